"""``tk.flash_attn_func`` and ``tk.flash_attn_varlen_func``: FlashAttention-2's functions, in Triton.

Reading order: argument checks -> the ops' bodies and the torch.library ops (forward, backward) with fake
implementations -> autograd (the op's, and ``_FlashAttnFunction`` for plain eager calls, which skip the
dispatcher) -> the public functions. Each body launches from a plan cached per call signature
(``_fwd.plan_key``). The kernels are in ``_fwd.py`` (forward, shared score/mask/dropout helpers, configs)
and ``_bwd.py`` (delta, dK/dV, dQ); the fp64 specification is ``reference.py``.

Nothing here reads a device value on the host: varlen sequence bounds stay in ``cu_seqlens`` on the
device, grids come from the host ints ``max_seqlen_*`` (as in FA2), the dropout seed is drawn on the
device, so forward and backward can be captured in one CUDA graph and replayed with other sequence
lengths of the same totals.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._runtime import check_runnable, plain_eager
from . import _bwd, _fwd

MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------------------------------
# argument checks


def check_tensor(name: str, t, dims: int | tuple[int, ...], what: str) -> torch.Tensor:
    """``t`` if it is a tensor of ``dims`` dimensions (an int, or the allowed counts), else TypeError /
    ValueError naming ``name``; the message reads "must be {dims}-D {what}" (int) or "must be {what}"."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in ((dims,) if isinstance(dims, int) else dims):
        form = f"{dims}-D {what}" if isinstance(dims, int) else what
        raise ValueError(f"{name} must be {form}, got shape {tuple(t.shape)}")
    return t


def _check_qkv(q, k, v, varlen: bool) -> None:
    layout = "[total, H, D]" if varlen else "[B, S, H, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 3 if varlen else 4, layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must be float16 or bfloat16 (as FlashAttention), got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    check_runnable(q.device, "q")
    head_dim = q.shape[-1]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (q.shape[-1]) must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(f"q, k and v must have one head dim, got {q.shape[-1]}, {k.shape[-1]}, "
                         f"{v.shape[-1]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"k must have q's batch size {q.shape[0]}, got {k.shape[0]}")
    num_heads, num_kv_heads = q.shape[-2], k.shape[-2]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q's head count ({num_heads}) must be a multiple of k's and v's ({num_kv_heads})")


def _check_options(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, batch: int, num_heads: int,
                   device: torch.device) -> None:
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if softmax_scale is not None and (not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a finite float > 0 or None, got {softmax_scale!r}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints >= -1 (-1: unlimited), got {window_size!r}")
    if not isinstance(softcap, (int, float)) or not softcap >= 0.0 or not math.isfinite(softcap):
        raise ValueError(f"softcap must be a finite float >= 0 (0: off), got {softcap!r}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if alibi_slopes.device != device:
            raise ValueError(f"alibi_slopes must be on q's device {device}, got {alibi_slopes.device}")
        if tuple(alibi_slopes.shape) not in ((num_heads,), (batch, num_heads)):
            raise ValueError(f"alibi_slopes must be [H] = [{num_heads}] or [B, H] = [{batch}, {num_heads}], "
                             f"got {tuple(alibi_slopes.shape)}")


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, device: torch.device, total_q: int,
                      total_k: int) -> None:
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, t, 1, "[B + 1]")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32 (as FlashAttention), got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
        if t.shape[0] < 1:
            raise ValueError(f"{name} must hold B + 1 >= 1 offsets, got none")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (B + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a host int >= 0, got {n!r}")
    if device.type == "cpu" and plain_eager(cu_seqlens_q) and plain_eager(cu_seqlens_k):
        # On the CPU (the interpreter) the offsets are host memory, so they are checked: the kernels trust them, and
        # malformed ones read and write out of bounds. On a GPU checking them would synchronise, and they are trusted
        # as in FlashAttention (README).
        for name, t, total in (("cu_seqlens_q", cu_seqlens_q, total_q), ("cu_seqlens_k", cu_seqlens_k, total_k)):
            bad = torch.cat([t[:1] < 0, t[1:] < t[:-1]]) | (t > total)
            if bool(bad.any()):
                b = int(bad.nonzero()[0, 0])
                raise ValueError(f"{name} must be non-decreasing offsets from >= 0 to at most the {total} packed "
                                 f"rows; {name}[{b}] = {int(t[b])}" + (f" follows {int(t[b - 1])}" if b else ""))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _problem(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
             window_left, window_right, softcap, alibi_slopes, seed_offset) -> _fwd.Problem:
    varlen = cu_seqlens_q is not None
    return _fwd.Problem(
        batch=cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0], num_heads=q.shape[-2],
        num_kv_heads=k.shape[-2], head_dim=q.shape[-1],
        max_seqlen_q=max_seqlen_q if varlen else q.shape[1],
        max_seqlen_k=max_seqlen_k if varlen else k.shape[1],
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, softmax_scale=softmax_scale,
        window_left=window_left, window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes,
        dropout_p=dropout_p, seed_offset=seed_offset)


# ----------------------------------------------------------------------------------------------------
# torch.library ops


def _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, window_left,
              window_right, softcap, alibi_slopes, seed_offset, deterministic=False):
    """The forward op's body, also run directly by plain eager calls (``_attention``)."""
    # ``deterministic`` only travels to the backward (autograd's context keeps the forward's inputs)
    prob = _problem(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    window_left, window_right, softcap, alibi_slopes, seed_offset)
    return _fwd.forward(q, k, v, prob)


def _bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
              softmax_scale, window_left, window_right, softcap, alibi_slopes, seed_offset, deterministic=False):
    """The backward op's body, also run directly by the eager path's autograd (``_FlashAttnFunction``)."""
    prob = _problem(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    window_left, window_right, softcap, alibi_slopes, seed_offset)
    return _bwd.backward(_last_dim_contiguous(dout), q, k, v, out, lse, prob, deterministic)


@torch.library.custom_op("tilekernels::flash_attn_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
            cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
            softmax_scale: float, window_left: int, window_right: int, softcap: float,
            alibi_slopes: Optional[torch.Tensor], seed_offset: Optional[torch.Tensor], deterministic: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                     window_left, window_right, softcap, alibi_slopes, seed_offset, deterministic)


@_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("tilekernels::flash_attn_bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
            max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, window_left: int,
            window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
            seed_offset: Optional[torch.Tensor], deterministic: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                     softmax_scale, window_left, window_right, softcap, alibi_slopes, seed_offset, deterministic)


@_bwd_op.register_fake
def _(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ----------------------------------------------------------------------------------------------------
# autograd (the LSE output carries no gradient, as in FlashAttention)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k = inputs[:5]
    alibi_slopes, seed_offset = inputs[12], inputs[13]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seed_offset)
    ctx.scalars = inputs[5:12]
    ctx.deterministic = inputs[14]


def _grads(ctx, dout, run):
    """The 15 inputs' gradients (dq, dk, dv, then None), the backward done by ``run`` (the op or its body)."""
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seed_offset = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, window_left, window_right, softcap = ctx.scalars
    dq, dk, dv = run(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                     softmax_scale, window_left, window_right, softcap, alibi_slopes, seed_offset, ctx.deterministic)
    return (dq, dk, dv) + (None,) * 12


def _backward(ctx, dout, dlse):
    return _grads(ctx, dout, _bwd_op)


torch.library.register_autograd("tilekernels::flash_attn_fwd", _backward, setup_context=_setup_context)


class _FlashAttnFunction(torch.autograd.Function):
    """The op's autograd for plain eager calls, without the dispatcher: the same forward and backward
    bodies, saved tensors and gradients. It costs the host less than the op's autograd (H100 host,
    benchmarks/NOTES.md): no dispatcher either way, ``forward(ctx, ...)`` rather than ``setup_context``
    (whose ``apply`` re-inspects the signature on every call), lse marked non-differentiable and no zero
    gradient materialised for it, and the engine sees four inputs (the other twelve arguments travel as
    one tuple). torch.compile, fake tensors and tensor subclasses take the op (``plain_eager``). Not twice
    differentiable, as the op."""

    @staticmethod
    def forward(ctx, q, k, v, rest):
        out, lse = _fwd_impl(q, k, v, *rest)
        _setup_context(ctx, (q, k, v, *rest), (out, lse))
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        if dout is None:   # lse carries no gradient; out's may be undefined
            return None, None, None, None
        return _grads(ctx, dout, _bwd_impl)[:3] + (None,)


# ----------------------------------------------------------------------------------------------------
# public


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
               causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs):
    varlen = cu_seqlens_q is not None
    _check_qkv(q, k, v, varlen)
    if varlen:
        _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device, q.shape[0], k.shape[0])
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    _check_options(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, batch, q.shape[-2], q.device)
    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    window_left, window_right = window_size
    if causal:
        window_right = 0
    seed_offset = _fwd.draw_philox_seed(q.device) if dropout_p > 0 else None
    # the kernels index cu_seqlens and alibi_slopes as contiguous (only the slopes' batch stride is passed);
    # the copies are a few bytes, and forward and backward (which saves these) both see them
    if varlen:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    args = (_last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), cu_seqlens_q, cu_seqlens_k,
            int(max_seqlen_q or 0), int(max_seqlen_k or 0), float(dropout_p), float(softmax_scale), int(window_left),
            int(window_right), float(softcap), alibi_slopes, seed_offset, deterministic)
    if not (plain_eager(q) and plain_eager(k) and plain_eager(v)):
        out, lse = _fwd_op(*args)   # torch.compile, fake tensors, subclasses
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _FlashAttnFunction.apply(*args[:3], args[3:])
    else:
        out, lse = _fwd_impl(*args)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Attention over a padded batch, FlashAttention-2's ``flash_attn_func``.

    q ``[B, Sq, H, D]``, k and v ``[B, Sk, H_kv, D]`` (H a multiple of H_kv: GQA/MQA), fp16 or bf16,
    1 <= D <= 256, any strides with the last dim contiguous (others are copied). Returns out
    ``[B, Sq, H, D]``, or ``(out, lse, None)`` with ``return_attn_probs=True``; lse ``[B, H, Sq]`` fp32 is
    the natural-log sum of exp of the scores (``+inf`` for a row that may see no key).

    - ``softmax_scale``: default ``D ** -0.5``. ``softcap > 0``: scores become ``softcap * tanh(s / softcap)``.
    - ``causal``: query i sees keys j <= i + Sk - Sq (bottom-right aligned). ``window_size=(left, right)``:
      keys in ``[i + Sk - Sq - left, i + Sk - Sq + right]``, -1 for unlimited; causal sets right = 0.
    - ``alibi_slopes`` fp32 ``[H]`` or ``[B, H]``: adds ``-slope * |i + Sk - Sq - j|`` to the scores (the
      LSE includes it; FA2's causal kernel adds ``slope * j`` instead, which changes only the LSE).
    - ``dropout_p``: dropout on the attention probabilities, drawn by Philox from a seed that torch's
      generator draws on the device (``torch.manual_seed`` reproduces it).
    - ``deterministic``: ``True`` gives bit-identical gradients run to run (two kernels, no atomics). The
      default ``False`` lets Hopper (fp16/bf16, head dim 128 or 256, or 64 with a causal or windowed mask;
      no softcap, ALiBi or dropout) take one fused kernel that sums dq in fp32 with TMA reduce-adds: dq may
      then differ in the last bits between runs.

    Example::

        q = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, 1024, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out = tk.flash_attn_func(q, k, v, causal=True)      # [2, 1024, 16, 128]
        out.sum().backward()
    """
    return _attention(q, k, v, None, None, None, None, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False):
    """Attention over packed sequences of different lengths, FlashAttention-2's ``flash_attn_varlen_func``.

    q ``[total_q, H, D]``, k and v ``[total_k, H_kv, D]``; sequence b is rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q (int32 ``[B + 1]``, on q's device) and likewise for k. A
    sequence may be empty. ``max_seqlen_q`` / ``max_seqlen_k`` are host ints bounding every length; they
    size the grid and are not checked against ``cu_seqlens`` (that would read the device), so a
    sequence longer than its bound is computed only up to the bound. The offsets themselves are trusted on a GPU,
    as in FlashAttention (malformed ones read and write out of bounds), and checked on the CPU, where reading them
    is free (ValueError). Returns out ``[total_q, H, D]``, or
    ``(out, lse, None)`` with lse ``[H, total_q]``. Rows past the last sequence (a buffer sized for more
    tokens) belong to none: out 0, lse ``+inf``, zero gradients. Options as ``flash_attn_func``; causal and windows
    are aligned per sequence. No host synchronisation in forward or backward: both can be captured in
    one CUDA graph and replayed with other lengths of the same totals.
    """
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
