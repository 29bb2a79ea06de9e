"""Device side of tk.dist's flags: bounded waits on epoch words and the per-call begin step.

Every flag is an int32 word in a rank's symmetric flag area (``workspace.py`` has the map) holding an
epoch: the value of the call that last set it. A wait is "word >= epoch": a scalar acquire atomic at
system scope (the writer may be another GPU or a copy engine); while the word is short, volatile loads
with a nanosleep between them, and the acquire atomic again once one sees it;
after ``max_spins`` polls it gives up and records the word in the workspace's error table
(``errors[1 + word]`` and ``errors[0]``), so the host can say which rank never arrived.
"""

import triton
import triton.language as tl

from ..gemm.scheduler import wait_chunk


@triton.jit
def wait_flag(flags, word, epoch, errors, max_spins):
    """Wait until ``flags[word] >= epoch``; True if it came, False after ``max_spins`` polls (recorded),
    or at once if an earlier wait already gave up on this word: the async-input GEMM's chunk wait
    (``scheduler.wait_chunk``), with the flag words as its chunks."""
    return wait_chunk(flags, errors, word, epoch, max_spins)


@triton.jit(do_not_specialize=["rank", "world", "max_spins", "own_signal"])  # launched directly (Workspace)
def begin_kernel(flags, errors, rank, world, max_spins, own_signal, EPOCH: tl.constexpr, DONE: tl.constexpr):
    """One program: advance this rank's epoch to e, then wait until every peer has finished call e - 1
    (``flags[DONE + peer] >= e - 1``, written by the peer's ``end``): after that no peer still reads
    or writes this call's buffers from the previous call, so they may be overwritten. With
    ``own_signal >= 0`` also ``flags[own_signal] := e`` (a chunk whose data the same stream writes
    before its consumer runs, so it needs no signal of its own)."""
    epoch = tl.load(flags + EPOCH, volatile=True) + 1
    tl.store(flags + EPOCH, epoch)
    if own_signal >= 0:
        tl.store(flags + own_signal, epoch)
    for peer in range(world):
        if peer != rank:
            wait_flag(flags, DONE + peer, epoch - 1, errors, max_spins)


@triton.jit(do_not_specialize=["first", "count", "skip", "max_spins"])  # launched directly (Workspace)
def wait_words_kernel(flags, errors, first, count, skip, max_spins, EPOCH: tl.constexpr):
    """One program: wait until ``flags[first + i] >=`` this rank's epoch for every i in ``[0, count)``
    but ``skip`` (bounded and recorded as in ``wait_flag``), so that what a stream enqueues after it
    runs only once those words have been written (by peers or copy engines)."""
    epoch = tl.load(flags + EPOCH, volatile=True)
    for i in range(count):
        if i != skip:
            wait_flag(flags, first + i, epoch, errors, max_spins)
