"""The async-input GEMM (``tk.AsyncInputScheduler``, ``tk.async_input_mm``).

Tiles are only reordered and gated, never computed differently, so every result must be bit-identical
to ``tk.gemm`` on the same inputs and config. A's rows of a chunk that has not arrived are NaN wherever
a test can arrange it: reading a row before its chunk's signal (a pivot mismatch, seed 000) shows.

CPU lane: the interpreter runs programs one after another, so a producer cannot run beside the GEMM:
signals are preset (a missing chunk times out after the interpreter's short default spin count).
GPU lane: a producer on a second stream copies A chunk by chunk with the copy engine (no SMs, which the
waiting GEMM occupies), in random order with random delays.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tilekernels as tk
from tilekernels.gemm.configs import GemmConfig, override_config
from tilekernels.testing import assert_close, poisoned, random_matrix, reference_gemm

gpu = pytest.mark.gpu
LAYOUTS = ("RR", "RC", "CR", "CC")
DTYPES = {"fp16": torch.float16, "fp32": torch.float32}

# The interpreter's GEMM config is 32x32x32: chunks of 32 rows are whole tiles, 24 and 40 straddle.
CHUNKINGS = {"whole": 32, "straddle24": 24, "straddle40": 40}
M, N, K = 96, 40, 48


def operands(layout, dtype, device, m=M, n=N, k=K):
    a = random_matrix(m, k, dtype, device, column_major=layout[0] == "C")
    b = random_matrix(k, n, dtype, device, column_major=layout[1] == "C")
    return a, b


def chunk_rows(chunk, rows_per_chunk, m):
    return slice(chunk * rows_per_chunk, min(m, (chunk + 1) * rows_per_chunk))


def num_chunks(rows_per_chunk, m=M):
    return -(-m // rows_per_chunk)


# ====================================================================================================
# CPU lane


@pytest.mark.parametrize("chunking", CHUNKINGS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_pivot_matches_gemm(layout, dtype, chunking, device):
    a, b = operands(layout, dtype, device)
    plain = tk.gemm(a, b)
    assert_close("plain", plain, reference_gemm(a, b), reference_gemm(a, b, compute_dtype=None))
    rows = CHUNKINGS[chunking]
    signals = torch.ones(num_chunks(rows), dtype=torch.int32, device=device)
    for pivot in range(signals.numel()):
        out = poisoned((M, N), dtype, device)
        tk.gemm(a, b, out=out, async_input=tk.AsyncInputScheduler(signals, rows, pivot_chunk=pivot))
        assert torch.equal(out, plain), f"pivot {pivot}: differs from tk.gemm"


def test_epochs_advance_without_zeroing(device):
    """Three calls, each after the producer raised every signal to the next epoch; then a call whose
    epoch the signals have not reached times out instead of reading stale rows."""
    a, b = operands("RR", torch.float32, device)
    plain = tk.gemm(a, b)
    signals = torch.zeros(3, dtype=torch.int32, device=device)
    for epoch in (1, 2, 3):
        signals.fill_(epoch)
        out = tk.async_input_mm(a, b, signals, chunk_pivot=epoch % 3, signal_value=epoch)
        assert torch.equal(out, plain), f"epoch {epoch}"
    with pytest.raises(TimeoutError, match=r"chunk\(s\) 0, 1, 2 "):
        tk.async_input_mm(a, b, signals, signal_value=4, max_spins=3)
    # the error was reported and cleared: the next good call runs
    assert torch.equal(tk.async_input_mm(a, b, signals, signal_value=3), plain)
    tk.raise_pending_errors()


# 16x16 tiles give every program several tiles, so a program meets chunks that arrived after one it
# gave up on (and that chunk again, where the wait must give up at once); with TMA the epilogue stores
# through a descriptor, and a skipped tile must still write nothing.
MISSING_CONFIGS = {"default": None,
                   "16x16-tma": GemmConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1, use_tma=True)}


@pytest.mark.parametrize("config", MISSING_CONFIGS, ids=str)
@pytest.mark.parametrize("chunking", CHUNKINGS, ids=str)
@pytest.mark.parametrize("layout", ["RR", "CC"])
def test_missing_chunk_times_out_and_the_rest_is_exact(layout, chunking, config, device):
    """Chunk `missing` is never signalled and its rows of A are NaN: TimeoutError names it, and every
    output row whose tile touches only arrived chunks is exact (a pivot mismatch would read NaN rows)."""
    rows = CHUNKINGS[chunking]
    config = MISSING_CONFIGS[config]
    a_full, b = operands(layout, torch.float32, device)
    plain = tk.gemm(a_full, b, config=config)
    chunks = num_chunks(rows)
    block_m = 32 if config is None else config.block_m
    for missing in range(chunks):
        for pivot in range(chunks):
            out, lost = _call_with_missing_chunk(a_full, b, rows, missing, pivot, device, config)
            # tiles are BLOCK_M rows: a tile touching the missing chunk is skipped whole
            tiles = [range(t, min(M, t + block_m)) for t in range(0, M, block_m)]
            _check_skipped_tiles(out, plain, lost, tiles, f"missing {missing}, pivot {pivot}")


def _call_with_missing_chunk(a_full, b, rows, missing, pivot, device, config=None):
    """tk.gemm with chunk ``missing`` never signalled and its rows of A NaN: TimeoutError names it. Returns the
    output (777 where nothing was written) and the lost rows."""
    a = a_full.clone() if a_full.stride(1) == 1 else a_full.t().clone().t()
    lost = chunk_rows(missing, rows, M)
    a[lost] = float("nan")
    signals = torch.ones(num_chunks(rows), dtype=torch.int32, device=device)
    signals[missing] = 0
    # not NaN: a skipped tile computed anyway from the NaN rows would also write NaN
    out = torch.full((M, N), 777.0, device=device)
    with pytest.raises(TimeoutError, match=rf"chunk\(s\) {missing} "):
        tk.gemm(a, b, out=out, config=config, async_input=tk.AsyncInputScheduler(signals, rows, pivot, max_spins=2))
    return out, lost


def _check_skipped_tiles(out, plain, lost, tiles, what):
    """Every tile (a range of rows) that touches the lost rows was skipped whole; every other row is exact."""
    skipped = torch.zeros(M, dtype=torch.bool)
    for tile in tiles:
        if any(lost.start <= r < lost.stop for r in tile):
            skipped[tile.start:tile.stop] = True
    kept = ~skipped.to(out.device)
    assert torch.equal(out[kept], plain[kept]), f"{what}: arrived rows differ"
    assert (out[~kept] == 777.0).all(), f"{what}: a skipped tile was written"


def test_async_input_mm_contract(device):
    """Equal chunks, uint32 signals, out=, the chunk_pivot argument and split-K."""
    a, b = operands("RC", torch.float16, device)
    plain = tk.gemm(a, b)
    signals = torch.full((4,), 7, dtype=torch.uint32, device=device)
    for pivot in range(4):
        assert torch.equal(tk.async_input_mm(a, b, signals, pivot, signal_value=7), plain)
    out = poisoned((M, N), torch.float16, device)
    result = tk.async_input_mm(a, b, signals, 2, signal_value=5, out=out)
    assert result is out and torch.equal(out, plain)
    split = tk.gemm(a, b, split_k=2)
    assert torch.equal(tk.gemm(a, b, split_k=2, async_input=tk.AsyncInputScheduler(signals, 24, 3, 7)), split)


def test_epilogue_and_config(device):
    """The epilogue reads the pivoted rows too (bias [M, N], residual), with several tiles per program."""
    a, b = operands("CR", torch.float32, device)
    bias = torch.randn(M, N, device=device)
    residual = torch.randn(M, N, device=device)
    config = GemmConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1)
    plain = tk.gemm(a, b, bias=bias, residual=residual, activation="silu", config=config)
    signals = torch.ones(6, dtype=torch.int32, device=device)
    for pivot in (0, 5):
        out = tk.gemm(a, b, bias=bias, residual=residual, activation="silu", config=config,
                      async_input=tk.AsyncInputScheduler(signals, 16, pivot))
        assert torch.equal(out, plain), f"pivot {pivot}"


LOCAL_CONFIGS = {"default": None,
                 "16x16-tma": GemmConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1, use_tma=True)}


@pytest.mark.parametrize("config", LOCAL_CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_pivot_rows_read_from_a_local(dtype, config, device):
    """tk.dist's own shard: the pivot chunk's rows come from ``a_local`` while A's copy of them is NaN,
    and the result is bit-identical to tk.gemm (pointer loads and TMA descriptors, every pivot; a missed
    signal of another chunk still times out and skips only that chunk's tiles)."""
    from tilekernels.gemm.gemm import _async_gemm_into, async_local_fits
    from tilekernels.gemm.scheduler import DEFAULT_MAX_SPINS_INTERPRETER

    config = LOCAL_CONFIGS[config]
    rows = 32
    a_full, b = operands("RR", dtype, device)
    plain = tk.gemm(a_full, b, config=config)
    chunks = num_chunks(rows)
    epoch = torch.ones(1, dtype=torch.int32, device=device)
    with override_config(config) if config is not None else contextlib.nullcontext():
        for pivot in range(chunks):
            own = chunk_rows(pivot, rows, M)
            a = a_full.clone()
            a[own] = float("nan")
            a_local = a_full[own].clone()
            assert async_local_fits(a, b, a_local, rows)
            signals = torch.ones(chunks, dtype=torch.int32, device=device)
            errors = torch.zeros(1 + chunks, dtype=torch.int32, device=device)
            out = poisoned((M, N), dtype, device)
            _async_gemm_into(a, b, out, signals, rows, pivot, epoch, DEFAULT_MAX_SPINS_INTERPRETER, errors,
                             a_local=a_local)
            assert torch.equal(out, plain), f"pivot {pivot}: differs from tk.gemm"
            assert not errors.any()
            # another chunk never arrives: its tiles are skipped, the local ones still computed
            late = (pivot + 1) % chunks
            signals[late] = 0
            out = torch.full((M, N), 777.0, dtype=dtype, device=device)
            _async_gemm_into(a, b, out, signals, rows, pivot, epoch, 2, errors, a_local=a_local)
            assert errors[0] == 1 and errors[1 + late] == 1 and errors[1:].sum() == 1
            lost = chunk_rows(late, rows, M)
            assert (out[lost] == 777.0).all()
            kept = torch.ones(M, dtype=torch.bool, device=device)
            kept[lost] = False
            assert torch.equal(out[kept], plain[kept]), f"pivot {pivot}: rows of arrived chunks differ"
    # what does not fit is refused: chunks that are not whole tiles, another stride, another shape
    a, b = operands("RR", dtype, device)
    assert not async_local_fits(a, b, a[:24].clone(), 24)
    assert not async_local_fits(a, b, torch.empty(rows, 2 * K, dtype=dtype, device=device)[:, :K], rows)
    assert not async_local_fits(a, b, a[:rows - 1].clone(), rows)


def _force_async_tail(monkeypatch, main: GemmConfig, tail: GemmConfig, rows: int):
    """Make every async-input plan made from here on ask for a row tail of ``M - rows`` rows (the interpreter's own
    plan never splits); returns the tail launches' row ranges as they happen."""
    from tilekernels.gemm import configs

    gemm_mod = importlib.import_module("tilekernels.gemm.gemm")

    real_plan = gemm_mod.select_plan

    def plan(M, N, K, dtype, device, heavy_epilogue=False, async_input=False):
        if not async_input:
            return real_plan(M, N, K, dtype, device, heavy_epilogue)
        return (main, configs.RowTail(rows, tail)) if M > rows else (main, None)

    monkeypatch.setattr(gemm_mod, "select_plan", plan)
    monkeypatch.setattr(gemm_mod, "_PLANS", {})
    spans = []
    real = gemm_mod._tail_call

    def record(*args):
        spans.append(tuple(args[1]))
        return real(*args)

    monkeypatch.setattr(gemm_mod, "_tail_call", record)
    return spans


@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("chunking", CHUNKINGS, ids=str)
def test_row_tail_is_the_last_pivoted_rows(chunking, tma, monkeypatch, device):
    """An async row tail (forced here): the main launch walks the pivoted row tiles but the last ``skip``, and a
    second launch in a smaller tile computes those rows, which are the ones just before the pivot tile (or A's
    last rows with pivot 0), waiting for their chunks as rows of A. Bit-identical to tk.gemm for every pivot and
    every chunking; where those rows would wrap around the end of A (a pivot tile inside the first ``skip``) it is
    one launch, as without a tail."""
    main = GemmConfig(32, 32, 32, 2, 4, 1, use_tma=tma)
    tail = GemmConfig(16, 32, 32, 2, 4, 1, use_tma=tma)
    rows = CHUNKINGS[chunking]
    for main_rows in (64, 32):   # skip 1 and 2 of the 3 row tiles
        spans = _force_async_tail(monkeypatch, main, tail, main_rows)
        skip = 3 - main_rows // 32
        for layout, dtype in (("RR", torch.float32), ("CC", torch.float16)):
            a, b = operands(layout, dtype, device)
            plain = tk.gemm(a, b, config=main)
            signals = torch.full((num_chunks(rows),), 5, dtype=torch.int32, device=device)
            for pivot in range(signals.numel()):
                spans.clear()
                out = poisoned((M, N), dtype, device)
                if rows * signals.numel() == M:   # equal chunks: the async_input_mm entry as well
                    tk.async_input_mm(a, b, signals, pivot, signal_value=5, out=out)
                else:
                    tk.gemm(a, b, out=out, async_input=tk.AsyncInputScheduler(signals, rows, pivot, 5))
                assert torch.equal(out, plain), f"pivot {pivot}, skip {skip}: differs from tk.gemm"
                pivot_tile = pivot * rows // 32
                if pivot_tile == 0:
                    assert spans == [(M - skip * 32, M)], (pivot, skip, spans)
                elif pivot_tile < skip:
                    assert spans == [], (pivot, skip, spans)
                else:
                    assert spans == [((pivot_tile - skip) * 32, pivot_tile * 32)], (pivot, skip, spans)
    # the main launch alone (the tail switched off) leaves exactly the tail's rows unwritten
    gemm_mod = importlib.import_module("tilekernels.gemm.gemm")
    monkeypatch.setattr(gemm_mod, "_tail_call", lambda *args: spans.append(tuple(args[1])))
    a, b = operands("RR", torch.float32, device)
    plain = tk.gemm(a, b, config=main)
    for pivot in range(num_chunks(rows)):
        spans.clear()
        out = poisoned((M, N), torch.float32, device)
        tk.gemm(a, b, out=out, async_input=tk.AsyncInputScheduler(torch.ones(num_chunks(rows), dtype=torch.int32,
                                                                              device=device), rows, pivot))
        left = torch.zeros(M, dtype=torch.bool, device=device)
        for lo, hi in spans:
            left[lo:hi] = True
        assert torch.equal(out[~left], plain[~left]) and out[left].isnan().all(), (pivot, spans)


def test_row_tail_epilogue_operands(monkeypatch, device):
    """An async row tail reads the tail's rows of every [M, N] epilogue operand (bias [M, N], residual, mul [M, 1],
    scale_a [M]) and the broadcast ones whole; a column-major out. Bit-identical to tk.gemm for every pivot."""
    main = GemmConfig(32, 32, 32, 2, 4, 1)
    spans = _force_async_tail(monkeypatch, main, GemmConfig(16, 32, 32, 2, 4, 1), 64)
    a, b = operands("CR", torch.float32, device)
    epilogue = dict(bias=torch.randn(M, N, device=device), residual=torch.randn(M, N, device=device), beta=0.5,
                    activation="silu", mul=[torch.randn(M, 1, device=device), torch.randn(1, N, device=device)],
                    scale_a=torch.rand(M, device=device) + 0.5)
    plain = tk.gemm(a, b, config=main, **epilogue)
    signals = torch.ones(4, dtype=torch.int32, device=device)
    for pivot in range(4):
        spans.clear()
        out = poisoned((N, M), torch.float32, device).t()
        tk.gemm(a, b, out=out, async_input=tk.AsyncInputScheduler(signals, 24, pivot), **epilogue)
        assert len(spans) == 1 and torch.equal(out, plain), (pivot, spans)


def test_row_tail_missing_chunk(monkeypatch, device):
    """A chunk that never arrives, with an async row tail: TimeoutError names it (after both launches), the tiles
    of either launch that touch it are skipped and the rest is exact; the tail's own tiles are 16 rows."""
    main = GemmConfig(32, 32, 32, 2, 4, 1)
    tail = GemmConfig(16, 32, 32, 2, 4, 1)
    spans = _force_async_tail(monkeypatch, main, tail, 64)
    rows = 24
    a_full, b = operands("RC", torch.float32, device)
    plain = tk.gemm(a_full, b, config=main)
    chunks = num_chunks(rows)
    for missing in range(chunks):
        for pivot in range(chunks):
            spans.clear()
            out, lost = _call_with_missing_chunk(a_full, b, rows, missing, pivot, device)
            assert len(spans) == 1
            lo, hi = spans[0]
            tiles = [range(t, min(M, t + 32)) for t in range(0, M, 32) if not lo <= t < hi]
            tiles += [range(t, min(hi, t + 16)) for t in range(lo, hi, 16)]
            _check_skipped_tiles(out, plain, lost, tiles, f"missing {missing}, pivot {pivot}")


@pytest.mark.parametrize("split_k", [1, 2])
def test_every_kernel_compiled_before_the_first_launch(split_k, monkeypatch, device):
    """With async input every kernel of the call (a row tail's, split-K's reduction) is compiled and loaded before
    the first launch: that launch's programs wait for chunks that the caller's producer may start only once the call
    has returned, and loading a kernel waits for the kernels running on the device (the GPU test below). Here the
    launches and ``prepare`` calls are recorded in order (``prepare`` itself compiles only on a GPU)."""
    from tilekernels import _runtime

    main = GemmConfig(32, 32, 32, 2, 4, 1)
    if split_k == 1:
        _force_async_tail(monkeypatch, main, GemmConfig(16, 32, 32, 2, 4, 1), 64)
    events = []
    real_call, real_prepare = _runtime.CachedLaunch.__call__, _runtime.CachedLaunch.prepare

    def call(self, args, dev):
        events.append(("launch", self))
        return real_call(self, args, dev)

    def prepare(self, args, dev):
        events.append(("prepare", self))
        return real_prepare(self, args, dev)

    monkeypatch.setattr(_runtime.CachedLaunch, "__call__", call)
    monkeypatch.setattr(_runtime.CachedLaunch, "prepare", prepare)
    a, b = operands("RR", torch.float32, device)
    plain = tk.gemm(a, b, config=main, split_k=split_k)
    signals = torch.ones(4, dtype=torch.int32, device=device)
    with override_config(main) if split_k > 1 else contextlib.nullcontext():
        for pivot in (0, 2):
            events.clear()
            out = tk.gemm(a, b, async_input=tk.AsyncInputScheduler(signals, 24, pivot), split_k=split_k)
            assert torch.equal(out, plain), pivot
            launches = [launch for kind, launch in events if kind == "launch"]
            prepared = [launch for kind, launch in events if kind == "prepare"]
            assert len(launches) == 2 and events[:1] == [("prepare", launches[1])], (pivot, events)
            assert prepared == [launches[1]], (pivot, events)


def test_row_tail_plan(monkeypatch):
    """configs.select_plan for the async kernel on a 132-SM Hopper: 4096x3584x8192 (issue 3's shape whose
    single launch leaves a part-full last wave) takes the large tile over 3584 rows and a tail, as tk.gemm does,
    and 16384x8192x8192 (31 waves and 4 tiles: the bar for long problems) its last 128 rows in 64x128 tiles; the
    other issue-3 shapes keep their single launch; gemm.py places the tail before the pivot tile."""
    from tilekernels.gemm import configs
    from tilekernels.gemm.gemm import _tail_span

    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    hopper = torch.device("cuda", 0)
    large = configs.TUNED_HOPPER_16BIT["large"]
    cfg, tail = configs.select_plan(4096, 3584, 8192, torch.bfloat16, hopper, async_input=True)
    assert cfg.block_m == large.block_m and cfg.block_n == large.block_n
    assert cfg.group_m == configs.ASYNC_LARGE_GROUP_M
    assert tail == configs.RowTail(3584, configs.TUNED_HOPPER_16BIT["medium"])
    assert configs.select_plan(16384, 8192, 8192, torch.bfloat16, hopper, async_input=True) == (
        cfg, configs.RowTail(16256, configs.TUNED_HOPPER_16BIT["skinny"]))
    assert configs.select_plan(16384, 8192, 8192, torch.bfloat16, hopper) == (
        large, configs.RowTail(16256, configs.TUNED_HOPPER_16BIT["skinny"]))
    for shape in ((8192, 3584), (16384, 3584), (4096, 8192), (8192, 8192)):
        assert configs.select_plan(*shape, 8192, torch.bfloat16, hopper, async_input=True) == (
            configs.select_config(*shape, 8192, torch.bfloat16, hopper, True), None), shape
    # two chunks of 2048 rows, the bench's pivot 1: the tail is rows [1536, 2048)
    assert _tail_span(4096, 128, 3584, 2048) == (4, (1536, 2048))
    assert _tail_span(4096, 128, 3584, 0) == (4, (3584, 4096))
    assert _tail_span(4096, 128, 3584, 256) == (4, None)
    assert _tail_span(4000, 128, 3584, 0) == (4, (3584, 4000))


def test_torch_compile(device):
    a, b = operands("RR", torch.float32, device)
    signals = torch.ones(3, dtype=torch.int32, device=device)
    compiled = torch.compile(lambda a, b, s: tk.async_input_mm(a, b, s, 1), fullgraph=True)
    assert torch.equal(compiled(a, b, signals), tk.gemm(a, b))


def _bad_cases():
    def sig(n=3, dtype=torch.int32, device="cpu"):
        return torch.ones(n, dtype=dtype, device=device)

    S = tk.AsyncInputScheduler
    return [
        pytest.param(lambda a, b, d: S(sig(device=d), 0), ValueError, "rows_per_chunk", id="rows0"),
        pytest.param(lambda a, b, d: S(sig(dtype=torch.float32, device=d), 32), TypeError, "chunk_signals",
                     id="float-signals"),
        pytest.param(lambda a, b, d: S(sig(dtype=torch.int64, device=d), 32), TypeError, "chunk_signals",
                     id="int64-signals"),
        pytest.param(lambda a, b, d: S(torch.ones(3, 1, dtype=torch.int32, device=d), 32), ValueError,
                     "chunk_signals", id="2d-signals"),
        pytest.param(lambda a, b, d: S(sig(device=d), 32, pivot_chunk=3), ValueError, "pivot_chunk",
                     id="pivot-past"),
        pytest.param(lambda a, b, d: S(sig(device=d), 32, pivot_chunk=-1), ValueError, "pivot_chunk",
                     id="pivot-negative"),
        pytest.param(lambda a, b, d: S(sig(device=d), 32, signal_value=2**31), ValueError, "signal_value",
                     id="epoch-past-int32"),
        pytest.param(lambda a, b, d: S(sig(device=d), 32, max_spins=0), ValueError, "max_spins", id="spins0"),
        pytest.param(lambda a, b, d: tk.gemm(a, b, async_input=S(sig(device=d), 20)), ValueError, "chunk_signals",
                     id="chunk-count"),
        pytest.param(lambda a, b, d: tk.gemm(a, b, async_input=S(sig(device="meta"), 32)), ValueError,
                     "chunk_signals", id="signals-device"),
        pytest.param(lambda a, b, d: tk.gemm(a, b, async_input=sig(device=d)), TypeError, "async_input",
                     id="not-a-scheduler"),
        pytest.param(lambda a, b, d: tk.async_input_mm(a, b, sig(5, device=d)), ValueError, "chunk_signals",
                     id="m-not-divisible"),
        pytest.param(lambda a, b, d: tk.async_input_mm(a, b, sig(device=d), 3), ValueError, "pivot_chunk",
                     id="mm-pivot"),
        pytest.param(lambda a, b, d: tk.async_input_mm(a, b, [1, 1, 1]), TypeError, "chunk_signals",
                     id="signals-list"),
        # no rows: nothing waits, but the signals are still checked
        pytest.param(lambda a, b, d: tk.async_input_mm(a[:0], b, sig(dtype=torch.float32, device=d)), TypeError,
                     "chunk_signals", id="m0-float-signals"),
        pytest.param(lambda a, b, d: tk.async_input_mm(a[:0], b, sig(device=d), 3), ValueError, "pivot_chunk",
                     id="m0-pivot"),
    ]


@pytest.mark.parametrize("build, error, match", _bad_cases())
def test_bad_input(build, error, match, device):
    a, b = operands("RR", torch.float32, device)
    with pytest.raises(error, match=rf"\b{match}\b"):
        build(a, b, device.type if device.type == "cpu" else str(device))


# ====================================================================================================
# GPU lane


class ChunkProducer:
    """Writes A chunk by chunk on its own stream, in a random order with random host-side delays:
    each chunk is a copy-engine copy from pinned host memory, then its signal is raised to the epoch by
    a second copy-engine copy (ordered after the first on the stream). Nothing here needs an SM, which
    the waiting GEMM's persistent programs occupy."""

    def __init__(self, host_a: torch.Tensor, rows_per_chunk: int, signals: torch.Tensor, seed: int):
        self.host_a, self.rows, self.signals = host_a, rows_per_chunk, signals
        self.stream = torch.cuda.Stream()
        self.rng = random.Random(seed)
        self.keep = []  # pinned epoch words, alive until the copies that read them have run

    def produce(self, a: torch.Tensor, epoch: int, max_delay_s: float = 200e-6, skip: int = -1) -> None:
        order = [c for c in range(self.signals.numel()) if c != skip]
        self.rng.shuffle(order)
        word = torch.full((1,), epoch, dtype=self.signals.dtype, pin_memory=True)
        self.keep.append(word)
        with torch.cuda.stream(self.stream):
            for chunk in order:
                time.sleep(self.rng.uniform(0, max_delay_s))
                rows = chunk_rows(chunk, self.rows, a.shape[0])
                a[rows].copy_(self.host_a[rows], non_blocking=True)
                self.signals[chunk:chunk + 1].copy_(word, non_blocking=True)


@gpu
@pytest.mark.parametrize("m, n, chunks", [(2048, 1024, 8), (2000, 1024, 8), (4096, 4096, 4)],
                         ids=["whole-tiles", "straddling", "large-tile"])
def test_gpu_producer_on_second_stream(m, n, chunks, device):
    """100 calls, epochs 1..100 (signals never zeroed), the producer racing the GEMM: bit-exact with
    tk.gemm on the whole A every time. "large-tile" takes the large config, where the async kernel's
    row-tile group differs from tk.gemm's (``configs.ASYNC_LARGE_GROUP_M``)."""
    _race_a_producer(m, n, 1024, chunks, 100, m, 200e-6, device)


def _race_a_producer(m, n, k, chunks, epochs, seed, max_delay_s, device):
    """``epochs`` calls of tk.async_input_mm (epochs 1.., signals never zeroed, the pivot moving) while a producer on
    a second stream copies A's chunks in random order with random delays: bit-exact with tk.gemm on the whole A."""
    host_a = torch.randn(m, k, dtype=torch.bfloat16).pin_memory()
    b = random_matrix(k, n, torch.bfloat16, device, column_major=True)
    expected = tk.gemm(host_a.to(device), b)
    signals = torch.zeros(chunks, dtype=torch.int32, device=device)
    producer = ChunkProducer(host_a, m // chunks, signals, seed=seed)
    a = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    for epoch in range(1, epochs + 1):
        a.fill_(float("nan"))
        producer.stream.wait_stream(torch.cuda.current_stream())
        out = tk.async_input_mm(a, b, signals, chunk_pivot=epoch % chunks, signal_value=epoch)
        producer.produce(a, epoch, max_delay_s=max_delay_s)
        torch.cuda.current_stream().wait_stream(producer.stream)
        torch.cuda.synchronize()
        tk.raise_pending_errors()
        assert torch.equal(out, expected), f"epoch {epoch}: differs from tk.gemm"


@gpu
@pytest.mark.parametrize("m, n", [(4096, 1024), (8192, 3584)], ids=["medium", "large"])
def test_gpu_pivot_rows_from_a_local(m, n, device):
    """tk.dist's copy_engine GEMM: the pivot chunk's rows come from a tensor of their own (the rank's
    shard) while A's copy of them stays NaN and the other chunks arrive from a producer: bit-exact with
    tk.gemm on the whole A, 20 calls, the pivot moving."""
    from tilekernels.gemm.gemm import _async_gemm_into, async_local_fits

    k, chunks = 2048, 4
    rows = m // chunks
    host_a = torch.randn(m, k, dtype=torch.bfloat16).pin_memory()
    b = random_matrix(k, n, torch.bfloat16, device)
    expected = tk.gemm(host_a.to(device), b)
    signals = torch.zeros(chunks, dtype=torch.int32, device=device)
    errors = torch.zeros(1 + chunks, dtype=torch.int32, device=device)
    producer = ChunkProducer(host_a, rows, signals, seed=n)
    a = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    for epoch in range(1, 21):
        pivot = epoch % chunks
        a_local = host_a[chunk_rows(pivot, rows, m)].to(device)
        assert async_local_fits(a, b, a_local, rows)
        a.fill_(float("nan"))
        signals[pivot] = epoch  # the local chunk: set by tk.dist's begin
        producer.stream.wait_stream(torch.cuda.current_stream())
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        _async_gemm_into(a, b, out, signals, rows, pivot, torch.full((1,), epoch, dtype=torch.int32, device=device),
                         1 << 22, errors, a_local=a_local)
        producer.produce(a, epoch, skip=pivot)
        torch.cuda.current_stream().wait_stream(producer.stream)
        torch.cuda.synchronize()
        assert not errors.any(), f"epoch {epoch}: a wait gave up"
        assert torch.equal(out, expected), f"epoch {epoch}: differs from tk.gemm"


@gpu
@pytest.mark.parametrize("chunks", [2, 8])
def test_gpu_row_tail_with_producer(chunks, device):
    """Issue 3's 4096x3584x8192, where the async kernel's plan (configs.select_plan) puts the last pivoted rows in
    a second launch of 128x128 tiles: the producer races both launches, 30 calls, the pivot moving; bit-exact with
    tk.gemm (whose own plan has the same configs) every time."""
    from tilekernels.gemm import configs

    m, n, k = 4096, 3584, 8192
    if configs.select_plan(m, n, k, torch.bfloat16, device, async_input=True)[1] is None:
        pytest.skip(f"no async row tail at {m}x{n}x{k} on {configs.sm_count(device)} SMs")
    gemm_mod = importlib.import_module("tilekernels.gemm.gemm")
    _race_a_producer(m, n, k, chunks, 30, chunks, 0.002, device)
    assert any(p.tail_span is not None for p in gemm_mod._PLANS.values())


_FIRST_CALL = """
import torch
import tilekernels as tk
m, n, k, chunks = 4096, 3584, 8192, 2
device = torch.device("cuda", 0)
host_a = torch.randn(m, k, dtype=torch.bfloat16).pin_memory()
b = torch.randn(n, k, dtype=torch.bfloat16, device=device).t()
a = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device=device)
signals = torch.zeros(chunks, dtype=torch.int32, device=device)
word = torch.ones(1, dtype=torch.int32).pin_memory()
producer = torch.cuda.Stream()
producer.wait_stream(torch.cuda.current_stream())
out = tk.async_input_mm(a, b, signals, chunk_pivot=1, max_spins=1 << 20)
with torch.cuda.stream(producer):   # started only once the call has returned, as in examples/async_input_gemm.py
    for c in (1, 0):
        a[c * (m // chunks):(c + 1) * (m // chunks)].copy_(host_a[c * (m // chunks):(c + 1) * (m // chunks)],
                                                           non_blocking=True)
        signals[c:c + 1].copy_(word, non_blocking=True)
torch.cuda.synchronize()
tk.raise_pending_errors()
assert torch.equal(out, tk.gemm(host_a.to(device), b)), "differs from tk.gemm"
print("ok")
"""


@gpu
def test_gpu_row_tail_first_call_in_a_fresh_process(device):
    """The first async call of a process, with a row tail, its producer started only once the call has returned (as
    in the example): every kernel of the call is loaded before the main launch starts waiting (``gemm._launch``).
    A kernel's first launch in a process loads its module, which waits for the kernels running on the device, so a
    tail loaded after the main launch held the host until the main launch's waits gave up (H100, 2026-11-25: 8.6 s,
    then TimeoutError for chunks 0 and 1). A fresh process, so that nothing has loaded the tail's kernel yet; the
    waits give up after 2^20 polls (about a second)."""
    from tilekernels.gemm import configs

    if configs.select_plan(4096, 3584, 8192, torch.bfloat16, device, async_input=True)[1] is None:
        pytest.skip(f"no async row tail at 4096x3584x8192 on {configs.sm_count(device)} SMs")
    src = str(Path(tk.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


@gpu
def test_gpu_producer_in_cuda_graph(device):
    """The consumer and the producer's copies captured in one graph; each replay gets new data."""
    m, n, k, chunks = 2048, 1024, 1024, 4
    host_a = torch.randn(m, k, dtype=torch.bfloat16).pin_memory()
    b = random_matrix(k, n, torch.bfloat16, device, column_major=True)
    signals = torch.zeros(chunks, dtype=torch.int32, device=device)
    producer = ChunkProducer(host_a, m // chunks, signals, seed=1)
    a = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        signals.fill_(1)
        tk.async_input_mm(a, b, signals, chunk_pivot=1, signal_value=1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        producer.stream.wait_stream(torch.cuda.current_stream())
        out = tk.async_input_mm(a, b, signals, chunk_pivot=1, signal_value=1)
        producer.produce(a, 1, max_delay_s=0)
        torch.cuda.current_stream().wait_stream(producer.stream)
    for rep in range(5):
        host_a.copy_(torch.randn(m, k, dtype=torch.bfloat16))
        signals.zero_()
        a.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        tk.raise_pending_errors()
        assert torch.equal(out, tk.gemm(host_a.to(device), b)), f"replay {rep}"


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn],
                         ids=["bf16", "fp16", "fp32", "fp8e4m3"])
def test_gpu_preset_signals_every_layout_and_dtype(layout, dtype, device):
    m, n, k = 1000, 768, 512
    a = random_matrix(m, k, torch.float32, device, column_major=layout[0] == "C").to(dtype)
    b = random_matrix(k, n, torch.float32, device, column_major=layout[1] == "C").to(dtype)
    plain = tk.gemm(a, b)
    signals = torch.full((8,), 3, dtype=torch.int32, device=device)
    for pivot in (0, 3, 7):
        assert torch.equal(tk.async_input_mm(a, b, signals, pivot, signal_value=3), plain), f"pivot {pivot}"
    signals = torch.full((5,), 3, dtype=torch.int32, device=device)  # chunks of 200 rows straddle tiles
    assert torch.equal(tk.gemm(a, b, async_input=tk.AsyncInputScheduler(signals, 200, 4, 3)), plain)


@gpu
def test_gpu_missing_chunk_times_out(device):
    """A never-signalled chunk: the kernel ends (no hang), tk.raise_pending_errors() names the chunk,
    the other chunks' rows are exact, and the next call runs normally."""
    m, n, k, chunks = 2048, 1024, 512, 4
    a, b = random_matrix(m, k, torch.bfloat16, device), random_matrix(k, n, torch.bfloat16, device)
    plain = tk.gemm(a, b)
    signals = torch.ones(chunks, dtype=torch.int32, device=device)
    signals[2] = 0
    out = poisoned((m, n), torch.bfloat16, device)
    start = time.perf_counter()
    tk.async_input_mm(a, b, signals, chunk_pivot=1, max_spins=1000, out=out)
    torch.cuda.synchronize()
    assert time.perf_counter() - start < 30, "the bounded wait took too long"
    with pytest.raises(TimeoutError, match=r"chunk\(s\) 2 "):
        tk.raise_pending_errors()
    rows = m // chunks
    kept = torch.ones(m, dtype=torch.bool, device=device)
    kept[2 * rows:3 * rows] = False
    assert torch.equal(out[kept], plain[kept])
    signals[2] = 1
    assert torch.equal(tk.async_input_mm(a, b, signals, chunk_pivot=1), plain)
    tk.raise_pending_errors()
