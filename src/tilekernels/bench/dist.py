"""Benchmarks of ``tk.dist.all_gather_matmul`` and ``tk.dist.matmul_reduce_scatter``, one process per GPU.

Run under torchrun (one rank per GPU; NCCL, NVLink multicast off)::

    torchrun --nproc-per-node 2 -m tilekernels bench all_gather_matmul --out DIR
    torchrun --nproc-per-node 2 -m tilekernels bench matmul_reduce_scatter --out DIR

Shapes are ``MxN`` (K = 8192) or ``MxNxK``, the global GEMM before sharding (ANCHORS.md, "Two H200"):
all-gather: A ``[M, K]`` sharded on M (each rank holds ``[M/world, K]``), B ``[K, N]`` per rank;
reduce-scatter: A ``[M, K/world]``, B ``[K/world, N]`` per rank, output ``[M/world, N]``.

Providers per shape:

- ``tk.<algorithm>``: the tk.dist op with ``algorithm=`` nccl, pipelined, copy_engine, fetch, auto
  (``--algorithms``; on the CPU nccl and pipelined, the ones that run without symmetric memory).
- ``torch.fused``: ``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``.
- ``torch.native`` (all-gather): ``_fused_all_gather_matmul_native`` (copy engine + ``_async_input_mm``).
- ``nccl+cublas``, the baseline: the unfused collective and ``torch.matmul`` one after the other.
- ``comm`` and ``matmul``: the collective alone and the local matmul alone. ``max(comm, matmul)`` is
  the overlap limit, the time of perfect overlap; tables give every provider's speedup over the
  baseline and the fraction of that limit it reaches (``limit / ms``; 1.00 = perfect overlap).

How a time is taken (every rank runs the same steps in the same order, so the collectives pair up):

1. Inputs are random (never zeros), different per rank, rotated through sets holding >= 2x L2.
2. Each provider's first call is checked before it is timed: its output (and gathered A) against the
   NCCL+torch result on sampled rows and columns, under ``testing.compare``'s error-ratio rule with an
   fp64 reference (the reduce-scatter reference gathers the sampled rows of every rank's operands).
   Every rank's verdict is combined (all-reduce MAX of the status): a provider that raises or is
   wrong on any rank is reported as ``failed``/``wrong`` on all of them and not timed.
3. Each repetition: ``dist.barrier()`` (hosts in step, GPUs idle), a GPU sleep of ``--sleep-us`` so the
   host can enqueue ahead, a one-element all-reduce (the GPUs leave it together), then CUDA events
   around one call. A repetition's time is the MAX over ranks (all-reduce MAX); rows give p20/p50/p80
   over repetitions of that maximum. Warmup and repetition counts come from ``--warmup``/``--rep``
   (ms budgets) divided by an estimate that every rank agrees on.
4. A provider that raises while being timed keeps taking part in the barriers, so the ranks stay in
   step; a provider that dies inside its own collective on one rank only can still hang the others
   (``--timeout-s`` bounds that through the process group's timeout).

Rank 0 prints the tables and writes ``<op>.json`` (long-format rows: op, provider, shape, metric "ms",
p20/p50/p80, gpu, world, versions, date, status), ``<op>.txt`` and ``<op>.png`` under ``--out``, and
appends the rows to ``benchmarks/results/<gpu>/<op>.json`` (on a GPU, or with ``--results-dir``).
``--trace`` (all-gather) runs one traced call per tk algorithm and shape and renders each merged
trace to PNG. ``--update-auto-table RUN.json`` writes a run's tk timings into ``dist/auto_table.json``
(times nothing). On the CPU the same path runs with gloo under the interpreter, for tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import math
import os
import pathlib
import time
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..testing import compare
from . import harness
from .harness import (
    INTERPRETER_WARNING,
    Accuracy,
    Run,
    UsageError,
    append_rows,
    default_results_dir,
    device_random,
    dtype_name,
    exception_text,
    format_table,
    format_value,
    geomean,
    l2_bytes,
    read_rows,
    rotation_count,
    write_rows,
)

ALL_GATHER = "all_gather_matmul"
REDUCE_SCATTER = "matmul_reduce_scatter"
ALGORITHMS = ("nccl", "pipelined", "copy_engine", "fetch", "auto")
CPU_ALGORITHMS = ("nccl", "pipelined")
TK_PREFIX = "tk."
TORCH_FUSED = "torch.fused"
TORCH_NATIVE = "torch.native"
BASELINE = "nccl+cublas"
COMM = "comm"
MATMUL = "matmul"
# Providers that are measured for the limit, not compared as alternatives.
REFERENCE_ONLY = (COMM, MATMUL)

DEFAULT_K = 8192
GPU_SHAPES = ["4096x3584", "8192x3584", "16384x3584", "8192x14336", "4096x8192", "512x3584", "1024x3584",
              "2048x3584"]
# Under the interpreter: several tiles, divisible by the world sizes tests use (2) and their chunks.
CPU_SHAPES = ["64x48x80"]
NVLINK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

DEFAULT_WARMUP_MS = 50.0
DEFAULT_REP_MS = 200.0
ESTIMATE_CALLS = 3
MIN_REPS_GPU, MIN_REPS_CPU = 10, 3
MAX_REPS = 300
MAX_WARMUP = 100
# torch.cuda._sleep counts clock cycles; 2 per ns is an H100/H200 boost clock, near enough.
CYCLES_PER_US = 2000
SAMPLE_EDGE = 16
SAMPLE_RANDOM = 64

# ANCHORS.md (2026-11-22, torch 2.11, two/four H200 over NVLink, bf16), ms, keyed by (M, N) at K = 8192.
ANCHORS = {
    (ALL_GATHER, 2): {
        (4096, 3584): {COMM: 0.175, MATMUL: 0.337, BASELINE: 0.495, TORCH_FUSED: 0.526, TORCH_NATIVE: 0.537},
        (8192, 3584): {COMM: 0.308, MATMUL: 0.616, BASELINE: 0.934, TORCH_FUSED: 0.900, TORCH_NATIVE: 0.869},
        (16384, 3584): {COMM: 0.571, MATMUL: 1.233, BASELINE: 1.818, TORCH_FUSED: 1.483, TORCH_NATIVE: 1.778},
        (8192, 14336): {COMM: 0.315, MATMUL: 2.654, BASELINE: 3.014, TORCH_FUSED: 2.910, TORCH_NATIVE: 2.921},
        (4096, 8192): {COMM: 0.184, MATMUL: 0.774, BASELINE: 0.924, TORCH_FUSED: 0.948, TORCH_NATIVE: 0.873},
    },
    (REDUCE_SCATTER, 2): {
        (4096, 3584): {COMM: 0.099, MATMUL: 0.185, BASELINE: 0.270, TORCH_FUSED: 0.354},
        (8192, 3584): {COMM: 0.169, MATMUL: 0.328, BASELINE: 0.487, TORCH_FUSED: 0.573},
        (16384, 3584): {COMM: 0.300, MATMUL: 0.680, BASELINE: 0.998, TORCH_FUSED: 0.883},
        (8192, 14336): {COMM: 0.550, MATMUL: 1.255, BASELINE: 1.932, TORCH_FUSED: 1.717},
        (4096, 8192): {COMM: 0.190, MATMUL: 0.405, BASELINE: 0.589, TORCH_FUSED: 0.563},
    },
    (ALL_GATHER, 4): {
        (4096, 3584): {COMM: 0.205, MATMUL: 0.357, BASELINE: 0.530, TORCH_FUSED: 0.568, TORCH_NATIVE: 0.596},
        (8192, 3584): {COMM: 0.364, MATMUL: 0.633, BASELINE: 0.977, TORCH_FUSED: 0.971, TORCH_NATIVE: 0.881},
        (16384, 3584): {COMM: 0.684, MATMUL: 1.250, BASELINE: 1.948, TORCH_FUSED: 1.637, TORCH_NATIVE: 1.744},
        (8192, 14336): {COMM: 0.365, MATMUL: 2.749, BASELINE: 3.164, TORCH_FUSED: 3.090, TORCH_NATIVE: 2.949},
        (4096, 8192): {COMM: 0.205, MATMUL: 0.723, BASELINE: 0.949, TORCH_FUSED: 0.970, TORCH_NATIVE: 0.923},
    },
    (REDUCE_SCATTER, 4): {
        (4096, 3584): {COMM: 0.111, MATMUL: 0.109, BASELINE: 0.208, TORCH_FUSED: 0.345},
        (8192, 3584): {COMM: 0.189, MATMUL: 0.183, BASELINE: 0.360, TORCH_FUSED: 0.438},
        (16384, 3584): {COMM: 0.340, MATMUL: 0.355, BASELINE: 0.686, TORCH_FUSED: 0.664},
        (8192, 14336): {COMM: 0.615, MATMUL: 0.661, BASELINE: 1.366, TORCH_FUSED: 0.994},
        (4096, 8192): {COMM: 0.212, MATMUL: 0.217, BASELINE: 0.417, TORCH_FUSED: 0.477},
    },
}


# ----------------------------------------------------------------------------------------------------
# command line


def add_arguments(parser) -> None:
    parser.add_argument("--algorithms",
                        help=f"tk.dist algorithms to time: {', '.join(ALGORITHMS)} (default: all on a GPU, "
                             f"{', '.join(CPU_ALGORITHMS)} on the CPU)")
    parser.add_argument("--trace", action="store_true",
                        help="all_gather_matmul: also run one traced call per tk algorithm and shape and "
                             "render it (Chrome trace JSON + PNG under --out, or ./traces)")
    parser.add_argument("--update-auto-table", nargs="+", type=pathlib.Path, metavar="RUN_JSON",
                        help="write the tk algorithm timings of these run files (an --out's <op>.json) "
                             "into the auto table; times nothing")
    parser.add_argument("--auto-table", type=pathlib.Path,
                        help="the auto table --update-auto-table writes (default: tilekernels/dist/"
                             "auto_table.json, or $TILEKERNELS_AUTO_TABLE)")
    parser.add_argument("--sleep-us", type=float, default=1000.0,
                        help="GPU sleep before each timed call, so the host enqueues ahead (default 1000)")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="process-group timeout: how long a rank waits on a stuck peer (default 600)")
    parser.add_argument("--split-max-rows", type=int,
                        help="all_gather_matmul: copy_engine's SPLIT_MAX_ROWS for this run (one GEMM per shard "
                             "up to this many gathered rows; default: the library's)")
    parser.add_argument("--workspace-mib", type=int,
                        help="pass one tk.dist.Workspace of this many MiB to every tk call (default: the "
                             "ops' own per-group workspace)")


def parse_shapes(text: str) -> list[dict]:
    """``"4096x3584,64x48x80"`` -> ``[{"M": 4096, "N": 3584, "K": 8192}, {"M": 64, "N": 48, "K": 80}]``."""
    return harness.parse_shapes(text, names=("M", "N", "K"), defaults={"K": DEFAULT_K})


def shape_problem(op: str, shape: dict, world: int) -> str | None:
    """Why ``shape`` cannot be split over ``world`` ranks for ``op``, or None."""
    if shape["M"] % world:
        return f"M = {shape['M']} is not a multiple of the world size {world}"
    if op == REDUCE_SCATTER and shape["K"] % world:
        return f"K = {shape['K']} is not a multiple of the world size {world}"
    return None


def parse_algorithms(text: str | None, on_gpu: bool) -> list[str]:
    if not text:
        return list(ALGORITHMS if on_gpu else CPU_ALGORITHMS)
    algorithms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown or not algorithms:
        raise UsageError(f"--algorithms: unknown {unknown or text!r}; choose from {', '.join(ALGORITHMS)}")
    return algorithms


def shape_label(shape: dict) -> str:
    return f"{shape['M']}x{shape['N']}x{shape['K']}"


# ----------------------------------------------------------------------------------------------------
# ranks


@dataclasses.dataclass
class Context:
    """What every step of one rank needs: the group, the run's options, and rank 0's outputs."""

    op: str
    rank: int
    world: int
    device: torch.device
    group: object
    group_name: str
    opts: argparse.Namespace
    run: Run
    workspace: object = None
    flag: torch.Tensor | None = None

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def echo(self, text: str = "") -> None:
        if self.rank == 0:
            print(text, flush=True)

    def sync(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)


def _all_gather(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, shard, group=group)


def _reduce_scatter(out: torch.Tensor, full: torch.Tensor, group) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, full, group=group)


def agree(ctx: Context, code: int, message: str = "", value: float = -1.0) -> tuple[int, str, float]:
    """Combine every rank's (status code, message, value): the worst code, the message of the first
    rank with that code, the largest value. Codes: 0 ok, 1 wrong answer, 2 raised."""
    both = torch.tensor([float(code), float(value)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ctx.group)
    worst, largest = int(both[0].item()), float(both[1].item())
    text = ""
    if worst:
        messages: list = [None] * ctx.world
        dist.all_gather_object(messages, (code, message), group=ctx.group)
        rank = next(r for r, (c, _) in enumerate(messages) if c == worst)
        text = f"rank {rank}: {messages[rank][1]}"
    return worst, text, largest


def rendezvous(ctx: Context) -> None:
    """Ranks in step before a timed call: host barrier, then (GPU) a sleep the host enqueues behind and a
    one-element all-reduce the GPUs leave together."""
    dist.barrier(group=ctx.group)
    if ctx.on_gpu:
        if ctx.opts.sleep_us > 0 and hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(int(ctx.opts.sleep_us * CYCLES_PER_US))
        dist.all_reduce(ctx.flag, group=ctx.group)


# ----------------------------------------------------------------------------------------------------
# inputs, providers and checks


def _sample(n: int, seed: int) -> torch.Tensor:
    """Edge rows/columns (the last tiles) plus random ones: the same on every rank (a CPU generator)."""
    if n <= 2 * SAMPLE_EDGE + SAMPLE_RANDOM:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(seed)
    middle = torch.randperm(n - 2 * SAMPLE_EDGE, generator=gen)[:SAMPLE_RANDOM] + SAMPLE_EDGE
    return torch.cat([torch.arange(SAMPLE_EDGE), middle, torch.arange(n - SAMPLE_EDGE, n)]).sort().values


@dataclasses.dataclass
class Provider:
    name: str
    fn: Callable[[dict], object]
    algorithm: str | None = None
    checked: bool = True


@dataclasses.dataclass
class Case:
    """One shape of one op on this rank: input sets, providers, and the check against the baseline."""

    op: str
    shape: dict
    dtype: torch.dtype
    sets: list[dict]
    providers: list[Provider]
    check: Callable[[str, object], Accuracy] | None = None


def _tk_ops():
    import tilekernels.dist as tk_dist

    return tk_dist


def _all_gather_providers(ctx: Context, algorithms: Sequence[str]) -> list[Provider]:
    group, name = ctx.group, ctx.group_name

    def tk(algorithm):
        def run(x, trace=False):
            fn = _tk_ops().all_gather_matmul
            kwargs = {"trace": trace} if trace else {}
            a, outs = fn(x["a_shard"], [x["b"]], 0, group, return_a=True, algorithm=algorithm,
                         workspace=ctx.workspace, **kwargs)
            return a, outs[0]
        return run

    def fused(x):
        a, outs = torch.ops.symm_mem.fused_all_gather_matmul(x["a_shard"], [x["b"]], 0, name, return_A=True)
        return a, outs[0]

    def native(x):
        from torch.distributed._symmetric_memory import _fused_all_gather_matmul_native

        return _fused_all_gather_matmul_native(x.get("a_shard_symm", x["a_shard"]), x["b"], name)

    def gather(x):
        a = x["a_shard"].new_empty((ctx.world * x["a_shard"].shape[0], x["a_shard"].shape[1]))
        _all_gather(a, x["a_shard"], group)
        return a

    def baseline(x):
        a = gather(x)
        return a, torch.matmul(a, x["b"])

    providers = [Provider(TK_PREFIX + alg, tk(alg), alg) for alg in algorithms]
    if ctx.on_gpu:
        providers += [Provider(TORCH_FUSED, fused), Provider(TORCH_NATIVE, native)]
    providers += [Provider(BASELINE, baseline), Provider(COMM, lambda x: (gather(x), None)),
                  Provider(MATMUL, lambda x: (None, torch.matmul(x["a_full"], x["b"])), checked=False)]
    return providers


def _reduce_scatter_providers(ctx: Context, algorithms: Sequence[str]) -> list[Provider]:
    group, name = ctx.group, ctx.group_name

    def tk(algorithm):
        def run(x):
            return _tk_ops().matmul_reduce_scatter(x["a"], x["b"], "sum", 0, group, algorithm=algorithm,
                                                   workspace=ctx.workspace)
        return run

    def fused(x):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(x["a"], x["b"], "sum", 0, name)

    def scatter(full):
        out = full.new_empty((full.shape[0] // ctx.world, full.shape[1]))
        _reduce_scatter(out, full, group)
        return out

    providers = [Provider(TK_PREFIX + alg, tk(alg), alg) for alg in algorithms]
    if ctx.on_gpu:
        providers.append(Provider(TORCH_FUSED, fused))
    providers += [Provider(BASELINE, lambda x: scatter(torch.matmul(x["a"], x["b"]))),
                  Provider(COMM, lambda x: scatter(x["c_full"]), checked=False),
                  Provider(MATMUL, lambda x: torch.matmul(x["a"], x["b"]), checked=False)]
    return providers


def _set_count(ctx: Context, set_bytes: int) -> int:
    count = torch.tensor([float(rotation_count(set_bytes, ctx.device))], device=ctx.device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=ctx.group)
    return max(1, int(count.item()))


def build_case(ctx: Context, shape: dict, providers: list[Provider]) -> Case:
    """Input sets for this rank (collective: every rank agrees on their number)."""
    M, N, K, w = shape["M"], shape["N"], shape["K"], ctx.world
    dtype, size = ctx.opts.dtype, ctx.opts.dtype.itemsize
    names = {p.name for p in providers}
    if ctx.op == ALL_GATHER:
        set_bytes = (M // w * K + K * N + (M * K if MATMUL in names else 0)) * size
    else:
        set_bytes = (M * (K // w) + K // w * N + (M * N if COMM in names else 0)) * size
    count = _set_count(ctx, set_bytes)
    seed = ctx.opts.seed * 1_000_003 + 7919 * ctx.rank

    def make(i: int) -> dict:
        base = seed + 101 * i
        if ctx.op == ALL_GATHER:
            x = {"a_shard": device_random((M // w, K), dtype, ctx.device, base),
                 "b": device_random((K, N), dtype, ctx.device, base + 1)}
            if MATMUL in names:
                x["a_full"] = device_random((M, K), dtype, ctx.device, base + 2)
            if TORCH_NATIVE in names:
                x.update(_symmetric_copy(x["a_shard"]))
        else:
            x = {"a": device_random((M, K // w), dtype, ctx.device, base),
                 "b": device_random((K // w, N), dtype, ctx.device, base + 1)}
            if COMM in names:
                x["c_full"] = device_random((M, N), dtype, ctx.device, base + 2)
        return x

    return Case(ctx.op, dict(shape), dtype, [make(i) for i in range(count)], providers)


def _symmetric_copy(a_shard: torch.Tensor) -> dict:
    """``{"a_shard_symm": copy in symmetric memory}``: torch's native path rendezvous on its input, which
    must come from ``symm_mem.empty``; ``{}`` where that cannot be had (the provider then reports why)."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        buffer = symm_mem.empty(tuple(a_shard.shape), dtype=a_shard.dtype, device=a_shard.device)
    except Exception:  # noqa: BLE001 - torch.native then gets the plain tensor and fails on its own terms
        return {}
    buffer.copy_(a_shard)
    return {"a_shard_symm": buffer}


def prepare_check(ctx: Context, case: Case) -> None:
    """Run the baseline on set 0 and build ``case.check`` (collective; raises if the baseline does)."""
    x = case.sets[0]
    M, N, w, r = case.shape["M"], case.shape["N"], ctx.world, ctx.rank
    baseline = next(p for p in case.providers if p.name == BASELINE)
    if ctx.op == ALL_GATHER:
        a_ref, c_ref = baseline.fn(x)
        rows, cols = _sample(M, 1).to(ctx.device), _sample(N, 2).to(ctx.device)
        ref = a_ref[rows].double() @ x["b"][:, cols].double()
        low = c_ref[rows][:, cols]

        def check(provider: str, out) -> Accuracy:
            a, c = out
            if a is not None and (tuple(a.shape) != tuple(a_ref.shape) or not torch.equal(a, a_ref)):
                return Accuracy(False, math.inf, "the gathered A differs from NCCL's all-gather")
            if c is None:
                return Accuracy(True, float("nan"), "gathered A only")
            return _compare(provider, c, (M, N), rows, cols, ref, low)
    else:
        c_ref = baseline.fn(x)
        local_rows = M // w
        rows, cols = _sample(local_rows, 1), _sample(N, 2).to(ctx.device)
        every_chunk = torch.cat([p * local_rows + rows for p in range(w)]).to(ctx.device)
        rows = rows.to(ctx.device)
        a_part = x["a"][every_chunk].contiguous()                 # [w * s, K/w]: all chunks' sampled rows
        b_part = x["b"][:, cols].contiguous()                     # [K/w, s]
        a_all = a_part.new_empty((w * a_part.shape[0], a_part.shape[1]))
        b_all = b_part.new_empty((w * b_part.shape[0], b_part.shape[1]))
        _all_gather(a_all, a_part, ctx.group)
        _all_gather(b_all, b_part, ctx.group)
        s = rows.numel()
        a_peers, b_peers = a_all.view(w, w * s, -1), b_all.view(w, -1, cols.numel())
        ref = sum(a_peers[p, r * s:(r + 1) * s].double() @ b_peers[p].double() for p in range(w))
        low = c_ref[rows][:, cols]

        def check(provider: str, out) -> Accuracy:
            return _compare(provider, out, (local_rows, N), rows, cols, ref, low)

    ctx.sync()
    case.check = check


def _compare(provider: str, c: torch.Tensor, shape, rows, cols, ref, low) -> Accuracy:
    if tuple(c.shape) != tuple(shape):
        return Accuracy(False, math.inf, f"output shape {tuple(c.shape)}, expected {tuple(shape)}")
    nonfinite = int((~torch.isfinite(c)).sum())
    result = compare(provider, c[rows][:, cols], ref, low)
    detail = str(result) + (f"; {nonfinite} non-finite elements in the whole output" if nonfinite else "")
    return Accuracy(result.passed and nonfinite == 0, result.ratio, detail)


# ----------------------------------------------------------------------------------------------------
# measuring


def _recover(ctx: Context) -> None:
    if ctx.on_gpu:
        try:
            torch.cuda.synchronize(ctx.device)
        except Exception:  # a sticky CUDA error shows again at the next call, on every rank's report
            pass
        torch.cuda.empty_cache()


def time_provider(ctx: Context, fn: Callable[[dict], object],
                  sets: list[dict]) -> tuple[list[float] | None, str]:
    """Per-repetition times (ms, MAX over ranks), or (None, why) if any rank raised. Collective."""
    cycle = itertools.cycle(sets)
    error: list[str] = []

    def once():
        rendezvous(ctx)
        if error:
            return None
        try:
            if ctx.on_gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(next(cycle))
                end.record()
                return start, end
            start = time.perf_counter()
            fn(next(cycle))
            return (time.perf_counter() - start) * 1e3
        except Exception as exc:
            error.append(exception_text(exc))
            return None

    def resolve(marks) -> list[float]:
        try:
            ctx.sync()
        except Exception as exc:
            error.append(exception_text(exc))
        if error:
            return []
        return [m[0].elapsed_time(m[1]) if ctx.on_gpu else m for m in marks]

    estimate = resolve([once() for _ in range(ESTIMATE_CALLS)])
    code, message, slowest = agree(ctx, 2 if error else 0, error[0] if error else "",
                                   max(estimate, default=-1.0))
    if code:
        _recover(ctx)
        return None, message
    slowest = max(slowest, 1e-3)
    warmup = min(MAX_WARMUP, max(1, math.ceil(ctx.opts.warmup / slowest)))
    min_reps = MIN_REPS_GPU if ctx.on_gpu else MIN_REPS_CPU
    reps = min(MAX_REPS, max(min_reps, math.ceil(ctx.opts.rep / slowest)))
    resolve([once() for _ in range(warmup)])
    times = resolve([once() for _ in range(reps)])
    code, message, _ = agree(ctx, 2 if error else 0, error[0] if error else "")
    if code:
        _recover(ctx)
        return None, message
    per_rep = torch.tensor(times, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(per_rep, op=dist.ReduceOp.MAX, group=ctx.group)
    return per_rep.cpu().tolist(), ""


def _row(ctx: Context, case: Case, provider: Provider, status: str, times: list[float] | None = None,
         ratio: float | None = None, error: str = "") -> dict:
    shape = case.shape
    row = {
        "op": ctx.op, "provider": provider.name, "algorithm": provider.algorithm, "shape": dict(shape),
        "dtype": dtype_name(case.dtype), "layout": "RR", "variant": f"world {ctx.world}", "metric": "ms",
        "p20": None, "p50": None, "p80": None, "ms": None, "status": status, "error": error,
        "accuracy_ratio": ratio, "world": ctx.world, "backend": dist.get_backend(ctx.group),
        "config": "return_a" if ctx.op == ALL_GATHER else "reduce_op=sum", "mode": "bench", "timing": "eager",
        "run_id": ctx.run.run_id, "date": ctx.run.date,
        **{k: v for k, v in ctx.run.env.items() if k != "gpu_slug"},
    }
    if times:
        p20, p50, p80 = torch.tensor(times, dtype=torch.float64).quantile(
            torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)).tolist()
        row.update(p20=p20, p50=p50, p80=p80, ms=p50, reps=len(times))
        M, N, K, w = shape["M"], shape["N"], shape["K"], ctx.world
        size = case.dtype.itemsize
        if provider.name == COMM:
            moved = (M * K if ctx.op == ALL_GATHER else M * N) * size
            row["bus_gbps"] = moved * (w - 1) / w / (p50 * 1e-3) / 1e9
        else:
            flops = 2.0 * M * N * K / (1 if ctx.op == ALL_GATHER else w)
            row["tflops"] = flops / (p50 * 1e-3) / 1e12
    return row


def measure(ctx: Context, case: Case, provider: Provider) -> dict:
    """Check, then time, one provider on every rank; rank 0's row (every rank builds the same row)."""
    code, message, ratio = 0, "", -1.0
    try:
        out = provider.fn(case.sets[0])
        ctx.sync()
        if provider.checked and case.check is not None:
            accuracy = case.check(provider.name, out)
            if not accuracy.passed:
                code, message = 1, f"accuracy check failed, not timed: {accuracy.detail}"
            if math.isfinite(accuracy.ratio):
                ratio = accuracy.ratio
        del out
    except Exception as exc:
        code, message = 2, f"raised {exception_text(exc)}"
        _recover(ctx)
    code, message, ratio = agree(ctx, code, message, ratio)
    ratio = ratio if ratio >= 0 else None
    what = f"{ctx.op} {shape_label(case.shape)} [{provider.name}]"
    if code:
        if ctx.rank == 0:
            ctx.run.fail(what, message)
        return _row(ctx, case, provider, "wrong" if code == 1 else "failed", ratio=ratio, error=message)
    times, message = time_provider(ctx, provider.fn, case.sets)
    if times is None:
        if ctx.rank == 0:
            ctx.run.fail(what, f"raised while timing {message}")
        return _row(ctx, case, provider, "failed", ratio=ratio, error=f"raised while timing {message}")
    row = _row(ctx, case, provider, "ok", times, ratio)
    extra = (f", {format_value(row['tflops'])} TFLOP/s" if "tflops" in row
             else f", bus {format_value(row['bus_gbps'])} GB/s")
    ctx.echo(f"  {shape_label(case.shape):>17} {provider.name:>16}: {row['p50']:.4f} ms "
             f"(p20 {row['p20']:.4f}, p80 {row['p80']:.4f}{extra}; {row['reps']} reps"
             f"{'' if ratio is None else f', check ratio {ratio:.2f}'})")
    return row


def annotate(rows: list[dict]) -> None:
    """Give each timed row of one shape its speedup over the baseline and fraction of the overlap limit."""
    by_provider = {r["provider"]: r for r in rows if r["status"] == "ok"}
    base = by_provider.get(BASELINE)
    parts = [by_provider.get(COMM), by_provider.get(MATMUL)]
    limit = max(r["p50"] for r in parts) if all(parts) else None
    for r in by_provider.values():
        if base is not None:
            r["speedup"] = base["p50"] / r["p50"]
        if limit is not None:
            r["limit_ms"] = limit
            r["of_limit"] = limit / r["p50"]


def trace_calls(ctx: Context, case: Case, algorithms: Sequence[str], trace_dir: pathlib.Path) -> None:
    """One traced all_gather_matmul per algorithm: per-rank traces, merged and drawn by rank 0."""
    from ..dist import trace as tk_trace

    label = shape_label(case.shape)
    for algorithm in algorithms:
        provider = next(p for p in case.providers if p.algorithm == algorithm)
        template = trace_dir / f"{ctx.op}-{label}-{algorithm}-rank{{rank}}.json"
        rendezvous(ctx)
        code, message = 0, ""
        try:
            # The first traced call compiles the GEMM's TRACE variant: its timeline would show the
            # compiler, not the overlap. Trace a second call, which also finds its plans made.
            provider.fn(case.sets[0], trace=str(trace_dir / "warmup-rank{rank}.json"))
            ctx.sync()
            (trace_dir / f"warmup-rank{ctx.rank}.json").unlink(missing_ok=True)
            rendezvous(ctx)
            provider.fn(case.sets[0], trace=str(template))
            ctx.sync()
        except Exception as exc:
            code, message = 2, exception_text(exc)
            _recover(ctx)
        code, message, _ = agree(ctx, code, message)
        dist.barrier(group=ctx.group)
        if ctx.rank != 0:
            continue
        if code:
            ctx.run.note(f"trace of {label} [{TK_PREFIX}{algorithm}] raised {message}")
            continue
        files = [pathlib.Path(str(template).replace("{rank}", str(r))) for r in range(ctx.world)]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            ctx.run.note(f"trace of {label} [{TK_PREFIX}{algorithm}]: no trace written "
                         f"({', '.join(missing)})")
            continue
        merged = tk_trace.merge_chrome_traces(files, trace_dir / f"{ctx.op}-{label}-{algorithm}.json")
        try:
            png = tk_trace.render_png(merged, merged.with_suffix(".png"),
                                      title=f"{ctx.op} {label} {algorithm}, {ctx.world} ranks")
            ctx.echo(f"  trace {merged} -> {png}")
        except ImportError:
            ctx.run.note(f"matplotlib is not installed: {merged} not drawn")


# ----------------------------------------------------------------------------------------------------
# tables and plots


PROVIDER_ORDER = [TK_PREFIX + a for a in ALGORITHMS] + [TORCH_FUSED, TORCH_NATIVE, BASELINE, COMM, MATMUL]


def _ordered(providers) -> list[str]:
    providers = list(dict.fromkeys(providers))
    rank = {p: i for i, p in enumerate(PROVIDER_ORDER)}
    return sorted(providers, key=lambda p: (rank.get(p, len(rank)), p))


def _ok(row: dict | None) -> bool:
    return row is not None and row.get("status", "ok") == "ok" and isinstance(row.get("p50"), (int, float))


def cell_ms(row: dict | None) -> str:
    if row is None:
        return "-"
    if not _ok(row):
        return row.get("status", "failed")
    return f"{row['p50']:.3f}"


def _anchor(op: str, world: int, shape: dict) -> dict | None:
    if shape["K"] != DEFAULT_K:
        return None
    return ANCHORS.get((op, world), {}).get((shape["M"], shape["N"]))


def report_rows(rows: Sequence[dict], markdown: bool = False, interpreter_note: bool = True) -> str:
    """Per (op, world, dtype): a table of ms (rows = shapes, columns = providers and the overlap limit)
    and a table of speedup vs nccl+cublas and fraction of the overlap limit, then summaries."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["variant"], r["dtype"]), []).append(r)
    blocks = []
    if interpreter_note and any(r.get("interpreter") for r in rows):
        blocks.append(("> " if markdown else "") + INTERPRETER_WARNING)
    for (op, variant, dtype), group in groups.items():
        world = group[0].get("world", 0)
        providers = _ordered(r["provider"] for r in group)
        shapes = list(dict.fromkeys(shape_label(r["shape"]) for r in group))
        shape_of = {shape_label(r["shape"]): r["shape"] for r in group}
        cells = {(shape_label(r["shape"]), r["provider"]): r for r in group}
        compared = [p for p in providers if p not in REFERENCE_ONLY]
        speedups: dict[str, dict[str, float]] = {p: {} for p in compared if p != BASELINE}
        body_ms, body_ratio, failures, anchor_ratios = [], [], [], {}
        for s in shapes:
            comm, matmul, base = cells.get((s, COMM)), cells.get((s, MATMUL)), cells.get((s, BASELINE))
            limit = max(comm["p50"], matmul["p50"]) if _ok(comm) and _ok(matmul) else None
            body_ms.append([s] + [cell_ms(cells.get((s, p))) for p in providers]
                           + [f"{limit:.3f}" if limit else "-"])
            line = [s]
            for p in compared:
                r = cells.get((s, p))
                if not _ok(r):
                    line.append(cell_ms(r))
                    continue
                speed = f"{base['p50'] / r['p50']:.2f}x" if _ok(base) else "-"
                frac = f"{limit / r['p50']:.2f}" if limit else "-"
                line.append(f"{speed} · {frac}")
                if _ok(base) and p in speedups:
                    speedups[p][s] = base["p50"] / r["p50"]
            line.append(f"{base['p50'] / limit:.2f}x · 1.00" if limit and _ok(base) else "-")
            body_ratio.append(line)
            for p in providers:
                r = cells.get((s, p))
                if r is not None and not _ok(r):
                    failures.append(f"{r.get('status', 'failed')}: {p} at {s}: {r.get('error', '')}")
            anchor = _anchor(op, world, shape_of[s])
            if anchor and _ok(base) and BASELINE in anchor:
                anchor_ratios[s] = anchor[BASELINE] / base["p50"]
        h = "#### " if markdown else ""
        title = f"{h}{op} · {variant} · {dtype} — ms (p50 over repetitions of the slowest rank)"
        text = title + "\n\n" + format_table(["shape (MxNxK)"] + providers + ["limit"], body_ms, markdown)
        text += (f"\n\n{h}{op} · {variant} · {dtype} — speedup vs {BASELINE} · fraction of the overlap limit "
                 f"(limit/ms, limit = max(comm, matmul); 1.00 = perfect overlap)\n\n")
        text += format_table(["shape (MxNxK)"] + compared + ["limit"], body_ratio, markdown)
        summary = []
        for p, values in speedups.items():
            if values:
                worst = min(values, key=values.get)
                summary.append(f"{p} vs {BASELINE}: geomean {geomean(values.values()):.3f}x over "
                               f"{len(values)} shape(s), min {values[worst]:.3f}x at {worst}")
        if anchor_ratios:
            summary.append(f"ANCHORS.md {BASELINE} ({world} H200) / this run's: geomean "
                           f"{geomean(anchor_ratios.values()):.3f} over {len(anchor_ratios)} shape(s) "
                           f"(>1: this machine is faster)")
        summary += failures
        if summary:
            text += "\n\n" + "\n".join(("- " if markdown else "  ") + line for line in summary)
        blocks.append(text)
    return "\n\n".join(blocks)


def plot_rows(rows: Sequence[dict], path: pathlib.Path, title: str) -> str:
    """Speedup over nccl+cublas per shape and provider (bars) with the overlap limit (black tick)."""

    def draw(ax, panel, group):
        op, variant, dtype = panel
        cells = {(shape_label(r["shape"]), r["provider"]): r for r in group}
        shapes = list(dict.fromkeys(shape_label(r["shape"]) for r in group))
        providers = [p for p in _ordered(r["provider"] for r in group) if p not in REFERENCE_ONLY]
        width = 0.8 / max(len(providers), 1)
        for i, p in enumerate(providers):
            xs, ys = [], []
            for j, s in enumerate(shapes):
                r, base = cells.get((s, p)), cells.get((s, BASELINE))
                if _ok(r) and _ok(base):
                    xs.append(j + i * width)
                    ys.append(base["p50"] / r["p50"])
            ax.bar(xs, ys, width, label=p)
        for j, s in enumerate(shapes):
            comm, matmul, base = cells.get((s, COMM)), cells.get((s, MATMUL)), cells.get((s, BASELINE))
            if _ok(comm) and _ok(matmul) and _ok(base):
                limit = base["p50"] / max(comm["p50"], matmul["p50"])
                ax.hlines(limit, j - width / 2, j + 0.8 - width / 2, colors="black", linewidth=1.5,
                          label="overlap limit" if j == 0 else None)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels(shapes, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(f"speedup vs {BASELINE}")
        ax.set_title(f"{op} · {variant} · {dtype}", fontsize=10)
        ax.legend(fontsize=7, ncol=4)

    return harness.plot_panels(rows, lambda r: (r["op"], r["variant"], r["dtype"]), draw, path, title,
                               width=12, panel_height=3.8)


# ----------------------------------------------------------------------------------------------------
# the run


def _init_group(device_type: str, timeout_s: float) -> bool | None:
    """Initialise the default process group from torchrun's environment: True if made here, False if
    one existed, None if this is not a torchrun process."""
    if dist.is_initialized():
        return False
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    for key, value in NVLINK_ENV.items():
        os.environ.setdefault(key, value)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return True


def update_auto_table(files: Sequence[pathlib.Path], table: pathlib.Path | None = None) -> int:
    from ..dist import _auto

    rows = [r for f in files for r in read_rows(pathlib.Path(f))]
    for message in _auto.update_table(rows, table):
        print(message)
    return 0


def run_bench(op: str, opts: argparse.Namespace, device: torch.device) -> int:
    """``bench all_gather_matmul|matmul_reduce_scatter``: initialise the group (torchrun) and run."""
    if getattr(opts, "update_auto_table", None):
        return update_auto_table(opts.update_auto_table, getattr(opts, "auto_table", None))
    owned = _init_group(device.type, opts.timeout_s)
    if owned is None:
        print(f"bench {op}: one process per GPU is needed; run it as\n"
              f"  torchrun --nproc-per-node 2 -m tilekernels bench {op} --out DIR", flush=True)
        return 2 if getattr(opts, "op", None) == op else 0
    try:
        return bench_in_group(op, opts)
    finally:
        if owned:
            dist.destroy_process_group()


def _defaults(opts: argparse.Namespace) -> argparse.Namespace:
    opts = argparse.Namespace(**vars(opts))
    for key, value in (("warmup", DEFAULT_WARMUP_MS), ("rep", DEFAULT_REP_MS), ("sleep_us", 1000.0),
                       ("timeout_s", 600.0), ("seed", 0), ("dtype", torch.bfloat16), ("shapes", None),
                       ("providers", None), ("algorithms", None), ("trace", False), ("out", None),
                       ("results_dir", None), ("no_record", False), ("workspace_mib", None),
                       ("split_max_rows", None)):
        if getattr(opts, key, None) is None:
            setattr(opts, key, value)
    return opts


def bench_in_group(op: str, opts: argparse.Namespace) -> int:
    """Every rank of the (initialised) default group runs this; rank 0 reports and writes."""
    opts = _defaults(opts)
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    group = dist.group.WORLD
    run = Run(op, device, "bench")
    ctx = Context(op, rank, world, device, group, group.group_name, opts, run,
                  flag=torch.zeros(1, device=device))
    if opts.split_max_rows is not None:
        import importlib

        importlib.import_module("tilekernels.dist.all_gather_matmul").SPLIT_MAX_ROWS = opts.split_max_rows
    shapes = parse_shapes(opts.shapes or ",".join(GPU_SHAPES if on_gpu else CPU_SHAPES))
    algorithms = parse_algorithms(opts.algorithms, on_gpu)
    providers = (_all_gather_providers if op == ALL_GATHER else _reduce_scatter_providers)(ctx, algorithms)
    if opts.providers:
        wanted = {p.strip() for p in opts.providers.split(",")} | {BASELINE}
        providers = [p for p in providers if p.name in wanted or (p.algorithm and p.algorithm in wanted)]
    env = run.env
    ctx.echo(f"tilekernels bench {op} on {world} x {env['gpu']} ({dist.get_backend()}) — {run.date}")
    if opts.split_max_rows is not None:
        ctx.echo(f"copy_engine: one GEMM per shard up to {opts.split_max_rows} gathered rows (--split-max-rows)")
    ctx.echo(f"torch {env['torch']} · triton {env['triton']} · tilekernels {env['tilekernels']}"
             f"{' · commit ' + env['commit'] if env['commit'] else ''} · run {run.run_id}")
    if on_gpu:
        ctx.echo(f"{dtype_name(opts.dtype)}; per repetition: barrier, {opts.sleep_us:g} us GPU sleep, "
                 f"all-reduce, CUDA events around one call; time = MAX over ranks; warmup "
                 f"{opts.warmup:g} ms, rep {opts.rep:g} ms; inputs rotate through >= 2x L2 ({l2_bytes(device) / 2**20:.0f} MiB)")
        for key, value in NVLINK_ENV.items():
            if os.environ.get(key) != value:
                ctx.echo(f"warning: {key}={os.environ.get(key)!r}, expected {value} (NVLink multicast off)")
        _enable_torch_symm_mem(ctx)
        if opts.workspace_mib:
            ctx.workspace = _make_workspace(ctx, opts.workspace_mib << 20)
    else:
        ctx.echo(INTERPRETER_WARNING)

    rows: list[dict] = []
    trace_dir = (opts.out or pathlib.Path.cwd()) / "traces"
    for shape in shapes:
        problem = shape_problem(op, shape, world)
        if problem is not None:
            if rank == 0:
                run.fail(f"{op} {shape_label(shape)}", problem)
            continue
        shape_rows = bench_shape(ctx, shape, providers, algorithms, trace_dir if opts.trace else None)
        annotate(shape_rows)
        rows += shape_rows
    return _finish(ctx, rows)


def bench_shape(ctx: Context, shape: dict, providers: list[Provider], algorithms: Sequence[str],
                trace_dir: pathlib.Path | None) -> list[dict]:
    code, message = 0, ""
    case = None
    try:
        case = build_case(ctx, shape, providers)
        prepare_check(ctx, case)
    except Exception as exc:
        code, message = 2, f"inputs or baseline raised {exception_text(exc)}"
        _recover(ctx)
    code, message, _ = agree(ctx, code, message)
    if code:
        if ctx.rank == 0:
            ctx.run.fail(f"{ctx.op} {shape_label(shape)}", message)
        placeholder = Case(ctx.op, dict(shape), ctx.opts.dtype, [], providers)
        return [_row(ctx, placeholder, p, "failed", error=message) for p in providers]
    rows = [measure(ctx, case, p) for p in providers]
    if trace_dir is not None and ctx.op == ALL_GATHER:
        passed = [r["algorithm"] for r in rows if r["algorithm"] and r["status"] == "ok"]
        if ctx.rank == 0:
            trace_dir.mkdir(parents=True, exist_ok=True)
        trace_calls(ctx, case, passed, trace_dir)
    del case
    _recover(ctx)
    return rows


def _enable_torch_symm_mem(ctx: Context) -> None:
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)   # deprecated (a no-op) in newer torch
            symm_mem.enable_symm_mem_for_group(ctx.group_name)
    except Exception as exc:  # the torch providers then fail, each with its own message
        ctx.echo(f"note: enable_symm_mem_for_group raised {exception_text(exc)}")


def _make_workspace(ctx: Context, capacity: int):
    code, message, workspace = 0, "", None
    try:
        workspace = _tk_ops().Workspace(ctx.group, capacity_bytes=capacity)
    except Exception as exc:
        code, message = 2, exception_text(exc)
    code, message, _ = agree(ctx, code, message)
    if code:
        ctx.echo(f"note: tk.dist.Workspace({capacity >> 20} MiB) raised {message}; tk calls use their own")
        return None
    return workspace


def _finish(ctx: Context, rows: list[dict]) -> int:
    """Rank 0 reports and writes; the others wait for it (torchrun stops every rank once one exits
    with an error) and exit 0: rank 0's status is the run's."""
    try:
        return _write(ctx, rows) if ctx.rank == 0 else 0
    finally:
        dist.barrier(group=ctx.group)


def _write(ctx: Context, rows: list[dict]) -> int:
    run, opts = ctx.run, ctx.opts
    text = report_rows(rows, interpreter_note=False)
    footer = []
    if run.notes:
        footer.append("notes:\n" + "\n".join(f"  {n}" for n in run.notes))
    if run.failures:
        # Provider failures are listed under their table already; shapes that never ran are not.
        unlisted = [f for f in run.failures if "[" not in f]
        footer.append(f"{len(run.failures)} failure(s)" + (":\n" + "\n".join(f"  {f}" for f in unlisted)
                                                          if unlisted else " (listed with the tables)"))
    print("\n" + "\n\n".join([text or "(no rows)"] + footer), flush=True)
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)
        write_rows(opts.out / f"{ctx.op}.json", rows)
        (opts.out / f"{ctx.op}.txt").write_text("\n\n".join([text, *footer]) + "\n")
        print(f"wrote {opts.out / (ctx.op + '.json')} ({len(rows)} rows), {opts.out / (ctx.op + '.txt')}")
        title = f"tilekernels {ctx.op}, {ctx.world} x {run.env['gpu']}, {run.date}"
        print(plot_rows(rows, opts.out / f"{ctx.op}.png", title))
    results_dir = opts.results_dir
    if results_dir is None and ctx.on_gpu:
        results_dir = default_results_dir()
    if results_dir is not None and not opts.no_record and rows:
        from . import results

        path = results_dir / run.env["gpu_slug"] / f"{ctx.op}.json"
        print(f"appended {append_rows(path, rows)} rows to {path}")
        print(f"regenerated {results.write_results_md(results_dir)}")
    return 1 if run.failures else 0


# ----------------------------------------------------------------------------------------------------
# registration (bench/__init__.py: "tilekernels.bench.dist:ALL_GATHER_MATMUL")


class DistBench:
    """The harness's op interface for one tk.dist op (both share this module)."""

    ANCHOR_PROVIDER = BASELINE

    def __init__(self, name: str):
        self.NAME = name

    def add_arguments(self, parser) -> None:
        add_arguments(parser)

    def check_cases(self, device: torch.device) -> list:
        # Multi-rank: tests/dist and `bench` check these ops; `check` runs in one process.
        return []

    def bench_cases(self, opts, device) -> list:
        raise UsageError(f"{self.NAME} is timed across ranks: torchrun --nproc-per-node 2 -m tilekernels "
                         f"bench {self.NAME}")

    def run_bench(self, opts: argparse.Namespace, device: torch.device) -> int:
        return run_bench(self.NAME, opts, device)

    def report_rows(self, rows: Sequence[dict], markdown: bool = False, interpreter_note: bool = True) -> str:
        return report_rows(rows, markdown, interpreter_note)

    def __repr__(self) -> str:
        return f"DistBench({self.NAME!r})"


ALL_GATHER_MATMUL = DistBench(ALL_GATHER)
MATMUL_REDUCE_SCATTER = DistBench(REDUCE_SCATTER)
