"""``all_gather_matmul``'s fetch algorithm (``tilekernels.dist._fetch``) on simulated ranks.

CPU lane: ``Workspace._simulated`` gives per-rank workspaces in one process that see each other's
buffers. The interpreter runs one launch at a time, so the ranks move in lockstep: every rank
publishes (begin, own shard into its data area, READY to every peer), then every rank computes (the
fused launches, end). Inside a launch the fetchers have the lowest program ids and run first.
Shapes are odd on purpose: m is not a multiple of BLOCK_M (16 here), K not a multiple of BLOCK_K nor
of the k-group (2 x 16), N not a multiple of BLOCK_N. Outputs and the returned A start as NaN.
GPU lane: ``test_gpu_simulated_on_one_gpu`` (ranks simulated on one GPU, waits at the GPU's bound); two
processes over NVLink: ``all_gather_matmul``'s multigpu tests.
"""

from __future__ import annotations

import pytest
import torch

from tilekernels.dist._fetch import (
    FetchConfig,
    _flag_groups,
    fetch_all_gather_matmul,
    fetch_compute,
    fetch_publish,
)
from tilekernels.dist.workspace import EPOCH, FETCH, Workspace
from tilekernels.testing import assert_close, poisoned, random_matrix, reference_gemm

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
M_SHARD, K, NS = 20, 40, (24, 8)
SPINS = 4


def make_call(world, dtype, device, m=M_SHARD, k=K, ns=NS):
    shards = [random_matrix(m, k, dtype, device) for _ in range(world)]
    bs = [random_matrix(k, n, dtype, device, column_major=i == 1) for i, n in enumerate(ns)]
    return shards, bs


def filled(shape, dtype, device, fill):
    return poisoned(shape, dtype, device) if fill is None else torch.full(shape, fill, dtype=dtype, device=device)


def a_out_buffer(kind, rows, k, dtype, device, fill):
    if kind is None:
        return None
    if kind == "col":
        return filled((k, rows), dtype, device, fill).t()
    return filled((rows, k), dtype, device, fill)


def run_call(spaces, shards, bs, *, layout="k", a_out="row", skip=(), config=None, fill=None):
    """One call on every rank not in ``skip``, in lockstep; returns per rank (outs, a_out, error).
    Outputs start as NaN, or as ``fill``."""
    world = len(spaces)
    m, k = shards[0].shape
    live = [r for r in range(world) if r not in skip]
    for r in live:
        fetch_publish(spaces[r], shards[r])
    results = {}
    for r in live:
        outs = [filled((world * m, b.shape[1]), b.dtype, b.device, fill) for b in bs]
        gathered = a_out_buffer(a_out, world * m, k, shards[r].dtype, shards[r].device, fill)
        error = None
        try:
            fetch_compute(spaces[r], shards[r], bs, outs, gathered, layout=layout, config=config)
        except TimeoutError as e:
            error = e
        results[r] = (outs, gathered, error)
    return results


def check_rank(rank, shards, bs, outs, gathered, *, rows_of=None):
    """Every output (and the returned A) against the fp64 reference, on the rows of ``rows_of`` ranks."""
    m = shards[0].shape[0]
    full = torch.cat(shards)
    sources = range(len(shards)) if rows_of is None else rows_of
    rows = torch.cat([torch.arange(s * m, (s + 1) * m) for s in sources])
    for i, (b, out) in enumerate(zip(bs, outs)):
        assert_close(f"rank {rank} out {i}", out[rows], reference_gemm(full, b)[rows],
                     reference_gemm(full, b, compute_dtype=None)[rows])
    if gathered is not None:
        assert torch.equal(gathered[rows], full[rows]), f"rank {rank}: gathered A differs"


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("layout", ["k", "m"])
@pytest.mark.parametrize("world", [2, 3])
def test_matches_reference(world, layout, dtype, device):
    spaces = Workspace._simulated(world, 1 << 16, device=device, max_spins=SPINS)
    shards, bs = make_call(world, DTYPES[dtype], device)
    results = run_call(spaces, shards, bs, layout=layout)
    for rank, (outs, gathered, error) in results.items():
        assert error is None, f"rank {rank}: {error}"
        check_rank(rank, shards, bs, outs, gathered)


@pytest.mark.parametrize("a_out", ["row", "col", None], ids=["a_out-row", "a_out-col", "no-a_out"])
@pytest.mark.parametrize("layout", ["k", "m"])
def test_staging_and_returned_a(layout, a_out, device):
    """Staging is a_out itself when a_out's strides are the layout's, else a temporary (and a_out,
    when given, is written beside it); bf16, a shard shorter than one tile, one fetcher, one k-block
    per flag, fetch steps wider than a k-group."""
    world = 2
    spaces = Workspace._simulated(world, 1 << 16, device=device, max_spins=SPINS)
    shards, bs = make_call(world, torch.bfloat16, device, m=5, k=36, ns=(17,))
    config = FetchConfig(16, 16, 16, 2, 1, fetch_block_k=32, num_fetchers=1, num_warps=4, num_stages=1)
    results = run_call(spaces, shards, bs, layout=layout, a_out=a_out, config=config)
    for rank, (outs, gathered, error) in results.items():
        assert error is None, f"rank {rank}: {error}"
        check_rank(rank, shards, bs, outs, gathered)


def test_three_calls_without_zeroing(device):
    """Epochs advance on the device; new inputs every call, so a tile read from the previous call's
    staging or data area would show. Staging flags are never cleared: they hold the last epoch."""
    world = 3
    spaces = Workspace._simulated(world, 1 << 16, device=device, max_spins=SPINS)
    for call in (1, 2, 3):
        shards, bs = make_call(world, torch.float32, device)
        results = run_call(spaces, shards, bs, layout="m" if call == 2 else "k")
        for rank, (outs, gathered, error) in results.items():
            assert error is None, f"call {call} rank {rank}: {error}"
            check_rank(rank, shards, bs, outs, gathered)
        for ws in spaces:
            assert int(ws.flags[EPOCH]) == call
            # rank r's staging flags of the peers' tiles: 2 m-tiles x 2 k-groups per peer
            words = [FETCH + (src * 2 + t) * 2 + g for src in range(world) if src != ws.rank
                     for t in range(2) for g in range(2)]
            assert ws.flags[words].tolist() == [call] * len(words), f"call {call} rank {ws.rank}"


def test_rank_that_never_publishes_times_out(device):
    """After a good call, rank 1 never publishes: ranks 0 and 2 raise TimeoutError naming it, after
    computing every tile of their own and each other's rows; rank 1's rows stay unwritten (in both
    outputs and A) although its READY and staging flags and data area still hold the first call's.
    The outputs start at a finite sentinel: a tile computed from unfetched (NaN) staging would show."""
    world = 3
    spaces = Workspace._simulated(world, 1 << 16, device=device, max_spins=SPINS)
    shards, bs = make_call(world, torch.float16, device)
    assert all(error is None for _, _, error in run_call(spaces, shards, bs).values())
    shards, bs = make_call(world, torch.float16, device)
    sentinel = 4096.0
    results = run_call(spaces, shards, bs, skip=(1,), fill=sentinel)
    m = shards[0].shape[0]
    for rank, (outs, gathered, error) in results.items():
        assert isinstance(error, TimeoutError), f"rank {rank} did not time out"
        assert f"tk.dist on rank {rank}" in str(error) and "rank 1 never published its shard" in str(error)
        # The GEMM saw the fetch give up and skipped without a second wait of its own.
        assert "FETCH flag" not in str(error), str(error)
        check_rank(rank, shards, bs, outs, gathered, rows_of=[0, 2])
        for tensor in (*outs, gathered):
            assert (tensor[m:2 * m] == sentinel).all(), f"rank {rank}: rows of rank 1 were written"


def test_one_call_entry_point(device):
    """``fetch_all_gather_matmul`` is publish + compute; with one rank nothing is fetched."""
    ws, = Workspace._simulated(1, 1 << 16, device=device, max_spins=SPINS)
    shards, bs = make_call(1, torch.float32, device)
    outs = [poisoned((M_SHARD, b.shape[1]), b.dtype, device) for b in bs]
    fetch_all_gather_matmul(ws, shards[0], bs, outs, None, layout="m")
    check_rank(0, shards, bs, outs, None)


def test_argument_errors(device):
    ws, _ = Workspace._simulated(2, 1 << 12, device=device, max_spins=SPINS)
    a = random_matrix(8, 16, torch.float32, device)
    b = random_matrix(16, 4, torch.float32, device)
    out = poisoned((16, 4), torch.float32, device)
    with pytest.raises(ValueError, match="layout"):
        fetch_compute(ws, a, [b], [out], None, layout="n")
    with pytest.raises(ValueError, match=r"outs\[0\] must be \[world\*m, N\]"):
        fetch_compute(ws, a, [b], [poisoned((8, 4), torch.float32, device)], None)
    with pytest.raises(TypeError, match=r"bs\[0\] has dtype"):
        fetch_compute(ws, a, [b.half()], [out], None)
    with pytest.raises(ValueError, match=r"outs\[0\]"):
        fetch_all_gather_matmul(ws, a, [b], [poisoned((8, 4), torch.float32, device)], None)
    assert int(ws.flags[EPOCH]) == 0, "a call with bad arguments began the protocol"
    with pytest.raises(ValueError, match="a_shard must be contiguous"):
        fetch_publish(ws, random_matrix(8, 16, torch.float32, device, column_major=True))
    with pytest.raises(ValueError, match="capacity_bytes >= "):
        fetch_publish(ws, random_matrix(64, 64, torch.float32, device))


def test_flag_groups_fit_the_workspace():
    """Too many (m-tile, k-group) flags for the FETCH words: k-groups widen until they fit."""
    cfg = FetchConfig(block_m=16, block_k=16, k_blocks_per_flag=1)
    assert _flag_groups(cfg, 2, 16 * 1000, 16 * 100) == 4  # 2000 m-tiles x 25 k-groups
    assert _flag_groups(cfg, 2, 20, 40) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("layout, dtype", [("k", "bf16"), ("m", "fp16"), ("k", "fp32")])
def test_gpu_simulated_on_one_gpu(layout, dtype):
    """Three ranks simulated on one GPU with the GPU's wait bound: a launch's fetchers and GEMM programs run
    at once, so the GEMM programs really wait for their staged tiles (the interpreter's lockstep never
    does). Three calls with new inputs, edges in every dimension, outputs poisoned, no wait gave up. Covers
    the fetch kernel's waits on a GPU where no second GPU is."""
    world, device = 3, torch.device("cuda")
    spaces = Workspace._simulated(world, 1 << 22, device=device)
    for call in range(3):
        shards, bs = make_call(world, DTYPES[dtype], device, m=300, k=520, ns=(384, 72))
        results = run_call(spaces, shards, bs, layout=layout)
        torch.cuda.synchronize()
        for ws in spaces:
            ws.check()  # raises TimeoutError if a wait gave up (GPU waits report here, not in the call)
        for rank, (outs, gathered, error) in results.items():
            assert error is None, f"call {call} rank {rank}: {error}"
            check_rank(rank, shards, bs, outs, gathered)
        assert [int(ws.flags[EPOCH]) for ws in spaces] == [call + 1] * world
