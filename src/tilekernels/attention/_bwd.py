"""FlashAttention backward: delta, then dK/dV per key block, then dQ per query block (no atomics); on
Hopper a Gluon kernel for dK/dV instead (see its section below), which with ``deterministic=False`` also
computes dQ (fused).

With ``p_ij = exp(s_ij - lse_i)`` recomputed from the forward's LSE (FlashAttention-2's algorithm):

    delta_i = do_i . o_i                        (_attn_bwd_delta)
    dp_ij   = do_i . v_j * keep_ij / (1 - p)
    ds_ij   = p_ij * (dp_ij - delta_i) * f'(q_i . k_j)      f' = scale, or scale * (1 - tanh^2) with softcap
    dv_j    = sum_i p_ij * keep_ij / (1 - p) * do_i         dk_j = sum_i ds_ij q_i      (_attn_bwd_dkdv)
    dq_i    = sum_j ds_ij k_j                                                          (_attn_bwd_dq)

Determinism: each dK/dV program owns one key block of one KV head and walks, in a fixed order, every
query head of its GQA group and every query block that may see it; each dQ program owns one query
block of one head. Nothing is accumulated across programs, so these gradients are bit-identical run to
run. The fused Hopper kernel sums dq across programs in fp32 (TMA reduce-add), so it is taken only for
``deterministic=False`` (FA2's default); ``deterministic=True`` calls on Hopper pair its dK/dV-only form
(``HopperBwdConfig.with_dq=False``, the same per-program sums) with the dQ kernel here.

The masked/unmasked split of the query (resp. key) blocks mirrors the forward's; masks, softcap,
ALiBi and dropout come from the forward's device helpers, so both passes see the same scores.
Varlen: sequence bounds are read from ``cu_seqlens`` on the device; grids are sized from the host's
``max_seqlen_*`` (upper bounds), so forward and backward capture in one CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .._runtime import (CachedLaunch, as_template, cache_put, cast_for_store, cdiv, dot, ensure_cuda_context,
                        is_hopper, is_interpreter, on_current_device)
from . import _fwd
from ._fwd import (
    FP32_PRECISION,
    HAVE_GLUON,
    Problem,
    ceil_to,
    dropout_keep,
    floor_to,
    head_dim_pad,
    head_options,
    hopper_descriptor,
    key_ranges,
    load_block,
    load_rows,
    lse_strides,
    plan_key,
    rebased,
    row_count,
    row_descriptor,
    scores_log2,
    seq_bounds,
    seq_source,
    seq_strides,
    use_tensor_descriptors,
)

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from ._fwd import _fa3_allowed, _fa3_sequence, _fresh, _smem_reinterpret, _tma_load, _zero_rows_past

    # the TMA reduce-add (cp.reduce.async.bulk.tensor): triton 3.9's Gluon has it; 3.6's IR has the op but
    # its Gluon API does not, so build it the way 3.9 does
    _tma_reduce_add = getattr(tma, "async_atomic_add", None)
    if _tma_reduce_add is None:
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)


@triton.jit
def _attn_bwd_delta(Out, DO, Delta, CuSeqlensQ, DqAcc, stride_ob, stride_os, stride_oh, stride_dob, stride_dos,
                    stride_doh, stride_lb, stride_lh, stride_ab, stride_as, stride_ah, seqlen_q_batch, num_heads,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                    IS_VARLEN: tl.constexpr, ZERO_ACC: tl.constexpr):
    """delta[b, h, i] = sum_d do * o (fp32), laid out like LSE; with ``ZERO_ACC`` also zeroes the same rows of
    the Gluon backward's fp32 dQ accumulator (laid out as q), so that it needs no fill kernel of its own."""
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    start_q, seqlen_q = seq_bounds(CuSeqlensQ, b, seqlen_q_batch, IS_VARLEN)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 >= seqlen_q:
        return
    row0 = (start_q + m0).to(tl.int64)
    offs_tile = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o = load_rows(Out + b.to(tl.int64) * stride_ob + row0 * stride_os + h.to(tl.int64) * stride_oh,
                  offs_tile, stride_os, offs_d, seqlen_q - m0, HEAD_DIM, True, EVEN_D)
    do = load_rows(DO + b.to(tl.int64) * stride_dob + row0 * stride_dos + h.to(tl.int64) * stride_doh,
                   offs_tile, stride_dos, offs_d, seqlen_q - m0, HEAD_DIM, True, EVEN_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    ptrs = Delta + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + row0 + offs_tile
    tl.store(ptrs, delta, mask=offs_tile < seqlen_q - m0)
    if ZERO_ACC:
        acc = DqAcc + b.to(tl.int64) * stride_ab + row0 * stride_as + h.to(tl.int64) * stride_ah
        tl.store(acc + offs_tile[:, None] * stride_as + offs_d[None, :], tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32),
                 mask=(offs_tile[:, None] < seqlen_q - m0) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _scale_cast(Src, Dst, n, scale, BLOCK: tl.constexpr):
    """dst = src * scale rounded to dst's dtype, over ``n`` contiguous elements: the Gluon backward's fp32 dQ
    accumulator into dq. (It replaced ``torch.mul(acc, scale, out=dq)``, the same bits: H100, D 64, +0.5% on
    the whole backward.)"""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(Src + offs, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(Dst + offs, cast_for_store(x * scale, Dst.dtype.element_ty), mask=mask)


_CAST_BLOCK = 4096


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_src, do_src, q_row0, head, lse_base, delta_base, stride_qs, stride_dos,
                 offs_n, offs_m, offs_d, lo, hi, seqlen_q, seqlen_k, qk_scale_log2, softcap_log2,
                 scale_over_cap, slope_log2, window_left, window_right, seed, rng_offset, bh, dropout_p,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                 EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, COMPUTE_DK: tl.constexpr,
                 COMPUTE_DV: tl.constexpr):
    """dK, dV of one key block accumulated over query blocks ``[lo, hi)`` of one head (transposed
    scores: rows are keys, columns queries, so no tile is transposed in registers). ``COMPUTE_DK`` /
    ``COMPUTE_DV`` leave one of them out (see ``_attn_bwd_dkdv``)."""
    for m0 in tl.range(lo, hi, BLOCK_M):
        q = load_block(q_src, q_row0, m0, head, offs_m, stride_qs, offs_d, seqlen_q - m0, HEAD_DIM,
                       HEAD_DIM_PAD, BLOCK_M, MASKED, EVEN_D, USE_TMA)
        q_idx = m0 + offs_m
        if MASKED:
            lse2 = tl.load(lse_base + q_idx, mask=q_idx < seqlen_q, other=float("inf")) * 1.4426950408889634
        else:
            lse2 = tl.load(lse_base + q_idx) * 1.4426950408889634
        # [BN, D] @ [D, BM] -> [BN, BM]
        qkT = dot(k, tl.trans(q), tl.zeros((BLOCK_N, BLOCK_M), tl.float32), FP32_PRECISION)
        sT, tT = scores_log2(qkT, q_idx[None, :], offs_n[:, None], seqlen_q, seqlen_k, qk_scale_log2,
                             softcap_log2, scale_over_cap, slope_log2, window_left, window_right,
                             MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI)
        pT = tl.math.exp2(sT - lse2[None, :])
        do = load_block(do_src, q_row0, m0, head, offs_m, stride_dos, offs_d, seqlen_q - m0, HEAD_DIM,
                        HEAD_DIM_PAD, BLOCK_M, MASKED, EVEN_D, USE_TMA)
        if HAS_DROPOUT:
            keepT = dropout_keep(seed, rng_offset, bh, q_idx[None, :], offs_n[:, None], dropout_p)
            scale_keep = 1.0 / (1.0 - dropout_p)
        # dP is issued before the dV product: that order measured ~4% faster at D 128 on an H100
        if COMPUTE_DK:
            # [BN, D] @ [D, BM] -> [BN, BM]
            dpT = dot(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M), tl.float32), FP32_PRECISION)
        if COMPUTE_DV:
            if HAS_DROPOUT:
                pT_kept = tl.where(keepT, pT * scale_keep, 0.0)
            else:
                pT_kept = pT
            dv = dot(pT_kept.to(do.dtype), do, dv, FP32_PRECISION)  # [BN, BM] @ [BM, D] -> [BN, D]
        if COMPUTE_DK:
            if HAS_DROPOUT:
                dpT = tl.where(keepT, dpT * scale_keep, 0.0)
            if MASKED:
                delta = tl.load(delta_base + q_idx, mask=q_idx < seqlen_q, other=0.0)
            else:
                delta = tl.load(delta_base + q_idx)
            dsT = pT * (dpT - delta[None, :])
            if HAS_SOFTCAP:
                dsT = dsT * (1.0 - tT * tT)
            dk = dot(dsT.to(q.dtype), q, dk, FP32_PRECISION)  # [BN, BM] @ [BM, D] -> [BN, D]
    return dk, dv


# The batch-mode sequence lengths are not specialised on their values (triton makes an int that equals 1
# a constant): at head dim 256 the dK/dV and dQ kernels specialised for seqlen_q = 1 with head_group = 1
# crash ptxas (triton 3.6's, SIGSEGV; seen on the H100, and reproduced for both by compiling for sm_90 on
# a CPU machine).
@triton.jit(do_not_specialize=["seqlen_q_batch", "seqlen_k_batch"])
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, Lse, Delta, CuSeqlensQ, CuSeqlensK, AlibiSlopes, SeedOffset,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                   stride_vh, stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh,
                   stride_dvb, stride_dvs, stride_dvh, stride_lb, stride_lh, stride_ab, seqlen_q_batch,
                   seqlen_k_batch, num_heads, num_kv_heads, head_group, qk_scale_log2, softcap_log2,
                   scale_over_cap, window_left, window_right, dropout_p, scale, HEAD_DIM: tl.constexpr,
                   HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                   USE_TMA: tl.constexpr, COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr):
    """dk, dv for key rows n0:n0+BLOCK_N of one (sequence, KV head), summed over its query heads.

    ``COMPUTE_DK`` / ``COMPUTE_DV``: at head dim 256 one launch per gradient, so each program holds one
    [BLOCK_N, 256] fp32 accumulator instead of two (the dK launch recomputes P, the dV launch skips dP).
    With ``USE_TMA``, Q and dO are tensor descriptors (as in the forward)."""
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_kv_heads
    hk = pid_bh % num_kv_heads
    start_q, seqlen_q = seq_bounds(CuSeqlensQ, b, seqlen_q_batch, IS_VARLEN)
    start_k, seqlen_k = seq_bounds(CuSeqlensK, b, seqlen_k_batch, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:
        return
    row0 = (start_k + n0).to(tl.int64)
    offs_tile = tl.arange(0, BLOCK_N)
    offs_n = n0 + offs_tile
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k = load_rows(K + b.to(tl.int64) * stride_kb + row0 * stride_ks + hk.to(tl.int64) * stride_kh,
                  offs_tile, stride_ks, offs_d, seqlen_k - n0, HEAD_DIM, True, EVEN_D)
    if COMPUTE_DK:
        v = load_rows(V + b.to(tl.int64) * stride_vb + row0 * stride_vs + hk.to(tl.int64) * stride_vh,
                      offs_tile, stride_vs, offs_d, seqlen_k - n0, HEAD_DIM, True, EVEN_D)
    else:
        v = k  # unused: the dV-only launch needs no dP
    # query range [lo, hi) that may see any key of the block, and the unmasked middle
    diag = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = (seqlen_q // BLOCK_M) * BLOCK_M
    if n0 + BLOCK_N > seqlen_k:
        full_hi = 0
    if HAS_RIGHT:
        lo = floor_to(n0 - diag - window_right, BLOCK_M)
        full_lo = ceil_to(n0 + BLOCK_N - 1 - diag - window_right, BLOCK_M)
    if HAS_LEFT:
        hi = tl.minimum(hi, tl.maximum(n0 + BLOCK_N - diag + window_left, 0))
        full_hi = tl.minimum(full_hi, floor_to(n0 - diag + window_left + 1, BLOCK_M))
    mid_lo = tl.maximum(lo, tl.minimum(full_lo, hi))
    mid_hi = tl.maximum(mid_lo, tl.minimum(full_hi, hi))

    # a launch that leaves a gradient out carries a 1x1 placeholder, not a [BLOCK_N, D] accumulator
    if COMPUTE_DK:
        dk = tl.zeros((BLOCK_N, HEAD_DIM_PAD), tl.float32)
    else:
        dk = tl.zeros((1, 1), tl.float32)
    if COMPUTE_DV:
        dv = tl.zeros((BLOCK_N, HEAD_DIM_PAD), tl.float32)
    else:
        dv = tl.zeros((1, 1), tl.float32)
    for g in range(head_group):
        h = hk * head_group + g
        head = h.to(tl.int64)
        q_src, q_row0 = seq_source(Q, b, start_q, h, stride_qb, stride_qs, stride_qh, seqlen_q_batch,
                                   IS_VARLEN, USE_TMA)
        do_src, _ = seq_source(DO, b, start_q, h, stride_dob, stride_dos, stride_doh, seqlen_q_batch,
                               IS_VARLEN, USE_TMA)
        row_base = b.to(tl.int64) * stride_lb + head * stride_lh + start_q.to(tl.int64)
        slope_log2, seed, rng_offset, bh = head_options(AlibiSlopes, SeedOffset, b, h, num_heads, stride_ab,
                                                        HAS_ALIBI, HAS_DROPOUT)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, q_row0, h, Lse + row_base, Delta + row_base,
                              stride_qs, stride_dos, offs_n, offs_m, offs_d, lo, mid_lo, seqlen_q, seqlen_k,
                              qk_scale_log2, softcap_log2, scale_over_cap, slope_log2, window_left,
                              window_right, seed, rng_offset, bh, dropout_p, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M,
                              BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D,
                              USE_TMA, COMPUTE_DK, COMPUTE_DV)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, q_row0, h, Lse + row_base, Delta + row_base,
                              stride_qs, stride_dos, offs_n, offs_m, offs_d, mid_lo, mid_hi, seqlen_q,
                              seqlen_k, qk_scale_log2, softcap_log2, scale_over_cap, slope_log2, window_left,
                              window_right, seed, rng_offset, bh, dropout_p, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M,
                              BLOCK_N, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                              EVEN_D, USE_TMA, COMPUTE_DK, COMPUTE_DV)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, q_row0, h, Lse + row_base, Delta + row_base,
                              stride_qs, stride_dos, offs_n, offs_m, offs_d, mid_hi, hi, seqlen_q, seqlen_k,
                              qk_scale_log2, softcap_log2, scale_over_cap, slope_log2, window_left,
                              window_right, seed, rng_offset, bh, dropout_p, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M,
                              BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D,
                              USE_TMA, COMPUTE_DK, COMPUTE_DV)

    row_ok = (offs_tile < seqlen_k - n0)[:, None] & (offs_d[None, :] < HEAD_DIM)
    if COMPUTE_DK:
        dk_ptrs = DK + b.to(tl.int64) * stride_dkb + row0 * stride_dks + hk.to(tl.int64) * stride_dkh
        tl.store(dk_ptrs + offs_tile[:, None] * stride_dks + offs_d[None, :],
                 cast_for_store(dk * scale, DK.dtype.element_ty), mask=row_ok)
    if COMPUTE_DV:
        dv_ptrs = DV + b.to(tl.int64) * stride_dvb + row0 * stride_dvs + hk.to(tl.int64) * stride_dvh
        tl.store(dv_ptrs + offs_tile[:, None] * stride_dvs + offs_d[None, :],
                 cast_for_store(dv, DV.dtype.element_ty), mask=row_ok)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, kv_row0, hk, stride_ks, stride_vs, offs_m, offs_n,
               offs_d, lo, hi, seqlen_q, seqlen_k, qk_scale_log2, softcap_log2, scale_over_cap, slope_log2,
               window_left, window_right, seed, rng_offset, bh, dropout_p, HEAD_DIM: tl.constexpr,
               HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
               USE_TMA: tl.constexpr):
    """dQ of one query block accumulated over key blocks ``[lo, hi)``."""
    for n0 in tl.range(lo, hi, BLOCK_N):
        k = load_block(k_src, kv_row0, n0, hk, offs_n, stride_ks, offs_d, seqlen_k - n0, HEAD_DIM,
                       HEAD_DIM_PAD, BLOCK_N, MASKED, EVEN_D, USE_TMA)
        v = load_block(v_src, kv_row0, n0, hk, offs_n, stride_vs, offs_d, seqlen_k - n0, HEAD_DIM,
                       HEAD_DIM_PAD, BLOCK_N, MASKED, EVEN_D, USE_TMA)
        k_idx = n0 + offs_n
        # [BM, D] @ [D, BN] -> [BM, BN]
        qk = dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), FP32_PRECISION)
        s, t = scores_log2(qk, offs_m[:, None], k_idx[None, :], seqlen_q, seqlen_k, qk_scale_log2,
                           softcap_log2, scale_over_cap, slope_log2, window_left, window_right,
                           MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI)
        p = tl.math.exp2(s - lse2[:, None])
        # [BM, D] @ [D, BN] -> [BM, BN]
        dp = dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), FP32_PRECISION)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rng_offset, bh, offs_m[:, None], k_idx[None, :], dropout_p)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = dot(ds.to(k.dtype), k, dq, FP32_PRECISION)  # [BM, BN] @ [BN, D] -> [BM, D]
    return dq


@triton.jit(do_not_specialize=["seqlen_q_batch", "seqlen_k_batch"])  # as _attn_bwd_dkdv: ptxas crash
def _attn_bwd_dq(Q, K, V, DO, DQ, Lse, Delta, CuSeqlensQ, CuSeqlensK, AlibiSlopes, SeedOffset, stride_qb,
                 stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh,
                 stride_ab, seqlen_q_batch, seqlen_k_batch, num_heads, head_group, qk_scale_log2,
                 softcap_log2, scale_over_cap, window_left, window_right, dropout_p, scale,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                 HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr):
    """dq for query rows m0:m0+BLOCK_M of one (sequence, head). With ``USE_TMA``, K and V are tensor
    descriptors (as in the forward)."""
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    start_q, seqlen_q = seq_bounds(CuSeqlensQ, b, seqlen_q_batch, IS_VARLEN)
    start_k, seqlen_k = seq_bounds(CuSeqlensK, b, seqlen_k_batch, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    hk = h // head_group
    row0 = (start_q + m0).to(tl.int64)
    head = h.to(tl.int64)
    offs_tile = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_tile
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = load_rows(Q + b.to(tl.int64) * stride_qb + row0 * stride_qs + head * stride_qh, offs_tile, stride_qs,
                  offs_d, seqlen_q - m0, HEAD_DIM, True, EVEN_D)
    do = load_rows(DO + b.to(tl.int64) * stride_dob + row0 * stride_dos + head * stride_doh, offs_tile,
                   stride_dos, offs_d, seqlen_q - m0, HEAD_DIM, True, EVEN_D)
    row_ok = offs_tile < seqlen_q - m0
    row_ptrs = b.to(tl.int64) * stride_lb + head * stride_lh + row0 + offs_tile
    lse2 = tl.load(Lse + row_ptrs, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(Delta + row_ptrs, mask=row_ok, other=0.0)
    k_src, kv_row0 = seq_source(K, b, start_k, hk, stride_kb, stride_ks, stride_kh, seqlen_k_batch, IS_VARLEN,
                                USE_TMA)
    v_src, _ = seq_source(V, b, start_k, hk, stride_vb, stride_vs, stride_vh, seqlen_k_batch, IS_VARLEN,
                          USE_TMA)
    slope_log2, seed, rng_offset, bh = head_options(AlibiSlopes, SeedOffset, b, h, num_heads, stride_ab,
                                                    HAS_ALIBI, HAS_DROPOUT)
    lo, mid_lo, mid_hi, hi = key_ranges(m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
                                        HAS_LEFT, HAS_RIGHT)

    dq = tl.zeros((BLOCK_M, HEAD_DIM_PAD), tl.float32)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, kv_row0, hk, stride_ks, stride_vs, offs_m, offs_n,
                    offs_d, lo, mid_lo, seqlen_q, seqlen_k, qk_scale_log2, softcap_log2, scale_over_cap,
                    slope_log2, window_left, window_right, seed, rng_offset, bh, dropout_p, HEAD_DIM,
                    HEAD_DIM_PAD, BLOCK_M, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                    HAS_DROPOUT, EVEN_D, USE_TMA)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, kv_row0, hk, stride_ks, stride_vs, offs_m, offs_n,
                    offs_d, mid_lo, mid_hi, seqlen_q, seqlen_k, qk_scale_log2, softcap_log2, scale_over_cap,
                    slope_log2, window_left, window_right, seed, rng_offset, bh, dropout_p, HEAD_DIM,
                    HEAD_DIM_PAD, BLOCK_M, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                    HAS_DROPOUT, EVEN_D, USE_TMA)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, kv_row0, hk, stride_ks, stride_vs, offs_m, offs_n,
                    offs_d, mid_hi, hi, seqlen_q, seqlen_k, qk_scale_log2, softcap_log2, scale_over_cap,
                    slope_log2, window_left, window_right, seed, rng_offset, bh, dropout_p, HEAD_DIM,
                    HEAD_DIM_PAD, BLOCK_M, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                    HAS_DROPOUT, EVEN_D, USE_TMA)
    dq_ptrs = DQ + b.to(tl.int64) * stride_dqb + row0 * stride_dqs + head * stride_dqh
    tl.store(dq_ptrs + offs_tile[:, None] * stride_dqs + offs_d[None, :],
             cast_for_store(dq * scale, DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


# ----------------------------------------------------------------------------------------------------
# Hopper (sm_90): one fused kernel in Gluon with FlashAttention-3's backward schedule
#
# A program owns one block of BLOCK_N = 128 keys of one KV head and walks every query block (BLOCK_M
# rows) of every query head of its GQA group that may see it. Four partitions share the SM:
# - a producer warp TMA-loads K and V once and then each query block's Q and dO into a ring of STAGES
#   buffers; rows past the sequence (the next sequence's, or TMA's zero fill) are zeroed before release;
# - two consumer warpgroups, each owning 64 of the keys: per query block
#       s^T = K_w Q^T, dp^T = V_w dO^T (both issued at once), p^T = exp2(s^T * c - lse),
#       dV_w += p^T dO, ds^T = p^T (dp^T - delta), dK_w += ds^T Q,
#   then both write ds^T into one shared [BLOCK_N, BLOCK_M] buffer, and each computes half of the
#   columns of dQ_partial = ds K (A = the shared ds^T, transposed; B = half of K's columns) and writes
#   it to a shared fp32 [BLOCK_M, D] tile;
# - a writer warp adds that tile (double-buffered) into an fp32 dQ accumulator with one TMA reduce-add
#   (``cp.reduce.async.bulk.tensor``), off the consumers' path, as FlashAttention-3 does. Per-element
#   atomics from the writer (``red.global.add.v4.f32``) measured 35% slower than leaving dQ out.
# That is 5 matrix products per (key block, query block) instead of the two-kernel path's 7. The dQ sum
# order depends on which program's reduce lands first, so this path is taken only for
# ``deterministic=False``. The delta kernel zeroes the accumulator first (``_attn_bwd_delta``'s ``ZERO_ACC``),
# ``_scale_cast`` then scales it into dq. With ``stats_ahead`` each consumer loads the next step's LSE and
# delta rows during this step, so their L2 latency is off the path from the score product to its exp2.
#
# Head dim 256 (``SPLIT_D``): dK and dV of 64 keys take all of one warpgroup's registers, so a program
# owns BLOCK_N = 64 keys and the consumers split the head dim instead. Each computes s^T and dp^T for
# half of the step's query rows against all 64 keys, stores its rows of p and ds (bf16) to shared
# memory, and after a barrier accumulates its half of the columns of dV += p^T dO and dK += ds^T Q and
# computes the same half of dQ_partial = ds K. The shared p and ds leave room for two ring slots only if
# the dQ partial has no tile of its own: it is written into the slot's Q and dO bytes once both
# warpgroups are done with them, and the writer frees the slot after its reduce-add.

if HAVE_GLUON:

    @gluon.jit
    def _bwd_producer(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty, fix,
                      q_row0, kv_row, kv_col, h0, lo, n_q, total, n0, seqlen_q, seqlen_k,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      PAIRED: gl.constexpr):
        """One warp: K and V of the key block, then (Q, dO) of step t = g * n_q + j (head h0 + g, query block
        lo + j * BLOCK_M) into ring slot t % STAGES: entry s of ``q_bufs`` and ``do_bufs``, or with ``PAIRED``
        entries 2s and 2s + 1 of one buffer."""
        Q_STEP: gl.constexpr = 2 if PAIRED else 1
        DO_OFF: gl.constexpr = 1 if PAIRED else 0
        kv_bytes: gl.constexpr = 2 * k_desc.block_type.nbytes
        qdo_bytes: gl.constexpr = 2 * q_desc.block_type.nbytes
        fix_phase = n0 * 0
        if n0 + BLOCK_N <= seqlen_k:
            mbarrier.expect(kv_bar, kv_bytes)
            _tma_load(k_desc, [kv_row, kv_col], kv_bar, k_smem)
            _tma_load(v_desc, [kv_row, kv_col], kv_bar, v_smem)
        else:
            # the sequence's last key block: rows past its keys are zeroed (0 * NaN would not be 0 in ds K)
            mbarrier.expect(fix, kv_bytes)
            _tma_load(k_desc, [kv_row, kv_col], fix, k_smem)
            _tma_load(v_desc, [kv_row, kv_col], fix, v_smem)
            mbarrier.wait(fix, 0)
            _zero_rows_past(k_smem, n0, seqlen_k, BLOCK_N)
            _zero_rows_past(v_smem, n0, seqlen_k, BLOCK_N)
            mbarrier.arrive(kv_bar)
            fix_phase = 1
        for t in range(total):
            g = t // n_q
            m = lo + (t - g * n_q) * BLOCK_M
            col = (h0 + g) * HEAD_DIM
            s = t % STAGES
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            if m + BLOCK_M <= seqlen_q:
                mbarrier.expect(ready.index(s), qdo_bytes)
                _tma_load(q_desc, [q_row0 + m, col], ready.index(s), q_bufs.index(s * Q_STEP))
                _tma_load(do_desc, [q_row0 + m, col], ready.index(s), do_bufs.index(s * Q_STEP + DO_OFF))
            else:
                # the last query block of a head (once per head): zero the rows past the sequence
                mbarrier.expect(fix, qdo_bytes)
                _tma_load(q_desc, [q_row0 + m, col], fix, q_bufs.index(s * Q_STEP))
                _tma_load(do_desc, [q_row0 + m, col], fix, do_bufs.index(s * Q_STEP + DO_OFF))
                mbarrier.wait(fix, fix_phase)
                fix_phase = fix_phase ^ 1
                _zero_rows_past(q_bufs.index(s * Q_STEP), m, seqlen_q, BLOCK_M)
                _zero_rows_past(do_bufs.index(s * Q_STEP + DO_OFF), m, seqlen_q, BLOCK_M)
                mbarrier.arrive(ready.index(s))

    @gluon.jit
    def _bwd_row_stats(Lse, Delta, l_base, g, stride_lh, q_pos, seqlen_q):
        """(lse * log2(e), delta) of query rows ``q_pos`` of head h0 + g; rows past the sequence get lse +inf,
        so p = 0 there."""
        row_ok = q_pos < seqlen_q
        l_ptrs = l_base + g * stride_lh + q_pos
        lse2 = gl.load(Lse + l_ptrs, mask=row_ok, other=float("inf")) * 1.4426950408889634
        delta = gl.load(Delta + l_ptrs, mask=row_ok, other=0.0)
        return lse2, delta

    @gluon.jit
    def _bwd_step_stats(Lse, Delta, l_base, stride_lh, t, lo, n_q, total, seqlen_q, BLOCK_M: gl.constexpr,
                        layout: gl.constexpr):
        """``_bwd_row_stats`` of step t (head h0 + t // n_q, query block lo + (t % n_q) * BLOCK_M) as the
        columns of a ``layout`` tile; nothing is read for t past the last step (all rows masked)."""
        g = t // gl.maximum(n_q, 1)
        q_pos = lo + (t - g * n_q) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
        return _bwd_row_stats(Lse, Delta, l_base, g, stride_lh, q_pos, gl.where(t < total, seqlen_q, 0))

    @gluon.jit
    def _bwd_probs_t(sT, lse2, k_pos, q_pos, k_first, k_last, q_first, q_last, keys_whole, seqlen_k, diag,
                     qk_scale_log2, window_left, window_right, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
        """p^T of a [keys, queries] score tile whose keys are ``k_first..k_last`` and queries
        ``q_first..q_last``: the mask is built only where some pair of the tile may be outside it."""
        unmasked = keys_whole
        if HAS_RIGHT:
            unmasked = unmasked & (k_last <= q_first + diag + window_right)
        if HAS_LEFT:
            unmasked = unmasked & (k_first >= q_last + diag - window_left)
        if unmasked:
            pT = gl.exp2(sT * qk_scale_log2 - gl.expand_dims(lse2, 0))
        else:
            allowed = _fa3_allowed(gl.expand_dims(k_pos, 1), gl.expand_dims(q_pos, 0), seqlen_k, diag,
                                   window_left, window_right, HAS_LEFT, HAS_RIGHT)
            pT = gl.where(allowed, gl.exp2(sT * qk_scale_log2 - gl.expand_dims(lse2, 0)), 0.0)
        return pT

    @gluon.jit
    def _bwd_store_dkdv(DK, DV, dk, dv, dk_base, dv_base, stride_dks, stride_dvs, row0, col0, seqlen_k, scale,
                        ROWS: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr):
        """Rows ``row0 ...`` (those inside the sequence) and columns ``col0 ...`` of dk (times ``scale``) and dv."""
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        ok = gl.expand_dims(rows < seqlen_k, 1)
        r64 = gl.expand_dims(rows.to(gl.int64), 1)
        gl.store(DK + dk_base + r64 * stride_dks + gl.expand_dims(cols, 0), (dk * scale).to(DK.dtype.element_ty),
                 mask=ok)
        gl.store(DV + dv_base + r64 * stride_dvs + gl.expand_dims(cols, 0), dv.to(DV.dtype.element_ty), mask=ok)

    @gluon.jit
    def _bwd_consumer(W: gl.constexpr, k_smem, v_smem, q_bufs, do_bufs, ds_smem, dq_smem, kv_bar, ready, empty,
                      ds_full, ds_free, dq_full, dq_free, DK, DV, Lse, Delta, dk_base, dv_base, stride_dks,
                      stride_dvs, l_base, stride_lh, n0, lo, n_q, total, seqlen_q, seqlen_k, qk_scale_log2, scale,
                      window_left, window_right, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                      EARLY_DQ: gl.constexpr, FRESH_KV: gl.constexpr, WITH_DQ: gl.constexpr,
                      STATS_AHEAD: gl.constexpr):
        """One warpgroup: keys ``n0 + W * BLOCK_N / 2 ...``; accumulates their dK and dV over every step and
        (``WITH_DQ``) computes columns ``W * D / 2 ...`` of each step's dQ partial. ``STATS_AHEAD``: each step's
        LSE and delta rows are loaded during the step before (``HopperBwdConfig.stats_ahead``)."""
        HALF: gl.constexpr = BLOCK_N // 2
        DQ_N: gl.constexpr = HEAD_DIM // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_N, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = k_smem.dtype

        nw0 = n0 + W * HALF
        k_cols = k_smem.slice(W * DQ_N, DQ_N, dim=1)
        ds_w = ds_smem.slice(W * HALF, HALF, dim=0)
        k_pos = nw0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
        diag = seqlen_k - seqlen_q
        keys_whole = nw0 + HALF <= seqlen_k

        dk = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
        dv = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
        if STATS_AHEAD:
            lse2_next, delta_next = _bwd_step_stats(Lse, Delta, l_base, stride_lh, 0, lo, n_q, total, seqlen_q,
                                                    BLOCK_M, s_layout)
        mbarrier.wait(kv_bar, 0)
        for t in range(total):
            g = t // n_q
            m = lo + (t - g * n_q) * BLOCK_M
            s = t % STAGES
            q = q_bufs.index(s)
            do = do_bufs.index(s)
            q_pos = m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            if STATS_AHEAD:
                lse2 = lse2_next
                delta = delta_next
            else:
                lse2, delta = _bwd_row_stats(Lse, Delta, l_base, g, stride_lh, q_pos, seqlen_q)
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
            zero_s = gl.zeros([HALF, BLOCK_M], gl.float32, s_layout)
            k_w = _fresh(k_smem, t, FRESH_KV).slice(W * HALF, HALF, dim=0)
            v_w = _fresh(v_smem, t, FRESH_KV).slice(W * HALF, HALF, dim=0)
            s_tok = warpgroup_mma(k_w, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(v_w, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            sT = warpgroup_mma_wait(1, deps=(s_tok,))
            pT = _bwd_probs_t(sT, lse2, k_pos, q_pos, nw0, nw0 + HALF - 1, m, m + BLOCK_M - 1, keys_whole, seqlen_k,
                              diag, qk_scale_log2, window_left, window_right, HAS_LEFT, HAS_RIGHT)
            dpT = warpgroup_mma_wait(0, deps=(dp_tok,))
            dsT = (pT * (dpT - gl.expand_dims(delta, 0))).to(dtype)
            if STATS_AHEAD:
                # the loads have a whole step to land: issued at the step's start, their L2 latency stalled the
                # exp2 right after the score product (ncu, D 64: long-scoreboard stalls led)
                lse2_next, delta_next = _bwd_step_stats(Lse, Delta, l_base, stride_lh, t + 1, lo, n_q, total,
                                                        seqlen_q, BLOCK_M, s_layout)
            p_op = gl.convert_layout(pT.to(dtype), op_layout)
            dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)
            ds_op = gl.convert_layout(dsT, op_layout)
            dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)
            if WITH_DQ:
                # ds^T into the shared buffer once the other warpgroup has read the previous step's
                mbarrier.wait(ds_free, (t & 1) ^ 1)
                ds_w.store(dsT)
                fence_async_shared()
                mbarrier.arrive(ds_full)
            if not (EARLY_DQ and WITH_DQ):
                dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
                mbarrier.arrive(empty.index(s))
            if WITH_DQ:
                # dQ partial [BLOCK_M, DQ_N] = ds [BLOCK_M, BLOCK_N] @ K[:, W * DQ_N ...]; with EARLY_DQ queued
                # behind dV and dK, without draining the tensor cores in between
                mbarrier.wait(ds_full, t & 1)
                zero_dq = gl.zeros([BLOCK_M, DQ_N], gl.float32, dq_layout)
                dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_cols, zero_dq, use_acc=False, is_async=True)
                if EARLY_DQ:
                    dv, dk, p_op, ds_op, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op, dq_tok))
                    mbarrier.arrive(empty.index(s))
                else:
                    dq = warpgroup_mma_wait(0, deps=(dq_tok,))
                mbarrier.arrive(ds_free)
                b = t % 2
                mbarrier.wait(dq_free.index(b), ((t // 2) & 1) ^ 1)
                dq_smem.index(b).slice(W * DQ_N, DQ_N, dim=1).store(dq)
                fence_async_shared()
                mbarrier.arrive(dq_full.index(b))

        _bwd_store_dkdv(DK, DV, dk, dv, dk_base, dv_base, stride_dks, stride_dvs, nw0, 0, seqlen_k, scale, HALF,
                        HEAD_DIM, o_layout)

    @gluon.jit
    def _bwd_consumer_split_d(W: gl.constexpr, k_smem, v_smem, q_bufs, do_bufs, p_smem, ds_smem, dq_smem, kv_bar,
                              ready, empty, ds_full, ds_free, dq_full, dq_free, DK, DV, Lse, Delta, dk_base, dv_base,
                              stride_dks, stride_dvs, l_base, stride_lh, n0, lo, n_q, total, seqlen_q, seqlen_k,
                              qk_scale_log2, scale, window_left, window_right, HEAD_DIM: gl.constexpr,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, FRESH_KV: gl.constexpr):
        """One warpgroup of the head-dim-split schedule (head dim 256, where one warpgroup cannot hold dK and dV
        of 64 keys): scores for query rows ``W * BLOCK_M / 2 ...`` of each step against all BLOCK_N keys, and
        columns ``W * D / 2 ...`` of dK, dV (accumulated over the steps) and of each step's dQ partial. p and
        ds go through shared memory ([BLOCK_M, BLOCK_N], each warpgroup writes its query rows), because
        every column of dK, dV and dQ needs all of them. A ring slot holds a step's Q and dO (``q_bufs``
        entries 2s and 2s + 1) and, once both warpgroups are done with them, the step's fp32 dQ partial
        (``dq_smem`` entry s, the same bytes); the dQ writer frees the slot."""
        QH: gl.constexpr = BLOCK_M // 2
        DH: gl.constexpr = HEAD_DIM // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, QH, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DH, 16])
        dtype: gl.constexpr = k_smem.dtype

        k_pos = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        k_cols = k_smem.slice(W * DH, DH, dim=1)
        p_rows = p_smem.slice(W * QH, QH, dim=0).permute((1, 0))
        ds_rows = ds_smem.slice(W * QH, QH, dim=0).permute((1, 0))
        diag = seqlen_k - seqlen_q
        keys_whole = n0 + BLOCK_N <= seqlen_k

        dk = gl.zeros([BLOCK_N, DH], gl.float32, o_layout)
        dv = gl.zeros([BLOCK_N, DH], gl.float32, o_layout)
        mbarrier.wait(kv_bar, 0)
        for t in range(total):
            g = t // n_q
            m = lo + (t - g * n_q) * BLOCK_M
            s = t % STAGES
            q = q_bufs.index(2 * s)
            do = do_bufs.index(2 * s + 1)
            mw = m + W * QH
            q_pos = mw + gl.arange(0, QH, layout=gl.SliceLayout(0, s_layout))
            lse2, delta = _bwd_row_stats(Lse, Delta, l_base, g, stride_lh, q_pos, seqlen_q)
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
            zero_s = gl.zeros([BLOCK_N, QH], gl.float32, s_layout)
            k_op = _fresh(k_smem, t, FRESH_KV)
            s_tok = warpgroup_mma(k_op, q.slice(W * QH, QH, dim=0).permute((1, 0)), zero_s, use_acc=False,
                                  is_async=True)
            v_op = _fresh(v_smem, t, FRESH_KV)
            dp_tok = warpgroup_mma(v_op, do.slice(W * QH, QH, dim=0).permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
            sT = warpgroup_mma_wait(1, deps=(s_tok,))
            pT = _bwd_probs_t(sT, lse2, k_pos, q_pos, n0, n0 + BLOCK_N - 1, mw, mw + QH - 1, keys_whole, seqlen_k, diag,
                              qk_scale_log2, window_left, window_right, HAS_LEFT, HAS_RIGHT)
            dpT = warpgroup_mma_wait(0, deps=(dp_tok,))
            dsT = (pT * (dpT - gl.expand_dims(delta, 0))).to(dtype)
            # this warpgroup's rows of p and ds, once both warpgroups have read the previous step's
            mbarrier.wait(ds_free, (t & 1) ^ 1)
            p_rows.store(pT.to(dtype))
            ds_rows.store(dsT)
            fence_async_shared()
            mbarrier.arrive(ds_full)
            mbarrier.wait(ds_full, t & 1)
            # dV[:, cols] += p^T dO[:, cols], dK[:, cols] += ds^T Q[:, cols], dQ partial[:, cols] = ds K[:, cols]
            dv_tok = warpgroup_mma(p_smem.permute((1, 0)), do.slice(W * DH, DH, dim=1), dv, is_async=True)
            dk_tok = warpgroup_mma(ds_smem.permute((1, 0)), q.slice(W * DH, DH, dim=1), dk, is_async=True)
            zero_dq = gl.zeros([BLOCK_M, DH], gl.float32, o_layout)
            dq_tok = warpgroup_mma(ds_smem, k_cols, zero_dq, use_acc=False, is_async=True)
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
            mbarrier.arrive(ds_free)
            # both warpgroups done with the step's products: Q and dO are dead, the dQ partial takes their bytes
            mbarrier.wait(ds_free, t & 1)
            dq_smem.index(s).slice(W * DH, DH, dim=1).store(dq)
            fence_async_shared()
            mbarrier.arrive(dq_full.index(s))

        _bwd_store_dkdv(DK, DV, dk, dv, dk_base, dv_base, stride_dks, stride_dvs, n0, W * DH, seqlen_k, scale,
                        BLOCK_N, DH, o_layout)

    @gluon.jit
    def _bwd_dq_writer(dq_desc, dq_smem, dq_full, dq_free, q_row0, h0, lo, n_q, total, HEAD_DIM: gl.constexpr,
                       BLOCK_M: gl.constexpr, DQ_BUFS: gl.constexpr):
        """One warp: adds each step's shared dQ partial into the fp32 accumulator with a TMA reduce-add. Rows
        past the sequence add exact zeros (their p, and so ds, is 0), so no mask is needed; rows past the
        tensor are dropped by TMA."""
        for t in range(total):
            g = t // n_q
            m = lo + (t - g * n_q) * BLOCK_M
            b = t % DQ_BUFS
            mbarrier.wait(dq_full.index(b), (t // DQ_BUFS) & 1)
            _tma_reduce_add(dq_desc, [q_row0 + m, (h0 + g) * HEAD_DIM], dq_smem.index(b))
            tma.store_wait(0)
            mbarrier.arrive(dq_free.index(b))

    @gluon.jit
    def _attn_bwd_hopper(q_desc, k_desc, v_desc, do_desc, dq_desc, DK, DV, Lse, Delta, CuSeqlensQ, CuSeqlensK,
                         stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, stride_lb,
                         stride_lh, seqlen_q_batch, seqlen_k_batch, num_kv_heads, head_group,
                         qk_scale_log2, scale, window_left, window_right, HEAD_DIM: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         IS_VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                         SPLIT_D: gl.constexpr, CONSUMER_REGS: gl.constexpr, WORKER_REGS: gl.constexpr,
                         EARLY_DQ: gl.constexpr, FRESH_KV: gl.constexpr, WITH_DQ: gl.constexpr,
                         STATS_AHEAD: gl.constexpr):
        """dk, dv of BLOCK_N key rows of one (sequence, KV head) and (``WITH_DQ``) their share of dq (added into
        an fp32 accumulator laid out as q); q/k/v/dO and the accumulator are descriptors over ``[rows, H * D]``.
        ``SPLIT_D``: the consumer warpgroups split the head dim instead of the keys (``_bwd_consumer_split_d``),
        and each ring slot's Q and dO bytes take the step's dQ partial once dead (no separate dQ tiles)."""
        pid_n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // num_kv_heads
        hk = pid_bh % num_kv_heads
        start_q, seqlen_q, start_k, seqlen_k = _fa3_sequence(CuSeqlensQ, CuSeqlensK, b, seqlen_q_batch,
                                                             seqlen_k_batch, IS_VARLEN)
        n0 = pid_n * BLOCK_N
        # the query blocks that may see any key of the block (bottom-right aligned masks)
        diag = seqlen_k - seqlen_q
        lo = n0 * 0
        hi = seqlen_q
        if HAS_RIGHT:
            lo = (gl.maximum(n0 - diag - window_right, 0) // BLOCK_M) * BLOCK_M
        if HAS_LEFT:
            hi = gl.minimum(hi, gl.maximum(n0 + BLOCK_N - diag + window_left, 0))
        n_q = gl.where(n0 < seqlen_k, gl.maximum(gl.cdiv(hi - lo, BLOCK_M), 0), 0)
        total = n_q * head_group
        h0 = hk * head_group
        if IS_VARLEN:
            dk_base = hk.to(gl.int64) * stride_dkh + start_k.to(gl.int64) * stride_dks
            dv_base = hk.to(gl.int64) * stride_dvh + start_k.to(gl.int64) * stride_dvs
            l_base = h0.to(gl.int64) * stride_lh + start_q.to(gl.int64)
        else:
            dk_base = b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh
            dv_base = b.to(gl.int64) * stride_dvb + hk.to(gl.int64) * stride_dvh
            l_base = b.to(gl.int64) * stride_lb + h0.to(gl.int64) * stride_lh

        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
        if SPLIT_D:
            # slot s: Q (entry 2s) and dO (2s + 1), later the fp32 dQ partial in the same bytes
            DQ_BUFS: gl.constexpr = STAGES
            q_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
            do_bufs = q_bufs
            dq_smem = _smem_reinterpret(q_bufs, gl.float32, [STAGES, BLOCK_M, HEAD_DIM], dq_desc.layout)
            # p and ds query-major: each warpgroup stores its query rows
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
            ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], ds_layout)
            p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], ds_layout)
        else:
            DQ_BUFS: gl.constexpr = 2
            q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
            do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
            ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
            if WITH_DQ:
                dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, BLOCK_M, HEAD_DIM], dq_desc.layout)
            else:
                dq_smem = ds_smem   # not used
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        fix = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
        dq_free = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(fix, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            # freed by both consumers, or (SPLIT_D) by the dQ writer once the slot's dQ partial is added
            mbarrier.init(empty.index(i), count=1 if SPLIT_D else 2)
        mbarrier.init(ds_full, count=2)
        mbarrier.init(ds_free, count=2)
        for i in gl.static_range(DQ_BUFS):
            mbarrier.init(dq_full.index(i), count=2)
            mbarrier.init(dq_free.index(i), count=1)
        fence_async_shared()

        if SPLIT_D:
            gl.warp_specialize([
                (_bwd_consumer_split_d, (0, k_smem, v_smem, q_bufs, do_bufs, p_smem, ds_smem, dq_smem, kv_bar, ready,
                                         empty, ds_full, ds_free, dq_full, dq_free, DK, DV, Lse, Delta, dk_base,
                                         dv_base, stride_dks, stride_dvs, l_base, stride_lh, n0, lo, n_q, total,
                                         seqlen_q, seqlen_k, qk_scale_log2, scale, window_left, window_right, HEAD_DIM,
                                         BLOCK_M, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, FRESH_KV)),
                (_bwd_consumer_split_d, (1, k_smem, v_smem, q_bufs, do_bufs, p_smem, ds_smem, dq_smem, kv_bar, ready,
                                         empty, ds_full, ds_free, dq_full, dq_free, DK, DV, Lse, Delta, dk_base,
                                         dv_base, stride_dks, stride_dvs, l_base, stride_lh, n0, lo, n_q, total,
                                         seqlen_q, seqlen_k, qk_scale_log2, scale, window_left, window_right, HEAD_DIM,
                                         BLOCK_M, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, FRESH_KV)),
                (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
                                 fix, start_q, start_k + n0, hk * HEAD_DIM, h0, lo, n_q, total, n0, seqlen_q, seqlen_k,
                                 HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, True)),
                # the writer frees the ring slot (``empty``) once the slot's dQ partial is added
                (_bwd_dq_writer, (dq_desc, dq_smem, dq_full, empty, start_q, h0, lo, n_q, total, HEAD_DIM, BLOCK_M,
                                  DQ_BUFS)),
            ], [4, 1, 1], [CONSUMER_REGS, WORKER_REGS, WORKER_REGS])
        elif WITH_DQ:
            gl.warp_specialize([
                (_bwd_consumer, (0, k_smem, v_smem, q_bufs, do_bufs, ds_smem, dq_smem, kv_bar, ready, empty, ds_full,
                                 ds_free, dq_full, dq_free, DK, DV, Lse, Delta, dk_base, dv_base, stride_dks,
                                 stride_dvs, l_base, stride_lh, n0, lo, n_q, total, seqlen_q, seqlen_k, qk_scale_log2,
                                 scale, window_left, window_right, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_LEFT,
                                 HAS_RIGHT, EARLY_DQ, FRESH_KV, WITH_DQ, STATS_AHEAD)),
                (_bwd_consumer, (1, k_smem, v_smem, q_bufs, do_bufs, ds_smem, dq_smem, kv_bar, ready, empty, ds_full,
                                 ds_free, dq_full, dq_free, DK, DV, Lse, Delta, dk_base, dv_base, stride_dks,
                                 stride_dvs, l_base, stride_lh, n0, lo, n_q, total, seqlen_q, seqlen_k, qk_scale_log2,
                                 scale, window_left, window_right, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_LEFT,
                                 HAS_RIGHT, EARLY_DQ, FRESH_KV, WITH_DQ, STATS_AHEAD)),
                (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
                                 fix, start_q, start_k + n0, hk * HEAD_DIM, h0, lo, n_q, total, n0, seqlen_q, seqlen_k,
                                 HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, False)),
                (_bwd_dq_writer, (dq_desc, dq_smem, dq_full, dq_free, start_q, h0, lo, n_q, total, HEAD_DIM, BLOCK_M,
                                  DQ_BUFS)),
            ], [4, 1, 1], [CONSUMER_REGS, WORKER_REGS, WORKER_REGS])
        else:
            # dK and dV only: dQ comes from the Triton dQ kernel (``HopperBwdConfig.with_dq``). The partitions are
            # written out again, without the dQ writer: triton 3.6's Gluon takes the partition list only as a
            # literal, not built in a variable
            gl.warp_specialize([
                (_bwd_consumer, (0, k_smem, v_smem, q_bufs, do_bufs, ds_smem, dq_smem, kv_bar, ready, empty, ds_full,
                                 ds_free, dq_full, dq_free, DK, DV, Lse, Delta, dk_base, dv_base, stride_dks,
                                 stride_dvs, l_base, stride_lh, n0, lo, n_q, total, seqlen_q, seqlen_k, qk_scale_log2,
                                 scale, window_left, window_right, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_LEFT,
                                 HAS_RIGHT, EARLY_DQ, FRESH_KV, WITH_DQ, STATS_AHEAD)),
                (_bwd_consumer, (1, k_smem, v_smem, q_bufs, do_bufs, ds_smem, dq_smem, kv_bar, ready, empty, ds_full,
                                 ds_free, dq_full, dq_free, DK, DV, Lse, Delta, dk_base, dv_base, stride_dks,
                                 stride_dvs, l_base, stride_lh, n0, lo, n_q, total, seqlen_q, seqlen_k, qk_scale_log2,
                                 scale, window_left, window_right, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_LEFT,
                                 HAS_RIGHT, EARLY_DQ, FRESH_KV, WITH_DQ, STATS_AHEAD)),
                (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
                                 fix, start_q, start_k + n0, hk * HEAD_DIM, h0, lo, n_q, total, n0, seqlen_q, seqlen_k,
                                 HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, False)),
            ], [4, 1], [CONSUMER_REGS, WORKER_REGS])


# ----------------------------------------------------------------------------------------------------
# launch configs: data, per head-dim bucket


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    block_m: int        # query rows per step of the dK/dV kernel, per program of the dQ kernel
    block_n: int        # key rows per program of the dK/dV kernel, per step of the dQ kernel
    num_warps: int
    num_stages: int
    split_dkdv: bool = False  # dK/dV kernel: one launch per gradient (one accumulator per program)


# Hopper, keyed by padded head dim: (dK/dV config, dQ config); chosen by sweeps on an H100 (bf16,
# TMA loads, 2026-11-22): D 128 453 TFLOP/s with 3 stages (373 with 2, 362 at 64x64/4 warps); D 64
# 64x64/4 warps 339 (316 at the D 128 config). D 256 spills two [BLOCK_N, 256] accumulators at every
# size that fits (best 154 at 32x32/4); one launch per gradient (``split_dkdv``) at 64x64/4 gives 203
# non-causal, 149 causal, and a 128x32/8 dQ another few percent.
BWD_CONFIGS = {
    16: (BwdConfig(64, 64, 4, 3), BwdConfig(64, 64, 4, 3)),
    32: (BwdConfig(64, 64, 4, 3), BwdConfig(64, 64, 4, 3)),
    64: (BwdConfig(64, 64, 4, 3), BwdConfig(64, 64, 4, 3)),
    128: (BwdConfig(64, 128, 8, 3), BwdConfig(128, 64, 8, 3)),
    256: (BwdConfig(64, 64, 4, 2, split_dkdv=True), BwdConfig(128, 32, 8, 2)),
}
INTERPRETER_BWD_CONFIGS = (BwdConfig(16, 32, 4, 1), BwdConfig(32, 16, 4, 1))

config_override: tuple[BwdConfig, BwdConfig] | None = None


def bwd_configs(head_dim: int) -> tuple[BwdConfig, BwdConfig]:
    if config_override is not None:
        return config_override
    if is_interpreter():
        return INTERPRETER_BWD_CONFIGS
    return BWD_CONFIGS[head_dim_pad(head_dim)]


@dataclasses.dataclass(frozen=True)
class HopperBwdConfig:
    """The Gluon backward's launch: ``block_m`` query rows per step against ``block_n`` keys per program,
    ``stages`` ring slots for Q and dO, the register split, and the schedule: two consumer warpgroups
    owning half of the keys each, or (``split_d``) half of the head dim each."""
    block_m: int
    stages: int
    consumer_regs: int = 240
    worker_regs: int = 32
    block_n: int = 128
    split_d: bool = False
    # issue each step's dQ product right behind dV and dK and wait for the three together, instead of
    # waiting for dV and dK first (the two-consumer schedule only)
    early_dq: bool = False
    # K and V of the score products addressed through an opaque index (``_fresh``), so that their wgmma
    # descriptors are rebuilt in each step instead of hoisted out of the loop, spilled and reloaded right
    # before the products
    fresh_kv: bool = True
    # False: the Gluon kernel computes dK and dV only, and the Triton dQ kernel (``bwd_configs``) writes dq
    # directly: no fp32 accumulator to zero and scale, no reduce-adds, and the same bits run to run
    with_dq: bool = True
    # load each step's LSE and delta rows during the step before (two-consumer schedule): issued at the step's
    # start, their L2 latency was exposed right after the score product
    stats_ahead: bool = False

    def __post_init__(self):
        if self.split_d and self.early_dq:
            raise ValueError("HopperBwdConfig: early_dq applies to the two-consumer schedule, not to split_d")
        if self.split_d and not self.with_dq:
            raise ValueError("HopperBwdConfig: with_dq=False applies to the two-consumer schedule, not to split_d")
        if self.split_d and self.stats_ahead:
            raise ValueError("HopperBwdConfig: stats_ahead applies to the two-consumer schedule, not to split_d")


# Keyed by (head dim, causal or windowed). Chosen on an H100 (bf16, 2026-11-23, 3 interleaved rounds of
# do_bench medians, backward only, TFLOP/s; benchmarks/NOTES.md), fused against the two-kernel path:
# D 128 full 400-424 vs 394-422, causal 322-382 vs 303-342; D 64 causal 235 vs 214, but D 64 full 307 vs
# 327, so that case kept the two kernels until ``stats_ahead`` (below). 128-row query blocks: 116-167 at D 64
# (D 128 does not fit).
# D 256: 64 keys per program, both warpgroups over all of them with half the head dim each (dK and dV of
# 64 keys x 256 columns in fp32 are 128 registers per thread of one warpgroup). K, V, p, ds and two ring
# slots take 208 KiB of shared memory; a separate fp32 dQ tile (64 KiB) would leave room for one slot only
# (FlashAttention-3's head dim 256 runs one), so each slot's dead Q and dO take the step's dQ partial.
# H100, bf16, 4x16x4096 | 2x16x8192: full 302 | 315 TFLOP/s, causal 275 | 296, against the two-kernel
# path's 285 | 273 and 187 | 206; with one slot and a separate dQ tile 247 | 252 and 233 | 242.
_D256 = HopperBwdConfig(64, 2, block_n=64, split_d=True)
# ``early_dq`` (dQ's product queued behind dV and dK, one wait for all three; H100, 2026-11-23, 3 interleaved
# rounds): D 64 causal 8x16x2048 253-259 TFLOP/s against 246-247, but D 128 0.95-0.96x of the default
# (4x16x4096 full and causal, 2x16x8192 causal), so it is on for D 64 only. D 64 in a second run (medians):
# causal 2 slots 221, with early_dq 249, 3 slots 258, 4 slots 257; full 308-321 for the fused variants against
# the two kernels' 320, so D 64 full kept the two kernels.
# ``fresh_kv`` (H100, 2026-11-23, 3 interleaved rounds, TFLOP/s, off / on / on with K of the dQ product also
# fresh): D 128 4x16x4096 full 402 / 484 / 440, causal 322 / 406 / 391, 1x16x16384 causal 388 / 490 / 497; D 256
# full 306 / 357 / 365, causal 276 / 345 / 338. D 64 causal (36-52 bytes of spill stores) 219 / 216 / 236 in rounds
# spread over 150-264, so it kept the old addressing; D 64 full fused with fresh_kv measured 324 against the two
# kernels' 324. Both changed with ``stats_ahead`` (each step's LSE and delta loaded during the step before;
# H100, 2026-11-24, 5 interleaved rounds, 8x16x2048x64, TFLOP/s; ncu had long-scoreboard stalls first at D 64,
# tensor pipes 33-35% busy): full, with
# fresh_kv, 2 / 3 / 4 slots 351-353 / 333 / 347-350, without stats_ahead 329, the two kernels 327-328; causal
# 2 / 3 / 4 / 5 / 6 slots 270 / 265 / 271-272 / 258 / 256, the old config 259-261. With the fill folded into the
# delta kernel and the Triton cast (``_scale_cast``): full 357 vs 326, causal 275 vs 260. D 128 stays without it:
# ptxas spills rise (causal 340 -> 608 bytes) and it measured 396 vs 408 (causal), 485 vs 488 (full).
HOPPER_BWD_CONFIGS = {(128, False): HopperBwdConfig(64, 2), (128, True): HopperBwdConfig(64, 2),
                      (64, False): HopperBwdConfig(64, 2, early_dq=True, stats_ahead=True),
                      (64, True): HopperBwdConfig(64, 4, early_dq=True, stats_ahead=True),
                      (256, False): _D256, (256, True): _D256}
# ``deterministic=True``: the Gluon kernel for dK and dV (each program sums its keys' gradients over the
# query blocks in a fixed order) and the Triton dQ kernel for dq (``with_dq=False``): no atomics, so the
# same bits run to run. H100, bf16, 2026-11-24, 3 interleaved rounds of do_bench medians, backward only,
# TFLOP/s, against the two Triton kernels: D 128 4x16x4096 full 429 vs 411, causal 372 vs 302; D 64
# 8x16x2048 causal 264 (2 slots; 3 slots 260) vs 224. D 64 full kept the two kernels (314 vs 334, and 340
# vs 345 at 4x16x4096) until ``stats_ahead`` with ``fresh_kv`` (same day, 3 rounds, 8x16x2048x64): full 341 vs
# 328, causal 274 vs 262 for the config before (the same bits). D 256 keeps the two kernels (its head-dim split
# schedule has no dQ-less form).
_D64_DETERMINISTIC = HopperBwdConfig(64, 2, with_dq=False, stats_ahead=True)
HOPPER_DETERMINISTIC_BWD_CONFIGS = {(128, False): HopperBwdConfig(64, 2, with_dq=False),
                                    (128, True): HopperBwdConfig(64, 2, with_dq=False),
                                    (64, False): _D64_DETERMINISTIC, (64, True): _D64_DETERMINISTIC}


def hopper_bwd_config(head_dim: int, masked: bool, deterministic: bool = False) -> HopperBwdConfig | None:
    """The table's config for a call (``HOPPER_DETERMINISTIC_BWD_CONFIGS`` when ``deterministic``), or None
    where the table leaves it to the two Triton kernels."""
    table = HOPPER_DETERMINISTIC_BWD_CONFIGS if deterministic else HOPPER_BWD_CONFIGS
    return table.get((head_dim, masked))


# tests: None takes the Gluon backward wherever the tables have a config on Hopper; False never; True
# also raises if it does not apply (so a test cannot silently run the other kernels)
hopper_mode: bool | None = None
hopper_config_override: HopperBwdConfig | None = None


def _hopper_cfg(prob: Problem, deterministic: bool) -> HopperBwdConfig | None:
    """The Gluon backward's config for this call: the override, the table's, or where the table has none
    and a test forces the kernel (``hopper_mode``), the masked case's (with dQ left to the Triton kernel when
    ``deterministic``); None: the two Triton kernels."""
    if hopper_config_override is not None:
        return hopper_config_override
    masked = prob.window_left >= 0 or prob.window_right >= 0
    cfg = hopper_bwd_config(prob.head_dim, masked, deterministic)
    if cfg is None and hopper_mode is True:
        cfg = HOPPER_BWD_CONFIGS.get((prob.head_dim, True))
        if cfg is not None and deterministic and not cfg.split_d:
            cfg = dataclasses.replace(cfg, with_dq=False, early_dq=False)
    return cfg


def hopper_backward_applies(tensors, prob: Problem, deterministic: bool) -> bool:
    """Whether the Gluon backward takes this call: Hopper (sm_90), fp16/bf16, a config in the tables
    (``_hopper_cfg``; head dim 128 or 256, or 64 with a causal or windowed mask; ``deterministic`` calls only
    with ``with_dq=False``), heads contiguous in q/k/v/dO (``[rows, H * D]`` views for TMA), no softcap,
    ALiBi or dropout."""
    if hopper_mode is False:
        return False
    q = tensors[0]
    cfg = _hopper_cfg(prob, deterministic)
    ok = (HAVE_GLUON and cfg is not None and not (deterministic and cfg.with_dq) and not is_interpreter()
          and q.is_cuda and is_hopper(q.device) and q.dtype in (torch.float16, torch.bfloat16)
          and prob.softcap == 0 and prob.alibi_slopes is None and prob.dropout_p == 0
          and use_tensor_descriptors(tensors, prob.is_varlen)
          and all(t.stride(-2) == prob.head_dim for t in tensors))
    if hopper_mode is True and not ok:
        raise RuntimeError("hopper_mode=True, but the Gluon backward does not apply to this call")
    return ok


class _BwdPlan:
    """The backward's launches for one call signature (``_fwd.plan_key``), each a ``CachedLaunch`` or None
    (empty grid): ``delta`` (which also zeroes the fp32 dQ accumulator, except in varlen mode); then either
    ``fused`` (the Gluon kernel, with descriptor templates for q, dO, k, v and the accumulator, and ``cast``,
    which scales the accumulator into dq) or ``dkdv`` (one or two launches); ``dq`` (with templates for the
    operands it streams, on the TMA path) for the Triton kernels and for a Gluon kernel without dQ
    (``with_dq`` False); and the integer arguments of each."""

    __slots__ = ("is_fused", "with_dq", "cast", "fused", "delta", "delta_ints", "descs", "ints", "dkdv",
                 "dkdv_descs", "dkdv_ints", "dq", "dq_descs", "dq_ints")


# call signature -> _BwdPlan; the config tables are read when a plan is made (``clear_plans``)
_BWD_PLANS: dict = {}


def clear_plans() -> None:
    """Forget the backward's launch plans (after editing a config table)."""
    _BWD_PLANS.clear()


def _make_bwd_plan(dout, q, k, v, out, lse, dq, dk, dv, dq_acc, prob: Problem,
                   cfg: HopperBwdConfig | None) -> _BwdPlan:
    """``cfg``: the Gluon kernel's config (``dq_acc``: its fp32 dQ accumulator, or None when the Triton dQ
    kernel writes dq, ``HopperBwdConfig.with_dq``), or None for the two Triton kernels."""
    varlen = prob.is_varlen
    plan = _BwdPlan()
    plan.is_fused = fused = cfg is not None
    plan.with_dq = dq_acc is not None
    plan.fused = plan.dkdv = plan.dq = plan.descs = plan.dkdv_descs = plan.dq_descs = plan.cast = None
    pad = head_dim_pad(prob.head_dim)
    block = 64 if pad <= 128 else 32
    grid = (cdiv(prob.max_seqlen_q, block), prob.batch * prob.num_heads)
    # the delta kernel zeroes the dQ accumulator too, except in varlen mode, where rows past cu_seqlens_q[-1]
    # belong to no sequence (``backward`` allocates it zeroed there)
    zero_acc = dq_acc is not None and not varlen
    plan.delta = CachedLaunch(_attn_bwd_delta, grid, dict(HEAD_DIM=prob.head_dim, HEAD_DIM_PAD=pad, BLOCK_M=block,
                                                          IS_VARLEN=varlen, ZERO_ACC=zero_acc),
                              num_warps=4) if grid[0] else None
    plan.delta_ints = (*seq_strides(out, varlen), *seq_strides(dout, varlen), *lse_strides(lse, varlen),
                       *(seq_strides(dq_acc, varlen) if zero_acc else (0, 0, 0)), prob.max_seqlen_q, prob.num_heads)
    group = prob.num_heads // prob.num_kv_heads
    dkdv_cfg, dq_cfg = bwd_configs(prob.head_dim)
    flags = prob.flags()
    # TMA loads for the operands the loops stream (q and dO in dK/dV, k and v in dQ)
    use_tma = use_tensor_descriptors((q, k, v, dout), varlen)
    if use_tma:
        if q.is_cuda:
            ensure_cuda_context(q.device.index)
        if not fused:
            plan.dkdv_descs = tuple(as_template(row_descriptor(t, varlen, dkdv_cfg.block_m, pad)) for t in (q, dout))
        if dq_acc is None:
            plan.dq_descs = tuple(as_template(row_descriptor(t, varlen, dq_cfg.block_n, pad)) for t in (k, v))
    strides = (*seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen), *seq_strides(dout, varlen))
    if fused:
        grid = (cdiv(prob.max_seqlen_k, cfg.block_n), prob.batch * prob.num_kv_heads)
        if grid[0]:
            ensure_cuda_context(q.device.index)
            # without a dQ accumulator the kernel takes q's descriptor in its place, unused
            plan.descs = tuple(as_template(hopper_descriptor(t, row_count(t, varlen), block)) for t, block in (
                (q, cfg.block_m), (dout, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n),
                (q if dq_acc is None else dq_acc, cfg.block_m)))
            plan.fused = CachedLaunch(_attn_bwd_hopper, grid, dict(
                HEAD_DIM=prob.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                IS_VARLEN=varlen, HAS_LEFT=prob.window_left >= 0, HAS_RIGHT=prob.window_right >= 0,
                SPLIT_D=cfg.split_d, CONSUMER_REGS=cfg.consumer_regs, WORKER_REGS=cfg.worker_regs,
                EARLY_DQ=cfg.early_dq, FRESH_KV=cfg.fresh_kv, WITH_DQ=dq_acc is not None,
                STATS_AHEAD=cfg.stats_ahead), num_warps=4)
        plan.ints = (*seq_strides(dk, varlen), *seq_strides(dv, varlen), *lse_strides(lse, varlen),
                     prob.max_seqlen_q, prob.max_seqlen_k, prob.num_kv_heads, group)
        if dq_acc is not None:
            plan.cast = CachedLaunch(_scale_cast, cdiv(dq.numel(), _CAST_BLOCK), dict(BLOCK=_CAST_BLOCK), num_warps=4)
            return plan
    else:
        # keys that no query sees get zero gradients: the dK/dV grid covers every key block
        grid = (cdiv(prob.max_seqlen_k, dkdv_cfg.block_n), prob.batch * prob.num_kv_heads)
        if grid[0]:
            passes = ((True, False), (False, True)) if dkdv_cfg.split_dkdv else ((True, True),)
            plan.dkdv = tuple(CachedLaunch(_attn_bwd_dkdv, grid, dict(
                HEAD_DIM=prob.head_dim, HEAD_DIM_PAD=pad, BLOCK_M=dkdv_cfg.block_m, BLOCK_N=dkdv_cfg.block_n,
                **flags, USE_TMA=use_tma, COMPUTE_DK=compute_dk, COMPUTE_DV=compute_dv),
                num_warps=dkdv_cfg.num_warps, num_stages=dkdv_cfg.num_stages) for compute_dk, compute_dv in passes)
        plan.dkdv_ints = (*strides, *seq_strides(dk, varlen), *seq_strides(dv, varlen), *lse_strides(lse, varlen),
                          prob.alibi_batch_stride(), prob.max_seqlen_q, prob.max_seqlen_k, prob.num_heads,
                          prob.num_kv_heads, group)
    grid = (cdiv(prob.max_seqlen_q, dq_cfg.block_m), prob.batch * prob.num_heads)
    if grid[0]:
        plan.dq = CachedLaunch(_attn_bwd_dq, grid, dict(
            HEAD_DIM=prob.head_dim, HEAD_DIM_PAD=pad, BLOCK_M=dq_cfg.block_m, BLOCK_N=dq_cfg.block_n, **flags,
            USE_TMA=use_tma), num_warps=dq_cfg.num_warps, num_stages=dq_cfg.num_stages)
    plan.dq_ints = (*strides, *seq_strides(dq, varlen), *lse_strides(lse, varlen), prob.alibi_batch_stride(),
                    prob.max_seqlen_q, prob.max_seqlen_k, prob.num_heads, group)
    return plan


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, prob: Problem, deterministic: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for checked inputs (last dims contiguous). On Hopper the Gluon kernel computes dK and
    dV; with ``deterministic=False`` it also sums dQ across programs by TMA reduce-adds (or leaves dQ to the
    Triton kernel where the table says so), with ``deterministic=True`` dQ always comes from the Triton dQ
    kernel. The launches come from the call signature's plan (``_BwdPlan``), made on its first call."""
    if not on_current_device(q):
        with torch.cuda.device(q.device):  # triton launches on the current device
            return backward(dout, q, k, v, out, lse, prob, deterministic)
    varlen = prob.is_varlen
    key = plan_key((dout, q, k, v, out, lse, prob.cu_seqlens_q, prob.cu_seqlens_k, prob.alibi_slopes,
                    prob.seed_offset), prob, deterministic, config_override, hopper_mode, hopper_config_override,
                   _fwd.tma_mode)
    plan = _BWD_PLANS.get(key)
    if plan is not None:
        fused, with_dq = plan.is_fused, plan.with_dq
    else:
        fused = hopper_backward_applies((q, k, v, dout), prob, deterministic)
        cfg = _hopper_cfg(prob, deterministic) if fused else None
        with_dq = fused and cfg.with_dq
    # varlen: rows past cu_seqlens[-1] get zero gradients (no program writes them; garbage there would
    # flow back into whatever produced q, k and v). The fused path writes every row of dq.
    alloc = torch.zeros if varlen else torch.empty
    dq = (torch.empty if with_dq else alloc)(q.shape, dtype=q.dtype, device=q.device)
    dk = alloc(k.shape, dtype=k.dtype, device=k.device)
    dv = alloc(v.shape, dtype=v.dtype, device=v.device)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    # the fused kernel's fp32 dQ accumulator, laid out as q (rows no program reaches stay 0): zeroed by the delta
    # kernel, or here in varlen mode (``_make_bwd_plan``)
    dq_acc = None
    if with_dq:
        dq_acc = (torch.zeros if varlen else torch.empty)(q.shape, dtype=torch.float32, device=q.device)
    if plan is None:
        plan = cache_put(_BWD_PLANS, key, _make_bwd_plan(dout, q, k, v, out, lse, dq, dk, dv, dq_acc, prob, cfg),
                         256)
    delta = torch.empty_like(lse)
    cu_q, cu_k, alibi, seed = prob.pointers(q)
    if plan.delta is not None:
        plan.delta((out, dout, delta, cu_q, delta if dq_acc is None else dq_acc, *plan.delta_ints), q.device)
    qk_scale_log2, softcap_log2, scale_over_cap, window_left, window_right, dropout_p = prob.scalars()
    if fused:
        if plan.fused is not None:
            q_desc, do_desc, k_desc, v_desc, dq_desc = rebased(plan.descs, (q, dout, k, v,
                                                                            q if dq_acc is None else dq_acc))
            cu_lq, cu_lk, _, _ = prob.pointers(lse)
            plan.fused((q_desc, k_desc, v_desc, do_desc, dq_desc, dk, dv, lse, delta, cu_lq, cu_lk, *plan.ints,
                        qk_scale_log2, prob.softmax_scale, window_left, window_right), q.device)
        if with_dq:
            plan.cast((dq_acc, dq, dq.numel(), prob.softmax_scale), q.device)
            return dq, dk, dv
    common = (qk_scale_log2, softcap_log2, scale_over_cap, window_left, window_right, dropout_p, prob.softmax_scale)
    pointers = (cu_q, cu_k, alibi, seed)
    if not fused:
        q_src, do_src = rebased(plan.dkdv_descs, (q, dout))
        for launch in plan.dkdv or ():
            launch((q_src, k, v, do_src, dk, dv, lse, delta, *pointers, *plan.dkdv_ints, *common), q.device)
    if plan.dq is not None:
        k_src, v_src = rebased(plan.dq_descs, (k, v))
        plan.dq((q, k_src, v_src, dout, dq, lse, delta, *pointers, *plan.dq_ints, *common), q.device)
    return dq, dk, dv
