"""``tk.layer_norm`` / ``tk.rms_norm`` / the quantisation ops' specification in plain PyTorch.

For one row of ``N`` elements (x ``[..., N]``: the rows are the product of the leading dims):

1. The normalised input ``s``. With ``residual`` it is ``x + x_bias + residual`` rounded to x's dtype
   (and returned as the op's second output); without, ``x + x_bias`` kept exact (nothing rounded).
   ``x_bias`` (layer_norm only) is optional.
2. layer_norm: ``mean = sum(s) / N``, ``var = sum((s - mean)^2) / N`` (biased),
   ``y = (s - mean) * rstd * weight + bias`` with ``rstd = 1 / sqrt(var + eps)``.
   rms_norm: ``y = s * rstd * weight`` with ``rstd = 1 / sqrt(sum(s^2) / N + eps)``.
   ``weight`` / ``bias`` None means 1 / 0.
3. Quantisation (``quant="dynamic"|"smooth"``), from the unrounded ``y``: ``z = y * smooth_scale``
   ("smooth") or ``z = y``; ``amax = max|z|`` over the row; ``row_scale = amax / QMAX`` (QMAX 127 for
   int8, 448 for float8_e4m3fn); ``q = z * QMAX / amax``, rounded half to even and clamped to
   [-127, 127] for int8, cast (round to nearest even) for e4m3. A row with ``amax == 0`` has
   ``row_scale = 0`` and ``q = 0``; a row whose ``z`` holds NaN (``moe_smooth_quant``'s rows for an
   expert id outside ``[0, E)``) has ``row_scale = NaN`` and ``q = 0``. Dequantised,
   ``q * row_scale[..., None]`` is about ``z``.

``compute_dtype=torch.float64`` (the default) computes on the CPU in float64: the exact answer, against
which the error-ratio rule of ``tilekernels.testing`` measures the kernels. Its only rounding is the one
the op defines, ``s`` to x's dtype with a residual; that rounding passes gradients straight through
(``ds/dx = 1``) so that autograd through the reference gives the exact gradients of the ops' backward:
pass float64 leaves as x and residual and the op's dtype as ``x_dtype``, which is what s is rounded to.
``compute_dtype=None`` computes PyTorch's own low-precision answer on x's device: the sums in x's dtype
and ``F.layer_norm`` / ``F.rms_norm`` in x's dtype (the rule's denominator). Any other float dtype
computes the same way in that dtype (``torch.float32``: what PyTorch gets in fp32).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..testing import assert_close

QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def _round_through(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``s`` rounded to ``dtype`` (and kept in s's dtype) with the identity as its gradient."""
    if s.dtype == dtype:
        return s
    return s + (s.detach().to(dtype).to(s.dtype) - s.detach())


def _normalised_input(x, residual, x_bias, compute_dtype, x_dtype):
    """Step 1 in ``compute_dtype`` (None: x's dtype), on the CPU for float64 else on x's device; s is
    rounded to ``x_dtype`` (None: x's dtype) when a residual is given."""
    dtype = x.dtype if compute_dtype is None else compute_dtype
    device = torch.device("cpu") if dtype == torch.float64 else x.device

    def conv(t):
        return t.to(device=device, dtype=dtype)

    s = conv(x)
    if x_bias is not None:
        s = s + conv(x_bias)
    if residual is not None:
        s = _round_through(s + conv(residual), x.dtype if x_dtype is None else x_dtype)
    return s, conv


def reference_layer_norm(x, weight, bias, eps, residual=None, x_bias=None, compute_dtype=torch.float64, *,
                         x_dtype=None):
    """``tk.layer_norm(x, weight, bias, eps, residual=residual, x_bias=x_bias)`` -> ``(y, s)``.

    x ``[..., N]``; weight, bias, x_bias ``[N]`` or None; residual like x or None. ``y`` has x's shape,
    in float64 (exact) or in ``compute_dtype`` / x's dtype; ``s`` is the normalised input of step 1 in
    the same dtype (its values rounded to ``x_dtype``, default x's dtype, when residual is given).
    Differentiable in every tensor argument.
    """
    s, conv = _normalised_input(x, residual, x_bias, compute_dtype, x_dtype)
    w = None if weight is None else conv(weight)
    b = None if bias is None else conv(bias)
    if s.dtype != torch.float64:
        return F.layer_norm(s, (s.shape[-1],), w, b, eps), s
    mean = s.mean(dim=-1, keepdim=True)
    var = (s - mean).square().mean(dim=-1, keepdim=True)
    y = (s - mean) * torch.rsqrt(var + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y, s


def reference_rms_norm(x, weight, eps, residual=None, compute_dtype=torch.float64, *, x_dtype=None):
    """``tk.rms_norm(x, weight, eps, residual=residual)`` -> ``(y, s)``, as ``reference_layer_norm``."""
    s, conv = _normalised_input(x, residual, None, compute_dtype, x_dtype)
    w = None if weight is None else conv(weight)
    if s.dtype != torch.float64:
        return F.rms_norm(s, (s.shape[-1],), w, eps), s
    y = s * torch.rsqrt(s.square().mean(dim=-1, keepdim=True) + eps)
    if w is not None:
        y = y * w
    return y, s


def reference_quant(z, quant_dtype):
    """Step 3 on rows ``z [..., N]`` (computed in float64 on the CPU) -> ``(q, row_scale)``: q of z's
    shape in ``quant_dtype``, row_scale ``z.shape[:-1]`` in float64 (exact, uncast)."""
    if quant_dtype not in QUANT_MAX:
        raise TypeError(f"quant_dtype must be torch.int8 or torch.float8_e4m3fn, got {quant_dtype}")
    qmax = QUANT_MAX[quant_dtype]
    q, amax = _scaled_rows(z, qmax)
    if quant_dtype == torch.int8:
        q = q.round().clamp(-qmax, qmax)
    return q.to(quant_dtype), (amax / qmax).squeeze(-1)


def _scaled_rows(z, qmax):
    """``(z * qmax / amax, amax)`` of rows ``z`` in float64 on the CPU, 0 where a row's amax is 0 or not
    finite; amax keeps its last dim (size 1)."""
    z = z.detach().to(device="cpu", dtype=torch.float64)
    amax = z.abs().amax(dim=-1, keepdim=True)
    usable = (amax > 0) & amax.isfinite()
    return torch.where(usable, z * (qmax / torch.where(usable, amax, 1.0)), 0.0), amax


def reference_moe_rows(x, smooth_scale, topk_ids):
    """``moe_smooth_quant``'s rows before quantisation, float64 ``[k*T, H]``: row ``j*T + t`` is
    ``x[t] * smooth_scale[topk_ids[t, j]]`` (k-major), all NaN where the expert id is outside
    ``[0, E)``."""
    x = x.detach().to(device="cpu", dtype=torch.float64)
    smooth_scale = smooth_scale.detach().to(device="cpu", dtype=torch.float64)
    ids = topk_ids.detach().to(device="cpu", dtype=torch.int64).t().reshape(-1)      # [k*T], k-major
    experts = smooth_scale.shape[0]
    valid = (ids >= 0) & (ids < experts)
    scales = torch.where(valid[:, None], smooth_scale[ids.clamp(0, experts - 1)], float("nan"))
    return x.repeat(topk_ids.shape[1], 1) * scales


def quant_steps(q, z, quant_dtype):
    """How far each element of ``q`` is from its exact value ``z * QMAX / amax`` (0 where the row's amax
    is 0 or NaN), in quantisation steps at that magnitude: 1 for int8; e4m3's spacing for
    float8_e4m3fn (``2^(e - 3)`` in ``[2^e, 2^(e+1))``, ``2^-9`` below ``2^-6``). Correct rounding is
    within 0.5 everywhere; a NaN in q counts as infinitely far. Float64 on the CPU, z's shape."""
    exact, _ = _scaled_rows(z, QUANT_MAX[quant_dtype])
    if quant_dtype == torch.int8:
        step = torch.ones_like(exact)
    else:
        step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2.0 ** -6))) - 3)
    steps = (q.detach().to(device="cpu", dtype=torch.float64) - exact).abs() / step
    return torch.nan_to_num(steps, nan=math.inf)


def assert_quant_close(name, q, row_scale, z, torch_z, quant_dtype, *, ratio=2.0, max_mismatch=0.002):
    """The rule for a quantised output ``(q, row_scale)`` of rows ``z`` (the float64 reference's):

    - q has z's shape and ``quant_dtype``; row_scale is float32 of ``z.shape[:-1]``;
    - every element of q is within one step of ``z * QMAX / amax`` (``quant_steps``: correct rounding
      is within 0.5, fp32 arithmetic may tip a near-tie over);
    - q equals ``reference_quant(z)`` on all but ``max_mismatch`` of the elements (fp32 arithmetic
      misses on about 0.01%; quantising y after rounding it to bf16 misses on 1-3%);
    - row_scale meets ``tilekernels.testing``'s error-ratio rule against ``amax / QMAX`` of
      ``torch_z``, PyTorch's fp32 z, with NaN parity (NaN rows of moe_smooth_quant); its floor is 4 fp32
      epsilons of the largest scale, the handful of fp32 roundings (row sum, rsqrt, products, the
      division) a kernel's scale goes through where PyTorch's cascade sums may be nearly exact.

    Raises ``AssertionError`` naming the worst element.
    """
    shape = tuple(z.shape)
    assert tuple(q.shape) == shape, f"{name}: q shape {tuple(q.shape)} != {shape}"
    assert q.dtype == quant_dtype, f"{name}: q dtype {q.dtype} != {quant_dtype}"
    assert tuple(row_scale.shape) == shape[:-1], \
        f"{name}: row_scale shape {tuple(row_scale.shape)} != {shape[:-1]}"
    assert row_scale.dtype == torch.float32, f"{name}: row_scale dtype {row_scale.dtype} != torch.float32"
    q_ref, scale_ref = reference_quant(z, quant_dtype)
    steps = quant_steps(q, z, quant_dtype)
    if steps.numel() and float(steps.max()) > 1.0:
        worst = tuple(int(i) for i in torch.unravel_index(steps.argmax(), steps.shape))
        raise AssertionError(f"{name}: q is {float(steps.max()):.3g} steps from z * QMAX / amax at {worst} "
                             f"(q {q.cpu()[worst].float().item()}, exact quantisation "
                             f"{q_ref[worst].float().item()})")
    mismatched = int((q.cpu().float() != q_ref.float()).sum())
    allowed = int(q.numel() * max_mismatch)
    assert mismatched <= allowed, (f"{name}: {mismatched} of {q.numel()} elements of q differ from the exact "
                                   f"quantisation (at most {allowed} may)")
    torch_scale = torch_z.detach().float().abs().amax(dim=-1) / QUANT_MAX[quant_dtype]
    finite = scale_ref[scale_ref.isfinite()]
    atol = 4 * torch.finfo(torch.float32).eps * (float(finite.abs().max()) if finite.numel() else 0.0) + 1e-45
    assert_close(f"{name} row_scale", row_scale, scale_ref, torch_scale, ratio=ratio, atol=atol)
