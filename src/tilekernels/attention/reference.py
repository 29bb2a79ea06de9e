"""``tk.flash_attn_func`` / ``tk.flash_attn_varlen_func``'s specification in plain PyTorch.

FlashAttention-2's semantics (``flash_attn_func``), spelled out step by step for one query head ``h``
(which reads kv head ``h // (H // H_k)``: GQA/MQA) of one sequence with ``S_q`` queries and ``S_k`` keys:

1. scores ``s[i, j] = (q[i] . k[j]) * softmax_scale`` (default ``1 / sqrt(D)``);
2. ``softcap > 0``: ``s = softcap * tanh(s / softcap)``;
3. alibi: ``s[i, j] -= slope[h] * |i + S_k - S_q - j|`` (for causal and non-causal alike);
4. masks, aligned bottom-right (query ``i`` sits at key position ``i + S_k - S_q``): key ``j`` is
   allowed iff ``left < 0 or j >= i + S_k - S_q - left`` and ``right < 0 or j <= i + S_k - S_q + right``
   with ``(left, right) = window_size``; ``causal`` means ``right = 0``;
5. ``p = softmax(s)`` over the allowed keys; ``lse[i] = log(sum_j exp(s[i, j]))`` in natural log;
   a row with no allowed key has ``out = 0`` and ``lse = +inf``;
6. dropout: ``out = (p * keep / (1 - dropout_p)) @ v`` with a boolean ``keep`` mask; ``lse`` is the
   undropped softmax's.

In ``float64`` this is the exact reference. With ``compute_dtype`` equal to the inputs' own fp16/bf16
it is PyTorch's answer in that low precision (matmuls, softcap, alibi and masking in the low dtype,
the softmax as ``torch.softmax`` computes it), the denominator of the error-ratio rule of
``tilekernels.testing``. Everything is differentiable, so autograd through it gives reference gradients.

The second half specifies the paged-KV ops (``tk.batch_prefill``, ``tk.batch_decode``,
``tk.merge_attention_states``) on top of ``reference_attention``: a paged cache is gathered back into
contiguous keys and values, then attended to as varlen attention.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch


def _allowed_keys(seqlen_q: int, seqlen_k: int, window_size: tuple[int, int], device) -> torch.Tensor:
    """``[S_q, S_k]`` bool: which keys each query may attend to (bottom-right aligned window)."""
    left, right = window_size
    rows = torch.arange(seqlen_q, device=device).view(-1, 1) + (seqlen_k - seqlen_q)  # key position of query i
    cols = torch.arange(seqlen_k, device=device).view(1, -1)
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= cols >= rows - left
    if right >= 0:
        allowed &= cols <= rows + right
    return allowed


def _attention_dense(q, k, v, *, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                     dropout_keep, compute_dtype):
    """Steps 1-6 on equal-length sequences: q ``[B, S_q, H, D]``, k/v ``[B, S_k, H_k, D]``,
    slopes ``[B, H]`` or None, keep ``[B, H, S_q, S_k]`` or None. Returns out ``[B, S_q, H, D]`` and
    lse ``[B, H, S_q]``."""
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    group = heads // heads_k
    q = q.to(compute_dtype).transpose(1, 2)                                            # [B, H, S_q, D]
    k = k.to(compute_dtype).transpose(1, 2).repeat_interleave(group, dim=1)            # [B, H, S_k, D]
    v = v.to(compute_dtype).transpose(1, 2).repeat_interleave(group, dim=1)            # [B, H, S_k, D]

    scores = (q @ k.transpose(-1, -2)) * softmax_scale                                 # [B, H, S_q, S_k]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        key_pos = torch.arange(seqlen_k, device=q.device).view(1, -1)
        query_pos = torch.arange(seqlen_q, device=q.device).view(-1, 1) + (seqlen_k - seqlen_q)
        distance = (query_pos - key_pos).abs().to(compute_dtype)                        # [S_q, S_k]
        slopes = alibi_slopes.to(compute_dtype).view(batch, heads, 1, 1)
        scores = scores - slopes * distance

    allowed = _allowed_keys(seqlen_q, seqlen_k, window_size, q.device)
    scores = scores.masked_fill(~allowed, -math.inf)
    empty_row = ~allowed.any(dim=-1, keepdim=True)                                      # [S_q, 1]
    # An empty row is given finite scores (any will do) so that neither softmax nor its gradient
    # produces NaN, then zeroed.
    p = torch.softmax(scores.masked_fill(empty_row, 0.0), dim=-1).masked_fill(empty_row, 0.0)
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(scores.to(lse_dtype), dim=-1).masked_fill(empty_row.view(-1), math.inf)

    if dropout_p > 0:
        p = p * dropout_keep.to(compute_dtype) / (1.0 - dropout_p)
    out = p @ v                                                                        # [B, H, S_q, D]
    return out.transpose(1, 2), lse


def reference_attention(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_keep=None,
                        compute_dtype=torch.float64):
    """Attention as ``flash_attn_func`` (or, with ``cu_seqlens_*``, ``flash_attn_varlen_func``) defines it.

    - batch mode: q ``[B, S_q, H, D]``, k/v ``[B, S_k, H_k, D]``; returns out ``[B, S_q, H, D]`` and
      lse ``[B, H, S_q]``.
    - varlen mode: q ``[total_q, H, D]``, k/v ``[total_k, H_k, D]``, ``cu_seqlens_q``/``cu_seqlens_k``
      int32 ``[B + 1]`` (read on the host: this is a reference); returns out ``[total_q, H, D]`` and lse
      ``[H, total_q]``.

    ``alibi_slopes``: ``[H]`` or ``[B, H]``. ``dropout_keep``: bool ``[B, H, S_q, S_k]`` (varlen:
    ``[B, H, max_seqlen_q, max_seqlen_k]`` indexed by positions within each sequence), required when
    ``dropout_p > 0``. ``out`` is returned in ``compute_dtype`` on the inputs' device (the caller casts);
    ``lse`` in float64 when computing in float64, else float32.
    """
    heads, head_dim = q.shape[-2], q.shape[-1]
    if heads % k.shape[-2] != 0:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k's ({k.shape[-2]})")
    if dropout_p > 0 and dropout_keep is None:
        raise ValueError("dropout_keep (the kept-element mask) is required when dropout_p > 0")
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    window_size = (window_size[0], 0) if causal else tuple(window_size)
    options = {"softmax_scale": softmax_scale, "window_size": window_size, "softcap": softcap,
               "dropout_p": dropout_p, "compute_dtype": compute_dtype}

    if cu_seqlens_q is None:
        batch = q.shape[0]
        slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, heads)
        return _attention_dense(q, k, v, alibi_slopes=slopes, dropout_keep=dropout_keep, **options)

    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    batch = len(starts_q) - 1
    slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, heads)
    outs, lses = [], []
    for b in range(batch):
        q_b = q[starts_q[b]:starts_q[b + 1]].unsqueeze(0)
        k_b = k[starts_k[b]:starts_k[b + 1]].unsqueeze(0)
        v_b = v[starts_k[b]:starts_k[b + 1]].unsqueeze(0)
        keep_b = None
        if dropout_p > 0:
            keep_b = dropout_keep[b:b + 1, :, :q_b.shape[1], :k_b.shape[1]]
        out_b, lse_b = _attention_dense(q_b, k_b, v_b, alibi_slopes=None if slopes is None else slopes[b:b + 1],
                                        dropout_keep=keep_b, **options)
        outs.append(out_b[0])
        lses.append(lse_b[0])
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


# ====================================================================================================
# paged KV: tk.batch_prefill / tk.batch_decode / tk.merge_attention_states
#
# A paged cache holds keys and values in fixed-size pages of ``page_size`` slots; a page table maps
# each sequence's key positions to (physical page, slot): position ``j`` is in page ``pages[j //
# page_size]``, slot ``j % page_size``. Two table formats say which pages a sequence owns:
#
# - 1-D (FlashInfer's): ``kv_indptr`` [B + 1], ``kv_page_indices`` [kv_indptr[B]], ``kv_last_page_len``
#   [B]; sequence b owns ``kv_page_indices[kv_indptr[b]:kv_indptr[b + 1]]`` (n_b pages) and has
#   ``(n_b - 1) * page_size + kv_last_page_len[b]`` keys (0 when n_b = 0).
# - 2-D (vLLM's): ``block_table`` [B, max_pages], ``seqlen_k`` [B]; sequence b owns the first
#   ``ceil(seqlen_k[b] / page_size)`` entries of its row.
#
# Two cache layouts, told apart by rank (x = 16 // element size: 8 for fp16/bf16, 16 for fp8):
#
# - linear, 4-D: K and V ``[num_pages, page_size, H_kv, D]``, key(p, s, h, d) = K[p, s, h, d];
# - vectorized, 5-D: K ``[num_pages, H_kv, D // x, page_size, x]``, key(p, s, h, d) = K[p, h, d // x, s,
#   d % x]; V ``[num_pages, H_kv, page_size // x, D, x]``, value(p, s, h, d) = V[p, h, s // x, d, s % x].
#
# fp8 caches are dequantised as ``cache.float() * scale`` with a scale per tensor (a float, a 0-d or
# 1-element tensor) or per page and kv head (float32 ``[num_pages, H_kv]``).

PAGED_LAYOUTS = ("linear", "vectorized")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclasses.dataclass
class PagedKV:
    """A paged K/V cache and its page table in both formats (``make_paged_kv`` builds one).

    ``k_cache``/``v_cache`` in ``layout`` ("linear" 4-D or "vectorized" 5-D); the 1-D table
    (``kv_indptr``, ``kv_page_indices``, ``kv_last_page_len``) and the 2-D table (``block_table``,
    ``seqlen_k``), all int32 on the caches' device; ``k_scale``/``v_scale``: None, a float or a float32
    tensor (0-d per tensor, ``[num_pages, H_kv]`` per page and head), as the ops take them.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_page_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    block_table: torch.Tensor
    seqlen_k: torch.Tensor
    k_scale: float | torch.Tensor | None
    v_scale: float | torch.Tensor | None
    page_size: int
    layout: str

    def table(self, fmt: str) -> dict:
        """The page-table keywords of the ops for format ``"1d"`` or ``"2d"`` (the other format's absent)."""
        if fmt == "1d":
            return {"kv_indptr": self.kv_indptr, "kv_page_indices": self.kv_page_indices,
                    "kv_last_page_len": self.kv_last_page_len}
        if fmt == "2d":
            return {"block_table": self.block_table, "seqlen_k": self.seqlen_k}
        raise ValueError(f"fmt must be '1d' or '2d', got {fmt!r}")

    @property
    def num_pages(self) -> int:
        return self.k_cache.shape[0]


def _vector_width(dtype: torch.dtype) -> int:
    """x of the vectorized layout: how many elements make 16 bytes."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def _page_order(num_pages: int, order: str, generator: torch.Generator | None) -> torch.Tensor:
    """Physical page numbers (int64, CPU) in the order logical pages take them."""
    if order == "shuffle":
        return torch.randperm(num_pages, generator=generator)
    if order == "interleave":
        i = torch.arange(num_pages)
        return torch.where(i % 2 == 0, i // 2, num_pages - 1 - i // 2)
    raise ValueError(f"order must be 'shuffle' or 'interleave', got {order!r}")


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _key_slots(sequences: list[tuple[list[int], int]], page_size: int, device):
    """Physical page and slot (int64 on ``device``) of every key, sequence after sequence, from each
    sequence's ``(pages, key count)``."""
    tok_page = _cat([torch.as_tensor(pages, dtype=torch.long)[torch.arange(n) // page_size]
                     for pages, n in sequences])
    tok_slot = _cat([torch.arange(n) % page_size for _, n in sequences])
    return tok_page.to(device), tok_slot.to(device)


def _quantise(x: torch.Tensor, kv_dtype: torch.dtype, scale: str | None, tok_page: torch.Tensor,
              num_pages: int):
    """``x`` [total, H_kv, D] into ``kv_dtype`` and the scale that dequantises it (None, 0-d or
    ``[num_pages, H_kv]`` float32). A page or head of zeros keeps scale 1."""
    if kv_dtype not in FP8_DTYPES:
        if scale is not None:
            raise ValueError(f"scale is for fp8 caches only, got scale={scale!r} with kv_dtype {kv_dtype}")
        return x.to(kv_dtype), None
    fp8_max = torch.finfo(kv_dtype).max
    wide = x.float()
    if scale is None:
        return wide.clamp(-fp8_max, fp8_max).to(kv_dtype), None
    if scale == "tensor":
        amax = wide.abs().amax() if wide.numel() else wide.new_zeros(())
        factor = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
        per_token = factor
    elif scale == "page":
        page_amax = wide.new_zeros(num_pages, x.shape[1])
        page_amax.scatter_reduce_(0, tok_page.unsqueeze(-1).expand(-1, x.shape[1]), wide.abs().amax(dim=-1),
                                  "amax")
        factor = torch.where(page_amax > 0, page_amax / fp8_max, torch.ones_like(page_amax))
        per_token = factor[tok_page].unsqueeze(-1)                                      # [total, H_kv, 1]
    else:
        raise ValueError(f"scale must be None, 'tensor' or 'page', got {scale!r}")
    return (wide / per_token).clamp(-fp8_max, fp8_max).to(kv_dtype), factor


def _to_layout(k_lin: torch.Tensor, v_lin: torch.Tensor, layout: str):
    """Linear ``[P, page_size, H_kv, D]`` caches into ``layout`` (contiguous)."""
    if layout == "linear":
        return k_lin, v_lin
    num_pages, page_size, heads_kv, head_dim = k_lin.shape
    x = _vector_width(k_lin.dtype)
    if head_dim % x or page_size % x:
        raise ValueError(f"the vectorized layout needs head dim and page_size multiples of x = {x} for "
                         f"{k_lin.dtype}, got head dim {head_dim} and page_size {page_size}")
    k_vec = k_lin.view(num_pages, page_size, heads_kv, head_dim // x, x).permute(0, 2, 3, 1, 4)
    v_vec = v_lin.view(num_pages, page_size // x, x, heads_kv, head_dim).permute(0, 3, 1, 4, 2)
    return k_vec.contiguous(), v_vec.contiguous()


def make_paged_kv(k: torch.Tensor, v: torch.Tensor, cu_seqlens_k: torch.Tensor, page_size: int, *,
                  layout: str = "linear", kv_dtype: torch.dtype | None = None, scale: str | None = None,
                  extra_pages: int = 0, order: str = "shuffle",
                  generator: torch.Generator | None = None) -> PagedKV:
    """Scatter contiguous varlen keys/values into a paged cache (a test builder: reads ``cu_seqlens_k``
    on the host). ``gather_paged_kv`` is its inverse.

    - ``k``, ``v``: ``[total_k, H_kv, D]`` fp16/bf16; ``cu_seqlens_k`` int32 ``[B + 1]``.
    - Sequence b gets ``ceil(len_b / page_size)`` pages; the pool holds their total plus ``extra_pages``.
      Physical page numbers follow a permutation of the pool: ``order="shuffle"``, random (from
      ``generator``), or ``"interleave"``, low and high numbers alternating (0, N-1, 1, N-2, ...).
    - ``kv_dtype``: the caches' dtype (default ``k``'s); fp8 (``torch.float8_e4m3fn``/``e5m2``) is
      quantised with ``scale`` None (scale 1), ``"tensor"`` (one float32 0-d tensor per cache: amax /
      fp8 max) or ``"page"`` (float32 ``[num_pages, H_kv]`` per page and kv head: that page's amax / fp8
      max; 1 for unused pages).
    - Every slot no sequence uses (a last page's tail, the extra pages) holds NaN, fp8 too, so a kernel
      that reads one shows it.
    - ``block_table`` is ``[B, max(1, max pages per sequence)]``; a row is padded past its sequence's
      pages with the first unused page (all NaN), or with page 0 when every page is used.
    - ``kv_last_page_len`` is 0 for a sequence with no keys (no pages).
    """
    if layout not in PAGED_LAYOUTS:
        raise ValueError(f"layout must be one of {PAGED_LAYOUTS}, got {layout!r}")
    if page_size < 1 or extra_pages < 0:
        raise ValueError(f"page_size must be >= 1 and extra_pages >= 0, got {page_size} and {extra_pages}")
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must be [total_k, H_kv, D] of one shape, got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    device = k.device
    heads_kv, head_dim = k.shape[1], k.shape[2]
    starts = cu_seqlens_k.tolist()
    lengths = [end - start for start, end in itertools.pairwise(starts)]
    pages_per_seq = [-(-n // page_size) for n in lengths]
    first_page = [0, *itertools.accumulate(pages_per_seq)]
    num_used = first_page[-1]
    used = _page_order(num_used + extra_pages, order, generator)
    num_pages = used.numel()
    used, pad_page = used[:num_used], (int(used[num_used]) if extra_pages > 0 else 0)
    seq_pages = [(used[first_page[b]:first_page[b + 1]].tolist(), n) for b, n in enumerate(lengths)]
    tok_page, tok_slot = _key_slots(seq_pages, page_size, device)
    rows = _cat([torch.arange(start, start + n) for start, n in zip(starts, lengths)]).to(device)

    kv_dtype = kv_dtype or k.dtype
    k_q, k_scale = _quantise(k[rows], kv_dtype, scale, tok_page, num_pages)
    v_q, v_scale = _quantise(v[rows], kv_dtype, scale, tok_page, num_pages)
    k_lin = torch.full((num_pages, page_size, heads_kv, head_dim), math.nan, dtype=kv_dtype, device=device)
    v_lin = torch.full_like(k_lin, math.nan)
    k_lin[tok_page, tok_slot] = k_q
    v_lin[tok_page, tok_slot] = v_q
    k_cache, v_cache = _to_layout(k_lin, v_lin, layout)

    max_pages = max([1, *pages_per_seq])
    block_table = torch.full((len(lengths), max_pages), pad_page, dtype=torch.int32)
    for b, n in enumerate(pages_per_seq):
        block_table[b, :n] = used[first_page[b]:first_page[b + 1]]
    last_page_len = [n - (p - 1) * page_size if p else 0 for n, p in zip(lengths, pages_per_seq)]

    def int32(values):
        return torch.as_tensor(values, dtype=torch.int32).to(device)

    return PagedKV(k_cache, v_cache, kv_indptr=int32(first_page), kv_page_indices=int32(used),
                   kv_last_page_len=int32(last_page_len), block_table=block_table.to(device),
                   seqlen_k=int32(lengths), k_scale=k_scale, v_scale=v_scale, page_size=page_size, layout=layout)


def _cache_geometry(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, str]:
    """``(page_size, layout)`` of a cache pair, from its rank and shape."""
    if k_cache.dim() == 4 and v_cache.shape == k_cache.shape:
        return k_cache.shape[1], "linear"
    if k_cache.dim() == 5 and v_cache.dim() == 5:
        num_pages, heads_kv, d_chunks, page_size, x = k_cache.shape
        if tuple(v_cache.shape) == (num_pages, heads_kv, page_size // x, d_chunks * x, x):
            return page_size, "vectorized"
    raise ValueError(f"k_cache and v_cache are neither linear [P, page_size, H_kv, D] nor vectorized "
                     f"([P, H_kv, D/x, page_size, x], [P, H_kv, page_size/x, D, x]): shapes "
                     f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")


def _sequence_pages(page_size: int, kv_indptr, kv_page_indices, kv_last_page_len, block_table,
                    seqlen_k) -> list[tuple[list[int], int]]:
    """Each sequence's physical pages and key count, read from whichever table is given (on the host)."""
    one_d = any(t is not None for t in (kv_indptr, kv_page_indices, kv_last_page_len))
    two_d = block_table is not None or seqlen_k is not None
    if one_d == two_d:
        raise ValueError("pass exactly one page table: kv_indptr/kv_page_indices/kv_last_page_len (1-D) "
                         "or block_table/seqlen_k (2-D)")
    if one_d:
        indptr, indices, last = kv_indptr.tolist(), kv_page_indices.tolist(), kv_last_page_len.tolist()
        sequences = []
        for b in range(len(indptr) - 1):
            pages = indices[indptr[b]:indptr[b + 1]]
            sequences.append((pages, (len(pages) - 1) * page_size + last[b] if pages else 0))
        return sequences
    table, lengths = block_table.tolist(), seqlen_k.tolist()
    return [(row[:-(-n // page_size)], n) for row, n in zip(table, lengths)]


def _dequantise(x: torch.Tensor, scale, tok_page: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.float() * scale`` (in float64 when ``dtype`` is), cast to ``dtype``; ``x`` [total, H_kv, D]."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    x = x.to(wide)
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device=x.device, dtype=wide)
        x = x * (scale.reshape(()) if scale.numel() == 1 else scale[tok_page].unsqueeze(-1))
    elif scale is not None:
        x = x * scale
    return x.to(dtype)


def gather_paged_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, *, kv_indptr=None, kv_page_indices=None,
                    kv_last_page_len=None, block_table=None, seqlen_k=None, k_scale=None, v_scale=None,
                    dtype: torch.dtype = torch.float32):
    """The keys and values a page table points at, contiguous and dequantised: the inverse of
    ``make_paged_kv`` (reads the table on the host).

    Takes either table format (keywords as the ops take them) and either layout (by the caches' rank).
    Returns k, v ``[total_k, H_kv, D]`` in ``dtype`` on the caches' device and int32 ``cu_seqlens_k``.
    """
    page_size, layout = _cache_geometry(k_cache, v_cache)
    sequences = _sequence_pages(page_size, kv_indptr, kv_page_indices, kv_last_page_len, block_table, seqlen_k)
    device = k_cache.device
    tok_page, tok_slot = _key_slots(sequences, page_size, device)
    if layout == "linear":
        k, v = k_cache[tok_page, tok_slot], v_cache[tok_page, tok_slot]                 # [total, H_kv, D]
    else:
        x = k_cache.shape[-1]
        k = k_cache[tok_page, :, :, tok_slot, :].flatten(-2)                             # [total, H_kv, D]
        v = v_cache[tok_page, :, tok_slot // x, :, tok_slot % x]                        # [total, H_kv, D]
    cu_seqlens_k = torch.tensor([0, *itertools.accumulate(n for _, n in sequences)], dtype=torch.int32,
                                device=device)
    return (_dequantise(k, k_scale, tok_page, dtype), _dequantise(v, v_scale, tok_page, dtype), cu_seqlens_k)


def reference_paged_attention(q, k_cache, v_cache, qo_indptr, kv_indptr=None, kv_page_indices=None,
                              kv_last_page_len=None, *, block_table=None, seqlen_k=None, causal=False,
                              softmax_scale=None, logits_soft_cap=0.0, window_left=-1, k_scale=None,
                              v_scale=None, compute_dtype=torch.float64):
    """``tk.batch_prefill`` (and, with ``qo_indptr = arange(B + 1)``, ``tk.batch_decode``) as
    ``reference_attention`` on the gathered cache.

    q ``[total_q, H, D]``; sequence b's queries are ``q[qo_indptr[b]:qo_indptr[b + 1]]``, aligned
    bottom-right to its keys; the mask is ``window_size=(window_left, 0 if causal else -1)``. Returns
    out ``[total_q, H, D]`` in ``compute_dtype`` and lse ``[total_q, H]`` (float64 when computing in
    float64, else float32), natural log; a row with no allowed key, or past ``qo_indptr[-1]``, has out 0
    and lse -inf. With ``compute_dtype`` equal to q's fp16/bf16, K/V are dequantised into that dtype and
    this is PyTorch's low-precision answer.
    """
    k, v, cu_seqlens_k = gather_paged_kv(k_cache, v_cache, kv_indptr=kv_indptr, kv_page_indices=kv_page_indices,
                                         kv_last_page_len=kv_last_page_len, block_table=block_table,
                                         seqlen_k=seqlen_k, k_scale=k_scale, v_scale=v_scale,
                                         dtype=compute_dtype)
    total_q, heads, head_dim = q.shape
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    out = torch.zeros(total_q, heads, head_dim, dtype=compute_dtype, device=q.device)
    lse = torch.full((total_q, heads), -math.inf, dtype=lse_dtype, device=q.device)
    if cu_seqlens_k.numel() > 1:
        seq_out, seq_lse = reference_attention(
            q, k, v, cu_seqlens_q=qo_indptr, cu_seqlens_k=cu_seqlens_k, softmax_scale=softmax_scale,
            causal=causal, window_size=(window_left, 0 if causal else -1), softcap=logits_soft_cap,
            compute_dtype=compute_dtype)
        rows = seq_out.shape[0]
        out[:rows] = seq_out
        lse[:rows] = seq_lse.t().masked_fill(seq_lse.t() == math.inf, -math.inf)
    return out, lse


def reference_merge_states(v_a, lse_a, v_b, lse_b, *, compute_dtype=torch.float64):
    """``tk.merge_attention_states``' specification: two partial attention states over disjoint key sets
    (v ``[N, H, D]``, lse ``[N, H]``, natural log) into the state over their union.

    ``m = max(lse_a, lse_b)``, ``w = exp(lse - m)``: ``v = (w_a v_a + w_b v_b) / (w_a + w_b)``,
    ``lse = m + log(w_a + w_b)``. A state with lse -inf or +inf (no keys: the paged ops write -inf,
    flash_attn_* +inf) has weight 0 (its v is never read); two such states give v 0 and lse -inf. Returns
    v and lse in ``compute_dtype`` (``torch.float32``: PyTorch's fp32 answer, the error-ratio rule's
    denominator once v is cast to the inputs' dtype).
    """
    v_a, v_b = v_a.to(compute_dtype), v_b.to(compute_dtype)
    lse_a, lse_b = (torch.where(lse == math.inf, -math.inf, lse.to(compute_dtype)) for lse in (lse_a, lse_b))
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)                              # [N, H]
    total = w_a + w_b
    part_a = torch.where((w_a > 0).unsqueeze(-1), w_a.unsqueeze(-1) * v_a, torch.zeros_like(v_a))
    part_b = torch.where((w_b > 0).unsqueeze(-1), w_b.unsqueeze(-1) * v_b, torch.zeros_like(v_b))
    nonempty = (total > 0).unsqueeze(-1)
    v = torch.where(nonempty, (part_a + part_b) / torch.where(nonempty, total.unsqueeze(-1), 1.0), 0.0)
    lse = torch.where(total > 0, m + torch.log(total), -math.inf)
    return v, lse
