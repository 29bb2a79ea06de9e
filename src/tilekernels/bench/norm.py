"""Check cases and benchmark cases for the norms and quantisation ops (issue 7).

Six registered ops share this module (``bench/__init__.py``: ``tilekernels.bench.norm:LAYER_NORM`` ...):
``layer_norm``, ``rms_norm``, ``add_rms_norm_quant``, ``dynamic_quant``, ``smooth_quant`` and
``moe_smooth_quant``. They are memory-bound: the metric is TB/s, and the question is how close each
comes to the device's copy bandwidth.

Shapes (``--shapes``): ``MxN`` (M rows of N columns), for moe_smooth_quant ``TxH`` (T tokens of hidden
size H, each routed to ``--moe-topk`` of ``--moe-experts`` experts, default k = 2 of E = 8). GPU default:
N = 4096, 8192, 16384, 32768 with M such that x is 256 MiB in bf16 (32768x4096 ... 4096x32768), so
every row length of issue 7's goal is measured and input sets rotate through more than the L2 on
their own. Under the CPU interpreter: one tiny shape, 3x1000, enough to run every path end to end.

Rows' ``variant`` is the pass: ``fwd``, or ``bwd`` for layer_norm and rms_norm (``--passes fwd,bwd``,
the default; the quantisation ops have no backward and run ``fwd`` whatever it says). Their ``layout``
names what the call carries: ``weight+bias`` (layer_norm), ``weight`` (rms_norm), ``q-int8`` or
``q-fp8e4m3`` (the quantised ops, one table per ``--quant-dtype``, default int8), moe_smooth_quant
``q-int8/k2/E8``. dtype: ``--dtype`` bf16 (default), fp16 or fp32 for x, the residual, weight and bias;
smooth scales are fp32, expert ids int32.

Inputs: standard normal from ``device_random`` (never zeros); smooth scales ``0.5 + |normal|``; each
token's k experts distinct, drawn at random. ``eps`` is the ops' default (1e-5 layer_norm, 1e-6 RMS).

Providers:

- ``tilekernels``: ``tk.layer_norm(x, weight, bias)``, ``tk.rms_norm(x, weight)``,
  ``tk.add_rms_norm_quant(x, residual, weight, quant_dtype=)``, ``tk.dynamic_quant(x, quant_dtype)``,
  ``tk.smooth_quant(x, smooth_scale, quant_dtype)``, ``tk.moe_smooth_quant(x, smooth_scale, topk_ids,
  quant_dtype)``.
- ``eager``: the op composed from torch ops the way a user writes it without tilekernels:
  ``F.layer_norm`` / ``F.rms_norm``; ``s = a + b`` then ``F.rms_norm(s)`` for add_rms_norm_quant; the
  quantisation (``eager_quant``) in fp32: ``amax = |z|.amax(-1)``, ``z * (QMAX / amax)`` rounded
  (``torch.round``) and clamped for int8 or clamped and cast for fp8, ``row_scale = amax / QMAX``; smooth
  quant on ``x * smooth_scale`` (fp32), the MoE rows as ``x[None] * smooth_scale[topk_ids.t()]`` (``[k, T, H]``
  flattened k-major).
- ``compile``: ``torch.compile(<the eager function>, dynamic=False)``, compiled afresh for each case on
  its first call (``torch._dynamo.reset()`` first: a run's many shapes would otherwise pass the recompile
  limit and silently fall back to eager); the compile happens in the accuracy check, before any timing.
  Under the interpreter it is left out, with the reason printed, when torch.compile cannot run on this
  CPU (tried once, on a tiny function).

The ``bwd`` pass (layer_norm, rms_norm) is FlashAttention's ``benchmark_backward`` method, as in
``bench/attention.py``: each input set gets the provider's forward graph built once, outside the timing,
on leaves x, weight (and bias) requiring grad; each timed call is ``torch.autograd.grad(y, leaves, dy,
retain_graph=True)``. Under ``--cuda-graph`` the bwd pass is not run.

Metric: TB/s = bytes moved / median time, the bytes being the least the op must move: each tensor it
reads or writes once, at its element size (e: x's; q 1 byte; row_scale 4 bytes per row; weight, bias
and smooth scales once, at theirs):

- layer_norm fwd ``M*N*e*2 + N*(|weight| + |bias|)`` (read x, write y);
  bwd ``M*N*e*3 + N*(|weight| + |dweight| + |dbias|)`` (read x, dy, write dx; mean and rstd, which a
  kernel may save or recompute, are not counted).
- rms_norm fwd ``M*N*e*2 + N*|weight|``; bwd ``M*N*e*3 + N*(|weight| + |dweight|)``.
- add_rms_norm_quant ``M*N*(3*e + 1) + 4*M + N*|weight|`` (read a, b; write a + b, q, row_scale).
- dynamic_quant ``M*N*(e + 1) + 4*M``; smooth_quant adds ``N*4`` (the smooth scales).
- moe_smooth_quant ``T*H*e + k*T*H + 4*k*T + E*H*4 + T*k*4`` (x read once, q and row_scale of the k*T
  rows written, the smooth table and the ids read once).

The run measures the device's copy bandwidth once (``harness.copy_bandwidth_tbps``: ``.copy_`` of a 1
GiB tensor, bytes read + written over its median time); every row carries ``bytes_moved``, ``copy_tbps``
and ``copy_fraction = TB/s / copy TB/s``. After the harness's TB/s tables comes a goals table per op,
pass and dtype: each provider's copy fraction, ours/eager and ours/compile, and one line judging issue 7's
goal at the shapes with N (H) in 4096..32768: forward ``copy_fraction >= 0.9`` and ``ours/eager >= 1.3``,
backward ``copy_fraction >= 0.8``; ours/compile is shown, without a goal. ANCHORS.md measured eager
layer_norm at 1.78-2.26 and rms_norm at 1.83-2.13 TB/s on an H100 (copy: 3.02).

The accuracy check before timing compares each provider's outputs with ``tilekernels.norm.reference`` in
float64 on a sample of rows (64, evenly spaced, the first and last among them; moe_smooth_quant: tokens,
all k rows of each), plus: every element of y, s, dx and row_scale (and of fp8 q) finite.

- y, s (the residual sum), dx: ``testing.compare``'s error-ratio rule against the same reference
  computed by PyTorch in x's dtype, at most 2x its error (3x for gradients); dweight and dbias, which sum
  over every row, against the whole float64 reference (computed in chunks of rows).
- q: within one quantisation step of the reference's q (``compare_steps``: int8 values, or adjacent
  float8_e4m3fn values); a provider that rounds y to x's dtype before quantising (eager) lands there too.
- row_scale: relative error at most ``max(eps(x dtype), 1e-5)`` (``compare_relative``).

``python -m tilekernels check`` runs, per op, a few cases at odd sizes (N 1000 and 4099 on the CPU,
real sizes on a GPU) against the same references, every row: the residual and x_bias paths, the norms'
quantised outputs, gradients with a residual, a row of zeros, int8 and fp8.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..testing import Comparison, compare, random_tensor
from . import harness
from .check import CheckCase
from .harness import (
    COPY_BYTES_CPU,
    COPY_BYTES_GPU,
    OURS,
    Accuracy,
    BenchCase,
    UsageError,
    copy_bandwidth_tbps,
    device_random,
    dtype_name,
    exception_text,
    format_table,
    parse_dims,
    shape_items,
    shape_label,
    table_groups,
    tk_function,
)

LAYER_NORM_OP = "layer_norm"
RMS_NORM_OP = "rms_norm"
ADD_RMS_NORM_QUANT_OP = "add_rms_norm_quant"
DYNAMIC_QUANT_OP = "dynamic_quant"
SMOOTH_QUANT_OP = "smooth_quant"
MOE_SMOOTH_QUANT_OP = "moe_smooth_quant"
NORM_OPS = (LAYER_NORM_OP, RMS_NORM_OP)

EAGER = "eager"
COMPILE = "compile"
PROVIDERS = (OURS, EAGER, COMPILE)
PASSES = ("fwd", "bwd")
DIMS = ("M", "N")
MOE_DIMS = ("T", "H")
QUANT_DTYPES = {"int8": torch.int8, "fp8e4m3": torch.float8_e4m3fn}
QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}     # DESIGN.md's: NVIDIA's e4m3fn, not fnuz
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMOOTH_DTYPE = torch.float32
IDS_DTYPE = torch.int32
EPS = {LAYER_NORM_OP: 1e-5, RMS_NORM_OP: 1e-6, ADD_RMS_NORM_QUANT_OP: 1e-6}
DEFAULT_TOPK, DEFAULT_EXPERTS = 2, 8

# x is 256 MiB in bf16 at every row length of the goal
GPU_SHAPES = "32768x4096,16384x8192,8192x16384,4096x32768"
CPU_SHAPES = "3x1000"

# issue 7's goals, judged at the shapes whose row length is in GOAL_COLUMNS
GOAL_COLUMNS = (4096, 32768)
FORWARD_COPY_GOAL, BACKWARD_COPY_GOAL, EAGER_GOAL = 0.9, 0.8, 1.3

OUT_RATIO, GRAD_RATIO = 2.0, 3.0
ROW_SCALE_MIN_RTOL = 1e-5
CHECK_ROWS = 64                 # rows (tokens) of a bench case the accuracy check compares
REFERENCE_CHUNK = 2**22         # elements per chunk of the float64 gradient reference

FORMULAS = {
    LAYER_NORM_OP: "bytes moved (x + y + weight + bias; bwd x + dy + dx + weight + dweight + dbias)",
    RMS_NORM_OP: "bytes moved (x + y + weight; bwd x + dy + dx + weight + dweight)",
    ADD_RMS_NORM_QUANT_OP: "bytes moved (a + b + (a + b) + q at 1 B + row_scale at 4 B/row + weight)",
    DYNAMIC_QUANT_OP: "bytes moved (x + q at 1 B + row_scale at 4 B/row)",
    SMOOTH_QUANT_OP: "bytes moved (x + q at 1 B + row_scale at 4 B/row + smooth_scale)",
    MOE_SMOOTH_QUANT_OP: "bytes moved (x + k*T*H q at 1 B + row_scale at 4 B/row + smooth_scale [E, H] + topk_ids)",
}


def _reference():
    from ..norm import reference

    return reference


# ----------------------------------------------------------------------------------------------------
# what one case runs


class Spec:
    """One call of one op: its shape, dtypes and options, the inputs it takes, its outputs' names, and
    what tilekernels, eager PyTorch and the reference make of it.

    The bench uses the plain calls (``residual`` only for add_rms_norm_quant); ``check`` also the
    options: ``residual`` and ``x_bias`` (layer_norm) and ``quant`` ("dynamic" / "smooth") on the norms,
    gradients with a residual.
    """

    def __init__(self, op: str, rows: int, cols: int, dtype: torch.dtype, *, backward: bool = False,
                 quant_dtype: torch.dtype | None = None, residual: bool = False, x_bias: bool = False,
                 quant: str | None = None, topk: int = DEFAULT_TOPK, experts: int = DEFAULT_EXPERTS,
                 ids_dtype: torch.dtype = IDS_DTYPE):
        self.op, self.rows, self.cols, self.dtype, self.backward = op, rows, cols, dtype, backward
        self.residual = residual or op == ADD_RMS_NORM_QUANT_OP
        self.x_bias = x_bias
        if op in (ADD_RMS_NORM_QUANT_OP, DYNAMIC_QUANT_OP):
            quant = "dynamic"
        elif op in (SMOOTH_QUANT_OP, MOE_SMOOTH_QUANT_OP):
            quant = "smooth"
        self.quant = quant
        self.quant_dtype = (quant_dtype or torch.int8) if quant else None
        self.topk, self.experts, self.ids_dtype = topk, experts, ids_dtype
        self.moe = op == MOE_SMOOTH_QUANT_OP
        self.eps = EPS.get(op, 0.0)

    @property
    def shape(self) -> dict:
        return dict(zip(MOE_DIMS if self.moe else DIMS, (self.rows, self.cols)))

    @property
    def variant(self) -> str:
        return "bwd" if self.backward else "fwd"

    @property
    def layout(self) -> str:
        if self.quant_dtype is None:
            return "weight+bias" if self.op == LAYER_NORM_OP else "weight"
        label = f"q-{dtype_name(self.quant_dtype)}"
        return label + (f"/k{self.topk}/E{self.experts}" if self.moe else "")

    def grad_inputs(self) -> tuple[str, ...]:
        """The inputs the backward differentiates, in the order of its outputs."""
        names = ["x", "weight"] + (["bias"] if self.op == LAYER_NORM_OP else [])
        return tuple(names + (["residual"] if self.residual else []) + (["x_bias"] if self.x_bias else []))

    def output_names(self) -> tuple[str, ...]:
        if self.backward:
            return tuple("d" + name for name in self.grad_inputs())
        names = ("q", "row_scale") if self.quant else ("y",)
        return names + (("s",) if self.residual else ())

    def bytes_moved(self) -> int:
        """The least the op must move (module docstring): reads and writes once each."""
        M, N, e = self.rows, self.cols, self.dtype.itemsize
        p = self.dtype.itemsize                  # weight and bias are in x's dtype here
        if self.op == LAYER_NORM_OP:
            return 3 * M * N * e + 3 * N * p if self.backward else 2 * M * N * e + 2 * N * p
        if self.op == RMS_NORM_OP:
            return 3 * M * N * e + 2 * N * p if self.backward else 2 * M * N * e + N * p
        if self.op == ADD_RMS_NORM_QUANT_OP:
            return M * N * (3 * e + 1) + 4 * M + N * p
        if self.op == DYNAMIC_QUANT_OP:
            return M * N * (e + 1) + 4 * M
        if self.op == SMOOTH_QUANT_OP:
            return M * N * (e + 1) + 4 * M + N * SMOOTH_DTYPE.itemsize
        k, E = self.topk, self.experts
        return (M * N * e + k * M * N + 4 * k * M + E * N * SMOOTH_DTYPE.itemsize
                + M * k * self.ids_dtype.itemsize)

    def set_bytes(self) -> int:
        """An input set and what a call leaves beside it (the backward's forward graph and dx)."""
        if self.backward:
            return 4 * self.rows * self.cols * self.dtype.itemsize
        return self.bytes_moved()

    def make_inputs(self, random: Callable[[tuple, torch.dtype], torch.Tensor],
                    experts_for: Callable[[int, int, int], torch.Tensor]) -> dict:
        """The inputs, from ``random(shape, dtype)`` (never zeros) and ``experts_for(T, E, k)`` (``[T, k]``
        distinct expert ids per token)."""
        M, N = self.rows, self.cols
        x = {"x": random((M, N), self.dtype)}
        if self.op in NORM_OPS or self.op == ADD_RMS_NORM_QUANT_OP:
            x["weight"] = random((N,), self.dtype)
        if self.op == LAYER_NORM_OP:
            x["bias"] = random((N,), self.dtype)
        if self.residual:
            x["residual"] = random((M, N), self.dtype)
        if self.x_bias:
            x["x_bias"] = random((N,), self.dtype)
        if self.quant == "smooth":
            rows = (self.experts, N) if self.moe else (N,)
            x["smooth_scale"] = 0.5 + random(rows, SMOOTH_DTYPE).abs()
        if self.moe:
            x["topk_ids"] = experts_for(M, self.experts, self.topk).to(self.ids_dtype)
        if self.backward:
            x["dy"] = random((M, N), self.dtype)
            if self.residual:
                x["ds"] = random((M, N), self.dtype)
        return x

    # tilekernels and eager PyTorch: functions of one input set -> the op's outputs, a tuple

    def tk_forward(self, x: dict) -> tuple:
        if self.op in NORM_OPS:
            options = {}
            if self.residual:
                options["residual"] = x["residual"]
            if self.x_bias:
                options["x_bias"] = x["x_bias"]
            if self.quant:
                options.update(quant=self.quant, quant_dtype=self.quant_dtype, smooth_scale=x.get("smooth_scale"))
            if self.op == LAYER_NORM_OP:
                out = tk_function("layer_norm")(x["x"], x["weight"], x["bias"], self.eps, **options)
            else:
                out = tk_function("rms_norm")(x["x"], x["weight"], self.eps, **options)
        elif self.op == ADD_RMS_NORM_QUANT_OP:
            out = tk_function("add_rms_norm_quant")(x["x"], x["residual"], x["weight"], self.eps, self.quant_dtype)
        elif self.op == DYNAMIC_QUANT_OP:
            out = tk_function("dynamic_quant")(x["x"], self.quant_dtype)
        elif self.op == SMOOTH_QUANT_OP:
            out = tk_function("smooth_quant")(x["x"], x["smooth_scale"], self.quant_dtype)
        else:
            out = tk_function("moe_smooth_quant")(x["x"], x["smooth_scale"], x["topk_ids"], self.quant_dtype)
        return out if isinstance(out, tuple) else (out,)

    def eager_function(self) -> tuple[Callable, tuple[str, ...]]:
        """``(fn, input names)``: the op as a user composes it from torch ops (the bench's plain calls
        only); ``fn(*inputs)`` returns the op's outputs, and is what ``compile`` compiles."""
        eps, quant_dtype = self.eps, self.quant_dtype
        if self.op == LAYER_NORM_OP:
            def layer_norm(x, weight, bias):
                return (F.layer_norm(x, (x.shape[-1],), weight, bias, eps),)

            return layer_norm, ("x", "weight", "bias")
        if self.op == RMS_NORM_OP:
            def rms_norm(x, weight):
                return (F.rms_norm(x, (x.shape[-1],), weight, eps),)

            return rms_norm, ("x", "weight")
        if self.op == ADD_RMS_NORM_QUANT_OP:
            def add_rms_norm_quant(a, b, weight):
                s = a + b
                return (*eager_quant(F.rms_norm(s, (s.shape[-1],), weight, eps), quant_dtype), s)

            return add_rms_norm_quant, ("x", "residual", "weight")
        if self.op == DYNAMIC_QUANT_OP:
            def dynamic_quant(x):
                return eager_quant(x, quant_dtype)

            return dynamic_quant, ("x",)
        if self.op == SMOOTH_QUANT_OP:
            def smooth_quant(x, smooth_scale):
                return eager_quant(x * smooth_scale, quant_dtype)

            return smooth_quant, ("x", "smooth_scale")

        def moe_smooth_quant(x, smooth_scale, topk_ids):
            rows = x.unsqueeze(0) * smooth_scale[topk_ids.t()]           # [k, T, H], row j*T + t
            return eager_quant(rows.flatten(0, 1), quant_dtype)

        return moe_smooth_quant, ("x", "smooth_scale", "topk_ids")

    # the float64 reference: name -> (reference, PyTorch's low-precision answer or None)

    def _norm_reference(self, x: dict, rows, compute_dtype):
        reference = _reference()

        def pick(name):
            t = x.get(name)
            return t if t is None or rows is None else t[rows]

        if self.op == LAYER_NORM_OP:
            return reference.reference_layer_norm(pick("x"), x["weight"], x["bias"], self.eps, pick("residual"),
                                                  x.get("x_bias"), compute_dtype)
        return reference.reference_rms_norm(pick("x"), x["weight"], self.eps, pick("residual"), compute_dtype)

    def references(self, x: dict, rows: torch.Tensor | None) -> dict:
        """The reference outputs of ``rows`` (None: all) of input set ``x``, by output name. Gradients of
        weight, bias and x_bias are over every row whatever ``rows`` says."""
        if self.backward:
            return self._grad_references(x, rows)
        reference = _reference()
        refs = {}
        if self.op in NORM_OPS or self.op == ADD_RMS_NORM_QUANT_OP:
            y, s = self._norm_reference(x, rows, torch.float64)
            low_y, low_s = self._norm_reference(x, rows, None)
            if self.quant is None:
                refs["y"] = (y, low_y)
            z = y * _cpu64(x["smooth_scale"]) if self.quant == "smooth" else y
            if self.residual:
                refs["s"] = (s, low_s)
        elif self.moe:
            tokens = x["x"] if rows is None else x["x"][rows]
            ids = x["topk_ids"] if rows is None else x["topk_ids"][rows]
            z = reference.reference_moe_rows(tokens, x["smooth_scale"], ids)
        else:
            z = _cpu64(x["x"] if rows is None else x["x"][rows])
            if self.quant == "smooth":
                z = z * _cpu64(x["smooth_scale"])
        if self.quant:
            q, row_scale = reference.reference_quant(z, self.quant_dtype)
            refs["q"], refs["row_scale"] = (q, None), (row_scale, None)
        return refs

    def _grad_references(self, x: dict, rows: torch.Tensor | None) -> dict:
        """Gradients of the norm by autograd through the reference: float64 leaves on the CPU over chunks
        of rows (s rounded to x's dtype as the op rounds it), and PyTorch's own in x's dtype on x's device."""
        reference = _reference()
        names = self.grad_inputs()
        per_row = {"x", "residual"}
        M, N = self.rows, self.cols
        wanted = torch.arange(M) if rows is None else rows.cpu()
        exact = {name: [] for name in names if name in per_row}
        params = {name: _cpu64(x[name]).requires_grad_() for name in names if name not in per_row}
        sums = {name: torch.zeros_like(t) for name, t in params.items()}
        step = max(1, REFERENCE_CHUNK // N)
        for start in range(0, M, step):
            stop = min(M, start + step)
            chunk = {name: _cpu64(x[name][start:stop]).requires_grad_() for name in exact}
            leaves = {**chunk, **params}
            y, s = self._call_reference(reference, leaves, torch.float64)
            outputs, grads_out = self._grad_outputs(y, s, x, slice(start, stop))
            grads = dict(zip(names, torch.autograd.grad(outputs, [leaves[n] for n in names],
                                                        [_cpu64(g) for g in grads_out])))
            keep = wanted[(wanted >= start) & (wanted < stop)] - start
            for name, kept in exact.items():
                kept.append(grads[name][keep])
            for name in sums:
                sums[name] += grads[name]
        low_leaves = {name: x[name].detach().requires_grad_() for name in names}
        y, s = self._call_reference(reference, low_leaves, None)
        outputs, grads_out = self._grad_outputs(y, s, x, slice(None))
        low = dict(zip(names, torch.autograd.grad(outputs, [low_leaves[n] for n in names], grads_out)))
        refs = {}
        for name in names:
            ref = torch.cat(exact[name]) if name in exact else sums[name]
            low_grad = low[name][wanted.to(low[name].device)] if name in exact else low[name]
            refs["d" + name] = (ref, low_grad)
        return refs

    def _call_reference(self, reference, leaves: dict, compute_dtype):
        if self.op == LAYER_NORM_OP:
            return reference.reference_layer_norm(leaves["x"], leaves["weight"], leaves["bias"], self.eps,
                                                  leaves.get("residual"), leaves.get("x_bias"), compute_dtype,
                                                  x_dtype=self.dtype)
        return reference.reference_rms_norm(leaves["x"], leaves["weight"], self.eps, leaves.get("residual"),
                                            compute_dtype, x_dtype=self.dtype)

    def _grad_outputs(self, y, s, x: dict, rows: slice):
        if self.residual:
            return (y, s), (x["dy"][rows], x["ds"][rows])
        return (y,), (x["dy"][rows],)

    def output_rows(self, name: str, t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The rows of output ``name`` that ``references(x, rows)`` holds."""
        if rows is None or name in ("dweight", "dbias", "dx_bias"):
            return t
        if self.moe:       # token t's k rows are j*T + t, k-major
            rows = torch.cat([rows + j * self.rows for j in range(self.topk)])
        return t[rows.to(t.device)]

    def compare(self, outputs: Sequence[torch.Tensor], refs: dict, rows: torch.Tensor | None,
                label: str = "") -> tuple[list[Comparison], dict[str, int]]:
        """Every output against its reference (the rules in the module docstring), and how many
        non-finite elements each float output holds in all."""
        comparisons, nonfinite = [], {}
        for name, t in zip(self.output_names(), outputs):
            ref, low = refs[name]
            picked = self.output_rows(name, t, rows)
            what = f"{label}{name}"
            if name == "q":
                comparisons.append(compare_steps(what, picked, ref))
            elif name == "row_scale":
                rtol = max(torch.finfo(self.dtype).eps, ROW_SCALE_MIN_RTOL)
                comparisons.append(compare_relative(what, picked, ref, rtol))
            else:
                ratio = GRAD_RATIO if self.backward else OUT_RATIO
                comparisons.append(compare(what, picked, ref, low, ratio=ratio))
            if t.dtype.is_floating_point:
                nonfinite[name] = int((~torch.isfinite(t.float() if t.dtype.itemsize == 1 else t)).sum())
        return comparisons, nonfinite


def _cpu64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float64)


def eager_quant(z: torch.Tensor, quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row quantisation in plain PyTorch, as a user writes it: ``(q, row_scale)`` from z in fp32."""
    qmax = QUANT_MAX[quant_dtype]
    z = z.float()
    amax = z.abs().amax(dim=-1, keepdim=True)
    scaled = z * torch.where(amax > 0, qmax / amax, 0.0)
    if quant_dtype == torch.int8:
        q = scaled.round().clamp(-qmax, qmax).to(torch.int8)
    else:
        q = scaled.clamp(-qmax, qmax).to(quant_dtype)
    return q, (amax / qmax).squeeze(-1)


# ----------------------------------------------------------------------------------------------------
# the rules for quantised outputs, as testing.Comparison (the check table's "torch max err" is then the
# allowance: one step, or the relative tolerance at the worst element)


def step_index(q: torch.Tensor) -> torch.Tensor:
    """q's values as integer steps (int64), so neighbours differ by 1: int8 as it is; float8_e4m3fn by
    its sign and magnitude bits (NaN, magnitude 0x7F, maps far beyond any value). Not
    ``norm.reference.quant_steps``, which measures distance from the exact value for the tests' stricter rule."""
    if q.dtype == torch.int8:
        return q.to(torch.int64)
    bits = q.view(torch.uint8).to(torch.int64)
    magnitude = bits & 0x7F
    magnitude = torch.where(magnitude == 0x7F, torch.full_like(magnitude, 1 << 20), magnitude)
    return torch.where(bits >= 0x80, -magnitude, magnitude)


def compare_steps(name: str, q: torch.Tensor, ref: torch.Tensor, steps: int = 1) -> Comparison:
    """q within ``steps`` quantisation steps of the reference's q, everywhere."""
    if q.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(q.shape)} != reference shape {tuple(ref.shape)}")
    if q.dtype != ref.dtype:
        raise AssertionError(f"{name}: dtype {q.dtype} != reference dtype {ref.dtype}")
    out_steps, ref_steps = step_index(q.detach().cpu()), step_index(ref.detach().cpu())
    diff = (out_steps - ref_steps).abs()
    max_err = float(diff.max()) if diff.numel() else 0.0
    worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
    values, ref_values = q.detach().cpu().float(), ref.detach().cpu().float()
    nan = torch.isnan(values)
    detail = f"{int(nan.sum())} NaN elements" if bool(nan.any()) else ""
    ref_rms = float(ref_values.pow(2).mean().sqrt()) if ref_values.numel() else 0.0
    rel_rms = float((values - ref_values).nan_to_num().pow(2).mean().sqrt()) / ref_rms if ref_rms > 0 else 0.0
    return Comparison(name, max_err, float(steps), rel_rms, worst,
                      float(values[worst]) if worst else 0.0, float(ref_values[worst]) if worst else 0.0,
                      max_err / steps, not detail, detail, max_err <= steps and not detail)


def compare_relative(name: str, out: torch.Tensor, ref: torch.Tensor, rtol: float) -> Comparison:
    """``|out - ref| <= rtol * |ref|`` everywhere (zeros must be zeros), with NaN/inf parity."""
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    out64, ref64 = _cpu64(out), _cpu64(ref)
    parity = (torch.isnan(out64) != torch.isnan(ref64)) | (torch.isinf(out64) != torch.isinf(ref64))
    detail = f"{int(parity.sum())} elements differ in NaN/inf" if bool(parity.any()) else ""
    finite = torch.isfinite(out64) & torch.isfinite(ref64)
    diff = torch.where(finite, (out64 - ref64).abs(), 0.0)
    allowed = rtol * ref64.abs().nan_to_num(posinf=0.0) + 1e-30
    excess = diff / allowed
    worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape)) if excess.numel() else ()
    ratio = float(excess[worst]) if worst else 0.0
    ref_rms = float(ref64[finite].pow(2).mean().sqrt()) if bool(finite.any()) else 0.0
    rel_rms = float(diff.pow(2).mean().sqrt()) / ref_rms if ref_rms > 0 else 0.0
    return Comparison(name, float(diff[worst]) if worst else 0.0, float(allowed[worst]) if worst else 0.0,
                      rel_rms, worst, float(out64[worst]) if worst else 0.0, float(ref64[worst]) if worst else 0.0,
                      ratio, not detail, detail, ratio <= 1.0 and not detail)


def _combine(comparisons: list[Comparison], nonfinite: dict[str, int]) -> Accuracy:
    worst = _worst(comparisons)
    detail = "; ".join(str(c) for c in comparisons if not c.passed) or str(worst)
    bad = {name: n for name, n in nonfinite.items() if n}
    if bad:
        detail += "; non-finite elements in the whole " + ", ".join(f"{name} ({n})" for name, n in bad.items())
    return Accuracy(all(c.passed for c in comparisons) and not bad, worst.ratio, detail)


def _worst(comparisons: list[Comparison]) -> Comparison:
    """A failing comparison if any, else the one nearest its limit."""
    return max(comparisons, key=lambda c: (not c.passed, c.ratio))


# ----------------------------------------------------------------------------------------------------
# shapes


def parse_norm_shapes(text: str, op: str) -> list[dict]:
    """``"32768x4096,3x1000"`` -> ``[{"M": 32768, "N": 4096}, {"M": 3, "N": 1000}]`` (moe_smooth_quant:
    ``T`` and ``H``)."""
    names = MOE_DIMS if op == MOE_SMOOTH_QUANT_OP else DIMS
    shapes = []
    for item, parts in shape_items(text):
        try:
            shapes.append(parse_dims(item, parts, names))
        except UsageError:
            raise UsageError(f"shape {item!r}: expected {'x'.join(names)} (2 positive integers joined by 'x'), "
                             "e.g. 16384x8192") from None
    return shapes


def row_length(shape: dict) -> int:
    """N (H for moe_smooth_quant): what issue 7's goal ranges over."""
    return shape.get("N", shape.get("H"))


# ----------------------------------------------------------------------------------------------------
# providers: functions of one input set -> a tuple of outputs


def _backward_provider(spec: Spec, provider: str, forward: Callable[[dict], tuple]):
    """Time ``autograd.grad`` on a forward graph built once per input set (kept in the set, so it goes
    with the set; another provider's graphs are dropped when this one starts)."""
    key = f"graph:{provider}"
    names = spec.grad_inputs()

    def run(x: dict) -> tuple:
        if key not in x:
            for other in [k for k in x if k.startswith("graph:")]:
                del x[other]
            leaves = {name: x[name].detach().requires_grad_() for name in names}
            outputs = forward({**x, **leaves})
            x[key] = (outputs, tuple(leaves[name] for name in names))
        outputs, leaves = x[key]
        grads_out = (x["dy"], x["ds"]) if spec.residual else (x["dy"],)
        return torch.autograd.grad(outputs, leaves, grads_out, retain_graph=True)

    return run


def _eager_call(spec: Spec, compiled: bool) -> Callable[[dict], tuple]:
    fn, names = spec.eager_function()
    state: dict = {}

    def call(x: dict) -> tuple:
        if "fn" not in state:
            if compiled:
                torch._dynamo.reset()   # each case compiles afresh: no recompile limit across the run
                state["fn"] = torch.compile(fn, dynamic=False)
            else:
                state["fn"] = fn
        return state["fn"](*(x[name] for name in names))

    return call


def _providers(spec: Spec, providers: Sequence[str]) -> dict[str, Callable]:
    fns = {}
    for provider in providers:
        forward = spec.tk_forward if provider == OURS else _eager_call(spec, provider == COMPILE)
        fns[provider] = _backward_provider(spec, provider, forward) if spec.backward else forward
    return fns


_compile_unavailable: dict[str, str | None] = {}


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot run on ``device`` (None if it can): tried once per process on a tiny
    function (on a CPU it needs a working C++ compiler)."""
    key = str(device)
    if key not in _compile_unavailable:
        try:
            probe = torch.compile(lambda t: t * 2.0 + 1.0, dynamic=False)
            probe(torch.ones(8, device=device))
            _compile_unavailable[key] = None
        except Exception as exc:  # any failure of the compiler stack means the same: no compile provider
            _compile_unavailable[key] = f"torch.compile does not run on {device} here ({exception_text(exc)})"
    return _compile_unavailable[key]


# ----------------------------------------------------------------------------------------------------
# the accuracy check before timing


def sample_rows(count: int, limit: int = CHECK_ROWS) -> torch.Tensor:
    """Up to ``limit`` row indices spread evenly over ``count`` rows, the first and last among them."""
    return torch.linspace(0, count - 1, min(count, limit)).round().long().unique()


def _make_check(spec: Spec):
    """``check(inputs, output, provider)``; the references are computed once per input set."""
    names = spec.output_names()
    rows = sample_rows(spec.rows)
    cache: dict[int, dict] = {}

    def check(inputs: dict, output, provider: str) -> Accuracy:
        outputs = tuple(output) if isinstance(output, (tuple, list)) else (output,)
        if len(outputs) != len(names):
            return Accuracy(False, math.inf, f"{len(outputs)} outputs, expected {len(names)} ({', '.join(names)})")
        key = id(inputs)
        if key not in cache:
            cache.clear()
            cache[key] = spec.references(inputs, rows)
        comparisons, nonfinite = spec.compare(outputs, cache[key], rows, f"{provider} ")
        return _combine(comparisons, nonfinite)

    return check


# ----------------------------------------------------------------------------------------------------
# benchmark cases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--passes", default="fwd,bwd",
                        help="flash_attn, layer_norm, rms_norm: fwd and/or bwd (backward alone, on a prebuilt "
                             "forward graph); default fwd,bwd (the quantisation ops run fwd only)")
    parser.add_argument("--quant-dtype", default="int8",
                        help="add_rms_norm_quant, dynamic_quant, smooth_quant, moe_smooth_quant: comma-separated "
                             f"q dtypes, {', '.join(QUANT_DTYPES)} (default int8)")
    parser.add_argument("--moe-topk", type=int, default=DEFAULT_TOPK,
                        help=f"moe_smooth_quant: experts per token, k (default {DEFAULT_TOPK})")
    parser.add_argument("--moe-experts", type=int, default=DEFAULT_EXPERTS,
                        help=f"moe_smooth_quant: experts, E (default {DEFAULT_EXPERTS})")


def _split(text: str, allowed: Sequence[str], option: str) -> list[str]:
    items = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [p for p in items if p not in allowed]
    if unknown or not items:
        raise UsageError(f"{option}: {', '.join(unknown) or 'nothing given'}; choose from {', '.join(allowed)}")
    return items


def _device_inputs(spec: Spec, device: torch.device, seed: int, i: int) -> dict:
    counter = itertools.count(1000 * seed + 20 * i)

    def random(shape, dtype):
        return device_random(shape, dtype, device, next(counter))

    def experts_for(tokens, experts, k):
        gen = torch.Generator(device=device).manual_seed(next(counter))
        return torch.rand(tokens, experts, generator=gen, device=device).argsort(dim=1)[:, :k]

    return spec.make_inputs(random, experts_for)


def _case(spec: Spec, device: torch.device, providers: Sequence[str], seed: int, copy_tbps: float) -> BenchCase:
    nbytes = spec.bytes_moved()
    return BenchCase(op=spec.op, shape=spec.shape, dtype=spec.dtype, variant=spec.variant, layout=spec.layout,
                     flops=float(nbytes), set_bytes=spec.set_bytes(),
                     make_inputs=lambda i: _device_inputs(spec, device, seed, i),
                     providers=_providers(spec, providers), check=_make_check(spec), metric="tbps",
                     row_extra=lambda row: {"bytes_moved": nbytes, "copy_tbps": copy_tbps,
                                            "copy_fraction": row["p50"] / copy_tbps})


def bench_cases(op: str, opts: argparse.Namespace, device: torch.device) -> list[BenchCase]:
    interpreter = device.type != "cuda"
    dtype = opts.dtype
    if dtype not in FLOAT_DTYPES:
        raise UsageError(f"{op}: --dtype {dtype_name(dtype)}; x is bf16, fp16 or fp32 (q's dtype: --quant-dtype)")
    explicit = bool(opts.providers)
    providers = _split(opts.providers, PROVIDERS, "--providers") if explicit else list(PROVIDERS)
    shapes = parse_norm_shapes(opts.shapes or (CPU_SHAPES if interpreter else GPU_SHAPES), op)
    if op in NORM_OPS:
        passes = _split(getattr(opts, "passes", None) or "fwd,bwd", PASSES, "--passes")
        if getattr(opts, "cuda_graph", False) and "bwd" in passes:
            passes.remove("bwd")
            print(f"{op}: bwd not timed under --cuda-graph (its forward graphs are built eagerly, on another "
                  "stream than the capture)", flush=True)
        quant_dtypes = [None]
    else:
        passes = ["fwd"]
        names = _split(getattr(opts, "quant_dtype", None) or "int8", tuple(QUANT_DTYPES), "--quant-dtype")
        quant_dtypes = [QUANT_DTYPES[name] for name in names]
    topk, experts = getattr(opts, "moe_topk", DEFAULT_TOPK), getattr(opts, "moe_experts", DEFAULT_EXPERTS)
    if op == MOE_SMOOTH_QUANT_OP and not 1 <= topk <= experts:
        raise UsageError(f"--moe-topk {topk} --moe-experts {experts}: expected 1 <= k <= E (distinct experts per "
                         "token)")
    if COMPILE in providers and interpreter and not explicit:
        reason = compile_unavailable(device)
        if reason:       # asked for by name, it runs and fails with the reason instead
            providers.remove(COMPILE)
            print(f"{op}: compile left out: {reason}", flush=True)
    copy_tbps = copy_bandwidth_tbps(device, opts.warmup or 50.0, opts.rep or 200.0)
    print(f"{op}: TB/s = {FORMULAS[op]} / median time; device copy bandwidth {copy_tbps:.3g} TB/s (.copy_ of "
          f"{COPY_BYTES_CPU if interpreter else COPY_BYTES_GPU} bytes, read + written); copy_fraction = TB/s / that",
          flush=True)
    cases = []
    for variant, quant_dtype, shape in itertools.product(passes, quant_dtypes, shapes):
        rows, cols = shape.values()
        spec = Spec(op, rows, cols, dtype, backward=variant == "bwd", quant_dtype=quant_dtype, topk=topk,
                    experts=experts)
        cases.append(_case(spec, device, providers, opts.seed, copy_tbps))
    return cases


# ----------------------------------------------------------------------------------------------------
# tables: the harness's TB/s tables, then the goals


def _fmt(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"


def _goal_verdict(group: Sequence[dict], variant: str, providers: Sequence[str]) -> str:
    """The line judging issue 7's goal over the group's shapes with N in GOAL_COLUMNS."""
    low, high = GOAL_COLUMNS
    if any(r.get("interpreter") for r in group):
        return "goals not judged under the CPU interpreter (its timings mean nothing)"
    cells = {(shape_label(r["shape"]), r["provider"]): r for r in group}
    lengths = {shape_label(r["shape"]): row_length(r["shape"]) for r in group}
    shapes = [s for s, n in lengths.items() if low <= n <= high]
    scope = f"worst over N {low}..{high}"
    if not shapes:
        return f"{scope}: no shape with N in that range, goal not judged"
    copy_goal = BACKWARD_COPY_GOAL if variant == "bwd" else FORWARD_COPY_GOAL
    measured = [s for s in shapes if (s, OURS) in cells]
    missing = [s for s in shapes if s not in measured]
    parts, missed = [], [f"no {OURS} figure at {', '.join(missing)}"] if missing else []
    if measured:
        fraction, at = min((cells[(s, OURS)]["copy_fraction"], s) for s in measured)
        parts.append(f"ours/copy {fraction:.3f} at {at} (goal >= {copy_goal})")
        if fraction < copy_goal:
            missed.append("ours/copy")
        for provider in (p for p in providers if p != OURS):
            ratios = [(cells[(s, OURS)]["p50"] / cells[(s, provider)]["p50"], s) for s in measured
                      if (s, provider) in cells]
            goal = EAGER_GOAL if provider == EAGER and variant == "fwd" else None
            if len(ratios) < len(measured) and goal is not None:
                missed.append(f"ours/{provider} not measured at every shape")
            if ratios:
                ratio, at = min(ratios)
                parts.append(f"ours/{provider} {ratio:.3f} at {at}" + (f" (goal >= {goal})" if goal else " (no goal)"))
                if goal is not None and ratio < goal:
                    missed.append(f"ours/{provider}")
        if EAGER not in providers and variant == "fwd":
            missed.append(f"ours/{EAGER} not measured")
    verdict = "goal met" if not missed else "goal MISSED (" + "; ".join(missed) + ")"
    return f"{scope} ({len(shapes)} shape(s))" + (": " + ", ".join(parts) if parts else "") + f" -> {verdict}"


def goals_tables(rows: Sequence[dict], markdown: bool = False) -> str:
    """Per (op, pass, dtype, layout): each provider's copy fraction, ours/eager and ours/compile per
    shape, and the line judging issue 7's goal."""
    blocks = []
    for (op, variant, dtype, layout), group, providers, cells, shapes in table_groups(
            [r for r in rows if "copy_fraction" in r]):
        others = [p for p in providers if p != OURS] if OURS in providers else []
        headers = ["shape", "MB moved", "copy TB/s"] + [f"{p}/copy" for p in providers] + [f"ours/{p}" for p in others]
        body = []
        for s in shapes:
            first = next(cells[(s, p)] for p in providers if (s, p) in cells)
            line = [s, f"{first['bytes_moved'] / 1e6:.4g}", f"{first['copy_tbps']:.3g}"]
            line += [_fmt(cells[(s, p)]["copy_fraction"]) if (s, p) in cells else "-" for p in providers]
            ours = cells.get((s, OURS))
            line += [_fmt(ours["p50"] / cells[(s, p)]["p50"]) if ours and (s, p) in cells else "-" for p in others]
            body.append(line)
        copy_goal = BACKWARD_COPY_GOAL if variant == "bwd" else FORWARD_COPY_GOAL
        goal = f"ours/copy >= {copy_goal}" + (f", ours/eager >= {EAGER_GOAL}" if variant == "fwd" else "")
        title = (f"{op} · {variant} · {dtype} · {layout} — fraction of the copy bandwidth and speedups "
                 f"(issue 7: {goal} at N {GOAL_COLUMNS[0]}..{GOAL_COLUMNS[1]})")
        text = ("#### " if markdown else "") + title + "\n\n" + format_table(headers, body, markdown)
        text += "\n\n" + ("- " if markdown else "  ") + _goal_verdict(group, variant, providers)
        blocks.append(text)
    return "\n\n".join(blocks)


def report_rows(rows: Sequence[dict], op_module=None, markdown: bool = False, interpreter_note: bool = True) -> str:
    text = harness.report(rows, op_module, markdown=markdown, interpreter_note=interpreter_note)
    goals = goals_tables(rows, markdown)
    return "\n\n".join(t for t in (text, goals) if t)


# ----------------------------------------------------------------------------------------------------
# check cases


def _check_case(name: str, spec: Spec, device: torch.device, seed: int, zero_row: bool = False) -> CheckCase:
    """tk's op on inputs from ``random_tensor`` against the reference, every row and output.
    ``zero_row``: x's second row is zeros (row_scale 0, q 0)."""

    def run() -> Comparison:
        gen = torch.Generator().manual_seed(seed)

        def random(shape, dtype):
            return random_tensor(shape, dtype, device, generator=gen)

        def experts_for(tokens, experts, k):
            return torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :k].to(device)

        x = spec.make_inputs(random, experts_for)
        if zero_row:
            x["x"][1] = 0
        if spec.backward:
            outputs = _backward_provider(spec, OURS, spec.tk_forward)(x)
        else:
            outputs = spec.tk_forward(x)
        if len(outputs) != len(spec.output_names()):
            raise AssertionError(f"{len(outputs)} outputs, expected {', '.join(spec.output_names())}")
        comparisons, nonfinite = spec.compare(outputs, spec.references(x, None), None)
        bad = {k: n for k, n in nonfinite.items() if n}
        worst = _worst(comparisons)
        if bad and worst.passed:
            raise AssertionError("non-finite elements in " + ", ".join(f"{k} ({n})" for k, n in bad.items()))
        return worst

    return CheckCase(name, run)


def _case_name(spec: Spec, zero_row: bool) -> str:
    name = f"{dtype_name(spec.dtype)}-{spec.variant}-" + "x".join(map(str, spec.shape.values()))
    if spec.moe:
        name += f"-k{spec.topk}-E{spec.experts}-ids{dtype_name(spec.ids_dtype)}"
    if spec.residual and spec.op in NORM_OPS:
        name += "-residual"
    if spec.x_bias:
        name += "-xbias"
    if spec.quant and spec.op in NORM_OPS:
        name += f"-{spec.quant}"
    if spec.quant_dtype is not None:
        name += f"-q{dtype_name(spec.quant_dtype)}"
    return name + ("-zero_row" if zero_row else "")


def check_cases(op: str, device: torch.device) -> list[CheckCase]:
    on_gpu = device.type == "cuda"
    bf16, fp16, fp32, int8, e4m3 = torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float8_e4m3fn
    seed = itertools.count(1)
    cases: list[CheckCase] = []

    def add(rows, cols, dtype, zero_row=False, **options):
        spec = Spec(op, rows, cols, dtype, **options)
        cases.append(_check_case(_case_name(spec, zero_row), spec, device, next(seed), zero_row))

    # (rows, N) at an even and an odd row length; N 4099 is one past the 4096 a single block holds
    small, odd = ((2048, 8192), (333, 4099)) if on_gpu else ((5, 1000), (3, 4099))
    if op in NORM_OPS:
        extra = {"x_bias": True} if op == LAYER_NORM_OP else {}
        add(*small, bf16)
        add(*odd, fp16, residual=True, **extra)
        add(*small, bf16, quant="smooth", quant_dtype=int8)
        add(*odd, fp32, residual=True, quant="dynamic", quant_dtype=e4m3)
        add(*small, bf16, backward=True)
        add(*odd, fp16, backward=True, residual=True, **extra)
        if on_gpu:
            add(1000, 32768, bf16)
            add(4096, 16384, bf16, backward=True)
    elif op == MOE_SMOOTH_QUANT_OP:
        add(*small, bf16, quant_dtype=int8, topk=2, experts=8 if on_gpu else 3)
        add(*odd, fp16, quant_dtype=e4m3, topk=3, experts=4, ids_dtype=torch.int64)
    else:
        add(*small, bf16, zero_row=op == DYNAMIC_QUANT_OP, quant_dtype=int8)
        add(*odd, fp16, quant_dtype=e4m3)
        add(*odd, fp32, quant_dtype=int8)
        if on_gpu:
            add(1000, 32768, bf16, quant_dtype=e4m3)
    return cases


# ----------------------------------------------------------------------------------------------------
# registration (bench/__init__.py: "tilekernels.bench.norm:LAYER_NORM", ...)


# ANCHORS.md: torch eager layer_norm 1.78-2.26 and rms_norm 1.83-2.13 TB/s on the H100 (bf16; the shapes
# are not given), so every forward row is compared with the top of the range.
ANCHOR_TBPS = {LAYER_NORM_OP: 2.26, RMS_NORM_OP: 2.13}


def anchor(row: dict):
    """ANCHORS.md's best torch-eager figure for a bf16 forward GPU row of layer_norm or rms_norm."""
    if row.get("interpreter") or row.get("dtype") != "bf16" or row.get("variant") != "fwd":
        return None
    value = ANCHOR_TBPS.get(row.get("op"))
    return None if value is None else ("H100 torch-eager anchor (top of range)", value)


class NormBench(harness.SharedModuleOp):
    """The harness's op interface for one of the six ops."""

    METRIC = "tbps"
    ANCHOR_PROVIDER = EAGER

    def __init__(self, name: str):
        super().__init__(name, sys.modules[__name__])
        self.FLOPS_FORMULA = FORMULAS[name]

    def anchor(self, row: dict):
        return anchor(row)


LAYER_NORM = NormBench(LAYER_NORM_OP)
RMS_NORM = NormBench(RMS_NORM_OP)
ADD_RMS_NORM_QUANT = NormBench(ADD_RMS_NORM_QUANT_OP)
DYNAMIC_QUANT = NormBench(DYNAMIC_QUANT_OP)
SMOOTH_QUANT = NormBench(SMOOTH_QUANT_OP)
MOE_SMOOTH_QUANT = NormBench(MOE_SMOOTH_QUANT_OP)
