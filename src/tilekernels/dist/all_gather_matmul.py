"""tk.dist.all_gather_matmul: ``all_gather(a_shard) @ b`` with the all-gather hidden behind the GEMM.

Contract: ``torch.ops.symm_mem.fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name,
return_A=...)``. The gather dimension is moved to the front and the rest flattened, so every algorithm
works on ``a [m, K]`` per rank, gathered ``A [world*m, K]`` (rank r's rows at ``[r*m, (r+1)*m)``); the
results are viewed back exactly as PyTorch's fallback does (same shapes and strides). A gather along
the last dimension (K) is ``sum_r a_r @ b[r-th K block]``: ``nccl`` and ``pipelined`` handle it, the
other algorithms run ``pipelined`` for it.

Algorithms
----------
``nccl``: all_gather_into_tensor, then ``torch.matmul`` — the unfused baseline.

``pipelined``: ring steps of P2P send/recv (NCCL, or gloo on CPU), each shard split into sub-chunks;
the GEMM of a sub-chunk (``tk.gemm``) runs while the next one is in flight. The own shard's GEMM runs
first. Works wherever torch.distributed P2P works (across nodes; CPU).

``copy_engine`` (CUDA, symmetric memory; the protocol below): every rank pushes its shard into every
peer's gathered-A buffer by copy engine on a side stream and then sets that peer's chunk signal; the
async-input GEMM (``gemm/scheduler.py``) runs with pivot = rank, so it computes the local rows while
the peers' rows arrive, and waits (bounded) for each peer's chunk only when it reaches its tiles.

``fetch``: iris' HBM-buffer kernel — fetcher programs pull peers' tiles, GEMM programs wait on
per-tile flags (``_fetch.py``).

``auto``: the fastest algorithm measured for the nearest shape in ``auto_table.json`` (``_auto.py``),
never one that measured slower than ``nccl`` there; ``nccl`` where nothing was measured.

copy_engine protocol (one call, epoch e; flag words are in ``workspace.py``)
----------------------------------------------------------------------------
1. current stream: ``ws.begin()`` — e := EPOCH + 1 on the device; wait until every peer's DONE >= e-1,
   i.e. each peer's GEMM of the previous call no longer reads its gathered-A buffer (this rank is
   about to write into it).
2. side stream (after 1), for step 1..world-1, peer p = rank - step: copy the shard into p's gathered-A
   buffer (this rank's rows) over NVLink, then p's SIGNALS[rank] := e — a 4-byte copy-engine copy of
   the EPOCH word queued after the data copy on the same stream, so it never lands before the rows,
   and it needs no SM, so the spinning GEMM cannot starve it. The order rank-1, rank-2, ... delivers
   to each peer first the chunk its pivoted GEMM needs next. The own rows: the GEMM reads them from
   the shard itself (``a_local``) when they are whole row tiles of its launch, and nothing copies them
   into the own buffer; otherwise the current stream copies them there before the GEMM. Their signal
   was set by ``begin``.
3. current stream: the async-input GEMM, pivot = rank, waits ``SIGNALS[c] >= EPOCH`` (the epoch is
   read on the device, so a CUDA-graph replay waits for its own epoch). Several Bs: one GEMM each
   (the later ones find every chunk there). Split form (``SPLIT_MAX_ROWS``): one plain GEMM per shard
   instead, the own one first, each peer's after a one-warp kernel on the stream has seen its signal.
4. side stream, with ``return_a``: the gathered A is assembled in a new tensor while the GEMM runs
   (the own rows from the shard; each peer's rows from the buffer once a one-warp kernel has seen
   their signal). Then the current stream joins the side stream (so the copies are done before 5:
   after it peers may overwrite the buffer); ``ws.end()``: DONE[rank] := e on every peer.
A peer that never pushes: the GEMM's wait on its chunk gives up after ``max_spins`` polls, records the
chunk in the workspace's error table and skips those tiles; ``TimeoutError`` naming the rank and chunk
is raised by the next call on the workspace or by ``tk.raise_pending_errors()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .._runtime import sm_count
from ..gemm.gemm import _async_gemm_into, _gemm_into, async_local_fits, gemm
from . import trace as tracing
from ._common import DTYPES, check_algorithm, check_dim, resolve_group
from .workspace import SIGNALS, Workspace, default_workspace


def _all_gather_into(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, shard, group=group)


# ----------------------------------------------------------------------------------------------------
# algorithms on a [m, K] per rank -> (A [world*m, K] | None, [A @ b])


def _nccl(a: torch.Tensor, bs, group, world: int):
    m, K = a.shape
    gathered = a.new_empty((world * m, K))
    _all_gather_into(gathered, a, group)
    return gathered, [torch.matmul(gathered, b) for b in bs]


def _sub_chunks(m: int, on_gpu: bool) -> list[tuple[int, int]]:
    """Row ranges one shard is sent in: on a GPU pieces of >= 1024 rows (up to 4) so the first GEMM
    starts early without making GEMMs too small to fill the machine; one piece on CPU."""
    pieces = max(1, min(4, m // 1024)) if on_gpu else 1
    bounds = [m * i // pieces for i in range(pieces + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(pieces) if bounds[i + 1] > bounds[i]]


def _pipelined(a: torch.Tensor, bs, group, world: int, rank: int, need_a: bool):
    m, K = a.shape
    gathered = a.new_empty((world * m, K))
    outs = [a.new_empty((world * m, b.shape[1])) for b in bs]
    pieces = _sub_chunks(m, a.is_cuda)
    # Every transfer is its own P2P group, issued in the same order on every rank, so they complete in
    # order and the GEMM of one piece overlaps the transfer of the next.
    pending = []
    for step in range(1, world):
        src, dst = (rank - step) % world, (rank + step) % world
        for lo, hi in pieces:
            ops = [dist.P2POp(dist.isend, a[lo:hi], dst, group),
                   dist.P2POp(dist.irecv, gathered[src * m + lo:src * m + hi], src, group)]
            pending.append((src, lo, hi, dist.batch_isend_irecv(ops)))
    for b, out in zip(bs, outs):
        gemm(a, b, out=out[rank * m:(rank + 1) * m])
    if need_a:
        gathered[rank * m:(rank + 1) * m].copy_(a)
    for src, lo, hi, works in pending:
        for work in works:
            work.wait()
        rows = slice(src * m + lo, src * m + hi)
        for b, out in zip(bs, outs):
            gemm(gathered[rows], b, out=out[rows])
    return gathered, outs


def _pipelined_k(a: torch.Tensor, bs, group, world: int, rank: int, need_a: bool):
    """Gather along K: ``sum_r a_r @ b[r-th K block]``, accumulated in fp32 while shards circulate."""
    k = a.shape[1]
    shards = [None] * world
    shards[rank] = a
    pending = []
    for step in range(1, world):
        src, dst = (rank - step) % world, (rank + step) % world
        shards[src] = torch.empty_like(a)
        ops = [dist.P2POp(dist.isend, a, dst, group), dist.P2POp(dist.irecv, shards[src], src, group)]
        pending.append((src, dist.batch_isend_irecv(ops)))
    accs = [gemm(a, b[rank * k:(rank + 1) * k], out_dtype=torch.float32) for b in bs]
    for src, works in pending:
        for work in works:
            work.wait()
        for i, b in enumerate(bs):
            accs[i] = gemm(shards[src], b[src * k:(src + 1) * k], residual=accs[i], out_dtype=torch.float32)
    gathered = torch.cat(shards, dim=1) if need_a else None
    return gathered, [acc.to(a.dtype) for acc in accs]


def _gemm_device_trace(name: str, M: int, N: int, device: torch.device):
    """The GEMM's per-program event buffer when a trace is being recorded: programs <= 2 per SM, two
    events (wait, compute) per tile, tiles of at least 64 x 64."""
    if tracing.active_tracer() is None:
        return tracing.disabled_device_trace(device)
    programs = 2 * sm_count(device)
    tiles = -(-M // 64) * -(-N // 64)
    return tracing.device_trace(name, programs, device, max_events=2 * -(-tiles // programs) + 8)


class _CopyEnginePlan:
    """The views and events one (m, K, dtype) copy_engine call uses, made once per workspace: on the
    device machine each torch op costs 5-20 us of host time, and a call that makes thirty of them is
    host-bound for every shape below ~8192 x 3584 x 8192."""

    def __init__(self, ws: Workspace, m: int, K: int, dtype: torch.dtype):
        rank, world = ws.rank, ws.world_size
        ws.require(world * m * K * dtype.itemsize,
                   f"all_gather_matmul(copy_engine) of a [{world * m}, {K}] {dtype}")
        self.gathered = ws.data(rank, (world * m, K), dtype)
        self.own_rows = self.gathered[rank * m:(rank + 1) * m]
        # step 1..world-1: peer rank - step, the rows of this rank in its buffer, its signal word
        self.pushes = []
        for step in range(1, world):
            peer = (rank - step) % world
            self.pushes.append((ws.data(peer, (world * m, K), dtype)[rank * m:(rank + 1) * m],
                                ws.flag(peer, SIGNALS + rank)))
        # the peers' rows of the gathered A: before and after this rank's
        self.peer_rows = [rows for rows in (slice(0, rank * m), slice((rank + 1) * m, world * m))
                          if rows.stop > rows.start]
        self.signals = ws.flags[SIGNALS:SIGNALS + world]
        self.errors = ws.errors[SIGNALS:]
        self.direct: dict[tuple, bool] = {}  # whether the GEMMs read the own rows from the shard, per Bs
        cuda = ws.device.type == "cuda"
        self.begun = torch.cuda.Event() if cuda else None
        self.pushed = torch.cuda.Event() if cuda else None


# copy_engine with a gathered A of at most this many rows runs one plain GEMM per shard, each after a
# stream-ordered wait for its signal, instead of one async-input GEMM whose programs poll (0: never).
SPLIT_MAX_ROWS = 0


def _copy_engine_steps(a: torch.Tensor, bs, ws: Workspace, need_a: bool):
    """The copy_engine protocol (module docstring) as two steps, so that simulated ranks in one process
    can run step 1 on every rank before step 2: ``next()`` begins and pushes; the second ``next()``
    runs the GEMMs and finishes, returning (A | None, outs)."""
    m, K = a.shape
    rank, world = ws.rank, ws.world_size
    key = ("copy_engine", m, K, a.dtype)
    plan = ws._plans.get(key)
    if plan is None:
        plan = ws._plans[key] = _CopyEnginePlan(ws, m, K, a.dtype)
    ws.chunks_per_rank = 1
    main = torch.cuda.current_stream() if a.is_cuda else None

    # The GEMM reads this rank's rows from the shard itself where they are whole row tiles of its
    # launch; then the shard is not copied into the own buffer at all (else that copy precedes the GEMM).
    split = world * m <= SPLIT_MAX_ROWS
    fit_key = (a.stride(), a.data_ptr() % 16 == 0, *((b.shape[1], b.stride()) for b in bs))
    direct = split or plan.direct.get(fit_key)
    if direct is None:
        direct = plan.direct[fit_key] = all(async_local_fits(plan.gathered, b, a, m) for b in bs)
    ws.begin(own_signal=SIGNALS + rank)
    if main is not None:
        plan.begun.record(main)
        ws.side_stream.wait_event(plan.begun)
    with ws.stream():
        for step, (rows, signal) in enumerate(plan.pushes, start=1):
            with tracing.span(f"push to rank {(rank - step) % world}", ws.side_stream):
                rows.copy_(a)
                signal.copy_(ws.epoch)
    if not direct:  # (the split form's own GEMM reads the shard)
        with tracing.span("own shard copy", main):
            plan.own_rows.copy_(a)
    yield None

    outs = [a.new_empty((world * m, b.shape[1])) for b in bs]
    if split:
        # One GEMM per shard: the own one at once (from the shard), each peer's after a one-warp
        # kernel on the stream has seen its signal, in the order the peers push to this rank.
        for i, (b, out) in enumerate(zip(bs, outs)):
            with tracing.span(f"GEMM {i}, rows of rank {rank}", main):
                _gemm_into(a, b, out[rank * m:(rank + 1) * m])
        for step in range(1, world):
            peer = (rank + step) % world
            rows = slice(peer * m, (peer + 1) * m)
            ws.wait_words(SIGNALS + peer, 1)
            for i, (b, out) in enumerate(zip(bs, outs)):
                with tracing.span(f"GEMM {i}, rows of rank {peer}", main):
                    _gemm_into(plan.gathered[rows], b, out[rows])
    else:
        for i, (b, out) in enumerate(zip(bs, outs)):
            with tracing.span(f"GEMM {i}", main):
                device_trace = _gemm_device_trace(f"GEMM {i}", world * m, b.shape[1], a.device)
                _async_gemm_into(plan.gathered, b, out, plan.signals, m, rank, ws.epoch, ws.spins(),
                                 plan.errors, device_trace if device_trace.enabled else None, checked=True,
                                 a_local=a if direct else None)
    a_out = None
    with ws.stream():
        if need_a:
            # The gathered A for the caller, assembled on the side stream: the own rows from the shard at
            # once (copy engine), each peer's once a one-warp kernel has seen its signal. That kernel may
            # get an SM only when the GEMM's programs drain (benchmarks/NOTES.md, thirty-third session);
            # then only the peers' rows are copied after the GEMM, where all of A was before.
            a_out = a.new_empty((world * m, K))
            with tracing.span("gathered A out", ws.side_stream):
                a_out[rank * m:(rank + 1) * m].copy_(a)
                ws.wait_words(SIGNALS, world, skip=rank)
                for rows in plan.peer_rows:
                    a_out[rows].copy_(plan.gathered[rows])
        if main is not None:
            plan.pushed.record(ws.side_stream)
    if main is not None:
        main.wait_event(plan.pushed)
    ws.end()
    if main is None:
        ws.check()  # the interpreter ran everything already: report a timeout at once
    yield a_out, outs


def _copy_engine(a, bs, ws, need_a):
    steps = _copy_engine_steps(a, bs, ws, need_a)
    next(steps)
    return next(steps)


def _fetch(a, bs, ws, need_a):
    from ._fetch import fetch_all_gather_matmul

    m, K = a.shape
    world = ws.world_size
    outs = [a.new_empty((world * m, b.shape[1])) for b in bs]
    a_out = a.new_empty((world * m, K)) if need_a else None
    fetch_all_gather_matmul(ws, a, list(bs), outs, a_out)
    return a_out, outs


# ----------------------------------------------------------------------------------------------------
# public


def _check_inputs(a_shard, bs, gather_dim: int):
    if not isinstance(a_shard, torch.Tensor):
        raise TypeError(f"a_shard must be a torch.Tensor, got {type(a_shard).__name__}")
    if a_shard.dim() < 2:
        raise ValueError(f"a_shard must be at least 2-D, got shape {tuple(a_shard.shape)}")
    if a_shard.dtype not in DTYPES:
        raise TypeError(f"a_shard: unsupported dtype {a_shard.dtype}; supported: {', '.join(map(str, DTYPES))}")
    if a_shard.device.type == "meta":
        raise ValueError("a_shard is on the meta device; tk.dist runs on real tensors")
    if isinstance(bs, torch.Tensor) or not isinstance(bs, Sequence) or len(bs) == 0:
        raise TypeError("bs must be a non-empty list of 2-D tensors")
    gather_dim = check_dim("gather_dim", gather_dim, a_shard.dim())
    for i, b in enumerate(bs):
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"bs[{i}] must be a torch.Tensor, got {type(b).__name__}")
        if b.dim() != 2:
            raise ValueError(f"bs[{i}] must be 2-D [K, N], got shape {tuple(b.shape)}")
        if b.dtype != a_shard.dtype:
            raise TypeError(f"bs[{i}] has dtype {b.dtype}, a_shard has {a_shard.dtype}")
        if b.device != a_shard.device:
            raise ValueError(f"bs[{i}] is on {b.device}, a_shard on {a_shard.device}")
    return gather_dim


def _choose(algorithm, op, M, N, K, world, a):
    if algorithm != "auto":
        return algorithm
    from ._auto import choose

    return choose(op, M, N, K, world, a.dtype, a.device)


def all_gather_matmul(a_shard: torch.Tensor, bs: Sequence[torch.Tensor], gather_dim: int = 0, group=None, *,
                      return_a: bool = True, algorithm: str = "auto", workspace: Workspace | None = None,
                      trace=False):
    """``(all_gather(a_shard, gather_dim), [all_gather(a_shard, gather_dim) @ b for b in bs])``.

    Args:
        a_shard: this rank's shard, ``[..., K]`` (>= 2-D), fp16/bf16/fp32 (the GEMM's dtypes).
        bs: one or more ``[K_total, N_i]`` matrices (same dtype and device), K_total = K unless the
            gather is along the last dimension (then K * world).
        gather_dim: the dimension the shards are gathered along (any; negative counts from the end).
        group: None (default group), a ProcessGroup, or a group name.
        return_a: also return the gathered A (otherwise None in its place).
        algorithm: "nccl", "pipelined", "copy_engine", "fetch" or "auto" (module docstring).
        workspace: a ``tk.dist.Workspace`` for copy_engine/fetch (default: one per group, made on first
            use and grown collectively when a call needs more).
        trace: True (writes ``tilekernels-trace-rank{r}.json``) or a path: a Chrome trace of the call's
            copies and GEMM (``dist/trace.py``).

    Returns ``(A | None, [A @ b ...])`` with the shapes and strides of
    ``torch.ops.symm_mem.fused_all_gather_matmul``'s fallback.

    Example (2 ranks, tensor-parallel column-sharded MLP input):
        >>> a, (y,) = tk.dist.all_gather_matmul(x_shard, [w_up], algorithm="copy_engine")
    """
    group, _ = resolve_group(group)
    check_algorithm(algorithm)
    gather_dim = _check_inputs(a_shard, bs, gather_dim)
    if not isinstance(return_a, bool):
        raise TypeError(f"return_a must be a bool, got {type(return_a).__name__}")
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a tk.dist.Workspace or None, got {type(workspace).__name__}")
    world, rank = group.size(), group.rank()
    last = gather_dim == a_shard.dim() - 1
    K_total = a_shard.shape[-1] * (world if last else 1)
    for i, b in enumerate(bs):
        if b.shape[0] != K_total:
            raise ValueError(f"bs[{i}] has {b.shape[0]} rows, the gathered A has {K_total} columns")
    if trace:
        from .trace import traced_call

        return traced_call(all_gather_matmul, trace, rank, a_shard, bs, gather_dim, group,
                           return_a=return_a, algorithm=algorithm, workspace=workspace)

    if last:
        a = a_shard.flatten(0, -2).contiguous()
        algo = _choose(algorithm, "all_gather_matmul", a.shape[0], bs[0].shape[1], K_total, world, a)
        if algo == "nccl":
            gathered = a.new_empty((world * a.shape[0], a.shape[1]))
            _all_gather_into(gathered, a, group)
            a_mm = torch.cat(gathered.chunk(world), dim=-1).view(*a_shard.shape[:-1], K_total)
            return (a_mm if return_a else None), [torch.matmul(a_mm, b) for b in bs]
        gathered, outs = _pipelined_k(a, bs, group, world, rank, return_a)
        lead = a_shard.shape[:-1]
        return ((gathered.view(*lead, K_total) if return_a else None),
                [out.view(*lead, out.shape[-1]) for out in outs])

    if gather_dim == 0 and a_shard.dim() == 2:
        a, leading = a_shard.contiguous(), None  # the common case: no views to make or undo
    else:
        moved = a_shard.movedim(gather_dim, 0)
        leading = [world, *moved.shape[:-1]]
        a = moved.flatten(0, -2).contiguous()
    m, K = a.shape
    algo = _choose(algorithm, "all_gather_matmul", world * m, bs[0].shape[1], K, world, a)
    if algo in ("copy_engine", "fetch") and not a.is_cuda:
        raise ValueError(f"algorithm={algo!r} needs CUDA tensors and symmetric memory; on CPU use 'nccl' or "
                         "'pipelined'")
    if world == 1:
        gathered, outs = a.clone() if return_a else None, [torch.matmul(a, b) for b in bs]
    elif algo == "nccl":
        gathered, outs = _nccl(a, bs, group, world)
    elif algo == "pipelined":
        gathered, outs = _pipelined(a, bs, group, world, rank, return_a)
    else:
        ws = workspace
        if ws is None:
            ws = default_workspace(group, group.group_name, world * m * K * a.element_size())
        elif ws.world_size != world or ws.rank != rank:
            raise ValueError(f"workspace belongs to a group of {ws.world_size} ranks (rank {ws.rank}); this "
                             f"call's group has {world} (rank {rank})")
        if algo == "copy_engine":
            gathered, outs = _copy_engine(a, bs, ws, return_a)
        else:
            gathered, outs = _fetch(a, bs, ws, return_a)

    if leading is None:
        return (gathered if return_a else None), outs

    def unflatten(t: torch.Tensor) -> torch.Tensor:
        return t.view(*leading, -1).flatten(0, 1).movedim(0, gather_dim)

    return (unflatten(gathered) if return_a else None), [unflatten(out) for out in outs]
