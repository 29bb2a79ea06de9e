"""``tk.dynamic_quant``, ``tk.smooth_quant`` and ``tk.moe_smooth_quant``: per-row quantisation to int8
or fp8 (CK Tile's 12_smoothquant and 14_moe_smoothquant).

Each row ``z`` (x, or x times a per-column smooth scale) becomes ``row_scale = max|z| / QMAX`` and
``q = z / row_scale``: int8 rounded half to even (QMAX 127), or NVIDIA's float8_e4m3fn (QMAX 448, not
AMD's fnuz 240). These are the forward row kernel of ``tk.norm`` with no norm (``norm/_kernels.py``),
so the quantisation step is the one the fused norms use.
"""

from __future__ import annotations

import torch

from ..norm.norm import as_shape, check_no_grad, check_quant_dtype, check_rows, check_vector, rows_view, run_forward


def _quantise(op, x, smooth_scale, topk_ids, quant_dtype):
    check_quant_dtype(quant_dtype)
    check_no_grad(op, x, smooth_scale)
    _, q, scale, _, _, _ = run_forward(rows_view(x), None, None, None, None,
                                       None if smooth_scale is None else smooth_scale.contiguous(), topk_ids, 0.0,
                                       "none", "dynamic" if smooth_scale is None else "smooth", quant_dtype, False,
                                       False)
    return q, scale


def dynamic_quant(x, quant_dtype=torch.int8):
    """Per-row dynamic quantisation: ``(q, row_scale)``.

    x ``[..., N]`` fp32/fp16/bf16, any strides. q has x's shape and ``quant_dtype`` (torch.int8 or
    torch.float8_e4m3fn); row_scale fp32 ``x.shape[:-1]``, ``max|x| / QMAX`` per row (0 for a row of
    zeros, whose q is 0), so ``q * row_scale[..., None]`` approximates x.

    Example::

        q, scale = tk.dynamic_quant(torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16))
    """
    check_rows("x", x)
    q, scale = _quantise("dynamic_quant", x, None, None, quant_dtype)
    return as_shape(q, x.shape), as_shape(scale, x.shape[:-1])


def smooth_quant(x, smooth_scale, quant_dtype=torch.int8):
    """SmoothQuant: ``dynamic_quant(x * smooth_scale)`` in one pass; smooth_scale ``[N]``, any float dtype.
    Returns ``(q, row_scale)`` as ``dynamic_quant``."""
    check_rows("x", x)
    if smooth_scale is None:
        raise TypeError("smooth_scale must be a torch.Tensor [N], got None")
    check_vector("smooth_scale", smooth_scale, (x.shape[-1],), x)
    q, scale = _quantise("smooth_quant", x, smooth_scale, None, quant_dtype)
    return as_shape(q, x.shape), as_shape(scale, x.shape[:-1])


def moe_smooth_quant(x, smooth_scale, topk_ids, quant_dtype=torch.int8):
    """SmoothQuant of each token once per expert it is routed to: ``(q [k*T, H], row_scale [k*T])``.

    x ``[T, H]`` fp32/fp16/bf16 (any strides); smooth_scale ``[E, H]`` (one row per expert, any float
    dtype); topk_ids ``[T, k]`` int32/int64 expert ids. Row ``r = j * T + t`` (k-major, as CK's
    moe_smoothquant) is ``x[t] * smooth_scale[topk_ids[t, j]]``, quantised as ``dynamic_quant``.

    Expert ids are not range-checked on the host (that would read the device and break CUDA graphs):
    a row whose id is outside ``[0, E)`` gets ``row_scale`` NaN and q 0, which shows downstream.
    """
    check_rows("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if not isinstance(smooth_scale, torch.Tensor):
        raise TypeError(f"smooth_scale must be a torch.Tensor [E, H], got {type(smooth_scale).__name__}")
    if smooth_scale.dim() != 2 or smooth_scale.shape[0] < 1:
        raise ValueError(f"smooth_scale must be [E, H] with E >= 1, got shape {tuple(smooth_scale.shape)}")
    check_vector("smooth_scale", smooth_scale, (smooth_scale.shape[0], x.shape[1]), x, form="[E, H]")
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor [T, k], got {type(topk_ids).__name__}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [T, k] with T = {x.shape[0]} (x's rows), got shape "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.device != x.device:
        raise ValueError(f"topk_ids must be on x's device {x.device}, got {topk_ids.device}")
    return _quantise("moe_smooth_quant", x, smooth_scale, topk_ids, quant_dtype)
