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
"""

from __future__ import annotations

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
