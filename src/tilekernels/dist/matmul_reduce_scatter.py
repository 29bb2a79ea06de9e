"""tk.dist.matmul_reduce_scatter: ``reduce_scatter(a @ b)`` with the communication hidden behind the GEMM.

Contract: ``torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name)``
(fallback: ``funcol.reduce_scatter_single(A @ B, ...)``). Every rank holds ``a [..., K]`` and
``b [K, N]`` (its K shard of a tensor-parallel layer); the result on rank r is chunk r, along
``scatter_dim``, of ``sum_ranks a @ b`` (or the mean), contiguous, shape ``[*a.shape[:-1], N]`` with
``scatter_dim`` divided by the world size.

Splitting the work: rank p's chunk of the output is the product of a slice of the operands — rows of
``a`` (``a.narrow(scatter_dim, ...)``, flattened to 2-D) when scattering a leading dimension, columns
of ``b`` when scattering N. Its "partial" on a rank is that slice's GEMM, ``[rows, cols]``, laid out
exactly as p's contiguous output chunk. Every algorithm computes the partial for each peer, moves it
to that peer, and each rank adds the ``world`` partials of its own chunk — in fp32, rounded once to
the output dtype (``_reduce_partials_kernel``; the own partial never leaves fp32).

Algorithms
----------
``nccl``: ``torch.matmul``, then ``reduce_scatter_tensor`` (NCCL on a GPU, gloo on CPU) — the unfused
baseline, PyTorch's fallback. The reduction runs inside the collective, in the input dtype.

``pipelined``: step s = 1..world-1 computes the partial for rank + s (``tk.gemm(out=...)``) and hands
it to a P2P send to rank + s (receiving rank - s's partial for this rank) with
``dist.batch_isend_irecv``; the collective library runs it on its own stream (NCCL) or threads (gloo)
while the next step's GEMM runs. Own partial last, then wait for the transfers and reduce. Works
wherever torch.distributed P2P works (across nodes; CPU).

``copy_engine`` (CUDA, symmetric memory, protocol below): the partial for peer p is computed into this
rank's staging slot while the previous one is pushed by copy engine into p's receive slot; the own
partial last, in fp32; then one kernel waits for every peer's partial and reduces.

``fetch`` (same protocol): the GEMM stores the partial for p straight into p's receive slot over
NVLink (no staging, no copy); only the flag is a copy-engine write.

``auto``: ``tilekernels.dist._auto.choose`` (measured tables) when present, else ``nccl``.

Every algorithm handles every ``scatter_dim``; none falls back to another.

copy_engine / fetch protocol (one call, epoch e; flag words and ``begin``/``end`` in ``workspace.py``)
-----------------------------------------------------------------------------------------------------
Data area of every rank: ``[receive: world x numel][staging: world x numel]`` (dtype of a; each region
starts on a 256-byte boundary). Receive slot ``src`` holds src's partial for this rank; staging slot
``p`` this rank's partial for p (copy_engine only). numel = elements of one output chunk.

1. current stream: ``ws.begin()`` — e := EPOCH + 1 on the device; wait until every peer's DONE >= e-1:
   each peer's reduction of the previous call has stopped reading its receive slots, which this rank
   is about to overwrite.
2. for step 1..world-1, p = rank + step (a permutation per step: each peer receives from one rank at a
   time):
   current stream: the GEMM of p's partial into staging[p] (fetch: into p's receive[rank]);
   side stream, after that GEMM: copy staging[p] -> p's receive[rank] over NVLink (copy_engine), then
   ``ws.signal(p, PARTIAL + rank)``: p's flag word := e, a 4-byte copy-engine copy of the EPOCH word
   queued behind the data on the same stream, so it never lands before the data. The copy engine
   needs no SM: a peer's reduction kernel spinning on its SMs cannot starve the push it waits for.
   The side stream overlaps the push of p with the GEMM for p + 1.
   fetch: the side stream only signals, after the GEMM kernel that stored into p's memory has
   completed (stream order: its stores are visible before the flag copy starts).
3. current stream: the own partial's GEMM (fp32 output), then ``_reduce_partials_kernel``: every
   program waits (bounded, ``_signals.wait_flag``) for ``PARTIAL + src >= EPOCH`` for every
   src != rank — an acquire load at system scope by one thread, broadcast behind a CTA barrier, so
   the program's loads of receive[src] come after it. The epoch is read on the device, so a CUDA-graph
   replay waits for its own epoch. Then it adds the own fp32 partial and receive[src] for src = 0, 1,
   ... in fp32 (a fixed order: bit-identical run to run), divides by world for "avg" and stores its
   blocks of the chunk once in the output dtype.
4. current stream joins the side stream (this rank's pushes are done: staging may be rewritten and
   peers' slots are final); ``ws.end()``: DONE[rank] := e on every peer.
Nothing is zeroed between calls: a flag holding e-1 is simply not ready for call e.

Timeout: a partial that never arrives makes the wait give up after ``ws.spins()`` polls (seconds on a
GPU); the word is recorded in ``ws.errors``, that program stores nothing (its part of the output is
left unwritten), and later programs give up on the recorded word at once. ``TimeoutError`` naming the
rank ("rank p never delivered its partial result") is raised by the next call on the workspace or by
``tk.raise_pending_errors()`` — at once under the interpreter. The workspace is then out of step.

Not measured yet on a GPU (ANCHORS.md has the baselines to beat: matmul then reduce-scatter ~= the sum
of the two, 1.9-2.2x from perfect overlap at 4 GPUs).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .._runtime import cast_for_store, cdiv, direct_launcher, offset_i64, sm_count
from ..gemm.gemm import _gemm_into, gemm
from ..gemm.scheduler import _poll
from ._common import DTYPES, check_algorithm, check_dim, check_matrix, resolve_group
from ._signals import wait_flag
from .workspace import EPOCH, PARTIAL, Workspace, default_workspace

REDUCE_OPS = ("sum", "avg")
_ALIGN = 256


# ----------------------------------------------------------------------------------------------------
# kernel


@triton.jit
def _reduce_partials_kernel(own_ptr, slots_ptr, out_ptr, numel, rank, world, flags, errors, max_spins,
                            WAIT: tl.constexpr, EPOCH: tl.constexpr, PARTIAL: tl.constexpr,
                            AVERAGE: tl.constexpr, BLOCK: tl.constexpr):
    """``out = own + sum_{src != rank} slots[src]`` (``AVERAGE``: divided by world) in fp32, one
    rounding to out's dtype.

    own: fp32 ``[numel]``; slots: ``[world, numel]`` (slot ``rank`` unused); out: ``[numel]``. A
    persistent grid: program ``pid`` handles blocks pid, pid + P, ... With ``WAIT`` every program first
    waits for ``flags[PARTIAL + src] >= flags[EPOCH]`` for each src != rank (a word already recorded
    as failed gives up at once) and, if any never came, stores nothing.
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    arrived = pid >= 0
    if WAIT:
        epoch = tl.load(flags + EPOCH, volatile=True)
        for src in range(world):
            if src != rank:
                came = _poll(flags + PARTIAL + src) >= epoch
                # Not there yet: wait, unless an earlier program already gave up on it. Nested ifs:
                # triton's `and` would not skip the host-memory read on the fast path.
                if came == 0:  # noqa: SIM102
                    if tl.load(errors + 1 + PARTIAL + src, volatile=True) == 0:
                        came = wait_flag(flags, PARTIAL + src, epoch, errors, max_spins)
                arrived = arrived & came
    if arrived:
        for start in range(pid * BLOCK, numel, num_programs * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < numel
            acc = tl.load(own_ptr + offs, mask=mask)
            for src in range(world):
                if src != rank:
                    part = tl.load(slots_ptr + offset_i64(src, numel) + offs, mask=mask)
                    acc += part.to(tl.float32)
            if AVERAGE:
                acc = tl.div_rn(acc, world.to(tl.float32))  # correctly rounded, as torch.mean
            tl.store(out_ptr + offs, cast_for_store(acc, out_ptr.dtype.element_ty), mask=mask)


def _reduce_partials(own: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, rank: int, world: int,
                     reduce_op: str, ws: Workspace | None = None, plan: _SymmetricPlan | None = None) -> None:
    """Launch ``_reduce_partials_kernel`` on the current stream; with ``ws``, waiting for the PARTIAL
    flags. ``plan``: where the compiled kernel's direct launcher is kept between calls."""
    numel = own.numel()
    if numel == 0:
        return
    block = 1024 if own.is_cuda else 256
    # Every program may spin, which is safe with any grid: the producers are copy engines or other
    # GPUs' GEMMs, never this GPU's SMs (this rank's GEMMs are earlier on the same stream).
    programs = min(cdiv(numel, block), 4 * sm_count(own.device))
    flags, errors, spins = (ws.flags, ws.errors, ws.spins()) if ws is not None else (own, own, 0)
    args = (own, slots, out, numel, rank, world, flags, errors, spins)
    constexprs = dict(WAIT=ws is not None, EPOCH=EPOCH, PARTIAL=PARTIAL, AVERAGE=reduce_op == "avg", BLOCK=block)
    if plan is not None and plan.reduce_launch is not None:
        plan.reduce_launch(programs, args + tuple(constexprs.values()))
        return
    compiled = _reduce_partials_kernel[(programs,)](*args, **constexprs, num_warps=4)
    if plan is not None and own.is_cuda:
        # Same plan, same specialisation (numel, rank, world, spins, dtypes; fresh or slot pointers
        # are 256-byte aligned): later calls skip Triton's argument binding (~30-60 us of host time).
        plan.reduce_launch = direct_launcher(compiled, own.device.index)


# ----------------------------------------------------------------------------------------------------
# splitting a @ b into the world's output chunks


@dataclasses.dataclass(frozen=True)
class _Split:
    """How ``a @ b`` splits into ``world`` output chunks along ``scatter_dim``.

    ``partial(p, out)`` writes this rank's contribution to rank p's chunk, ``[rows, cols]`` (= the
    chunk's contiguous layout), into ``out`` (any tensor of ``numel`` elements, e.g. a slot).
    """

    a: torch.Tensor          # [..., K]; for a scatter along N, already flattened to [M, K]
    b: torch.Tensor          # [K, N]
    scatter_dim: int         # of the output; a.dim() - 1 of the original a means N
    scatter_n: bool
    world: int
    out_shape: tuple
    rows: int
    cols: int

    @classmethod
    def make(cls, a: torch.Tensor, b: torch.Tensor, scatter_dim: int, world: int) -> _Split:
        out_shape = [*a.shape[:-1], b.shape[1]]
        out_shape[scatter_dim] //= world
        cols = out_shape[-1]
        rows = math.prod(out_shape[:-1])
        scatter_n = scatter_dim == a.dim() - 1
        if scatter_n:
            a = a.reshape(-1, a.shape[-1])
        return cls(a, b, scatter_dim, scatter_n, world, tuple(out_shape), rows, cols)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def operands(self, dst: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scatter_n:
            return self.a, self.b[:, dst * self.cols:(dst + 1) * self.cols]
        size = self.out_shape[self.scatter_dim]
        # A leading scatter_dim other than 0 makes the slice strided: reshape copies it (once per chunk).
        return self.a.narrow(self.scatter_dim, dst * size, size).reshape(-1, self.a.shape[-1]), self.b

    def partial(self, dst: int, out: torch.Tensor) -> None:
        a_part, b_part = self.operands(dst)
        if a_part.shape[1] == 0:
            gemm(a_part, b_part, out=out.view(self.rows, self.cols))
        else:  # checked by matmul_reduce_scatter: skip tk.gemm's checks (host time)
            _gemm_into(a_part, b_part, out.view(self.rows, self.cols))


# ----------------------------------------------------------------------------------------------------
# algorithms


def _reduce_scatter_into(out: torch.Tensor, stacked: torch.Tensor, op, group) -> None:
    # reduce_scatter_single replaces the deprecated reduce_scatter_tensor in newer torch (2.13); the GPU
    # machine's torch has only the latter.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, stacked, op=op, group=group)


def _nccl(split: _Split, a: torch.Tensor, b: torch.Tensor, reduce_op: str, group) -> torch.Tensor:
    full = torch.matmul(a, b)
    if split.scatter_dim != 0:
        # Rank p's chunk must be the p-th contiguous block of the collective's input.
        full = torch.cat(full.chunk(split.world, dim=split.scatter_dim))
    out = full.new_empty(split.out_shape)
    _reduce_scatter_into(out, full, dist.ReduceOp.SUM if reduce_op == "sum" else dist.ReduceOp.AVG, group)
    return out


def _pipelined(split: _Split, reduce_op: str, group, rank: int) -> torch.Tensor:
    world, numel, dtype, device = split.world, split.numel, split.a.dtype, split.a.device
    staging = torch.empty((world, numel), dtype=dtype, device=device)
    received = torch.empty((world, numel), dtype=dtype, device=device)
    works = []
    for step in range(1, world):
        dst, src = (rank + step) % world, (rank - step) % world
        split.partial(dst, staging[dst])
        # One P2P group per step, issued in the same order on every rank: the library runs it on its
        # own stream (NCCL; after the GEMM above) while the next step's GEMM runs.
        ops = [dist.P2POp(dist.isend, staging[dst], dist.get_global_rank(group, dst), group),
               dist.P2POp(dist.irecv, received[src], dist.get_global_rank(group, src), group)]
        works += dist.batch_isend_irecv(ops)
    own = torch.empty(numel, dtype=torch.float32, device=device)
    split.partial(rank, own)
    for work in works:
        work.wait()
    out = torch.empty(split.out_shape, dtype=dtype, device=device)
    _reduce_partials(own, received, out, rank, world, reduce_op)
    return out


def _region_bytes(split: _Split) -> int:
    return cdiv(split.world * split.numel * split.a.element_size(), _ALIGN) * _ALIGN


def _slots(ws: Workspace, owner: int, split: _Split, region: int) -> torch.Tensor:
    """``owner``'s receive (region 0) or staging (region 1) slots, ``[world, numel]``."""
    return ws.data(owner, (split.world, split.numel), split.a.dtype, region * _region_bytes(split))


def _workspace_bytes(split: _Split, staged: bool) -> int:
    return _region_bytes(split) * (2 if staged else 1)


class _SymmetricPlan:
    """The slot views and events of one copy_engine/fetch call shape, made once per workspace (each
    torch op costs microseconds of host time on the device machine, and a call makes dozens)."""

    def __init__(self, split: _Split, ws: Workspace, staged: bool):
        rank, world = ws.rank, ws.world_size
        ws.require(_workspace_bytes(split, staged), f"matmul_reduce_scatter of {world} chunks of {split.numel} "
                   f"{split.a.dtype} elements")
        # step 1..world-1: (peer, its receive slot for this rank, where this rank's GEMM writes, its flag)
        self.steps = []
        for step in range(1, world):
            dst = (rank + step) % world
            target = _slots(ws, dst, split, 0)[rank]
            self.steps.append((dst, target, _slots(ws, rank, split, 1)[dst] if staged else target,
                               ws.flag(dst, PARTIAL + rank)))
        self.received = _slots(ws, rank, split, 0)
        cuda = ws.side_stream is not None
        self.computed = [torch.cuda.Event() for _ in self.steps] if cuda else None
        self.pushed = torch.cuda.Event() if cuda else None
        self.reduce_launch = None


def _plan(split: _Split, ws: Workspace, staged: bool, reduce_op: str) -> _SymmetricPlan:
    key = ("matmul_reduce_scatter", split.rows, split.cols, split.a.dtype, staged, reduce_op)
    plan = ws._plans.get(key)
    if plan is None:
        plan = ws._plans[key] = _SymmetricPlan(split, ws, staged)
    return plan


def _push_partials(split: _Split, ws: Workspace, plan: _SymmetricPlan, staged: bool) -> None:
    """Protocol steps 1-2 on this rank: begin, then every peer's partial computed and pushed + signalled.
    ``staged``: copy_engine (GEMM into staging, copy-engine push); else fetch (GEMM into the peer)."""
    main = torch.cuda.current_stream() if ws.side_stream is not None else None
    ws.begin()
    for i, (dst, target, staging, flag) in enumerate(plan.steps):
        split.partial(dst, staging)
        if main is not None:
            plan.computed[i].record(main)
            ws.side_stream.wait_event(plan.computed[i])
        with ws.stream():
            if staged:
                target.copy_(staging)
            flag.copy_(ws.epoch)  # ws.signal(dst, PARTIAL + rank), with the view the plan holds
    if main is not None:
        plan.pushed.record(ws.side_stream)


def _finish_partials(split: _Split, ws: Workspace, plan: _SymmetricPlan, reduce_op: str) -> torch.Tensor:
    """Protocol steps 3-4 on this rank: own partial, wait for the peers' and reduce, end."""
    rank, world = ws.rank, ws.world_size
    device = split.a.device
    own = torch.empty(split.numel, dtype=torch.float32, device=device)
    split.partial(rank, own)
    out = torch.empty(split.out_shape, dtype=split.a.dtype, device=device)
    _reduce_partials(own, plan.received, out, rank, world, reduce_op, ws, plan)
    if plan.pushed is not None:
        torch.cuda.current_stream().wait_event(plan.pushed)
    ws.end()
    if device.type != "cuda":
        ws.check()  # the interpreter has run everything already: report a timeout at once
    return out


def _symmetric(split: _Split, ws: Workspace, reduce_op: str, staged: bool) -> torch.Tensor:
    plan = _plan(split, ws, staged, reduce_op)
    _push_partials(split, ws, plan, staged)
    return _finish_partials(split, ws, plan, reduce_op)


# ----------------------------------------------------------------------------------------------------
# public


def _check_inputs(a, b, reduce_op, scatter_dim, algorithm, workspace) -> int:
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"a must be a torch.Tensor, got {type(a).__name__}")
    if a.dim() < 2:
        raise ValueError(f"a must be at least 2-D [..., K], got shape {tuple(a.shape)}")
    if a.dtype not in DTYPES:
        raise TypeError(f"a: unsupported dtype {a.dtype}; supported: {', '.join(map(str, DTYPES))}")
    check_matrix("b", b, dtype=a.dtype, device=a.device)
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"a and b: K mismatch, a is {tuple(a.shape)} (K={a.shape[-1]}) and b is "
                         f"{tuple(b.shape)} (K={b.shape[0]})")
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    scatter_dim = check_dim("scatter_dim", scatter_dim, a.dim())
    check_algorithm(algorithm)
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a tk.dist.Workspace or None, got {type(workspace).__name__}")
    return scatter_dim


def _choose(algorithm: str, a: torch.Tensor, b: torch.Tensor, world: int) -> str:
    if algorithm != "auto":
        return algorithm
    try:
        from ._auto import choose
    except ModuleNotFoundError:
        return "nccl"
    # _auto's sizes are the global GEMM's: M = a's rows, K = world * a's columns.
    allowed = ("nccl", "pipelined", "copy_engine", "fetch") if a.is_cuda else ("nccl", "pipelined")
    return choose("matmul_reduce_scatter", math.prod(a.shape[:-1]), b.shape[1], world * a.shape[-1], world,
                  a.dtype, a.device, allowed=allowed)


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, reduce_op: str = "sum", scatter_dim: int = 0,
                          group=None, *, algorithm: str = "auto", workspace: Workspace | None = None
                          ) -> torch.Tensor:
    """``reduce_scatter(a @ b, reduce_op, scatter_dim)`` over ``group``, communication overlapped with the GEMM.

    Args:
        a: this rank's ``[..., K]`` (>= 2-D), fp16/bf16/fp32 — e.g. the activations times this rank's
            K shard of a row-parallel linear layer.
        b: ``[K, N]``, same dtype and device (row- or column-major).
        reduce_op: "sum" or "avg" (the sum divided by the world size).
        scatter_dim: the output dimension that is scattered (any, negative counts from the end; the
            last one is N). Its size must be divisible by the world size.
        group: None (default group), a ProcessGroup, or a group name.
        algorithm: "nccl", "pipelined", "copy_engine", "fetch" or "auto" (module docstring).
            copy_engine and fetch need CUDA tensors and symmetric memory; on CPU (gloo) use nccl or
            pipelined.
        workspace: a ``tk.dist.Workspace`` for copy_engine/fetch (default: one per group, made on first
            use, grown collectively when a call needs more).

    Returns a contiguous ``[*a.shape[:-1], N]`` tensor with ``scatter_dim`` divided by the world size,
    a's dtype: this rank's chunk of the reduction, as ``torch.ops.symm_mem.fused_matmul_reduce_scatter``
    returns it. The fused algorithms add the partials in fp32 and round once; ``nccl`` reduces in
    a's dtype inside the collective, as PyTorch's fallback does.

    Example (2 ranks, the down projection of a tensor-parallel MLP, sequence-parallel output):
        >>> h = torch.randn(4096, 7168, dtype=torch.bfloat16, device="cuda")      # [M, K/2]
        >>> w = torch.randn(7168, 3584, dtype=torch.bfloat16, device="cuda")      # [K/2, N]
        >>> y = tk.dist.matmul_reduce_scatter(h, w, algorithm="copy_engine")       # [M/2, N]
    """
    scatter_dim = _check_inputs(a, b, reduce_op, scatter_dim, algorithm, workspace)
    group, group_name = resolve_group(group)
    world, rank = group.size(), group.rank()
    if scatter_dim == a.dim() - 1:
        size, where = b.shape[1], "N (b's columns)"
    else:
        size, where = a.shape[scatter_dim], f"a's dimension {scatter_dim}"
    if size % world:
        raise ValueError(f"scatter_dim={scatter_dim}: {where} has size {size}, not divisible by the world "
                         f"size {world}")
    if world == 1:
        return torch.matmul(a, b)
    split = _Split.make(a, b, scatter_dim, world)
    algo = _choose(algorithm, a, b, world)
    if algo == "nccl":
        return _nccl(split, a, b, reduce_op, group)
    if algo == "pipelined":
        return _pipelined(split, reduce_op, group, rank)
    if a.device.type != "cuda":
        raise ValueError(f"algorithm={algo!r} needs CUDA tensors and symmetric memory (a tk.dist.Workspace); "
                         "on CPU use 'nccl' or 'pipelined'")
    staged = algo == "copy_engine"
    with torch.cuda.device(a.device):
        ws = workspace
        if ws is None:
            ws = default_workspace(group, group_name, _workspace_bytes(split, staged))
        elif ws.world_size != world or ws.rank != rank:
            raise ValueError(f"workspace belongs to a group of {ws.world_size} ranks (rank {ws.rank}); this "
                             f"call's group has {world} (rank {rank})")
        if ws.device != a.device:
            raise ValueError(f"workspace is on {ws.device}, a on {a.device}")
        return _symmetric(split, ws, reduce_op, staged)
