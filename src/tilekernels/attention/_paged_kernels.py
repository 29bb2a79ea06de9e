"""Paged-KV attention kernels: batch prefill / decode over a page table, and the merge of partial states.

The online softmax, the masks and the key-block ranges are the FlashAttention forward's own
(``_fwd.softmax_step``, ``scores_log2`` through it, ``key_ranges``, ``normalize``); what differs is where
the rows come from.

Queries. Programs walk *virtual blocks*: sequence b owns the virtual indices
``[qo_indptr[b] // QT + b, qo_indptr[b + 1] // QT + b + 1)``, at least the ``cdiv(qo_len, QT)`` blocks
of ``QT`` queries it needs, and the ranges tile ``[0, total_q // QT + B)`` in order. A program finds
its sequence by a binary search over ``qo_indptr`` on the device, so the grid needs only host shapes
(``total_q``, B): no plan step, no host synchronisation. In decode every sequence has one query and
program b is sequence b.

Rows of a tile. ``HP`` query heads of one KV head are packed into the tile's rows (row r is query
``m0 + r // HP`` of head ``c * HP + r % HP``): a decode tile reads each key block once for the whole
head group. Prefill keeps ``HP = 1`` (one head per program), where packing would save no key traffic
and cut the unmasked share of causal tiles.

Keys. Key position j of sequence b is in physical page ``table[j // PAGE_SIZE]`` at slot
``j % PAGE_SIZE``; the element (page p, slot s, head h, dim d) of a cache sits at

    p * stride_page + h * stride_head + (s // XS) * stride_sa + (s % XS) * stride_sb
                    + (d // XD) * stride_da + (d % XD) * stride_db

which covers the linear layout ``[pages, page_size, H_kv, D]`` (XS = XD = 1) and the vectorized ones,
K ``[pages, H_kv, D/x, page_size, x]`` (XD = x) and V ``[pages, H_kv, page_size/x, D, x]`` (XS = x).
Only ``p * stride_page`` is 64-bit: the launcher checks that one page's extent is below 2^31 elements,
so every in-page term is provably 32-bit safe, whatever the pool's size.

Loads. The table entries of a key block are read one block ahead. Where a 64-key block lies in one
page of a linear cache (pages of 64, 128, ... keys), K and V come through 4-D TMA descriptors over
``[pages, page_size, H_kv, D]``; elsewhere rows are gathered with pointer loads (one address
computation for K and V when their strides agree).

Scales (fp8 caches): mode 0 none (a host float folded into the scalars), 1 one device scalar per
tensor, 2 per (page, KV head), applied per key column to the scores (K) and to the probabilities (V).

Split KV: with ``NUM_SPLITS > 1`` program (…, s) takes the s-th of ``NUM_SPLITS`` equal shares of its
key range and writes an fp32 partial (out, lse); ``_merge_splits`` combines them.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from .._runtime import cast_for_store, dot, is_interpreter
from ._fwd import FP32_PRECISION, HAVE_GLUON, key_ranges, normalize, softmax_step

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from ._fwd import _fa3_buffers, _fa3_consumer, _fa3_key_blocks, _tma_load, _zero_rows_past

    # triton 3.9 renamed the cp.async copy (the old name raises there); 3.6 has only the old one
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

SCALE_NONE = 0
SCALE_TENSOR = 1
SCALE_PAGE = 2


# ----------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def paged_row_offsets(pages, slots, head, stride_page, stride_head, stride_sa, stride_sb, XS: tl.constexpr):
    """int64 element offsets of rows (page, slot) of one head: the page term in 64 bits (a pool may pass
    2^31 elements), the in-page terms in 32 (one page's extent is checked to be below 2^31)."""
    if XS == 1:
        in_page = head * stride_head + slots * stride_sa
    else:
        in_page = head * stride_head + (slots // XS) * stride_sa + (slots % XS) * stride_sb
    return pages.to(tl.int64) * stride_page + in_page


@triton.jit
def _load_paged(Cache, rows, offs_d, row_ok, stride_da, stride_db, XD: tl.constexpr, HEAD_DIM: tl.constexpr,
                ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """A [rows, HEAD_DIM_PAD] tile of the cache at row offsets ``rows`` (``paged_row_offsets``); rows with
    ``row_ok`` false and columns past HEAD_DIM read as 0 (unused slots may hold anything, NaN included).
    The unit-stride case is spelled out so that the compiler sees contiguous columns and vectorises."""
    if XD == 1:
        cols = offs_d * stride_da
    else:
        cols = (offs_d // XD) * stride_da + (offs_d % XD) * stride_db
    ptrs = Cache + rows[:, None] + cols[None, :]
    if ROW_MASK:
        if EVEN_D:
            return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        return tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _find_sequence(QoIndptr, pid, num_seqs, QT: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """The sequence b whose virtual blocks hold ``pid``: the last b with ``qo_indptr[b] // QT + b <= pid``
    (an upper-bound binary search over b in [0, num_seqs))."""
    lo = pid * 0
    count = num_seqs + lo
    for _ in tl.static_range(SEARCH_STEPS):
        half = count // 2
        mid = lo + half
        first = tl.load(QoIndptr + mid) // QT + mid
        go_right = (count > 0) & (first <= pid)
        lo = tl.where(go_right, mid + 1, lo)
        count = tl.where(go_right, count - half - 1, tl.where(count > 0, half, 0))
    return lo - 1


@triton.jit
def _block_pages(PageTable, table_base, n0, offs_n, seqlen_k, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Physical pages of keys ``n0 + offs_n``: one scalar when a block lies in one page
    (``PAGE_SIZE % BLOCK_N == 0``), else one per key. Keys past the sequence read page 0 (their rows are
    masked); every key before its end reads its own page, also past the tile's range ``hi``: such keys
    are masked out of the scores, but their values still meet the probabilities' zeros in ``p @ v``,
    and another page's unused slots may hold NaN."""
    if PAGE_SIZE % BLOCK_N == 0:
        pages = tl.load(PageTable + table_base + n0 // PAGE_SIZE, mask=n0 < seqlen_k, other=0)
    else:
        k_idx = n0 + offs_n
        pages = tl.load(PageTable + table_base + k_idx // PAGE_SIZE, mask=k_idx < seqlen_k, other=0)
    return pages


@triton.jit
def _paged_blocks(acc, m_i, l_i, q, K, V, PageTable, KScale, VScale, table_base, hk, q_idx, offs_n, offs_d,
                  page_next, lo, hi, qo_len, seqlen_k, qk_scale_log2, softcap_log2, scale_over_cap, window_left,
                  stride_kp, stride_kh, stride_ksa, stride_ksb, stride_kda, stride_kdb,
                  stride_vp, stride_vh, stride_vsa, stride_vsb, stride_vda, stride_vdb,
                  stride_scale_p, stride_scale_h,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  K_XS: tl.constexpr, K_XD: tl.constexpr, V_XS: tl.constexpr, V_XD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, K_SCALE: tl.constexpr,
                  V_SCALE: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
                  SAME_ROWS: tl.constexpr):
    """Online softmax over the sequence's key blocks ``[lo, hi)``, rows gathered through the page table
    (``PageTable + table_base`` is the sequence's first entry). With ``USE_TMA`` (linear layout, whole
    key blocks per page) K and V are tensor descriptors and each block is one TMA load. ``page_next``:
    ``_block_pages`` of block ``lo``, read by the caller ahead of time."""
    # the table entries of the next block are read one block ahead, so that the loads of K and V never
    # wait on a table read (H100, page size 16, 128x128 tiles: 414 -> 440 TFLOP/s)
    for n0 in tl.range(lo, hi, BLOCK_N):
        k_idx = n0 + offs_n
        row_ok = k_idx < seqlen_k
        page = page_next
        page_next = _block_pages(PageTable, table_base, n0 + BLOCK_N, offs_n, seqlen_k, PAGE_SIZE, BLOCK_N)
        if PAGE_SIZE % BLOCK_N == 0:
            pages = page + offs_n * 0
            slots = (n0 % PAGE_SIZE) + offs_n
        else:
            pages = page
            slots = k_idx % PAGE_SIZE
        if USE_TMA:
            # descriptors over [pages, page_size, H_kv, D]; rows past the keys (the page's unused slots,
            # which may hold NaN) are zeroed, as 0 * NaN would not be
            k = K.load([page, n0 % PAGE_SIZE, hk, 0]).reshape(BLOCK_N, HEAD_DIM_PAD)
            if MASKED:
                k = tl.where(row_ok[:, None], k, 0.0)
        else:
            k_rows = paged_row_offsets(pages, slots, hk, stride_kp, stride_kh, stride_ksa, stride_ksb, K_XS)
            k = _load_paged(K, k_rows, offs_d, row_ok, stride_kda, stride_kdb, K_XD, HEAD_DIM, MASKED, EVEN_D)
        # [BM, D] @ [D, BN] -> [BM, BN]; an fp8 cache is widened to q's dtype first
        qk = dot(q, tl.trans(k.to(q.dtype)), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), FP32_PRECISION)
        if K_SCALE == 2:
            qk = qk * tl.load(KScale + pages.to(tl.int64) * stride_scale_p + hk * stride_scale_h)[None, :]
        p, acc, m_new, l_i = softmax_step(acc, m_i, l_i, qk, q_idx, k_idx[None, :], qo_len, seqlen_k,
                                          qk_scale_log2, softcap_log2, scale_over_cap, 0.0, window_left, 0,
                                          MASKED, HAS_LEFT, CAUSAL, HAS_SOFTCAP, False)
        if USE_TMA:
            v = V.load([page, n0 % PAGE_SIZE, hk, 0]).reshape(BLOCK_N, HEAD_DIM_PAD)
            if MASKED:
                v = tl.where(row_ok[:, None], v, 0.0)
        else:
            if SAME_ROWS:
                v_rows = k_rows  # K and V share their row strides (the usual case): one address computation
            else:
                v_rows = paged_row_offsets(pages, slots, hk, stride_vp, stride_vh, stride_vsa, stride_vsb, V_XS)
            v = _load_paged(V, v_rows, offs_d, row_ok, stride_vda, stride_vdb, V_XD, HEAD_DIM, MASKED, EVEN_D)
        if V_SCALE == 2:
            p = p * tl.load(VScale + pages.to(tl.int64) * stride_scale_p + hk * stride_scale_h)[None, :]
        acc = dot(p.to(q.dtype), v.to(q.dtype), acc, FP32_PRECISION)  # [BM, BN] @ [BN, D] -> [BM, D]
        m_i = m_new
    return acc, m_i, l_i


# ----------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _paged_attn(Q, K, V, Out, Lse, QoIndptr, KvIndptr, PageTable, LastPageLen, SeqlenK, KScale, VScale,
                stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, stride_split_o,
                stride_split_l, stride_kp, stride_kh, stride_ksa, stride_ksb, stride_kda, stride_kdb,
                stride_vp, stride_vh, stride_vsa, stride_vsb, stride_vda, stride_vdb, stride_table,
                stride_scale_p, stride_scale_h, num_seqs, num_heads, head_group, qk_scale_log2, softcap_log2,
                scale_over_cap, v_scale_value, window_left,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                K_XS: tl.constexpr, K_XD: tl.constexpr, V_XS: tl.constexpr, V_XD: tl.constexpr,
                HP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DECODE: tl.constexpr,
                SEARCH_STEPS: tl.constexpr, TABLE_2D: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, K_SCALE: tl.constexpr,
                V_SCALE: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_TMA: tl.constexpr,
                SAME_ROWS: tl.constexpr):
    """out and lse of one tile: ``QT = BLOCK_M // HP`` queries x ``HP`` heads of one KV head, one share
    of the keys. Grid: (virtual query blocks, H // HP, NUM_SPLITS)."""
    QT: tl.constexpr = BLOCK_M // HP
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    # the last virtual blocks first: under a causal mask a sequence's last query blocks are its longest
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head0 = tl.program_id(1) * HP
    split = tl.program_id(2)
    if DECODE:
        b = pid
        start_q = pid
        qo_len = pid * 0 + 1
        m0 = pid * 0
    else:
        b = _find_sequence(QoIndptr, pid, num_seqs, QT, SEARCH_STEPS)
        start_q = tl.load(QoIndptr + b)
        qo_len = tl.load(QoIndptr + b + 1) - start_q
        m0 = (pid - (start_q // QT + b)) * QT
    if m0 >= qo_len:
        return
    hk = head0 // head_group

    # the sequence's page table and key count
    if TABLE_2D:
        table_base = b.to(tl.int64) * stride_table
        seqlen_k = tl.load(SeqlenK + b)
    else:
        first_page = tl.load(KvIndptr + b)
        num_pages = tl.load(KvIndptr + b + 1) - first_page
        table_base = first_page.to(tl.int64)
        seqlen_k = tl.where(num_pages > 0, (num_pages - 1) * PAGE_SIZE + tl.load(LastPageLen + b), 0)

    # rows: query m0 + r // HP of head head0 + r % HP
    offs_r = tl.arange(0, BLOCK_M)
    if HP == 1:
        q_pos = m0 + offs_r
        heads = head0 + offs_r * 0
    else:
        q_pos = m0 + offs_r // HP
        heads = head0 + offs_r % HP
    row_ok = (offs_r < QT * HP) & (q_pos < qo_len)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_rows = (start_q + q_pos).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0)

    if K_SCALE == 1:
        k_scale = tl.load(KScale).to(tl.float32)
        qk_scale_log2 = qk_scale_log2 * k_scale
        scale_over_cap = scale_over_cap * k_scale

    lo, mid_lo, mid_hi, hi = key_ranges(m0, qo_len, seqlen_k, window_left, 0, QT, BLOCK_N, HAS_LEFT, CAUSAL)
    if NUM_SPLITS > 1:
        share = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        a = tl.minimum(lo + split * share, hi)
        e = tl.minimum(a + share, hi)
        mid_lo = tl.minimum(tl.maximum(mid_lo, a), e)
        mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), e)
        lo = a
        hi = e

    pages_lo = _block_pages(PageTable, table_base, lo, offs_n, seqlen_k, PAGE_SIZE, BLOCK_N)
    if CAUSAL:
        # every range's first table entries, read before the long unmasked loop: the diagonal blocks'
        # loop is short, and its first K load would otherwise wait on this read (H100, page 16, 4 x 4096,
        # ours / contiguous, causal: 0.881 -> 0.910 and 0.862 -> 0.881, benchmarks/NOTES.md). Full masks
        # read them where they are used: read early there too, the full-mask runs measured 0.910 / 0.906
        # against 0.945 / 0.930 in the run before (the registers are held through the whole loop).
        pages_mid = _block_pages(PageTable, table_base, mid_lo, offs_n, seqlen_k, PAGE_SIZE, BLOCK_N)
        pages_hi = _block_pages(PageTable, table_base, mid_hi, offs_n, seqlen_k, PAGE_SIZE, BLOCK_N)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    q_idx = q_pos[:, None]
    acc, m_i, l_i = _paged_blocks(acc, m_i, l_i, q, K, V, PageTable, KScale, VScale, table_base, hk, q_idx, offs_n,
                                  offs_d, pages_lo, lo, mid_lo, qo_len, seqlen_k, qk_scale_log2, softcap_log2,
                                  scale_over_cap, window_left, stride_kp, stride_kh, stride_ksa, stride_ksb,
                                  stride_kda, stride_kdb, stride_vp, stride_vh, stride_vsa, stride_vsb,
                                  stride_vda, stride_vdb, stride_scale_p, stride_scale_h, HEAD_DIM, HEAD_DIM_PAD,
                                  PAGE_SIZE, K_XS, K_XD, V_XS, V_XD, BLOCK_M, BLOCK_N, True, HAS_LEFT,
                                  CAUSAL, HAS_SOFTCAP, K_SCALE, V_SCALE, EVEN_D, USE_TMA, SAME_ROWS)
    if not CAUSAL:
        pages_mid = _block_pages(PageTable, table_base, mid_lo, offs_n, seqlen_k, PAGE_SIZE, BLOCK_N)
    acc, m_i, l_i = _paged_blocks(acc, m_i, l_i, q, K, V, PageTable, KScale, VScale, table_base, hk, q_idx, offs_n,
                                  offs_d, pages_mid, mid_lo, mid_hi, qo_len, seqlen_k, qk_scale_log2, softcap_log2,
                                  scale_over_cap, window_left, stride_kp, stride_kh, stride_ksa, stride_ksb,
                                  stride_kda, stride_kdb, stride_vp, stride_vh, stride_vsa, stride_vsb,
                                  stride_vda, stride_vdb, stride_scale_p, stride_scale_h, HEAD_DIM, HEAD_DIM_PAD,
                                  PAGE_SIZE, K_XS, K_XD, V_XS, V_XD, BLOCK_M, BLOCK_N, False, HAS_LEFT,
                                  CAUSAL, HAS_SOFTCAP, K_SCALE, V_SCALE, EVEN_D, USE_TMA, SAME_ROWS)
    if not CAUSAL:
        pages_hi = _block_pages(PageTable, table_base, mid_hi, offs_n, seqlen_k, PAGE_SIZE, BLOCK_N)
    acc, m_i, l_i = _paged_blocks(acc, m_i, l_i, q, K, V, PageTable, KScale, VScale, table_base, hk, q_idx, offs_n,
                                  offs_d, pages_hi, mid_hi, hi, qo_len, seqlen_k, qk_scale_log2, softcap_log2,
                                  scale_over_cap, window_left, stride_kp, stride_kh, stride_ksa, stride_ksb,
                                  stride_kda, stride_kdb, stride_vp, stride_vh, stride_vsa, stride_vsb,
                                  stride_vda, stride_vdb, stride_scale_p, stride_scale_h, HEAD_DIM, HEAD_DIM_PAD,
                                  PAGE_SIZE, K_XS, K_XD, V_XS, V_XD, BLOCK_M, BLOCK_N, True, HAS_LEFT,
                                  CAUSAL, HAS_SOFTCAP, K_SCALE, V_SCALE, EVEN_D, USE_TMA, SAME_ROWS)

    out, lse = normalize(acc, m_i, l_i, float("-inf"))
    if V_SCALE == 1:
        out = out * tl.load(VScale).to(tl.float32)
    else:
        out = out * v_scale_value
    rows = (start_q + q_pos).to(tl.int64)
    o_ptrs = (Out + split.to(tl.int64) * stride_split_o + rows[:, None] * stride_ot + heads[:, None] * stride_oh
              + offs_d[None, :])
    tl.store(o_ptrs, cast_for_store(out, Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    l_ptrs = Lse + split.to(tl.int64) * stride_split_l + rows * stride_lt + heads * stride_lh
    tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit
def merge_pair(o_a, lse_a, o_b, lse_b):
    """Two normalised attention states ``[rows, D]`` with natural-log LSEs ``[rows]`` -> one; an LSE of
    ``-inf`` (no key) weighs 0, and two empty states give out 0, lse ``-inf``."""
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_safe)
    w_b = tl.exp(lse_b - m_safe)
    total = w_a + w_b
    empty = total == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    out = o_a * (w_a * inv)[:, None] + o_b * (w_b * inv)[:, None]
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
    return out, lse


@triton.jit
def _merge_splits(Part, PartLse, Out, Lse, num_rows, num_heads, stride_split_o, stride_split_l, stride_pt,
                  stride_ph, stride_plt, stride_plh, stride_ot, stride_oh, stride_lt, stride_lh,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                  NUM_SPLITS: tl.constexpr):
    """out/lse of BLOCK_H heads of one row from NUM_SPLITS fp32 partial states."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_ok = offs_h < num_heads
    mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    o_ptrs = Part + t * stride_pt + offs_h[:, None] * stride_ph + offs_d[None, :]
    l_ptrs = PartLse + t * stride_plt + offs_h * stride_plh
    out = tl.load(o_ptrs, mask=mask, other=0.0)
    lse = tl.load(l_ptrs, mask=h_ok, other=float("-inf"))
    for s in tl.static_range(1, NUM_SPLITS):
        o_s = tl.load(o_ptrs + s * stride_split_o, mask=mask, other=0.0)
        l_s = tl.load(l_ptrs + s * stride_split_l, mask=h_ok, other=float("-inf"))
        out, lse = merge_pair(out, lse, o_s, l_s)
    tl.store(Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             cast_for_store(out, Out.dtype.element_ty), mask=mask)
    tl.store(Lse + t * stride_lt + offs_h * stride_lh, lse, mask=h_ok)


@triton.jit
def _merge_states(VA, LseA, VB, LseB, Out, Lse, num_heads, stride_at, stride_ah, stride_lat, stride_lah,
                  stride_bt, stride_bh, stride_lbt, stride_lbh, stride_ot, stride_oh, stride_lt, stride_lh,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """merge_attention_states for BLOCK_H heads of one row (an lse of +inf or -inf: no keys, weight 0)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_ok = offs_h < num_heads
    mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    o_a = tl.load(VA + t * stride_at + offs_h[:, None] * stride_ah + offs_d[None, :], mask=mask, other=0.0)
    o_b = tl.load(VB + t * stride_bt + offs_h[:, None] * stride_bh + offs_d[None, :], mask=mask, other=0.0)
    l_a = tl.load(LseA + t * stride_lat + offs_h * stride_lah, mask=h_ok, other=float("-inf"))
    l_b = tl.load(LseB + t * stride_lbt + offs_h * stride_lbh, mask=h_ok, other=float("-inf"))
    # flash_attn_* mark a row with no keys lse = +inf (FA2's convention), the paged ops -inf: both weigh 0
    l_a = tl.where(l_a == float("inf"), float("-inf"), l_a)
    l_b = tl.where(l_b == float("inf"), float("-inf"), l_b)
    out, lse = merge_pair(o_a.to(tl.float32), l_a, o_b.to(tl.float32), l_b)
    tl.store(Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             cast_for_store(out, Out.dtype.element_ty), mask=mask)
    tl.store(Lse + t * stride_lt + offs_h * stride_lh, lse, mask=h_ok)


# ----------------------------------------------------------------------------------------------------
# Hopper prefill in Gluon: the FlashAttention forward's schedule (``_fwd._attn_fwd_hopper``: a TMA producer
# warp, two consumer warpgroups that overlap the softmax with ``p @ V``), with a producer that fills each
# key block's shared buffer page by page. The caches are 2-D descriptors over ``[pages * page_size,
# H_kv * D]``; a key block of ``BLOCK_N`` rows is ``BLOCK_N // SUB`` TMA boxes of ``SUB = min(page_size,
# BLOCK_N)`` rows, each landing in its rows of the block's buffer. The producer reads the page ids of the
# next block into registers (every lane holds them all) while the current one is in flight. Rows past the
# sequence's keys (page 0, or a page's unused slots; either may hold NaN) are zeroed in V as in the
# forward, and masked by value in the scores. Pages under 8 rows cannot be boxes (a shared buffer is not
# sliced inside its 8-row swizzle pattern) and uneven ones do not tile a block: there four producer warps
# gather the rows with cp.async (masked rows read as 0) and each thread arrives on the block's barrier when
# its copies land; the consumers then fence before their wgmma reads (``GATHERED``). The consumers are
# ``_fwd._fa3_consumer``.

if HAVE_GLUON:

    @gluon.jit
    def _find_sequence_gl(QoIndptr, pid, num_seqs, QT: gl.constexpr, SEARCH_STEPS: gl.constexpr):
        """``_find_sequence`` for Gluon kernels (which cannot call ``triton.jit`` functions)."""
        lo = pid * 0
        count = num_seqs + lo
        for _ in gl.static_range(SEARCH_STEPS):
            half = count // 2
            mid = lo + half
            first = gl.load(QoIndptr + mid) // QT + mid
            go_right = (count > 0) & (first <= pid)
            lo = gl.where(go_right, mid + 1, lo)
            count = gl.where(go_right, count - half - 1, gl.where(count > 0, half, 0))
        return lo - 1

    @gluon.jit
    def _page_rows(PageTable, table_base, n0, seqlen_k, PAGE_SIZE: gl.constexpr, SUB: gl.constexpr,
                   NPG: gl.constexpr):
        """Cache rows (page * PAGE_SIZE + slot) of the NPG boxes of the key block at ``n0``, in every lane;
        boxes past the sequence read page 0."""
        layout: gl.constexpr = gl.BlockedLayout([NPG], [32], [1], [0])
        keys = n0 + gl.arange(0, NPG, layout=layout) * SUB
        pages = gl.load(PageTable + table_base + keys // PAGE_SIZE, mask=keys < seqlen_k, other=0)
        return pages * PAGE_SIZE + keys % PAGE_SIZE

    @gluon.jit
    def _pick(rows, i: gl.constexpr, NPG: gl.constexpr):
        """Element ``i`` of ``_page_rows``' result as a scalar (each lane holds them all: no shuffles)."""
        if NPG == 1:
            return gl.sum(rows, axis=0)
        idx = gl.arange(0, NPG, layout=rows.type.layout)
        return gl.sum(gl.where(idx == i, rows, 0), axis=0)

    @gluon.jit
    def _paged_producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                        v_fix, PageTable, table_base, q_row, q_col, kv_col, lo, n_blocks, seqlen_k,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr):
        """``_fwd._fa3_producer`` over a paged cache: each K and V block is NPG boxes, one per page run."""
        SUB: gl.constexpr = PAGE_SIZE if PAGE_SIZE < BLOCK_N else BLOCK_N
        NPG: gl.constexpr = BLOCK_N // SUB
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, q_col], q_bar, q_smem)
        block_bytes: gl.constexpr = BLOCK_N * k_desc.block_type.nbytes // SUB
        # rows_k: block i's boxes (read one iteration ahead); rows_v: block i - 1's. Two values that never
        # share a handle: triton 3.6 carried only one of two loop variables that started as the same one.
        rows_k = _page_rows(PageTable, table_base, lo, seqlen_k, PAGE_SIZE, SUB, NPG)
        rows_v = gl.zeros_like(rows_k)
        for i in range(n_blocks + 1):
            if i < n_blocks:
                s = i % STAGES
                # a fresh barrier counts its (non-existent) previous phase as complete: the first lap passes
                mbarrier.wait(k_empty.index(s), ((i // STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(s), block_bytes)
                for c in gl.static_range(NPG):
                    _tma_load(k_desc, [_pick(rows_k, c, NPG), kv_col], k_ready.index(s),
                              k_bufs.index(s).slice(c * SUB, SUB, dim=0))
            if i > 0:
                j = i - 1
                s = j % STAGES
                n0 = lo + j * BLOCK_N
                mbarrier.wait(v_empty.index(s), ((j // STAGES) & 1) ^ 1)
                if n0 + BLOCK_N <= seqlen_k:
                    mbarrier.expect(v_ready.index(s), block_bytes)
                    for c in gl.static_range(NPG):
                        _tma_load(v_desc, [_pick(rows_v, c, NPG), kv_col], v_ready.index(s),
                                  v_bufs.index(s).slice(c * SUB, SUB, dim=0))
                else:
                    # the last block, cut by the sequence's end: at most one per program
                    mbarrier.expect(v_fix, block_bytes)
                    for c in gl.static_range(NPG):
                        _tma_load(v_desc, [_pick(rows_v, c, NPG), kv_col], v_fix,
                                  v_bufs.index(s).slice(c * SUB, SUB, dim=0))
                    mbarrier.wait(v_fix, 0)
                    _zero_rows_past(v_bufs.index(s), n0, seqlen_k, BLOCK_N)
                    mbarrier.arrive(v_ready.index(s))
            rows_v = rows_k
            rows_k = _page_rows(PageTable, table_base, lo + (i + 1) * BLOCK_N, seqlen_k, PAGE_SIZE, SUB, NPG)

    @gluon.jit
    def _gather_producer(q_desc, K, V, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, PageTable,
                         table_base, q_row, q_col, kv_col, lo, n_blocks, seqlen_k, stride_kr, stride_vr,
                         HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         PAGE_SIZE: gl.constexpr):
        """Four warps: each key block's K and V rows gathered by cp.async through the page table (pages too
        small or uneven for TMA boxes). Rows past the sequence's keys read as 0 (masked copies). Every
        thread arrives on the block's barrier when its own copies land (``k_ready``/``v_ready`` count
        128); K_i and V_i go out together, one page-table read per block."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, q_col], q_bar, q_smem)
        cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout)), 0)
        for i in range(n_blocks):
            s = i % STAGES
            phase = ((i // STAGES) & 1) ^ 1  # a fresh barrier's previous phase counts as complete
            keys = lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
            ok = keys < seqlen_k
            pages = gl.load(PageTable + table_base + keys // PAGE_SIZE, mask=ok, other=0)
            rows = gl.expand_dims(pages.to(gl.int64) * PAGE_SIZE + keys % PAGE_SIZE, 1)
            mask = gl.expand_dims(ok, 1) & (cols < HEAD_DIM)
            mbarrier.wait(k_empty.index(s), phase)
            _async_load(k_bufs.index(s), K + (rows * stride_kr + kv_col) + cols, mask=mask)
            async_copy.mbarrier_arrive(k_ready.index(s), increment_count=False)
            mbarrier.wait(v_empty.index(s), phase)
            _async_load(v_bufs.index(s), V + (rows * stride_vr + kv_col) + cols, mask=mask)
            async_copy.mbarrier_arrive(v_ready.index(s), increment_count=False)

    @gluon.jit
    def _paged_loads(q_desc, k_desc, v_desc, K, V, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                     v_fix, PageTable, table_base, q_row, q_col, kv_col, lo, n_blocks, seqlen_k, stride_kr, stride_vr,
                     HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr,
                     GATHER: gl.constexpr):
        """The producer partition: ``_gather_producer`` with ``GATHER``, else ``_paged_producer``."""
        if GATHER:
            _gather_producer(q_desc, K, V, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                             PageTable, table_base, q_row, q_col, kv_col, lo, n_blocks, seqlen_k, stride_kr,
                             stride_vr, HEAD_DIM, BLOCK_N, STAGES, PAGE_SIZE)
        else:
            _paged_producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
                            v_empty, v_fix, PageTable, table_base, q_row, q_col, kv_col, lo, n_blocks, seqlen_k,
                            BLOCK_N, STAGES, PAGE_SIZE)

    @gluon.jit
    def _paged_prefill_hopper(q_desc, k_desc, v_desc, K, V, Out, Lse, QoIndptr, KvIndptr, PageTable, LastPageLen,
                              SeqlenK, stride_kr, stride_vr, stride_ot, stride_oh, stride_lt, stride_lh, stride_table,
                              num_seqs, num_heads, head_group, qk_scale_log2, v_scale_value, window_left,
                              HEAD_DIM: gl.constexpr,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                              PAGE_SIZE: gl.constexpr, GATHER: gl.constexpr, SEARCH_STEPS: gl.constexpr,
                              TABLE_2D: gl.constexpr,
                              CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                              PRODUCER_REGS: gl.constexpr):
        """out and lse of BLOCK_M queries of one (sequence, head) over a paged cache (``_paged_attn``'s
        virtual query blocks, grid (virtual blocks, H)); q is a descriptor over ``[total_q, H * D]``. K/V
        blocks arrive as TMA boxes (``k_desc``/``v_desc``: page sizes that are powers of two >= 8) or,
        with ``GATHER``, as rows of ``K``/``V`` (row strides ``stride_kr``/``stride_vr``) copied by cp.async."""
        # the last virtual blocks first: under a causal mask a sequence's last query blocks are its longest
        pid = gl.num_programs(0) - 1 - gl.program_id(0)
        h = gl.program_id(1)
        hk = h // head_group
        b = _find_sequence_gl(QoIndptr, pid, num_seqs, BLOCK_M, SEARCH_STEPS)
        start_q = gl.load(QoIndptr + b)
        qo_len = gl.load(QoIndptr + b + 1) - start_q
        m0 = (pid - (start_q // BLOCK_M + b)) * BLOCK_M
        if TABLE_2D:
            table_base = b.to(gl.int64) * stride_table
            seqlen_k = gl.load(SeqlenK + b)
        else:
            first_page = gl.load(KvIndptr + b)
            num_pages = gl.load(KvIndptr + b + 1) - first_page
            table_base = first_page.to(gl.int64)
            seqlen_k = gl.where(num_pages > 0, (num_pages - 1) * PAGE_SIZE + gl.load(LastPageLen + b), 0)
        lo, n_blocks = _fa3_key_blocks(m0, qo_len, seqlen_k, window_left, 0, BLOCK_M, BLOCK_N, HAS_LEFT, CAUSAL)
        o_base = start_q.to(gl.int64) * stride_ot + h.to(gl.int64) * stride_oh
        l_base = start_q.to(gl.int64) * stride_lt + h.to(gl.int64) * stride_lh

        q_smem, k_bufs, v_bufs, q_bar, v_fix, k_ready, k_empty, v_ready, v_empty = _fa3_buffers(
            q_desc, k_desc, HEAD_DIM, BLOCK_N, STAGES, 128 if GATHER else 1)

        # the gathering producer is four warps, the TMA one a single warp
        PRODUCER_WARPS: gl.constexpr = 4 if GATHER else 1
        gl.warp_specialize([
            (_fa3_consumer, (0, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, Out, Lse, o_base,
                             l_base, stride_ot, stride_lt, v_scale_value, m0, qo_len, seqlen_k, lo, n_blocks,
                             qk_scale_log2, window_left, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_LEFT, CAUSAL,
                             float("-inf"), GATHER)),
            (_fa3_consumer, (1, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, Out, Lse, o_base,
                             l_base, stride_ot, stride_lt, v_scale_value, m0, qo_len, seqlen_k, lo, n_blocks,
                             qk_scale_log2, window_left, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_LEFT, CAUSAL,
                             float("-inf"), GATHER)),
            (_paged_loads, (q_desc, k_desc, v_desc, K, V, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
                            v_empty, v_fix, PageTable, table_base, start_q + m0, h * HEAD_DIM, hk * HEAD_DIM, lo,
                            n_blocks, seqlen_k, stride_kr, stride_vr, HEAD_DIM, BLOCK_N, STAGES, PAGE_SIZE, GATHER)),
        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------
# launch configs


@dataclasses.dataclass(frozen=True)
class PagedConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Hopper, keyed by padded head dim; chosen by sweeps on an H100 (bf16, D 128, 4 x 4096 queries and keys,
# H 32 / H_kv 8, 2026-11-22, benchmarks/NOTES.md). Prefill through TMA (linear layout, pages a multiple
# of 64 keys; page 1024): 128x64/4 warps/2 stages 484 TFLOP/s (64x64/4/3 467, 128x128/8/3 476; later,
# ours / contiguous at H 16 / 16 and 32 / 8: 0.98-0.99 full, 0.95-0.97 causal, against 0.89-0.94 and
# 0.80-0.87 for 128x64/8/3 and 256x64/16/3). Gathered rows (any other page size): 128x128/8/3 429-452
# (128x128/8/2 413-440, 64x64/4/3 341-380): long key blocks amortise the per-row address work; at D 128
# 256-row tiles of 16 warps amortise it over more queries (page 16, full masks, ours / contiguous:
# 0.951 / 0.942 and 0.973 / 0.956 in two runs against 0.924 / 0.950 and 0.929 / 0.947 for 128x128/8/3;
# page 1 0.881 / 0.928 against 0.862 / 0.916). D 64 and D 256 are untuned starting points.
PREFILL_TMA_CONFIGS = {
    16: PagedConfig(128, 64, 4, 2), 32: PagedConfig(128, 64, 4, 2), 64: PagedConfig(128, 64, 4, 2),
    128: PagedConfig(128, 64, 4, 2), 256: PagedConfig(64, 64, 4, 2),
}
PREFILL_GATHER_CONFIGS = {
    16: PagedConfig(128, 128, 8, 3), 32: PagedConfig(128, 128, 8, 3), 64: PagedConfig(128, 128, 8, 3),
    128: PagedConfig(256, 64, 16, 3), 256: PagedConfig(64, 64, 4, 2),
}
# sequences of fewer queries than a 256-row tile (on average): the 128-row tile measured before it
SHORT_PREFILL_GATHER_CONFIG = PagedConfig(128, 128, 8, 3)
# Causal masks, gathered rows (H100, page 16, 4 x 4096 queries and keys, D 128, 3 interleaved rounds,
# ours / contiguous flash_attn_varlen_func in the same run, 2026-11-22): 128x64/8/3 0.901 (H 16 / H_kv
# 16) and 0.908 (32 / 8) against 0.876 and 0.892 for 128x128/8/3, then the full-mask config, which
# stayed ahead there (0.942 / 0.960 against 0.899 / 0.907). 128x64/8/4 0.892 / 0.861, 128x32/8/4
# 0.74-0.76, 64x128/4/3 0.61, 128x64/4/3 0.38-0.41; later runs: 256x64/16/3 0.874-0.882 / 0.914-0.915,
# 256x64/16/4 0.862 / 0.902, 256x32/16/3 0.815 / 0.855, 128x64/8/2 with 128 registers (two blocks per
# SM) 0.847 / 0.879. Other head dims: the full-mask table.
PREFILL_GATHER_CAUSAL_CONFIGS = {128: PagedConfig(128, 64, 8, 3)}
# decode: BLOCK_M is raised to fit the packed heads; bandwidth-bound (1.04-1.06x the copy-bandwidth
# floor at D 128 with these, page sizes 1, 16 and 64)
DECODE_CONFIGS = {
    16: PagedConfig(16, 128, 4, 3), 32: PagedConfig(16, 128, 4, 3), 64: PagedConfig(16, 128, 4, 3),
    128: PagedConfig(16, 64, 4, 3), 256: PagedConfig(16, 32, 4, 2),
}
# fp8 caches: a block of 64 keys is half the bytes, too little work per step; 128-key blocks (H100, D 128,
# page 16, 32 x 8192 keys: 1.74 -> 1.49x the floor). Still above it: the widening to bf16 goes through
# registers, so these loads are not pipelined into shared memory as bf16 ones are.
DECODE_FP8_CONFIGS = {
    16: PagedConfig(16, 256, 4, 3), 32: PagedConfig(16, 256, 4, 3), 64: PagedConfig(16, 128, 4, 3),
    128: PagedConfig(16, 128, 4, 3), 256: PagedConfig(16, 64, 4, 2),
}
INTERPRETER_CONFIG = PagedConfig(16, 16, 4, 1)

# tests and the bench sweep set this to force one config (block_m is still raised to fit HP heads)
config_override: PagedConfig | None = None
# tests: None decides by the device (TMA on Hopper and newer, where the layout allows); False forces
# the pointer path; True forces descriptors wherever the layout allows, also under the interpreter
tma_mode: bool | None = None
# tests: None takes the Gluon prefill (``_paged_prefill_hopper``) wherever it applies on Hopper; False
# never; True also raises where it does not apply (so a test cannot silently run the Triton kernel)
hopper_mode: bool | None = None

def paged_config(head_dim_pad: int, decode: bool, tma_pages: bool, kv_bytes: int,
                 causal: bool = False, mean_queries: float = float("inf")) -> PagedConfig:
    """The launch config; ``tma_pages``: the layout and page size allow TMA loads of 64-key blocks;
    ``kv_bytes``: the cache's element size; ``causal``: a causal prefill; ``mean_queries``: queries per
    sequence on average (total_q / B, known on the host): sequences shorter than a 256-row tile take the
    128-row config, since a tile runs its whole key loop however few of its rows are queries."""
    if config_override is not None:
        return config_override
    if is_interpreter():
        return INTERPRETER_CONFIG
    if decode:
        return (DECODE_FP8_CONFIGS if kv_bytes == 1 else DECODE_CONFIGS)[head_dim_pad]
    if tma_pages:
        return PREFILL_TMA_CONFIGS[head_dim_pad]
    if causal and head_dim_pad in PREFILL_GATHER_CAUSAL_CONFIGS:
        return PREFILL_GATHER_CAUSAL_CONFIGS[head_dim_pad]
    cfg = PREFILL_GATHER_CONFIGS[head_dim_pad]
    if cfg.block_m > 128 and mean_queries < cfg.block_m:
        return SHORT_PREFILL_GATHER_CONFIG
    return cfg
