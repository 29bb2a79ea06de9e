"""tk.layer_norm / tk.rms_norm (and their quantised outputs) against the fp64 reference of
``tilekernels.norm.reference``, by the error-ratio rule of ``tilekernels.testing``.

y within 2x of the error PyTorch makes with ``F.layer_norm`` / ``F.rms_norm`` in x's own dtype;
``s = x + residual`` bit-exact (with an ``x_bias`` too, a sum of three, by the rule); gradients within 3x
of PyTorch's low-precision autograd, against fp64 autograd through the reference. Quantised outputs
(``assert_quant_close``): every element of q within one quantisation step of ``z * QMAX / amax`` and
equal to the exact quantisation on all but 0.2% of the elements (quantising the bf16-rounded y instead
of the fp32 y misses on 1-3%), row_scale by the rule against PyTorch's fp32 answer. Tensors the ops
allocate are NaN-filled by torch (``fill_uninitialized_memory`` under deterministic mode) so an element
no kernel wrote shows up.

CPU lane (no marker; ``TRITON_INTERPRET=1``): N 1, 7, 1000 (one pass under the interpreter, whose
one-pass limit is 1024 columns), 4099 and 70000 (multi-pass); padded, strided, 1-D, 3-D and transposed
3-D x; without weight or bias; residual, x_bias, eps; weights in another dtype; quantised outputs in
every layout of the returned tuple, zero rows, empty inputs; backward with both outputs in the loss,
determinism; quant with autograd refused; torch.compile, fake tensors and opcheck; argument checks.

GPU lane (``-m gpu``): real sizes (M 4096, N 4096..32768 and a 131072 row), backward at N 8192 and
32768, CUDA graph capture of forward and backward, no host synchronisation, fp8/int8 outputs.

Ids read ``layer_norm-bf16-M3N4099-padded-residual-xbias``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
import triton
import torch.nn.functional as F

import tilekernels as tk
from tilekernels.norm import _kernels as kern
from tilekernels.norm.reference import (
    assert_quant_close,
    quant_steps,
    reference_layer_norm,
    reference_quant,
    reference_rms_norm,
)
from tilekernels.testing import assert_close, assert_no_host_sync, capture_graph, random_tensor

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
QUANT_DTYPES = {"int8": torch.int8, "e4m3": torch.float8_e4m3fn}
QUANT_NAMES = {v: k for k, v in QUANT_DTYPES.items()}
OPS = ("layer_norm", "rms_norm")
DEFAULT_EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}
LAYOUTS = ("2d", "padded", "step", "1d", "3d", "3d-transposed")

gpu = pytest.mark.gpu


# ====================================================================================================
# cases, inputs and the checks every test uses


@dataclasses.dataclass(frozen=True)
class NormCase:
    """One norm problem. ``M`` rows of ``N`` (``3d``: ``[2, M, N]``, ``1d``: one row ``[N]``); layout of
    x: ``2d`` contiguous, ``padded`` (rows of a wider tensor: row stride > N), ``step`` (every other
    column), ``3d``, ``3d-transposed`` (``[M, 2, N].transpose(0, 1)``: no single row stride).
    ``eps=None`` leaves the op's default; ``param_dtype`` is weight/bias/x_bias's dtype (None: x's);
    x is ``scale * N(0, 1) + offset``."""

    op: str
    dtype: torch.dtype
    M: int
    N: int
    layout: str = "2d"
    weight: bool = True
    bias: bool = True
    residual: bool = False
    x_bias: bool = False
    eps: float | None = None
    param_dtype: torch.dtype | None = None
    scale: float = 1.0
    offset: float = 0.0

    @property
    def name(self) -> str:
        parts = [self.op, DTYPE_NAMES[self.dtype], f"M{self.M}N{self.N}", self.layout]
        if not self.weight:
            parts.append("noweight")
        if self.op == "layer_norm" and not self.bias:
            parts.append("nobias")
        if self.residual:
            parts.append("residual")
        if self.x_bias:
            parts.append("xbias")
        if self.eps is not None:
            parts.append(f"eps{self.eps:g}")
        if self.param_dtype is not None:
            parts.append(f"params-{DTYPE_NAMES[self.param_dtype]}")
        if self.scale != 1.0:
            parts.append(f"scale{self.scale:g}")
        if self.offset:
            parts.append(f"offset{self.offset:g}")
        return "-".join(parts)

    def param(self, marks=()):
        return pytest.param(self, id=self.name, marks=marks)

    @property
    def ref_eps(self) -> float:
        return DEFAULT_EPS[self.op] if self.eps is None else self.eps


def norm_case(op, dtype, M, N, **kw) -> NormCase:
    if op == "rms_norm":
        kw.setdefault("bias", False)
    return NormCase(op, dtype, M, N, **kw)


def make_x(case: NormCase, device) -> torch.Tensor:
    M, N = case.M, case.N

    def t(*shape):
        x = torch.randn(shape, dtype=torch.float32) * case.scale + case.offset
        return x.to(device=device, dtype=case.dtype)

    if case.layout == "2d":
        return t(M, N)
    if case.layout == "padded":
        return t(M, N + 11)[:, 5:N + 5]
    if case.layout == "step":
        return t(M, 2 * N)[:, ::2]
    if case.layout == "1d":
        return t(N)
    if case.layout == "3d":
        return t(2, M, N)
    if case.layout == "3d-transposed":
        return t(M, 2, N).transpose(0, 1)
    raise ValueError(case.layout)


def make_inputs(case: NormCase, device) -> dict:
    """The op's tensors by keyword: x, weight, bias (layer_norm), residual, x_bias, each random or None."""
    N, pdt = case.N, case.param_dtype or case.dtype
    x = make_x(case, device)
    inputs = {"x": x, "weight": random_tensor((N,), pdt, device) if case.weight else None}
    if case.op == "layer_norm":
        inputs["bias"] = random_tensor((N,), pdt, device) if case.bias else None
        inputs["x_bias"] = random_tensor((N,), pdt, device) if case.x_bias else None
    inputs["residual"] = random_tensor(x.shape, case.dtype, device) if case.residual else None
    return inputs


def call(case: NormCase, inputs: dict, **options):
    """The op with the case's inputs (None-valued keywords left out) and ``options``."""
    kwargs = {key: value for key, value in inputs.items() if key not in ("x", "weight") and value is not None}
    if case.eps is not None:
        kwargs["eps"] = case.eps
    fn = tk.layer_norm if case.op == "layer_norm" else tk.rms_norm
    return fn(inputs["x"], inputs["weight"], **kwargs, **options)


def reference(case: NormCase, inputs: dict, compute_dtype=torch.float64, x_dtype=None):
    """``(y, s)`` of the reference for the case's inputs."""
    if case.op == "layer_norm":
        return reference_layer_norm(inputs["x"], inputs["weight"], inputs["bias"], case.ref_eps,
                                    residual=inputs["residual"], x_bias=inputs["x_bias"],
                                    compute_dtype=compute_dtype, x_dtype=x_dtype)
    return reference_rms_norm(inputs["x"], inputs["weight"], case.ref_eps, residual=inputs["residual"],
                              compute_dtype=compute_dtype, x_dtype=x_dtype)


def check_like_x(name: str, out: torch.Tensor, x: torch.Tensor, dtype=None) -> None:
    expected = x.dtype if dtype is None else dtype
    assert tuple(out.shape) == tuple(x.shape), f"{name}: shape {tuple(out.shape)} != x's {tuple(x.shape)}"
    assert out.dtype == expected, f"{name}: dtype {out.dtype} != {expected}"
    assert out.device == x.device, f"{name}: on {out.device}, x on {x.device}"


def check_s(name: str, case: NormCase, inputs: dict, s: torch.Tensor) -> None:
    """s is ``x (+ x_bias) + residual`` rounded to x's dtype: bit-exact for a sum of two (one rounding
    of an exact sum), by the rule for three (the kernel's fp32 sum rounds twice)."""
    check_like_x(f"{name} s", s, inputs["x"])
    ref_s = reference(case, inputs)[1]
    if inputs.get("x_bias") is None:
        got = s.detach().to(device="cpu", dtype=torch.float64)
        differ = got != ref_s
        if bool(differ.any()):
            first = tuple(int(i) for i in differ.nonzero()[0])
            raise AssertionError(f"{name}: s differs from (x + residual) rounded to x's dtype in "
                                 f"{int(differ.sum())} elements, first at {first} (s {got[first].item()}, "
                                 f"expected {ref_s[first].item()})")
    else:
        assert_close(f"{name} s", s, ref_s, reference(case, inputs, None)[1])


def check_forward(name: str, case: NormCase, inputs: dict, result) -> None:
    """The unquantised result ``y`` or ``(y, s)`` against the reference."""
    if case.residual:
        assert isinstance(result, tuple) and len(result) == 2, f"{name}: expected (y, s), got {type(result)}"
        y, s = result
        check_s(name, case, inputs, s)
    else:
        assert isinstance(result, torch.Tensor), f"{name}: expected y alone, got {type(result)}"
        y = result
    check_like_x(f"{name} y", y, inputs["x"])
    assert_close(f"{name} y", y, reference(case, inputs)[0], reference(case, inputs, None)[0])


def quant_result(result, *, residual: bool, return_unquantized: bool):
    """Split a quantised result by the documented order: ``(q, row_scale[, y][, s])``."""
    expected = 2 + int(return_unquantized) + int(residual)
    assert isinstance(result, tuple) and len(result) == expected, \
        f"expected a tuple of {expected} outputs, got {type(result).__name__} of {len(result)}"
    q, row_scale, rest = result[0], result[1], list(result[2:])
    y = rest.pop(0) if return_unquantized else None
    s = rest.pop(0) if residual else None
    return q, row_scale, y, s


# ====================================================================================================
# CPU lane: the reference itself


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_reference_matches_torch_in_fp64(dtype):
    """The fp64 reference is F.layer_norm / F.rms_norm in fp64 of the rounded sum, and its
    straight-through rounding gives the gradients of normalising ``x + residual`` exactly."""
    M, N = 4, 37
    x, residual = random_tensor((M, N), dtype), random_tensor((M, N), dtype)
    weight, bias, x_bias = (random_tensor((N,), torch.float32) for _ in range(3))
    s = (x.double() + x_bias.double() + residual.double()).to(dtype).double()
    y, ref_s = reference_layer_norm(x, weight, bias, 1e-5, residual=residual, x_bias=x_bias)
    assert torch.equal(ref_s, s)
    torch.testing.assert_close(y, F.layer_norm(s, (N,), weight.double(), bias.double(), 1e-5), rtol=1e-13, atol=1e-13)
    y, ref_s = reference_rms_norm(x, weight, 1e-6, residual=residual)
    s = (x.double() + residual.double()).to(dtype).double()
    torch.testing.assert_close(y, F.rms_norm(s, (N,), weight.double(), 1e-6), rtol=1e-13, atol=1e-13)

    leaves = [t.double().requires_grad_() for t in (x, weight, residual)]
    y, ref_s = reference_rms_norm(leaves[0], leaves[1], 1e-6, residual=leaves[2], x_dtype=dtype)
    assert torch.equal(ref_s, s)
    dy, ds = random_tensor((M, N), torch.float64), random_tensor((M, N), torch.float64)
    dx, dw, dres = torch.autograd.grad((y, ref_s), leaves, (dy, ds))
    s_leaf, w_leaf = s.clone().requires_grad_(), weight.double().requires_grad_()
    ds_expected, dw_expected = torch.autograd.grad(F.rms_norm(s_leaf, (N,), w_leaf, 1e-6), (s_leaf, w_leaf), dy)
    torch.testing.assert_close(dx, ds_expected + ds, rtol=1e-13, atol=1e-13)
    assert torch.equal(dx, dres)
    torch.testing.assert_close(dw, dw_expected, rtol=1e-13, atol=1e-13)


def test_reference_quant_rules():
    """Half-to-even rounding, QMAX at amax, zero rows and NaN rows, the e4m3 grid."""
    z = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5], [0.0] * 7,
                      [math.nan, 1.0, 0, 0, 0, 0, 0]], dtype=torch.float64)
    q, scale = reference_quant(z, torch.int8)
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, 126], [0] * 7, [0] * 7]
    assert scale[0].item() == 1.0 and scale[1].item() == 0.0 and math.isnan(scale[2].item())
    z8 = torch.tensor([[448.0, 17.0, 19.0, -0.1, 0.0]], dtype=torch.float64)
    q8, scale8 = reference_quant(z8, torch.float8_e4m3fn)
    assert q8.float().tolist() == [[448.0, 16.0, 20.0, -0.1015625, 0.0]] and scale8.item() == 1.0
    assert float(quant_steps(q8, z8, torch.float8_e4m3fn).max()) <= 0.5
    assert float(quant_steps(q, z, torch.int8).max()) <= 0.5
    assert float(quant_steps(q.clone().fill_(0), z, torch.int8).max()) == 127.0


# ====================================================================================================
# CPU lane: forward


SHAPE_CASES = [norm_case(op, dt, M, N) for op in OPS for dt in DTYPES.values()
               for N in (1, 7, 1000, 4099) for M in (1, 3, 5)]


@pytest.mark.parametrize("case", [c.param() for c in SHAPE_CASES])
def test_forward_shapes(case, device, poison_allocations):
    inputs = make_inputs(case, device)
    check_forward(case.name, case, inputs, call(case, inputs))


def _option_cases():
    cases = []
    for dt in DTYPES.values():
        for op in OPS:
            cases += [
                norm_case(op, dt, 3, 1000, weight=False),
                norm_case(op, dt, 3, 4099, residual=True),
                norm_case(op, dt, 5, 1000, residual=True),
                norm_case(op, dt, 3, 7, residual=True),
                norm_case(op, dt, 3, 1000, layout="padded"),
                norm_case(op, dt, 3, 4099, layout="padded", residual=True),
                norm_case(op, dt, 3, 1000, layout="step"),
                norm_case(op, dt, 3, 1000, layout="3d", residual=True),
                norm_case(op, dt, 3, 4099, layout="3d-transposed"),
                norm_case(op, dt, 1, 1000, layout="1d", residual=True),
                norm_case(op, dt, 3, 1000, eps=0.1, scale=0.1),
                norm_case(op, dt, 3, 1000, eps=0.0),
                # small x: the default eps is a large part of the variance, so the right default shows
                norm_case(op, dt, 3, 1000, scale=1e-3),
            ]
        cases += [
            norm_case("layer_norm", dt, 3, 1000, bias=False),
            norm_case("layer_norm", dt, 3, 1000, weight=False, bias=False),
            norm_case("layer_norm", dt, 3, 1000, x_bias=True),
            norm_case("layer_norm", dt, 3, 4099, x_bias=True, residual=True),
            norm_case("layer_norm", dt, 3, 1000, x_bias=True, residual=True, layout="3d"),
        ]
    cases += [
        norm_case(op, torch.bfloat16, 3, 4099, param_dtype=torch.float32, residual=True, x_bias=op == "layer_norm")
        for op in OPS
    ] + [
        norm_case(op, torch.float32, 3, 1000, param_dtype=torch.bfloat16) for op in OPS
    ] + [
        # a mean far from 0: a single-pass E[x^2] - E[x]^2 variance loses digits that PyTorch keeps
        norm_case("layer_norm", torch.float32, 3, N, offset=30.0) for N in (1000, 4099)
    ] + [
        norm_case("layer_norm", torch.float32, 2, 70000, residual=True, x_bias=True),
        norm_case("rms_norm", torch.bfloat16, 2, 70000, residual=True),
    ]
    return [c.param() for c in cases]


@pytest.mark.parametrize("case", _option_cases())
def test_forward_options(case, device, poison_allocations):
    inputs = make_inputs(case, device)
    check_forward(case.name, case, inputs, call(case, inputs))


@pytest.mark.parametrize("N", [64, 3000], ids=["one-pass", "chunked"])
def test_layer_norm_fp32_variance_overflow(N, device):
    """A finite fp32 row whose squared deviations overflow fp32: y stays finite (rstd 0, as PyTorch's
    fp32 layer_norm gives), and the other rows are untouched. The fp32 statistics divide exactly; an
    inf there must not turn into NaN."""
    x = random_tensor((3, N), torch.float32, device)
    x[1] = 0.0
    x[1, 0], x[1, 1] = 3e19, -3e19
    weight = torch.ones(N, device=device)
    bias = torch.zeros(N, device=device)
    y = tk.layer_norm(x, weight, bias)
    assert bool(torch.isfinite(y).all()), "NaN or inf in y of a finite row"
    expect = torch.nn.functional.layer_norm(x, (N,), weight, bias)
    assert torch.equal(y[1], expect[1]), f"overflowing row: {y[1, :4].tolist()} against {expect[1, :4].tolist()}"
    ref = torch.nn.functional.layer_norm(x[[0, 2]].double(), (N,), weight.double(), bias.double())
    assert (y[[0, 2]].double() - ref).abs().max().item() < 1e-5


def test_forward_empty_rows(device, poison_allocations):
    """M == 0 rows: empty outputs of the right shapes, quantised ones too."""
    for op in OPS:
        case = norm_case(op, torch.bfloat16, 0, 64, residual=True)
        inputs = make_inputs(case, device)
        y, s = call(case, inputs)
        check_like_x(f"{op} y", y, inputs["x"])
        check_like_x(f"{op} s", s, inputs["x"])
        q, row_scale, s = call(case, inputs, quant="dynamic")
        check_like_x(f"{op} q", q, inputs["x"], torch.int8)
        assert tuple(row_scale.shape) == (0,)


def test_forward_does_not_write_inputs(device):
    """x, residual and the parameters are read, never written (s is a new tensor)."""
    case = norm_case("layer_norm", torch.bfloat16, 3, 4099, residual=True, x_bias=True)
    inputs = make_inputs(case, device)
    copies = {key: value.clone() for key, value in inputs.items() if value is not None}
    _, s = call(case, inputs)
    for key, value in copies.items():
        assert torch.equal(inputs[key], value), f"{key} was written"
    assert s.data_ptr() not in (inputs["x"].data_ptr(), inputs["residual"].data_ptr())


# ----------------------------------------------------------------------------------------------------
# quantised outputs


def quant_cases():
    """(case, quant, quant_dtype, return_unquantized)."""
    params = []
    for op in OPS:
        for quant in ("dynamic", "smooth"):
            for qname, qdt in QUANT_DTYPES.items():
                for residual in (False, True):
                    for ret in (False, True):
                        dt = torch.bfloat16 if residual else torch.float16
                        N = 4099 if ret else 1000
                        case = norm_case(op, dt, 3, N, residual=residual, x_bias=op == "layer_norm" and ret)
                        name = f"{case.name}-{quant}-{qname}" + ("-unquantized" if ret else "")
                        params.append(pytest.param(case, quant, qdt, ret, id=name))
    for dt in (torch.float32, torch.bfloat16):
        case = norm_case("rms_norm", dt, 2, 7, layout="3d-transposed")
        params.append(pytest.param(case, "dynamic", torch.int8, False, id=f"{case.name}-dynamic-int8"))
    case = norm_case("layer_norm", torch.float32, 1, 1000, layout="1d")
    params.append(pytest.param(case, "smooth", torch.float8_e4m3fn, True, id=f"{case.name}-smooth-e4m3-unquantized"))
    case = norm_case("rms_norm", torch.bfloat16, 2, 70000, residual=True)
    params.append(pytest.param(case, "smooth", torch.float8_e4m3fn, False, id=f"{case.name}-smooth-e4m3"))
    return params


def check_norm_quant(name, case, inputs, result, quant, quant_dtype, smooth_scale, return_unquantized):
    q, row_scale, y, s = quant_result(result, residual=case.residual, return_unquantized=return_unquantized)
    x = inputs["x"]
    ref_y = reference(case, inputs)[0]
    torch_y = reference(case, inputs, torch.float32)[0]
    z, torch_z = ref_y, torch_y
    if quant == "smooth":
        z = ref_y * smooth_scale.to(device="cpu", dtype=torch.float64)
        torch_z = torch_y * smooth_scale.to(torch.float32)
    # row_scale rides on the kernel's fp32 mean/variance, which PyTorch computes differently: ratio 3
    assert_quant_close(name, q, row_scale, z, torch_z, quant_dtype, ratio=3.0)
    if y is not None:
        check_like_x(f"{name} y", y, x)
        assert_close(f"{name} y", y, ref_y, reference(case, inputs, None)[0])
    if s is not None:
        check_s(name, case, inputs, s)


def test_forward_kind_of_a_norm_with_quantised_rows_only(monkeypatch, device):
    """A norm whose quantised rows are all a call returns looks up its own configs (kind "layer+dynamic" ...);
    with a residual, x_bias or the unquantised y as well it keeps the norms' (kind None)."""
    from tilekernels.norm import _kernels as kern
    from tilekernels.norm import norm as norm_module

    kinds = []
    real = kern.forward_config
    monkeypatch.setattr(kern, "forward_config", lambda N, dev, kind=None: kinds.append(kind) or real(N, dev, kind))
    x = torch.randn(4, 64, device=device)
    w, b, smooth = torch.randn(64, device=device), torch.randn(64, device=device), torch.rand(64, device=device) + 0.5
    calls = [lambda: tk.layer_norm(x, w, b, quant="dynamic"),
             lambda: tk.rms_norm(x, w, quant="smooth", smooth_scale=smooth),
             lambda: tk.layer_norm(x, w, b, quant="dynamic", residual=x),
             lambda: tk.rms_norm(x, w, quant="dynamic", return_unquantized=True),
             lambda: tk.layer_norm(x, w, b)]
    for fn in calls:
        norm_module._FORWARD_PLANS.clear()
        fn()
    norm_module._FORWARD_PLANS.clear()
    assert kinds == ["layer+dynamic", "rms+smooth", None, None, None]


@pytest.mark.parametrize("case, quant, quant_dtype, return_unquantized", quant_cases())
def test_quantized_outputs(case, quant, quant_dtype, return_unquantized, device, poison_allocations):
    inputs = make_inputs(case, device)
    smooth_scale = None
    options = {"quant": quant, "quant_dtype": quant_dtype}
    if return_unquantized:
        options["return_unquantized"] = True
    if quant == "smooth":
        smooth_scale = torch.rand(case.N, device=device) + 0.5
        options["smooth_scale"] = smooth_scale
    result = call(case, inputs, **options)
    check_norm_quant(case.name, case, inputs, result, quant, quant_dtype, smooth_scale, return_unquantized)


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
@pytest.mark.parametrize("op", OPS)
def test_quantized_zero_row(op, quant_dtype, device, poison_allocations):
    """A row whose y is all zeros has row_scale 0 and q 0 (not NaN); the other rows are unaffected."""
    case = norm_case(op, torch.bfloat16, 3, 1000, bias=False)
    inputs = make_inputs(case, device)
    inputs["x"][1] = 0
    q, row_scale = call(case, inputs, quant="dynamic", quant_dtype=quant_dtype)
    assert row_scale[1].item() == 0.0, f"row_scale of a zero row is {row_scale[1].item()}"
    assert bool((q[1].float() == 0).all()), "q of a zero row is not all 0"
    ref_y = reference(case, inputs)[0]
    assert_quant_close(f"{op}-zero-row", q, row_scale, ref_y, reference(case, inputs, torch.float32)[0], quant_dtype,
                       ratio=3.0)


def test_quantized_with_autograd_is_refused(device):
    """Quantised outputs have no backward: an input that requires grad is refused, not ignored."""
    case = norm_case("rms_norm", torch.float32, 3, 64)
    inputs = make_inputs(case, device)
    inputs["weight"].requires_grad_()
    with pytest.raises(ValueError, match=r"quant|grad"):
        call(case, inputs, quant="dynamic")
    with torch.no_grad():
        call(case, inputs, quant="dynamic")


# ====================================================================================================
# CPU lane: backward


BACKWARD_VARIANTS = {
    # name: case fields; with a residual the loss takes both y and s
    "plain": {},
    "noweight": {"weight": False, "bias": False},
    "residual": {"residual": True},
    "residual-xbias": {"residual": True, "x_bias": True},
    "padded-residual": {"residual": True, "layout": "padded"},
}


def backward_cases():
    params = []
    for op in OPS:
        for dt in (torch.float32, torch.bfloat16):
            for N in (7, 1000, 4099):
                for variant, fields in BACKWARD_VARIANTS.items():
                    if op == "rms_norm" and "xbias" in variant:
                        continue
                    if N != 1000 and variant in ("noweight", "padded-residual"):
                        continue
                    # the multi-block backward is slow under the interpreter: its fullest variant only
                    if N == 4099 and variant != ("residual-xbias" if op == "layer_norm" else "residual"):
                        continue
                    params.append(norm_case(op, dt, 3, N, **fields).param())
        params.append(norm_case(op, torch.bfloat16, 5, 1000, layout="3d", residual=True,
                                param_dtype=torch.float32).param())
    return params


def grad_leaves(case, inputs):
    return [key for key in ("x", "weight", "bias", "residual", "x_bias") if inputs.get(key) is not None]


def run_backward(case, inputs, grad_y, grad_s):
    """The op's gradients for every tensor input, with the loss ``<y, grad_y> + <s, grad_s>``."""
    keys = grad_leaves(case, inputs)
    leaves = {key: inputs[key].detach().clone().requires_grad_() for key in keys}
    result = call(case, {**inputs, **leaves})
    outputs, grads = (result, (grad_y, grad_s)) if case.residual else ((result,), (grad_y,))
    return dict(zip(keys, torch.autograd.grad(outputs, [leaves[k] for k in keys], grads)))


def reference_grads(case, inputs, grad_y, grad_s, compute_dtype):
    keys = grad_leaves(case, inputs)
    if compute_dtype == torch.float64:
        leaves = {key: inputs[key].detach().to(device="cpu", dtype=torch.float64).requires_grad_() for key in keys}
        grad_y, grad_s = (g.to(device="cpu", dtype=torch.float64) for g in (grad_y, grad_s))
    else:
        leaves = {key: inputs[key].detach().clone().requires_grad_() for key in keys}
    y, s = reference(case, {**inputs, **leaves}, compute_dtype, x_dtype=case.dtype)
    outputs, grads = ((y, s), (grad_y, grad_s)) if case.residual else ((y,), (grad_y,))
    return dict(zip(keys, torch.autograd.grad(outputs, [leaves[k] for k in keys], grads)))


def _grad_outputs(case, inputs):
    x = inputs["x"]
    return random_tensor(x.shape, case.dtype, x.device), random_tensor(x.shape, case.dtype, x.device)


@pytest.mark.parametrize("case", backward_cases())
def test_backward(case, device, poison_allocations):
    check_backward(case, device, layouts=True)


def check_backward(case, device, layouts: bool):
    """Every gradient of ``case`` against the fp64 reference (FlashAttention's 3x rule); ``layouts``:
    also each gradient's shape, dtype and strides against its input's."""
    inputs = make_inputs(case, device)
    grad_y, grad_s = _grad_outputs(case, inputs)
    got = run_backward(case, inputs, grad_y, grad_s)
    exact = reference_grads(case, inputs, grad_y, grad_s, torch.float64)
    low = reference_grads(case, inputs, grad_y, grad_s, None)
    for key, grad in got.items():
        if layouts:
            check_like_x(f"{case.name} d{key}", grad, inputs[key])
        assert_close(f"{case.name} d{key}", grad, exact[key], low[key], ratio=3.0)


@pytest.mark.parametrize("op", OPS)
def test_backward_deterministic(op, device):
    """dweight / dbias (reduced over rows across programs) bit-identical run to run; dx too."""
    case = norm_case(op, torch.bfloat16, 19, 1000, residual=True, x_bias=op == "layer_norm",
                     param_dtype=torch.float32)
    inputs = make_inputs(case, device)
    grad_y, grad_s = _grad_outputs(case, inputs)
    first = run_backward(case, inputs, grad_y, grad_s)
    second = run_backward(case, inputs, grad_y, grad_s)
    for key in first:
        assert torch.equal(first[key], second[key]), f"{case.name}: d{key} differs between two runs"


@contextlib.contextmanager
def _override(key, value):
    """``_kernels.config_override[key] = value`` for the block (None: leave it unset)."""
    saved = kern.config_override.copy()
    if value is not None:
        kern.config_override[key] = value
    try:
        yield
    finally:
        kern.config_override.clear()
        kern.config_override.update(saved)


def _persistent_forward_calls(device):
    """(name, call) pairs covering every forward kind: norms with residual / x_bias, their quantised
    outputs, and the three quant ops (smooth: one scale row; MoE: a row per expert)."""
    M, N, T, E = 37, 600, 13, 5
    x = random_tensor((M, N), torch.bfloat16, device)
    res = random_tensor((M, N), torch.bfloat16, device)
    w, b, xb = (random_tensor((N,), torch.float32, device) for _ in range(3))
    smooth = torch.rand(N, device=device) + 0.5
    smooth_rows = torch.rand(E, N, device=device) + 0.5
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)]).to(device=device, dtype=torch.int32)
    return [
        ("layer", lambda: tk.layer_norm(x, w, b, residual=res, x_bias=xb)),
        ("rms-smooth", lambda: tk.rms_norm(x, w, residual=res, quant="smooth", smooth_scale=smooth,
                                           return_unquantized=True)),
        ("layer-dynamic-fp8", lambda: tk.layer_norm(x, w, b, quant="dynamic", quant_dtype=torch.float8_e4m3fn)),
        ("dynamic", lambda: tk.dynamic_quant(x)),
        ("smooth", lambda: tk.smooth_quant(x, smooth)),
        ("moe", lambda: tk.moe_smooth_quant(x[:T], smooth_rows, ids)),
    ]


@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
@pytest.mark.parametrize("block_m", [1, 2])
def test_forward_persistent_is_bit_identical(block_m, prefetch, device):
    """The persistent whole-row forward (weight, bias, smooth_scale loaded once per program; with
    prefetch the next tile's x and residual loaded ahead) gives the bits of one program per tile,
    for a row count that leaves the last tile partial and programs with different tile counts."""
    calls = _persistent_forward_calls(device)
    with torch.no_grad():
        expected = [(name, fn()) for name, fn in calls]
        config = kern.RowConfig(block_m, 1024, 4, programs_per_sm=1, prefetch=prefetch, persistent=True)
        with _override("forward", config):
            got = [(name, fn()) for name, fn in calls]
    for (name, want), (_, have) in zip(expected, got):
        for i, (a, b) in enumerate(zip(want, have)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name}: output {i} differs"


@pytest.mark.parametrize("sms", [132, 114, 7])
def test_persistent_forward_grid_is_balanced(sms, monkeypatch):
    """The persistent forward grid takes the fewest programs that need as many rounds as SM count x
    programs_per_sm would (never more programs than that, nor than tiles)."""
    monkeypatch.setattr(kern, "sm_count", lambda device: sms)
    for per_sm in (1, 2):
        config = kern.RowConfig(2, 1024, 4, programs_per_sm=per_sm, persistent=True)
        cap = per_sm * sms
        for M in list(range(1, 600)) + [4095, 4096, 4097, 65536]:
            tiles = triton.cdiv(M, 2)
            grid = kern.forward_grid(M, 4096, config, "cpu")
            assert 1 <= grid <= min(tiles, cap)
            rounds = triton.cdiv(tiles, min(tiles, cap))
            assert triton.cdiv(tiles, grid) == rounds, (M, grid)
            assert grid == 1 or triton.cdiv(tiles, grid - 1) > rounds, (M, grid)
    config = kern.RowConfig(1, 16384, 16, programs_per_sm=1, persistent=True)
    if sms == 132:   # smooth_quant at 4096 x 32768 on an H100: 32 rows each for 128 programs, not 31-32 for 132
        assert kern.forward_grid(4096, 32768, config, "cpu") == 128


def test_backward_only_s_used(device):
    """With only s in the loss, dx = dresidual = grad_s and dweight = 0 (y's gradient is absent)."""
    case = norm_case("layer_norm", torch.float32, 3, 1000, residual=True)
    inputs = make_inputs(case, device)
    leaves = {key: inputs[key].detach().clone().requires_grad_() for key in grad_leaves(case, inputs)}
    _, s = call(case, {**inputs, **leaves})
    grad_s = random_tensor(s.shape, s.dtype, device)
    s.backward(grad_s)
    assert torch.equal(leaves["x"].grad, grad_s) and torch.equal(leaves["residual"].grad, grad_s)
    assert leaves["weight"].grad is None or not bool(leaves["weight"].grad.any())


# ====================================================================================================
# CPU lane: torch.compile and custom-op registration


def test_torch_compile_fullgraph(device):
    """layer_norm with a residual (forward and backward), rms_norm with quantised outputs, under
    torch.compile(fullgraph=True): bit-equal to eager."""
    torch._dynamo.reset()
    case = norm_case("layer_norm", torch.bfloat16, 5, 1000, residual=True, x_bias=True)
    inputs = make_inputs(case, device)
    grad_y, grad_s = _grad_outputs(case, inputs)
    keys = grad_leaves(case, inputs)

    def step(x, weight, bias, residual, x_bias):
        y, s = tk.layer_norm(x, weight, bias, residual=residual, x_bias=x_bias)
        with torch.no_grad():
            q, row_scale, s2 = tk.rms_norm(x.detach(), weight.detach(), residual=residual.detach(), quant="dynamic",
                                           quant_dtype=torch.float8_e4m3fn)
        return y, s, q, row_scale, s2

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (compiled, step):
        leaves = [inputs[key].detach().clone().requires_grad_() for key in keys]
        out = fn(*leaves)
        grads = torch.autograd.grad(out[:2], leaves, (grad_y, grad_s))
        results.append((*out, *grads))
    labels = ("y", "s", "q", "row_scale", "s2", *(f"d{key}" for key in keys))
    for label, first, second in zip(labels, *results):
        assert torch.equal(first.float(), second.float()), f"compiled and eager {label} differ"


def _fake_tensor_calls(device):
    """(label, fn, args, kwargs) covering every output layout of the public functions."""
    x3 = random_tensor((2, 3, 40), torch.bfloat16, device)
    r3 = random_tensor((2, 3, 40), torch.bfloat16, device)
    w = random_tensor((40,), torch.float32, device)
    ss = torch.rand(40, device=device) + 0.5
    x2 = random_tensor((5, 40), torch.float16, device)
    ids = torch.tensor([[0, 1]] * 5, dtype=torch.int64, device=device)
    return [
        ("ln", tk.layer_norm, (x3, w, w), {}),
        ("ln-residual", tk.layer_norm, (x3, w, w), {"residual": r3, "x_bias": w}),
        ("ln-quant", tk.layer_norm, (x3, w), {"quant": "dynamic"}),
        ("ln-quant-all", tk.layer_norm, (x3, w), {"residual": r3, "quant": "smooth", "smooth_scale": ss,
                                                 "quant_dtype": torch.float8_e4m3fn, "return_unquantized": True}),
        ("rms-residual-quant", tk.rms_norm, (x3, w), {"residual": r3, "quant": "dynamic"}),
        ("rms-quant-y", tk.rms_norm, (x3, w), {"quant": "dynamic", "return_unquantized": True}),
        ("add-rms", tk.add_rms_norm_quant, (x3, r3, w), {}),
        ("dynamic", tk.dynamic_quant, (x3, torch.float8_e4m3fn), {}),
        ("smooth", tk.smooth_quant, (x2, ss), {}),
        ("moe", tk.moe_smooth_quant, (x2, torch.stack([ss, ss]), ids), {}),
    ]


def test_fake_tensor_outputs(device):
    """Under FakeTensorMode (what torch.compile traces with) every public call gives outputs of the
    shapes, dtypes and devices the real kernels give."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for label, fn, args, kwargs in _fake_tensor_calls(device):
        real = fn(*args, **kwargs)
        real = real if isinstance(real, tuple) else (real,)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake_kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            fake = fn(*fake_args, **fake_kwargs)
        fake = fake if isinstance(fake, tuple) else (fake,)
        assert len(fake) == len(real), f"{label}: {len(fake)} fake outputs, {len(real)} real"
        for i, (f, r) in enumerate(zip(fake, real)):
            assert (tuple(f.shape), f.dtype, f.device) == (tuple(r.shape), r.dtype, r.device), \
                f"{label} output {i}: fake {tuple(f.shape)} {f.dtype} {f.device}, real {tuple(r.shape)} {r.dtype} {r.device}"


def test_custom_op_registration(device):
    """Schema, fake implementation and autograd registration of the row-norm forward op agree with
    the real kernels (layer norm with residual and x_bias; rms norm with quantised outputs)."""
    M, N = 5, 40
    x = random_tensor((M, N), torch.bfloat16, device).requires_grad_()
    residual = random_tensor((M, N), torch.bfloat16, device).requires_grad_()
    weight = random_tensor((N,), torch.float32, device).requires_grad_()
    bias, x_bias = (random_tensor((N,), torch.float32, device).requires_grad_() for _ in range(2))
    smooth_scale = torch.rand(N, device=device) + 0.5
    cases = [
        (x, weight, bias, residual, x_bias, None, None, 1e-5, "layer", "none", torch.int8, True, True),
        (x.detach(), weight.detach(), None, residual.detach(), None, smooth_scale, None, 1e-6, "rms", "smooth",
         torch.float8_e4m3fn, True, False),
    ]
    for args in cases:
        torch.library.opcheck(torch.ops.tilekernels.row_norm_forward, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration",
                                          "test_aot_dispatch_dynamic"))


# ====================================================================================================
# CPU lane: bad inputs, a ValueError or TypeError that names the argument


def _bad_cases():
    """Builders taking a tensor factory ``t(*shape, dtype=bf16)``; each returns (fn, args, kwargs)."""
    M, N = 3, 16
    f32 = torch.float32

    def ln(x=None, weight=None, **kw):
        return lambda t: (tk.layer_norm, (x(t) if x else t(M, N), weight(t) if weight else t(N)), kw)

    def rms(x=None, weight=None, **kw):
        return lambda t: (tk.rms_norm, (x(t) if x else t(M, N), weight(t) if weight else t(N)), kw)

    def kw(**builders):
        """Keywords whose tensor values are built by ``t`` at call time."""
        return lambda t: {key: (value(t) if callable(value) else value) for key, value in builders.items()}

    def with_kw(make, keywords):
        def build(t):
            fn, args, _ = make(t)
            return fn, args, keywords(t)
        return build

    cases = {
        "ln-x-int": (ln(x=lambda t: torch.ones(M, N, dtype=torch.int32, device=t(1).device)), r"\bx\b"),
        "ln-x-fp64": (ln(x=lambda t: t(M, N, dtype=torch.float64)), r"\bx\b"),
        "ln-x-0d": (ln(x=lambda t: t()), r"\bx\b"),
        "ln-x-N0": (ln(x=lambda t: t(M, 0), weight=lambda t: t(0)), r"\bx\b|\bN\b"),
        "ln-weight-shape": (ln(weight=lambda t: t(N + 1)), r"weight"),
        "ln-weight-2d": (ln(weight=lambda t: t(1, N)), r"weight"),
        "ln-weight-int": (ln(weight=lambda t: torch.ones(N, dtype=torch.int32, device=t(1).device)), r"weight"),
        "ln-weight-device": (ln(weight=lambda t: t(N).to("meta")), r"weight|device"),
        "ln-bias-shape": (with_kw(ln(), kw(bias=lambda t: t(N - 1))), r"bias"),
        "ln-residual-shape": (with_kw(ln(), kw(residual=lambda t: t(M + 1, N))), r"residual"),
        "ln-residual-dtype": (with_kw(ln(), kw(residual=lambda t: t(M, N, dtype=f32))), r"residual"),
        "ln-x_bias-shape": (with_kw(ln(), kw(x_bias=lambda t: t(N + 2))), r"x_bias"),
        "ln-eps-negative": (with_kw(ln(), kw(eps=-1e-5)), r"eps"),
        "ln-quant-unknown": (with_kw(ln(), kw(quant="static")), r"quant"),
        "ln-quant_dtype-e5m2": (with_kw(ln(), kw(quant="dynamic", quant_dtype=torch.float8_e5m2)), r"quant_dtype"),
        "ln-quant_dtype-fnuz": (with_kw(ln(), kw(quant="dynamic", quant_dtype=torch.float8_e4m3fnuz)),
                                r"quant_dtype"),
        "ln-quant_dtype-int32": (with_kw(ln(), kw(quant="dynamic", quant_dtype=torch.int32)), r"quant_dtype"),
        "ln-smooth-missing": (with_kw(ln(), kw(quant="smooth")), r"smooth_scale"),
        "ln-smooth-without-quant": (with_kw(ln(), kw(smooth_scale=lambda t: t(N, dtype=f32))), r"smooth_scale"),
        "ln-smooth-with-dynamic": (with_kw(ln(), kw(quant="dynamic", smooth_scale=lambda t: t(N, dtype=f32))),
                                   r"smooth_scale"),
        "ln-smooth-shape": (with_kw(ln(), kw(quant="smooth", smooth_scale=lambda t: t(N + 1, dtype=f32))),
                            r"smooth_scale"),
        "rms-x-int8": (rms(x=lambda t: torch.ones(M, N, dtype=torch.int8, device=t(1).device)), r"\bx\b"),
        "rms-weight-shape": (rms(weight=lambda t: t(N // 2)), r"weight"),
        "rms-residual-shape": (with_kw(rms(), kw(residual=lambda t: t(M, N + 1))), r"residual"),
        "rms-residual-dtype": (with_kw(rms(), kw(residual=lambda t: t(M, N, dtype=torch.float16))), r"residual"),
        "rms-residual-device": (with_kw(rms(), kw(residual=lambda t: t(M, N).to("meta"))), r"residual|device"),
        "rms-eps-negative": (with_kw(rms(), kw(eps=-1.0)), r"eps"),
        "rms-quant-unknown": (with_kw(rms(), kw(quant=True)), r"quant"),
        "rms-quant_dtype-e5m2": (with_kw(rms(), kw(quant="smooth", smooth_scale=lambda t: t(N, dtype=f32),
                                                   quant_dtype=torch.float8_e5m2)), r"quant_dtype"),
        "rms-smooth-2d": (with_kw(rms(), kw(quant="smooth", smooth_scale=lambda t: t(1, N, dtype=f32))),
                          r"smooth_scale"),
        "rms-smooth-int": (with_kw(rms(), kw(quant="smooth", smooth_scale=lambda t: torch.ones(
            N, dtype=torch.int32, device=t(1).device))), r"smooth_scale"),
    }
    return [pytest.param(build, match, id=name) for name, (build, match) in cases.items()]


@pytest.mark.parametrize("build, match", _bad_cases())
def test_bad_input(build, match, device):
    def t(*shape, dtype=torch.bfloat16):
        return random_tensor(shape, dtype, device)

    fn, args, kwargs = build(t)
    with pytest.raises((ValueError, TypeError), match=match):
        fn(*args, **kwargs)


# ====================================================================================================
# GPU lane (-m gpu): real sizes, CUDA graphs, no host synchronisation


GPU_CASES = [
    norm_case(op, torch.bfloat16, M, N, residual=True, x_bias=op == "layer_norm")
    for op in OPS for M, N in ((4096, 4096), (4096, 8192), (1024, 32768))
] + [
    norm_case(op, torch.bfloat16, 64, 131072, residual=True) for op in OPS
] + [
    norm_case(op, torch.float32, 4096, 4096, layout="padded") for op in OPS
] + [
    norm_case(op, torch.float16, 4096, 5120, layout="3d-transposed") for op in OPS
]


@gpu
@pytest.mark.parametrize("case", [c.param() for c in GPU_CASES])
def test_gpu_forward(case, device, poison_allocations):
    inputs = make_inputs(case, device)
    check_forward(case.name, case, inputs, call(case, inputs))


@gpu
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
@pytest.mark.parametrize("quant", ["dynamic", "smooth"])
@pytest.mark.parametrize("op", OPS)
def test_gpu_quantized(op, quant, quant_dtype, device, poison_allocations):
    case = norm_case(op, torch.bfloat16, 4096, 8192, residual=True)
    inputs = make_inputs(case, device)
    options = {"quant": quant, "quant_dtype": quant_dtype, "return_unquantized": True}
    smooth_scale = None
    if quant == "smooth":
        smooth_scale = torch.rand(case.N, device=device) + 0.5
        options["smooth_scale"] = smooth_scale
    result = call(case, inputs, **options)
    check_norm_quant(f"{case.name}-{quant}-{QUANT_NAMES[quant_dtype]}", case, inputs, result, quant, quant_dtype,
                     smooth_scale, True)


@gpu
@pytest.mark.parametrize("N", [4096, 8192, 16384, 32768, 5000])
@pytest.mark.parametrize("quant", ["dynamic", "smooth"])
@pytest.mark.parametrize("op", OPS)
def test_gpu_quantized_only(op, quant, N, device, poison_allocations):
    """q and row_scale alone (no residual, no y): the forward configs tuned for a norm's quantised rows
    (``_kernels.TUNED_FORWARD``, kinds such as "layer+dynamic"), persistent ones included."""
    case = norm_case(op, torch.bfloat16, 3000 if N <= 8192 else 700, N)
    inputs = make_inputs(case, device)
    options = {"quant": quant, "quant_dtype": torch.int8}
    smooth_scale = None
    if quant == "smooth":
        smooth_scale = torch.rand(case.N, device=device) + 0.5
        options["smooth_scale"] = smooth_scale
    result = call(case, inputs, **options)
    check_norm_quant(f"{case.name}-{quant}-only", case, inputs, result, quant, torch.int8, smooth_scale, False)


GPU_BACKWARD_CASES = [
    norm_case(op, torch.bfloat16, M, N, residual=True, x_bias=op == "layer_norm")
    for op in OPS for M, N in ((4096, 8192), (1024, 32768))
] + [norm_case(op, torch.float32, 2048, 8192) for op in OPS]


@gpu
@pytest.mark.parametrize("case", [c.param() for c in GPU_BACKWARD_CASES])
def test_gpu_backward(case, device):
    check_backward(case, device, layouts=False)


@gpu
@pytest.mark.parametrize("M, N", [(16384, 4096), (2000, 16384), (700, 32768)])
@pytest.mark.parametrize("op", OPS)
def test_gpu_deterministic(op, M, N, device):
    """Many rows over many programs: dweight / dbias bit-identical over three runs (from 16384 columns, of the
    Gluon backward; at 32768 with two programs per row exchanging row sums)."""
    case = norm_case(op, torch.bfloat16, M, N, residual=True, param_dtype=torch.float32)
    inputs = make_inputs(case, device)
    grad_y, grad_s = _grad_outputs(case, inputs)
    runs = []
    ran = _smem_backward_ran(case, device, lambda: runs.append(run_backward(case, inputs, grad_y, grad_s)))
    assert ran == (N >= 16384), f"{case.name}: Gluon backward ran {ran}"
    runs += [run_backward(case, inputs, grad_y, grad_s) for _ in range(2)]
    for run in runs[1:]:
        for key in run:
            assert torch.equal(runs[0][key], run[key]), f"{case.name}: d{key} differs between runs"


# rows past 8192 columns: the Gluon backward with dw/db in shared memory (norm/_gluon.py), with M below and
# above the grid, rows that do not fill the block, row strides, fp16 and fp32 (which stage more bytes)
SMEM_BACKWARD_CASES = [
    norm_case("layer_norm", torch.bfloat16, 300, 10000, residual=True, x_bias=True),
    norm_case("layer_norm", torch.float16, 7, 16384, layout="padded", param_dtype=torch.float32),
    norm_case("layer_norm", torch.bfloat16, 257, 32768, bias=False, residual=True),
    norm_case("rms_norm", torch.bfloat16, 1000, 20000, residual=True),
    norm_case("rms_norm", torch.float32, 64, 16384),
]


def _smem_backward_ran(case, device, fn):
    """Run ``fn`` with empty launch caches and say whether the backward took the Gluon kernel."""
    from tilekernels.norm import _gluon
    from tilekernels.norm import norm as norm_module

    norm_module._BACKWARD_PLANS.clear()
    fn()
    return any(plan[0].kernel is getattr(_gluon, "_row_backward_smem", None)
               for plan in norm_module._BACKWARD_PLANS.values())


@gpu
@pytest.mark.parametrize("prefetch", [None, 0, 1, 2])
@pytest.mark.parametrize("case", [c.param() for c in SMEM_BACKWARD_CASES])
def test_gpu_smem_backward(case, prefetch, device):
    """Every gradient against the fp64 reference, under the table's config and each prefetch mode."""
    config = None
    if prefetch is not None:
        config = kern.SmemBackwardConfig(16, prefetch=prefetch)
    with _override("smem_backward", config):
        ran = _smem_backward_ran(case, device, lambda: check_backward(case, device, layouts=True))
    from tilekernels.norm import _gluon

    x = make_x(case, device).clone()   # run_backward's leaves are clones: a padded x arrives contiguous
    fits = _gluon.smem_backward_applies(x, x, None, config or kern.smem_backward_config(case.N, case.op[:-5]),
                                        triton.next_power_of_2(case.N), True, case.bias)
    assert ran == fits, f"{case.name}: Gluon backward ran {ran}, fits {fits}"


# dw/db summed in registers (``acc_regs``; the table's choice for layer norm at 16384): x and dy held across the
# row's reduction (one stage) or read again from a ring of two or three staged rows; one program per row, the
# exchange through global memory, or a cluster of two
REGISTER_SUM_CONFIGS = {"held-w32": dict(num_warps=32, stages=1), "ring2-w32": dict(num_warps=32, stages=2),
                        "ring3-w16": dict(num_warps=16, stages=3), "ring2-split2": dict(num_warps=16, stages=2, split=2),
                        "ring2-cluster2": dict(num_warps=32, stages=2, split=2, cluster=True)}


@pytest.mark.parametrize("stages", [0, -1, 1.5, True])
def test_smem_backward_config_refuses_bad_stages(stages):
    with pytest.raises(ValueError, match="stages"):
        kern.SmemBackwardConfig(16, stages=stages)


@gpu
@pytest.mark.parametrize("variant", list(REGISTER_SUM_CONFIGS))
@pytest.mark.parametrize("case", [c.param() for c in SMEM_BACKWARD_CASES])
def test_gpu_smem_backward_register_sums(case, variant, device):
    """Every gradient against the fp64 reference with dw/db summed in registers, and bit-identical over
    repeats; the Gluon kernel runs where its ring fits."""
    from tilekernels.norm import _gluon

    config = kern.SmemBackwardConfig(vec=8, acc_regs=True, **REGISTER_SUM_CONFIGS[variant])
    with _override("smem_backward", config):
        ran = _smem_backward_ran(case, device, lambda: check_backward(case, device, layouts=True))
        inputs = make_inputs(case, device)
        grad_y, grad_s = _grad_outputs(case, inputs)
        runs = [run_backward(case, inputs, grad_y, grad_s) for _ in range(2)]
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), f"{case.name}: d{key} differs between runs"
    x = make_x(case, device).clone()
    fits = _gluon.smem_backward_applies(x, x, None, config, triton.next_power_of_2(case.N), True, case.bias)
    assert ran == fits, f"{case.name}: Gluon backward ran {ran}, fits {fits}"


# rows shared by 2 or 4 programs that exchange their parts of the row sums: parts only partly filled or
# empty (20000 = 2 x 8192 + 3616, in four parts of 8192), fewer rows than program groups, fp16 and fp32
SPLIT_BACKWARD_CASES = [
    (norm_case("layer_norm", torch.bfloat16, 300, 20000, residual=True, x_bias=True), 4),
    (norm_case("rms_norm", torch.bfloat16, 1000, 32768, residual=True), 2),
    (norm_case("layer_norm", torch.float16, 5, 30000, param_dtype=torch.float32), 4),
    (norm_case("rms_norm", torch.float32, 64, 16384), 4),
    (norm_case("layer_norm", torch.bfloat16, 2000, 32768), 2),
]


@gpu
@pytest.mark.parametrize("case, split", [pytest.param(c, s, id=f"{c.name}-split{s}") for c, s in SPLIT_BACKWARD_CASES])
def test_gpu_split_backward(case, split, device):
    """Every gradient against the fp64 reference; then the same call with no waits at all (each program sums
    its partners' parts of every row itself: what a program does when a partner never publishes) gives the
    same bits."""
    from tilekernels.norm import _gluon

    config = kern.SmemBackwardConfig(16, vec=8, split=split)
    with _override("smem_backward", config):
        ran = _smem_backward_ran(case, device, lambda: check_backward(case, device, layouts=True))
        assert ran, f"{case.name}: the Gluon backward did not run"
        inputs = make_inputs(case, device)
        grad_y, grad_s = _grad_outputs(case, inputs)
        exchanged = run_backward(case, inputs, grad_y, grad_s)
        saved, _gluon.max_spins = _gluon.max_spins, -1
        try:
            alone = run_backward(case, inputs, grad_y, grad_s)
        finally:
            _gluon.max_spins = saved
    for key in exchanged:
        assert torch.equal(exchanged[key], alone[key]), f"{case.name}: d{key} differs without the exchange"


def test_cluster_exchange_error_words_raise():
    """What the cluster backward leaves when a wait gave up (word 0 set, word 1 the row) is raised by
    ``tk.raise_pending_errors`` as TimeoutError naming the row, once: the words are cleared."""
    from tilekernels.norm import norm as norm_module

    words = norm_module._EXCHANGE_ERRORS.table(torch.device("cpu"))
    words[1], words[0] = 123, 1
    with pytest.raises(TimeoutError, match=r"cluster partner's row sums \(row 123\)"):
        tk.raise_pending_errors()
    assert int(words[0]) == 0
    tk.raise_pending_errors()
    norm_module._EXCHANGE_ERRORS.check()


@gpu
@pytest.mark.parametrize("case, split",
                         [pytest.param(c, s, id=f"{c.name}-cluster{s}") for c, s in SPLIT_BACKWARD_CASES])
def test_gpu_cluster_backward(case, split, device):
    """A row's programs as one thread-block cluster, the row sums exchanged in distributed shared memory
    (the table's choice from 32768 columns): every gradient against the fp64 reference, dx bit-identical
    to the exchange through global memory with the same warps (the same sums, added in part order), and
    bit-identical over repeats."""
    from tilekernels.norm import norm as norm_module

    cluster = kern.SmemBackwardConfig(32, vec=8, split=split, cluster=True)
    with _override("smem_backward", cluster):
        ran = _smem_backward_ran(case, device, lambda: check_backward(case, device, layouts=True))
        assert ran, f"{case.name}: the Gluon backward did not run"
        assert any(plan[0].constexprs.get("CLUSTER") for plan in norm_module._BACKWARD_PLANS.values()), \
            f"{case.name}: the cluster launch was not taken"
        inputs = make_inputs(case, device)
        grad_y, grad_s = _grad_outputs(case, inputs)
        runs = [run_backward(case, inputs, grad_y, grad_s) for _ in range(3)]
    with _override("smem_backward", kern.SmemBackwardConfig(32, vec=8, split=split)):
        norm_module._BACKWARD_PLANS.clear()
        through_memory = run_backward(case, inputs, grad_y, grad_s)
    assert torch.equal(runs[0]["x"], through_memory["x"]), f"{case.name}: dx differs from the global exchange"
    for run in runs[1:]:
        for key in run:
            assert torch.equal(runs[0][key], run[key]), f"{case.name}: d{key} differs between runs"


@gpu
def test_gpu_cluster_backward_gives_up(device):
    """With no polls allowed, a program that does not find its partner's sums at once records the row and
    ``tk.raise_pending_errors`` raises TimeoutError naming it; where every program found them at once, the
    gradients are the ones of a normal call. Either way no call hangs or returns wrong values silently."""
    from tilekernels.norm import _gluon
    from tilekernels.norm import norm as norm_module

    case = norm_case("layer_norm", torch.bfloat16, 4096, 32768)
    inputs = make_inputs(case, device)
    grad_y, grad_s = _grad_outputs(case, inputs)
    with _override("smem_backward", kern.SmemBackwardConfig(32, vec=8, split=2, cluster=True)):
        norm_module._BACKWARD_PLANS.clear()
        want = run_backward(case, inputs, grad_y, grad_s)
        saved, _gluon.max_spins = _gluon.max_spins, -1
        try:
            got = run_backward(case, inputs, grad_y, grad_s)
            try:
                tk.raise_pending_errors()
            except TimeoutError as error:
                assert "cluster partner's row sums (row " in str(error), str(error)
            else:
                for key in want:
                    assert torch.equal(want[key], got[key]), f"d{key} wrong and no error raised"
        finally:
            _gluon.max_spins = saved
            norm_module._BACKWARD_PLANS.clear()
    tk.raise_pending_errors()   # the error words were cleared when raised


@gpu
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_gpu_smem_backward_unaligned_rows(norm, device):
    """Rows that cp.async cannot copy (a row stride that is not a multiple of 16 elements) take the Triton
    backward, and agree with the Gluon backward on the same values in aligned rows."""
    from tilekernels.norm import norm as norm_module

    M, N = 33, 16384
    padded = random_tensor((M, N + 11), torch.bfloat16, device)[:, 5:N + 5]
    aligned = padded.contiguous()
    dy = random_tensor((M, N), torch.bfloat16, device)
    weight = random_tensor((N,), torch.bfloat16, device)
    xf = aligned.float()
    mean, rstd = xf.mean(1), torch.rsqrt(xf.var(1, unbiased=False) + 1e-5)
    results = {}
    for name, x in (("padded", padded), ("aligned", aligned)):
        results[name] = []
        ran = _smem_backward_ran(None, device, lambda: results[name].extend(norm_module.launch_backward(
            dy, x, None, None, weight, mean, rstd, norm, True, norm == "layer")))
        assert ran == (name == "aligned"), f"{name} rows: Gluon backward ran {ran}"
    # the two kernels sum in other orders: dx may differ by a bf16 rounding step, dw/db in fp32 by a few ulp
    for label, got, want in zip(("dx", "dw", "db"), results["padded"], results["aligned"]):
        if want is not None:
            tol = dict(rtol=1.6e-2, atol=1e-2) if label == "dx" else dict(rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{norm} {label}: {m}")


def _graph_step(case, inputs, grad_y, grad_s, smooth_scale):
    """Forward and backward of the case, plus its quantised forward: the tensors a graph captures."""
    keys = grad_leaves(case, inputs)
    leaves = [inputs[key] for key in keys]
    y, s = call(case, inputs)
    grads = torch.autograd.grad((y, s), leaves, (grad_y, grad_s))
    with torch.no_grad():
        q, row_scale = call(case, inputs, quant="smooth", smooth_scale=smooth_scale,
                            quant_dtype=torch.float8_e4m3fn)[:2]
    return (y, s, *grads, q, row_scale)


@gpu
@pytest.mark.parametrize("M, N", [(2048, 8192), (300, 32768)])
@pytest.mark.parametrize("op", OPS)
def test_gpu_cuda_graph(op, M, N, device):
    """Capture forward, backward and a quantised forward in one CUDA graph; replay with new data in the
    captured inputs; each replay within the rule (at 32768 columns the backward's programs share rows, as
    thread-block clusters whose exchange words are tagged with the row's iteration)."""
    case = norm_case(op, torch.bfloat16, M, N, residual=True, x_bias=op == "layer_norm")
    inputs = make_inputs(case, device)
    for key in grad_leaves(case, inputs):
        inputs[key].requires_grad_()
    grad_y, grad_s = _grad_outputs(case, inputs)
    smooth_scale = torch.rand(case.N, device=device) + 0.5

    graph, results = capture_graph(lambda: _graph_step(case, inputs, grad_y, grad_s, smooth_scale))

    keys = grad_leaves(case, inputs)
    for replay in range(2):
        fresh = make_inputs(case, device)
        with torch.no_grad():
            for key in keys:
                inputs[key].copy_(fresh[key])
            grad_y.copy_(random_tensor(grad_y.shape, grad_y.dtype, device))
            grad_s.copy_(random_tensor(grad_s.shape, grad_s.dtype, device))
            for t in results:
                if t.dtype.is_floating_point and t.dtype != torch.float8_e4m3fn:
                    t.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        name = f"{case.name}-replay{replay}"
        plain = {key: value.detach() if value is not None else None for key, value in inputs.items()}
        y, s, *grads = results[:2 + len(keys)]
        q, row_scale = results[2 + len(keys):]
        check_forward(name, case, plain, (y, s))
        exact = reference_grads(case, plain, grad_y, grad_s, torch.float64)
        low = reference_grads(case, plain, grad_y, grad_s, None)
        for key, grad in zip(keys, grads):
            assert_close(f"{name} d{key}", grad, exact[key], low[key], ratio=3.0)
        z = reference(case, plain)[0] * smooth_scale.cpu().double()
        torch_z = reference(case, plain, torch.float32)[0] * smooth_scale
        assert_quant_close(f"{name} quant", q, row_scale, z, torch_z, torch.float8_e4m3fn,
                           ratio=3.0)


@gpu
def test_gpu_no_host_sync(device):
    """Forward (every output layout), backward and quantised outputs never synchronise with the host:
    torch's sync debug mode turns any .item(), .tolist() or device-to-host copy into an error."""
    case = norm_case("layer_norm", torch.bfloat16, 4096, 8192, residual=True, x_bias=True)
    rms_case = norm_case("rms_norm", torch.bfloat16, 4096, 8192, residual=True)
    inputs, rms_inputs = make_inputs(case, device), make_inputs(rms_case, device)
    grad_y, grad_s = _grad_outputs(case, inputs)
    smooth_scale = torch.rand(case.N, device=device) + 0.5

    def step():
        run_backward(case, inputs, grad_y, grad_s)
        run_backward(rms_case, rms_inputs, grad_y, grad_s)
        call(case, inputs, quant="smooth", smooth_scale=smooth_scale, return_unquantized=True)
        call(rms_case, rms_inputs, quant="dynamic", quant_dtype=torch.float8_e4m3fn)

    assert_no_host_sync(step)
