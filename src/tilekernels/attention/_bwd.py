"""FlashAttention backward: delta, then dK/dV per key block, then dQ per query block. No atomics.

With ``p_ij = exp(s_ij - lse_i)`` recomputed from the forward's LSE (FlashAttention-2's algorithm):

    delta_i = do_i . o_i                        (_attn_bwd_delta)
    dp_ij   = do_i . v_j * keep_ij / (1 - p)
    ds_ij   = p_ij * (dp_ij - delta_i) * f'(q_i . k_j)      f' = scale, or scale * (1 - tanh^2) with softcap
    dv_j    = sum_i p_ij * keep_ij / (1 - p) * do_i         dk_j = sum_i ds_ij q_i      (_attn_bwd_dkdv)
    dq_i    = sum_j ds_ij k_j                                                          (_attn_bwd_dq)

Determinism: each dK/dV program owns one key block of one KV head and walks, in a fixed order, every
query head of its GQA group and every query block that may see it; each dQ program owns one query
block of one head. Nothing is accumulated across programs, so gradients are bit-identical run to run
whether or not ``deterministic=True`` is asked for (the flag is accepted for FA2 compatibility).

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

from .._runtime import cast_for_store, cdiv, dot, ensure_cuda_context, is_interpreter
from ._fwd import (
    FP32_PRECISION,
    Problem,
    ceil_to,
    dropout_keep,
    floor_to,
    head_dim_pad,
    head_options,
    key_ranges,
    load_block,
    load_rows,
    lse_strides,
    row_descriptor,
    scores_log2,
    seq_bounds,
    seq_source,
    seq_strides,
    use_tensor_descriptors,
)


@triton.jit
def _attn_bwd_delta(Out, DO, Delta, CuSeqlensQ, stride_ob, stride_os, stride_oh, stride_dob, stride_dos,
                    stride_doh, stride_lb, stride_lh, seqlen_q_batch, num_heads,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                    IS_VARLEN: tl.constexpr):
    """delta[b, h, i] = sum_d do * o (fp32), laid out like LSE."""
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


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, prob: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for checked inputs (last dims contiguous)."""
    varlen = prob.is_varlen
    # varlen: rows past cu_seqlens[-1] get zero gradients (no program writes them; garbage there would
    # flow back into whatever produced q, k and v)
    alloc = torch.zeros if varlen else torch.empty
    dq = alloc(q.shape, dtype=q.dtype, device=q.device)
    dk = alloc(k.shape, dtype=k.dtype, device=k.device)
    dv = alloc(v.shape, dtype=v.dtype, device=v.device)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty_like(lse)
    dkdv_cfg, dq_cfg = bwd_configs(prob.head_dim)
    pad = head_dim_pad(prob.head_dim)
    pointers = prob.pointers(q)
    flags = prob.flags()
    common = (*prob.scalars(), prob.softmax_scale)

    # TMA loads for the operands the loops stream (q and dO in dK/dV, k and v in dQ)
    use_tma = use_tensor_descriptors((q, k, v, dout), varlen)
    dkdv_operands, dq_operands = (q, dout), (k, v)
    if use_tma:
        if q.is_cuda:
            ensure_cuda_context(q.device.index)
        dkdv_operands = tuple(row_descriptor(t, varlen, dkdv_cfg.block_m, pad) for t in dkdv_operands)
        dq_operands = tuple(row_descriptor(t, varlen, dq_cfg.block_n, pad) for t in dq_operands)

    block = 64 if pad <= 128 else 32
    grid = (cdiv(prob.max_seqlen_q, block), prob.batch * prob.num_heads)
    if grid[0]:
        _attn_bwd_delta[grid](out, dout, delta, pointers[0], *seq_strides(out, varlen),
                              *seq_strides(dout, varlen), *lse_strides(lse, varlen), prob.max_seqlen_q,
                              prob.num_heads, HEAD_DIM=prob.head_dim, HEAD_DIM_PAD=pad, BLOCK_M=block,
                              IS_VARLEN=varlen, num_warps=4)
    # keys that no query sees get zero gradients: the dK/dV grid covers every key block
    grid = (cdiv(prob.max_seqlen_k, dkdv_cfg.block_n), prob.batch * prob.num_kv_heads)
    if grid[0]:
        passes = ((True, False), (False, True)) if dkdv_cfg.split_dkdv else ((True, True),)
        for compute_dk, compute_dv in passes:
            _attn_bwd_dkdv[grid](
                dkdv_operands[0], k, v, dkdv_operands[1], dk, dv, lse, delta, *pointers,
                *seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen),
                *seq_strides(dout, varlen), *seq_strides(dk, varlen), *seq_strides(dv, varlen),
                *lse_strides(lse, varlen), prob.alibi_batch_stride(), prob.max_seqlen_q, prob.max_seqlen_k,
                prob.num_heads, prob.num_kv_heads, prob.num_heads // prob.num_kv_heads, *common,
                HEAD_DIM=prob.head_dim, HEAD_DIM_PAD=pad, BLOCK_M=dkdv_cfg.block_m, BLOCK_N=dkdv_cfg.block_n,
                **flags, USE_TMA=use_tma, COMPUTE_DK=compute_dk, COMPUTE_DV=compute_dv,
                num_warps=dkdv_cfg.num_warps, num_stages=dkdv_cfg.num_stages,
            )
    grid = (cdiv(prob.max_seqlen_q, dq_cfg.block_m), prob.batch * prob.num_heads)
    if grid[0]:
        _attn_bwd_dq[grid](q, dq_operands[0], dq_operands[1], dout, dq, lse, delta, *pointers,
                           *seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen),
                           *seq_strides(dout, varlen), *seq_strides(dq, varlen), *lse_strides(lse, varlen),
                           prob.alibi_batch_stride(), prob.max_seqlen_q, prob.max_seqlen_k, prob.num_heads,
                           prob.num_heads // prob.num_kv_heads, *common, HEAD_DIM=prob.head_dim,
                           HEAD_DIM_PAD=pad, BLOCK_M=dq_cfg.block_m, BLOCK_N=dq_cfg.block_n, **flags,
                           USE_TMA=use_tma, num_warps=dq_cfg.num_warps, num_stages=dq_cfg.num_stages)
    return dq, dk, dv
