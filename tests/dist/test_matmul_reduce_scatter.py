"""tk.dist.matmul_reduce_scatter: every algorithm against an fp64 reference and PyTorch's own answer.

Reference: every rank's a and b are all-gathered, ``sum_r a_r @ b_r`` is computed in fp64 and this
rank's chunk along ``scatter_dim`` sliced out (divided by the world size for "avg"). PyTorch's answer,
the denominator of the error rule, is each rank's ``a_r @ b_r`` in the low precision, summed in fp32.

CPU lane: gloo ranks in processes (``mp.run_ranks``) for nccl and pipelined — each spawn runs a list of
cases, since starting ranks costs seconds; the copy_engine/fetch protocol with simulated ranks in one
process (``Workspace._simulated``), phases driven rank by rank in lockstep: every rank pushes, then
every rank reduces. GPU lane (``-m multigpu``): NCCL ranks, real sizes, random delays, a CUDA graph.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.distributed as dist

from tilekernels.dist.matmul_reduce_scatter import matmul_reduce_scatter
from tilekernels.dist.workspace import DONE, FLAG_WORDS, PARTIAL, Workspace
from tilekernels.testing import assert_close, random_tensor

from .mp import gpu_world, run_ranks

# The module, for its private protocol steps: ``tilekernels.dist.matmul_reduce_scatter`` as an attribute
# of the package is the function once ``dist/__init__.py`` exports it.
mrs_module = importlib.import_module("tilekernels.dist.matmul_reduce_scatter")

multigpu = pytest.mark.multigpu
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def reference(a_all, b_all, scatter_dim: int, reduce_op: str, rank: int, world: int, dtype):
    """(fp64 reference, PyTorch's low-precision answer) of this rank's chunk; a_all/b_all per rank."""
    exact = sum(a.double().cpu() @ b.double().cpu() for a, b in zip(a_all, b_all))
    low = sum((a @ b).float() for a, b in zip(a_all, b_all))
    if reduce_op == "avg":
        exact, low = exact / world, low / world
    return exact.chunk(world, scatter_dim)[rank], low.to(dtype).chunk(world, scatter_dim)[rank]


def gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return parts


# A case: (id, a's shape, N, scatter_dim, dtype name, reduce_op). M = 2*37 and 3*37 rows: chunks are not
# whole 32-row tiles of the interpreter's GEMM config.
CASES_2 = [
    ("M74-K24-N40-dim0-fp32-sum", (74, 24), 40, 0, "fp32", "sum"),
    ("M74-K24-N40-dimN-fp16-sum", (74, 24), 40, -1, "fp16", "sum"),
    ("B3-S74-K16-N24-dim1-fp16-avg", (3, 74, 16), 24, 1, "fp16", "avg"),
    ("B4-S5-K16-N24-dim0-fp32-avg", (4, 5, 16), 24, 0, "fp32", "avg"),
    ("B3-S5-K16-N24-dimN-bf16-sum", (3, 5, 16), 24, 2, "bf16", "sum"),
]
CASES_3 = [
    ("M111-K24-N30-dim0-fp16-sum", (111, 24), 30, 0, "fp16", "sum"),
    ("B2-S9-K16-N30-dimN-fp32-avg", (2, 9, 16), 30, -1, "fp32", "avg"),
]


def _body_cases(rank, world, algorithm, cases):
    failures = []
    for index, (case_id, a_shape, n, scatter_dim, dtype_name, reduce_op) in enumerate(cases):
        dtype = DTYPES[dtype_name]
        gen = torch.Generator().manual_seed(1000 * index + rank)
        a = random_tensor(a_shape, dtype, generator=gen)
        b = random_tensor((a_shape[-1], n), dtype, generator=gen, scale=0.5)
        if case_id.startswith("M") and rank % 2:
            a = a.t().contiguous().t()  # a column-major a on odd ranks
        out = matmul_reduce_scatter(a, b, reduce_op, scatter_dim, algorithm=algorithm)
        ref, torch_out = reference(gather(a, world), gather(b, world), scatter_dim, reduce_op, rank, world,
                                   dtype)
        try:
            assert out.dtype == dtype and out.is_contiguous(), (out.dtype, out.stride())
            assert_close(f"{algorithm} {case_id} rank {rank}", out, ref, torch_out)
        except AssertionError as error:
            failures.append(str(error))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("algorithm", ["nccl", "pipelined"])
def test_two_ranks(algorithm):
    run_ranks(_body_cases, 2, algorithm, CASES_2)


def _body_three(rank, world):
    for algorithm in ("nccl", "pipelined"):
        _body_cases(rank, world, algorithm, CASES_3)


def test_three_ranks():
    run_ranks(_body_three, 3)


def _body_bad_inputs(rank, world):
    a = torch.randn(6, 8)
    b = torch.randn(8, 4)
    mrs = matmul_reduce_scatter
    cases = [
        (TypeError, "a must be a torch.Tensor", lambda: mrs(a.tolist(), b)),
        (ValueError, "a must be at least 2-D", lambda: mrs(torch.randn(8), b)),
        (TypeError, "a: unsupported dtype", lambda: mrs(a.to(torch.float64), b.to(torch.float64))),
        (TypeError, "b has dtype", lambda: mrs(a, b.half())),
        (ValueError, "b must be 2-D", lambda: mrs(a, b[None])),
        (ValueError, "K mismatch", lambda: mrs(a, torch.randn(7, 4))),
        (ValueError, "reduce_op must be", lambda: mrs(a, b, "max")),
        (ValueError, "scatter_dim must be in", lambda: mrs(a, b, "sum", 2)),
        (TypeError, "scatter_dim must be an int", lambda: mrs(a, b, "sum", 0.0)),
        (ValueError, "a's dimension 0 has size 5, not divisible by the world size 2",
         lambda: mrs(a[:5], b)),
        (ValueError, "N \\(b's columns\\) has size 3", lambda: mrs(a, b[:, :3], "sum", -1)),
        (ValueError, "algorithm must be one of", lambda: mrs(a, b, algorithm="ring")),
        (ValueError, "needs CUDA tensors and symmetric memory", lambda: mrs(a, b, algorithm="copy_engine")),
        (ValueError, "needs CUDA tensors and symmetric memory", lambda: mrs(a, b, algorithm="fetch")),
        (TypeError, "workspace must be a tk.dist.Workspace", lambda: mrs(a, b, workspace=object())),
        (ValueError, "no process group named", lambda: mrs(a, b, group="no-such-group")),
        (TypeError, "group must be None, a ProcessGroup", lambda: mrs(a, b, group=3)),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()
    # A valid call afterwards still works (the errors left nothing half-done), a group name works, and
    # "auto" picks an algorithm that runs on CPU.
    out = mrs(a, b, group=dist.group.WORLD.group_name, algorithm="nccl")
    assert out.shape == (3, 4)
    torch.testing.assert_close(mrs(a, b), out)


def test_bad_inputs():
    run_ranks(_body_bad_inputs, 2)


# ----------------------------------------------------------------------------------------------------
# copy_engine / fetch protocol with simulated ranks (one process, shared buffers, synchronous copies)


def _poison(spaces):
    for ws in spaces:  # all-ones bytes are NaN in fp16, bf16 and fp32: an unwritten slot shows
        ws._peers[ws.rank][FLAG_WORDS * 4:].fill_(255)


def _simulated_call(spaces, a_all, b_all, scatter_dim, reduce_op, staged, skip_push=()):
    """One call on every simulated rank: every rank's push phase, then every rank's reduce phase.
    Ranks in ``skip_push`` begin but never push. Returns each rank's output or the exception it raised."""
    splits = [mrs_module._Split.make(a, b, scatter_dim % a.dim(), len(spaces)) for a, b in zip(a_all, b_all)]
    plans = [mrs_module._plan(split, ws, staged, reduce_op) for ws, split in zip(spaces, splits)]
    for ws, split, plan in zip(spaces, splits, plans):
        if ws.rank in skip_push:
            ws.begin()
        else:
            mrs_module._push_partials(split, ws, plan, staged)
    results = []
    for ws, split, plan in zip(spaces, splits, plans):
        try:
            results.append(mrs_module._finish_partials(split, ws, plan, reduce_op))
        except TimeoutError as error:
            results.append(error)
    return results


def _inputs(world, a_shape, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    a_all = [random_tensor(a_shape, dtype, generator=gen) for _ in range(world)]
    b_all = [random_tensor((a_shape[-1], n), dtype, generator=gen, scale=0.5) for _ in range(world)]
    return a_all, b_all


def sim_calls(world):
    """Three calls on one workspace with different shapes, dims and reduce ops; chunks of 37 rows."""
    return [((world * 37, 24), 40, 0, "sum"), ((2, 9, 16), 30, -1, "avg"), ((3, world * 2, 16), 20, 1, "sum")]


@pytest.mark.parametrize("algorithm, world, dtype", [
    pytest.param("copy_engine", 2, torch.float16, id="copy_engine-2-fp16"),
    pytest.param("copy_engine", 3, torch.bfloat16, id="copy_engine-3-bf16"),
    pytest.param("fetch", 2, torch.bfloat16, id="fetch-2-bf16"),
    pytest.param("fetch", 3, torch.float16, id="fetch-3-fp16"),
])
def test_simulated_three_calls(algorithm, world, dtype):
    spaces = Workspace._simulated(world, 1 << 16)
    _poison(spaces)
    calls = sim_calls(world)
    for call, (a_shape, n, scatter_dim, reduce_op) in enumerate(calls):
        a_all, b_all = _inputs(world, a_shape, n, dtype, seed=call)
        outs = _simulated_call(spaces, a_all, b_all, scatter_dim, reduce_op, algorithm == "copy_engine")
        for rank, out in enumerate(outs):
            ref, torch_out = reference(a_all, b_all, scatter_dim, reduce_op, rank, world, dtype)
            assert_close(f"call {call} rank {rank}", out, ref, torch_out)
    assert [int(ws.epoch) for ws in spaces] == [len(calls)] * world
    done = spaces[0].flags[DONE:DONE + world].tolist()  # every peer finished the last call
    assert done == [0] + [len(calls)] * (world - 1)


@pytest.mark.parametrize("algorithm", ["copy_engine", "fetch"])
def test_simulated_missing_partial_times_out(algorithm):
    world, dtype = 3, torch.float32
    spaces = Workspace._simulated(world, 1 << 16, max_spins=3)
    a_all, b_all = _inputs(world, (6, 8), 10, dtype, seed=1)
    staged = algorithm == "copy_engine"
    # Call 1 is complete: its PARTIAL flags hold epoch 1, which must not satisfy call 2.
    assert all(isinstance(out, torch.Tensor) for out in _simulated_call(spaces, a_all, b_all, 0, "sum", staged))
    outs = _simulated_call(spaces, a_all, b_all, 0, "sum", staged, skip_push={1})
    for rank in (0, 2):
        assert isinstance(outs[rank], TimeoutError), outs[rank]
        message = str(outs[rank])
        assert f"on rank {rank}" in message and "rank 1 never delivered its partial result" in message, message
        assert "rank 0 never" not in message and "rank 2 never" not in message, message
        assert not spaces[rank].errors.any()  # reported once, then cleared
    # Rank 1 got both partials it waited for.
    ref, torch_out = reference(a_all, b_all, 0, "sum", 1, world, dtype)
    assert_close("rank 1", outs[1], ref, torch_out)
    assert spaces[0].flags[PARTIAL + 1] == 1 and spaces[0].flags[PARTIAL + 2] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["copy_engine", "fetch"])
def test_gpu_simulated_on_one_gpu(algorithm):
    """Two ranks simulated on one GPU, each pushing on a side stream of its own while the other's
    reduction kernel waits for its partial: the protocol's waits on a GPU where no second GPU is. Three
    calls (dims, shapes and reduce ops change), slots poisoned first, no wait gave up."""
    world, dtype = 2, torch.bfloat16
    spaces = Workspace._simulated(world, 1 << 26, device="cuda")
    _poison(spaces)
    calls = [((world * 1000, 512), 1536, 0, "sum"), ((3, 700, 256), 600, -1, "avg"),
             ((2, world * 300, 384), 520, 1, "sum")]
    for call, (a_shape, n, scatter_dim, reduce_op) in enumerate(calls):
        a_all, b_all = _inputs(world, a_shape, n, dtype, seed=call)
        outs = _simulated_call(spaces, [a.cuda() for a in a_all], [b.cuda() for b in b_all], scatter_dim, reduce_op,
                               algorithm == "copy_engine")
        torch.cuda.synchronize()
        for ws in spaces:
            ws.check()  # raises TimeoutError if a wait gave up (GPU waits report here)
        for rank, out in enumerate(outs):
            assert isinstance(out, torch.Tensor), f"call {call} rank {rank}: {out}"
            ref, torch_out = reference(a_all, b_all, scatter_dim, reduce_op, rank, world, dtype)
            assert_close(f"call {call} rank {rank}", out.cpu(), ref, torch_out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_reduce_kernel_adds_in_fp32_and_rounds_once(reduce_op, dtype):
    world, rank, numel = 3, 1, 1000
    own = torch.randn(numel, dtype=torch.float32)
    slots = torch.randn(world, numel).to(dtype)
    slots[rank] = float("nan")  # the own slot is never read
    out = torch.full((numel,), float("nan"), dtype=dtype)
    mrs_module._reduce_partials(own, slots, out, rank, world, reduce_op)
    expected = own + slots[0].float() + slots[2].float()
    if reduce_op == "avg":
        expected = expected / world
    assert torch.equal(out, expected.to(dtype))


# ----------------------------------------------------------------------------------------------------
# GPU lane


ALGORITHMS = ("nccl", "pipelined", "copy_engine", "fetch")


def _gpu_inputs(rank, a_shape, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed * 101 + rank)
    a = random_tensor(a_shape, dtype, generator=gen).cuda()
    b = random_tensor((a_shape[-1], n), dtype, generator=gen, scale=a_shape[-1] ** -0.5).cuda()
    return a, b


def _body_gpu_every_algorithm(rank, world):
    failures = []
    # M = world * 1037 rows: chunks are not whole tiles.
    shapes = [((world * 1037, 1024), 768, 0, "sum"), ((world * 1037, 1024), 768, -1, "sum"),
              ((4, world * 130, 512), 384, 1, "avg")]
    for seed, (a_shape, n, scatter_dim, reduce_op) in enumerate(shapes):
        for dtype in (torch.bfloat16, torch.float16):
            a, b = _gpu_inputs(rank, a_shape, n, dtype, seed)
            baseline = matmul_reduce_scatter(a, b, reduce_op, scatter_dim, algorithm="nccl")
            ref, _ = reference([t.cpu() for t in gather(a, world)], [t.cpu() for t in gather(b, world)],
                               scatter_dim, reduce_op, rank, world, dtype)
            for algorithm in ALGORITHMS:
                out = matmul_reduce_scatter(a, b, reduce_op, scatter_dim, algorithm=algorithm)
                torch.cuda.synchronize()
                try:
                    assert out.shape == baseline.shape and out.stride() == baseline.stride()
                    assert_close(f"{algorithm} {tuple(a_shape)} dim {scatter_dim} {dtype} rank {rank}",
                                 out, ref, baseline)
                except AssertionError as error:
                    failures.append(str(error))
    import tilekernels as tk

    tk.raise_pending_errors()
    assert not failures, "\n".join(failures)


@multigpu
def test_gpu_every_algorithm():
    run_ranks(_body_gpu_every_algorithm, gpu_world())


def _body_gpu_random_delays(rank, world):
    import tilekernels as tk

    rng = random.Random(rank)
    # Two input sets, alternated: a partial left over from the previous call would show as a mismatch.
    inputs = [_gpu_inputs(rank, (world * 517, 512), 640, torch.bfloat16, seed) for seed in range(2)]
    for algorithm in ("pipelined", "copy_engine", "fetch"):
        expected = [matmul_reduce_scatter(a, b, algorithm=algorithm) for a, b in inputs]
        outs = []
        for call in range(50):
            torch.cuda._sleep(rng.randrange(0, 2_000_000))
            a, b = inputs[call % 2]
            outs.append(matmul_reduce_scatter(a, b, algorithm=algorithm))
        torch.cuda.synchronize()
        tk.raise_pending_errors()
        for call, out in enumerate(outs):
            assert torch.equal(out, expected[call % 2]), f"{algorithm} call {call} rank {rank} differs"


@multigpu
def test_gpu_random_delays():
    run_ranks(_body_gpu_random_delays, gpu_world())


def _body_gpu_cuda_graph(rank, world):
    import tilekernels as tk

    ws = Workspace(capacity_bytes=8 << 20)
    static_a, static_b = _gpu_inputs(rank, (world * 517, 512), 640, torch.bfloat16, 0)
    for _ in range(2):  # compile and settle before capture
        matmul_reduce_scatter(static_a, static_b, algorithm="copy_engine", workspace=ws)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # NCCL's watchdog polls events
        static_out = matmul_reduce_scatter(static_a, static_b, algorithm="copy_engine", workspace=ws)
    for seed in range(1, 6):
        a, b = _gpu_inputs(rank, (world * 517, 512), 640, torch.bfloat16, seed)
        static_a.copy_(a)
        static_b.copy_(b)
        torch.cuda._sleep(random.Random(seed * 7 + rank).randrange(0, 2_000_000))
        graph.replay()
        expected = matmul_reduce_scatter(a, b, algorithm="copy_engine", workspace=ws)
        torch.cuda.synchronize()
        assert torch.equal(static_out, expected), f"replay {seed} rank {rank}"
    tk.raise_pending_errors()
    assert int(ws.epoch) == 2 + 5 * 2  # every replay advanced the device epoch (capture ran nothing)


@multigpu
def test_gpu_cuda_graph():
    run_ranks(_body_gpu_cuda_graph, gpu_world())
