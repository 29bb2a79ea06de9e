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
At 32768 columns dw alone is 128 KiB, the staged row no longer fits beside it, and a row held in
registers spills, so ``_kernels.SMEM_BACKWARD_CONFIGS`` takes this kernel at 16384 columns only (H100
figures there). ``smem_backward_applies`` says which calls it can take.
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


def smem_backward_bytes(block_n: int, want_dw: bool, want_db: bool, prefetch: int, x_dtype, dy_dtype) -> int:
    """Shared memory the kernel allocates beyond the reductions' scratch: the fp32 sums and the staged row."""
    stage = block_n * (x_dtype.itemsize + dy_dtype.itemsize) if prefetch == 2 else 0
    return 4 * block_n * (int(want_dw) + int(want_db)) + stage


def _aligned(t: torch.Tensor) -> bool:
    """Row starts 16-byte aligned, as triton sees them (pointer and row stride divisible by 16)."""
    return t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0


def smem_backward_applies(x: torch.Tensor, dy: torch.Tensor, ds, config, block_n: int, want_dw: bool,
                          want_db: bool) -> bool:
    """Whether the Gluon backward runs ``config`` for these tensors: it needs Gluon, a CUDA device of compute
    capability 8.0 or later, unit column strides and shared memory for its sums (and the staged row). cp.async
    (prefetch 2) copies 4 bytes or more per thread and so also needs 16-byte aligned rows and N a multiple of
    16; where that fails the Triton backward runs (the Gluon one with the next row in registers measured no
    faster than it)."""
    if config is None or not HAVE_GLUON or is_interpreter() or x.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 8 or not (want_dw or want_db):
        return False
    if any(t is not None and t.shape[1] > 1 and t.stride(1) != 1 for t in (x, dy, ds)):
        return False
    if config.prefetch == 2 and not (x.shape[1] % 16 == 0 and _aligned(x) and _aligned(dy)):
        return False
    return smem_backward_bytes(block_n, want_dw, want_db, config.prefetch, x.dtype, dy.dtype) <= SMEM_BYTES


if HAVE_GLUON:

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
    def _row_backward_smem(x_ptr, xbias_ptr, dy_ptr, ds_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr,
                           db_part_ptr, M, N, stride_xm, stride_dym, stride_dsm,
                           NORM: gl.constexpr, HAS_W: gl.constexpr, HAS_XBIAS: gl.constexpr, HAS_DS: gl.constexpr,
                           WANT_DW: gl.constexpr, WANT_DB: gl.constexpr, PREFETCH: gl.constexpr,
                           BLOCK_N: gl.constexpr, VEC: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [gl.num_warps()], [0])
        smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        cols = gl.arange(0, BLOCK_N, layout=layout)
        mask_n = cols < N
        zero = gl.zeros([BLOCK_N], gl.float32, layout)
        if WANT_DW:
            dw_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N], smem_layout, zero)
        if WANT_DB:
            db_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N], smem_layout, zero)
        if PREFETCH == 2:   # the next row waits in shared memory, copied there by cp.async
            x_stage = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [BLOCK_N], smem_layout)
            dy_stage = gl.allocate_shared_memory(dy_ptr.dtype.element_ty, [BLOCK_N], smem_layout)
            _stage_row(x_stage, dy_stage, x_ptr, dy_ptr, pid, M, cols, mask_n, stride_xm, stride_dym)
        elif PREFETCH == 1:   # in registers
            x_next, dy_next = _load_row(x_ptr, dy_ptr, pid, M, cols, mask_n, stride_xm, stride_dym)
        for row in range(pid, M, programs):
            if PREFETCH == 2:
                async_copy.wait_group(0)
                x = x_stage.load(layout)
                dy = dy_stage.load(layout)
                _stage_row(x_stage, dy_stage, x_ptr, dy_ptr, row + programs, M, cols, mask_n, stride_xm, stride_dym)
            elif PREFETCH == 1:
                x = x_next
                dy = dy_next
                x_next, dy_next = _load_row(x_ptr, dy_ptr, row + programs, M, cols, mask_n, stride_xm, stride_dym)
            else:
                x, dy = _load_row(x_ptr, dy_ptr, row, M, cols, mask_n, stride_xm, stride_dym)
            rstd = gl.load(rstd_ptr + row)
            xhat, g = _row_values(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM, HAS_W, HAS_XBIAS)
            if NORM == NORM_LAYER:
                sum_gx, sum_g = gl.reduce((g * xhat, g), 0, _add_pairs)
                dx = (g - xhat * (sum_gx / N) - sum_g / N) * rstd
            else:
                dx = (g - xhat * (gl.sum(g * xhat, axis=0) / N)) * rstd
            if HAS_DS:
                dx += gl.load(ds_ptr + row.to(gl.int64) * stride_dsm + cols, mask=mask_n, other=0.0).to(gl.float32)
            gl.store(dx_ptr + row.to(gl.int64) * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask_n)
            if WANT_DW:
                dw_smem.store(dw_smem.load(layout) + dy.to(gl.float32) * xhat)
            if WANT_DB:
                db_smem.store(db_smem.load(layout) + dy.to(gl.float32))
        if PREFETCH == 2:   # the last copy (of no row: masked) lands before the program exits
            async_copy.wait_group(0)
        part_row = pid.to(gl.int64) * N
        if WANT_DW:
            gl.store(dw_part_ptr + part_row + cols, dw_smem.load(layout), mask=mask_n)
        if WANT_DB:
            gl.store(db_part_ptr + part_row + cols, db_smem.load(layout), mask=mask_n)
