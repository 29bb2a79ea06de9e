"""``tk.gemm``: persistent GEMM with a fused epilogue, as a PyTorch op.

Reading order: argument checks -> launch (config, split-K, TMA descriptors, grid) -> torch.library
custom ops (functional ``tilekernels::gemm`` and out-variant ``tilekernels::gemm_out``) with fake
implementations -> autograd -> the public function.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence

import torch

from .._runtime import cdiv, check_runnable, fp32_precision, is_interpreter, sm_count, supports_tensor_descriptors
from . import _kernels
from .configs import GemmConfig, auto_split_k, select_config

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
FLOAT_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_AUTO_SPLIT = 0  # split_k="auto" travels through the custom op as 0

# ----------------------------------------------------------------------------------------------------
# argument checks


def _default_out_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in FLOAT_OUT_DTYPES else torch.bfloat16


def _check_operand(name: str, t, M: int, N: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but a is on {device}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.dim() > 2:
        raise ValueError(f"{name} must broadcast to [M, N] = [{M}, {N}], got shape {tuple(t.shape)}")
    try:
        shape = torch.broadcast_shapes(tuple(t.shape), (M, N))
    except RuntimeError:
        shape = None
    if shape != (M, N):
        raise ValueError(f"{name} must broadcast to [M, N] = [{M}, {N}], got shape {tuple(t.shape)}")


def _check_scale(name: str, s, length: int, dim_name: str, device: torch.device) -> None:
    if s is None or isinstance(s, numbers.Real) and not isinstance(s, bool):
        return
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be None, a number or a tensor, got {type(s).__name__}")
    if s.device != device:
        raise ValueError(f"{name} is on {s.device} but a is on {device}")
    if not s.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {s.dtype}")
    # a single element, or `length` of them along one dimension ([M], [M, 1] and [1, M] for scale_a)
    if s.numel() != 1 and (s.numel() != length or max(s.shape) != length):
        raise ValueError(f"{name} must be a scalar or have {length} elements ([{dim_name}]), "
                         f"got shape {tuple(s.shape)}")


def _check_args(a, b, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, out_dtype, out,
                split_k, config):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a and b: K mismatch, a is {tuple(a.shape)} (K={a.shape[1]}) and b is "
                         f"{tuple(b.shape)} (K={b.shape[0]})")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got a {a.dtype} and b {b.dtype}")
    if a.dtype not in INPUT_DTYPES:
        raise TypeError(f"a and b: unsupported dtype {a.dtype}; supported: "
                        f"{', '.join(str(d) for d in INPUT_DTYPES)}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got a on {a.device} and b on {b.device}")
    check_runnable(a.device, "a")
    M, N = a.shape[0], b.shape[1]
    if bias is not None:
        _check_operand("bias", bias, M, N, a.device)
    if residual is not None:
        _check_operand("residual", residual, M, N, a.device)
    if isinstance(mul, torch.Tensor) or not isinstance(mul, (list, tuple)):
        raise TypeError(f"mul must be a tuple or list of tensors, got {type(mul).__name__}")
    if len(mul) > 2:
        raise ValueError(f"mul takes at most 2 tensors, got {len(mul)}")
    for i, m in enumerate(mul):
        _check_operand(f"mul[{i}]", m, M, N, a.device)
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS} or None, got {activation!r}")
    for name, v in (("alpha", alpha), ("beta", beta)):
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    _check_scale("scale_a", scale_a, M, "M", a.device)
    _check_scale("scale_b", scale_b, N, "N", a.device)
    if out_dtype is not None:
        if not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"out_dtype must be a torch.dtype, got {type(out_dtype).__name__}")
        allowed = FLOAT_OUT_DTYPES + ((torch.int32,) if a.dtype == torch.int8 else ())
        if out_dtype not in allowed:
            raise TypeError(f"out_dtype must be one of {', '.join(str(d) for d in allowed)} for "
                            f"{a.dtype} inputs, got {out_dtype}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != (M, N):
            raise ValueError(f"out must have shape [M, N] = [{M}, {N}], got {tuple(out.shape)}")
        if out.device != a.device:
            raise ValueError(f"out is on {out.device} but a is on {a.device}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
        allowed = FLOAT_OUT_DTYPES + ((torch.int32,) if a.dtype == torch.int8 else ())
        if out.dtype not in allowed:
            raise TypeError(f"out: unsupported dtype {out.dtype} for {a.dtype} inputs")
        if any(st == 0 and sz > 1 for st, sz in zip(out.stride(), out.shape)):
            raise ValueError("out must not have overlapping elements (a stride of 0)")
    final_dtype = out.dtype if out is not None else (out_dtype or _default_out_dtype(a.dtype))
    if final_dtype == torch.int32 and (bias is not None or residual is not None or mul or activation
                                       or alpha != 1.0 or scale_a is not None or scale_b is not None):
        raise ValueError("out_dtype torch.int32 (exact int8 GEMM) takes no epilogue; ask for a float "
                         "out_dtype to use bias, residual, mul, activation, alpha or scales")
    if not (split_k == "auto" or isinstance(split_k, int) and not isinstance(split_k, bool) and split_k >= 1):
        raise ValueError(f"split_k must be a positive int or 'auto', got {split_k!r}")
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a tilekernels GemmConfig, got {type(config).__name__}")


# ----------------------------------------------------------------------------------------------------
# launch


def _tma_view(t: torch.Tensor):
    """(tensor whose last stride is 1, transposed?) if ``t`` can be read by TMA, else None."""
    es = t.element_size()
    if t.data_ptr() % 16:
        return None
    if t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0:
        return t, False
    if t.stride(0) == 1 and (t.stride(1) * es) % 16 == 0:
        return t.t(), True
    return None


def _descriptor(view: torch.Tensor, block_shape):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(view, list(view.shape), list(view.stride()), list(block_shape))


def _as_mn(t: torch.Tensor | None, M: int, N: int):
    """(tensor viewed as [M, N] with broadcast strides, stride_m, stride_n), or (None, 0, 0)."""
    if t is None:
        return None, 0, 0
    v = torch.broadcast_to(t, (M, N))
    return v, v.stride(0), v.stride(1)


def _as_vec(s: torch.Tensor | None, length: int):
    if s is None:
        return None, 0
    v = torch.broadcast_to(s.reshape(-1), (length,)) if s.numel() == 1 else s.reshape(length)
    return v, v.stride(0)


def _launch(a, b, c, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k) -> None:
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return
    cfg = select_config(M, N, K, a.dtype, a.device)
    if split_k == _AUTO_SPLIT:
        split_k = auto_split_k(M, N, K, cfg, a.device)
    k_per_split = cdiv(cdiv(K, split_k), cfg.block_k) * cfg.block_k if K else cfg.block_k
    split_k = max(1, cdiv(K, k_per_split))

    # TMA: Hopper, or the interpreter when an override asks for it (so the path is tested on CPU);
    # both operands must be 16-byte aligned with one unit stride.
    use_tma = cfg.use_tma and (supports_tensor_descriptors(a.device) or is_interpreter())
    a_arg, b_arg, a_trans, b_trans = a, b, False, False
    if use_tma:
        a_view, b_view = _tma_view(a), _tma_view(b)
        use_tma = a_view is not None and b_view is not None
    if use_tma:
        (a_base, a_trans), (b_base, b_trans) = a_view, b_view
        a_arg = _descriptor(a_base, (cfg.block_k, cfg.block_m) if a_trans else (cfg.block_m, cfg.block_k))
        b_arg = _descriptor(b_base, (cfg.block_n, cfg.block_k) if b_trans else (cfg.block_k, cfg.block_n))

    acc_int = a.dtype == torch.int8
    partials = None
    if split_k > 1:
        partials = torch.empty((split_k, M, N), dtype=torch.int32 if acc_int else torch.float32, device=a.device)

    bias_v, sbm, sbn = _as_mn(bias, M, N)
    res_v, srm, srn = _as_mn(residual, M, N)
    mul0, sm0m, sm0n = _as_mn(mul[0] if len(mul) > 0 else None, M, N)
    mul1, sm1m, sm1n = _as_mn(mul[1] if len(mul) > 1 else None, M, N)
    sa_v, ssa = _as_vec(scale_a, M)
    sb_v, ssb = _as_vec(scale_b, N)
    epilogue_args = (alpha, beta, sa_v, ssa, sb_v, ssb, bias_v, sbm, sbn, mul0, sm0m, sm0n, mul1, sm1m, sm1n,
                     res_v, srm, srn)
    epilogue_flags = dict(
        HAS_ALPHA=alpha != 1.0, HAS_SCALE_A=scale_a is not None, HAS_SCALE_B=scale_b is not None,
        HAS_BIAS=bias is not None, BIAS_IS_ROW=bias is not None and sbm == 0,
        ACTIVATION=activation or "none", NUM_MUL=len(mul), HAS_RESIDUAL=residual is not None,
        OUT_IS_INT=c.dtype == torch.int32,
    )

    precision = fp32_precision()
    heavy_epilogue = bias is not None or residual is not None or bool(mul) or activation is not None
    num_tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n) * split_k
    num_programs = max(1, min(num_tiles, sm_count(a.device) * cfg.programs_per_sm))
    _kernels.gemm_kernel[(num_programs,)](
        a_arg, b_arg, c, partials,
        M, N, K, k_per_split, num_programs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        *epilogue_args,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SPLIT_K=split_k,
        USE_TMA=use_tma, A_TRANS=a_trans, B_TRANS=b_trans, EVEN_K=K % cfg.block_k == 0,
        ACC_INT=acc_int, FP32_PRECISION=precision, COMPENSATED=a.dtype == torch.float32 and precision == "ieee",
        FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize,
        EPILOGUE_SUBTILE=heavy_epilogue and cfg.block_n >= 32 and split_k == 1,
        **epilogue_flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split_k > 1:
        block_m, block_n = 32, 128
        _kernels.splitk_reduce_kernel[(cdiv(M, block_m) * cdiv(N, block_n),)](
            partials, c, M, N, c.stride(0), c.stride(1), *epilogue_args,
            SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n, **epilogue_flags, num_warps=4,
        )


# ----------------------------------------------------------------------------------------------------
# torch.library ops: the functional op and the out= variant, each with a fake implementation


@torch.library.custom_op("tilekernels::gemm", mutates_args=())
def _gemm_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
             mul: list[torch.Tensor], activation: Optional[str], alpha: float, beta: float,
             scale_a: Optional[torch.Tensor], scale_b: Optional[torch.Tensor], out_dtype: torch.dtype,
             split_k: int) -> torch.Tensor:
    c = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    _launch(a, b, c, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k)
    return c


@_gemm_op.register_fake
def _(a, b, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, out_dtype, split_k):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("tilekernels::gemm_out", mutates_args=("out",))
def _gemm_out_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                 mul: list[torch.Tensor], activation: Optional[str], alpha: float, beta: float,
                 scale_a: Optional[torch.Tensor], scale_b: Optional[torch.Tensor], split_k: int,
                 out: torch.Tensor) -> None:
    _launch(a, b, out, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k)


@_gemm_out_op.register_fake
def _(a, b, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k, out):
    return None


# ----------------------------------------------------------------------------------------------------
# autograd: d(alpha * a @ b + bias + beta * residual); other epilogues are forward-only


def _sum_to(grad: torch.Tensor, shape) -> torch.Tensor:
    """Reduce a broadcast gradient back to ``shape`` (bias [N] -> sum over rows, and so on)."""
    while grad.dim() > len(shape):
        grad = grad.sum(0)
    for dim, size in enumerate(shape):
        if size == 1 and grad.shape[dim] != 1:
            grad = grad.sum(dim, keepdim=True)
    return grad


def _setup_context(ctx, inputs, output):
    a, b, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, out_dtype, split_k = inputs
    ctx.save_for_backward(a, b)
    ctx.alpha, ctx.beta = alpha, beta
    ctx.num_mul = len(mul)
    ctx.bias_shape = None if bias is None else (tuple(bias.shape), bias.dtype)
    ctx.residual_shape = None if residual is None else (tuple(residual.shape), residual.dtype)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_in = grad.to(a.dtype)
    grad_a = grad_b = grad_bias = grad_residual = None
    if ctx.needs_input_grad[0]:
        grad_a = gemm(grad_in, b.t(), alpha=ctx.alpha, out_dtype=a.dtype)  # [M, N] @ [N, K]
    if ctx.needs_input_grad[1]:
        grad_b = gemm(a.t(), grad_in, alpha=ctx.alpha, out_dtype=b.dtype)  # [K, M] @ [M, N]
    if ctx.bias_shape is not None and ctx.needs_input_grad[2]:
        shape, dtype = ctx.bias_shape
        grad_bias = _sum_to(grad.float(), shape).to(dtype)
    if ctx.residual_shape is not None and ctx.needs_input_grad[3]:
        shape, dtype = ctx.residual_shape
        grad_residual = _sum_to(grad.float() * ctx.beta, shape).to(dtype)
    return (grad_a, grad_b, grad_bias, grad_residual, [None] * ctx.num_mul, None, None, None, None, None, None,
            None)


torch.library.register_autograd("tilekernels::gemm", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------
# public


def gemm(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, mul: Sequence[torch.Tensor] = (), activation: str | None = None,
         alpha: float = 1.0, beta: float = 1.0, scale_a=None, scale_b=None, out_dtype: torch.dtype | None = None,
         out: torch.Tensor | None = None, split_k: int | str = 1, config: GemmConfig | None = None) -> torch.Tensor:
    """``epilogue(a @ b)`` in one persistent kernel.

    Args:
        a: ``[M, K]``, row- or column-major (a transposed view works without a copy).
        b: ``[K, N]``, row- or column-major. Same dtype as ``a``: fp16, bf16, fp32, fp8 e4m3fn/e5m2,
            or int8. fp32 follows ``torch.get_float32_matmul_precision()`` as torch.matmul does:
            "highest" (the default) computes in fp32 FMA, "high"/"medium" on tf32 tensor cores.
        bias: broadcastable to ``[M, N]`` (typically ``[N]``), added after scaling.
        residual: broadcastable to ``[M, N]``, added last as ``beta * residual``.
        mul: up to two tensors broadcastable to ``[M, N]``, multiplied in after the activation
            (CK's multi-D epilogue; e.g. the up-projection in a gated MLP).
        activation: None, "relu", "gelu", "gelu_tanh" or "silu".
        alpha, beta: scalars. ``scale_a`` (a number, or ``[M]``) and ``scale_b`` (a number, or ``[N]``)
            are the per-row / per-column dequantisation scales for fp8/int8 inputs.
        out_dtype: fp16/bf16/fp32 (int32 for an exact int8 product with no epilogue). Default: the
            input dtype, bf16 for fp8/int8 inputs.
        out: write the result here (any strides, shape ``[M, N]``) and return it.
        split_k: split the K loop over this many programs (or "auto": only when the output tiles
            cannot fill the GPU and K is long); partial sums are added in a fixed order, so the
            result is bit-identical run to run.
        config: a ``GemmConfig`` overriding the launch heuristic (tests, tuning).

    Epilogue order: ``acc*alpha*scale_a*scale_b + bias -> activation -> * mul... -> + beta*residual
    -> cast``, all in fp32. Autograd covers ``alpha * a @ b + bias + beta * residual``; with an
    activation, ``mul`` or scales the op is forward-only.

    Example:
        >>> y = tk.gemm(x, w.t(), bias=b, activation="gelu", residual=x_res)   # [M, N]
    """
    _check_args(a, b, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, out_dtype, out,
                split_k, config)
    mul = list(mul)
    alpha = float(alpha)
    if isinstance(scale_a, numbers.Real):
        alpha, scale_a = alpha * float(scale_a), None
    if isinstance(scale_b, numbers.Real):
        alpha, scale_b = alpha * float(scale_b), None
    split = _AUTO_SPLIT if split_k == "auto" else split_k
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (a, b, bias, residual, scale_a, scale_b, *mul))
    if needs_grad and (activation is not None or mul or scale_a is not None or scale_b is not None):
        raise NotImplementedError("tk.gemm autograd covers alpha * a @ b + bias + beta * residual; "
                                  "activation, mul and scales are forward-only")
    if config is not None:
        from .configs import override_config

        with override_config(config):
            return gemm(a, b, bias=bias, residual=residual, mul=mul, activation=activation, alpha=alpha,
                        beta=beta, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, out=out,
                        split_k=split_k)
    if not needs_grad and type(a) is torch.Tensor and not torch.compiler.is_compiling():
        # Eager fast path: the same launch the custom op makes, minus ~45 us of dispatcher overhead
        # per call (measured on an H100), which is as long as a whole skinny GEMM.
        c = out if out is not None else torch.empty((a.shape[0], b.shape[1]), device=a.device,
                                                    dtype=out_dtype or _default_out_dtype(a.dtype))
        _launch(a, b, c, bias, residual, mul, activation, alpha, float(beta), scale_a, scale_b, split)
        return c
    if out is not None:
        torch.ops.tilekernels.gemm_out(a, b, bias, residual, mul, activation, alpha, float(beta), scale_a,
                                       scale_b, split, out)
        return out
    return torch.ops.tilekernels.gemm(a, b, bias, residual, mul, activation, alpha, float(beta), scale_a,
                                      scale_b, out_dtype or _default_out_dtype(a.dtype), split)
