"""The norm backward for wide rows, in Gluon: dw and db summed in shared memory.

The Triton backward (``_kernels._row_backward``) keeps a program's dw/db sums in registers. Past 8192
columns a whole row of them does not fit beside the row's x and dy, so there each row is split over
column programs that re-read the whole row from L2 for the row sums (0.47-0.76 of copy bandwidth at
N 16384-32768, benchmarks/NOTES.md). Here one persistent program per SM owns whole rows and keeps the
sums in shared memory instead, which Triton cannot allocate explicitly but Gluon can::

    for row in rows pid, pid + P, ...:
        x, dy of this row                         (registers: the whole row)
        the next row's x and dy                   -> shared memory by cp.async (PREFETCH 2), or registers (1)
        xhat, g = ..., dy * w
        sums of g * xhat and g                    (one reduction)
        dx = rstd * (g - xhat * mean(g * xhat) - mean(g))   -> stored
        dw_smem += dy * xhat;  db_smem += dy      (each thread its own elements)

and at the end writes its sums to row ``pid`` of the ``[P, N]`` fp32 partial buffers that
``_kernels._sum_rows`` adds in a fixed order, as the Triton path does: dw and db are bit-identical run
to run. The shared-memory accumulators are loaded and stored in the register layout of the row, so
each thread reads back only what it wrote.

Shared memory bounds it: dw and db of a 16384-column row are 128 KiB and the staged bf16 row 64 KiB.
Wider rows are shared (``SPLIT`` > 1): ``SPLIT`` programs each own ``N / SPLIT`` columns of
a group's rows, with their sums in shared memory as above, and exchange their parts of each row's two
sums through global memory (one int64 word per sum, the value's bits with a "here" bit above them, in
a ``[M, SPLIT, 2]`` buffer zeroed per call), adding them in part order, so dx, dw and db are
bit-identical run to run and the same in every program of a row. A program publishes its part, updates
dw/db, then polls; a program whose partner has not published after ``max_spins`` polls (it could only
be one that is not resident) sums that part of the row itself from memory, with the same code and so
the same bits, and waits no more. ``_kernels.SMEM_BACKWARD_CONFIGS`` says which widths take which
kernel (H100 figures there); ``smem_backward_applies`` says which calls they can take.
"""

from __future__ import annotations

import torch

from .._runtime import is_interpreter
from ._kernels import NORM_LAYER

try:  # gluon ships with triton 3.6 and 3.9
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    # triton 3.9 renamed the cp.async copy (the old name raises there); 3.6 has only the old one
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

SMEM_BYTES = 200 * 1024   # of the 227 KiB an H100 program may have, leaving room for the reductions' scratch
# polls of a partner's row sums (split rows) before a program gives up and sums that part of the row itself;
# a negative value never polls (tests: the fallback gives the same bits)
max_spins = 1 << 16


def smem_backward_bytes(block_n: int, want_dw: bool, want_db: bool, prefetch: int, x_dtype, dy_dtype) -> int:
    """Shared memory a program allocates beyond the reductions' scratch (``block_n``: its columns): the fp32
    sums and the staged row."""
    stage = block_n * (x_dtype.itemsize + dy_dtype.itemsize) if prefetch == 2 else 0
    return 4 * block_n * (int(want_dw) + int(want_db)) + stage


def _aligned(t: torch.Tensor) -> bool:
    """Row starts 16-byte aligned, as triton sees them (pointer and row stride divisible by 16)."""
    return t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0


def smem_backward_applies(x: torch.Tensor, dy: torch.Tensor, ds, config, block_n: int, want_dw: bool,
                          want_db: bool) -> bool:
    """Whether the Gluon backward runs ``config`` for these tensors (``block_n``: the row's power-of-two width,
    which ``config.split`` programs share): it needs Gluon, a CUDA device of compute capability 8.0 or later,
    unit column strides and shared memory for its sums (and the staged row). cp.async (prefetch 2) copies 4
    bytes or more per thread and so also needs 16-byte aligned rows and N a multiple of 16; where that fails
    the Triton backward runs (the Gluon one with the next row in registers measured no faster than it)."""
    if config is None or not HAVE_GLUON or is_interpreter() or x.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 8 or not (want_dw or want_db):
        return False
    if any(t is not None and t.shape[1] > 1 and t.stride(1) != 1 for t in (x, dy, ds)):
        return False
    if config.prefetch == 2 and not (x.shape[1] % 16 == 0 and _aligned(x) and _aligned(dy)):
        return False
    return smem_backward_bytes(block_n // config.split, want_dw, want_db, config.prefetch, x.dtype,
                               dy.dtype) <= SMEM_BYTES


if HAVE_GLUON:
    # the split backward's exchange words (``_word``)
    _READY = gl.constexpr(1 << 32)
    _LOW_BITS = gl.constexpr(0xFFFFFFFF)

    @gluon.jit
    def _add_pairs(a0, b0, a1, b1):
        return a0 + a1, b0 + b1

    @gluon.jit
    def _load_row(x_ptr, dy_ptr, row, M, cols, mask_n, stride_xm, stride_dym):
        mask = mask_n & (row < M)
        x = gl.load(x_ptr + row.to(gl.int64) * stride_xm + cols, mask=mask, other=0.0)
        dy = gl.load(dy_ptr + row.to(gl.int64) * stride_dym + cols, mask=mask, other=0.0)
        return x, dy

    @gluon.jit
    def _row_values(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM: gl.constexpr,
                    HAS_W: gl.constexpr, HAS_XBIAS: gl.constexpr):
        """(xhat, g = dy * w) fp32 of one loaded row, xhat 0 past N."""
        v = x.to(gl.float32)
        if HAS_XBIAS:
            v += gl.load(xbias_ptr + cols, mask=mask_n, other=0.0).to(gl.float32)
        if NORM == NORM_LAYER:
            xhat = (v - gl.load(mean_ptr + row)) * rstd
        else:
            xhat = v * rstd
        g = dy.to(gl.float32)
        if HAS_W:
            g = g * gl.load(w_ptr + cols, mask=mask_n, other=0.0).to(gl.float32)
        return gl.where(mask_n, xhat, 0.0), g

    @gluon.jit
    def _stage_row(x_stage, dy_stage, x_ptr, dy_ptr, row, M, cols, mask_n, stride_xm, stride_dym):
        mask = mask_n & (row < M)
        _async_load(x_stage, x_ptr + row.to(gl.int64) * stride_xm + cols, mask=mask)
        _async_load(dy_stage, dy_ptr + row.to(gl.int64) * stride_dym + cols, mask=mask)
        async_copy.commit_group()

    @gluon.jit
    def _part_sums(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM: gl.constexpr,
                   HAS_W: gl.constexpr, HAS_XBIAS: gl.constexpr):
        """(xhat, g, sum of g * xhat, sum of g) over the columns ``cols`` of one loaded row (rms norm: the
        second sum is not needed, and is 0 times the first). The same code and layout for a program's own
        part of a row and for a partner's part re-read after a wait gave up, so both give the same bits."""
        xhat, g = _row_values(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM, HAS_W, HAS_XBIAS)
        if NORM == NORM_LAYER:
            sum_gx, sum_g = gl.reduce((g * xhat, g), 0, _add_pairs)
        else:
            sum_gx = gl.sum(g * xhat, axis=0)
            sum_g = sum_gx * 0.0
        return xhat, g, sum_gx, sum_g

    @gluon.jit
    def _word(value):
        """An fp32 partial sum as an int64 exchange word: the value's bits below, 1 above (a zeroed word
        reads as "not yet"). One 64-bit store, so a reader sees the value whole or not at all."""
        return value.to(gl.uint32, bitcast=True).to(gl.int64) | _READY

    @gluon.jit
    def _unword(word):
        return (word & _LOW_BITS).to(gl.uint32).to(gl.float32, bitcast=True)

    @gluon.jit
    def _accumulate(dw_smem, db_smem, dy, xhat, layout: gl.constexpr, WANT_DW: gl.constexpr, WANT_DB: gl.constexpr):
        """dw += dy * xhat and db += dy in shared memory (each thread its own elements)."""
        if WANT_DW:
            dw_smem.store(dw_smem.load(layout) + dy.to(gl.float32) * xhat)
        if WANT_DB:
            db_smem.store(db_smem.load(layout) + dy.to(gl.float32))

    @gluon.jit
    def _load_words(word_ptr, spins_left):
        """A part's two exchange words, or zeros (not there) once this program has stopped waiting."""
        polling = spins_left >= 0
        return (gl.load(word_ptr, mask=polling, other=0, volatile=True),
                gl.load(word_ptr + 1, mask=polling, other=0, volatile=True))

    @gluon.jit
    def _partner_sums(w0, w1, word_ptr, x_ptr, dy_ptr, xbias_ptr, w_ptr, mean_ptr, row, rstd, part, M, N, stride_xm,
                      stride_dym, spins_left, layout: gl.constexpr, NORM: gl.constexpr, HAS_W: gl.constexpr,
                      HAS_XBIAS: gl.constexpr, BLOCK_N: gl.constexpr):
        """Column part ``part``'s sums for ``row`` from its program's words (``w0, w1`` as last loaded from
        ``word_ptr``), polled up to ``spins_left`` more times. If they have not come by then (the partner
        program is not resident, say), that part of the row is read from memory and summed here, and
        ``spins_left`` becomes -1, so this program waits no more. Returns (sum of g * xhat, sum of g, spins
        left)."""
        while (w0 & w1 & _READY) == 0:
            if spins_left > 0:
                spins_left -= 1
                w0, w1 = _load_words(word_ptr, spins_left)
            else:
                cols = part * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
                mask_n = cols < N
                x, dy = _load_row(x_ptr, dy_ptr, row, M, cols, mask_n, stride_xm, stride_dym)
                _, _, sum_gx, sum_g = _part_sums(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM,
                                                 HAS_W, HAS_XBIAS)
                w0 = _word(sum_gx)
                w1 = _word(sum_g)
                spins_left = -1
        return _unword(w0), _unword(w1), spins_left

    @gluon.jit
    def _row_backward_smem(x_ptr, xbias_ptr, dy_ptr, ds_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr,
                           db_part_ptr, xchg_ptr, M, N, stride_xm, stride_dym, stride_dsm, max_spins,
                           NORM: gl.constexpr, HAS_W: gl.constexpr, HAS_XBIAS: gl.constexpr, HAS_DS: gl.constexpr,
                           WANT_DW: gl.constexpr, WANT_DB: gl.constexpr, PREFETCH: gl.constexpr,
                           BLOCK_N: gl.constexpr, VEC: gl.constexpr, SPLIT: gl.constexpr):
        """``SPLIT`` programs (a group; 1 for rows of ``BLOCK_N`` columns or fewer) share the group's rows,
        each ``BLOCK_N`` columns of them (``cols``). With ``SPLIT > 1`` a program
        publishes its part's two row sums (``_word``), updates dw/db while its partners' come (two programs:
        the partner's words are loaded before that update), and adds all parts' sums in part order
        (``_partner_sums``) before its dx."""
        layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [gl.num_warps()], [0])
        smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        pid = gl.program_id(0)
        groups = gl.num_programs(0) // SPLIT
        group = pid // SPLIT
        part = pid % SPLIT
        cols = part * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
        mask_n = cols < N
        zero = gl.zeros([BLOCK_N], gl.float32, layout)
        dw_smem = None
        db_smem = None
        if WANT_DW:
            dw_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N], smem_layout, zero)
        if WANT_DB:
            db_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N], smem_layout, zero)
        if PREFETCH == 2:   # the next row waits in shared memory, copied there by cp.async
            x_stage = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [BLOCK_N], smem_layout)
            dy_stage = gl.allocate_shared_memory(dy_ptr.dtype.element_ty, [BLOCK_N], smem_layout)
            _stage_row(x_stage, dy_stage, x_ptr, dy_ptr, group, M, cols, mask_n, stride_xm, stride_dym)
        elif PREFETCH == 1:   # in registers
            x_next, dy_next = _load_row(x_ptr, dy_ptr, group, M, cols, mask_n, stride_xm, stride_dym)
        spins_left = max_spins
        for row in range(group, M, groups):
            if PREFETCH == 2:
                async_copy.wait_group(0)
                x = x_stage.load(layout)
                dy = dy_stage.load(layout)
                _stage_row(x_stage, dy_stage, x_ptr, dy_ptr, row + groups, M, cols, mask_n, stride_xm, stride_dym)
            elif PREFETCH == 1:
                x = x_next
                dy = dy_next
                x_next, dy_next = _load_row(x_ptr, dy_ptr, row + groups, M, cols, mask_n, stride_xm, stride_dym)
            else:
                x, dy = _load_row(x_ptr, dy_ptr, row, M, cols, mask_n, stride_xm, stride_dym)
            rstd = gl.load(rstd_ptr + row)
            xhat, g, sum_gx, sum_g = _part_sums(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM,
                                                HAS_W, HAS_XBIAS)
            if SPLIT > 1:
                own_gx = sum_gx
                own_g = sum_g
                words = xchg_ptr + row.to(gl.int64) * (2 * SPLIT)
                gl.atomic_xchg(words + 2 * part, _word(own_gx), sem="relaxed", scope="gpu")
                gl.atomic_xchg(words + 2 * part + 1, _word(own_g), sem="relaxed", scope="gpu")
                if SPLIT == 2:   # the partner's words: the loads overlap the dw/db update
                    w0, w1 = _load_words(words + 2 * (1 - part), spins_left)
                _accumulate(dw_smem, db_smem, dy, xhat, layout, WANT_DW, WANT_DB)
                sum_gx = 0.0
                sum_g = 0.0
                for other in gl.static_range(SPLIT):
                    if other == part:
                        part_gx = own_gx
                        part_g = own_g
                    else:
                        if SPLIT > 2:
                            w0, w1 = _load_words(words + 2 * other, spins_left)
                        part_gx, part_g, spins_left = _partner_sums(
                            w0, w1, words + 2 * other, x_ptr, dy_ptr, xbias_ptr, w_ptr, mean_ptr, row, rstd, other, M,
                            N, stride_xm, stride_dym, spins_left, layout, NORM, HAS_W, HAS_XBIAS, BLOCK_N)
                    sum_gx += part_gx
                    sum_g += part_g
            if NORM == NORM_LAYER:
                dx = (g - xhat * (sum_gx / N) - sum_g / N) * rstd
            else:
                dx = (g - xhat * (sum_gx / N)) * rstd
            if HAS_DS:
                dx += gl.load(ds_ptr + row.to(gl.int64) * stride_dsm + cols, mask=mask_n, other=0.0).to(gl.float32)
            gl.store(dx_ptr + row.to(gl.int64) * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask_n)
            if SPLIT == 1:
                _accumulate(dw_smem, db_smem, dy, xhat, layout, WANT_DW, WANT_DB)
        if PREFETCH == 2:   # the last copy (of no row: masked) lands before the program exits
            async_copy.wait_group(0)
        part_row = group.to(gl.int64) * N
        if WANT_DW:
            gl.store(dw_part_ptr + part_row + cols, dw_smem.load(layout), mask=mask_n)
        if WANT_DB:
            gl.store(db_part_ptr + part_row + cols, db_smem.load(layout), mask=mask_n)
