"""tk.dist.Workspace: the symmetric memory, flags and epochs every fused tk.dist algorithm shares.

Layout of each rank's symmetric buffer (the same on every rank, so a peer's word has a known address):

    [ flags: FLAG_WORDS int32 ][ data: capacity bytes ]

Flag words (int32 epochs; see ``_signals.py`` for the wait):

    EPOCH          this rank's call counter; ``begin`` increments it on the device, so a call captured
                   in a CUDA graph advances it on every replay. Every value a call writes or waits
                   for is read from here at run time: nothing is zeroed between calls.
    DONE + p       written by rank p at the end of its call e (copy engine: p's EPOCH word -> here):
                   p no longer touches this rank's buffers for call e.
    READY + p      rank p's shard for call e is in p's data area (fetch).
    PARTIAL + p    rank p's partial result for this rank has landed here (matmul_reduce_scatter).
    SIGNALS + c    chunk c of this rank's gathered A has landed (all_gather_matmul copy_engine); the
                   async-input GEMM waits for ``>= EPOCH``.
    FETCH + i      per-(m-tile, k-group) staging flags of ``fetch``.

Per call, on the current stream: ``begin()`` (epoch e = EPOCH + 1; wait until every peer's DONE >= e-1,
i.e. it finished the previous call), the algorithm, then ``end()`` (write DONE[rank] = e on every
peer). One wait per call, after which the algorithm may write into peers' data areas and flags
without zeroing anything. Every wait is bounded (``max_spins``); a word that never arrives is recorded
in ``errors`` (pinned host memory) and ``check()`` raises ``TimeoutError`` naming the rank (and
chunk) — at the next call on this workspace or at ``tk.raise_pending_errors()``. A workspace whose
wait gave up is out of step with its peers: make a new one.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from .. import _runtime
from ._common import resolve_group

FLAG_WORDS = 1 << 16
EPOCH = 0
DONE = 64
READY = 512
PARTIAL = 768
SIGNALS = 1024          # up to 4096 chunks
FETCH = 8192            # up to FLAG_WORDS - FETCH staging flags
MAX_WORLD = 256
DEFAULT_CAPACITY = 256 << 20
# Polls before a wait gives up (~0.5-1 us each on a GPU: seconds, far beyond a real arrival).
DEFAULT_MAX_SPINS_GPU = 1 << 23
DEFAULT_MAX_SPINS_INTERPRETER = 16

_FLAG_BYTES = FLAG_WORDS * 4


def describe_word(word: int, chunks_per_rank: int = 1) -> str:
    """What a flag word that was never written means, for a TimeoutError."""
    if DONE <= word < READY:
        return f"rank {word - DONE} never finished its previous call (DONE flag)"
    if READY <= word < PARTIAL:
        return f"rank {word - READY} never published its shard (READY flag)"
    if PARTIAL <= word < SIGNALS:
        return f"rank {word - PARTIAL} never delivered its partial result (PARTIAL flag)"
    if SIGNALS <= word < FETCH:
        chunk = word - SIGNALS
        return f"chunk {chunk} from rank {chunk // chunks_per_rank} never arrived (SIGNALS flag)"
    return f"fetch staging flag {word - FETCH} was never set (FETCH flag)"


class Workspace:
    """Symmetric memory for the fused tk.dist algorithms, allocated collectively once and reused.

    Args:
        group: None (the default group), a ProcessGroup or a group name. Every rank of the group must
            create its workspace at the same point (it is a collective: ``symm_mem.rendezvous``).
        capacity_bytes: data bytes per rank. A call that needs more raises ``ValueError`` saying how
            much it needs; calls with any shapes up to the capacity reuse the same memory.
        device: a CUDA device (default: the current one).
        max_spins: polls before a wait on a peer gives up (None: seconds on a GPU).

    Calls that use one workspace must be made in the same order on every rank (as any collective).
    The protocol is in this module's docstring.

    Example:
        >>> ws = tk.dist.Workspace(capacity_bytes=512 << 20)
        >>> a, (y,) = tk.dist.all_gather_matmul(x_shard, [w], workspace=ws, algorithm="copy_engine")
    """

    def __init__(self, group=None, capacity_bytes: int = DEFAULT_CAPACITY, *, device=None,
                 max_spins: int | None = None):
        self.group, self.group_name = resolve_group(group)
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        device = torch.device(device) if device is not None else None
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        if device is None or device.type != "cuda":
            raise ValueError("tk.dist.Workspace needs a CUDA device with peer access (symmetric memory); "
                             "without one use algorithm='nccl' or 'pipelined'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        import torch.distributed._symmetric_memory as symm_mem

        capacity_bytes = -(-capacity_bytes // 256) * 256
        nbytes = _FLAG_BYTES + capacity_bytes
        with torch.cuda.device(device):
            buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
            buffer.zero_()
            handle = symm_mem.rendezvous(buffer, self.group_name)
            peers = [buffer if p == handle.rank else handle.get_buffer(p, (nbytes,), torch.uint8, 0)
                     for p in range(handle.world_size)]
            torch.cuda.synchronize(device)
        self.group.barrier()  # every rank's flags are zero before anyone writes a peer's
        self._init(handle.rank, handle.world_size, device, capacity_bytes, peers, max_spins)
        self._handle = handle
        self.side_stream = torch.cuda.Stream(device)

    def _init(self, rank, world_size, device, capacity, peers, max_spins):
        if world_size > MAX_WORLD:
            raise ValueError(f"tk.dist.Workspace supports up to {MAX_WORLD} ranks, got {world_size}")
        self.rank, self.world_size, self.device, self.capacity = rank, world_size, device, capacity
        self._peers = peers
        self.max_spins = max_spins
        self.flags = self.peer_flags(rank)
        self.epoch = self.flags[EPOCH:EPOCH + 1]
        self.errors = torch.zeros(1 + FLAG_WORDS, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._error_words = self.errors.numpy()
        self.chunks_per_rank = 1
        self._launches: dict = {}  # one-program kernel -> its direct launcher (``_one_program``)
        self._views: dict[tuple, torch.Tensor] = {}
        self._plans: dict[tuple, object] = {}  # per-algorithm, per-shape views and events
        _runtime.register_error_check(device, weakref.WeakMethod(self.check))

    @classmethod
    def _simulated(cls, world_size: int, capacity_bytes: int = 1 << 20, device="cpu",
                   max_spins: int | None = None) -> list[Workspace]:
        """``world_size`` workspaces in one process that see each other's buffers, as ranks would:
        for testing the protocol on CPU under the interpreter, or on one GPU (each then has a side
        stream of its own). No group."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        nbytes = _FLAG_BYTES + capacity_bytes
        buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world_size)]
        spaces = []
        for rank in range(world_size):
            ws = cls.__new__(cls)
            side = torch.cuda.Stream(device) if device.type == "cuda" else None
            ws.group, ws.group_name, ws._handle, ws.side_stream = None, None, None, side
            ws._init(rank, world_size, device, capacity_bytes, buffers, max_spins)
            spaces.append(ws)
        return spaces

    # ------------------------------------------------------------------------------------------------
    # memory

    def peer_flags(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s flag words (int32 ``[FLAG_WORDS]``), mapped into this device."""
        return self._peers[rank][:_FLAG_BYTES].view(torch.int32)

    def data(self, rank: int, shape, dtype: torch.dtype, offset_bytes: int = 0) -> torch.Tensor:
        """A contiguous ``shape``/``dtype`` view of rank ``rank``'s data area at ``offset_bytes``."""
        key = (rank, tuple(shape), dtype, offset_bytes)
        view = self._views.get(key)
        if view is None:
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * dtype.itemsize
            self.require(offset_bytes + nbytes, "this view")
            start = _FLAG_BYTES + offset_bytes
            view = self._peers[rank][start:start + nbytes].view(dtype).view(shape)
            if len(self._views) > 256:
                self._views.clear()
            self._views[key] = view
        return view

    def require(self, nbytes: int, what: str) -> None:
        if nbytes > self.capacity:
            raise ValueError(f"tk.dist.Workspace: {what} needs {nbytes} bytes of symmetric memory per rank, "
                             f"this workspace holds {self.capacity}; create one with capacity_bytes >= "
                             f"{nbytes}")

    def stream(self):
        """Context manager: the side stream (copies), or nothing on CPU."""
        if self.side_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.side_stream)

    def spins(self) -> int:
        if self.max_spins is not None:
            return self.max_spins
        return DEFAULT_MAX_SPINS_INTERPRETER if _runtime.is_interpreter() else DEFAULT_MAX_SPINS_GPU

    # ------------------------------------------------------------------------------------------------
    # the per-call protocol

    def begin(self, own_signal: int = -1) -> None:
        """Epoch e = EPOCH + 1, then wait until every peer finished call e - 1 (on the current stream);
        with ``own_signal >= 0`` also set that flag word of this rank to e."""
        self.check()
        from ._signals import begin_kernel

        args = (self.flags, self.errors, self.rank, self.world_size, self.spins(), own_signal)
        self._one_program(begin_kernel, args, dict(EPOCH=EPOCH, DONE=DONE))
        self.check_if_interpreted()

    def wait_words(self, first: int, count: int, skip: int = -1) -> None:
        """On the current stream: wait until this rank's flag words ``first .. first + count - 1`` (all
        but ``first + skip``) reach this call's epoch, bounded (a word that never comes is recorded for
        ``check``, which the caller runs after ``end``). One program of one warp."""
        from ._signals import wait_words_kernel

        self._one_program(wait_words_kernel, (self.flags, self.errors, first, count, skip, self.spins()),
                          dict(EPOCH=EPOCH))

    def _one_program(self, kernel, args: tuple, constexprs: dict) -> None:
        """Launch one program of one warp of ``kernel`` on the current stream. A Triton launch re-binds its
        arguments (~30 us of host time); these kernels keep one signature per workspace, so after the first
        call they go straight to the compiled kernel (their integer arguments are not specialised on)."""
        launch = self._launches.get(kernel)
        if launch is not None:
            launch(1, args + tuple(constexprs.values()))
            return
        with _device_guard(self.device):
            compiled = kernel[(1,)](*args, **constexprs, num_warps=1)
        if self.device.type == "cuda":
            self._launches[kernel] = _runtime.direct_launcher(compiled, self.device.index)

    def flag(self, rank: int, word: int) -> torch.Tensor:
        """Rank ``rank``'s flag ``word`` as a one-element int32 tensor (views are cached: a call makes
        several of them and each torch op costs microseconds of host time)."""
        key = ("flag", rank, word)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.peer_flags(rank)[word:word + 1]
        return view

    def end(self) -> None:
        """Tell every peer this rank is done with the call: its DONE word := this rank's epoch. Copy
        engine copies of the epoch word (no SM), on the current stream after the call's work."""
        for peer in range(self.world_size):
            if peer != self.rank:
                self.flag(peer, DONE + self.rank).copy_(self.epoch)

    def signal(self, peer: int, word: int) -> None:
        """``peer``'s flag ``word`` := this rank's epoch, on the current stream after its earlier work
        (a 4-byte copy-engine copy: the write lands after everything before it on the stream)."""
        self.flag(peer, word).copy_(self.epoch)

    def check(self) -> None:
        """Raise ``TimeoutError`` naming what never arrived, if a wait of this workspace gave up (reads
        what has landed so far; no synchronisation)."""
        words = self._error_words
        # Word 0 is set by tk.dist's own waits; the async-input GEMM gets the table from SIGNALS on
        # (its word 0, "something failed", is words[SIGNALS]; its chunk c is flag word SIGNALS + c).
        if not (words[0] or words[SIGNALS]):
            return
        failed = [int(w) for w in words[1:].nonzero()[0]]  # words[1 + w] marks flag word w
        words[:] = 0
        reasons = [describe_word(w, self.chunks_per_rank) for w in failed if w != SIGNALS - 1]  # SIGNALS - 1: the GEMM's word 0
        raise TimeoutError(f"tk.dist on rank {self.rank}: a bounded wait gave up: " + "; ".join(reasons)
                           + ". The work that needed it was skipped; this workspace is now out of step with "
                           "its peers (create a new one).")

    def check_if_interpreted(self) -> None:
        """``check()`` when the work ran synchronously (CPU interpreter): report a timeout at once."""
        if self.device.type != "cuda":
            self.check()

    def __repr__(self) -> str:
        return (f"tk.dist.Workspace(rank {self.rank} of {self.world_size}, {self.capacity} data bytes, "
                f"{self.device})")


def _device_guard(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# (group name, device) -> workspaces made for calls without workspace=; older ones are kept because a
# captured CUDA graph may still use them.
_DEFAULTS: dict[tuple, list[Workspace]] = {}


def default_workspace(group, group_name: str, nbytes: int) -> Workspace:
    """The workspace a call without ``workspace=`` uses: one per (group, device), replaced by a larger
    one (collectively: every rank makes the same call) when a call needs more."""
    device = torch.device("cuda", torch.cuda.current_device())
    spaces = _DEFAULTS.setdefault((group_name, device), [])
    if not spaces or spaces[-1].capacity < nbytes:
        spaces.append(Workspace(group, max(DEFAULT_CAPACITY, nbytes), device=device))
    return spaces[-1]
