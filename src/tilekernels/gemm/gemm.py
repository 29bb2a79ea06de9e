"""``tk.gemm``: persistent GEMM with a fused epilogue, as a PyTorch op.

Reading order: argument checks -> launch (config, split-K, TMA descriptors, grid) -> torch.library
custom ops (functional ``tilekernels::gemm`` and out-variant ``tilekernels::gemm_out``) with fake
implementations -> autograd -> the public function.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Optional, Sequence

import torch

from .._runtime import (CachedLaunch, cache_put, capability, cdiv, check_errors, check_no_self_overlap, check_out_memory,
                        check_runnable, descriptor_template, ensure_cuda_context, error_table, fp32_precision,
                        is_interpreter, on_current_device, plain_eager, rebase, sm_count, supports_tensor_descriptors,
                        tensor_key)
from . import _gluon, _kernels
from .configs import GemmConfig, RowTail, active_override, auto_split_k, select_config, select_plan
from .scheduler import AsyncInputScheduler

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
    # broadcasting's rule on the shape tuple itself: torch.broadcast_shapes goes through torch's symbolic-shape
    # guards, ~10-20 us a call on the host, which was most of an eager GEMM's host time with bias and residual
    shape = t.shape
    if len(shape) > 2 or any(d != 1 and d != full for d, full in zip(reversed(shape), (N, M))):
        raise ValueError(f"{name} must broadcast to [M, N] = [{M}, {N}], got shape {tuple(shape)}")


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


def _check_out_memory(out: torch.Tensor, a, b, bias, residual, mul, scale_a, scale_b) -> None:
    """``out`` (already checked not to overlap itself) must not overlap any input: the kernel reads inputs
    after other tiles have written C. The one exception is ``out`` exactly ``residual`` (same elements), which
    each element reads before it is written."""
    inputs = {"a": a, "b": b, "bias": bias, "residual": residual, "scale_a": scale_a, "scale_b": scale_b,
              **{f"mul[{i}]": m for i, m in enumerate(mul)}}
    if residual is not None and residual.data_ptr() == out.data_ptr() and residual.dtype == out.dtype and (
            residual.shape == out.shape and residual.stride() == out.stride()):
        inputs = {k: v for k, v in inputs.items() if k != "residual"}
    check_out_memory(out, inputs, "pass an out that shares no memory with the inputs (out=residual itself is "
                     "allowed)")


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
        if type(v) is float:   # the common case, without numbers.Real's ABC check (host time: see gemm())
            continue
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
        try:
            float(v)
        except OverflowError:
            raise ValueError(f"{name} is too large for a float: {v!r}") from None
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
        check_no_self_overlap("out", out)
        if not torch.compiler.is_compiling():   # traced tensors have no addresses; the op checks when it runs
            _check_out_memory(out, a, b, bias, residual, mul, scale_a, scale_b)
    final_dtype = out.dtype if out is not None else (out_dtype or _default_out_dtype(a.dtype))
    if final_dtype == torch.int32 and (bias is not None or residual is not None or mul or activation
                                       or alpha != 1.0 or scale_a is not None or scale_b is not None):
        raise ValueError("out_dtype torch.int32 (exact int8 GEMM) takes no epilogue; ask for a float "
                         "out_dtype to use bias, residual, mul, activation, alpha or scales")
    if not (split_k == "auto" or isinstance(split_k, int) and not isinstance(split_k, bool) and split_k >= 1):
        raise ValueError(f"split_k must be a positive int or 'auto', got {split_k!r}")
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a tilekernels GemmConfig, got {type(config).__name__}")


def _check_async_input(async_input, a: torch.Tensor) -> None:
    if async_input is None:
        return
    if not isinstance(async_input, AsyncInputScheduler):
        raise TypeError(f"async_input must be a tk.AsyncInputScheduler, got {type(async_input).__name__}")
    signals = async_input.chunk_signals
    if signals.device != a.device:
        raise ValueError(f"async_input: chunk_signals is on {signals.device} but a is on {a.device}")
    M = a.shape[0]
    if cdiv(M, async_input.rows_per_chunk) != async_input.num_chunks:
        raise ValueError(f"async_input: A's {M} rows in chunks of {async_input.rows_per_chunk} make "
                         f"{cdiv(M, async_input.rows_per_chunk)} chunks, but chunk_signals has "
                         f"{async_input.num_chunks} elements")


# ----------------------------------------------------------------------------------------------------
# launch


def _tma_view(t: torch.Tensor):
    """(tensor whose last stride is 1, transposed?) if ``t`` can be read by TMA, else None."""
    es = t.element_size()
    if t.data_ptr() % 16 or 0 in t.shape:
        return None
    if t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0:
        return t, False
    if t.stride(0) == 1 and (t.stride(1) * es) % 16 == 0:
        return t.t(), True
    return None


def _stride_div(stride: int) -> int:
    """The largest power of two up to 16 that divides ``stride`` (1 for 0 and 1): the pointer path's alignment
    hint for that stride or K bound (``_runtime.known_multiple``)."""
    return 1 if stride <= 1 else min(16, stride & -stride)


def _pointer_hints(a: torch.Tensor, b: torch.Tensor, K: int, k_per_split: int, use_tma: bool) -> dict:
    """The pointer path's alignment hints (``DIV_*``; all 1 with TMA operands, so those launches do not compile
    apart by their strides' low bits)."""
    if use_tma:
        return dict(DIV_AM=1, DIV_AK=1, DIV_BK=1, DIV_BN=1, DIV_K=1)
    return dict(DIV_AM=_stride_div(a.stride(0)), DIV_AK=_stride_div(a.stride(1)), DIV_BK=_stride_div(b.stride(0)),
                DIV_BN=_stride_div(b.stride(1)), DIV_K=_stride_div(math.gcd(K, k_per_split)))


def _descriptor(view: torch.Tensor, block_shape):
    """A validated descriptor template for ``view``'s shape, strides and alignment (``rebase`` puts each
    call's tensor under it)."""
    return descriptor_template(view, view.shape, view.stride(), block_shape)


def _bcast_strides(t: torch.Tensor | None, M: int, N: int) -> tuple[int, int]:
    """Strides of ``t`` broadcast to [M, N] (0 along broadcast dimensions); (0, 0) for None."""
    if t is None:
        return 0, 0
    v = torch.broadcast_to(t, (M, N))
    return v.stride(0), v.stride(1)


def _vec_stride(s: torch.Tensor | None) -> int:
    """Stride between consecutive elements of a scale that is one element or a [length] vector in
    any of its [length], [length, 1], [1, length] shapes (a single element is broadcast: stride 0)."""
    if s is None or s.numel() == 1:
        return 0
    return s.reshape(-1).stride(0)


class _Plan:
    """Everything about one GEMM launch that depends only on its signature (shapes, strides, dtypes,
    alignments, epilogue shape, config): computed once, then reused by every call with that signature.

    ``kernel`` is the ``CachedLaunch`` of ``gemm_kernel``: after the first call has compiled it (GPU
    only) it launches through the compiled kernel's launcher directly; under the interpreter, and until
    then, calls go through Triton.
    """

    __slots__ = ("cfg", "split_k", "use_tma", "a_trans", "b_trans", "a_desc", "b_desc", "c_desc", "res_desc",
                 "num_programs", "ints", "epilogue_strides", "async_ints", "epilogue_flags", "acc_int", "kernel",
                 "local_desc", "local_ints", "tail", "tail_span", "reduce", "gluon")


_PLANS: dict[tuple, _Plan] = {}
# Shared memory a launch may plan for its pipeline plus the epilogue's TMA staging (H100/H200: 227 KiB
# per block, less what the compiler adds for barriers and layout conversions).
_SMEM_BUDGET = 216 * 1024
_MAX_PLANS = 1024  # distinct call signatures kept; the oldest is dropped past this


def _async_key(async_input):
    # signal_value and max_spins are not specialised (do_not_specialize); only their integer width is.
    if async_input is None:
        return None
    signals, rows_per_chunk, pivot_chunk, signal_value = async_input[:4]
    local = tensor_key(_local_rows(async_input))
    if isinstance(signal_value, torch.Tensor):
        return tensor_key(signals), rows_per_chunk, pivot_chunk, "device", local
    return tensor_key(signals), rows_per_chunk, pivot_chunk, -2**31 <= signal_value < 2**31, local


def _local_rows(async_input):
    """The pivot chunk's rows as a tensor of their own (``_async_gemm_into``'s ``a_local``), or None."""
    return async_input[6] if async_input is not None and len(async_input) > 6 else None


def _plan_key(a, b, c, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k, async_input):
    return (_async_key(async_input), a.device, a.dtype, a.shape, a.stride(), a.data_ptr() % 16 == 0, b.shape[1],
            b.stride(), b.data_ptr() % 16 == 0, c.dtype, c.stride(), c.data_ptr() % 16 == 0, tensor_key(bias),
            tensor_key(residual), tuple(tensor_key(m) for m in mul), tensor_key(scale_a), tensor_key(scale_b),
            activation, alpha != 1.0, beta != 1.0, split_k, active_override(),
            fp32_precision() if a.dtype == torch.float32 else None)


# Hopper launches of the large tile go to the Gluon kernel (``_gluon``) where it computes the call: its main loop
# ran 0.8-2.5% faster (medians) than gemm_kernel's on the large anchor shapes (H100, bf16, CUDA graphs, 2026-12-07; RR
# 8192^3 696 against 679 TFLOP/s, cuBLAS 669; benchmarks/NOTES.md). TILEKERNELS_GEMM_GLUON=0 keeps every launch
# on gemm_kernel (read when a plan is made).
def _gluon_takes(a, b, c, bias, residual, mul, activation, alpha, scale_a, scale_b, split_k, async_input, trace,
                 cfg) -> bool:
    """Whether the Gluon kernel takes this launch: Hopper, no trace, split-K or config override, the large 128x256x64
    tile chosen, and operands it reads (``_gluon.applies``). Async input only as tk.async_input_mm and
    ``tk.gemm(async_input=...)`` give it (an integer ``signal_value``); tk.dist's launches (their own error table,
    the pivot chunk's rows from a tensor of their own, a device epoch) stay on gemm_kernel."""
    if async_input is not None and (len(async_input) != 5 or isinstance(async_input[3], torch.Tensor)):
        return False
    if (trace is not None or split_k != 1 or active_override() is not None
            or (cfg.block_m, cfg.block_n, cfg.block_k) != (128, 256, 64) or not a.is_cuda or is_interpreter()
            or os.environ.get("TILEKERNELS_GEMM_GLUON", "1") == "0" or capability(a.device) != (9, 0)):
        return False
    return _gluon.applies(a, b, c, bias, residual, mul, activation, alpha, scale_a, scale_b)


def _make_plan(a, b, c, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k, async_input,
               trace=None, cfg=None, wait_row0=0) -> _Plan:
    """``cfg``: the config to take as it is (a row tail's launch, ``_tail_call``); None picks one, and may split
    the rows into a main launch and a tail (``configs.select_plan``). ``wait_row0``: where A's row 0 sits in the
    rows the async-input signals count (an async row tail's launch on a row view)."""
    M, K = a.shape
    N = b.shape[1]
    heavy_epilogue = bias is not None or residual is not None or bool(mul) or activation is not None
    chosen = cfg is None   # the launch is ours to plan (not a row tail's given config)
    tail = None
    if cfg is None and async_input is None and trace is None and split_k in (1, _AUTO_SPLIT):
        cfg, tail = select_plan(M, N, K, a.dtype, a.device, heavy_epilogue)
    elif cfg is None and trace is None and split_k in (1, _AUTO_SPLIT) and len(async_input) == 5:
        # tk.async_input_mm and tk.gemm(async_input=...); tk.dist's launches (own error table, local rows) take
        # no tail
        cfg, tail = select_plan(M, N, K, a.dtype, a.device, heavy_epilogue, async_input=True)
    elif cfg is None:
        cfg = select_config(M, N, K, a.dtype, a.device, async_input is not None, heavy_epilogue)
    if split_k == _AUTO_SPLIT:
        split_k = auto_split_k(M, N, K, cfg, a.device)
    k_per_split = cdiv(cdiv(K, split_k), cfg.block_k) * cfg.block_k if K else cfg.block_k
    split_k = max(1, cdiv(K, k_per_split))
    if split_k > 1:
        tail = None
    skip, span = 0, None
    if tail is not None:
        # this launch computes every row tile but the last `skip` in its order (pivoted with async input), and
        # _tail_call the rows `span` of A that those are
        skip, span = _tail_span(M, cfg.block_m, tail.rows, async_input[1] * async_input[2] if async_input else 0)
        if span is None:   # the tail's rows would wrap around the end of A: one launch instead
            cfg, tail, skip = select_config(M, N, K, a.dtype, a.device, True, heavy_epilogue), None, 0

    plan = _Plan()
    plan.cfg, plan.split_k, plan.tail, plan.tail_span = cfg, split_k, tail, span
    # the one pivoted row-tile index's offset, for whichever kernel takes the launch
    pivot_tile_m = async_input[1] * async_input[2] // cfg.block_m if async_input is not None else 0
    plan.gluon = None
    if chosen and _gluon_takes(a, b, c, bias, residual, mul, activation, alpha, scale_a, scale_b, split_k, async_input,
                               trace, cfg):
        # the Gluon kernel takes the rows of the large tile: all of them, or the main launch's before a row tail
        # (the first span[0] rows; with async input the row tiles but the last `skip` in the pivoted order)
        rows = span[0] if tail is not None and async_input is None else M
        plan.gluon = _gluon.make_plan(a, b, c, bias, residual, activation, rows, sm_count(a.device), cfg.group_m,
                                      (async_input[1], pivot_tile_m, skip) if async_input is not None else None,
                                      unit_beta=beta == 1.0)
        plan.kernel, plan.reduce, plan.use_tma = plan.gluon.launch, None, False
        return plan
    # TMA: Hopper, or the interpreter when an override asks for it (so the path is tested on CPU);
    # both operands must be 16-byte aligned with one unit stride.
    use_tma = cfg.use_tma and (supports_tensor_descriptors(a.device) or is_interpreter())
    a_view = b_view = None
    if use_tma:
        a_view, b_view = _tma_view(a), _tma_view(b)
        use_tma = a_view is not None and b_view is not None
    plan.use_tma, plan.a_trans, plan.b_trans, plan.a_desc, plan.b_desc = use_tma, False, False, None, None
    if use_tma:
        (a_base, plan.a_trans), (b_base, plan.b_trans) = a_view, b_view
        plan.a_desc = _descriptor(a_base, (cfg.block_k, cfg.block_m) if plan.a_trans else (cfg.block_m, cfg.block_k))
        plan.b_desc = _descriptor(b_base, (cfg.block_n, cfg.block_k) if plan.b_trans else (cfg.block_k, cfg.block_n))
    a_local = _local_rows(async_input)
    plan.local_desc = None
    if a_local is not None:
        # async_local_fits has checked: row-major with A's strides, aligned as A, whole tiles.
        if plan.a_trans or async_input[1] % cfg.block_m:
            raise ValueError("a_local: the local rows must be row-major and whole tiles of rows (async_local_fits)")
        if use_tma:
            plan.local_desc = _descriptor(a_local, (cfg.block_m, cfg.block_k))

    cfg, slices, plan.c_desc, plan.res_desc = _epilogue_config(cfg, use_tma, a, c, residual, heavy_epilogue, split_k)
    plan.cfg = cfg
    flatten = cfg.flatten and _can_flatten(cfg, a, slices, plan.c_desc is not None, heavy_epilogue)

    num_tiles = (cdiv(M, cfg.block_m) - skip) * cdiv(N, cfg.block_n) * split_k
    plan.num_programs = max(1, min(num_tiles, sm_count(a.device) * cfg.programs_per_sm))
    plan.ints = (M, N, K, k_per_split, plan.num_programs,
                 a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    sbm, sbn = _bcast_strides(bias, M, N)
    plan.epilogue_strides = (_vec_stride(scale_a), _vec_stride(scale_b), sbm, sbn,
                             *_bcast_strides(mul[0] if len(mul) > 0 else None, M, N),
                             *_bcast_strides(mul[1] if len(mul) > 1 else None, M, N),
                             *_bcast_strides(residual, M, N))
    # rows per chunk, pivot tile, row tiles left to a tail, A's row 0 in the signals' rows
    plan.async_ints = (0, 0, skip, 0)
    plan.local_ints = (0, 0)
    if async_input is not None:
        rows_per_chunk, pivot_chunk = async_input[1], async_input[2]
        plan.async_ints = (rows_per_chunk, pivot_tile_m, skip, wait_row0)
        if a_local is not None:
            plan.local_ints = (pivot_chunk * rows_per_chunk, pivot_chunk * rows_per_chunk + a_local.shape[0])
    plan.acc_int = a.dtype == torch.int8
    plan.epilogue_flags = dict(
        HAS_ALPHA=alpha != 1.0, HAS_SCALE_A=scale_a is not None, HAS_SCALE_B=scale_b is not None,
        HAS_BIAS=bias is not None, BIAS_IS_ROW=bias is not None and sbm == 0,
        ACTIVATION=activation or "none", NUM_MUL=len(mul), HAS_RESIDUAL=residual is not None,
        OUT_IS_INT=c.dtype == torch.int32,
    )
    precision = fp32_precision()
    constexprs = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SPLIT_K=split_k,
        USE_TMA=use_tma, A_TRANS=plan.a_trans, B_TRANS=plan.b_trans, EVEN_K=K % cfg.block_k == 0,
        **_pointer_hints(a, b, K, k_per_split, use_tma),
        ACC_INT=plan.acc_int, FP32_PRECISION=precision,
        COMPENSATED=a.dtype == torch.float32 and precision == "ieee",
        # A traced launch keeps the loops apart: its clock reads in the fused loop stop triton from
        # pipelining the K loop at all (sm_90 TTGIR, triton 3.9: no loads issued ahead), and a trace
        # of a GEMM running ~1.6x slower shows the wrong overlap. Unfused, the K loop pipelines as usual.
        # (A descriptor chosen per tile, HAS_LOCAL_A, is not tried in warp-specialised partitions.)
        FLATTEN=flatten and trace is None, WARP_SPECIALIZE=cfg.warp_specialize and a_local is None,
        EPILOGUE_SLICES=slices, C_DESC=plan.c_desc is not None, RES_DESC=plan.res_desc is not None,
        **plan.epilogue_flags,
        ASYNC_INPUT=async_input is not None,
        SIGNAL_IS_PTR=async_input is not None and isinstance(async_input[3], torch.Tensor),
        HAS_LOCAL_A=a_local is not None,
        TRACE=trace is not None, TRACE_MAX_EVENTS=trace.max_events if trace is not None else 1,
    )
    plan.kernel = CachedLaunch(_kernels.gemm_kernel, plan.num_programs, constexprs, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages)
    plan.reduce = None
    if split_k > 1:   # the partials summed in split order, then the epilogue
        block_m, block_n = 32, 128
        plan.reduce = CachedLaunch(_kernels.splitk_reduce_kernel, cdiv(M, block_m) * cdiv(N, block_n), dict(
            SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n, **plan.epilogue_flags), num_warps=4)
    return plan


def _can_flatten(cfg: GemmConfig, a: torch.Tensor, slices: int, tma_epilogue: bool, heavy: bool) -> bool:
    """Whether the kernel may fuse its tile loop with the K loop (``FLATTEN``; it only can when
    every tile has the same K range, i.e. split_k 1). Fused, the next tile's operand loads are in
    flight while this tile's epilogue runs, so the shared memory the pointer epilogue uses to change
    the accumulator's layout (up to BM x BN/slices fp32) can no longer reuse the operand buffers:
    without the room for both, the loops stay apart (an fp32 C at 128x256 s4 would need 320 KiB).
    A heavy epilogue through the pointer path keeps them apart: unfused measured as fast or faster (H100 bf16,
    bias+gelu+residual at 4 stages: 4096^3 578-586 vs 557-559 TFLOP/s, 8192^3 623-633 vs 618-635). Through
    TMA (C and the residual by descriptors, 3 stages), fused is level or faster (2026-11-25, medians of 5
    rounds, two processes: 8192^3 0.98 / 1.01x, 4096^3 1.03 / 1.02x, three K >= 8192 anchors 0.99-1.01x; the
    large tile on seven medium shapes 1.01-1.04x under CUDA graphs). A config the caller gives is taken as
    it is.
    """
    if not tma_epilogue:
        pipeline = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * a.element_size()
        if pipeline + cfg.block_m * (cfg.block_n // slices) * 4 > _SMEM_BUDGET:
            return False
        if heavy and active_override() is None:
            return False
    return True


def _epilogue_config(cfg: GemmConfig, use_tma: bool, a: torch.Tensor, c: torch.Tensor, residual, heavy: bool,
                     split_k: int):
    """(config, slices, C's descriptor, the residual's descriptor): ``_epilogue_plan`` for the table's
    config, or for the same with one operand stage fewer where only that lets a heavy epilogue with a full
    residual read the residual and write C through TMA: the large 128x256 tile at 4 stages leaves too
    little shared memory for the staging buffers, and the pointer epilogue runs instead. Measured on the
    H100 (bf16, bias + gelu + residual, the loops apart; two processes of 3 interleaved rounds): 3 stages
    with the TMA epilogue against 4 with the pointer one, 1.01-1.04x at 4096^3, 16384x3584x8192,
    8192x14336x8192 and 8192x8192x28672, 1.00-1.02x at 8192^3 (benchmarks/NOTES.md, thirty-fourth
    session). Never below 3 stages; a config the caller forces is taken as it is.
    """
    planned = _epilogue_plan(cfg, use_tma, a, c, residual, heavy, split_k)
    if (heavy and residual is not None and planned[1] is None and cfg.num_stages > 3
            and active_override() is None):
        fewer = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        fewer_planned = _epilogue_plan(fewer, use_tma, a, c, residual, heavy, split_k)
        if fewer_planned[1] is not None and fewer_planned[2] is not None:
            return (fewer, *fewer_planned)
    return (cfg, *planned)


def _epilogue_plan(cfg: GemmConfig, use_tma: bool, a: torch.Tensor, c: torch.Tensor, residual, heavy: bool,
                   split_k: int):
    """(column slices, C's descriptor or None, the residual's descriptor or None) for one launch.

    The TMA epilogue needs TMA operands, no split-K (the partials go to a workspace) and C (and the
    residual, to read it that way) row-major, 16-byte aligned and not broadcast. Its staging buffers
    share shared memory with the operand pipeline, so the tile goes out in as many slices as that
    takes (at most 4; past that the pointer epilogue runs instead).
    """
    fixed = cfg.epilogue_slices
    default = 2 if heavy and cfg.block_n >= 32 and split_k == 1 else 1
    if not (use_tma and cfg.tma_epilogue and split_k == 1):
        return fixed or default, None, None
    M, N = c.shape
    c_view = _tma_view(c)
    if c_view is None or c_view[1]:
        return fixed or default, None, None
    res_ok = residual is not None and tuple(residual.shape) == (M, N)
    res_view = _tma_view(residual) if res_ok else None
    res_ok = res_view is not None and not res_view[1]
    pipeline = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * a.element_size()
    staging = cfg.block_m * cfg.block_n * (c.element_size() + (residual.element_size() if res_ok else 0))
    for slices in ((fixed,) if fixed else (default, 2, 4)):
        fits = pipeline + staging // slices <= _SMEM_BUDGET and cfg.block_n // slices >= 8
        if fits and (fixed or slices >= default):
            box = (cfg.block_m, cfg.block_n // slices)
            return slices, _descriptor(c, box), _descriptor(residual, box) if res_ok else None
    return fixed or default, None, None


def _launch(a, b, c, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k,
            async_input=None, trace=None) -> None:
    """``async_input``: None, or (chunk_signals, rows_per_chunk, pivot_chunk, signal_value, max_spins)
    and optionally the error table to record timeouts in (tk.dist: its workspace's). ``signal_value``
    may be an int32 device tensor of one element, read by the kernel when it runs (tk.dist's epoch).
    ``trace``: a ``dist.trace.DeviceTrace`` to record per-program wait/compute spans in, or None. A row tail's
    launch is built by ``_tail_call`` and made here, after the main one."""
    if a.shape[0] == 0 or b.shape[1] == 0:
        return
    if not on_current_device(a):
        with torch.cuda.device(a.device):  # triton launches on the current device
            return _launch(a, b, c, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k,
                           async_input, trace)
    own_errors = async_input is not None and len(async_input) > 5
    if async_input is not None and not own_errors:
        check_errors(a.device, "chunk")  # an earlier call's timeout that has landed by now
    errors = None
    if async_input is not None:
        errors = async_input[5] if own_errors else error_table(a.device, async_input[0].numel())
    plan, args, reduce_args = _call(a, b, c, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k,
                                    async_input, errors, trace, None, 0)
    tail = None
    if plan.tail is not None:
        # with async input the tail's rows wait as rows of A, with the same error table: a timeout in either launch
        # is reported below, or at the next call on a GPU
        tail = _tail_call(plan.tail, plan.tail_span, a, b, c, bias, residual, mul, activation, alpha, beta, scale_a,
                          scale_b, None if async_input is None else (*async_input[:5], errors))
    if async_input is not None:
        # Every kernel of the call is compiled and loaded before the first launch: that launch's programs wait for
        # chunks that the caller's producer may start only once this call has returned, and loading a kernel (its
        # first launch in the process) waits for the kernels running on the device. A row tail loaded after the
        # main launch held the host until the main launch's waits gave up (H100, 2026-11-25: 8.6 s, then
        # TimeoutError for chunks 0 and 1 of 4096x3584x8192).
        if tail is not None:
            tail[0].kernel.prepare(tail[1], a.device)
        if reduce_args is not None:
            plan.reduce.prepare(reduce_args, a.device)
    plan.kernel(args, a.device)
    if reduce_args is not None:
        plan.reduce(reduce_args, a.device)
    if tail is not None:
        tail[0].kernel(tail[1], a.device)
    if async_input is not None and not own_errors and not a.is_cuda:
        check_errors(a.device, "chunk")  # the interpreter has finished the kernel: report at once


def _call(a, b, c, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k, async_input, errors,
          trace, cfg, wait_row0):
    """(plan, gemm_kernel's runtime arguments, the split-K reduction's or None) for one launch (``_launch``);
    ``errors``: the error table of a launch with async input; ``cfg`` and ``wait_row0``: a row tail's config, taken
    as it is, and where its row view starts in A (``_tail_call``), else None and 0."""
    key = _plan_key(a, b, c, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k, async_input)
    if trace is not None:
        key += (trace.max_events,)
    if cfg is not None:
        key += (cfg, wait_row0)
    plan = _PLANS.get(key)
    if plan is None:
        plan = cache_put(_PLANS, key, _make_plan(a, b, c, bias, residual, mul, activation, alpha, beta, scale_a,
                                                 scale_b, split_k, async_input, trace, cfg, wait_row0), _MAX_PLANS)
    if plan.gluon is not None:
        ensure_cuda_context(a.device.index)
        if async_input is None:
            return plan, _gluon.launch_args(plan.gluon, a, b, c, bias, residual, beta), None
        return plan, _gluon.launch_args(plan.gluon, a, b, c, bias, residual, beta, async_input[0], errors,
                                        async_input[3], async_input[4]), None

    if plan.use_tma:
        if a.is_cuda:
            ensure_cuda_context(a.device.index)
        a_arg = rebase(plan.a_desc, a.t() if plan.a_trans else a)
        b_arg = rebase(plan.b_desc, b.t() if plan.b_trans else b)
    else:
        a_arg, b_arg = a, b
    c_arg = c if plan.c_desc is None else rebase(plan.c_desc, c)
    res_arg = residual if plan.res_desc is None else rebase(plan.res_desc, residual)
    M, N = plan.ints[0], plan.ints[1]
    partials = None
    if plan.split_k > 1:
        partials = torch.empty((plan.split_k, M, N), dtype=torch.int32 if plan.acc_int else torch.float32,
                               device=a.device)
    ssa, ssb, sbm, sbn, sm0m, sm0n, sm1m, sm1n, srm, srn = plan.epilogue_strides
    mul0 = mul[0] if len(mul) > 0 else None
    mul1 = mul[1] if len(mul) > 1 else None
    epilogue_args = (alpha, beta, scale_a, ssa, scale_b, ssb, bias, sbm, sbn, mul0, sm0m, sm0n, mul1, sm1m, sm1n,
                     res_arg, srm, srn)
    if async_input is None:
        wait_args = (None, None, *plan.async_ints, 0, 0, None, 0, 0)
    else:
        signals, _, _, signal_value, max_spins = async_input[:5]
        a_local = _local_rows(async_input)
        if a_local is not None and plan.local_desc is not None:
            a_local = rebase(plan.local_desc, a_local)
        wait_args = (signals, errors, *plan.async_ints, signal_value, max_spins, a_local, *plan.local_ints)
    trace_args = (trace.events, trace.clock) if trace is not None else (None, None)
    args = (a_arg, b_arg, c_arg, partials, *plan.ints, *epilogue_args, *wait_args, *trace_args)
    reduce_args = None
    if plan.split_k > 1:
        reduce_args = (partials, c, M, N, c.stride(0), c.stride(1), *epilogue_args)
    return plan, args, reduce_args


def _tail_call(tail: RowTail, span: tuple[int, int], a, b, c, bias, residual, mul, activation, alpha, beta, scale_a,
               scale_b, async_input):
    """(plan, arguments) of the launch for rows ``span = [lo, hi)`` in ``tail.config``: the same GEMM over row views
    of A, C and every epilogue operand that has M rows (broadcast ones as they are), so the main launch's plan and
    this one's are cached apart. ``async_input``: None, or the main launch's with its error table; the rows wait for
    their chunks (no pivot: they are one range)."""
    M = a.shape[0]
    lo, hi = span

    def rows(t):
        return t if t is None or t.dim() < 2 or t.shape[0] != M else t[lo:hi]

    if isinstance(scale_a, torch.Tensor) and scale_a.numel() == M and M > 1:
        scale_a = scale_a.reshape(-1)[lo:hi]
    errors = None
    if async_input is not None:
        signals, rows_per_chunk, _, signal_value, max_spins, errors = async_input
        async_input = (signals, rows_per_chunk, 0, signal_value, max_spins, errors)
    plan, args, _ = _call(a[lo:hi], b, c[lo:hi], rows(bias), rows(residual), [rows(m) for m in mul], activation,
                          alpha, beta, scale_a, scale_b, 1, async_input, errors, None, tail.config, lo)
    return plan, args


def _tail_span(M: int, block_m: int, rows: int, pivot_row: int) -> tuple[int, tuple[int, int] | None]:
    """(row tiles the main launch leaves, the rows ``[lo, hi)`` of A they are) for a tail that takes ``M - rows``
    rows. The main launch walks the M tiles from the pivot tile on (0 without async input), wrapping around, and
    stops ``skip`` tiles short: those are the tiles just before the pivot tile, A's last with pivot 0. None where
    they wrap around the end of A (a pivot tile inside the first ``skip``)."""
    tiles_m = cdiv(M, block_m)
    skip = tiles_m - rows // block_m
    pivot_tile = pivot_row // block_m
    if pivot_tile == 0:
        return skip, ((tiles_m - skip) * block_m, M)
    if pivot_tile < skip:
        return skip, None
    return skip, ((pivot_tile - skip) * block_m, pivot_tile * block_m)


# ----------------------------------------------------------------------------------------------------
# torch.library ops: the functional op and the out= variant, each with a fake implementation


@torch.library.custom_op("tilekernels::gemm", mutates_args=())
def _gemm_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
             mul: list[torch.Tensor], activation: Optional[str], alpha: float, beta: float,
             scale_a: Optional[torch.Tensor], scale_b: Optional[torch.Tensor], out_dtype: torch.dtype,
             split_k: int, chunk_signals: Optional[torch.Tensor], rows_per_chunk: int, pivot_chunk: int,
             signal_value: int, max_spins: int) -> torch.Tensor:
    c = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    _launch(a, b, c, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k,
            _async_tuple(chunk_signals, rows_per_chunk, pivot_chunk, signal_value, max_spins))
    return c


@_gemm_op.register_fake
def _(a, b, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, out_dtype, split_k, *async_args):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("tilekernels::gemm_out", mutates_args=("out",))
def _gemm_out_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                 mul: list[torch.Tensor], activation: Optional[str], alpha: float, beta: float,
                 scale_a: Optional[torch.Tensor], scale_b: Optional[torch.Tensor], split_k: int,
                 chunk_signals: Optional[torch.Tensor], rows_per_chunk: int, pivot_chunk: int, signal_value: int,
                 max_spins: int, out: torch.Tensor) -> None:
    _check_out_memory(out, a, b, bias, residual, mul, scale_a, scale_b)
    _launch(a, b, out, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k,
            _async_tuple(chunk_signals, rows_per_chunk, pivot_chunk, signal_value, max_spins))


@_gemm_out_op.register_fake
def _(a, b, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, split_k, chunk_signals,
      rows_per_chunk, pivot_chunk, signal_value, max_spins, out):
    return None


def _async_tuple(chunk_signals, rows_per_chunk, pivot_chunk, signal_value, max_spins):
    """The async-input arguments as ``_launch`` takes them (the ops carry them flat)."""
    if chunk_signals is None:
        return None
    return chunk_signals, rows_per_chunk, pivot_chunk, signal_value, max_spins


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
    a, b, bias, residual, mul, activation, alpha, beta, scale_a, scale_b = inputs[:10]
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
    # activation, alpha, beta, scale_a, scale_b, out_dtype, split_k and the five async-input arguments
    return (grad_a, grad_b, grad_bias, grad_residual, [None] * ctx.num_mul) + (None,) * 12


torch.library.register_autograd("tilekernels::gemm", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------
# public


def gemm(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, mul: Sequence[torch.Tensor] = (), activation: str | None = None,
         alpha: float = 1.0, beta: float = 1.0, scale_a=None, scale_b=None, out_dtype: torch.dtype | None = None,
         out: torch.Tensor | None = None, split_k: int | str = 1, config: GemmConfig | None = None,
         async_input: AsyncInputScheduler | None = None) -> torch.Tensor:
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
        out: write the result here (any strides, shape ``[M, N]``) and return it. It must not share memory
            with the inputs (``ValueError``), except that ``out=residual`` updates the residual in place;
            with an input that requires grad, out= raises (no autograd through it, as ``torch.mm``).
        split_k: split the K loop over this many programs (or "auto": only when the output tiles
            cannot fill the GPU and K is long); partial sums are added in a fixed order, so the
            result is bit-identical run to run.
        config: a ``GemmConfig`` overriding the launch heuristic (tests, tuning).
        async_input: a ``tk.AsyncInputScheduler``: A's rows arrive in chunks, each announced by a
            signal; every tile waits for the chunks its rows touch, the pivot chunk's tiles first (see
            ``tk.async_input_mm`` and ``gemm/scheduler.py`` for the protocol).

    Epilogue order: ``acc*alpha*scale_a*scale_b + bias -> activation -> * mul... -> + beta*residual
    -> cast``, all in fp32. Autograd covers ``alpha * a @ b + bias + beta * residual``; with an
    activation, ``mul`` or scales the op is forward-only.

    Example:
        >>> y = tk.gemm(x, w.t(), bias=b, activation="gelu", residual=x_res)   # [M, N]
    """
    _check_args(a, b, bias, residual, mul, activation, alpha, beta, scale_a, scale_b, out_dtype, out,
                split_k, config)
    _check_async_input(async_input, a)
    if async_input is None:
        wait = (None, 0, 0, 0, 0)
    else:
        wait = (async_input.chunk_signals, async_input.rows_per_chunk, async_input.pivot_chunk,
                async_input.signal_value, async_input.spins())
    mul = list(mul)
    alpha = float(alpha)
    if scale_a is not None and isinstance(scale_a, numbers.Real):
        alpha, scale_a = alpha * float(scale_a), None
    if scale_b is not None and isinstance(scale_b, numbers.Real):
        alpha, scale_b = alpha * float(scale_b), None
    split = _AUTO_SPLIT if split_k == "auto" else split_k
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (a, b, bias, residual, scale_a, scale_b, *mul))
    if needs_grad and out is not None:
        raise ValueError("out= does not support autograd, but an input requires grad: drop out= or call "
                         "under torch.no_grad()")
    if needs_grad and (activation is not None or mul or scale_a is not None or scale_b is not None):
        raise NotImplementedError("tk.gemm autograd covers alpha * a @ b + bias + beta * residual; "
                                  "activation, mul and scales are forward-only")
    if config is not None:
        from .configs import override_config

        with override_config(config):
            return gemm(a, b, bias=bias, residual=residual, mul=mul, activation=activation, alpha=alpha,
                        beta=beta, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, out=out,
                        split_k=split_k, async_input=async_input)
    if not needs_grad and plain_eager(a):
        # Eager fast path: the same launch the custom op makes, minus ~45 us of dispatcher overhead
        # per call (measured on an H100), which is as long as a whole skinny GEMM.
        c = out if out is not None else torch.empty((a.shape[0], b.shape[1]), device=a.device,
                                                    dtype=out_dtype or _default_out_dtype(a.dtype))
        _launch(a, b, c, bias, residual, mul, activation, alpha, float(beta), scale_a, scale_b, split,
                _async_tuple(*wait))
        return c
    if out is not None:
        torch.ops.tilekernels.gemm_out(a, b, bias, residual, mul, activation, alpha, float(beta), scale_a,
                                       scale_b, split, *wait, out)
        return out
    return torch.ops.tilekernels.gemm(a, b, bias, residual, mul, activation, alpha, float(beta), scale_a,
                                      scale_b, out_dtype or _default_out_dtype(a.dtype), split, *wait)


def async_input_mm(a: torch.Tensor, b: torch.Tensor, chunk_signals: torch.Tensor, chunk_pivot: int = 0, *,
                   signal_value: int = 1, max_spins: int | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` while A's rows are still arriving: PyTorch's ``torch.ops.symm_mem._async_input_mm``
    contract, in every layout and dtype ``tk.gemm`` takes.

    A's M rows form ``len(chunk_signals)`` equal chunks (M must divide); chunk ``c`` may be read once
    ``chunk_signals[c] >= signal_value`` (int32 or uint32 signals on A's device), and chunk
    ``chunk_pivot`` is computed first. Bump ``signal_value`` from call to call instead of zeroing the
    signals. A chunk that never arrives within ``max_spins`` polls raises ``TimeoutError`` naming it
    (see ``tk.AsyncInputScheduler``); the tiles of the other chunks are still computed.

    Example (the consumer; a producer on another stream copies chunk c, then sets its signal):
        >>> signals = torch.zeros(world, dtype=torch.int32, device="cuda")
        >>> y = tk.async_input_mm(a_gathered, w, signals, chunk_pivot=rank, signal_value=epoch)
    """
    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        _check_args(a, b, None, None, (), None, 1.0, 1.0, None, None, None, out, 1, None)
    if not isinstance(chunk_signals, torch.Tensor):
        raise TypeError(f"chunk_signals must be a torch.Tensor, got {type(chunk_signals).__name__}")
    M, num_chunks = a.shape[0], chunk_signals.numel()
    if num_chunks < 1 or M % num_chunks:
        raise ValueError(f"async_input_mm: A's {M} rows must split into len(chunk_signals) = {num_chunks} "
                         "equal chunks")
    # built (and so checked) for M = 0 too, where no tile waits
    scheduler = AsyncInputScheduler(chunk_signals, max(1, M // num_chunks), pivot_chunk=chunk_pivot,
                                    signal_value=signal_value, max_spins=max_spins)
    if M == 0:
        _check_async_input(scheduler, a)
        return gemm(a, b, out=out)
    return gemm(a, b, out=out, async_input=scheduler)


def _gemm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """tk.dist's plain GEMM: ``out = a @ b`` (``out``'s dtype: a's or fp32) for operands its caller
    has already checked (2-D, one dtype and device, K equal and > 0, out ``[M, N]``). Skips tk.gemm's
    argument checks: tk.dist makes several of these per call, and each check costs host time."""
    _launch(a, b, out, None, None, [], None, 1.0, 1.0, None, None, 1)


def async_local_fits(a: torch.Tensor, b: torch.Tensor, a_local: torch.Tensor, rows_per_chunk: int) -> bool:
    """Whether ``_async_gemm_into`` can read the pivot chunk's rows from ``a_local`` instead of from
    ``a``: a_local holds exactly one chunk ``[rows_per_chunk, K]`` of A's dtype, both are row-major
    with the same strides and the same 16-byte alignment, and the launch's row tiles fit whole into a
    chunk (so no tile reads from both tensors)."""
    if (a_local.dtype != a.dtype or a_local.device != a.device or a_local.dim() != 2
            or tuple(a_local.shape) != (rows_per_chunk, a.shape[1]) or a_local.stride() != a.stride()
            or a.stride(1) != 1 or (a_local.data_ptr() % 16 == 0) != (a.data_ptr() % 16 == 0)):
        return False
    cfg = select_config(a.shape[0], b.shape[1], a.shape[1], a.dtype, a.device, True)
    return rows_per_chunk % cfg.block_m == 0


def _async_gemm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, chunk_signals: torch.Tensor,
                     rows_per_chunk: int, pivot_chunk: int, signal_value: torch.Tensor, max_spins: int,
                     errors: torch.Tensor, trace=None, checked: bool = False, a_local=None) -> None:
    """tk.dist's async-input GEMM: ``out = a @ b`` waiting for ``chunk_signals[c] >= signal_value[0]``
    (an int32 device word, read when the kernel runs) and recording timeouts in ``errors`` (the
    caller's table: word 0 any-fail, 1 + c chunk c); ``trace``: see ``_launch``. ``checked``: the
    caller has validated the operands (as ``_gemm_into``'s callers do). ``a_local``: the pivot
    chunk's rows, read from there instead of from ``a`` (whose rows there may then hold anything);
    only where ``async_local_fits`` says so."""
    if not checked:
        _check_args(a, b, None, None, (), None, 1.0, 1.0, None, None, None, out, 1, None)
    wait = (chunk_signals, rows_per_chunk, pivot_chunk, signal_value, max_spins, errors)
    _launch(a, b, out, None, None, [], None, 1.0, 1.0, None, None, 1,
            wait if a_local is None else (*wait, a_local), trace)
