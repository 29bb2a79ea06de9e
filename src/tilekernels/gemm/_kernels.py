"""Triton bodies of the persistent GEMM. The host side (checks, configs, grid, autograd) is gemm.py.

``gemm_kernel`` computes ``C = epilogue(A @ B)`` for A ``[M, K]`` and B ``[K, N]`` in any of the four
layouts. Each program loops over work items chosen by ``scheduler.tile_coords``; per item it runs the
K loop over its K-split into an fp32 (int32 for int8) accumulator and then either applies the fused
epilogue and stores C, or, with ``SPLIT_K > 1``, stores the fp32 partial sum into a workspace
``[SPLIT_K, M, N]`` that ``splitk_reduce_kernel`` adds up in a fixed order (so split-K is
deterministic) before the same epilogue.

Operand loads:
- ``USE_TMA``: A and B arrive as host-built TMA tensor descriptors over their storage. A stored
  column-major (``A_TRANS``) is described as the ``[K, M]`` tensor it really is and each ``[BK, BM]``
  box is transposed in registers/shared memory (no copy in global memory); likewise B stored as
  ``[N, K]`` (``B_TRANS``). Out-of-range rows and K columns are zero-filled by the copy engine.
- otherwise plain pointer loads (every launch before Hopper; on Hopper an operand TMA cannot read): rows
  past M and columns past N are clamped to row/column 0 (read but never stored), and only the K tail is
  masked (``EVEN_K`` drops the mask). Hints keep those loads in 16-byte vectors: the clamped offsets are
  marked contiguous, and ``DIV_*`` pass what the host knows of each stride's and K's divisors.

Epilogue order (DESIGN.md): ``acc*alpha*scale_a*scale_b + bias -> activation -> * mul... ->
+ beta*residual -> cast``. Every ``[M, N]``-shaped epilogue operand is addressed through its strides,
so broadcast views (stride 0) cost no copy; row offsets are 64-bit. With TMA operands, C and a full
row-major residual go through TMA descriptors instead (``epilogue_store``; gemm.py decides per launch).
"""

import triton
import triton.language as tl

from .._runtime import (INTERPRET, TRACE_COMPUTE, TRACE_WAIT, cast_for_store, compensated_dot, dot, offset_i64,
                        known_multiple, trace_clock, trace_event)
from .scheduler import tile_coords, wait_for_rows


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): saturates cleanly to +-1 (exp overflow gives inf -> 1, underflow -> -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _gelu_short(x):
    """GELU ``x * Phi(x)`` in 12 instructions (2 of them MUFU) instead of the ~20 of libdevice's erf and its
    coefficient selects, for epilogues that round to fp16 (bf16 and fp8: ``_gelu_coarse``; in the fused GEMM
    epilogue the erf was most of its cost: 8192^3 bias+gelu+residual 618-625 TFLOP/s against 654-661 for
    bias+relu+residual, H100).

    Phi(x) = 1 / (1 + 2^(-x P(x^2))) with P a degree-6 polynomial fitted to the logit of Phi (in log2 units)
    over x^2 <= 36: |Phi error| <= 3.2e-8 over the whole line in exact arithmetic, so |GELU error| <= 9.2e-8 --
    about erf's fp32 form, whose 1 + erf(x / sqrt 2) cancels to ~6e-8 absolute for x < 0 -- and a thousandth
    of a 16-bit output's unit near |GELU| ~ 0.1. Past x^2 = 36 no clamp is needed: P is at least 5.9 there
    (its leading coefficient is positive; float32 Horner overflows only to +inf), so |x P| >= 35 and the
    logistic is within 2^-35 of 0 or 1, as Phi is within 1e-9. The GPU takes ex2.approx and rcp.approx (flush
    to zero; ~2^-22 relative each). Inf and NaN as the erf form: +inf -> +inf, -inf -> NaN, NaN -> NaN; below
    about -5.4 it returns a tiny negative value or -0."""
    t = x * x
    p = 5.346370129345479e-09 * t - 3.9003021824463704e-07
    p = p * t + 1.1527107182836388e-05
    p = p * t - 0.00015997022700301174
    p = p * t - 9.32933701122274e-05
    p = p * t + 0.1048345688660696
    p = p * t + 2.302209396871495
    return _logistic_times(x, -(x * p))


@triton.jit
def _gelu_coarse(x):
    """GELU for epilogues that round to 8 significant bits or fewer (bf16, fp8): ``_gelu_short``'s form with a
    degree-4 P, fitted by linear programming to the logit of Phi over x^2 <= 20.25, two FFMA an element fewer.
    |GELU error| <= 7.7e-5 (at x = -0.67) and within 0.16 of a bf16 unit of GELU(x) for every x >= -4.5, where
    ``_gelu_short`` is within 0.10 (0.035 for x >= -4); below -4.5 both are tiny negative values (|GELU| < 1.6e-5)
    of poor relative accuracy, this one the better. No clamp is needed: P >= 2.29 for every x^2 >= 0 (its
    leading coefficient is positive). Inf and NaN as ``_gelu_short``."""
    t = x * x
    p = 4.902491499392482e-07 * t - 8.770551340216587e-06
    p = p * t - 0.001108256067041496
    p = p * t + 0.10777232057321183
    p = p * t + 2.299772925882591
    return _logistic_times(x, -(x * p))


@triton.jit
def _logistic_times(x, q):
    """``x / (1 + 2^q)``: ex2.approx and rcp.approx on the GPU (flush to zero), exp2 and a division on the
    interpreter."""
    if INTERPRET:
        r = 1.0 / (1.0 + tl.math.exp2(q))
    else:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [q], dtype=tl.float32, is_pure=True,
                                      pack=1)
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=tl.float32,
                                      is_pure=True, pack=1)
    return x * r


@triton.jit
def _gelu_tanh_short(x):
    """The tanh GELU ``0.5 x (1 + tanh(u))``, u = sqrt(2/pi) (x + 0.044715 x^3), as ``x / (1 + e^(-2u))`` (the
    same function: 0.5 (1 + tanh u) is the logistic of 2u) in 7 instructions, for epilogues that round to 16
    bits or fewer; the exponent's constants folded into one polynomial in x^2. Inf and NaN as the tanh form."""
    t = x * x
    # -2 u log2(e) = -x (c1 + c3 x^2), c1 = 2 log2(e) sqrt(2 / pi), c3 = 0.044715 c1
    return _logistic_times(x, -(x * (t * 0.1029432395800235 + 2.302208198144325)))


@triton.jit
def apply_activation(x, ACTIVATION: tl.constexpr, SHORT_FORMS: tl.constexpr = False, COARSE: tl.constexpr = False):
    """``SHORT_FORMS``: gelu and gelu_tanh by ``_gelu_short`` and ``_gelu_tanh_short``, silu by
    ``_logistic_times`` (the caller rounds the result to 16 bits or fewer); with ``COARSE`` too (the caller
    rounds to 8 significant bits or fewer: bf16, fp8), gelu by ``_gelu_coarse``."""
    if ACTIVATION == "relu":
        x = tl.where(x < 0.0, 0.0, x)  # NaN stays NaN (tl.maximum would drop it)
    elif ACTIVATION == "gelu" and SHORT_FORMS and COARSE:
        x = _gelu_coarse(x)
    elif ACTIVATION == "gelu" and SHORT_FORMS:
        x = _gelu_short(x)
    elif ACTIVATION == "gelu":
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh" and SHORT_FORMS:
        x = _gelu_tanh_short(x)
    elif ACTIVATION == "gelu_tanh":
        x = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif ACTIVATION == "silu" and SHORT_FORMS:
        x = _logistic_times(x, x * -1.4426950408889634)   # x / (1 + e^-x): ex2 and rcp instead of exp and a division
    elif ACTIVATION == "silu":
        x = x / (1.0 + tl.exp(-x))
    return x


@triton.jit
def _load_mn(ptr, offs_m, offs_n, mask, stride_m, stride_n):
    return tl.load(ptr + offset_i64(offs_m, stride_m)[:, None] + offset_i64(offs_n, stride_n)[None, :],
                   mask=mask, other=0.0).to(tl.float32)


@triton.jit
def epilogue_store(acc, c_ptr, stride_cm, stride_cn, offs_m, offs_n, M, N, alpha, beta,
                   scale_a_ptr, stride_scale_a, scale_b_ptr, stride_scale_b,
                   bias_ptr, stride_bias_m, stride_bias_n,
                   mul0_ptr, stride_mul0_m, stride_mul0_n,
                   mul1_ptr, stride_mul1_m, stride_mul1_n,
                   res_ptr, stride_res_m, stride_res_n,
                   HAS_ALPHA: tl.constexpr, HAS_SCALE_A: tl.constexpr, HAS_SCALE_B: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BIAS_IS_ROW: tl.constexpr, ACTIVATION: tl.constexpr,
                   NUM_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr, OUT_IS_INT: tl.constexpr,
                   C_DESC: tl.constexpr = False, RES_DESC: tl.constexpr = False, off_m=0, off_n=0):
    """Apply the fused epilogue to one ``[BM, BN]`` accumulator tile and store it into C.

    ``C_DESC`` / ``RES_DESC``: C / the residual are TMA descriptors whose box is this tile, read and
    written at ``(off_m, off_n)``; the TMA unit clips rows and columns past the edges (and a tile
    placed at row M or beyond touches nothing), so no masks and no per-element address arithmetic.
    The store is asynchronous: the program goes on to its next tile while C drains from shared memory.
    """
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask = mask_m[:, None] & mask_n[None, :]
    if OUT_IS_INT:
        out = acc
    else:
        out = acc.to(tl.float32)
        if HAS_ALPHA:
            out = out * alpha
        if HAS_SCALE_A:
            scale_a = tl.load(scale_a_ptr + offs_m * stride_scale_a, mask=mask_m, other=0.0)
            out = out * scale_a.to(tl.float32)[:, None]
        if HAS_SCALE_B:
            scale_b = tl.load(scale_b_ptr + offs_n * stride_scale_b, mask=mask_n, other=0.0)
            out = out * scale_b.to(tl.float32)[None, :]
        if HAS_BIAS:
            if BIAS_IS_ROW:
                bias = tl.load(bias_ptr + offs_n * stride_bias_n, mask=mask_n, other=0.0)
                out = out + bias.to(tl.float32)[None, :]
            else:
                out = out + _load_mn(bias_ptr, offs_m, offs_n, mask, stride_bias_m, stride_bias_n)
        out_ty: tl.constexpr = c_ptr.dtype if C_DESC else c_ptr.dtype.element_ty
        out = apply_activation(out, ACTIVATION, out_ty.primitive_bitwidth <= 16, out_ty.is_bf16() or out_ty.is_fp8())
        if NUM_MUL >= 1:
            out = out * _load_mn(mul0_ptr, offs_m, offs_n, mask, stride_mul0_m, stride_mul0_n)
        if NUM_MUL >= 2:
            out = out * _load_mn(mul1_ptr, offs_m, offs_n, mask, stride_mul1_m, stride_mul1_n)
        if HAS_RESIDUAL:
            if RES_DESC:
                out = out + beta * res_ptr.load([off_m, off_n]).to(tl.float32)
            else:
                out = out + beta * _load_mn(res_ptr, offs_m, offs_n, mask, stride_res_m, stride_res_n)
    if C_DESC:
        c_ptr.store([off_m, off_n], cast_for_store(out, c_ptr.dtype))
    else:
        c_ptrs = c_ptr + offset_i64(offs_m, stride_cm)[:, None] + offset_i64(offs_n, stride_cn)[None, :]
        tl.store(c_ptrs, cast_for_store(out, c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _halves(x):
    """``[BM, BN]`` -> (columns ``[0, BN/2)``, columns ``[BN/2, BN)``)."""
    BM: tl.constexpr = x.shape[0]
    BN: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def column_slices(x, SLICES: tl.constexpr):
    """``x`` as a tuple of ``SLICES`` (1, 2 or 4) column slices, left to right."""
    if SLICES == 1:
        return (x,)
    elif SLICES == 2:
        return _halves(x)
    else:
        left, right = _halves(x)
        l0, l1 = _halves(left)
        r0, r1 = _halves(right)
        return l0, l1, r0, r1


@triton.jit(do_not_specialize=["signal_value", "max_spins"])
def gemm_kernel(
    a, b, c, partials,
    M, N, K, k_per_split, num_programs,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    alpha, beta,
    scale_a_ptr, stride_scale_a, scale_b_ptr, stride_scale_b,
    bias_ptr, stride_bias_m, stride_bias_n,
    mul0_ptr, stride_mul0_m, stride_mul0_n,
    mul1_ptr, stride_mul1_m, stride_mul1_n,
    res_ptr, stride_res_m, stride_res_n,
    signals, errors, rows_per_chunk, pivot_tile_m, tiles_m_skip, wait_row0, signal_value, max_spins,
    a_local, local_lo, local_hi,
    trace_events, trace_clock_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_TMA: tl.constexpr, A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, EVEN_K: tl.constexpr,
    DIV_AM: tl.constexpr, DIV_AK: tl.constexpr, DIV_BK: tl.constexpr, DIV_BN: tl.constexpr, DIV_K: tl.constexpr,
    ACC_INT: tl.constexpr, FP32_PRECISION: tl.constexpr, COMPENSATED: tl.constexpr,
    FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, EPILOGUE_SLICES: tl.constexpr,
    C_DESC: tl.constexpr, RES_DESC: tl.constexpr,
    HAS_ALPHA: tl.constexpr, HAS_SCALE_A: tl.constexpr, HAS_SCALE_B: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_IS_ROW: tl.constexpr, ACTIVATION: tl.constexpr,
    NUM_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr, OUT_IS_INT: tl.constexpr,
    ASYNC_INPUT: tl.constexpr, SIGNAL_IS_PTR: tl.constexpr, HAS_LOCAL_A: tl.constexpr,
    TRACE: tl.constexpr, TRACE_MAX_EVENTS: tl.constexpr,
):
    pid = tl.program_id(0)
    if SIGNAL_IS_PTR:
        # The epoch lives on the device (tk.dist): a call captured in a CUDA graph waits for the value
        # its replay reached, not the one seen at capture.
        signal_value = tl.load(signal_value, volatile=True).to(tl.int64)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # tiles_m_skip: the last M tiles in this launch's (pivoted) order, which a row tail computes (gemm.py)
    tiles_m_run = tiles_m - tiles_m_skip
    num_tiles = tiles_m_run * tiles_n * SPLIT_K
    acc_dtype = tl.int32 if ACC_INT else tl.float32
    offs_k = tl.arange(0, BLOCK_K)
    k_tiles_all = tl.cdiv(K, BLOCK_K)

    # The epilogue recomputes its tile from its own counter: with FLATTEN the compiler fuses the K
    # loop with the tile loop, and this keeps the epilogue's indices off the pipelined loop's path.
    tile_id_c = pid - num_programs
    trace_slot = 0
    for tile_id in tl.range(pid, num_tiles, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n, pid_k = tile_coords(tile_id, tiles_m_run, tiles_n, GROUP_M, pivot_tile_m, ASYNC_INPUT, tiles_m)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if SPLIT_K == 1:
            # K bounds the same for every tile: the compiler can then fuse the K loop into the tile
            # loop (FLATTEN) and prefetch the next tile's operands while this one's epilogue runs.
            k_start = 0
            k_end = K
            k_tiles = k_tiles_all
        else:
            k_start = pid_k * k_per_split
            k_end = min(K, k_start + k_per_split)
            k_tiles = tl.cdiv(k_end - k_start, BLOCK_K)
        rows_valid = M
        if TRACE:  # (tk.dist trace=True) a wait span and a compute span per tile
            trace_start = trace_clock(trace_clock_ptr)
        if ASYNC_INPUT:
            # pid_m is the pivoted tile: the rows waited for are the rows read and written. The loads
            # of A depend on the wait's result through off_m, so none can be issued ahead of it. A tile
            # whose chunk never came keeps its K loop (a fixed trip count keeps the loop fusable) but
            # reads from row M on (TMA zero-fills them; the pointer path clamps them to row 0) and
            # stores nothing.
            # (wait_row0: where this launch's row 0 sits in A, for a row tail launched on a row view of it)
            ready = wait_for_rows(signals, errors, wait_row0 + off_m, wait_row0 + min(M, off_m + BLOCK_M),
                                  rows_per_chunk, signal_value, max_spins)
            off_m = tl.where(ready, off_m, M)
            rows_valid = tl.where(ready, M, 0)
            if TRACE:
                trace_slot = trace_event(trace_events, trace_clock_ptr, pid, trace_slot, TRACE_WAIT, trace_start,
                                         pid_m, TRACE_MAX_EVENTS)
                trace_start = trace_clock(trace_clock_ptr)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_dtype)
        comp = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # HAS_LOCAL_A: the rows [local_lo, local_hi) are read from a_local (tk.dist: this rank's own
        # shard, so it need not first be copied into the gathered buffer). gemm.py guarantees that no
        # tile straddles local_lo or local_hi and that a_local is row-major with A's strides. The
        # descriptor (or base pointer) is chosen per tile, so the K loop stays one fusable loop.
        a_src = a
        row0 = 0
        if HAS_LOCAL_A:
            if (off_m >= local_lo) & (off_m < local_hi):
                a_src = a_local
                row0 = local_lo
        if USE_TMA:
            for ki in range(k_tiles):
                off_k = k_start + ki * BLOCK_K
                if A_TRANS:
                    a_tile = a_src.load([off_k, off_m - row0]).T
                else:
                    a_tile = a_src.load([off_m - row0, off_k])
                if B_TRANS:
                    b_tile = b.load([off_n, off_k]).T
                else:
                    b_tile = b.load([off_k, off_n])
                if COMPENSATED:
                    acc, comp = compensated_dot(a_tile, b_tile, acc, comp)  # [BM, BK] @ [BK, BN]
                else:
                    acc = dot(a_tile, b_tile, acc, FP32_PRECISION)  # [BM, BK] @ [BK, BN] -> [BM, BN]
        else:
            # Rows past M and columns past N read row / column 0 (never stored). The hints keep the
            # compiler's view of each as one contiguous, aligned run: the clamp alone hides that, and a
            # layout whose unit stride runs along M or N then loads element by element (bf16, H100, CUDA
            # graphs, 2026-11-25: RR 8192^2 x 4096 53 -> 593-602 TFLOP/s, CC 4096^3 295 -> 551-554; the
            # stride and K hints: RC 3072^2 x 3000 14 -> 287-290). A vector the clamp would have split
            # reads on past M or N inside its own aligned 16 bytes: still inside the allocation, and its
            # extra values are never stored. The DIV_* hints do the same for the strides and the K tail's
            # mask (triton itself marks only multiples of 16), so rows that start 16 bytes apart load in
            # 16-byte vectors.
            offs_am = off_m + tl.arange(0, BLOCK_M)
            offs_bn = off_n + tl.arange(0, BLOCK_N)
            offs_am = tl.max_contiguous(tl.multiple_of(tl.where(offs_am < M, offs_am, 0), BLOCK_M), BLOCK_M)
            offs_bn = tl.max_contiguous(tl.multiple_of(tl.where(offs_bn < N, offs_bn, 0), BLOCK_N), BLOCK_N)
            a_ptrs = (a_src + offset_i64(offs_am - row0, known_multiple(stride_am, DIV_AM))[:, None]
                      + offset_i64(k_start + offs_k, known_multiple(stride_ak, DIV_AK))[None, :])
            b_ptrs = (b + offset_i64(k_start + offs_k, known_multiple(stride_bk, DIV_BK))[:, None]
                      + offset_i64(offs_bn, known_multiple(stride_bn, DIV_BN))[None, :])
            k_stop = known_multiple(k_end, DIV_K)
            for ki in range(k_tiles):
                if EVEN_K:
                    a_tile = tl.load(a_ptrs)
                    b_tile = tl.load(b_ptrs)
                else:
                    k_left = k_stop - k_start - ki * BLOCK_K
                    a_tile = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                    b_tile = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                if COMPENSATED:
                    acc, comp = compensated_dot(a_tile, b_tile, acc, comp)  # [BM, BK] @ [BK, BN]
                else:
                    acc = dot(a_tile, b_tile, acc, FP32_PRECISION)  # [BM, BK] @ [BK, BN] -> [BM, BN]
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk

        tile_id_c += num_programs
        pid_m, pid_n, pid_k = tile_coords(tile_id_c, tiles_m_run, tiles_n, GROUP_M, pivot_tile_m, ASYNC_INPUT, tiles_m)
        offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if SPLIT_K > 1:
            mask = (offs_cm < rows_valid)[:, None] & (offs_cn < N)[None, :]
            p_ptrs = (partials + offset_i64(pid_k, M) * N + offset_i64(offs_cm, N)[:, None]
                      + offs_cn[None, :])
            tl.store(p_ptrs, acc, mask=mask)
        else:
            # The tile goes out in EPILOGUE_SLICES column slices, one after the other: fewer registers
            # live while the epilogue loads its operands, so a heavy epilogue does not spill the
            # accumulator (fused bias+gelu+residual: 616 -> 673 TFLOP/s at 8192^3 with two), and
            # with C_DESC a smaller shared-memory staging buffer for the TMA store. A skipped async
            # tile (rows_valid 0) is placed at row tiles_m * BLOCK_M, where descriptors touch nothing.
            off_cm = tl.where(rows_valid > 0, pid_m * BLOCK_M, tiles_m * BLOCK_M)
            slices = column_slices(acc, EPILOGUE_SLICES)
            for part in tl.static_range(EPILOGUE_SLICES):
                off_part = pid_n * BLOCK_N + part * (BLOCK_N // EPILOGUE_SLICES)
                offs_part = off_part + tl.arange(0, BLOCK_N // EPILOGUE_SLICES)
                epilogue_store(slices[part], c, stride_cm, stride_cn, offs_cm, offs_part, rows_valid, N, alpha,
                               beta, scale_a_ptr, stride_scale_a, scale_b_ptr, stride_scale_b,
                               bias_ptr, stride_bias_m, stride_bias_n,
                               mul0_ptr, stride_mul0_m, stride_mul0_n,
                               mul1_ptr, stride_mul1_m, stride_mul1_n,
                               res_ptr, stride_res_m, stride_res_n,
                               HAS_ALPHA, HAS_SCALE_A, HAS_SCALE_B, HAS_BIAS, BIAS_IS_ROW, ACTIVATION,
                               NUM_MUL, HAS_RESIDUAL, OUT_IS_INT, C_DESC, RES_DESC, off_cm, off_part)
        if TRACE:
            trace_slot = trace_event(trace_events, trace_clock_ptr, pid, trace_slot, TRACE_COMPUTE, trace_start,
                                     pid_m, TRACE_MAX_EVENTS)


@triton.jit
def splitk_reduce_kernel(
    partials, c, M, N, stride_cm, stride_cn,
    alpha, beta,
    scale_a_ptr, stride_scale_a, scale_b_ptr, stride_scale_b,
    bias_ptr, stride_bias_m, stride_bias_n,
    mul0_ptr, stride_mul0_m, stride_mul0_n,
    mul1_ptr, stride_mul1_m, stride_mul1_n,
    res_ptr, stride_res_m, stride_res_n,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ALPHA: tl.constexpr, HAS_SCALE_A: tl.constexpr, HAS_SCALE_B: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_IS_ROW: tl.constexpr, ACTIVATION: tl.constexpr,
    NUM_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr, OUT_IS_INT: tl.constexpr,
):
    """Sum the split-K partials in split order (bit-reproducible), then the epilogue."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    p_ptrs = partials + offset_i64(offs_m, N)[:, None] + offs_n[None, :]
    acc = tl.load(p_ptrs, mask=mask, other=0)
    for s in range(1, SPLIT_K):
        acc += tl.load(p_ptrs + offset_i64(s, M) * N, mask=mask, other=0)
    epilogue_store(acc, c, stride_cm, stride_cn, offs_m, offs_n, M, N, alpha, beta,
                   scale_a_ptr, stride_scale_a, scale_b_ptr, stride_scale_b,
                   bias_ptr, stride_bias_m, stride_bias_n,
                   mul0_ptr, stride_mul0_m, stride_mul0_n,
                   mul1_ptr, stride_mul1_m, stride_mul1_n,
                   res_ptr, stride_res_m, stride_res_n,
                   HAS_ALPHA, HAS_SCALE_A, HAS_SCALE_B, HAS_BIAS, BIAS_IS_ROW, ACTIVATION,
                   NUM_MUL, HAS_RESIDUAL, OUT_IS_INT)
