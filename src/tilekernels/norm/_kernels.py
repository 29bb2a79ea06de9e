"""Row kernels behind the norms and the quantisation ops: one forward kernel, one backward kernel.

Forward, per row of ``N`` values (``_row_forward``)::

    v = x (+ x_bias) (+ residual -> rounded to x's dtype and stored as s)
    layer: y = (v - mean) * rstd * w + b,  rstd = 1 / sqrt(mean((v - mean)^2) + eps)
    rms:   y = v * rstd * w,               rstd = 1 / sqrt(mean(v^2) + eps)
    none:  y = v                           (tk.dynamic_quant / smooth_quant / moe_smooth_quant)
    quant: z = y (* smooth_scale[expert]); row_scale = max|z| / QMAX; q = round(z * QMAX / max|z|)

Every op of ``tk.norm`` and ``tk.quant`` is this kernel with other constexpr switches, so the
residual add, the statistics, the affine step and the quantisation are written once. (Two exceptions run
the same helpers in a loop of their own, where that measured faster on a GPU: ``_quant_rows`` for
smooth_quant at 32768 columns, ``lean_quant``, and the Gluon MoE forward of ``_gluon``.)

A row that fits one tile (``N <= BLOCK_N``) is read from memory once and kept in registers, one row
tile per program -- or, for some widths of the quantisation ops, in a persistent loop over row tiles
that loads the fp32 smooth scales once per program (``PERSISTENT``; which widths: ``TUNED_FORWARD``).
A longer row is read in ``BLOCK_N`` chunks several times -- statistics (Chan's parallel mean/variance merge),
then (with quantisation) the row's max|z|, then the outputs: one program owns the row, so the later
passes find it in L2 (a 64k-column bf16 row is 128 KB) and HBM still sees one read. With a residual
the first pass stores s and the later passes read s back instead of x and the residual.

Backward (``_row_backward``), with ``xhat = (v - mean) * rstd`` and ``g = dy * w``::

    layer: dx = rstd * (g - xhat * mean(g * xhat) - mean(g))      (+ ds, the gradient of s)
    rms:   dx = rstd * (g - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,  db = sum over rows of dy

A grid of ``row_programs x SPLIT_N`` programs: program (r, c) handles column block c of the row
tiles r, r + row_programs, ..., keeping its block's dw/db sums in registers and writing them to
row r of a ``[row_programs, N]`` fp32 partial buffer; ``_sum_rows`` then adds the partial rows in a
fixed order, so dw and db are bit-identical run to run. When a row is wider than one block
(``SPLIT_N > 1``) each program first sums ``g * xhat`` and ``g`` over the whole row (the programs of
one row tile run side by side, so most of those reads come from L2), then reloads its own block and
computes dx and the block's dw/db sums: registers hold one block of dw/db instead of the whole row's.
(Keeping the own block in registers through the sums instead spilled: 0.14 of copy bandwidth at
N = 32768 against 0.46.) On a GPU, rows of 16384 columns take the Gluon backward instead
(``_gluon._row_backward_smem``): whole rows per program, dw/db sums in shared memory, the next row
copied in by cp.async; rows up to 65536 columns the same with 2 or 4 programs per row that exchange
their parts of the row sums (``SMEM_BACKWARD_CONFIGS``).

int8 rounding is half to even, as ``torch.round``: adding 1.5 * 2^23 to |v| <= 127 leaves an fp32
value with no fractional bits, rounded by the FPU in its default (nearest-even) mode, whose low byte is
the int8 (``_quantize``).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from .._runtime import INTERPRET, cast_for_store, is_interpreter, sm_count

NORM_NONE = tl.constexpr(0)
NORM_LAYER = tl.constexpr(1)
NORM_RMS = tl.constexpr(2)
NORMS = {"none": NORM_NONE.value, "layer": NORM_LAYER.value, "rms": NORM_RMS.value}

QUANT_NONE = tl.constexpr(0)
QUANT_DYNAMIC = tl.constexpr(1)
QUANT_SMOOTH = tl.constexpr(2)
QUANTS = {None: QUANT_NONE.value, "dynamic": QUANT_DYNAMIC.value, "smooth": QUANT_SMOOTH.value}

ROUND_HALF_EVEN = tl.constexpr(12582912.0)   # 1.5 * 2^23
# _row_scales (and the Gluon MoE loop's copy of it, norm/_gluon.py): rows with max|z| below TINY_AMAX are
# scaled by PRESCALE first; FP32_MAX tells finite from inf
TINY_AMAX = tl.constexpr(7.888609052210118e-31)   # 2^-100
PRESCALE = tl.constexpr(1.2676506002282294e30)    # 2^100
FP32_MAX = tl.constexpr(3.4028234663852886e38)


# ----------------------------------------------------------------------------------------------------
# forward


@triton.jit
def _vector(ptr, cols, mask_n, PRESENT: tl.constexpr):
    """``ptr[cols]`` as fp32 (0 past N), or zeros when the operand is absent."""
    if PRESENT:
        v = tl.load(ptr + cols, mask=mask_n, other=0.0).to(tl.float32)
    else:
        v = cols.to(tl.float32) * 0.0
    return v


@triton.jit
def _column_mask(cols, N, EVEN_N: tl.constexpr):
    """``cols < N``, or a constant true mask when N fills the block: the compiler then drops the
    per-element selects and predicates (the quantising ops run near the SM's issue limit)."""
    if EVEN_N:
        return tl.full(cols.shape, 1, tl.int1)
    return cols < N


@triton.jit
def _smooth_vector(smooth_ptr, cols, mask_n, QUANT: tl.constexpr, TOPK: tl.constexpr):
    """The smooth-scale row of a non-MoE smooth quantisation (MoE rows load their expert's row each)."""
    if QUANT == QUANT_SMOOTH and TOPK == 0:
        v = _vector(smooth_ptr, cols, mask_n, True)
    else:
        v = cols.to(tl.float32) * 0.0
    return v


@triton.jit
def _forward_rows(tile, M, N, T, num_experts, topk_ptr, stride_xm, stride_rm, stride_sm, stride_tk_t, stride_tk_j,
                  TOPK: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows of tile ``tile``: (output rows, in range, valid, smooth-scale row offsets, x / residual /
    output row offsets). MoE: tiles walk the rows token by token (token t's k rows j * T + t one after
    another), so a token's row of x is read from HBM once and from L2 for its other k - 1 experts."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < M
    if TOPK > 0:
        token = rows // TOPK
        choice = rows % TOPK
        rows = choice * T + token
        expert = tl.load(topk_ptr + token.to(tl.int64) * stride_tk_t + choice * stride_tk_j, mask=mask_m,
                         other=0).to(tl.int64)
        valid = mask_m & (expert >= 0) & (expert < num_experts)
        smooth_row = tl.where(valid, expert, 0)[:, None] * stride_sm
    else:
        token = rows
        valid = mask_m
        smooth_row = rows.to(tl.int64)[:, None] * 0
    x_row = token.to(tl.int64)[:, None] * stride_xm
    res_row = rows.to(tl.int64)[:, None] * stride_rm
    out_row = rows.to(tl.int64)[:, None] * N
    return rows, mask_m, valid, smooth_row, x_row, res_row, out_row


@triton.jit
def _load_input(x_ptr, res_ptr, x_row, res_row, cols, mask, stride_xn, stride_rn, HAS_RESIDUAL: tl.constexpr):
    """x and the residual of a tile as stored (the residual is x again when there is none)."""
    x = tl.load(x_ptr + x_row + cols[None, :] * stride_xn, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + res_row + cols[None, :] * stride_rn, mask=mask, other=0.0)
    else:
        res = x
    return x, res


@triton.jit
def _tile_input(tile, x_ptr, res_ptr, topk_ptr, cols, mask_n, M, N, T, num_experts, stride_xm, stride_xn, stride_rm,
                stride_rn, stride_sm, stride_tk_t, stride_tk_j, HAS_RESIDUAL: tl.constexpr, TOPK: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """x and the residual of whole-row tile ``tile`` (``_load_input``; nothing past M), and its rows' valid
    flags and smooth-scale row offsets (``_forward_rows``): MoE's expert ids come with the prefetched rows,
    so the next tile's expert rows can be read without first waiting for its ids."""
    rows, mask_m, valid, smooth_row, x_row, res_row, out_row = _forward_rows(
        tile, M, N, T, num_experts, topk_ptr, stride_xm, stride_rm, stride_sm, stride_tk_t, stride_tk_j, TOPK,
        BLOCK_M)
    x, res = _load_input(x_ptr, res_ptr, x_row, res_row, cols, mask_m[:, None] & mask_n[None, :], stride_xn,
                         stride_rn, HAS_RESIDUAL)
    return x, res, valid, smooth_row


@triton.jit
def _row_values(x, res, xb, sum_ptr, out_row, cols, mask, HAS_XBIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                WRITE_SUM: tl.constexpr):
    """The values the norm sees, fp32 ``[BLOCK_M, BLOCK_N]``: x (+ x_bias) (+ residual, rounded to s's
    dtype and stored when ``WRITE_SUM``)."""
    v = x.to(tl.float32)
    if HAS_XBIAS:
        v += xb[None, :]
    if HAS_RESIDUAL:
        v += res.to(tl.float32)
        s = cast_for_store(v, sum_ptr.dtype.element_ty)
        if WRITE_SUM:
            tl.store(sum_ptr + out_row + cols[None, :], s, mask=mask)
        v = s.to(tl.float32)
    return v


@triton.jit
def _chunk_values(x_ptr, res_ptr, sum_ptr, xbias_ptr, x_row, res_row, out_row, cols, mask, mask_n, stride_xn,
                  stride_rn, HAS_XBIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, READ_SUM: tl.constexpr,
                  WRITE_SUM: tl.constexpr):
    """``_row_values`` of one chunk of a long row, loaded here; ``READ_SUM``: s as the first pass stored it."""
    if READ_SUM:
        v = tl.load(sum_ptr + out_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        x, res = _load_input(x_ptr, res_ptr, x_row, res_row, cols, mask, stride_xn, stride_rn, HAS_RESIDUAL)
        v = _row_values(x, res, _vector(xbias_ptr, cols, mask_n, HAS_XBIAS), sum_ptr, out_row, cols, mask,
                        HAS_XBIAS, HAS_RESIDUAL, WRITE_SUM)
    return v


@triton.jit
def _div(a, b, EXACT: tl.constexpr):
    """``a / b`` per row: correctly rounded when ``EXACT`` (fp32 layer norm), else triton's approximate
    division (2 ulp on the GPU), which is far below the rounding of a bf16 or fp16 output."""
    if EXACT:
        return tl.math.div_rn(a, tl.zeros_like(a) + b)   # not a * 0 + b: an inf a would make that NaN
    return a / b


@triton.jit
def _inv_sqrt(v, EXACT: tl.constexpr):
    """``1 / sqrt(v)`` per row: correctly rounded square root and division when ``EXACT`` (fp32 layer
    norm), else the hardware's approximate rsqrt."""
    if EXACT:
        return tl.math.div_rn(tl.zeros_like(v) + 1.0, tl.math.sqrt_rn(v))   # v = inf (overflow) -> 0, as rsqrt
    return tl.rsqrt(v)


@triton.jit
def _affine(v, mean, rstd, w, b, NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """``(v - mean) * rstd * w + b`` (layer), ``v * rstd * w`` (rms) or ``v`` (none), in fp32."""
    if NORM == NORM_LAYER:
        y = (v - mean[:, None]) * rstd[:, None]
    elif NORM == NORM_RMS:
        y = v * rstd[:, None]
    else:
        y = v
    if HAS_W:
        y = y * w[None, :]
    if HAS_B:
        y = y + b[None, :]
    return y


@triton.jit
def _smoothed(y, smooth, smooth_ptr, smooth_row, cols, mask, QUANT: tl.constexpr, TOPK: tl.constexpr):
    """``y * smooth_scale`` for smooth quantisation (``smooth``, loaded once; MoE: each row's expert's
    row, loaded here), else ``y``."""
    if QUANT == QUANT_SMOOTH:
        if TOPK > 0:
            # each expert's row is read again by every row routed to it: keep it in L2 over x's stream
            y = y * tl.load(smooth_ptr + smooth_row + cols[None, :], mask=mask, other=0.0,
                            eviction_policy="evict_last").to(tl.float32)
        else:
            y = y * smooth[None, :]
    return y


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _abs_max(z, mask):
    """max|z| per row of ``[BLOCK_M, BLOCK_N]``, NaN where a row holds NaN (the spec's NaN rows)."""
    return tl.reduce(tl.where(mask, tl.abs(z), 0.0), 1, _max_nan)


@triton.jit
def _quantize(z, inv_scale, prescale, q_dtype: tl.constexpr, QMAX: tl.constexpr):
    """``z * prescale * inv_scale`` (per row) as ``q_dtype``: int8 rounded half to even, fp8 to nearest
    even; NaN to 0 (``_row_scales`` gives the factors).

    A tile whose rows all have ``prescale`` 1 (finite, not tiny) takes one multiply per element, and
    int8 takes no float-to-int conversion: |v| <= 127 (plus rounding) there, so adding 1.5 * 2^23 leaves
    the nearest-even integer in the low mantissa bits, whose low byte is the int8. The quantising ops run
    near the SM's instruction issue limit (moe_smooth_quant writes two int8 rows per bf16 row read), and
    the conversion instruction issues at a quarter of the FP32 rate.

    fp8 needs no clamp to +-QMAX: inv_scale is QMAX / max|z| correctly rounded, so |v| <= QMAX (1 + 2^-24)^2,
    which rounds to QMAX (e4m3's grid step there is 32), and the GPU's conversion saturates besides.
    """
    if (tl.min(prescale, axis=0) == 1.0) & (tl.max(prescale, axis=0) == 1.0):
        v = z * inv_scale[:, None]
    else:
        v = (z * prescale[:, None]) * inv_scale[:, None]
        v = tl.where(v == v, v, 0.0)
    if q_dtype == tl.int8:
        q = (v + ROUND_HALF_EVEN).to(tl.int32, bitcast=True).to(tl.int8)
    else:
        q = cast_for_store(v, q_dtype)
    return q


@triton.jit
def _row_scales(amax, valid, QMAX: tl.constexpr):
    """(row_scale, inv_scale, prescale): ``row_scale = max|z| / QMAX``, and q = z * prescale * inv_scale.

    A row of zeros gets 0 and q 0; an invalid row (MoE expert id out of range) NaN and q 0; a row
    holding NaN (``_abs_max`` gives NaN) NaN and q 0. For a row whose max|z| is below 2^-100, QMAX /
    max|z| would overflow fp32 (and 0 * inf give NaN), so z and max|z| are first scaled by 2^100,
    exactly; a row with max|z| NaN or inf gets prescale 0 (its q is 0 or NaN -> 0); every other row
    has prescale 1.
    """
    qmax = tl.full(amax.shape, QMAX, tl.float32)
    # correctly rounded divisions (one per row): triton's `/` is approximate on the GPU (2 ulp), which
    # tipped near-ties of q away from the exact quantisation there
    scale = tl.where(valid, tl.math.div_rn(amax, qmax), float("nan"))
    nonzero = valid & (amax > 0.0) & (amax <= FP32_MAX)
    prescale = tl.where(amax < TINY_AMAX, PRESCALE, tl.where(amax <= FP32_MAX, 1.0, 0.0))
    inv_scale = tl.where(nonzero, tl.math.div_rn(qmax, tl.where(nonzero, amax * prescale, 1.0)), 0.0)
    return scale, inv_scale, prescale


@triton.jit
def _one_pass_tile(tile, x, res, valid, smooth_row, w, b, xb, smooth, w_ptr, b_ptr, xbias_ptr, smooth_ptr, topk_ptr,
                   y_ptr, q_ptr, scale_ptr, sum_ptr, mean_ptr, rstd_ptr, M, N, T, num_experts, stride_xm, stride_rm,
                   stride_sm, stride_tk_t, stride_tk_j, eps, NORM: tl.constexpr, HAS_W: tl.constexpr,
                   HAS_B: tl.constexpr, HAS_XBIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
                   QMAX: tl.constexpr, TOPK: tl.constexpr, STORE_Y: tl.constexpr, STORE_STATS: tl.constexpr,
                   PRELOADED: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row tile ``tile`` of whole rows, its x and residual already loaded (``_tile_input``, which also gives
    the rows' valid flags and expert rows: used by the persistent loop, ``PRELOADED``). The
    weight, bias, x_bias and smooth-scale vectors come preloaded (``PRELOADED``, the persistent loop) or
    are loaded here where they are first used: held from the start, weight and bias cost one row's
    worth of registers during the statistics (layer_norm at 16384 columns fell from ~0.95 to 0.75 of
    copy bandwidth)."""
    rows, mask_m, tile_valid, tile_smooth_row, x_row, res_row, out_row = _forward_rows(
        tile, M, N, T, num_experts, topk_ptr, stride_xm, stride_rm, stride_sm, stride_tk_t, stride_tk_j, TOPK,
        BLOCK_M)
    if not PRELOADED:
        # one tile per program: the expert ids loaded here (the caller's copies are dead), which keeps the
        # code of before the ids came with x: ptxas issues all of x's and the expert rows' loads in one burst.
        # With the caller's ids it spread them between the arithmetic, as in a variant that measured 0.78 of
        # copy bandwidth against 0.82 for MoE at 4096 columns (benchmarks/NOTES.md).
        valid = tile_valid
        smooth_row = tile_smooth_row
    cols = tl.arange(0, BLOCK_N)
    mask_n = _column_mask(cols, N, EVEN_N)
    mask = mask_m[:, None] & mask_n[None, :]
    if not PRELOADED:
        xb = _vector(xbias_ptr, cols, mask_n, HAS_XBIAS)
    v = _row_values(x, res, xb, sum_ptr, out_row, cols, mask, HAS_XBIAS, HAS_RESIDUAL, True)
    # fp32 layer norm: correctly rounded statistics, and the mean corrected once by the mean of the
    # deviations from it. y = (v - mean) * rstd magnifies the mean's error when a row sits far from 0
    # (offset 30: 2.7-3.2x PyTorch's error on the H100 with the approximate division and rsqrt). The bf16
    # / fp16 kernels keep the cheaper operations (identical PTX), invisible after their output rounding;
    # rms_norm has no mean, and its fp32 forward is within the rule with them.
    EXACT: tl.constexpr = (x.dtype == tl.float32) and (NORM == NORM_LAYER)
    if NORM == NORM_LAYER:
        mean = _div(tl.sum(v, axis=1), N, EXACT)
        centred = tl.where(mask, v - mean[:, None], 0.0)
        if EXACT:
            mean += _div(tl.sum(centred, axis=1), N, EXACT)
            centred = tl.where(mask, v - mean[:, None], 0.0)
        rstd = _inv_sqrt(_div(tl.sum(centred * centred, axis=1), N, EXACT) + eps, EXACT)
    elif NORM == NORM_RMS:
        mean = tl.zeros([BLOCK_M], tl.float32)
        rstd = _inv_sqrt(_div(tl.sum(v * v, axis=1), N, EXACT) + eps, EXACT)
    else:
        mean = tl.zeros([BLOCK_M], tl.float32)
        rstd = tl.zeros([BLOCK_M], tl.float32) + 1.0
    if not PRELOADED:
        w = _vector(w_ptr, cols, mask_n, HAS_W)
        b = _vector(b_ptr, cols, mask_n, HAS_B)
    y = _affine(v, mean, rstd, w, b, NORM, HAS_W, HAS_B)
    if STORE_Y:
        tl.store(y_ptr + out_row + cols[None, :], cast_for_store(y, y_ptr.dtype.element_ty), mask=mask)
    if QUANT != QUANT_NONE:
        if not PRELOADED:
            smooth = _smooth_vector(smooth_ptr, cols, mask_n, QUANT, TOPK)
        z = _smoothed(y, smooth, smooth_ptr, smooth_row, cols, mask, QUANT, TOPK)
        # columns only: a row past M or with an invalid expert is not stored / gets NaN anyway
        amax = _abs_max(z, mask_n[None, :])
        scale, inv_scale, prescale = _row_scales(amax, valid, QMAX)
        q_dtype = q_ptr.dtype.element_ty
        # MoE: k rows written per row of x read; stream them past L2, which holds the smooth rows
        tl.store(q_ptr + out_row + cols[None, :], _quantize(z, inv_scale, prescale, q_dtype, QMAX), mask=mask,
                 cache_modifier=".cs" if TOPK > 0 else "")
        tl.store(scale_ptr + rows, scale, mask=mask_m)
    if STORE_STATS:
        tl.store(mean_ptr + rows, mean, mask=mask_m)
        tl.store(rstd_ptr + rows, rstd, mask=mask_m)


@triton.jit
def _chunk_outputs(start, x_ptr, res_ptr, sum_ptr, xbias_ptr, w_ptr, b_ptr, smooth_ptr, x_row, res_row, out_row,
                   smooth_row, mask_m, mean, rstd, N, stride_xn, stride_rn, NORM: tl.constexpr, HAS_W: tl.constexpr,
                   HAS_B: tl.constexpr, HAS_XBIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
                   TOPK: tl.constexpr, BLOCK_N: tl.constexpr):
    """(cols, mask, y, z) of the chunk at ``start`` in the passes after the statistics (s read back when
    there is a residual); z is y when nothing smooths it."""
    cols = start + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    mask = mask_m[:, None] & mask_n[None, :]
    v = _chunk_values(x_ptr, res_ptr, sum_ptr, xbias_ptr, x_row, res_row, out_row, cols, mask, mask_n, stride_xn,
                      stride_rn, HAS_XBIAS, HAS_RESIDUAL, HAS_RESIDUAL, False)
    y = _affine(v, mean, rstd, _vector(w_ptr, cols, mask_n, HAS_W), _vector(b_ptr, cols, mask_n, HAS_B), NORM,
                HAS_W, HAS_B)
    z = _smoothed(y, _smooth_vector(smooth_ptr, cols, mask_n, QUANT, TOPK), smooth_ptr, smooth_row, cols, mask,
                  QUANT, TOPK)
    return cols, mask, y, z


@triton.jit
def _chunked_tile(tile, x_ptr, res_ptr, xbias_ptr, w_ptr, b_ptr, smooth_ptr, topk_ptr, y_ptr, q_ptr, scale_ptr,
                  sum_ptr, mean_ptr, rstd_ptr, M, N, T, num_experts, stride_xm, stride_xn, stride_rm, stride_rn,
                  stride_sm, stride_tk_t, stride_tk_j, eps, NORM: tl.constexpr, HAS_W: tl.constexpr,
                  HAS_B: tl.constexpr, HAS_XBIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
                  QMAX: tl.constexpr, TOPK: tl.constexpr, STORE_Y: tl.constexpr, STORE_STATS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row tile ``tile`` of rows longer than a tile, in ``BLOCK_N`` chunks and several passes."""
    rows, mask_m, valid, smooth_row, x_row, res_row, out_row = _forward_rows(
        tile, M, N, T, num_experts, topk_ptr, stride_xm, stride_rm, stride_sm, stride_tk_t, stride_tk_j, TOPK,
        BLOCK_M)
    # pass 1: statistics (and s), chunk by chunk; Chan's merge keeps the variance exact-ish in fp32
    # fp32 layer norm: correctly rounded divisions and square root (see _one_pass_tile)
    EXACT: tl.constexpr = (x_ptr.dtype.element_ty == tl.float32) and (NORM == NORM_LAYER)
    mean = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M], tl.float32)   # layer: sum of squared deviations; rms: sum of squares
    if NORM != NORM_NONE or HAS_RESIDUAL:
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask_n = cols < N
            mask = mask_m[:, None] & mask_n[None, :]
            v = _chunk_values(x_ptr, res_ptr, sum_ptr, xbias_ptr, x_row, res_row, out_row, cols, mask, mask_n,
                              stride_xn, stride_rn, HAS_XBIAS, HAS_RESIDUAL, False, True)
            if NORM == NORM_LAYER:
                count = tl.minimum(N - start, BLOCK_N).to(tl.float32)
                chunk_mean = _div(tl.sum(v, axis=1), count, EXACT)
                centred = tl.where(mask, v - chunk_mean[:, None], 0.0)
                total = start + count
                delta = chunk_mean - mean
                mean += delta * _div(count, total, EXACT)
                acc += tl.sum(centred * centred, axis=1) + delta * delta * _div(start * count, total, EXACT)
            elif NORM == NORM_RMS:
                acc += tl.sum(v * v, axis=1)
        if HAS_RESIDUAL:
            tl.debug_barrier()   # the later passes read s back, possibly in other threads
    if NORM == NORM_NONE:
        rstd = tl.zeros([BLOCK_M], tl.float32) + 1.0
    else:
        rstd = _inv_sqrt(_div(acc, N, EXACT) + eps, EXACT)
    if QUANT != QUANT_NONE:
        q_dtype = q_ptr.dtype.element_ty
        # pass 2: the row's max|z|
        amax = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, N, BLOCK_N):
            cols, mask, y, z = _chunk_outputs(start, x_ptr, res_ptr, sum_ptr, xbias_ptr, w_ptr, b_ptr, smooth_ptr,
                                              x_row, res_row, out_row, smooth_row, mask_m, mean, rstd, N, stride_xn,
                                              stride_rn, NORM, HAS_W, HAS_B, HAS_XBIAS, HAS_RESIDUAL, QUANT, TOPK,
                                              BLOCK_N)
            amax = _max_nan(amax, _abs_max(z, mask))
        scale, inv_scale, prescale = _row_scales(amax, valid, QMAX)
        tl.store(scale_ptr + rows, scale, mask=mask_m)
    # last pass: the outputs
    for start in range(0, N, BLOCK_N):
        cols, mask, y, z = _chunk_outputs(start, x_ptr, res_ptr, sum_ptr, xbias_ptr, w_ptr, b_ptr, smooth_ptr, x_row,
                                          res_row, out_row, smooth_row, mask_m, mean, rstd, N, stride_xn, stride_rn,
                                          NORM, HAS_W, HAS_B, HAS_XBIAS, HAS_RESIDUAL, QUANT, TOPK, BLOCK_N)
        if STORE_Y:
            tl.store(y_ptr + out_row + cols[None, :], cast_for_store(y, y_ptr.dtype.element_ty), mask=mask)
        if QUANT != QUANT_NONE:
            tl.store(q_ptr + out_row + cols[None, :], _quantize(z, inv_scale, prescale, q_dtype, QMAX), mask=mask)
    if STORE_STATS:
        tl.store(mean_ptr + rows, mean, mask=mask_m)
        tl.store(rstd_ptr + rows, rstd, mask=mask_m)


@triton.jit
def _row_forward(x_ptr, res_ptr, xbias_ptr, w_ptr, b_ptr, smooth_ptr, topk_ptr,
                 y_ptr, q_ptr, scale_ptr, sum_ptr, mean_ptr, rstd_ptr,
                 M, N, T, num_experts, stride_xm, stride_xn, stride_rm, stride_rn, stride_sm,
                 stride_tk_t, stride_tk_j, eps,
                 NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_XBIAS: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr, TOPK: tl.constexpr,
                 STORE_Y: tl.constexpr, STORE_STATS: tl.constexpr, ONE_PASS: tl.constexpr,
                 PERSISTENT: tl.constexpr, PREFETCH: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """y / q + row_scale / s / mean + rstd of row tiles (see the module docstring).

    x ``[M, N]`` (MoE: ``[T, N]``, row r reads token ``r % T``) with any strides; y, q, s contiguous
    ``[M, N]``; row_scale, mean, rstd ``[M]`` fp32. MoE: expert ``topk[r % T, r // T]`` picks the
    smooth-scale row. ``TOPK``: k of a MoE quantisation (rows per token of x), 0 for every other op;
    ``EVEN_N``: N is a multiple of ``BLOCK_N``, so whole-row tiles need no column masks.

    Whole rows (``ONE_PASS``): one tile per program, or with ``PERSISTENT`` a loop over tiles that
    loads weight, bias, x_bias and smooth_scale once per program instead of once per tile (an fp32
    smooth_scale row is twice the bytes of a bf16 x row, read from L2 by every row otherwise); with
    ``PREFETCH`` the next tile's x and residual are loaded before this tile's reductions. Chunked rows:
    always a persistent loop, so only as many long rows are in flight as fit in L2 for their later passes.
    """
    pid = tl.program_id(0)
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_N)
        mask_n = _column_mask(cols, N, EVEN_N)
        if not PERSISTENT:
            x, res, valid, srow = _tile_input(pid, x_ptr, res_ptr, topk_ptr, cols, mask_n, M, N, T, num_experts,
                                              stride_xm, stride_xn, stride_rm, stride_rn, stride_sm, stride_tk_t,
                                              stride_tk_j, HAS_RESIDUAL, TOPK, BLOCK_M)
            unused = mask_n.to(tl.float32)   # the vectors are loaded where they are used
            _one_pass_tile(pid, x, res, valid, srow, unused, unused, unused, unused, w_ptr, b_ptr, xbias_ptr,
                           smooth_ptr, topk_ptr, y_ptr, q_ptr, scale_ptr, sum_ptr, mean_ptr, rstd_ptr, M, N, T,
                           num_experts, stride_xm, stride_rm, stride_sm, stride_tk_t, stride_tk_j, eps, NORM, HAS_W,
                           HAS_B, HAS_XBIAS, HAS_RESIDUAL, QUANT, QMAX, TOPK, STORE_Y, STORE_STATS, False, EVEN_N,
                           BLOCK_M, BLOCK_N)
        else:
            w = _vector(w_ptr, cols, mask_n, HAS_W)
            b = _vector(b_ptr, cols, mask_n, HAS_B)
            xb = _vector(xbias_ptr, cols, mask_n, HAS_XBIAS)
            smooth = _smooth_vector(smooth_ptr, cols, mask_n, QUANT, TOPK)
            step = tl.num_programs(0)
            if PREFETCH:
                x_next, res_next, valid_next, srow_next = _tile_input(
                    pid, x_ptr, res_ptr, topk_ptr, cols, mask_n, M, N, T, num_experts, stride_xm, stride_xn,
                    stride_rm, stride_rn, stride_sm, stride_tk_t, stride_tk_j, HAS_RESIDUAL, TOPK, BLOCK_M)
            for tile in range(pid, tl.cdiv(M, BLOCK_M), step):
                if PREFETCH:
                    x = x_next
                    res = res_next
                    valid = valid_next
                    srow = srow_next
                    x_next, res_next, valid_next, srow_next = _tile_input(
                        tile + step, x_ptr, res_ptr, topk_ptr, cols, mask_n, M, N, T, num_experts, stride_xm,
                        stride_xn, stride_rm, stride_rn, stride_sm, stride_tk_t, stride_tk_j, HAS_RESIDUAL, TOPK,
                        BLOCK_M)
                else:
                    x, res, valid, srow = _tile_input(tile, x_ptr, res_ptr, topk_ptr, cols, mask_n, M, N, T,
                                                      num_experts, stride_xm, stride_xn, stride_rm, stride_rn,
                                                      stride_sm, stride_tk_t, stride_tk_j, HAS_RESIDUAL, TOPK,
                                                      BLOCK_M)
                _one_pass_tile(tile, x, res, valid, srow, w, b, xb, smooth, w_ptr, b_ptr, xbias_ptr, smooth_ptr,
                               topk_ptr, y_ptr, q_ptr, scale_ptr, sum_ptr, mean_ptr, rstd_ptr, M, N, T, num_experts,
                               stride_xm, stride_rm, stride_sm, stride_tk_t, stride_tk_j, eps, NORM, HAS_W, HAS_B,
                               HAS_XBIAS, HAS_RESIDUAL, QUANT, QMAX, TOPK, STORE_Y, STORE_STATS, True, EVEN_N,
                               BLOCK_M, BLOCK_N)
    else:
        for tile in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
            _chunked_tile(tile, x_ptr, res_ptr, xbias_ptr, w_ptr, b_ptr, smooth_ptr, topk_ptr, y_ptr, q_ptr,
                          scale_ptr, sum_ptr, mean_ptr, rstd_ptr, M, N, T, num_experts, stride_xm, stride_xn,
                          stride_rm, stride_rn, stride_sm, stride_tk_t, stride_tk_j, eps, NORM, HAS_W, HAS_B,
                          HAS_XBIAS, HAS_RESIDUAL, QUANT, QMAX, TOPK, STORE_Y, STORE_STATS, BLOCK_M, BLOCK_N)


@triton.jit
def _quant_rows(x_ptr, smooth_ptr, q_ptr, scale_ptr, M, N, stride_xm, stride_xn, HAS_SMOOTH: tl.constexpr,
                QMAX: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr):
    """tk.dynamic_quant / tk.smooth_quant of whole rows, one row per step of a persistent loop that loads
    the smooth scales once per program: ``_row_forward``'s persistent one-pass path for one-row tiles with
    no norm, residual or prefetch, the same operations in the same order (bit-identical q and row_scale),
    but nothing else in the loop. ``lean_quant`` says where it runs: smooth_quant at 32768 columns, where
    the generic kernel's loop measured 0.90 of copy bandwidth and this one 0.91-0.92 (H100, 16 warps, one
    program per SM, ptxas giving both 128 registers and the same spills; benchmarks/NOTES.md)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask_n = _column_mask(cols, N, EVEN_N)
    if HAS_SMOOTH:
        smooth = _vector(smooth_ptr, cols, mask_n, True)
    row0 = tl.zeros([1], tl.int64)
    for row in range(pid, M, tl.num_programs(0)):
        rows = row0 + row
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask_n[None, :], other=0.0)
        z = x.to(tl.float32)
        if HAS_SMOOTH:
            z = z * smooth[None, :]
        amax = _abs_max(z, mask_n[None, :])
        scale, inv_scale, prescale = _row_scales(amax, rows >= 0, QMAX)
        tl.store(q_ptr + rows[:, None] * N + cols[None, :],
                 _quantize(z, inv_scale, prescale, q_ptr.dtype.element_ty, QMAX), mask=mask_n[None, :])
        tl.store(scale_ptr + rows, scale)


# ----------------------------------------------------------------------------------------------------
# backward


@triton.jit
def _normalised(x, xbias_ptr, cols, mask, mask_n, mean, rstd, NORM: tl.constexpr, HAS_XBIAS: tl.constexpr):
    """``xhat`` fp32 ``[BLOCK_M, BLOCK_N]`` from loaded x, 0 outside the tile's rows and columns."""
    v = x.to(tl.float32)
    if HAS_XBIAS:
        v += tl.load(xbias_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if NORM == NORM_LAYER:
        xhat = (v - mean[:, None]) * rstd[:, None]
    else:
        xhat = v * rstd[:, None]
    return tl.where(mask, xhat, 0.0)


@triton.jit
def _scaled(dy, w_ptr, cols, mask_n, HAS_W: tl.constexpr):
    """``dy * w`` fp32 from loaded dy."""
    g = dy.to(tl.float32)
    if HAS_W:
        g = g * tl.load(w_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return g


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _row_sums(g, xhat, NORM: tl.constexpr):
    """(sum of g * xhat, sum of g) per row; layer norm's two sums in one reduction (one CTA barrier)."""
    if NORM == NORM_LAYER:
        if INTERPRET:   # the interpreter runs a combine function element by element in Python
            sum_gx = tl.sum(g * xhat, axis=1)
            sum_g = tl.sum(g, axis=1)
        else:
            sum_gx, sum_g = tl.reduce((g * xhat, g), 1, _add_pairs)
    else:
        sum_gx = tl.sum(g * xhat, axis=1)
        sum_g = sum_gx
    return sum_gx, sum_g


@triton.jit
def _tile_rows(tile, M, BLOCK_M: tl.constexpr):
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, rows < M


@triton.jit
def _row_backward(x_ptr, xbias_ptr, dy_ptr, ds_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
                  M, N, stride_xm, stride_xn, stride_dym, stride_dyn, stride_dsm, stride_dsn,
                  NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_XBIAS: tl.constexpr, HAS_DS: tl.constexpr,
                  WANT_DW: tl.constexpr, WANT_DB: tl.constexpr, SPLIT_N: tl.constexpr, PREFETCH: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx ``[M, N]`` (contiguous) and the partial dw/db rows of this program (see the module docstring).

    ``PREFETCH`` (whole rows only): the next tile's x and dy are loaded before this tile's reductions,
    so a program's loads overlap its own arithmetic instead of waiting on HBM once per row.
    """
    pid = tl.program_id(0)
    col_block = pid % SPLIT_N
    row_program = pid // SPLIT_N
    row_programs = tl.num_programs(0) // SPLIT_N
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    dw_acc = tl.zeros([BLOCK_N], tl.float32)
    db_acc = tl.zeros([BLOCK_N], tl.float32)
    if PREFETCH:
        rows, mask_m = _tile_rows(row_program, M, BLOCK_M)
        mask = mask_m[:, None] & mask_n[None, :]
        x_next = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask,
                         other=0.0)
        dy_next = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * stride_dym + cols[None, :] * stride_dyn, mask=mask,
                          other=0.0)
    for tile in range(row_program, tl.cdiv(M, BLOCK_M), row_programs):
        rows, mask_m = _tile_rows(tile, M, BLOCK_M)
        mask = mask_m[:, None] & mask_n[None, :]
        x_row = rows.to(tl.int64)[:, None] * stride_xm
        dy_row = rows.to(tl.int64)[:, None] * stride_dym
        if PREFETCH:
            x = x_next
            dy = dy_next
            rows_next, mask_next = _tile_rows(tile + row_programs, M, BLOCK_M)
            mask_next = mask_next[:, None] & mask_n[None, :]
            x_next = tl.load(x_ptr + rows_next.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xn,
                             mask=mask_next, other=0.0)
            dy_next = tl.load(dy_ptr + rows_next.to(tl.int64)[:, None] * stride_dym + cols[None, :] * stride_dyn,
                              mask=mask_next, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=mask_m, other=0.0)
        if NORM == NORM_LAYER:
            mean = tl.load(mean_ptr + rows, mask=mask_m, other=0.0)
        else:
            mean = rstd * 0.0
        if SPLIT_N == 1:
            if not PREFETCH:
                x = tl.load(x_ptr + x_row + cols[None, :] * stride_xn, mask=mask, other=0.0)
                dy = tl.load(dy_ptr + dy_row + cols[None, :] * stride_dyn, mask=mask, other=0.0)
            xhat = _normalised(x, xbias_ptr, cols, mask, mask_n, mean, rstd, NORM, HAS_XBIAS)
            g = _scaled(dy, w_ptr, cols, mask_n, HAS_W)
            sum_gx, sum_g = _row_sums(g, xhat, NORM)
        else:
            sum_gx = tl.zeros([BLOCK_M], tl.float32)
            sum_g = tl.zeros([BLOCK_M], tl.float32)
            for start in range(0, N, BLOCK_N):
                cols_c = start + tl.arange(0, BLOCK_N)
                mask_nc = cols_c < N
                mask_c = mask_m[:, None] & mask_nc[None, :]
                x_c = tl.load(x_ptr + x_row + cols_c[None, :] * stride_xn, mask=mask_c, other=0.0)
                dy_c = tl.load(dy_ptr + dy_row + cols_c[None, :] * stride_dyn, mask=mask_c, other=0.0)
                xhat_c = _normalised(x_c, xbias_ptr, cols_c, mask_c, mask_nc, mean, rstd, NORM, HAS_XBIAS)
                part_gx, part_g = _row_sums(_scaled(dy_c, w_ptr, cols_c, mask_nc, HAS_W), xhat_c, NORM)
                sum_gx += part_gx
                sum_g += part_g
            # this program's block again, now that the sums are known (from L2: just read)
            x = tl.load(x_ptr + x_row + cols[None, :] * stride_xn, mask=mask, other=0.0)
            dy = tl.load(dy_ptr + dy_row + cols[None, :] * stride_dyn, mask=mask, other=0.0)
            xhat = _normalised(x, xbias_ptr, cols, mask, mask_n, mean, rstd, NORM, HAS_XBIAS)
            g = _scaled(dy, w_ptr, cols, mask_n, HAS_W)
        if NORM == NORM_LAYER:
            dx = (g - xhat * (sum_gx / N)[:, None] - (sum_g / N)[:, None]) * rstd[:, None]
        else:
            dx = (g - xhat * (sum_gx / N)[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(ds_ptr + rows.to(tl.int64)[:, None] * stride_dsm + cols[None, :] * stride_dsn, mask=mask,
                          other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], cast_for_store(dx, dx_ptr.dtype.element_ty),
                 mask=mask)
        if WANT_DW:
            dw_acc += tl.sum(dy.to(tl.float32) * xhat, axis=0)
        if WANT_DB:
            db_acc += tl.sum(dy.to(tl.float32), axis=0)
    part_row = row_program.to(tl.int64) * N
    if WANT_DW:
        tl.store(dw_part_ptr + part_row + cols, dw_acc, mask=mask_n)
    if WANT_DB:
        tl.store(db_part_ptr + part_row + cols, db_acc, mask=mask_n)


@triton.jit
def _sum_rows(part_ptr, out_ptr, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[n] = sum_r part[r, n]`` (fp32 ``[R, N]``), always in the same order: deterministic."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    for start in range(0, R, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        acc += tl.load(part_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
                       mask=(rows < R)[:, None] & mask_n[None, :], other=0.0)
    tl.store(out_ptr + cols, cast_for_store(tl.sum(acc, axis=0), out_ptr.dtype.element_ty), mask=mask_n)


# ----------------------------------------------------------------------------------------------------
# launch configurations, as data


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """``block_n`` columns (the whole row when it fits, else the chunk) x ``block_m`` rows per tile."""

    block_m: int
    block_n: int
    num_warps: int
    # chunked forward and backward: programs per SM of the persistent grid (backward: row programs;
    # the grid is that many x SM count x column blocks)
    programs_per_sm: int = 1
    # backward, and the persistent forward: load the next row tile's inputs before reducing this one
    prefetch: bool = True
    # forward, whole rows: a persistent loop over row tiles (programs_per_sm x SM count programs) that
    # loads weight, bias and smooth_scale once per program
    persistent: bool = False


# Measured on an H100 (bf16, 2026-11-22, benchmarks/NOTES.md "Norms and quantisation"). Forward: a
# whole row in registers up to 32768 columns (16 values per thread, 32 warps at 32768: 16 warps left
# layer_norm at 0.69-0.76 of copy bandwidth, 32 at 0.92); longer rows in 16384-column chunks, two
# persistent programs per SM (0.63 of copy at 65536 against 0.39-0.62 for the other chunkings).
# Under the interpreter the limits are small so the CPU lane reaches the chunked paths at N ~ 4k.
MAX_FORWARD_BLOCK = {"gpu": 32768, "interpreter": 1024}
FORWARD_CHUNK = {"gpu": 16384, "interpreter": 1024}
# Aim for this many columns x rows per forward tile when rows are short (several rows per program).
MIN_TILE_ELEMENTS = 2048
# The quantisation ops' whole-row forward, tuned per kind and width: kind -> {block_n: (warps or None for
# ``_warps``' default, programs per SM of a persistent row loop or None for one program per row tile,
# prefetch the next row tile)}; other ops and widths keep the default. H100 sweeps (2026-11-22, bf16 x,
# fractions of copy bandwidth, benchmarks/NOTES.md):
# - smooth_quant loads its fp32 scales once per program in the persistent loop (one program per row
#   re-read them from L2: twice the bytes of its bf16 x): 4096 0.88 -> 0.93, 8192 0.76 -> 0.93. At 16384
#   one program per row with 16 warps (1.01 under CUDA graphs; 8 warps need 134 registers per thread
#   since the column masks went (``EVEN_N``), one block per SM: 0.71), and one persistent program per
#   SM with 16 warps at 32768 (0.91-0.92 against 0.89 with 32).
# - dynamic_quant: persistent at 32768 only (0.92-0.93 against 0.90).
# - moe_smooth_quant writes k rows per row of x, and fewer warps per row keep more rows in flight, each
#   with less per-row overhead: 2 warps at 4096 and 8192 (0.82 against 0.81 / 0.80 with 4, 0.71 / 0.73
#   with 8), 16 warps in two persistent programs per SM at 16384 (0.68-0.72 against 0.67 with 8), a
#   persistent program per SM with prefetch at 32768 (0.69). Every row re-reads its expert's fp32
#   smooth row (twice the bytes of x) from L2; whether L2 bandwidth is the limit there is not shown yet.
#   Since the prefetch carries the next tile's expert ids with its x (the expert rows no longer wait for
#   the ids), 16 warps prefetching in one persistent program per SM lead at 32768: 0.734-0.741 against
#   0.695-0.703 with 32 warps (H100, 2026-11-23, 3 rounds each in two runs); at 16384 prefetching
#   measured 0.63-0.67 against 0.72-0.73 for the table's choice. 8 warps (2026-11-25, E 8 / E 64, 2 rounds, outputs
#   bit-identical): k 2 0.750-0.754 against 0.724-0.729 (e4m3 0.773 against 0.762-0.765), k 4 0.58 against 0.55,
#   k 8 0.49 against 0.47.
TUNED_FORWARD = {
    "smooth": {4096: (None, 4, True), 8192: (None, 4, True), 16384: (16, None, False), 32768: (16, 1, False)},
    "dynamic": {32768: (None, 2, True)},
    "moe": {4096: (2, None, False), 8192: (2, None, False), 16384: (16, 2, False), 32768: (8, 1, True)},
    # a norm whose quantised rows (q, row_scale) are all it returns, no residual or x_bias: more columns a thread
    # and, where the weight, bias and smooth rows would be re-read per row, a persistent loop. H100 sweep
    # (2026-11-25, bf16, int8, 128 MiB of x, 2 rounds, fractions of copy at 4096 / 8192 / 16384 / 32768, the
    # norms' defaults in brackets): layer+dynamic 0.81 / 0.86 / 0.84 / 0.50 (0.74 / 0.59 / 0.50 / 0.47),
    # layer+smooth 0.74 / 0.72 / 0.57 / 0.41 (0.57 / 0.52 / 0.42 / 0.36), rms+dynamic 0.91 / 0.91 / 0.88 / 0.75
    # (0.88 / 0.83 / 0.85 / 0.69). rms+smooth takes layer+smooth's configs.
    "layer+dynamic": {4096: (4, None, False), 8192: (4, 2, True), 16384: (8, 1, True), 32768: (16, None, False)},
    "layer+smooth": {4096: (8, 2, True), 8192: (8, 1, True), 16384: (8, 2, False), 32768: (16, None, False)},
    "rms+dynamic": {4096: (4, None, False), 8192: (4, None, False), 16384: (16, 1, True), 32768: (16, None, False)},
    "rms+smooth": {4096: (8, 2, True), 8192: (8, 1, True), 16384: (8, 2, False), 32768: (16, None, False)},
}
# Rows of N below their power-of-two tile (the columns past N masked; hidden sizes such as 2560, 5120, 7168,
# 14336), the same form, first match here and then in ``TUNED_FORWARD``; kind None is the norms that write y or
# s (layer_norm, rms_norm, add_rms_norm_quant, ...). H100 sweep (2026-11-25, bf16, 128 MiB of x, 2 interleaved
# rounds, fractions of copy, the tables' choice before in brackets):
# - 32 columns a thread instead of 16 (fewer warps, no masked lane idle in a whole warp): layer_norm 2560 0.94
#   (0.88), 5120 0.92 (0.79), 6144 0.95 (0.87); dynamic_quant 2560 0.95 (0.85), 5120 0.90 (0.82).
# - smooth_quant at 10240-14336 (the 16384 tile): one program per row re-read its fp32 smooth row each row and
#   measured 0.61-0.67; a persistent loop, 16 warps, two programs per SM, prefetching: 0.80 / 0.85 / 0.89 at
#   10240 / 12288 / 14336 (at 16384 itself one program per row stays ahead: 0.91 against 0.90).
_THIRTY_TWO_COLUMNS = {4096: (4, None, False), 8192: (8, None, False)}
MASKED_FORWARD = {None: _THIRTY_TWO_COLUMNS, "dynamic": _THIRTY_TWO_COLUMNS, "smooth": {16384: (16, 2, True)}}


def lean_quant(config: RowConfig, kind: str | None, N: int) -> bool:
    """Whether tk.dynamic_quant / tk.smooth_quant (``kind``) rows of N under ``config`` run ``_quant_rows``
    instead of ``_row_forward``: whole one-row tiles in a persistent loop without prefetch, which the table
    gives smooth_quant at 32768 columns. There ``_quant_rows`` measured 0.91-0.92 of copy bandwidth against
    0.90 for ``_row_forward`` with the same config (H100, bf16, int8 and e4m3, 2026-11-24)."""
    return (kind in ("smooth", "dynamic") and N <= config.block_n and config.block_m == 1 and config.persistent
            and not config.prefetch)


# Backward: (widest N, norm or None for both) -> RowConfig, first match wins. A block holds x, dy and
# a block of dw (and db for layer norm) per thread across the row loop, so past 8192 columns the row
# is split into column blocks (each program re-reads the row from L2 for its row sums), except RMS
# norm at 16384, whose three arrays still fit. Winners of a sweep over block, warps, programs per SM,
# rows per tile and prefetch; fractions of copy bandwidth (layer / rms): 4096 0.89 / 0.95, 8192
# 0.84 / 0.93, 16384 0.57 / 0.73, 32768 0.47 / 0.76.
BACKWARD_CONFIGS = (
    (4096, None, RowConfig(1, 4096, 8, programs_per_sm=2, prefetch=True)),
    (8192, None, RowConfig(1, 8192, 16, programs_per_sm=1, prefetch=True)),
    (16384, "rms", RowConfig(1, 16384, 16, programs_per_sm=1, prefetch=False)),
    (16384, "layer", RowConfig(1, 8192, 16, programs_per_sm=1, prefetch=False)),
    (None, None, RowConfig(1, 16384, 32, programs_per_sm=1, prefetch=False)),
)
INTERPRETER_BACKWARD_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class SmemBackwardConfig:
    """The Gluon backward (``_gluon._row_backward_smem``): whole rows, dw/db sums in shared memory (or, with
    ``acc_regs``, in registers)."""

    num_warps: int
    # the next row: 0 not loaded ahead, 1 loaded into registers, 2 copied into shared memory by cp.async
    prefetch: int = 2
    vec: int = 4             # columns per thread per access
    programs_per_sm: int = 1
    # programs per row, each with its own columns (a power of two): they exchange their parts of the row sums
    split: int = 1
    # split > 1: a row's programs are one thread-block cluster and exchange the sums in distributed shared
    # memory (Hopper) instead of through global memory
    cluster: bool = False
    # dw/db summed in registers instead of shared memory (one program per row, or cluster)
    acc_regs: bool = False
    # prefetch 2: ring slots of staged rows (stages - 1 rows copied ahead)
    stages: int = 1

    def __post_init__(self):
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages < 1:
            raise ValueError(f"SmemBackwardConfig: stages must be an int >= 1, got {self.stages!r}")


# (power-of-two width, norm) -> SmemBackwardConfig: the widths where the Gluon backward
# replaces the Triton one on a GPU (when its shared memory fits and the columns are contiguous). H100 sweep
# (bf16, launch_backward timed, 3 interleaved rounds, fractions of copy bandwidth, benchmarks/NOTES.md):
# at 16384 layer 0.825 with 32 warps and 16-byte accesses against 0.57 for the Triton kernel, rms 0.91
# against 0.75. Not at 4096 / 8192, where the Triton kernel measured level or ahead (layer 0.85-0.91
# against 0.73-0.89). Wider rows do not fit one program (dw alone is 128 KiB at 32768), so 2 or 4
# programs share each row (``split``), 16384 columns each: at 32768 layer
# 0.69-0.71 and rms 0.82 against 0.47 / 0.77 for the Triton kernel, at 65536 0.64 / 0.76 against 0.34 /
# 0.54. Programs of 8192 columns (split 4 at 32768, two per SM) measured 0.49-0.63; 32 warps 0.49-0.81.
# Since 2026-11-24 a row's programs are one thread-block cluster and exchange the row sums through
# distributed shared memory (``cluster``): at 32768 layer 0.845-0.849 and rms 0.953-0.956 (32 warps) against
# 0.690-0.694 / 0.820-0.826 for the exchange through global memory in the same runs; at 65536 0.736-0.741 /
# 0.809-0.814 against 0.641-0.644 / 0.763-0.767. At 16384, two programs of 8192 columns per SM in clusters
# measured 0.53-0.76, below the single program's 0.83 / 0.91.
# Since 2026-11-25 layer norm at 16384 sums dw/db in registers (``acc_regs``) with a ring of two staged rows:
# 0.854-0.860 against 0.824-0.830 for the sums in shared memory, whose read-modify-write each row was
# 256 KiB of shared-memory traffic. Not rms at 16384 (0.909 against 0.913), nor at 8192 (0.75 against 0.85
# for the Triton kernel) or in the cluster kernels (0.60 against 0.85 for layer at 32768: they spill).
SMEM_BACKWARD_CONFIGS = {
    (16384, "layer"): SmemBackwardConfig(32, vec=8, acc_regs=True, stages=2),
    (16384, "rms"): SmemBackwardConfig(16, vec=8),
    (32768, "layer"): SmemBackwardConfig(32, vec=8, split=2, cluster=True),
    (32768, "rms"): SmemBackwardConfig(32, vec=8, split=2, cluster=True),
    (65536, "layer"): SmemBackwardConfig(32, vec=8, split=4, cluster=True),
    (65536, "rms"): SmemBackwardConfig(32, vec=8, split=4, cluster=True),
}


@dataclasses.dataclass(frozen=True)
class SmemQuantConfig:
    """The Gluon MoE quantising forward (``_gluon._moe_rows_smem``): a persistent loop over rows of x that stream
    through a ring of ``stages`` shared-memory rows filled by cp.async. ``maxnreg``: a register cap per thread
    (triton's option) so that ``programs_per_sm`` programs fit on an SM whatever the ids' width; None: the
    compiler's choice. ``warp_reduce``: each warp owns a contiguous part of the row, so a row's max|z| takes one
    CTA barrier (the warps' maxima through shared memory) instead of the three of triton's CTA reduction; k <=
    ``HELD_TOPK`` only (``_gluon._quant_row``)."""

    num_warps: int
    stages: int = 3
    programs_per_sm: int = 1
    maxnreg: int | None = None
    warp_reduce: bool = False


# MoE with more expert choices per token than this takes the Gluon loop's many-k form (its ids re-read from the
# ring for each row, a loop over the k rows that is not unrolled) and the table's many-k configs
HELD_TOPK = tl.constexpr(2)

# (kind, power-of-two width, k > HELD_TOPK) -> SmemQuantConfig: where the Gluon MoE forward replaces the Triton one
# on a GPU (when its ring fits in shared memory and x's rows suit cp.async). H100 sweep (bf16 x, int8, 256 MiB of x,
# 3 interleaved rounds of do_bench medians, fractions of a copy timed in the same process, benchmarks/NOTES.md):
# - moe_smooth_quant, E 8, k 2: 4096 columns 0.90 (4 warps, 4 programs per SM, 2 or 3 ring slots; the Triton
#   kernel 0.82), 8192 0.86 (8 warps, 2 per SM, 2 slots; Triton 0.81; 3 slots 0.75); 0.91 / 0.87 since the ids
#   travel through the ring. With E 64, k 2: 0.89 / 0.86 against 0.80 / 0.82. But with k 8 (E 64) 0.50 / 0.52
#   against the Triton kernel's 0.58 / 0.60, so at first only k <= 2 took it (larger k: the last point). With z
#   held from max|z| to q (``_gluon._quant_row``, 2026-11-24, same configs): 4096 0.923-0.929, 8192 0.884-0.890.
#   At 16384 the ring then beats the Triton kernel too: 16 warps, one program per SM, 3 slots 0.759-0.763 (2 slots
#   0.745-0.748, 4 slots 0.748-0.751, 8 warps in two programs 0.74, 32 warps 0.68) against 0.723-0.727; with E 64
#   0.764-0.765 against 0.736-0.741. At 32768 the expert rows held one row ahead take too many registers (0.24-0.32
#   with spills, against 0.73). Then x read from its slot once per token and held for the k rows: 4096
#   0.931-0.935, 8192 0.905-0.908, 16384 0.776-0.778.
# - dynamic / smooth quantisation through the same loop (the smooth row loaded once per program) measured
#   slower than the Triton kernel at every width (smooth_quant 0.85 against 0.90 at 32768, 0.93-0.95 against
#   0.96-0.98 at 4096-16384), so the loop does MoE only.
# - k > 2 (2026-11-25, E 64, 128 MiB of x, 2 interleaved rounds). The unrolled k rows held two tokens' ids (int64
#   [k] per thread) and took 150-167 registers at 32 columns a thread, so fewer programs fitted than the grid
#   assumed; the many-k form takes 128 there. Then 64 columns a thread (254 registers, no spills) in as many
#   programs per SM as fit won at every width: fewer warps per row means less per-row overhead, which dominates
#   when a token writes 8 rows. Against the Triton kernel (the table before), k 8 / k 4, fractions of copy:
#   1024 0.83 / 0.86 (0.42 / 0.50), 2048 0.83 / 0.84 (0.53 / 0.61), 4096 0.79 / 0.84 (0.57 / 0.65), 8192 0.75 /
#   0.81 (0.59 / 0.67), 16384 0.61 / 0.66 (0.53 / 0.60), and the masked widths through the 8192 config: 5120
#   0.54 / 0.60 (0.30 / 0.34), 6144 0.62 / 0.68 (0.33 / 0.38), 7168 0.69 / 0.75 (0.35 / 0.41). q and row_scale
#   bit-identical to the Triton kernel's (k 3-8, bad ids, masked widths, fp16 / fp32 x, e4m3). At k 2, 64 columns
#   a thread measured level to 3% under the table's configs.
# - int64 ids (what ``torch.topk`` returns; the sweeps above used int32) took the 4096 and 8192 configs to 131
#   registers (triton 3.6, sm_90) where int32 ids take 128, so an SM held 3 programs of the 4 the grid assumed
#   (4096) or 1 of 2 (8192): 0.70 / 0.75 of copy against 0.93 / 0.91 (H100, 2026-12-07, E 8, k 2, 256 MiB of x, 3
#   rounds). ``maxnreg`` 128 holds them at 128 with no spills: int64 0.927-0.930 / 0.903-0.906, int32
#   unchanged (0.930-0.934 / 0.905-0.908), q bit-identical. 16384 (16 warps: 128 at most anyway) is 0.738 with int64
#   ids against 0.774 with int32; the many-k configs lose 1% (4096, k 8: 0.811-0.815 against 0.820).
# - One CTA barrier a row (``warp_reduce``; H100, 2026-12-08, int32 ids, the same method). ncu at 16384 had put
#   half the warps' stall samples in the row reduction's chain: shuffles, shared memory and its three barriers.
#   Three calls: 8192 0.893-0.899 -> 0.900-0.908, so 8192 takes it. 4096 0.912-0.918 -> 0.910-0.916 and 16384
#   0.775-0.778 -> 0.765-0.768 (there the expert rows' loads are waited for instead, ncu), so they do not. In the
#   same runs 16384 with 2 ring slots measured 0.783 against 0.775-0.778 with 3 (the sweep of 2026-11-24 had 3
#   ahead, before x was held per token), and takes 2. Outputs bit-identical throughout.
SMEM_QUANT_CONFIGS = {("moe", 4096, False): SmemQuantConfig(4, stages=2, programs_per_sm=4, maxnreg=128),
                      ("moe", 8192, False): SmemQuantConfig(8, stages=2, programs_per_sm=2, maxnreg=128,
                                                            warp_reduce=True),
                      ("moe", 16384, False): SmemQuantConfig(16, stages=2, programs_per_sm=1),
                      ("moe", 1024, True): SmemQuantConfig(1, stages=2, programs_per_sm=16),
                      ("moe", 2048, True): SmemQuantConfig(1, stages=2, programs_per_sm=8),
                      ("moe", 4096, True): SmemQuantConfig(2, stages=2, programs_per_sm=4),
                      ("moe", 8192, True): SmemQuantConfig(4, stages=2, programs_per_sm=2),
                      ("moe", 16384, True): SmemQuantConfig(8, stages=2, programs_per_sm=1)}

# tests and sweeps: {"forward": RowConfig, "backward": RowConfig, "smem_backward": SmemBackwardConfig, or None
# for the Triton backward, "smem_quant": SmemQuantConfig, or None for the Triton forward}
config_override: dict = {}


def smem_quant_config(N: int, kind: str | None, topk: int = 0) -> SmemQuantConfig | None:
    """The Gluon forward's config for tk.moe_smooth_quant (``kind`` "moe"; MoE's k ``topk``) rows of N, or None
    for the Triton forward (every other kind)."""
    if kind != "moe":
        return None
    if "smem_quant" in config_override:
        return config_override["smem_quant"]
    if "forward" in config_override:
        return None
    return SMEM_QUANT_CONFIGS.get((kind, triton.next_power_of_2(N), topk > HELD_TOPK.value))


def smem_backward_config(N: int, norm: str) -> SmemBackwardConfig | None:
    if "smem_backward" in config_override:
        return config_override["smem_backward"]
    if "backward" in config_override:
        return None
    return SMEM_BACKWARD_CONFIGS.get((triton.next_power_of_2(N), norm))


def _lane(device) -> str:
    return "interpreter" if device.type != "cuda" or is_interpreter() else "gpu"


def _warps(elements: int) -> int:
    """About 16 values per thread from 4 to 16 warps, then 32 warps for 32768 and more."""
    if elements >= 32768:
        return 32
    return max(4, min(16, triton.next_power_of_2(elements) // (32 * 16)))


def forward_config(N: int, device, kind: str | None = None) -> RowConfig:
    """``kind``: "smooth", "dynamic" or "moe" for tk.smooth_quant / tk.dynamic_quant /
    tk.moe_smooth_quant (``TUNED_FORWARD``), None for the norms; rows shorter than their tile look in
    ``MASKED_FORWARD`` first."""
    if "forward" in config_override:
        return config_override["forward"]
    lane = _lane(device)
    if N <= MAX_FORWARD_BLOCK[lane]:
        block_n = triton.next_power_of_2(N)
        block_m = max(1, min(64, MIN_TILE_ELEMENTS // block_n))
        config = RowConfig(block_m, block_n, _warps(block_m * block_n))
        tuned = None
        if lane == "gpu":
            masked = MASKED_FORWARD.get(kind, {}).get(block_n) if N < block_n else None
            tuned = masked or TUNED_FORWARD.get(kind, {}).get(block_n)
        if tuned is not None:
            warps, programs, prefetch = tuned
            config = dataclasses.replace(config, num_warps=warps or config.num_warps)
            if programs is not None:
                config = dataclasses.replace(config, programs_per_sm=programs, prefetch=prefetch, persistent=True)
        return config
    block_n = FORWARD_CHUNK[lane]
    return RowConfig(1, block_n, min(16, _warps(block_n)), programs_per_sm=2)


def forward_grid(M: int, N: int, config: RowConfig, device) -> int:
    """One program per row tile for whole rows (unless ``persistent``); a persistent grid for chunked
    ones, with as few programs as take the same number of rounds: 4096 rows on 132 SMs are 32 rounds
    either way, and 128 programs of 32 rows leave no round in which four programs run alone
    (smooth_quant at 4096x32768 on an H100: 0.895 -> 0.900 of copy bandwidth timed directly, level in
    the bench; benchmarks/NOTES.md)."""
    tiles_m = triton.cdiv(M, config.block_m)
    if N <= config.block_n and not config.persistent:
        return tiles_m
    return balanced_grid(tiles_m, config.programs_per_sm * sm_count(device))


def balanced_grid(tiles: int, cap: int) -> int:
    """The fewest programs of a persistent loop over ``tiles`` that take as many rounds as ``min(tiles, cap)``
    programs would (``forward_grid``; the Gluon MoE forward's tokens)."""
    programs = max(1, min(tiles, cap))
    return triton.cdiv(tiles, triton.cdiv(tiles, programs))


def backward_config(N: int, norm: str, device) -> RowConfig:
    if "backward" in config_override:
        return config_override["backward"]
    if _lane(device) == "interpreter":
        block_n = min(triton.next_power_of_2(N), INTERPRETER_BACKWARD_BLOCK)
        return RowConfig(max(1, min(16, MIN_TILE_ELEMENTS // block_n)), block_n, 4, programs_per_sm=2)
    width = triton.next_power_of_2(N)
    for widest, for_norm, config in BACKWARD_CONFIGS:
        if (widest is None or width <= widest) and for_norm in (None, norm):
            if width < config.block_n:   # shorter rows: the same tile area over several rows
                rows = min(16, config.block_n // width)
                return RowConfig(rows, width, max(4, config.num_warps // 2), config.programs_per_sm, config.prefetch)
            return config
    raise AssertionError("BACKWARD_CONFIGS ends with a catch-all")


def backward_grid(M: int, N: int, config: RowConfig, device) -> tuple[int, int]:
    """(row programs, column blocks): enough row programs to fill the device, no more than row tiles."""
    split_n = triton.cdiv(N, config.block_n)
    tiles_m = triton.cdiv(max(M, 1), config.block_m)
    row_programs = max(1, min(tiles_m, config.programs_per_sm * sm_count(device) // split_n or 1))
    return row_programs, split_n
