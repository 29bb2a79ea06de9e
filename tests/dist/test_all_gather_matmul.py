"""tk.dist.all_gather_matmul against all_gather + matmul.

CPU: ``nccl`` and ``pipelined`` on gloo processes (kernels under the interpreter); the copy_engine
protocol on simulated ranks in one process (``Workspace._simulated``), timeout included.
GPU (``multigpu``): every algorithm on two GPUs against NCCL + torch, random per-rank delays, graph
capture.
"""

from __future__ import annotations

import importlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.dist.mp import gpu_world, run_ranks
from tilekernels import dist as tkd
from tilekernels.dist.all_gather_matmul import _copy_engine_steps
from tilekernels.dist.workspace import Workspace


def _reference(a_shard: torch.Tensor, bs, gather_dim: int, group=None):
    """PyTorch's fallback for fused_all_gather_matmul, in fp64."""
    world = dist.get_world_size(group)
    shards = [torch.empty_like(a_shard) for _ in range(world)]
    dist.all_gather(shards, a_shard.contiguous(), group=group)
    a = torch.cat(shards, dim=gather_dim)
    return a, [(a.double() @ b.double()) for b in bs]


def _assert_matches(got, want, what: str, dtype: torch.dtype) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item() + 1e-6
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


def _cpu_cases(rank: int, world: int) -> None:
    torch.manual_seed(1234 + rank)
    cases = [
        # (algorithm, shard shape, gather_dim, dtype, number of Bs, return_a)
        ("nccl", (5, 24), 0, torch.float32, 2, True),
        ("pipelined", (37, 24), 0, torch.float32, 2, True),
        ("pipelined", (9, 16), 0, torch.float16, 1, False),
        ("pipelined", (3, 6, 16), 1, torch.float32, 1, True),
        ("nccl", (7, 12), 1, torch.float32, 2, True),
        ("pipelined", (7, 12), -1, torch.float32, 2, True),
        ("auto", (6, 16), 0, torch.float32, 1, True),
    ]
    for algorithm, shape, gather_dim, dtype, nb, return_a in cases:
        a_shard = torch.randn(shape, dtype=dtype)
        k_total = shape[-1] * (world if gather_dim % len(shape) == len(shape) - 1 else 1)
        torch.manual_seed(99)  # the same B on every rank
        bs = [torch.randn(k_total, 8 + 4 * i, dtype=dtype) for i in range(nb)]
        torch.manual_seed(1234 + rank)
        a, outs = tkd.all_gather_matmul(a_shard, bs, gather_dim, return_a=return_a, algorithm=algorithm)
        ref_a, ref_outs = _reference(a_shard, bs, gather_dim % len(shape))
        what = f"rank {rank} {algorithm} shard {shape} gather_dim {gather_dim} {dtype}"
        if return_a:
            assert torch.equal(a, ref_a), f"{what}: gathered A differs"
        else:
            assert a is None
        for i, (out, ref) in enumerate(zip(outs, ref_outs)):
            _assert_matches(out, ref, f"{what} B{i}", dtype)
            fallback = torch.matmul(ref_a, bs[i])
            if gather_dim % len(shape) != len(shape) - 1:
                fallback = torch.matmul(ref_a.movedim(gather_dim, 0), bs[i]).movedim(0, gather_dim)
            assert out.stride() == fallback.stride(), f"{what}: strides {out.stride()} != {fallback.stride()}"


def test_cpu_gloo_two_ranks():
    run_ranks(_cpu_cases, 2, backend="gloo")


def _three_ranks(rank: int, world: int) -> None:
    torch.manual_seed(rank)
    a_shard = torch.randn(11, 16)
    torch.manual_seed(7)
    b = torch.randn(16, 12)
    for algorithm in ("nccl", "pipelined"):
        a, (out,) = tkd.all_gather_matmul(a_shard, [b], algorithm=algorithm)
        ref_a, (ref,) = _reference(a_shard, [b], 0)
        assert torch.equal(a, ref_a)
        _assert_matches(out, ref, f"3 ranks {algorithm}", torch.float32)


def test_cpu_gloo_three_ranks():
    run_ranks(_three_ranks, 3, backend="gloo")


@pytest.fixture
def one_rank_group():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'f')}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_bad_inputs(one_rank_group):
    a, b = torch.randn(4, 8), torch.randn(8, 5)
    with pytest.raises(ValueError, match="algorithm"):
        tkd.all_gather_matmul(a, [b], algorithm="magic")
    with pytest.raises(TypeError, match="bs"):
        tkd.all_gather_matmul(a, b)
    with pytest.raises(ValueError, match="bs\\[0\\]"):
        tkd.all_gather_matmul(a, [torch.randn(7, 5)])
    with pytest.raises(TypeError, match="bs\\[1\\]"):
        tkd.all_gather_matmul(a, [b, b.half()])
    with pytest.raises(ValueError, match="gather_dim"):
        tkd.all_gather_matmul(a, [b], gather_dim=2)
    with pytest.raises(ValueError, match="a_shard"):
        tkd.all_gather_matmul(torch.randn(8), [b])
    # dtype and device are checked at any world size (one rank used to fall back to torch.matmul unchecked)
    with pytest.raises(TypeError, match="a_shard"):
        tkd.all_gather_matmul(a.double(), [b.double()])
    with pytest.raises(TypeError, match="a_shard"):
        tkd.all_gather_matmul(a.to(torch.int32), [b.to(torch.int32)])
    with pytest.raises(ValueError, match="a_shard"):
        tkd.all_gather_matmul(a.to("meta"), [b.to("meta")])
    with pytest.raises(ValueError, match="group"):
        tkd.all_gather_matmul(a, [b], group="no-such-group")
    with pytest.raises(ValueError, match="CUDA"):
        tkd.all_gather_matmul(a, [b], algorithm="copy_engine")
    with pytest.raises(ValueError, match="CUDA"):
        tkd.Workspace()


def _run_simulated(spaces, shards, bs, return_a=True):
    steps = [_copy_engine_steps(shard, bs, ws, return_a) for shard, ws in zip(shards, spaces)]
    for s in steps:
        next(s)
    return [next(s) for s in steps]


@pytest.mark.parametrize("world,m,K", [(2, 37, 24), (2, 64, 24), (3, 20, 24)], ids=["w2-m37", "w2-m64", "w3-m20"])
def test_copy_engine_protocol_simulated(world, m, K):
    """Signals and epochs of copy_engine with ranks simulated in one process: three calls in a row,
    nothing zeroed in between; chunks that are and are not whole GEMM tiles."""
    spaces = Workspace._simulated(world, 1 << 18)
    N = 20
    b = torch.randn(K, N)
    for call in range(3):
        shards = [torch.randn(m, K) for _ in range(world)]
        results = _run_simulated(spaces, shards, [b, b[:, :9]])
        gathered = torch.cat(shards)
        for rank, (a, (out, out2)) in enumerate(results):
            assert torch.equal(a, gathered), f"call {call} rank {rank}: gathered A"
            _assert_matches(out, gathered.double() @ b.double(), f"call {call} rank {rank}", torch.float32)
            _assert_matches(out2, gathered.double() @ b[:, :9].double(), f"call {call} rank {rank} B1",
                            torch.float32)
        assert [int(ws.epoch) for ws in spaces] == [call + 1] * world


@pytest.mark.parametrize("return_a", [False, True])
def test_copy_engine_reads_own_rows_from_the_shard(return_a):
    """With whole row tiles per shard (m = 64, the interpreter's tiles are 32 rows) the GEMM reads this
    rank's rows from the shard itself: its rows of the gathered buffer, NaN here, are neither read nor
    written, and the gathered A that return_a asks for is assembled from the shard and the peers' rows."""
    world, m, K, N = 2, 64, 24, 20
    spaces = Workspace._simulated(world, 1 << 18)
    b = torch.randn(K, N)
    for call in range(2):
        shards = [torch.randn(m, K) for _ in range(world)]
        for rank, ws in enumerate(spaces):
            ws.data(rank, (world * m, K), torch.float32)[rank * m:(rank + 1) * m] = float("nan")
        results = _run_simulated(spaces, shards, [b], return_a=return_a)
        gathered = torch.cat(shards)
        for rank, (a, (out,)) in enumerate(results):
            _assert_matches(out, gathered.double() @ b.double(), f"call {call} rank {rank}", torch.float32)
            own = spaces[rank].data(rank, (world * m, K), torch.float32)[rank * m:(rank + 1) * m]
            assert own.isnan().all(), "the own rows were copied into the buffer though the GEMM reads the shard"
            if return_a:
                assert torch.equal(a, gathered), f"call {call} rank {rank}: gathered A"
            else:
                assert a is None


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["async", "split"])
@pytest.mark.parametrize("return_a", [True, False])
def test_gpu_copy_engine_simulated_on_one_gpu(return_a, split, monkeypatch):
    """Two ranks simulated on one GPU, each with its own side stream: the copy_engine protocol on real
    streams (the GEMM reading the own rows from the shard, or one GEMM per shard after a stream-ordered
    wait; the gathered A assembled beside it after the one-warp wait), 10 calls with new shards, exact
    against torch. Runs where no second GPU is."""
    monkeypatch.setattr(importlib.import_module("tilekernels.dist.all_gather_matmul"), "SPLIT_MAX_ROWS",
                        1 << 30 if split else 0)
    device = torch.device("cuda")
    world, m, K, N = 2, 2048, 1024, 768
    spaces = Workspace._simulated(world, world * m * K * 2, device=device)
    torch.manual_seed(0)
    b = torch.randn(K, N, device=device, dtype=torch.bfloat16)
    for call in range(10):
        shards = [torch.randn(m, K, device=device, dtype=torch.bfloat16) for _ in range(world)]
        results = _run_simulated(spaces, shards, [b], return_a)
        torch.cuda.synchronize()
        gathered = torch.cat(shards)
        for rank, (a, (out,)) in enumerate(results):
            _assert_matches(out, gathered.double() @ b.double(), f"call {call} rank {rank}", torch.bfloat16)
            assert (a is None) if not return_a else torch.equal(a, gathered), f"call {call} rank {rank}: A"
    for ws in spaces:
        ws.check()


@pytest.mark.parametrize("world,m", [(2, 40), (3, 64)])
def test_copy_engine_one_gemm_per_shard(world, m, monkeypatch):
    """copy_engine's split form (SPLIT_MAX_ROWS): the own shard's GEMM from the shard, each peer's after
    its signal; the own rows of the buffer (NaN) are never read. Two calls, two Bs, return_a both ways."""
    agm = importlib.import_module("tilekernels.dist.all_gather_matmul")

    monkeypatch.setattr(agm, "SPLIT_MAX_ROWS", 1 << 30)
    K, N = 24, 20
    spaces = Workspace._simulated(world, 1 << 18)
    b = torch.randn(K, N)
    for call, return_a in enumerate((True, False)):
        shards = [torch.randn(m, K) for _ in range(world)]
        for rank, ws in enumerate(spaces):
            ws.data(rank, (world * m, K), torch.float32)[rank * m:(rank + 1) * m] = float("nan")
        results = _run_simulated(spaces, shards, [b, b[:, :9]], return_a=return_a)
        gathered = torch.cat(shards)
        for rank, (a, (out, out2)) in enumerate(results):
            _assert_matches(out, gathered.double() @ b.double(), f"call {call} rank {rank}", torch.float32)
            _assert_matches(out2, gathered.double() @ b[:, :9].double(), f"call {call} rank {rank} B1",
                            torch.float32)
            assert (a is None) if not return_a else torch.equal(a, gathered), f"call {call} rank {rank}: A"


@pytest.mark.parametrize("return_a", [False, True])  # with return_a the gathered A's assembly also waits
def test_copy_engine_timeout_names_rank(return_a):
    """Rank 2 of 3 never pushes its shard: the others raise TimeoutError naming rank 2 and its chunk,
    and still compute every row that did arrive."""
    spaces = Workspace._simulated(3, 1 << 16, max_spins=4)
    m, K = 16, 16
    b = torch.randn(K, 8)
    shards = [torch.randn(m, K) for _ in range(3)]
    _run_simulated(spaces, shards, [b])  # one good call first
    steps = [_copy_engine_steps(shards[r], [b], spaces[r], return_a) for r in range(2)]
    for s in steps:
        next(s)
    for rank, s in enumerate(steps):
        with pytest.raises(TimeoutError, match="chunk 2 from rank 2 never arrived"):
            next(s)
    # the error table was cleared by the raise
    spaces[0].check()


def test_copy_engine_workspace_too_small():
    spaces = Workspace._simulated(2, 1024)
    with pytest.raises(ValueError, match="capacity_bytes >= "):
        _run_simulated(spaces, [torch.randn(16, 16)] * 2, [torch.randn(16, 4)])


# ----------------------------------------------------------------------------------------------------
# GPU: two processes, one GPU each


GPU_ALGORITHMS = ("nccl", "pipelined", "copy_engine", "fetch", "auto")


def _gpu_cases(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    ws = tkd.Workspace(capacity_bytes=64 << 20)
    for dtype in (torch.bfloat16, torch.float16):
        for m, K, N in ((1000, 512, 384), (2048, 1024, 768), (1, 256, 128)):
            torch.manual_seed(rank)
            a_shard = torch.randn(m, K, device=device, dtype=dtype)
            torch.manual_seed(5)
            bs = [torch.randn(K, N, device=device, dtype=dtype), torch.randn(K, 64, device=device, dtype=dtype)]
            ref_a, ref_outs = _reference(a_shard, bs, 0)
            for algorithm in GPU_ALGORITHMS:
                a, outs = tkd.all_gather_matmul(a_shard, bs, algorithm=algorithm, workspace=ws)
                what = f"rank {rank} {algorithm} {dtype} m={m} K={K} N={N}"
                assert torch.equal(a, ref_a), f"{what}: gathered A differs"
                for out, ref in zip(outs, ref_outs):
                    _assert_matches(out, ref, what, dtype)
            # without return_a copy_engine reads the own rows from the shard where they are whole tiles
            # (m = 2048; m = 1000 and 1 take the copy first)
            a, outs = tkd.all_gather_matmul(a_shard, bs, algorithm="copy_engine", workspace=ws, return_a=False)
            assert a is None
            for out, ref in zip(outs, ref_outs):
                _assert_matches(out, ref, f"rank {rank} copy_engine return_a=False {dtype} m={m}", dtype)
    tkd_errors = ws.check
    torch.cuda.synchronize()
    tkd_errors()


@pytest.mark.multigpu
def test_gpu_every_algorithm():
    run_ranks(_gpu_cases, gpu_world())


def _gpu_split_cases(rank: int, world: int) -> None:
    importlib.import_module("tilekernels.dist.all_gather_matmul").SPLIT_MAX_ROWS = 1 << 30
    device = torch.device("cuda", rank)
    ws = tkd.Workspace(capacity_bytes=64 << 20)
    for m, K, N in ((1000, 512, 384), (2048, 1024, 768), (1, 256, 128)):
        for call in range(3):
            torch.manual_seed(call * world + rank)
            a_shard = torch.randn(m, K, device=device, dtype=torch.bfloat16)
            torch.manual_seed(5)
            bs = [torch.randn(K, N, device=device, dtype=torch.bfloat16),
                  torch.randn(K, 64, device=device, dtype=torch.bfloat16)]
            ref_a, ref_outs = _reference(a_shard, bs, 0)
            a, outs = tkd.all_gather_matmul(a_shard, bs, algorithm="copy_engine", workspace=ws,
                                            return_a=call != 1)
            assert (a is None) if call == 1 else torch.equal(a, ref_a), f"rank {rank} m={m} call {call}: A"
            for out, ref in zip(outs, ref_outs):
                _assert_matches(out, ref, f"rank {rank} split m={m} call {call}", torch.bfloat16)
    torch.cuda.synchronize()
    ws.check()


@pytest.mark.multigpu
def test_gpu_copy_engine_split():
    """copy_engine's split form (one GEMM per shard after a stream-ordered wait) on real ranks."""
    run_ranks(_gpu_split_cases, gpu_world())


def _gpu_random_delays(rank: int, world: int, algorithm: str) -> None:
    device = torch.device("cuda", rank)
    ws = tkd.Workspace(capacity_bytes=32 << 20)
    gen = torch.Generator().manual_seed(100 + rank)
    m, K, N = 512, 1024, 512
    torch.manual_seed(5)
    b = torch.randn(K, N, device=device, dtype=torch.bfloat16)
    for call in range(200):
        torch.manual_seed(call * world + rank)
        a_shard = torch.randn(m, K, device=device, dtype=torch.bfloat16)
        if torch.rand((), generator=gen) < 0.5:
            torch.cuda._sleep(int(torch.randint(1000, 200000, (), generator=gen)))
        a, (out,) = tkd.all_gather_matmul(a_shard, [b], algorithm=algorithm, workspace=ws)
        if call % 20 == 19:
            ref_a, (ref,) = _reference(a_shard, [b], 0)
            assert torch.equal(a, ref_a), f"call {call}: gathered A differs"
            _assert_matches(out, ref, f"call {call} {algorithm}", torch.bfloat16)
    torch.cuda.synchronize()
    ws.check()


@pytest.mark.multigpu
@pytest.mark.parametrize("algorithm", ["copy_engine", "fetch"])
def test_gpu_random_delays(algorithm):
    run_ranks(_gpu_random_delays, gpu_world(), algorithm)


def _gpu_graph(rank: int, world: int, algorithm: str) -> None:
    device = torch.device("cuda", rank)
    ws = tkd.Workspace(capacity_bytes=32 << 20)
    m, K, N = 384, 512, 256
    a_shard = torch.randn(m, K, device=device, dtype=torch.bfloat16)
    b = torch.randn(K, N, device=device, dtype=torch.bfloat16)
    dist.broadcast(b, 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            tkd.all_gather_matmul(a_shard, [b], algorithm=algorithm, workspace=ws)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, (out,) = tkd.all_gather_matmul(a_shard, [b], algorithm=algorithm, workspace=ws)
    for replay in range(5):
        a_shard.copy_(torch.randn(m, K, device=device, dtype=torch.bfloat16))
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        ref_a, (ref,) = _reference(a_shard, [b], 0)
        assert torch.equal(a, ref_a), f"replay {replay}: gathered A differs"
        _assert_matches(out, ref, f"replay {replay} {algorithm}", torch.bfloat16)
    ws.check()


@pytest.mark.multigpu
@pytest.mark.parametrize("algorithm", ["copy_engine", "fetch"])
def test_gpu_graph_capture(algorithm):
    run_ranks(_gpu_graph, gpu_world(), algorithm)


def _gpu_timeout(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    ws = tkd.Workspace(capacity_bytes=8 << 20, max_spins=20000)
    a_shard = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    b = torch.randn(256, 128, device=device, dtype=torch.bfloat16)
    tkd.all_gather_matmul(a_shard, [b], algorithm="copy_engine", workspace=ws)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:  # rank 1 sits this call out: rank 0 must give up on its chunk, not hang
        tkd.all_gather_matmul(a_shard, [b], algorithm="copy_engine", workspace=ws)
        with pytest.raises(TimeoutError, match="chunk 1 from rank 1"):
            import tilekernels as tk

            tk.raise_pending_errors()
    dist.barrier()


@pytest.mark.multigpu
def test_gpu_timeout_names_rank():
    run_ranks(_gpu_timeout, gpu_world())


def test_gemm_trace_records_wait_and_compute_per_tile():
    """The async-input GEMM's TRACE variant (trace=True): one wait and one compute span per tile, in
    order, each with start <= end and the tile's pivoted M index as tag; the product is unchanged."""
    from tilekernels.dist.trace import DeviceTrace
    from tilekernels.gemm.configs import _interpreter_config
    from tilekernels.gemm.gemm import _async_gemm_into

    M, N, K = 70, 40, 24
    a, b = torch.randn(M, K), torch.randn(K, N)
    out = torch.full((M, N), float("nan"))
    rows_per_chunk = 35
    signals = torch.full((2,), 3, dtype=torch.int32)
    errors = torch.zeros(1 + 2, dtype=torch.int32)
    programs, max_events = 16, 64
    trace = DeviceTrace("gemm", torch.zeros(programs, max_events, 4, dtype=torch.int64),
                        torch.zeros(1, dtype=torch.int64), max_events, True)
    _async_gemm_into(a, b, out, signals, rows_per_chunk, 1, torch.tensor([3], dtype=torch.int32), 16, errors,
                     trace)
    _assert_matches(out, a.double() @ b.double(), "traced GEMM", torch.float32)
    cfg = _interpreter_config()
    tiles_m, tiles_n = -(-M // cfg.block_m), -(-N // cfg.block_n)
    events = trace.events[trace.events[..., 0] != 0]
    kinds = events[:, 0].tolist()
    assert kinds.count(2) == kinds.count(3) == tiles_m * tiles_n, kinds
    for per_program in trace.events:
        recorded = per_program[per_program[:, 0] != 0]
        assert recorded[0::2, 0].eq(2).all() and recorded[1::2, 0].eq(3).all(), "wait, compute, wait, ..."
        assert (recorded[:, 1] <= recorded[:, 2]).all()
        assert ((recorded[:, 3] >= 0) & (recorded[:, 3] < tiles_m)).all()
    assert not errors.any()
