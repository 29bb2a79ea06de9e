"""FlashAttention forward kernel, the score/mask/dropout device helpers the backward shares, and configs.

One program computes ``BLOCK_M`` query rows of one (sequence, head) against every key block it may
see, with the online softmax in base 2 (FlashAttention-2's algorithm):

    s_ij = f(q_i . k_j)              f = scale * x, or softcap * tanh(scale * x / softcap)
           - slope_h * |i + Sk - Sq - j|                  (ALiBi)
    allowed(i, j) = j < Sk  and  j >= i + Sk - Sq - left  and  j <= i + Sk - Sq + right
    o_i = sum_j softmax_j(s_i) * keep_ij / (1 - p) * v_j   lse_i = log sum_j exp(s_ij)

Causal is ``right = 0`` (bottom-right aligned, as FA2). A row that may see no key gets ``o = 0`` and
``lse = +inf`` (FA2's convention: the backward's ``exp(s - lse)`` is then 0).

Key blocks are visited in three ranges, so that only blocks that cut a mask edge pay for the mask:
``[lo, full_lo)`` masked (left window edge), ``[full_lo, full_hi)`` unmasked, ``[full_hi, hi)`` masked
(causal diagonal, right window edge, the ragged end of the keys).

Sequences: batch mode reads ``b * stride_b``; varlen mode reads the sequence's start and length from
``cu_seqlens`` on the device (no host copy) and programs past the sequence's end return at once.
Addresses: every base offset (batch, sequence start, block start) is int64; only in-tile offsets are
int32.

Dropout: keep_ij = ``philox(seed, j, i, b * H + h, offset) >= p`` on local positions, so forward,
backward and ``dropout_keep_mask`` draw the same mask whatever the tile sizes.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from .._runtime import (
    CachedLaunch,
    as_template,
    cache_put,
    cast_for_store,
    cdiv,
    dot,
    ensure_cuda_context,
    is_hopper,
    is_interpreter,
    on_current_device,
    rebase,
    supports_tensor_descriptors,
    tensor_key,
)

LOG2E = 1.4426950408889634
# the operands are fp16/bf16: the fp32 switch of the shared dot helper never applies
FP32_PRECISION = tl.constexpr("ieee")


# ----------------------------------------------------------------------------------------------------
# device helpers shared with the backward


@triton.jit
def seq_bounds(CuSeqlens, b, seqlen_batch, IS_VARLEN: tl.constexpr):
    """(start row, length) of sequence ``b``: from ``cu_seqlens`` in varlen mode, else (0, seqlen)."""
    if IS_VARLEN:
        start = tl.load(CuSeqlens + b)
        seqlen = tl.load(CuSeqlens + b + 1) - start
    else:
        seqlen = seqlen_batch + tl.zeros((), tl.int32)
        start = seqlen * 0
    return start, seqlen


@triton.jit
def floor_to(x, block: tl.constexpr):
    """The largest multiple of ``block`` <= max(x, 0)."""
    return (tl.maximum(x, 0) // block) * block


@triton.jit
def ceil_to(x, block: tl.constexpr):
    """The smallest multiple of ``block`` >= max(x, 0)."""
    return ((tl.maximum(x, 0) + block - 1) // block) * block


@triton.jit
def scores_log2(qk, q_idx, k_idx, seqlen_q, seqlen_k, qk_scale_log2, softcap_log2, scale_over_cap,
                slope_log2, window_left, window_right, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Scores in log2 units (``s * log2(e)``), ``-inf`` where masked, and tanh(scale * qk / softcap).

    ``q_idx`` and ``k_idx`` are the local query and key positions, broadcastable to ``qk``'s shape
    (``[M, 1]`` and ``[1, N]``, or transposed for the backward's ``k @ q^T``). The second result is
    what the backward needs for softcap's derivative (``qk`` itself without softcap).
    """
    t = qk
    if HAS_SOFTCAP:
        x = qk * scale_over_cap
        t = 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0  # tanh(x), exact at both tails
        s = t * softcap_log2
    else:
        s = qk * qk_scale_log2
    diag = seqlen_k - seqlen_q
    if HAS_ALIBI:
        s = s - slope_log2 * tl.abs(q_idx + diag - k_idx).to(tl.float32)
    if MASKED:
        allowed = k_idx < seqlen_k
        if HAS_RIGHT:
            allowed = allowed & (k_idx <= q_idx + diag + window_right)
        if HAS_LEFT:
            allowed = allowed & (k_idx >= q_idx + diag - window_left)
        s = tl.where(allowed, s, float("-inf"))
    return s, t


@triton.jit
def dropout_keep(seed, rng_offset, bh, q_idx, k_idx, dropout_p):
    """keep_ij = uniform(philox(seed, j, i, b*H + h, offset)) >= p, on a tile of local positions."""
    zero = (q_idx * 0) + (k_idx * 0)
    c0 = (k_idx + zero).to(tl.uint32)
    c1 = (q_idx + zero).to(tl.uint32)
    c2 = (bh + zero).to(tl.uint32)
    c3 = (rng_offset + zero).to(tl.uint32)
    r0, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    return tl.random.uint_to_uniform_float(r0) >= dropout_p


@triton.jit
def load_rows(base, offs_row, stride_row, offs_d, row_limit, HEAD_DIM: tl.constexpr,
              ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """A [rows, HEAD_DIM_PAD] tile: rows ``offs_row`` (in-tile offsets) of a row-strided, d-contiguous
    block; rows at or past ``row_limit`` and columns past ``HEAD_DIM`` read as 0."""
    ptrs = base + offs_row[:, None] * stride_row + offs_d[None, :]
    if ROW_MASK:
        if EVEN_D:
            return tl.load(ptrs, mask=offs_row[:, None] < row_limit, other=0.0)
        return tl.load(ptrs, mask=(offs_row[:, None] < row_limit) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def seq_source(X, b, start, head, stride_b, stride_s, stride_h, seqlen_batch, IS_VARLEN: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Where sequence ``b``'s rows of head ``head`` are: (source, row0) for ``load_block``.

    Pointers: the int64 base address of its first row, row0 unused. TMA: the descriptor itself and the
    descriptor row of its first row (batch mode flattens (b, s) into rows; varlen rows are global).
    """
    if USE_TMA:
        src = X
        if IS_VARLEN:
            row0 = start
        else:
            row0 = b * seqlen_batch
    else:
        src = (X + b.to(tl.int64) * stride_b + tl.cast(start, tl.int64) * stride_s
               + tl.cast(head, tl.int64) * stride_h)
        row0 = start * 0
    return src, row0


@triton.jit
def load_block(src, row0, block_start, head, offs_row, stride_row, offs_d, row_limit, HEAD_DIM: tl.constexpr,
               HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Rows ``block_start + offs_row`` of a sequence as a [BLOCK, HEAD_DIM_PAD] tile (``seq_source``
    gives ``src``/``row0``). With ``ROW_MASK``, rows at or past ``row_limit`` (relative to the block)
    read as 0 -- through TMA too, where they would hold the next sequence's rows, or padding that may be
    NaN (and 0 * NaN is not 0)."""
    if USE_TMA:
        x = src.load([row0 + block_start, head, 0]).reshape(BLOCK, HEAD_DIM_PAD)
        if ROW_MASK:
            x = tl.where((offs_row < row_limit)[:, None], x, 0.0)
    else:
        x = load_rows(src + tl.cast(block_start, tl.int64) * stride_row, offs_row, stride_row, offs_d,
                      row_limit, HEAD_DIM, ROW_MASK, EVEN_D)
    return x


@triton.jit
def key_ranges(m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key blocks for query rows ``[m0, m0 + BLOCK_M)``: (lo, mid_lo, mid_hi, hi), where ``[lo, hi)`` is
    every key any of the rows may see and ``[mid_lo, mid_hi)`` the blocks no mask edge cuts."""
    diag = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = floor_to(m0 + diag - window_left, BLOCK_N)
        full_lo = ceil_to(m0 + BLOCK_M - 1 + diag - window_left, BLOCK_N)
    if HAS_RIGHT:
        hi = tl.minimum(hi, tl.maximum(m0 + BLOCK_M + diag + window_right, 0))
        full_hi = tl.minimum(full_hi, floor_to(m0 + diag + window_right + 1, BLOCK_N))
    mid_lo = tl.maximum(lo, tl.minimum(full_lo, hi))
    mid_hi = tl.maximum(mid_lo, tl.minimum(full_hi, hi))
    return lo, mid_lo, mid_hi, hi


@triton.jit
def head_options(AlibiSlopes, SeedOffset, b, h, num_heads, stride_ab, HAS_ALIBI: tl.constexpr,
                 HAS_DROPOUT: tl.constexpr):
    """(ALiBi slope in log2 units, dropout seed, dropout offset, b * H + h) of one (sequence, head)."""
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(AlibiSlopes + b * stride_ab + h).to(tl.float32) * 1.4426950408889634
    seed = 0
    rng_offset = 0
    if HAS_DROPOUT:
        seed = tl.load(SeedOffset)
        rng_offset = tl.load(SeedOffset + 1)
    return slope_log2, seed, rng_offset, b * num_heads + h


@triton.jit
def softmax_step(acc, m_i, l_i, qk, q_idx, k_idx, seqlen_q, seqlen_k, qk_scale_log2, softcap_log2,
                 scale_over_cap, slope_log2, window_left, window_right, MASKED: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr):
    """One key block of the online softmax: ``(p, acc, m_new, l_i)``, where ``p`` is the block's
    unnormalised probabilities (base-2 exponent against ``m_new``), ``acc`` the accumulator rescaled to
    ``m_new`` (the caller adds ``p @ v``) and ``l_i`` the updated row sums."""
    if MASKED or HAS_SOFTCAP or HAS_ALIBI:
        s, _ = scores_log2(qk, q_idx, k_idx, seqlen_q, seqlen_k, qk_scale_log2, softcap_log2, scale_over_cap,
                           slope_log2, window_left, window_right, MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                           HAS_ALIBI)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing allowed yet keeps m = -inf; subtract 0 instead (exp2(-inf) = 0, not NaN)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
    else:
        # plain scores: scale once inside one FMA per element (the scale is > 0, so max commutes)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale_log2)
        m_use = m_new
        p = tl.math.exp2(qk * qk_scale_log2 - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, acc, m_new, l_i


@triton.jit
def normalize(acc, m_i, l_i, empty_lse):
    """(out, lse in natural log) of a finished online softmax; a row that saw no key gets out 0 and
    lse ``empty_lse``."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, empty_lse, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    return out, lse


# ----------------------------------------------------------------------------------------------------
# the forward kernel


@triton.jit
def _fwd_blocks(acc, m_i, l_i, q, k_src, v_src, kv_row0, hk, stride_ks, stride_vs, offs_m, offs_n, offs_d, lo,
                hi, seqlen_q, seqlen_k, qk_scale_log2, softcap_log2, scale_over_cap, slope_log2, window_left,
                window_right, seed, rng_offset, bh, dropout_p, HEAD_DIM: tl.constexpr,
                HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Online softmax over key blocks ``[lo, hi)``; ``MASKED`` blocks apply the masks and bounds.

    ``k_src``/``v_src`` and ``kv_row0``: the (sequence, KV head)'s keys and values (``seq_source``).
    """
    for n0 in tl.range(lo, hi, BLOCK_N):
        k = load_block(k_src, kv_row0, n0, hk, offs_n, stride_ks, offs_d, seqlen_k - n0, HEAD_DIM,
                       HEAD_DIM_PAD, BLOCK_N, MASKED, EVEN_D, USE_TMA)
        # [BM, D] @ [D, BN] -> [BM, BN]
        qk = dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), FP32_PRECISION)
        k_idx = n0 + offs_n
        p, acc, m_new, l_i = softmax_step(acc, m_i, l_i, qk, offs_m[:, None], k_idx[None, :], seqlen_q, seqlen_k,
                                          qk_scale_log2, softcap_log2, scale_over_cap, slope_log2, window_left,
                                          window_right, MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rng_offset, bh, offs_m[:, None], k_idx[None, :], dropout_p)
            p = tl.where(keep, p, 0.0)
        v = load_block(v_src, kv_row0, n0, hk, offs_n, stride_vs, offs_d, seqlen_k - n0, HEAD_DIM,
                       HEAD_DIM_PAD, BLOCK_N, MASKED, EVEN_D, USE_TMA)
        acc = dot(p.to(v.dtype), v, acc, FP32_PRECISION)  # [BM, BN] @ [BN, D] -> [BM, D]
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, CuSeqlensQ, CuSeqlensK, AlibiSlopes, SeedOffset, stride_qb, stride_qs,
              stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ob,
              stride_os, stride_oh, stride_lb, stride_lh, stride_ab, seqlen_q_batch, seqlen_k_batch,
              num_heads, head_group, qk_scale_log2, softcap_log2, scale_over_cap, window_left, window_right,
              dropout_p, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              USE_TMA: tl.constexpr):
    """out[b, m0:m0+BLOCK_M, h] and lse for one query block of one (sequence, head).

    With ``USE_TMA``, Q, K and V are tensor descriptors over ``[rows, heads, D]`` (batch and sequence
    flattened into rows; block ``[BLOCK, 1, HEAD_DIM_PAD]``, columns past D read as 0).
    """
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    # the longest rows (causal: the last blocks) start first
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
    o_base = Out + b.to(tl.int64) * stride_ob + row0 * stride_os + h.to(tl.int64) * stride_oh
    offs_tile = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_tile
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k_src, kv_row0 = seq_source(K, b, start_k, hk, stride_kb, stride_ks, stride_kh, seqlen_k_batch, IS_VARLEN,
                                USE_TMA)
    v_src, _ = seq_source(V, b, start_k, hk, stride_vb, stride_vs, stride_vh, seqlen_k_batch, IS_VARLEN,
                          USE_TMA)
    q_src, q_row0 = seq_source(Q, b, start_q, h, stride_qb, stride_qs, stride_qh, seqlen_q_batch, IS_VARLEN,
                               USE_TMA)
    q = load_block(q_src, q_row0, m0, h, offs_tile, stride_qs, offs_d, seqlen_q - m0, HEAD_DIM, HEAD_DIM_PAD,
                   BLOCK_M, True, EVEN_D, USE_TMA)

    slope_log2, seed, rng_offset, bh = head_options(AlibiSlopes, SeedOffset, b, h, num_heads, stride_ab,
                                                    HAS_ALIBI, HAS_DROPOUT)
    lo, mid_lo, mid_hi, hi = key_ranges(m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
                                        HAS_LEFT, HAS_RIGHT)

    acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_src, v_src, kv_row0, hk, stride_ks, stride_vs, offs_m,
                                offs_n, offs_d, lo, mid_lo, seqlen_q, seqlen_k, qk_scale_log2, softcap_log2,
                                scale_over_cap, slope_log2, window_left, window_right, seed, rng_offset, bh,
                                dropout_p, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, True, HAS_LEFT,
                                HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D, USE_TMA)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_src, v_src, kv_row0, hk, stride_ks, stride_vs, offs_m,
                                offs_n, offs_d, mid_lo, mid_hi, seqlen_q, seqlen_k, qk_scale_log2,
                                softcap_log2, scale_over_cap, slope_log2, window_left, window_right, seed,
                                rng_offset, bh, dropout_p, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, False,
                                HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D, USE_TMA)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_src, v_src, kv_row0, hk, stride_ks, stride_vs, offs_m,
                                offs_n, offs_d, mid_hi, hi, seqlen_q, seqlen_k, qk_scale_log2, softcap_log2,
                                scale_over_cap, slope_log2, window_left, window_right, seed, rng_offset, bh,
                                dropout_p, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, True, HAS_LEFT,
                                HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, EVEN_D, USE_TMA)

    out, lse = normalize(acc, m_i, l_i, float("inf"))
    if HAS_DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    row_ok = offs_tile < seqlen_q - m0
    o_ptrs = o_base + offs_tile[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, cast_for_store(out, Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    lse_ptrs = Lse + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + (start_q + offs_m).to(tl.int64)
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def _dropout_mask_kernel(Keep, SeedOffset, seqlen_q, seqlen_k, num_heads, dropout_p,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """keep[b, h, i, j] exactly as the attention kernels draw it (tests and debugging)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = dropout_keep(tl.load(SeedOffset), tl.load(SeedOffset + 1), bh, offs_m[:, None], offs_n[None, :],
                        dropout_p)
    ptrs = (Keep + bh.to(tl.int64) * seqlen_q * seqlen_k + offs_m[:, None].to(tl.int64) * seqlen_k
            + offs_n[None, :])
    tl.store(ptrs, keep.to(tl.int8), mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))


# ----------------------------------------------------------------------------------------------------
# Hopper: the forward in Gluon (warp-specialised, FlashAttention-3's schedule)
#
# One program: BLOCK_M = 128 query rows of one (sequence, head), as two consumer warpgroups of 64 rows
# each, and one producer warp that TMA-loads q once and every key block's K and V into rings of STAGES
# shared buffers (K of block j before V of block j - 1, the order the consumers use them). A consumer
# issues s_j = q k_j^T and then p_{j-1} @ V_{j-1} without waiting, waits for s_j only, and computes the
# softmax of block j while p_{j-1} @ V_{j-1} still runs on the tensor cores (FlashAttention-3's
# intra-warpgroup overlap); the two warpgroups interleave on the SM by themselves. Nothing is in flight
# across the loop's back edge: ptxas serialises every wgmma of a kernel (warning C7514) if registers of
# an unfinished one are read, which the loop-carried accumulator would be. Triton's own pipeliner cannot
# express the overlap: it waits on a product right after issuing it whenever the result feeds anything
# but the next product's accumulator.
#
# The fast path covers fp16/bf16 at head dims 128 and 256 (``HOPPER_FWD_CONFIGS``) with heads contiguous
# (q/k/v viewable as [rows, H * D]), causal or windowed masks, GQA, batch and varlen modes; softcap, ALiBi
# and dropout take the Triton kernel above. Rows past a sequence's keys in its last block belong to the
# next sequence (or lie past the tensor, which TMA fills with 0): the producer zeroes those rows of V
# before it releases the block, since 0 * NaN would not be 0 in p @ v. Scores of such keys are masked to
# -inf by value.

try:  # gluon ships with triton 3.6 and 3.9; an older triton keeps the Triton kernel only
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    # triton 3.9 renamed the TMA copy (the old name raises there); 3.6 has only the old one
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False


if HAVE_GLUON:

    @gluon.jit
    def _zero_rows_past(buf, n0, seqlen_k, BLOCK_N: gl.constexpr):
        """Zero the rows of a landed key block ``buf`` (keys ``n0 ...``) at or past ``seqlen_k``, 8 rows at a
        time (and 128 columns at a time in wider rows: a one-warp producer has few registers), then fence so
        that wgmma (the async proxy) sees the stores."""
        CHUNK: gl.constexpr = 8
        COLS: gl.constexpr = 128
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
        for c in gl.static_range(BLOCK_N // CHUNK):
            rows = n0 + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
            part = buf.slice(c * CHUNK, CHUNK, dim=0)
            if buf.shape[1] <= COLS:
                x = part.load(layout)
                x = gl.where(gl.expand_dims(rows < seqlen_k, 1), x, 0.0)
                part.store(x)
            else:
                for h in gl.static_range(buf.shape[1] // COLS):
                    cols = part.slice(h * COLS, COLS, dim=1)
                    x = cols.load(layout)
                    x = gl.where(gl.expand_dims(rows < seqlen_k, 1), x, 0.0)
                    cols.store(x)
        fence_async_shared()

    # a shared buffer viewed with another dtype and shape: ``reinterpret`` in triton 3.9, ``_reinterpret`` in 3.6
    _smem_reinterpret = (getattr(gl.shared_memory_descriptor, "reinterpret", None)
                         or gl.shared_memory_descriptor._reinterpret)

    @gluon.jit
    def _fresh(buf, t, ON: gl.constexpr):
        """The 2-D shared buffer ``buf``; when ``ON``, addressed through a zero index that the compiler cannot see
        (inline asm on the loop counter ``t``). A loop-invariant wgmma operand's descriptors are otherwise hoisted
        out of the loop, and where registers are short ptxas spills them and reloads them from local memory right
        before the products; behind the opaque index they are rebuilt in each step from a few integer operations."""
        if ON:
            z = gl.inline_asm_elementwise("and.b32 $0, $1, 0;", "=r,r", [t], dtype=gl.int32, is_pure=False, pack=1)
            return _smem_reinterpret(buf, buf.dtype, [1, buf.shape[0], buf.shape[1]], buf.layout).index(z)
        else:
            return buf

    @gluon.jit
    def _fa3_producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                      v_fix, q_row, q_col, kv_row, kv_col, lo, n_blocks, seqlen_k,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """One warp: q, then K_0, K_1, V_0, K_2, V_1, ... into the rings (the order the consumers take them);
        the rows of a V block past the sequence's keys are zeroed before the block is released."""
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, q_col], q_bar, q_smem)
        for i in range(n_blocks + 1):
            if i < n_blocks:
                s = i % STAGES
                # a fresh barrier counts its (non-existent) previous phase as complete: the first lap passes
                mbarrier.wait(k_empty.index(s), ((i // STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                _tma_load(k_desc, [kv_row + lo + i * BLOCK_N, kv_col], k_ready.index(s), k_bufs.index(s))
            if i > 0:
                j = i - 1
                s = j % STAGES
                n0 = lo + j * BLOCK_N
                mbarrier.wait(v_empty.index(s), ((j // STAGES) & 1) ^ 1)
                if n0 + BLOCK_N <= seqlen_k:
                    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                    _tma_load(v_desc, [kv_row + n0, kv_col], v_ready.index(s), v_bufs.index(s))
                else:
                    # the last block, cut by the sequence's end: at most one per program
                    mbarrier.expect(v_fix, v_desc.block_type.nbytes)
                    _tma_load(v_desc, [kv_row + n0, kv_col], v_fix, v_bufs.index(s))
                    mbarrier.wait(v_fix, 0)
                    _zero_rows_past(v_bufs.index(s), n0, seqlen_k, BLOCK_N)
                    mbarrier.arrive(v_ready.index(s))

    @gluon.jit
    def _fa3_allowed(kk, qq, seqlen_k, diag, window_left, window_right, HAS_LEFT: gl.constexpr,
                     HAS_RIGHT: gl.constexpr):
        """Which (key ``kk``, query ``qq``) pairs of broadcast position tensors may attend: keys inside the
        sequence and the window (causal: ``window_right`` 0), aligned bottom-right by ``diag``. The forward
        and the backward (its transposed tile) share it."""
        allowed = kk < seqlen_k
        if HAS_RIGHT:
            allowed = allowed & (kk <= qq + diag + window_right)
        if HAS_LEFT:
            allowed = allowed & (kk >= qq + diag - window_left)
        return allowed

    @gluon.jit
    def _fa3_softmax(s, m_i, l_i, n0, q_pos, seqlen_k, diag, qk_scale_log2, window_left, window_right,
                     mid_lo, mid_hi, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr):
        """One key block of the online softmax on the scores ``s`` (raw q k^T): (p, alpha, m_new, l_new);
        blocks outside ``[mid_lo, mid_hi)`` apply the masks."""
        if (n0 < mid_lo) | (n0 >= mid_hi):
            k_pos = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
            allowed = _fa3_allowed(gl.expand_dims(k_pos, 0), gl.expand_dims(q_pos, 1), seqlen_k, diag, window_left,
                                   window_right, HAS_LEFT, HAS_RIGHT)
            x = gl.where(allowed, s * qk_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(x, axis=1))
            # a row with nothing allowed yet keeps m = -inf; subtract 0 instead (exp2(-inf) = 0, not NaN)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(x - gl.expand_dims(m_use, 1))
        else:
            # plain scores: scale once inside one FMA per element (the scale is > 0, so max commutes)
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale_log2)
            m_use = m_new
            p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(m_use, 1))
        alpha = gl.exp2(m_i - m_use)
        l_new = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _wait_ready(bar, phase, GATHERED: gl.constexpr):
        """Wait for a K or V block; blocks written by cp.async (generic proxy) also need a proxy fence
        before wgmma (the async proxy) reads them."""
        mbarrier.wait(bar, phase)
        if GATHERED:
            fence_async_shared()

    @gluon.jit
    def _fa3_consumer(W: gl.constexpr, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                      Out, Lse, o_base, l_base, stride_os, stride_ls, out_scale, m0, seqlen_q, seqlen_k, lo,
                      n_blocks, qk_scale_log2, window_left, window_right, HEAD_DIM: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                      HAS_RIGHT: gl.constexpr, EMPTY_LSE: gl.constexpr, GATHERED: gl.constexpr = False):
        """One warpgroup: query rows ``m0 + W * BLOCK_M / 2 ...`` against every key block of the program.
        Row i's out is at ``Out + o_base + i * stride_os`` (times ``out_scale``), its lse at ``Lse + l_base +
        i * stride_ls``; a row that sees no key gets out 0 and lse ``EMPTY_LSE``. ``GATHERED``: K and V
        arrive by cp.async (generic proxy), so a proxy fence follows each wait before wgmma reads them."""
        HALF: gl.constexpr = BLOCK_M // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        dtype: gl.constexpr = q_smem.dtype

        r0 = m0 + W * HALF
        q_pos = r0 + gl.arange(0, HALF, layout=row_layout)
        # the key blocks no mask edge cuts for this warpgroup's rows (key_ranges at HALF rows)
        diag = seqlen_k - seqlen_q
        full_lo = lo * 0
        full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
        if HAS_LEFT:
            full_lo = ((gl.maximum(r0 + HALF - 1 + diag - window_left, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        if HAS_RIGHT:
            full_hi = gl.minimum(full_hi, (gl.maximum(r0 + diag + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
        mid_lo = full_lo
        mid_hi = gl.maximum(full_lo, full_hi)

        q = q_smem.slice(W * HALF, HALF, dim=0)
        m_i = gl.full([HALF], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([HALF], gl.float32, row_layout)
        acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
        zero_s = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(q_bar, 0)
        if n_blocks > 0:
            _wait_ready(k_ready.index(0), 0, GATHERED)
            s_tok = warpgroup_mma(q, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s_tok,))
            mbarrier.arrive(k_empty.index(0))
            p, alpha, m_i, l_i = _fa3_softmax(s, m_i, l_i, lo, q_pos, seqlen_k, diag, qk_scale_log2, window_left,
                                              window_right, mid_lo, mid_hi, HAS_LEFT, HAS_RIGHT, BLOCK_N)
            for i in range(1, n_blocks):
                ks = i % STAGES
                _wait_ready(k_ready.index(ks), (i // STAGES) & 1, GATHERED)
                s_tok = warpgroup_mma(q, k_bufs.index(ks).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                vs = (i - 1) % STAGES
                _wait_ready(v_ready.index(vs), ((i - 1) // STAGES) & 1, GATHERED)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                acc_tok = warpgroup_mma(p_op, v_bufs.index(vs), acc, is_async=True)
                # the scores of block i are in (issued first); p_{i-1} @ V_{i-1} may still run under the
                # softmax of block i
                s = warpgroup_mma_wait(1, deps=(s_tok,))
                mbarrier.arrive(k_empty.index(ks))
                p, alpha, m_i, l_i = _fa3_softmax(s, m_i, l_i, lo + i * BLOCK_N, q_pos, seqlen_k, diag,
                                                  qk_scale_log2, window_left, window_right, mid_lo, mid_hi,
                                                  HAS_LEFT, HAS_RIGHT, BLOCK_N)
                acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
                mbarrier.arrive(v_empty.index(vs))
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            vs = (n_blocks - 1) % STAGES
            _wait_ready(v_ready.index(vs), ((n_blocks - 1) // STAGES) & 1, GATHERED)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc_tok = warpgroup_mma(p_op, v_bufs.index(vs), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc_tok,))
            mbarrier.arrive(v_empty.index(vs))

        # out = acc / l and lse (natural log); a row that saw no key: out 0, lse EMPTY_LSE
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        empty = l_o == 0.0
        out = acc * gl.expand_dims(out_scale / gl.where(empty, 1.0, l_o), 1)
        rows_o = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
        cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = Out + o_base + gl.expand_dims(rows_o.to(gl.int64) * stride_os, 1) + gl.expand_dims(cols_o, 0)
        gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=gl.expand_dims(rows_o < seqlen_q, 1))
        empty_s = l_i == 0.0
        lse = gl.where(empty_s, EMPTY_LSE, (m_i + gl.log2(gl.where(empty_s, 1.0, l_i))) * 0.6931471805599453)
        gl.store(Lse + l_base + q_pos.to(gl.int64) * stride_ls, lse, mask=q_pos < seqlen_q)

    @gluon.jit
    def _fa3_sequence(CuSeqlensQ, CuSeqlensK, b, seqlen_q_batch, seqlen_k_batch, IS_VARLEN: gl.constexpr):
        """(start_q, seqlen_q, start_k, seqlen_k) of sequence ``b``: from ``cu_seqlens`` on the device in
        varlen mode, else the batch's lengths (rows of batch element b start at ``b * seqlen``)."""
        if IS_VARLEN:
            start_q = gl.load(CuSeqlensQ + b)
            seqlen_q = gl.load(CuSeqlensQ + b + 1) - start_q
            start_k = gl.load(CuSeqlensK + b)
            seqlen_k = gl.load(CuSeqlensK + b + 1) - start_k
        else:
            seqlen_q = seqlen_q_batch + b * 0
            seqlen_k = seqlen_k_batch + b * 0
            start_q = b * seqlen_q_batch
            start_k = b * seqlen_k_batch
        return start_q, seqlen_q, start_k, seqlen_k

    @gluon.jit
    def _fa3_key_blocks(m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
        """(lo, n_blocks): the key blocks ``[lo, lo + n_blocks * BLOCK_N)`` that any of the query rows
        ``m0 ...`` may see (``key_ranges``' outer bounds; bottom-right aligned); none past the queries."""
        diag = seqlen_k - seqlen_q
        lo = m0 * 0
        hi = seqlen_k
        if HAS_LEFT:
            lo = (gl.maximum(m0 + diag - window_left, 0) // BLOCK_N) * BLOCK_N
        if HAS_RIGHT:
            hi = gl.minimum(hi, gl.maximum(m0 + BLOCK_M + diag + window_right, 0))
        n_blocks = gl.maximum(gl.cdiv(hi - lo, BLOCK_N), 0)
        return lo, gl.where(m0 < seqlen_q, n_blocks, 0)

    @gluon.jit
    def _fa3_buffers(q_desc, kv_desc, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     READY_COUNT: gl.constexpr):
        """Shared memory and barriers of the schedule: q, the K and V rings (``kv_desc``'s layout), and their
        barriers, initialised (``READY_COUNT`` arrivals complete a ready barrier: 1 for TMA's expect-tx,
        one per thread for cp.async; both consumer warpgroups release each block)."""
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        v_fix = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(v_fix, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=READY_COUNT)
            mbarrier.init(v_ready.index(i), count=READY_COUNT)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        fence_async_shared()
        return q_smem, k_bufs, v_bufs, q_bar, v_fix, k_ready, k_empty, v_ready, v_empty

    @gluon.jit
    def _attn_fwd_hopper(q_desc, k_desc, v_desc, Out, Lse, CuSeqlensQ, CuSeqlensK, stride_ob, stride_os, stride_oh,
                         stride_lb, stride_lh, seqlen_q_batch, seqlen_k_batch, num_heads, head_group,
                         qk_scale_log2, window_left, window_right, HEAD_DIM: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         IS_VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """out and lse of BLOCK_M query rows of one (sequence, head); q/k/v are descriptors over
        ``[rows, H * D]`` (batch and sequence flattened into rows), blocks ``[BLOCK, D]``."""
        # the longest rows (causal: the last blocks) start first
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // num_heads
        h = pid_bh % num_heads
        hk = h // head_group
        start_q, seqlen_q, start_k, seqlen_k = _fa3_sequence(CuSeqlensQ, CuSeqlensK, b, seqlen_q_batch,
                                                             seqlen_k_batch, IS_VARLEN)
        m0 = pid_m * BLOCK_M
        lo, n_blocks = _fa3_key_blocks(m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                       HAS_RIGHT)
        if IS_VARLEN:
            o_base = h.to(gl.int64) * stride_oh + start_q.to(gl.int64) * stride_os
            l_base = h.to(gl.int64) * stride_lh + start_q.to(gl.int64)
        else:
            o_base = b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
            l_base = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh

        q_smem, k_bufs, v_bufs, q_bar, v_fix, k_ready, k_empty, v_ready, v_empty = _fa3_buffers(
            q_desc, k_desc, HEAD_DIM, BLOCK_N, STAGES, 1)

        gl.warp_specialize([
            (_fa3_consumer, (0, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, Out, Lse,
                             o_base, l_base, stride_os, 1, 1.0, m0, seqlen_q, seqlen_k, lo, n_blocks, qk_scale_log2,
                             window_left, window_right, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT,
                             float("inf"))),
            (_fa3_consumer, (1, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, Out, Lse,
                             o_base, l_base, stride_os, 1, 1.0, m0, seqlen_q, seqlen_k, lo, n_blocks, qk_scale_log2,
                             window_left, window_right, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT,
                             float("inf"))),
            (_fa3_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
                             v_empty, v_fix, start_q + m0, h * HEAD_DIM, start_k, hk * HEAD_DIM, lo, n_blocks,
                             seqlen_k, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------
# launch configs: data, per head-dim bucket


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # a register cap per thread (triton's ``maxnreg``), so that more programs fit on an SM; None: the compiler's
    maxnreg: int | None = None


# Hopper, keyed by (padded head dim, causal); chosen by sweeps on an H100 (bf16, S 2048-4096, TMA
# loads, 2026-11-22, benchmarks/NOTES.md). D 128: 64x64/4 warps 500-573 TFLOP/s non-causal, 447-465
# causal (128x128/8: 496 and 428); D 64: 64x128/4 402 (128x64/8 378); D 256: 128x64/8/3 stages 519
# (2 stages 409), causal 64x32/4/3 470 (128x64/8/3 436). Without TMA, D 256 fits only 2 stages
# (``fwd_config``). Triton 3.6's automatic warp specialization of the key loop fails to compile at 4 warps
# and is slower at 8 (493 vs 573). D 64 causal under a 128-register cap (139 without; no spill) fits four
# programs per SM instead of three: 8x16x2048 334-339 against 321-322 TFLOP/s, 4x16x4096 365-371 against
# 354-356, outputs bit-identical (H100, 2026-11-23, two calls of 3 interleaved rounds); the same cap, 2 or
# 4 stages were slower. D 64 full: 128x64 tiles at 4 warps (244 registers, two programs per SM, each key
# block serving 128 queries) 403-418 at 8x16x2048 and 421-426 at 4x16x4096 against 64x128/4's 379-405 and
# 396-418; 128x64/8 393-411, 128x128/8/2 268-297, register caps on 64x128 level or slower; causal keeps 64-row
# tiles (128-row ones 250-357 against 340-375). benchmarks/NOTES.md.
FWD_CONFIGS = {
    (16, False): FwdConfig(64, 64, 4, 3), (16, True): FwdConfig(64, 64, 4, 3),
    (32, False): FwdConfig(64, 64, 4, 3), (32, True): FwdConfig(64, 64, 4, 3),
    (64, False): FwdConfig(128, 64, 4, 3), (64, True): FwdConfig(64, 64, 4, 3, maxnreg=128),
    (128, False): FwdConfig(64, 64, 4, 3), (128, True): FwdConfig(64, 64, 4, 3),
    (256, False): FwdConfig(128, 64, 8, 3), (256, True): FwdConfig(64, 32, 4, 3),
}
# Under the interpreter: small blocks, so the CPU tests' short sequences still span several of them.
INTERPRETER_FWD_CONFIG = FwdConfig(32, 16, 4, 1)

# tests and the bench sweep set this to force one config
config_override: FwdConfig | None = None
# tests: None decides by the device (TMA on Hopper and newer); False forces the pointer path; True
# forces descriptors wherever the layout allows, also under the interpreter (which runs them)
tma_mode: bool | None = None


@dataclasses.dataclass(frozen=True)
class HopperFwdConfig:
    """The Gluon kernel's launch: 128 query rows (two consumer warpgroups), ``block_n`` keys per block,
    ``stages`` buffers each for K and V, and the register split between consumers and the producer."""
    block_n: int
    stages: int
    consumer_regs: int = 232
    producer_regs: int = 40


# Chosen on an H100 (bf16, 2026-11-23, 3 interleaved rounds, benchmarks/NOTES.md), ours / cuDNN:
# D 128, 4x16x4096 full | causal: 128/2 stages 0.936 | 0.932, 128/3 0.951 | 0.937, 64/3 0.850 | 0.882,
# 128/2 with 240/32 registers 0.957 | 0.946 (the Triton kernel: 0.827 | 0.828). D 256: 64/2 0.994 | 0.974
# (Triton 0.757 | 0.772). D 64 stays with the Triton kernel: 0.898 | 0.883 there against 0.804-0.828 |
# 0.763-0.774 for 128/2, 128/3, 64/3 and 64/4.
HOPPER_FWD_CONFIGS = {128: HopperFwdConfig(128, 2, 240, 32), 256: HopperFwdConfig(64, 2)}
HOPPER_BLOCK_M = 128

# tests: None takes the Gluon kernel wherever it applies on Hopper; False never; True also
# raises if it does not apply (so a test cannot silently run the other kernel)
hopper_mode: bool | None = None


def hopper_kernel_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prob: "Problem", use_tma: bool) -> bool:
    """Whether the Gluon forward takes this call: Hopper (sm_90), fp16/bf16, head dim 128 or 256, heads
    contiguous in q/k/v (a ``[rows, H * D]`` view for TMA), no softcap, ALiBi or dropout."""
    if hopper_mode is False:
        return False
    ok = (HAVE_GLUON and use_tma and not is_interpreter() and q.is_cuda and is_hopper(q.device)
          and q.dtype in (torch.float16, torch.bfloat16) and prob.head_dim in HOPPER_FWD_CONFIGS
          and prob.softcap == 0 and prob.alibi_slopes is None and prob.dropout_p == 0
          and all(t.stride(-2) == prob.head_dim for t in (q, k, v)))
    if hopper_mode is True and not ok:
        raise RuntimeError("hopper_mode=True, but the Gluon forward does not apply to this call")
    return ok


@functools.lru_cache(maxsize=None)
def _nvmma_layout(rows: int, dim: int, dtype: torch.dtype):
    """The shared layout of a ``[rows, dim]`` fp16/bf16/fp32 buffer (cached: ~5 us each on the host)."""
    elem = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, dim], elem)


def hopper_descriptor(t: torch.Tensor, rows: int, block_rows: int, layout_rows: int | None = None):
    """A Gluon tensor descriptor over ``t`` as ``[rows, H * D]`` (row stride ``t.stride(-3)``), block
    ``[block_rows, D]``, with the shared layout of a ``[layout_rows, D]`` buffer (default ``block_rows``;
    the paged prefill's page boxes land in row slices of a whole key block's buffer)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    heads, dim = t.shape[-2], t.shape[-1]
    layout = _nvmma_layout(layout_rows or block_rows, dim, t.dtype)
    return GluonDescriptor(t, [rows, heads * dim], [t.stride(-3), 1], [block_rows, dim], layout)


def head_dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def fwd_config(head_dim: int, causal: bool, tma: bool) -> FwdConfig:
    if config_override is not None:
        return config_override
    if is_interpreter():
        return INTERPRETER_FWD_CONFIG
    cfg = FWD_CONFIGS[(head_dim_pad(head_dim), causal)]
    if not tma and head_dim_pad(head_dim) == 256:
        # pointer loads stage through more shared memory: 3 stages need 256 KiB at D 256
        cfg = dataclasses.replace(cfg, num_stages=2)
    return cfg


# ----------------------------------------------------------------------------------------------------
# launcher


@dataclasses.dataclass
class Problem:
    """One attention call's geometry and options, as the launchers take them."""

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_seqlen_q: int
    max_seqlen_k: int
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    softmax_scale: float
    window_left: int          # -1: unlimited
    window_right: int         # -1: unlimited; causal is 0
    softcap: float
    alibi_slopes: torch.Tensor | None
    dropout_p: float
    seed_offset: torch.Tensor | None

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def causal(self) -> bool:
        return self.window_right == 0

    def scalars(self) -> tuple:
        """(qk_scale_log2, softcap_log2, scale_over_cap, window_left, window_right, dropout_p)."""
        if self.softcap > 0:
            return (0.0, self.softcap * LOG2E, self.softmax_scale / self.softcap, self.window_left,
                    self.window_right, self.dropout_p)
        return (self.softmax_scale * LOG2E, 0.0, 0.0, self.window_left, self.window_right, self.dropout_p)

    def flags(self) -> dict:
        return dict(IS_VARLEN=self.is_varlen, HAS_LEFT=self.window_left >= 0,
                    HAS_RIGHT=self.window_right >= 0, HAS_SOFTCAP=self.softcap > 0,
                    HAS_ALIBI=self.alibi_slopes is not None, HAS_DROPOUT=self.dropout_p > 0)

    def pointers(self, anchor: torch.Tensor) -> tuple:
        """(cu_seqlens_q, cu_seqlens_k, alibi_slopes, seed_offset), ``anchor`` standing in for absent ones."""
        return tuple(anchor if t is None else t for t in
                     (self.cu_seqlens_q, self.cu_seqlens_k, self.alibi_slopes, self.seed_offset))

    def alibi_batch_stride(self) -> int:
        slopes = self.alibi_slopes
        return 0 if slopes is None or slopes.dim() == 1 else slopes.stride(0)


def seq_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides of a ``[B, S, H, D]`` or varlen ``[total, H, D]`` tensor."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """(batch, head) strides of LSE ``[B, H, S]`` or varlen ``[H, total]``; rows are contiguous."""
    if varlen:
        return 0, lse.stride(0)
    return lse.stride(0), lse.stride(1)


def _flat_rows(t: torch.Tensor, varlen: bool) -> bool:
    """Whether (batch, sequence) of ``t`` flatten into one row index with stride ``stride(-3)``."""
    return varlen or t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)


def use_tensor_descriptors(tensors, varlen: bool) -> bool:
    """TMA loads for these operands: Hopper or newer, non-empty, 16-byte aligned bases and row/head
    strides, rows that flatten (see ``_flat_rows``); the pointer path takes everything else."""
    if tma_mode is False:
        return False
    if tma_mode is None and not (tensors[0].is_cuda and supports_tensor_descriptors(tensors[0].device)):
        return False
    esize = tensors[0].element_size()
    # a descriptor needs every dimension >= 1 (batch mode allows S_k = 0)
    return all(t.numel() > 0 and t.data_ptr() % 16 == 0 and (t.stride(-3) * esize) % 16 == 0
               and (t.stride(-2) * esize) % 16 == 0
               and t.shape[-1] * esize >= 16 and _flat_rows(t, varlen) for t in tensors)


def row_count(t: torch.Tensor, varlen: bool) -> int:
    """Rows of ``t`` with batch and sequence flattened (varlen: its ``total``), as the descriptors see them."""
    return t.shape[0] if varlen else t.shape[0] * t.shape[1]


def row_descriptor(t: torch.Tensor, varlen: bool, block_rows: int, pad: int):
    """A tensor descriptor over ``t`` as ``[rows, heads, D]``, block ``[block_rows, 1, pad]``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    shape = [row_count(t, varlen), t.shape[-2], t.shape[-1]]
    return TensorDescriptor(t, shape, [t.stride(-3), t.stride(-2), 1], [block_rows, 1, pad])


# ----------------------------------------------------------------------------------------------------
# launch plans: what a call signature fixes, worked out once


def plan_key(tensors, prob: Problem, *knobs) -> tuple:
    """What a launch plan depends on: every tensor's ``tensor_key`` (dtype, shape, strides, 16-byte
    alignment: what triton specialises on and what the strides and descriptors are made from) and
    device, the problem's geometry (its ints, exactly: triton specialises on them too) and which options
    are on, and the test and sweep knobs (``knobs``). Float options (scale, softcap, dropout_p) are
    runtime arguments and not part of it."""
    return (*((None, None) if t is None else (tensor_key(t), t.device) for t in tensors),
            prob.batch, prob.num_heads, prob.num_kv_heads, prob.head_dim, prob.max_seqlen_q, prob.max_seqlen_k,
            prob.window_left, prob.window_right, prob.softcap > 0, prob.dropout_p > 0, *knobs)


class _FwdPlan:
    """One forward launch for one call signature (``plan_key``): the kernel's ``CachedLaunch`` (None
    when the grid is empty), the descriptor templates of q, k and v (None on the pointer path), the
    integer arguments, and which kernel (the Gluon one or the Triton one). A call that finds its plan
    costs the host little more than rebasing the descriptors and the launch: the table lookups, stride
    work, descriptor validation and triton's per-call binder are done once. (With this and the dispatcher
    skipped, an eager forward went from 190-265 to 52-100 us of host time on the H100 machine,
    benchmarks/NOTES.md.)"""

    __slots__ = ("launch", "descs", "ints", "hopper")


# call signature -> _FwdPlan (``plan_key``); the config tables are read when a plan is made, so a probe
# that edits them calls ``clear_plans()``
_FWD_PLANS: dict = {}


def clear_plans() -> None:
    """Forget the forward's launch plans (the backward's: ``_bwd.clear_plans``)."""
    _FWD_PLANS.clear()


def _make_fwd_plan(q, k, v, out, lse, prob: Problem) -> _FwdPlan:
    varlen = prob.is_varlen
    plan = _FwdPlan()
    plan.descs = None
    use_tma = use_tensor_descriptors((q, k, v), varlen)
    plan.hopper = hopper_kernel_applies(q, k, v, prob, use_tma)
    if plan.hopper:
        cfg = HOPPER_FWD_CONFIGS[prob.head_dim]
        grid = (cdiv(prob.max_seqlen_q, HOPPER_BLOCK_M), prob.batch * prob.num_heads)
        if grid[0]:
            ensure_cuda_context(q.device.index)
            plan.descs = tuple(as_template(hopper_descriptor(t, row_count(t, varlen), block)) for t, block in (
                (q, HOPPER_BLOCK_M), (k, cfg.block_n), (v, cfg.block_n)))
        plan.ints = (*seq_strides(out, varlen), *lse_strides(lse, varlen), prob.max_seqlen_q, prob.max_seqlen_k,
                     prob.num_heads, prob.num_heads // prob.num_kv_heads)
        plan.launch = CachedLaunch(_attn_fwd_hopper, grid, dict(
            HEAD_DIM=prob.head_dim, BLOCK_M=HOPPER_BLOCK_M, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
            IS_VARLEN=varlen, HAS_LEFT=prob.window_left >= 0, HAS_RIGHT=prob.window_right >= 0,
            CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs), num_warps=4) if grid[0] else None
        return plan
    cfg = fwd_config(prob.head_dim, prob.causal, use_tma)
    grid = (cdiv(prob.max_seqlen_q, cfg.block_m), prob.batch * prob.num_heads)
    pad = head_dim_pad(prob.head_dim)
    if use_tma and grid[0]:
        if q.is_cuda:
            ensure_cuda_context(q.device.index)
        plan.descs = tuple(as_template(row_descriptor(t, varlen, rows, pad))
                           for t, rows in ((q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n)))
    plan.ints = (*seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen),
                 *seq_strides(out, varlen), *lse_strides(lse, varlen), prob.alibi_batch_stride(),
                 prob.max_seqlen_q, prob.max_seqlen_k, prob.num_heads, prob.num_heads // prob.num_kv_heads)
    plan.launch = CachedLaunch(_attn_fwd, grid, dict(
        HEAD_DIM=prob.head_dim, HEAD_DIM_PAD=pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **prob.flags(),
        USE_TMA=use_tma), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        maxnreg=cfg.maxnreg) if grid[0] else None
    return plan


def rebased(templates, tensors) -> tuple:
    """This call's tensors under a plan's descriptor templates (``tensors`` themselves when there are none:
    the pointer path)."""
    if templates is None:
        return tuple(tensors)
    if tensors[0].is_cuda:
        ensure_cuda_context(tensors[0].device.index)
    return tuple(rebase(d, t) for d, t in zip(templates, tensors))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            prob: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for checked inputs (last dim contiguous)."""
    if not on_current_device(q):
        with torch.cuda.device(q.device):  # triton launches on the current device
            return forward(q, k, v, prob)
    varlen = prob.is_varlen
    if varlen:
        # rows past cu_seqlens_q[-1] (a buffer sized for more tokens) belong to no sequence and no
        # program writes them: they read as rows that see no key (0 and +inf), not as garbage
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((prob.num_heads, q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((prob.batch, prob.num_heads, q.shape[1]), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        lse.fill_(float("inf"))
        return out, lse
    key = plan_key((q, k, v, prob.cu_seqlens_q, prob.cu_seqlens_k, prob.alibi_slopes, prob.seed_offset), prob,
                   config_override, tma_mode, hopper_mode)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        plan = cache_put(_FWD_PLANS, key, _make_fwd_plan(q, k, v, out, lse, prob), 256)
    if plan.launch is None:
        return out, lse
    operands = rebased(plan.descs, (q, k, v))
    qk_scale_log2, softcap_log2, scale_over_cap, window_left, window_right, dropout_p = prob.scalars()
    if plan.hopper:
        cu_q, cu_k, _, _ = prob.pointers(lse)
        plan.launch((*operands, out, lse, cu_q, cu_k, *plan.ints, qk_scale_log2, window_left, window_right),
                    q.device)
    else:
        plan.launch((*operands, out, lse, *prob.pointers(q), *plan.ints, qk_scale_log2, softcap_log2,
                     scale_over_cap, window_left, window_right, dropout_p), q.device)
    return out, lse


# ----------------------------------------------------------------------------------------------------
# dropout: the seed the ops draw, and the mask they apply


def draw_philox_seed(device: torch.device) -> torch.Tensor:
    """(seed, offset) as an int64 ``[2]`` tensor on ``device``, drawn from torch's default generator for
    that device: reproducible after ``torch.manual_seed``, no host sync, and capturable in a CUDA graph
    (each replay draws anew, as torch's own dropout does)."""
    return torch.randint(0, 2**62, (2,), device=device, dtype=torch.int64)


def dropout_keep_mask(seed_offset: torch.Tensor, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                      dropout_p: float) -> torch.Tensor:
    """The bool keep mask ``[batch, heads, seqlen_q, seqlen_k]`` (local positions) the kernels use for
    ``seed_offset`` (from ``draw_philox_seed``)."""
    keep = torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.int8, device=seed_offset.device)
    if keep.numel():
        block = 16 if is_interpreter() else 64
        grid = (cdiv(seqlen_q, block), cdiv(seqlen_k, block), batch * heads)
        _dropout_mask_kernel[grid](keep, seed_offset, seqlen_q, seqlen_k, heads, float(dropout_p),
                                   BLOCK_M=block, BLOCK_N=block)
    return keep.bool()
