"""Tile schedulers for the persistent GEMM: which output tile a program computes next, and — for the
async-input GEMM — when it may read that tile's rows of A.

A persistent program walks ``tile_id = pid, pid + P, pid + 2P, ...`` over ``tiles_m * tiles_n *
split_k`` work items (P = programs launched, at most SM count x resident programs). ``tile_coords``
turns a work item into ``(pid_m, pid_n, pid_k)``: the K-split is outermost, and inside one split the
output tiles are walked in a grouped raster — ``GROUP_M`` rows of tiles column by column — so that the
programs running at the same time share B's columns and A's rows in L2.

Async input (CK's ``PersistentAsyncInputScheduler``, PyTorch's ``_async_input_mm``)
-----------------------------------------------------------------------------------
A's rows arrive in chunks of ``rows_per_chunk`` rows (the last may be shorter); chunk ``c`` may be read
once ``chunk_signals[c] >= signal_value``. The protocol, as the kernel runs it:

- The raster is rotated so the pivot chunk comes first: ``tile_coords`` returns the pivoted M tile
  ``m_eff = (m + tile_idx_pivot_m) % tiles_m`` with ``tile_idx_pivot_m = pivot_chunk * rows_per_chunk
  // BLOCK_M``. That one ``m_eff`` gives the rows the program waits for, the rows of A it reads and
  the rows of C it writes (seed 000 hung because the wait and the reads used two different indices).
- Before a tile's K loop, ``wait_for_rows`` waits for every chunk the tile's rows touch: one chunk
  when chunks are whole tiles, two or more when a tile straddles chunk boundaries.
- The wait: a scalar atomic read with acquire semantics at system scope (a peer GPU or the copy
  engine may be the producer) — triton runs a scalar atomic in one thread and broadcasts the value
  through shared memory behind a CTA barrier, so the other threads' loads of A come after the acquire.
  If the chunk is not there yet, the program polls with volatile loads, sleeping (``nanosleep``)
  between polls, and once one sees the signal, reads it again with the acquire atomic. The producer
  writes the rows, then the signal with release semantics on its stream after the copy:
  ``stream_write_value32``, or a copy-engine copy of the epoch (the tests and the example) — neither
  needs an SM, which the waiting programs occupy.
- Nothing may load a kernel while the programs wait for a producer that has not been started: a CUDA
  kernel's first launch in a process loads its module, which waits for the kernels running on the device
  (H100: the host held until the waits gave up). So gemm.py loads every kernel of a call (a row tail's,
  split-K's reduction) before its first launch, and a caller that starts the producer after the call
  must not launch a kernel for the first time in between (the example's producer is copies only).
- Signals are epochs: ready means ``>= signal_value``, so a caller bumps ``signal_value`` each call
  and never zeroes the signals or barriers between calls.
- Bounded: after ``max_spins`` polls the chunk is recorded in the error table (``_runtime``), the tile
  is skipped (its K loop reads from row M on, which TMA zero-fills, and it stores nothing) and the
  program goes on with its other tiles; a later wait on a chunk already recorded gives up at once. The
  host raises ``TimeoutError`` naming the chunk.
- A row tail (``configs.select_plan``, gemm.py): where the large tile's last wave would be part-full (issue 3's
  4096x3584x8192 on 132 SMs), the launch stops ``tiles_m_skip`` pivoted row tiles short, and a second launch in a
  smaller tile computes those rows: the ones just before the pivot tile, i.e. the last in the order, so the rows
  that arrive last are still computed last. It runs on a row view of A and waits for their chunks as rows of A
  (``wait_row0``); where those rows would wrap around the end of A the launch is not split.
- Cost when every chunk has arrived: one acquire atomic per chunk per tile before its K loop (a 128x256
  tile over K = 8192 runs ~70 us; the poll is well under 1 us). When the compiler fuses the K loop
  into the tile loop (split_k 1, see gemm.py ``_can_flatten``), the next tile's wait runs in the
  pipeline's load stage, a few K steps before this tile ends, so its loads can start during this
  tile's epilogue; a chunk that is late then also holds back those last few K steps.
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch

from .._runtime import INTERPRET, is_interpreter

SIGNAL_DTYPES = (torch.int32, torch.uint32)
# Polls before a wait gives up. On a GPU one poll plus its sleep takes ~1 us, so the default is several
# seconds (8.6 s measured on an H100): far beyond any real arrival, short of a hung job. Under the
# interpreter programs run one after another, so nothing can arrive while a program waits: give up quickly.
DEFAULT_MAX_SPINS_GPU = 1 << 23
DEFAULT_MAX_SPINS_INTERPRETER = 16


@triton.jit
def tile_coords(tile_id, tiles_m, tiles_n, GROUP_M: tl.constexpr, pivot_tile_m=0, PIVOT: tl.constexpr = False,
                pivot_mod=0):
    """Work item -> (pid_m, pid_n, pid_k): K-split outermost, grouped raster inside; with ``PIVOT``,
    pid_m is the pivoted M tile ``m_eff`` that every later use (wait, loads, stores) shares.

    ``pivot_mod``: the M tiles the pivot rotates over, where a launch walks fewer (``tiles_m``: a launch whose
    last row tiles in this order a row tail computes); 0 means ``tiles_m``."""
    tiles_mn = tiles_m * tiles_n
    pid_k = tile_id // tiles_mn
    tile_mn = tile_id % tiles_mn
    tiles_in_group = GROUP_M * tiles_n
    group_id = tile_mn // tiles_in_group
    first_m = group_id * GROUP_M
    group_size_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile_mn % tiles_in_group) % group_size_m
    pid_n = (tile_mn % tiles_in_group) // group_size_m
    if PIVOT:
        pid_m = (pid_m + pivot_tile_m) % tl.where(pivot_mod > 0, pivot_mod, tiles_m)
    return pid_m, pid_n, pid_k


@triton.jit
def _poll(signal_ptr):
    # A scalar atomic: one thread reads, the value is broadcast to the CTA behind a barrier.
    return tl.atomic_add(signal_ptr, 0, sem="acquire", scope="sys").to(tl.int64)


@triton.jit
def _sleep():
    if not INTERPRET:
        tl.inline_asm_elementwise("nanosleep.u32 256; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def wait_chunk(signals, errors, chunk, signal_value, max_spins):
    """Wait until ``signals[chunk] >= signal_value``; True if it came, False after ``max_spins`` polls
    (then ``errors[1 + chunk]`` and ``errors[0]`` are set), or at once if an earlier wait of this call
    already gave up on the chunk."""
    seen = _poll(signals + chunk)
    ready = seen >= signal_value
    if seen < signal_value:
        gave_up = tl.load(errors + 1 + chunk, volatile=True) != 0
        spins = tl.where(gave_up, max_spins, 0)
        # Spin on plain volatile loads and acquire once at the end. Acquire atomics at system scope from
        # every waiting program slowed a copy-engine copy on the same GPU (probe on an H100, 8 MiB: p50
        # 183-202 us beside them, 33-71 us alone or beside a plain GEMM; beside volatile polls 12-38 us
        # but bimodal, p80 33-179 us): such copies are what the waits wait for.
        while (seen < signal_value) & (spins < max_spins):
            _sleep()
            seen = tl.load(signals + chunk, volatile=True).to(tl.int64)
            spins += 1
        seen = _poll(signals + chunk)
        ready = seen >= signal_value
        if seen < signal_value:
            tl.store(errors + 1 + chunk, 1)
            tl.store(errors, 1)
    return ready


@triton.jit
def wait_for_rows(signals, errors, row_start, row_end, rows_per_chunk, signal_value, max_spins):
    """Wait for every chunk that rows ``[row_start, row_end)`` of A touch; True if all arrived."""
    first = row_start // rows_per_chunk
    last = (row_end - 1) // rows_per_chunk
    ready = wait_chunk(signals, errors, first, signal_value, max_spins)
    # The loop over further chunks sits inside an `if` on purpose: a loop directly in the tile loop
    # (its bounds change per tile) would stop the compiler fusing the K loop into the tile loop.
    if last > first:
        for chunk in range(first + 1, last + 1):
            ready = ready & wait_chunk(signals, errors, chunk, signal_value, max_spins)
    return ready


class AsyncInputScheduler:
    """Describes A arriving in chunks of rows, for ``tk.gemm(a, b, async_input=...)``.

    Args:
        chunk_signals: int32 or uint32, one element per chunk, on A's device. Chunk ``c`` (rows
            ``c * rows_per_chunk`` up to the next chunk, the last may be shorter) may be read once
            ``chunk_signals[c] >= signal_value``.
        rows_per_chunk: rows of A per chunk (>= 1); ``len(chunk_signals)`` must equal
            ``ceil(M / rows_per_chunk)``.
        pivot_chunk: the chunk computed first (the one already local); the others follow in order,
            wrapping around.
        signal_value: the epoch a chunk's signal must reach; bump it each call instead of zeroing.
        max_spins: polls before a wait gives up (None: about seconds on a GPU, 16 under the
            interpreter). The tile is then skipped and ``TimeoutError`` names the chunk: at once under
            the interpreter; on a GPU at the next tilekernels call that checks (every async-input
            call does, without synchronising) or ``tk.raise_pending_errors()`` (which synchronises).

    Cost when every chunk has already arrived: one acquire load of a signal per chunk a tile's rows touch,
    made by one warp (the Hopper Gluon kernel's loader; gemm_kernel: one thread, then a CTA barrier) before
    the tile's first load of A, and no host work beyond the call's error check. Measured with every signal
    preset (H100, bf16, K 8192, M 4096-16384, N 3584/8192, 2026-12-07): 0.991-1.009x tk.gemm eager,
    0.999-1.015x under CUDA graphs (``bench gemm --variants async``; benchmarks/RESULTS.md).

    A producer started after the call must not launch a kernel for the first time in the process while the
    GEMM waits for it: loading a kernel waits for the kernels running on the device, the GEMM included, so
    that would hold the host until the waits give up. Start it before the call, use copies or
    ``stream_write_value32``, or launch its kernels once beforehand.
    """

    def __init__(self, chunk_signals: torch.Tensor, rows_per_chunk: int, pivot_chunk: int = 0,
                 signal_value: int = 1, max_spins: int | None = None):
        if not isinstance(chunk_signals, torch.Tensor):
            raise TypeError(f"chunk_signals must be a torch.Tensor, got {type(chunk_signals).__name__}")
        if chunk_signals.dtype not in SIGNAL_DTYPES:
            raise TypeError(f"chunk_signals must be int32 or uint32, got {chunk_signals.dtype}")
        if chunk_signals.dim() != 1 or chunk_signals.numel() < 1:
            raise ValueError(f"chunk_signals must be 1-D with one element per chunk, got shape "
                             f"{tuple(chunk_signals.shape)}")
        if chunk_signals.numel() > 1 and chunk_signals.stride(0) != 1:
            raise ValueError("chunk_signals must be contiguous")
        for name, v in (("rows_per_chunk", rows_per_chunk), ("pivot_chunk", pivot_chunk),
                        ("signal_value", signal_value)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if rows_per_chunk < 1:
            raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
        num_chunks = chunk_signals.numel()
        if not 0 <= pivot_chunk < num_chunks:
            raise ValueError(f"pivot_chunk must be in [0, {num_chunks}) for {num_chunks} chunk_signals, "
                             f"got {pivot_chunk}")
        lo, hi = (-2**31, 2**31) if chunk_signals.dtype == torch.int32 else (0, 2**32)
        if not lo <= signal_value < hi:
            raise ValueError(f"signal_value {signal_value} does not fit chunk_signals' {chunk_signals.dtype}")
        if max_spins is not None and (not isinstance(max_spins, int) or isinstance(max_spins, bool)
                                      or not 1 <= max_spins < 2**31):
            raise ValueError(f"max_spins must be None or an int in [1, 2^31), got {max_spins!r}")
        self.chunk_signals = chunk_signals
        self.rows_per_chunk = rows_per_chunk
        self.pivot_chunk = pivot_chunk
        self.signal_value = signal_value
        self.max_spins = max_spins

    @property
    def num_chunks(self) -> int:
        return self.chunk_signals.numel()

    def spins(self) -> int:
        if self.max_spins is not None:
            return self.max_spins
        return DEFAULT_MAX_SPINS_INTERPRETER if is_interpreter() else DEFAULT_MAX_SPINS_GPU

    def __repr__(self) -> str:
        return (f"AsyncInputScheduler({self.num_chunks} chunks of {self.rows_per_chunk} rows, pivot_chunk="
                f"{self.pivot_chunk}, signal_value={self.signal_value}, max_spins={self.max_spins})")
