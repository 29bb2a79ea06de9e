"""``tk.layer_norm``, ``tk.rms_norm`` and ``tk.add_rms_norm_quant``: row norms with a fused residual add
and quantised outputs (CK Tile's 02_layernorm2d, 10_rmsnorm2d, 11_add_rmsnorm2d_rdquant).

Reading order: argument checks (shared with ``tk.quant``) -> the launchers -> torch.library ops
(forward, backward) with fake implementations -> autograd -> the public functions. The kernels are in
``_kernels.py``; the fp64 specification is ``reference.py``. ``tk.dynamic_quant``, ``tk.smooth_quant``
and ``tk.moe_smooth_quant`` (``quant/quant.py``) are the same forward op with no norm.

Nothing reads a device value on the host, so every call can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
import numbers
import weakref
from typing import Optional

import torch
import triton

from .._runtime import (CachedLaunch, ClusterLaunch, ErrorTable, cache_put, cdiv, check_runnable, on_current_device,
                        plain_eager, register_error_check, sm_count, tensor_key)
from . import _gluon
from . import _kernels as kern

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# max |q|: int8 symmetric, NVIDIA's float8_e4m3fn (not AMD's fnuz, whose max is 240)
QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


# ----------------------------------------------------------------------------------------------------
# argument checks


def check_rows(name: str, x) -> None:
    """``x`` is a float tensor ``[..., N]`` (N >= 1) that kernels can run on."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name} must be [..., N] with N >= 1, got shape {tuple(x.shape)}")
    check_runnable(x.device, name)


def check_vector(name: str, t, shape: tuple, x: torch.Tensor, form: str = "[N]") -> None:
    """``t`` is None or a float tensor of ``shape`` on x's device."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be {form} = {list(shape)}, got shape {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")


def check_like(name: str, t, like_name: str, like: torch.Tensor) -> None:
    """``t`` is a tensor of ``like``'s dtype, shape and device (a residual and the x it is added to)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != like.dtype:
        raise TypeError(f"{name} must have {like_name}'s dtype {like.dtype}, got {t.dtype}")
    if t.shape != like.shape:
        raise ValueError(f"{name} must have {like_name}'s shape {tuple(like.shape)}, got {tuple(t.shape)}")
    if t.device != like.device:
        raise ValueError(f"{name} must be on {like_name}'s device {like.device}, got {t.device}")


def check_quant_dtype(quant_dtype) -> None:
    if quant_dtype not in QUANT_MAX:
        raise TypeError(f"quant_dtype must be torch.int8 or torch.float8_e4m3fn (NVIDIA's fp8, max 448), "
                        f"got {quant_dtype!r}")


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def check_no_grad(op: str, *tensors) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise ValueError(f"{op}: quantised outputs have no backward; call it under torch.no_grad() or with "
                         "inputs that do not require grad (the unquantised path, quant=None, has one)")


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, N]``: a view when the leading dims collapse, else a copy."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def as_shape(t: torch.Tensor, shape) -> torch.Tensor:
    """``t`` (a ``[rows, N]`` or ``[rows]`` output) viewed as ``shape``, or as it is when it has as many dims (the
    view costs ~2.5 us of host time, as much as a fifth of a small call's)."""
    return t if t.dim() == len(shape) else t.view(shape)


def _vector(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


# ----------------------------------------------------------------------------------------------------
# launchers


def _empty(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=x.device)


def forward_rows(x: torch.Tensor, topk_ids: Optional[torch.Tensor]) -> int:
    return x.shape[0] * topk_ids.shape[1] if topk_ids is not None else x.shape[0]


# call signature -> CachedLaunch (forward) or (row kernel, column-sum kernel, row programs) (backward):
# the configs, grids and constexprs are worked out once per signature, and later calls launch through
# triton's compiled launcher directly. Host cost per call is what eager users of these memory-bound
# ops see (a 4096 x 4096 bf16 norm runs ~25 us on an H100).
_FORWARD_PLANS: dict = {}
_BACKWARD_PLANS: dict = {}


def launch_forward(x, weight, bias, residual, x_bias, smooth_scale, topk_ids, eps, norm, quant, quant_dtype,
                   store_y, store_stats):
    """Run ``_row_forward`` on 2-D x; returns (y, q, row_scale, s, mean, rstd), None where not asked."""
    if not on_current_device(x):
        with torch.cuda.device(x.device):  # triton launches on the current device
            return launch_forward(x, weight, bias, residual, x_bias, smooth_scale, topk_ids, eps, norm, quant,
                                  quant_dtype, store_y, store_stats)
    M, N = forward_rows(x, topk_ids), x.shape[1]
    quantise = quant != "none"
    device = x.device
    y = torch.empty((M, N), dtype=x.dtype, device=device) if store_y else None
    q = torch.empty((M, N), dtype=quant_dtype, device=device) if quantise else None
    scale = torch.empty(M, dtype=torch.float32, device=device) if quantise else None
    s = torch.empty((M, N), dtype=x.dtype, device=device) if residual is not None else None
    mean = torch.empty(M, dtype=torch.float32, device=device) if store_stats else None
    rstd = torch.empty(M, dtype=torch.float32, device=device) if store_stats else None
    if M == 0:
        return y, q, scale, s, mean, rstd
    key = (device, *map(tensor_key, (x, residual, x_bias, weight, bias, smooth_scale, topk_ids)), norm, quant,
           quant_dtype, store_y, store_stats, kern.config_override.get("forward"),
           kern.config_override.get("smem_quant", 0))
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        quant_only = quantise and not (store_y or store_stats)   # q and row_scale are all the call returns
        kind = None   # the configs' kind (_kernels.TUNED_FORWARD): None for a norm that writes y or s
        if residual is None and x_bias is None:
            if norm == "none":   # tk.dynamic_quant, tk.smooth_quant, tk.moe_smooth_quant
                kind = "moe" if topk_ids is not None else quant
            elif quant_only:     # a norm whose quantised rows are all it returns
                kind = f"{norm}+{quant}"
        topk = topk_ids.shape[1] if topk_ids is not None else 0
        smem = kern.smem_quant_config(N, kind, topk) if quant_only else None
        block_n = triton.next_power_of_2(N)
        if _gluon.smem_quant_applies(x, topk, smem, block_n):
            # a loop over tokens, the rows of x (MoE writes k rows for each)
            programs = kern.balanced_grid(x.shape[0], smem.programs_per_sm * sm_count(device))
            plan = cache_put(_FORWARD_PLANS, key, CachedLaunch(_gluon._moe_rows_smem, programs, dict(
                QMAX=QUANT_MAX[quant_dtype], TOPK=topk, BLOCK_N=block_n, VEC=16 // x.element_size(),
                STAGES=smem.stages, EVEN_N=N == block_n, WARP_REDUCE=smem.warp_reduce), num_warps=smem.num_warps,
                maxnreg=smem.maxnreg))
    if plan is None:
        config = kern.forward_config(N, device, kind)
        if quant_only and kern.lean_quant(config, kind, N):
            constexprs = dict(HAS_SMOOTH=quant == "smooth", QMAX=QUANT_MAX[quant_dtype],
                              EVEN_N=N % config.block_n == 0, BLOCK_N=config.block_n)
            plan = cache_put(_FORWARD_PLANS, key, CachedLaunch(
                kern._quant_rows, kern.forward_grid(M, N, config, device), constexprs, num_warps=config.num_warps))
    if plan is None:
        constexprs = dict(
            NORM=kern.NORMS[norm], HAS_W=weight is not None, HAS_B=bias is not None, HAS_XBIAS=x_bias is not None,
            HAS_RESIDUAL=residual is not None, QUANT=kern.QUANTS[None if quant == "none" else quant],
            QMAX=QUANT_MAX.get(quant_dtype, 1.0), TOPK=topk,
            STORE_Y=store_y, STORE_STATS=store_stats, ONE_PASS=N <= config.block_n, PERSISTENT=config.persistent,
            PREFETCH=config.persistent and config.prefetch,
            EVEN_N=N % config.block_n == 0, BLOCK_M=config.block_m, BLOCK_N=config.block_n)
        plan = cache_put(_FORWARD_PLANS, key, CachedLaunch(kern._row_forward, kern.forward_grid(M, N, config, device),
                                                           constexprs, num_warps=config.num_warps))
    moe = topk_ids is not None
    if plan.kernel is kern._quant_rows:
        plan((x, smooth_scale, q, scale, M, N, x.stride(0), x.stride(1)), device)
        return y, q, scale, s, mean, rstd
    if plan.kernel is not kern._row_forward:   # the Gluon MoE forward
        plan((x, smooth_scale, topk_ids, q, scale, x.shape[0], N, smooth_scale.shape[0], x.stride(0),
              smooth_scale.stride(0), topk_ids.stride(0), topk_ids.stride(1)), device)
        return y, q, scale, s, mean, rstd
    plan((x, residual, x_bias, weight, bias, smooth_scale, topk_ids, y, q, scale, s, mean, rstd,
          M, N, x.shape[0], smooth_scale.shape[0] if moe else 1, x.stride(0), x.stride(1),
          residual.stride(0) if residual is not None else 0, residual.stride(1) if residual is not None else 0,
          smooth_scale.stride(0) if moe else 0, topk_ids.stride(0) if moe else 0, topk_ids.stride(1) if moe else 0,
          eps), device)
    return y, q, scale, s, mean, rstd


class _ExchangeErrors:
    """The cluster backward's error words, per device (an ``_runtime.ErrorTable`` of two words): word 0 is set, and
    word 1 holds a row, when a program stopped waiting for a cluster partner's row sums
    (``_gluon._row_backward_smem``). Partners in a cluster run together, so that means a bug; the row's dx
    is then wrong, and ``check`` (at the next backward on the device, and in ``tk.raise_pending_errors``)
    raises."""

    def __init__(self):
        self.tables: dict = {}

    def table(self, device: torch.device) -> torch.Tensor:
        key = (device.type, device.index)
        if key not in self.tables:
            self.tables[key] = ErrorTable(device, 2)
            register_error_check(device, weakref.WeakMethod(self.check))
        return self.tables[key].tensor

    def check(self) -> None:
        """Raise if a cluster backward on any device recorded a wait that gave up (reads what has landed; no
        sync)."""
        for (kind, index), table in self.tables.items():
            words = table.words
            if words[0]:
                row = int(words[1])
                words[:] = 0
                raise TimeoutError(
                    f"the layer_norm / rms_norm backward on {kind}:{index}: a program stopped waiting for its "
                    f"cluster partner's row sums (row {row}) after max_spins polls, so dx of that row is wrong. "
                    "Partners in a cluster run together, so this is a tilekernels bug: please report it.")


_EXCHANGE_ERRORS = _ExchangeErrors()


def launch_backward(dy, x, x_bias, ds, weight, mean, rstd, norm, want_dw, want_db):
    """dx ``[M, N]`` in x's dtype and dw, db ``[N]`` fp32 (None where not wanted)."""
    if not on_current_device(x):
        with torch.cuda.device(x.device):
            return launch_backward(dy, x, x_bias, ds, weight, mean, rstd, norm, want_dw, want_db)
    M, N = x.shape
    device = x.device
    dx = torch.empty((M, N), dtype=x.dtype, device=device)
    if M == 0:
        zeros = torch.zeros(N, dtype=torch.float32, device=device)
        return dx, zeros if want_dw else None, zeros.clone() if want_db else None
    key = (device, *map(tensor_key, (x, x_bias, dy, ds, weight, mean, rstd)), norm, want_dw, want_db,
           kern.config_override.get("backward"), kern.config_override.get("smem_backward", 0))
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        switches = dict(NORM=kern.NORMS[norm], HAS_W=weight is not None, HAS_XBIAS=x_bias is not None,
                        HAS_DS=ds is not None, WANT_DW=want_dw, WANT_DB=want_db)
        smem = kern.smem_backward_config(N, norm)
        block_n = triton.next_power_of_2(N)
        if _gluon.smem_backward_applies(x, dy, ds, smem, block_n, want_dw, want_db):
            # row_programs groups of smem.split programs, each program one column part of the group's rows
            row_programs = max(1, min(M, smem.programs_per_sm * sm_count(device) // smem.split))
            constexprs = dict(**switches, PREFETCH=smem.prefetch, BLOCK_N=block_n // smem.split, VEC=smem.vec,
                              SPLIT=smem.split, CLUSTER=smem.cluster and smem.split > 1, ACC_REGS=smem.acc_regs,
                              STAGES=smem.stages if smem.prefetch == 2 else 1)
            rows = None
            if constexprs["CLUSTER"]:
                # a row group's programs are one cluster and exchange the row sums in shared memory; the
                # grid is sized to the clusters the device keeps resident (compiled here, with stand-ins
                # for the per-call buffers)
                rows = ClusterLaunch(_gluon._row_backward_smem, row_programs, constexprs, smem.split,
                                     _gluon.cluster_exchange_bytes(smem.split), num_warps=smem.num_warps)
                part = torch.empty((1, N), dtype=torch.float32, device=device)
                try:
                    resident = rows.prepare(
                        (x, x_bias, dy, ds, weight, mean, rstd, dx, part if want_dw else None,
                         part if want_db else None, _EXCHANGE_ERRORS.table(device), M, N, x.stride(0), dy.stride(0),
                         ds.stride(0) if ds is not None else 0, _gluon.max_spins), device)
                    row_programs = rows.grid = min(row_programs, resident)
                except RuntimeError:   # no cluster launch in this triton: the exchange through global memory
                    rows = None
                    constexprs["CLUSTER"] = False
            if rows is None:
                rows = CachedLaunch(_gluon._row_backward_smem, row_programs * smem.split, constexprs,
                                    num_warps=smem.num_warps)
        else:
            config = kern.backward_config(N, norm, device)
            row_programs, split_n = kern.backward_grid(M, N, config, device)
            rows = CachedLaunch(kern._row_backward, row_programs * split_n, dict(
                **switches, SPLIT_N=split_n, PREFETCH=config.prefetch and split_n == 1,
                BLOCK_M=config.block_m, BLOCK_N=config.block_n), num_warps=config.num_warps)
        # narrow column blocks: one program per 64 columns keeps enough of them in flight
        sums = CachedLaunch(kern._sum_rows, cdiv(N, 64), dict(BLOCK_R=32, BLOCK_N=64), num_warps=4)
        plan = cache_put(_BACKWARD_PLANS, key, (rows, sums, row_programs))
    rows, sums, row_programs = plan
    dw_part = torch.empty((row_programs, N), dtype=torch.float32, device=device) if want_dw else None
    db_part = torch.empty((row_programs, N), dtype=torch.float32, device=device) if want_db else None
    if rows.kernel is not kern._row_backward:   # the Gluon kernel: unit column strides
        split = rows.constexprs["SPLIT"]
        # the row parts' sums, exchanged between a row's programs: a zeroed word is "not yet" (_gluon._word);
        # a cluster exchanges them in shared memory
        xchg = None
        if rows.constexprs["CLUSTER"]:   # then only the error words of a wait that gave up
            _EXCHANGE_ERRORS.check()   # an earlier call's wait that gave up, if it has landed by now
            xchg = _EXCHANGE_ERRORS.table(device)
        elif split > 1:
            xchg = torch.zeros((M, split, 2), dtype=torch.int64, device=device)
        rows((x, x_bias, dy, ds, weight, mean, rstd, dx, dw_part, db_part, xchg, M, N, x.stride(0), dy.stride(0),
              ds.stride(0) if ds is not None else 0, _gluon.max_spins), device)
    else:
        rows((x, x_bias, dy, ds, weight, mean, rstd, dx, dw_part, db_part, M, N, x.stride(0), x.stride(1),
              dy.stride(0), dy.stride(1), ds.stride(0) if ds is not None else 0,
              ds.stride(1) if ds is not None else 0), device)
    grads = []
    for part in (dw_part, db_part):
        if part is None:
            grads.append(None)
        else:
            out = torch.empty(N, dtype=torch.float32, device=device)
            sums((part, out, row_programs, N), device)
            grads.append(out)
    return dx, grads[0], grads[1]


def run_forward(x, weight, bias, residual, x_bias, smooth_scale, topk_ids, eps, norm, quant, quant_dtype,
                store_y, store_stats):
    """The forward, (y, q, row_scale, s, mean, rstd) with None where not asked, for arguments the
    public functions have checked. Under torch.compile, and for tensor subclasses (fake tensors), it
    goes through the torch.library op; a plain eager call launches directly (``launch_forward``, the
    op's own impl), through ``_EagerRowNorm`` when it needs gradients, which saves the custom op's
    host cost per call."""
    if not plain_eager(x):
        # empty tensors stand for the outputs not asked for (callers read only what they asked for)
        return _forward_op(x, weight, bias, residual, x_bias, smooth_scale, topk_ids, eps, norm, quant, quant_dtype,
                           store_y, store_stats)
    if store_stats:  # autograd: only the unquantised norms keep their statistics
        y, s = _EagerRowNorm.apply(x, weight, bias, residual, x_bias, eps, norm)
        return y, None, None, s, None, None
    return launch_forward(x, weight, bias, residual, x_bias, smooth_scale, topk_ids, eps, norm, quant, quant_dtype,
                          store_y, store_stats)


# ----------------------------------------------------------------------------------------------------
# torch.library ops


@torch.library.custom_op("tilekernels::row_norm_forward", mutates_args=())
def _forward_op(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                residual: Optional[torch.Tensor], x_bias: Optional[torch.Tensor],
                smooth_scale: Optional[torch.Tensor], topk_ids: Optional[torch.Tensor], eps: float, norm: str,
                quant: str, quant_dtype: torch.dtype, store_y: bool, store_stats: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, q, row_scale, s, mean, rstd) of 2-D x; the public functions have checked every argument.
    Outputs not asked for are empty (each its own tensor: a custom op's outputs may not alias)."""
    return tuple(_empty(x) if t is None else t for t in launch_forward(
        x, weight, bias, residual, x_bias, smooth_scale, topk_ids, eps, norm, quant, quant_dtype, store_y,
        store_stats))


@_forward_op.register_fake
def _(x, weight, bias, residual, x_bias, smooth_scale, topk_ids, eps, norm, quant, quant_dtype, store_y,
      store_stats):
    M, N = forward_rows(x, topk_ids), x.shape[1]
    quantise = quant != "none"

    def nothing():   # one empty tensor per output: the real op's outputs never alias
        return x.new_empty(0, dtype=torch.float32)

    return (x.new_empty((M, N)) if store_y else nothing(),
            x.new_empty((M, N), dtype=quant_dtype) if quantise else nothing(),
            x.new_empty(M, dtype=torch.float32) if quantise else nothing(),
            x.new_empty((M, N)) if residual is not None else nothing(),
            x.new_empty(M, dtype=torch.float32) if store_stats else nothing(),
            x.new_empty(M, dtype=torch.float32) if store_stats else nothing())


@torch.library.custom_op("tilekernels::row_norm_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, x: torch.Tensor, x_bias: Optional[torch.Tensor], ds: Optional[torch.Tensor],
                 weight: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor, norm: str, want_dw: bool,
                 want_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) of the forward above: dw, db fp32 ``[N]`` (empty when not wanted)."""
    return tuple(_empty(x) if t is None else t
                 for t in launch_backward(dy, x, x_bias, ds, weight, mean, rstd, norm, want_dw, want_db))


@_backward_op.register_fake
def _(dy, x, x_bias, ds, weight, mean, rstd, norm, want_dw, want_db):
    N = x.shape[1]
    return (x.new_empty(x.shape), x.new_empty(N if want_dw else 0, dtype=torch.float32),
            x.new_empty(N if want_db else 0, dtype=torch.float32))


# ----------------------------------------------------------------------------------------------------
# autograd (unquantised path; row_scale, mean and rstd carry no gradient)


def _save_for_backward(ctx, x, weight, bias, residual, x_bias, norm, s, mean, rstd):
    # The norm saw s (the rounded sum) when there is a residual, else x + x_bias.
    normed = s if residual is not None else x
    ctx.save_for_backward(normed, x_bias if residual is None else None, weight, mean, rstd)
    ctx.norm = norm
    ctx.has = (weight is not None, bias is not None, residual is not None, x_bias is not None)
    ctx.dtypes = tuple(t.dtype if t is not None else None for t in (weight, bias, x_bias))


def _input_grads(ctx, dy, ds, run_backward):
    """Gradients of (x, weight, bias, residual, x_bias); ``run_backward`` is the backward op or, on the
    eager path, ``launch_backward`` itself."""
    normed, x_bias, weight, mean, rstd = ctx.saved_tensors
    has_w, has_b, has_residual, has_xbias = ctx.has
    if dy is None or dy.numel() == 0:
        dy = torch.zeros_like(normed)
    if ds is not None and ds.numel() == 0:
        ds = None
    want_dw = has_w and ctx.needs_input_grad[1]
    want_db = has_b and ctx.needs_input_grad[2]
    dx, dw, db = run_backward(dy, normed, x_bias, ds if has_residual else None, weight, mean, rstd, ctx.norm,
                              want_dw, want_db)
    w_dtype, b_dtype, xb_dtype = ctx.dtypes
    d_xbias = None
    if has_xbias and ctx.needs_input_grad[4]:
        d_xbias = dx.sum(dim=0, dtype=torch.float32).to(xb_dtype)
    return (dx, dw.to(w_dtype) if want_dw else None, db.to(b_dtype) if want_db else None,
            dx if has_residual else None, d_xbias)


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, x_bias = inputs[:5]
    _save_for_backward(ctx, x, weight, bias, residual, x_bias, inputs[8], output[3], output[4], output[5])


def _backward(ctx, dy, dq, dscale, ds, dmean, drstd):
    return (*_input_grads(ctx, dy, ds, _backward_op), None, None, None, None, None, None, None, None)


torch.library.register_autograd("tilekernels::row_norm_forward", _backward, setup_context=_setup_context)


class _EagerRowNorm(torch.autograd.Function):
    """The same forward and backward for plain eager calls that need gradients, without the custom
    op's dispatch: on the H100 machine (torch 2.11) each custom-op call cost ~240 us of host time
    inside ``torch._library``, so a layer_norm forward + backward took ~600 us of host time against
    torch's ~110 us. torch.compile, fake tensors and subclasses still go through the op."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, x_bias, eps, norm):
        y, _, _, s, mean, rstd = launch_forward(x, weight, bias, residual, x_bias, None, None, eps, norm, "none",
                                                torch.int8, True, True)
        _save_for_backward(ctx, x, weight, bias, residual, x_bias, norm, s, mean, rstd)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        return (*_input_grads(ctx, dy, ds, launch_backward), None, None)


# ----------------------------------------------------------------------------------------------------
# public


def _norm(norm, x, weight, bias, eps, residual, x_bias, quant, smooth_scale, quant_dtype, return_unquantized):
    check_rows("x", x)
    N = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias), ("x_bias", x_bias)):
        check_vector(name, t, (N,), x)
    if residual is not None:
        check_like("residual", residual, "x", x)
    eps = _check_eps(eps)
    if quant not in ("dynamic", "smooth", None):
        raise ValueError(f"quant must be None, 'dynamic' or 'smooth', got {quant!r}")
    if quant == "smooth" and smooth_scale is None:
        raise ValueError("smooth_scale is required with quant='smooth'")
    if quant != "smooth" and smooth_scale is not None:
        raise ValueError(f"smooth_scale is only used with quant='smooth' (quant is {quant!r})")
    check_vector("smooth_scale", smooth_scale, (N,), x)
    if quant is not None:
        check_quant_dtype(quant_dtype)
        check_no_grad(f"{norm}_norm", x, weight, bias, residual, x_bias, smooth_scale)
    if not isinstance(return_unquantized, bool):
        raise TypeError(f"return_unquantized must be a bool, got {type(return_unquantized).__name__}")
    if return_unquantized and quant is None:
        raise ValueError("return_unquantized=True needs quant='dynamic' or 'smooth' (without quant, y is returned)")
    store_y = quant is None or return_unquantized
    store_stats = quant is None and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias, residual, x_bias))
    y, q, scale, s, _, _ = run_forward(
        rows_view(x), _vector(weight), _vector(bias), None if residual is None else rows_view(residual),
        _vector(x_bias), _vector(smooth_scale), None, eps, norm, quant or "none",
        quant_dtype if quant is not None else torch.int8, store_y, store_stats)
    outputs = [as_shape(q, x.shape), as_shape(scale, x.shape[:-1])] if quant is not None else []
    if store_y:
        outputs.append(as_shape(y, x.shape))
    if residual is not None:
        outputs.append(as_shape(s, x.shape))
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def layer_norm(x, weight, bias=None, eps=1e-5, *, residual=None, x_bias=None, quant=None, smooth_scale=None,
               quant_dtype=torch.int8, return_unquantized=False):
    """Layer norm over the last dim, with an optional fused residual add and quantised output.

    x ``[..., N]`` fp32/fp16/bf16, any strides; weight, bias, x_bias ``[N]`` (or None), any float dtype.
    The row normalised is ``v = x + x_bias`` (fp32), or with ``residual`` (x's shape and dtype)
    ``s = x + x_bias + residual`` rounded to x's dtype; ``y = (v - mean) / sqrt(var + eps) * weight + bias``
    (biased variance), computed in fp32 and returned in x's dtype.

    Returns ``y``, or ``(y, s)`` with a residual. With ``quant="dynamic"`` (or ``"smooth"``, which first
    multiplies y by ``smooth_scale [N]``) y is replaced by ``q, row_scale`` -- or ``q, row_scale, y``
    with ``return_unquantized=True`` --: ``row_scale = max|z| / QMAX`` per row (fp32, x's leading
    shape; 0 for a row of zeros), ``q = z / row_scale`` as ``quant_dtype`` (int8: rounded half to
    even, QMAX 127; torch.float8_e4m3fn: QMAX 448), from the fp32 z. Rows up to 32768 columns are read
    once and kept in registers; longer ones take a chunked multi-pass scheme.

    Backward (quant=None): gradients for x, weight, bias, residual and x_bias; dweight and dbias are
    reduced in a fixed order, so they are bit-identical run to run.

    Example::

        x = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16)
        h = torch.randn_like(x)
        w, b = torch.ones(8192, device="cuda"), torch.zeros(8192, device="cuda")
        y, h = tk.layer_norm(x, w, b, residual=h)                       # y = LN(x + h), h = x + h
        q, scale = tk.layer_norm(x, w, b, quant="dynamic")              # int8 rows and their scales
    """
    return _norm("layer", x, weight, bias, eps, residual, x_bias, quant, smooth_scale, quant_dtype,
                 return_unquantized)


def rms_norm(x, weight, eps=1e-6, *, residual=None, quant=None, smooth_scale=None, quant_dtype=torch.int8,
             return_unquantized=False):
    """RMS norm over the last dim: ``y = v / sqrt(mean(v^2) + eps) * weight``, v as in ``layer_norm``.

    Same shapes, residual, quantisation and outputs as ``tk.layer_norm`` (no bias, no x_bias).
    Backward (quant=None): gradients for x, weight and residual, dweight deterministic.

    Example::

        y, h = tk.rms_norm(x, w, residual=h)      # the pre-norm block of a Llama layer
    """
    return _norm("rms", x, weight, None, eps, residual, None, quant, smooth_scale, quant_dtype, return_unquantized)


def add_rms_norm_quant(a, b, weight, eps=1e-6, quant_dtype=torch.int8):
    """``(q, row_scale, a + b)``: ``rms_norm(a, weight, eps, residual=b, quant="dynamic")`` (CK Tile's
    11_add_rmsnorm2d_rdquant). a, b ``[..., N]`` of one dtype and shape; q int8 or float8_e4m3fn."""
    check_rows("a", a)
    check_like("b", b, "a", a)
    return _norm("rms", a, weight, None, eps, b, None, "dynamic", None, quant_dtype, False)
