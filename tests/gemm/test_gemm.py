"""tk.gemm against its fp64 reference, by the error-ratio rule of ``tilekernels.testing``.

CPU lane (no marker; runs under ``TRITON_INTERPRET=1``, the whole file in under a minute on two cores):
small odd shapes that straddle tiles, every layout and dtype, each epilogue alone and combined,
``out=`` into poisoned strided buffers, split-K, autograd, torch.compile and argument checks.

GPU lane (``-m gpu``): the same checks at real sizes, every candidate and tuned config, tf32,
skinny split-K, CUDA graph capture, >2^31-element operands.

Ids read ``LAYOUT-DTYPE-MxNxK``: layout ``RC`` means A row-major, B column-major (a transposed view).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
import threading

import pytest
import torch
import triton
import triton.language as tl

import tilekernels as tk
from tilekernels.gemm._kernels import apply_activation
from tilekernels._runtime import cdiv, supports_tensor_descriptors
from tilekernels.gemm.configs import (
    TUNED_HOPPER_16BIT,
    TUNED_HOPPER_FP32,
    GemmConfig,
    auto_split_k,
    candidate_configs,
    override_config,
    select_config,
)
from tilekernels.testing import (
    ACTIVATIONS,
    assert_close,
    poisoned,
    random_matrix,
    random_tensor,
    reference_gemm,
)

LAYOUTS = ("RR", "RC", "CR", "CC")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

gpu = pytest.mark.gpu


def operands(M, N, K, dtype, layout, device, *, unit=False):
    """A ``[M, K]`` and B ``[K, N]``; a ``C`` in ``layout`` makes that operand a transposed view.
    ``unit=True`` scales A by 1/sqrt(K) so that the products are about N(0, 1): activations are then
    tested where they bend, not only where they saturate."""
    a = random_matrix(M, K, dtype, device, column_major=layout[0] == "C", scale=K ** -0.5 if unit else 1.0)
    b = random_matrix(K, N, dtype, device, column_major=layout[1] == "C")
    return a, b


def check(name, out, a, b, *, ratio=2.0, **epilogue):
    """Assert ``out`` is ``reference_gemm(a, b, **epilogue)`` by the error-ratio rule; right shape and
    dtype too."""
    M, N = a.shape[0], b.shape[1]
    assert tuple(out.shape) == (M, N), f"{name}: shape {tuple(out.shape)} != {(M, N)}"
    expected_dtype = epilogue.get("out_dtype") or a.dtype
    assert out.dtype == expected_dtype, f"{name}: dtype {out.dtype} != {expected_dtype}"
    assert out.device == a.device
    ref = reference_gemm(a, b, **epilogue)
    torch_out = reference_gemm(a, b, compute_dtype=None, **epilogue)
    return assert_close(name, out, ref, torch_out, ratio=ratio)


@contextlib.contextmanager
def allow_tf32():
    """Torch's own fp32 GEMMs as tf32, the precision tk.gemm computes fp32 in on a GPU."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def case_id(layout, dtype, M, N, K):
    return f"{layout}-{DTYPE_NAMES[dtype]}-M{M}N{N}K{K}"


def grid(layouts, dtypes, shapes, marks=()):
    return [pytest.param(lo, DTYPES[dt], M, N, K, id=case_id(lo, DTYPES[dt], M, N, K), marks=marks)
            for (M, N, K) in shapes for dt in dtypes for lo in layouts]


def epilogue_operands(kind, M, N, dtype, device):
    """Epilogue keyword arguments by name; every tensor random (never zeros)."""
    def t(*shape):
        return random_tensor(shape, dtype, device)

    if kind == "bias_n":
        return {"bias": t(N)}
    if kind == "bias_mn":
        return {"bias": t(M, N)}
    if kind in ACTIVATIONS:
        return {"activation": kind}
    if kind == "mul1":
        return {"mul": (t(M, N),)}
    if kind == "mul2":
        return {"mul": (t(M, N), t(M, N))}
    if kind == "residual":
        return {"residual": t(M, N)}
    if kind == "residual_beta":
        return {"residual": t(M, N), "beta": -0.75}
    if kind == "alpha":
        return {"alpha": 0.3}
    if kind == "scales":
        return {"scale_a": random_tensor((M,), torch.float32, device),
                "scale_b": random_tensor((N,), torch.float32, device)}
    if kind == "out_dtype":
        return {"out_dtype": torch.float32 if dtype != torch.float32 else torch.bfloat16}
    if kind == "broadcast":
        # [1, N] and [M, 1] operands are read through stride-0 views; a column-major residual too.
        return {"bias": t(M, 1), "mul": (t(1, N),), "residual": t(N, M).t()}
    if kind == "all":
        return {"bias": t(N), "activation": "gelu_tanh", "mul": (t(M, N), t(M, N)),
                "residual": t(N, M).t(), "alpha": 0.5, "beta": 1.5}
    if kind == "all_fp32_out":
        return {"bias": t(M, N), "activation": "silu", "mul": (t(M, N),), "residual": t(M, N),
                "alpha": -1.25, "beta": 0.5, "scale_b": random_tensor((N,), torch.float32, device),
                "out_dtype": torch.float32 if dtype != torch.float32 else torch.float16}
    raise ValueError(kind)


EPILOGUES = ("bias_n", "bias_mn", *ACTIVATIONS, "mul1", "mul2", "residual", "residual_beta", "alpha",
             "scales", "out_dtype", "broadcast", "all", "all_fp32_out")


def strided_out(M, N, dtype, device, kind):
    """A poisoned ``[M, N]`` output view that is not a plain contiguous tensor, and its base."""
    if kind == "col":
        base = poisoned((N, M), dtype, device)
        return base.t(), base
    if kind == "padded":
        base = poisoned((M + 3, N + 5), dtype, device)
        return base[1:M + 1, 2:N + 2], base
    if kind == "step":
        base = poisoned((M, 2 * N), dtype, device)
        return base[:, ::2], base
    raise ValueError(kind)


def check_out_view(name, out, base, result):
    """``result`` is ``out`` itself, and nothing of ``base`` outside the view was written."""
    same = result.data_ptr() == out.data_ptr() and result.stride() == out.stride()
    assert same, f"{name}: the result is not out"
    written = torch.zeros(base.shape, dtype=torch.bool, device=base.device)
    written.as_strided(out.shape, out.stride(), out.storage_offset() - base.storage_offset()).fill_(True)
    stray = int((~torch.isnan(base[~written])).sum())
    assert stray == 0, f"{name}: wrote {stray} elements outside out"


# ====================================================================================================
# CPU lane


SMALL_SHAPES = [(37, 53, 71), (65, 33, 130)]
EDGE_SHAPES = [(1, 1, 1), (1, 53, 71), (37, 1, 71), (37, 53, 1), (3, 2, 67)]


@pytest.mark.parametrize("layout, dtype, M, N, K", grid(LAYOUTS, DTYPES, SMALL_SHAPES))
def test_layouts(layout, dtype, M, N, K, device):
    a, b = operands(M, N, K, dtype, layout, device)
    check(case_id(layout, dtype, M, N, K), tk.gemm(a, b), a, b)


@pytest.mark.parametrize("layout, dtype, M, N, K", grid(LAYOUTS, DTYPES, EDGE_SHAPES))
def test_edge_shapes(layout, dtype, M, N, K, device):
    """1x1x1 and single-row/column/K problems; with M or N == 1 a 'column-major' view's strides are
    ambiguous (stride 1 both ways), which a layout check must not trip over."""
    a, b = operands(M, N, K, dtype, layout, device)
    out = poisoned((M, N), dtype, device)
    result = tk.gemm(a, b, out=out)
    assert result.data_ptr() == out.data_ptr()
    check(case_id(layout, dtype, M, N, K), out, a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", EPILOGUES)
def test_epilogue(kind, dtype, layout, device):
    M, N, K = 37, 53, 71
    a, b = operands(M, N, K, dtype, layout, device, unit=True)
    epilogue = epilogue_operands(kind, M, N, dtype, device)
    check(f"{kind}-{case_id(layout, dtype, M, N, K)}", tk.gemm(a, b, **epilogue), a, b, **epilogue)


@pytest.mark.parametrize("kind", ["all", "all_fp32_out", "broadcast", "bias_mn"])
@pytest.mark.parametrize("M, N, K", [pytest.param(M, N, K, id=f"M{M}N{N}K{K}")
                                     for M, N, K in [(1, 1, 1), (1, 40, 33), (40, 1, 33), (40, 33, 1)]])
def test_epilogue_edge_shapes(kind, M, N, K, device):
    a, b = operands(M, N, K, torch.bfloat16, "CR", device)
    epilogue = epilogue_operands(kind, M, N, torch.bfloat16, device)
    out_dtype = epilogue.get("out_dtype") or torch.bfloat16
    out = poisoned((M, N), out_dtype, device)
    tk.gemm(a, b, out=out, **epilogue)
    check(f"{kind}-M{M}N{N}K{K}", out, a, b, **epilogue)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_after_bias(activation, device):
    """Pre-activations about N(0, 2) in fp32, so each activation's curve (not its asymptotes) is what is
    compared; the bias shifts columns across the bend, so bias-after-activation would show."""
    M, N, K = 33, 40, 20
    a, b = operands(M, N, K, torch.float32, "RR", device, unit=True)
    bias = random_tensor((N,), torch.float32, device)
    out = tk.gemm(a, b, bias=bias, activation=activation)
    check(activation, out, a, b, bias=bias, activation=activation)


@triton.jit
def _short_gelu_kernel(x_ptr, y_ptr, n, ACTIVATION: tl.constexpr, COARSE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, apply_activation(v, ACTIVATION, True, COARSE), mask=offs < n)


def _short_gelu(x: torch.Tensor, activation: str, coarse: bool = False) -> torch.Tensor:
    """The fused epilogue's GELU for 16-bit outputs (``_kernels._gelu_short`` / ``_gelu_tanh_short``; with
    ``coarse``, the bf16 / fp8 outputs' ``_gelu_coarse``) applied to fp32 ``x``."""
    y = poisoned(tuple(x.shape), x.dtype, x.device)
    _short_gelu_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), ACTIVATION=activation, COARSE=coarse,
                                                        BLOCK=4096)
    return y


def _check_short_gelu(device, activation: str, bound: float, coarse: bool = False, bf16_units: float = 0.0):
    """Within ``bound * max(1, |x|)`` of fp64; with ``bf16_units``, also within that many bf16 units of GELU(x)
    (relative to 2^(floor(log2 |GELU(x)|) - 7)) for every x >= -4.5."""
    x = torch.cat([torch.linspace(-12, 12, 240001), torch.linspace(-0.01, 0.01, 2001),
                   torch.tensor([0.0, -0.0, 3e-39, -3e-39, 1e30, -1e30, 3e38])]).to(device)
    y = _short_gelu(x, activation, coarse).cpu().double()
    xd = x.cpu().double()
    if activation == "gelu":
        exact = xd * 0.5 * torch.special.erfc(-xd / 2 ** 0.5)
    elif activation == "gelu_tanh":
        exact = 0.5 * xd * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (xd + 0.044715 * xd ** 3)))
    else:
        exact = xd * torch.sigmoid(xd)
    err = (y - exact).abs()
    allowed = bound * xd.abs().clamp(min=1.0) + exact.abs() * 2 ** -23
    worst = int(torch.argmax(err / allowed))
    assert bool((err <= allowed).all()), f"x={xd[worst].item()}: {y[worst].item()} against {exact[worst].item()}"
    if bf16_units:
        # normal fp32 results only: the GPU flushes denormals (ftz), as the other forms there
        sel = (xd >= -4.5) & (exact.abs() >= 2.0 ** -126) & (xd.abs() < 1e30)
        units = err[sel] / torch.exp2(torch.floor(torch.log2(exact[sel].abs())) - 7)
        worst = int(torch.argmax(units))
        assert units[worst].item() <= bf16_units, f"x={xd[sel][worst].item()}: {units[worst].item()} bf16 units"
    # inf and NaN as the erf / tanh / division forms give them (torch's GELUs return NaN for both infinities)
    special = _short_gelu(torch.tensor([float("inf"), float("-inf"), float("nan")], device=device), activation,
                          coarse)
    special = special.cpu()
    assert special[0].item() == float("inf") and special[1:].isnan().all(), special


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_short_gelu_against_fp64(activation, device):
    """The GELUs (and SiLU) of 16-bit epilogues against fp64 over [-12, 12] (both tails, the bend, denormals,
    huge values): within 3e-7 * max(1, |x|) -- a thousandth of a bf16 or fp16 unit where GELU is ~0.1 or more."""
    _check_short_gelu(device, activation, 3e-7)


@gpu
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_gpu_short_gelu_against_fp64(activation, device):
    """The same on the GPU, where ex2.approx and rcp.approx (about 2^-22 relative each) stand in for the
    interpreter's exact exp2 and division."""
    _check_short_gelu(device, activation, 6e-7)


def test_coarse_gelu_against_fp64(device):
    """The GELU of bf16 / fp8 epilogues (``_gelu_coarse``, degree 4) against fp64: within 7.8e-5 * max(1, |x|)
    everywhere and 0.161 of a bf16 unit of GELU(x) for x >= -4.5 (its fit: 7.67e-5 and 0.1599); the 16-bit
    form is within 0.102 of a unit there, a bound the coarse one must miss (so the unit check can fail)."""
    _check_short_gelu(device, "gelu", 7.8e-5, coarse=True, bf16_units=0.161)
    _check_short_gelu(device, "gelu", 3e-7, bf16_units=0.102)
    with pytest.raises(AssertionError, match="bf16 units"):
        _check_short_gelu(device, "gelu", 7.8e-5, coarse=True, bf16_units=0.102)


@gpu
def test_gpu_coarse_gelu_against_fp64(device):
    """The same on the GPU (ex2.approx and rcp.approx)."""
    _check_short_gelu(device, "gelu", 7.8e-5, coarse=True, bf16_units=0.161)


@pytest.mark.parametrize("out_kind", ["col", "padded", "step"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_out_strided_poisoned(out_kind, dtype, device):
    M, N, K = 37, 53, 45
    a, b = operands(M, N, K, dtype, "RC", device)
    epilogue = {"bias": random_tensor((N,), dtype, device), "activation": "relu",
                "residual": random_tensor((M, N), dtype, device)}
    out, base = strided_out(M, N, dtype, device, out_kind)
    result = tk.gemm(a, b, out=out, **epilogue)
    check_out_view(out_kind, out, base, result)
    check(f"out-{out_kind}", out, a, b, **epilogue)


def test_out_with_out_dtype(device):
    M, N, K = 29, 31, 40
    a, b = operands(M, N, K, torch.bfloat16, "CR", device)
    out, base = strided_out(M, N, torch.float32, device, "col")
    result = tk.gemm(a, b, out=out, out_dtype=torch.float32, alpha=2.0)
    check_out_view("out_dtype", out, base, result)
    check("out_dtype", out, a, b, out_dtype=torch.float32, alpha=2.0)


def test_padded_leading_dimension_inputs(device):
    """Row-major operands whose row stride exceeds their width (slices of a bigger matrix)."""
    M, N, K = 37, 29, 50
    a = random_tensor((M + 2, K + 7), torch.float16, device)[1:M + 1, 3:K + 3]
    b = random_tensor((N + 5, K + 3), torch.float16, device)[2:N + 2, :K].t()
    check("padded-inputs", tk.gemm(a, b), a, b)


def test_general_strided_input_is_correct_or_refused(device):
    """A view that is neither row- nor column-major: a right answer, or a clear error naming it."""
    M, N, K = 20, 24, 30
    a = random_tensor((M, 2 * K), torch.float32, device)[:, ::2]
    b = random_matrix(K, N, torch.float32, device)
    try:
        out = tk.gemm(a, b)
    except (ValueError, TypeError) as err:
        assert "a" in str(err).split(), f"error does not name 'a': {err}"
    else:
        check("strided-a", out, a, b)


def padded(rows, cols, dtype, device, *, column_major=False, pad=8):
    """A random ``[rows, cols]`` view of a wider buffer: its row (or, column-major, column) stride is the
    contiguous extent plus ``pad`` (8 elements: 16 bytes in bf16, not 32), and the padding is NaN, so a load
    that strays past the view's last row or column into it shows up in any output element that it reaches."""
    inner, outer = (rows, cols) if column_major else (cols, rows)
    buf = torch.full((outer, inner + pad), float("nan"), dtype=dtype, device=device)
    view = buf[:, :inner]
    view.copy_(random_tensor((outer, inner), dtype, device))
    return view.t() if column_major else view


def pointer_path_cases(device):
    """Pointer-path launches (TMA off) whose edges cut the load vectors: M and N one element past a multiple of
    8, strides 8 mod 16 elements, a K tail; each layout, on the interpreter's small tile or, on a GPU, 128x128."""
    if device.type == "cuda":
        cfg, (M, N, K) = GemmConfig(128, 128, 64, 8, 4, 3), (385, 393, 1000)
    else:
        cfg, (M, N, K) = GemmConfig(32, 32, 32, 2, 4, 1), (41, 49, 72)
    return cfg, M, N, K


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_pointer_path_padded_strides(layout, dtype, device):
    """The pointer path's loads are marked contiguous past the clamp of rows beyond M and columns beyond N and
    aligned by the strides' and the K bound's known divisors (``gemm_kernel``): a vector that crosses M or N reads
    the view's padding, which is NaN here. Every output element is checked, and the poisoned out shows any not
    written; with and without split-K."""
    cfg, M, N, K = pointer_path_cases(device)
    if device.type != "cuda" and dtype == torch.float32:
        K = 40  # keep the fp32 interpreter case short
    a = padded(M, K, dtype, device, column_major=layout[0] == "C")
    b = padded(K, N, dtype, device, column_major=layout[1] == "C")
    for split_k in (1, 3):  # split-K: each split's K range ends at a multiple of its own length, or at K
        out = poisoned((M, N), dtype, device)
        tk.gemm(a, b, out=out, config=cfg, split_k=split_k)
        check(f"pointer-padded-split{split_k}-{case_id(layout, dtype, M, N, K)}", out, a, b)


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_gpu_pointer_path_padded_strides(layout, dtype, device):
    """``test_pointer_path_padded_strides`` compiled: the vectors are real on a GPU (the interpreter has none)."""
    test_pointer_path_padded_strides(layout, dtype, device)


def misaligned(M, N, dtype, device, column_major=False):
    """A random ``[M, N]`` matrix whose first element sits one element past a 16-byte boundary."""
    numel = M * N
    buf = random_tensor((numel + 1,), dtype, device)[1:]
    return buf.view(N, M).t() if column_major else buf.view(M, N)


def signature_sequence(M, N, K, dtype, device):
    """Calls with the same M, N, K that differ in exactly what a cached launch plan depends on
    (strides, 16-byte alignment, dtypes, epilogue operands and their broadcast, alpha == 1, out
    strides), interleaved with repeats that reuse a plan with new data."""
    def t(*shape):
        return random_tensor(shape, dtype, device)

    a_rr, b_rr = operands(M, N, K, dtype, "RR", device)
    a_cc, b_cc = operands(M, N, K, dtype, "CC", device)
    yield "RR", (a_rr, b_rr), {}
    yield "CC", (a_cc, b_cc), {}
    yield "CR", (a_cc, b_rr), {}
    yield "RC", (a_rr, b_cc), {}
    yield "RR-new-data", operands(M, N, K, dtype, "RR", device), {}
    yield "misaligned-a", (misaligned(M, K, dtype, device), b_rr), {}
    yield "misaligned-b-col", (a_rr, misaligned(K, N, dtype, device, column_major=True)), {}
    yield "RR-again", operands(M, N, K, dtype, "RR", device), {}
    yield "bias-n", (a_rr, b_rr), {"bias": t(N)}
    yield "bias-m1", (a_rr, b_rr), {"bias": t(M, 1)}
    yield "bias-n-new", (a_rr, b_rr), {"bias": t(N)}
    yield "alpha", (a_rr, b_rr), {"alpha": 0.25}
    yield "alpha-one", (a_rr, b_rr), {"alpha": 1.0, "residual": t(M, N)}
    yield "residual-col-beta", (a_rr, b_rr), {"residual": t(N, M).t(), "beta": -2.0}
    yield "residual-beta-changed", (a_rr, b_rr), {"residual": t(N, M).t(), "beta": 0.5}
    yield "gelu-mul", (a_cc, b_cc), {"activation": "gelu", "mul": (t(M, N),)}
    yield "gelu-mul2", (a_cc, b_cc), {"activation": "gelu", "mul": (t(M, N), t(1, N))}
    yield "fp32-out", (a_rr, b_rr), {"out_dtype": torch.float32 if dtype != torch.float32 else torch.float16}


def run_signature_sequence(M, N, K, dtype, device):
    for name, (a, b), epilogue in signature_sequence(M, N, K, dtype, device):
        check(name, tk.gemm(a, b, **epilogue), a, b, **epilogue)
        out_kind = "col" if name.endswith("new") else "padded"
        out, base = strided_out(M, N, epilogue.get("out_dtype") or dtype, device, out_kind)
        result = tk.gemm(a, b, out=out, **epilogue)
        check(f"{name}-out-{out_kind}", out, a, b, **epilogue)
        check_out_view(name, out, base, result)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_repeated_calls_follow_each_signature(dtype, device):
    """tk.gemm caches one launch plan per call signature; a changed stride, alignment, epilogue or
    out layout must never reuse another signature's plan, and a reused plan must read the new data."""
    run_signature_sequence(37, 53, 71, dtype, device)


# small configs: several tiles per persistent program (4 programs under the interpreter) and edge tiles
# in M, N and K at once
EXPLICIT_CONFIGS = [
    pytest.param(GemmConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1), id="16x16x16-g2"),
    pytest.param(GemmConfig(32, 16, 32, group_m=1, num_warps=4, num_stages=1), id="32x16x32-g1"),
    pytest.param(GemmConfig(16, 64, 16, group_m=4, num_warps=4, num_stages=2), id="16x64x16-g4"),
]


@pytest.mark.parametrize("config", EXPLICIT_CONFIGS)
@pytest.mark.parametrize("layout", ["RR", "CC"])
def test_explicit_config(config, layout, device):
    M, N, K = 37, 53, 71  # 3x4 (16x16) tiles for 4 programs; K tail of 7 for BLOCK_K 16 and 32
    a, b = operands(M, N, K, torch.float16, layout, device)
    epilogue = {"bias": random_tensor((N,), torch.float16, device), "activation": "silu"}
    out = poisoned((M, N), torch.float16, device)
    tk.gemm(a, b, config=config, out=out, **epilogue)
    check(f"{config.describe()}-{layout}", out, a, b, **epilogue)
    with override_config(config):
        again = tk.gemm(a, b, **epilogue)
    assert torch.equal(again, out), "override_config and config= disagree"


def _tma_config(**kw):
    return GemmConfig(16, 32, 16, group_m=2, num_warps=4, num_stages=1, use_tma=True, **kw)


def _planned(*args, **kwargs):
    """``tk.gemm(*args, **kwargs)`` with the plan cache emptied first, and the launch plan it made."""
    plans = importlib.import_module("tilekernels.gemm.gemm")._PLANS  # the module, not tk.gemm
    plans.clear()
    result = tk.gemm(*args, **kwargs)
    (plan,) = plans.values()
    return result, plan


@pytest.mark.parametrize("slices", [0, 1, 2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tma_epilogue(layout, slices, device):
    """C and the residual through TMA descriptors (the Hopper default, run here by the interpreter):
    edge tiles in M and N are clipped by the descriptors; operands a descriptor cannot take (a
    column-major residual or out, a row stride that is not 16-byte aligned, split-K) fall back to the
    pointer epilogue. Every case is checked against the reference and the descriptor use is asserted."""
    M, N, K = 40, 48, 40  # edge tiles in M (8 of 16 rows) and N (16 of 32); 16-byte rows for TMA
    config = _tma_config(epilogue_slices=slices)
    a, b = operands(M, N, K, torch.bfloat16, layout, device, unit=True)
    cases = [("plain", {}, True, False),
             ("residual", epilogue_operands("residual", M, N, torch.bfloat16, device), True, True),
             ("all_fp32_out", epilogue_operands("all_fp32_out", M, N, torch.bfloat16, device), True, True),
             ("broadcast", epilogue_operands("broadcast", M, N, torch.bfloat16, device), True, False),
             ("split_k", {"split_k": 2, "bias": random_tensor((N,), torch.bfloat16, device)}, False, False)]
    for name, kwargs, c_desc, res_desc in cases:
        out = poisoned((M, N), kwargs.get("out_dtype") or torch.bfloat16, device)
        _, plan = _planned(a, b, config=config, out=out, **kwargs)
        assert (plan.c_desc is not None, plan.res_desc is not None) == (c_desc, res_desc), name
        check(f"{name}-{layout}-e{slices}", out, a, b, **{k: v for k, v in kwargs.items() if k != "split_k"})
    for out_kind in ("col", "padded"):  # column-major: pointer store; padded (row stride 53 * 2 bytes): too
        out, base = strided_out(M, N, torch.bfloat16, device, out_kind)
        result, plan = _planned(a, b, config=config, out=out)
        assert plan.c_desc is None, out_kind
        check(f"out-{out_kind}", out, a, b)
        check_out_view(out_kind, out, base, result)
    without, plan = _planned(a, b, config=dataclasses.replace(config, tma_epilogue=False), **cases[2][1])
    assert plan.c_desc is None
    assert torch.equal(without, tk.gemm(a, b, config=config, **cases[2][1])), "TMA and pointer epilogues differ"


@pytest.mark.parametrize("slices", [3, -1, 8])
def test_bad_epilogue_slices(slices):
    with pytest.raises(ValueError, match="epilogue_slices"):
        GemmConfig(16, 32, 16, epilogue_slices=slices)
    with pytest.raises(ValueError, match="epilogue_slices"):
        GemmConfig(16, 2, 16, epilogue_slices=4)


def test_cached_plan_keeps_no_tensor_alive(device):
    """A launch plan is cached per signature; its TMA descriptor templates must not hold the first
    call's operands, output or residual (that memory would stay allocated as long as the plan)."""
    import gc
    import weakref

    M, N, K = 40, 48, 40
    a, b = operands(M, N, K, torch.bfloat16, "RR", device)
    residual = random_tensor((M, N), torch.bfloat16, device)
    out, plan = _planned(a, b, residual=residual, config=_tma_config())
    assert plan.c_desc is not None and plan.res_desc is not None
    refs = [weakref.ref(t) for t in (a, b, residual, out)]
    del a, b, residual, out
    gc.collect()
    assert all(r() is None for r in refs), "the cached plan keeps a call's tensors alive"


def test_async_input_takes_the_wider_group_on_large_tiles(monkeypatch):
    """The async-input kernel's own choice (configs.ASYNC_LARGE_GROUP_M): the large tile with a wider
    row-tile group on Hopper; every other class, and tk.gemm itself, as tuned."""
    from tilekernels.gemm import configs

    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    hopper = torch.device("cuda", 0)
    plain = select_config(16384, 8192, 8192, torch.bfloat16, hopper)
    waited = select_config(16384, 8192, 8192, torch.bfloat16, hopper, async_input=True)
    assert plain == TUNED_HOPPER_16BIT["large"]
    assert waited == dataclasses.replace(plain, group_m=configs.ASYNC_LARGE_GROUP_M) and waited.group_m != plain.group_m
    medium = select_config(2048, 2048, 8192, torch.bfloat16, hopper, async_input=True)
    assert medium == TUNED_HOPPER_16BIT["medium"]


def test_heavy_epilogue_takes_the_large_tile_on_medium_problems(monkeypatch):
    """configs.HEAVY_EPILOGUE_CLASS: a 16-bit heavy epilogue on Hopper moves the medium class to the large
    tile; the plain GEMM, fp32, the async-input kernel and every other class keep their tuned tile."""
    from tilekernels.gemm import configs

    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    hopper = torch.device("cuda", 0)
    assert select_config(2048, 7168, 4096, torch.bfloat16, hopper) == TUNED_HOPPER_16BIT["medium"]
    assert select_config(2048, 7168, 4096, torch.bfloat16, hopper, heavy_epilogue=True) == TUNED_HOPPER_16BIT["large"]
    assert select_config(2048, 7168, 4096, torch.float16, hopper, heavy_epilogue=True) == TUNED_HOPPER_16BIT["large"]
    assert (select_config(2048, 7168, 4096, torch.float32, hopper, heavy_epilogue=True)
            == select_config(2048, 7168, 4096, torch.float32, hopper))
    assert select_config(2048, 7168, 4096, torch.bfloat16, hopper, async_input=True,
                         heavy_epilogue=True) == TUNED_HOPPER_16BIT["medium"]
    assert select_config(128, 7168, 4096, torch.bfloat16, hopper, heavy_epilogue=True) == TUNED_HOPPER_16BIT["skinny"]
    monkeypatch.setattr(configs, "capability", lambda device: (8, 0))
    assert select_config(2048, 7168, 4096, torch.bfloat16, hopper, heavy_epilogue=True).block_n == 128


@pytest.mark.parametrize("sms", [132, 114])
def test_plain_medium_problems_take_the_tile_with_fewer_waves(sms, monkeypatch):
    """configs.LARGE_TILE_COST: a plain 16-bit medium problem on Hopper takes the large tile where its waves over
    the programs, times the cost of a large tile in medium tiles, are fewer than the medium tile's. The shapes and
    winners are the H100's measurements (132 SMs); an H100 PCIe's 114 SMs move some of them."""
    from tilekernels.gemm import configs

    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: sms)
    hopper = torch.device("cuda", 0)
    large, medium = TUNED_HOPPER_16BIT["large"], TUNED_HOPPER_16BIT["medium"]
    measured = {(2048, 2048, 8192): large, (2048, 4096, 4096): large, (1024, 8192, 8192): large,
                (2560, 2560, 8192): large, (4000, 4000, 2048): large, (1024, 4096, 4096): large,
                (512, 8192, 4096): large, (2048, 7168, 4096): medium, (3072, 3072, 4096): medium,
                (1536, 6144, 4096): medium}
    monkeypatch.setattr(configs, "fp32_precision", lambda: "tf32")   # fp32 through its tuned table
    for (M, N, K), tile in measured.items():
        def waves(cfg):
            return cdiv(cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n), sms)

        expect = large if waves(large) * configs.LARGE_TILE_COST < waves(medium) else medium
        if sms == 132:
            assert expect == tile, (M, N, K)
        assert select_config(M, N, K, torch.bfloat16, hopper) == expect, (M, N, K)
        assert select_config(M, N, K, torch.float16, hopper) == expect, (M, N, K)
        # fp32 (tf32) and the async-input kernel keep the medium tile: the rule was measured in 16 bits only
        assert select_config(M, N, K, torch.float32, hopper) == TUNED_HOPPER_FP32["medium"], (M, N, K)
        assert select_config(M, N, K, torch.bfloat16, hopper, async_input=True) == medium
    assert select_config(8192, 8192, 8192, torch.bfloat16, hopper) == large
    assert select_config(256, 8192, 8192, torch.bfloat16, hopper) == TUNED_HOPPER_16BIT["skinny"]


@pytest.mark.parametrize("sms", [132, 114])
def test_row_tail_plan(sms, monkeypatch):
    """configs.select_plan: where the last wave of tiles is part-full, the rows past whole waves go to a smaller
    tile in a launch of their own, if the model saves TAIL_MIN_GAIN. The split is always whole row tiles inside
    whole waves; the anchors (whole or nearly whole waves) keep select_config's single launch; fp32, non-Hopper
    and an override take no tail."""
    from tilekernels.gemm import configs

    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: sms)
    hopper = torch.device("cuda", 0)
    large, medium, skinny = (TUNED_HOPPER_16BIT[k] for k in ("large", "medium", "skinny"))
    if sms == 132:   # the H100's measured cases
        assert configs.select_plan(3072, 3072, 4096, torch.bfloat16, hopper) == (large, configs.RowTail(2816, skinny))
        assert configs.select_plan(6144, 3072, 4096, torch.bfloat16, hopper) == (large, configs.RowTail(5632, medium))
        for shape in ((8192, 8192, 8192), (4096, 4096, 4096), (16384, 3584, 8192), (8192, 28672, 8192),
                      (8192, 8192, 28672), (2048, 7168, 4096), (2048, 2048, 8192), (2560, 2560, 8192)):
            assert configs.select_plan(*shape, torch.bfloat16, hopper) == (
                select_config(*shape, torch.bfloat16, hopper), None), shape
    seen = 0
    for M, N, K in itertools.product((1000, 1536, 2048, 3072, 4096, 6144), (1024, 3072, 4608, 7168), (512, 4096)):
        for heavy in (False, True):
            cfg, tail = configs.select_plan(M, N, K, torch.bfloat16, hopper, heavy)
            if tail is None:
                assert cfg == select_config(M, N, K, torch.bfloat16, hopper, heavy_epilogue=heavy)
                continue
            seen += 1
            tiles_n = cdiv(N, cfg.block_n)
            assert tail.rows % cfg.block_m == 0 and 0 < tail.rows < M
            assert (tail.rows // cfg.block_m) * tiles_n <= (cdiv(M, cfg.block_m) * tiles_n // sms) * sms
            assert tail.config.block_m * tail.config.block_n < cfg.block_m * cfg.block_n
            assert not heavy or cfg == large
    assert seen > 0
    assert configs.select_plan(3072, 3072, 4096, torch.float32, hopper)[1] is None
    with override_config(large):
        assert configs.select_plan(3072, 3072, 4096, torch.bfloat16, hopper) == (large, None)
    monkeypatch.setattr(configs, "capability", lambda device: (8, 0))
    assert configs.select_plan(3072, 3072, 4096, torch.bfloat16, hopper)[1] is None


def _force_row_tail(monkeypatch, main: GemmConfig, tail: GemmConfig, rows: int):
    """Make every tk.gemm plan made from here on split at ``rows`` (those with more rows)."""
    from tilekernels.gemm import configs

    gemm_mod = importlib.import_module("tilekernels.gemm.gemm")

    def plan(M, N, K, dtype, device, heavy_epilogue=False):
        return (main, configs.RowTail(rows, tail)) if M > rows else (main, None)

    monkeypatch.setattr(gemm_mod, "select_plan", plan)
    monkeypatch.setattr(gemm_mod, "_PLANS", {})
    calls = []
    real = gemm_mod._tail_call
    monkeypatch.setattr(gemm_mod, "_tail_call", lambda *args: (calls.append(args[0]), real(*args))[1])
    return calls


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_row_tail_every_layout(layout, tma, monkeypatch):
    """A launch split into a main part and a row tail in another tile (forced here; the interpreter's own plan
    never splits): every row written, each part right, in every layout, with and without TMA descriptors (the
    tail's descriptors sit on row views of A and C)."""
    main = GemmConfig(32, 32, 32, 2, 4, 1, use_tma=tma)
    tail = GemmConfig(16, 16, 32, 2, 4, 1, use_tma=tma)
    calls = _force_row_tail(monkeypatch, main, tail, 64)
    for dtype in (torch.float16, torch.float32):
        M, N, K = 88, 72, 48
        a, b = operands(M, N, K, dtype, layout, "cpu")
        out = poisoned((M, N), dtype)
        tk.gemm(a, b, out=out)
        check(f"row tail {layout} {dtype}", out, a, b)
    assert len(calls) == 2 and calls[0].rows == 64 and calls[0].config == tail
    # the main launch alone (the tail switched off) leaves exactly the rows past 64 unwritten
    gemm_mod = importlib.import_module("tilekernels.gemm.gemm")
    monkeypatch.setattr(gemm_mod, "_tail_call", lambda *args: None)
    a, b = operands(88, 72, 48, torch.float32, layout, "cpu")
    out = poisoned((88, 72), torch.float32)
    tk.gemm(a, b, out=out)
    assert torch.equal(out[:64], tk.gemm(a[:64], b, config=main)) and out[64:].isnan().all()


def test_row_tail_epilogue_operands(monkeypatch):
    """The tail's rows of every [M, N]-shaped epilogue operand, and the broadcast ones whole: bias [N] and
    [M, N], mul [M, 1] and [1, N], scale_a [M] and [M, 1], residual [M, N] (also in place, out=residual), a
    strided out; fp16 with gelu."""
    calls = _force_row_tail(monkeypatch, GemmConfig(32, 32, 32, 2, 4, 1), GemmConfig(16, 32, 16, 2, 4, 1), 32)
    M, N, K = 70, 40, 24
    dt = torch.float16
    a, b = operands(M, N, K, dt, "RC", "cpu", unit=True)
    bias_n, bias_mn = random_tensor((N,), dt), random_tensor((M, N), dt)
    mul = [random_tensor((M, 1), dt), random_tensor((1, N), dt)]
    scale_a = random_tensor((M,), torch.float32).abs() + 0.5
    residual = random_tensor((M, N), dt)
    for bias, sa in ((bias_n, scale_a), (bias_mn, scale_a.reshape(M, 1))):
        out = poisoned((N, M), dt).t()   # column-major out
        tk.gemm(a, b, bias=bias, activation="gelu", mul=mul, scale_a=sa, residual=residual, beta=0.5, out=out)
        check("row tail epilogue", out, a, b, bias=bias, activation="gelu", mul=mul, scale_a=sa, residual=residual,
              beta=0.5)
    inplace = residual.clone()
    tk.gemm(a, b, bias=bias_n, residual=inplace, out=inplace)
    check("row tail out=residual", inplace, a, b, bias=bias_n, residual=residual)
    assert len(calls) == 3


def test_candidate_configs(device):
    """Every config the sweep would try on this device, on one small odd shape (the GPU lane has a
    bigger one, with the tuned configs too)."""
    M, N, K = 45, 70, 41
    a, b = operands(M, N, K, torch.float32, "RC", device)
    failures = []
    for cfg in candidate_configs(torch.float32, device):
        out = poisoned((M, N), torch.float32, device)
        tk.gemm(a, b, config=cfg, out=out)
        try:
            check(cfg.describe(), out, a, b)
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)


SPLIT_CASES = [
    # (split_k, layout, dtype, M, N, K)
    (2, "RR", "fp32", 37, 53, 130),
    (3, "CR", "bf16", 37, 20, 200),
    (3, "RC", "fp16", 9, 45, 20),    # more splits than K blocks: collapsed or empty splits add nothing
    ("auto", "CC", "bf16", 17, 29, 2111),  # one or two output tiles, long K: auto splits (CPU and GPU)
]


@pytest.mark.parametrize("split_k, layout, dtype, M, N, K", [
    pytest.param(s, lo, DTYPES[dt], M, N, K, id=f"split{s}-{case_id(lo, DTYPES[dt], M, N, K)}")
    for s, lo, dt, M, N, K in SPLIT_CASES])
def test_split_k(split_k, layout, dtype, M, N, K, device):
    """Split-K with a non-linear epilogue (which must see the full sum, once) into a poisoned out."""
    if split_k == "auto":
        cfg = select_config(M, N, K, dtype, device)
        assert auto_split_k(M, N, K, cfg, device) > 1, "auto must split here"
    a, b = operands(M, N, K, dtype, layout, device)
    epilogue = {"bias": random_tensor((N,), dtype, device), "activation": "gelu",
                "residual": random_tensor((M, N), dtype, device), "beta": 0.5, "alpha": 1.5}
    out = poisoned((M, N), dtype, device)
    tk.gemm(a, b, out=out, split_k=split_k, **epilogue)
    check(f"split{split_k}", out, a, b, **epilogue)
    again = tk.gemm(a, b, split_k=split_k, **epilogue)
    assert torch.equal(again, out), "split-K not bit-identical run to run"


def test_split_k_with_config(device):
    """Split-K over several 16x16 tiles per program, K tail inside the last split."""
    M, N, K = 30, 40, 100
    a, b = operands(M, N, K, torch.float32, "CC", device)
    epilogue = {"mul": (random_tensor((M, N), torch.float32, device),), "activation": "relu"}
    cfg = GemmConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1)
    out = poisoned((M, N), torch.float32, device)
    tk.gemm(a, b, split_k=4, config=cfg, out=out, **epilogue)
    check("split4-16x16x16", out, a, b, **epilogue)


def test_determinism_split_auto(device):
    M, N, K = 20, 24, 2111
    a, b = operands(M, N, K, torch.bfloat16, "RR", device)
    first = tk.gemm(a, b, split_k="auto")
    for _ in range(2):
        assert torch.equal(tk.gemm(a, b, split_k="auto"), first)
    check("auto", first, a, b)


@pytest.mark.parametrize("split_k", [1, 2], ids=["split1", "split2"])
@pytest.mark.parametrize("activation", [None, *ACTIVATIONS], ids=str)
def test_nan_inf_propagate(activation, split_k, device):
    """A NaN in A poisons its row, an inf in B its column (inf, or NaN where signs meet), through the
    bias and the activation exactly as in PyTorch: relu(NaN) is NaN, not 0."""
    M, N, K = 21, 34, 40
    a, b = operands(M, N, K, torch.float32, "RC", device)
    a[5, 7] = float("nan")
    b[3, 30] = float("inf")
    bias = random_tensor((N,), torch.float32, device)
    out = poisoned((M, N), torch.float32, device)
    tk.gemm(a, b, bias=bias, activation=activation, out=out, split_k=split_k)
    check(f"nan-inf-{activation}-split{split_k}", out, a, b, bias=bias, activation=activation)


def check_autograd(name, a, b, bias, grad):
    """Gradients of ``tk.gemm(a, b, bias=bias)`` for a, b and bias, each by the error-ratio rule against
    fp64 autograd and PyTorch's own autograd in the same precision (tf32 for fp32 on a GPU)."""
    leaves = [t.detach().clone().requires_grad_() for t in (a, b, bias)]
    out = tk.gemm(leaves[0], leaves[1], bias=leaves[2])
    grads = torch.autograd.grad(out, leaves, grad)
    check(f"fwd-{name}", out.detach(), a, b, bias=bias)

    def torch_grads(cast):
        xs = [cast(t.detach()).requires_grad_() for t in (a, b, bias)]
        return torch.autograd.grad(xs[0] @ xs[1] + xs[2], xs, cast(grad))

    ref = torch_grads(lambda t: t.to(device="cpu", dtype=torch.float64))
    low = torch_grads(lambda t: t.clone())
    for label, g, leaf, r, lo in zip(("grad_a", "grad_b", "grad_bias"), grads, leaves, ref, low):
        assert g.shape == leaf.shape and g.dtype == leaf.dtype, f"{label}: {g.shape} {g.dtype}"
        assert_close(f"{label}-{name}", g, r, lo)


@pytest.mark.parametrize("layout", ["RR", "CC", "RC"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_autograd(layout, dtype, device):
    M, N, K = 23, 37, 45
    a, b = operands(M, N, K, dtype, layout, device)
    bias = random_tensor((N,), dtype, device)
    grad = random_tensor((M, N), dtype, device)
    check_autograd(case_id(layout, dtype, M, N, K), a, b, bias, grad)


def test_autograd_partial(device):
    """Only b needs a gradient (a frozen input), and alpha/residual scale what flows back."""
    M, N, K = 19, 26, 33
    a, b = operands(M, N, K, torch.float32, "RR", device)
    residual = random_tensor((M, N), torch.float32, device)
    b_leaf = b.clone().requires_grad_()
    res_leaf = residual.clone().requires_grad_()
    out = tk.gemm(a, b_leaf, alpha=0.5, residual=res_leaf, beta=-2.0)
    grad = random_tensor((M, N), torch.float32, device)
    gb, gres = torch.autograd.grad(out, (b_leaf, res_leaf), grad)
    b64 = b.double().requires_grad_()
    r64 = residual.double().requires_grad_()
    rb, rres = torch.autograd.grad(0.5 * a.double() @ b64 - 2.0 * r64, (b64, r64), grad.double())
    lb_leaf = b.clone().requires_grad_()
    lr_leaf = residual.clone().requires_grad_()
    lb, lres = torch.autograd.grad(0.5 * a @ lb_leaf - 2.0 * lr_leaf, (lb_leaf, lr_leaf), grad)
    assert_close("grad_b", gb, rb, lb)
    assert_close("grad_residual", gres, rres, lres)


def test_autograd_with_activation_is_refused(device):
    a, b = operands(8, 8, 8, torch.float32, "RR", device)
    with pytest.raises(NotImplementedError, match="activation"):
        tk.gemm(a.requires_grad_(), b, activation="relu")


def test_custom_op_registration(device):
    """Schema, fake (meta) implementation and autograd registration agree with the real kernel."""
    M, N, K = 13, 21, 18
    a, b = operands(M, N, K, torch.float32, "RC", device)
    bias = random_tensor((N,), torch.float32, device)
    no_wait = (None, 0, 0, 0, 0)  # chunk_signals, rows_per_chunk, pivot_chunk, signal_value, max_spins
    args = (a, b, bias, None, [], "gelu", 1.0, 1.0, None, None, torch.float32, 1, *no_wait)
    torch.library.opcheck(torch.ops.tilekernels.gemm, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    out = poisoned((M, N), torch.float32, device)
    torch.library.opcheck(torch.ops.tilekernels.gemm_out,
                          (a, b, bias, None, [], None, 1.0, 1.0, None, None, 1, *no_wait, out),
                          test_utils=("test_schema", "test_faketensor"))
    signals = torch.ones(2, dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.tilekernels.gemm,
                          (a, b, bias, None, [], None, 1.0, 1.0, None, None, torch.float32, 1, signals, 7, 1, 1, 8),
                          test_utils=("test_schema", "test_faketensor"))


class GatedBlock(torch.nn.Module):
    """``silu(x @ W1 + b1) * (x @ W3) + x``: two tk.gemm calls and a fused multi-D epilogue."""

    def __init__(self, width, dtype, device):
        super().__init__()
        def frozen(t):
            return torch.nn.Parameter(t, requires_grad=False)

        self.w1 = frozen(random_matrix(width, width, dtype, device, scale=0.1))
        self.b1 = frozen(random_tensor((width,), dtype, device))
        self.w3 = frozen(random_matrix(width, width, dtype, device, scale=0.1, column_major=True))

    def forward(self, x):
        up = tk.gemm(x, self.w3)
        return tk.gemm(x, self.w1, bias=self.b1, activation="silu", mul=(up,), residual=x)

    def reference(self, x, compute_dtype):
        up = reference_gemm(x, self.w3, compute_dtype=compute_dtype)
        up = up if compute_dtype is None else up.to(x.dtype)  # the eager block rounds `up` to x's dtype
        return reference_gemm(x, self.w1, bias=self.b1, activation="silu", mul=(up,), residual=x,
                              compute_dtype=compute_dtype)


def check_compiled_block(block: GatedBlock, x: torch.Tensor) -> None:
    """torch.compile(fullgraph=True) of a block of tk.gemm calls: bit-equal to eager, within the rule."""
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        out = compiled(x)
        eager = block(x)
    assert torch.equal(out, eager), "compiled and eager tk.gemm disagree"
    assert_close("compiled", out, block.reference(x, torch.float64), block.reference(x, None))


def test_torch_compile_fullgraph(device):
    check_compiled_block(GatedBlock(48, torch.float32, device), random_tensor((19, 48), torch.float32, device))


def test_torch_compile_out_and_autograd(device):
    """The out= variant (a mutating op) and the backward pass under fullgraph compile."""
    torch._dynamo.reset()
    M, N, K = 17, 24, 32
    a, b = operands(M, N, K, torch.float32, "RR", device)
    bias = random_tensor((N,), torch.float32, device)

    def step(a, b, bias, out):
        tk.gemm(a.detach(), b.detach(), bias=bias.detach(), out=out, alpha=0.5)   # out= takes no autograd
        y = tk.gemm(a, b, bias=bias)
        return y.square().sum(), out * 2

    a_leaf, b_leaf, bias_leaf = (t.clone().requires_grad_() for t in (a, b, bias))
    out = poisoned((M, N), torch.float32, device)
    loss, doubled = torch.compile(step, fullgraph=True)(a_leaf, b_leaf, bias_leaf, out)
    loss.backward()
    check("compiled-out", out, a, b, bias=bias, alpha=0.5)
    assert torch.equal(doubled, out * 2)

    ref_leaves = [t.detach().double().requires_grad_() for t in (a, b, bias)]
    (ref_leaves[0] @ ref_leaves[1] + ref_leaves[2]).square().sum().backward()
    low_leaves = [t.detach().clone().requires_grad_() for t in (a, b, bias)]
    (low_leaves[0] @ low_leaves[1] + low_leaves[2]).square().sum().backward()
    for label, leaf, r, lo in zip(("grad_a", "grad_b", "grad_bias"), (a_leaf, b_leaf, bias_leaf), ref_leaves,
                                  low_leaves):
        assert_close(f"compiled-{label}", leaf.grad, r.grad, lo.grad)


# ---------------------------------------------------------------------------------------------------
# bad inputs: a ValueError or TypeError that names the argument (not a Triton error, not a wrong answer)


def _bad_cases():
    """Builders taking the test's device; each returns (a, b, kwargs)."""
    f16, f64 = torch.float16, torch.float64

    M, N, K = 6, 5, 4
    ok_a, ok_b = (lambda t: t(M, K)), (lambda t: t(K, N))
    cases = {
        # id: (builder(t) -> (a, b, kwargs), what the message must name); t(*shape, dtype=) makes tensors
        "K-mismatch": (lambda t: (t(M, K), t(K + 1, N), {}), r"\bK\b"),
        "mixed-dtypes": (lambda t: (t(M, K, dtype=f16), t(K, N, dtype=torch.bfloat16), {}), r"\bb\b"),
        "mixed-devices": (lambda t: (t(M, K), t(K, N).to("meta"), {}), r"\bb\b"),
        "a-3d": (lambda t: (t(2, M, K), ok_b(t), {}), r"\ba\b"),
        "b-1d": (lambda t: (ok_a(t), t(K), {}), r"\bb\b"),
        "a-float64": (lambda t: (t(M, K, dtype=f64), t(K, N, dtype=f64), {}), r"\ba\b.*dtype"),
        "a-int32": (lambda t: (t(M, K).to(torch.int32), t(K, N).to(torch.int32), {}), r"\ba\b.*dtype"),
        "not-a-tensor": (lambda t: (ok_a(t).tolist(), ok_b(t), {}), r"\ba\b"),
        "bias-wrong-N": (lambda t: (ok_a(t), ok_b(t), {"bias": t(N + 1)}), r"\bbias\b"),
        "bias-M-vector": (lambda t: (ok_a(t), ok_b(t), {"bias": t(M)}), r"\bbias\b"),
        "bias-wrong-MN": (lambda t: (ok_a(t), ok_b(t), {"bias": t(M, N + 1)}), r"\bbias\b"),
        "bias-3d": (lambda t: (ok_a(t), ok_b(t), {"bias": t(1, M, N)}), r"\bbias\b"),
        "bias-device": (lambda t: (ok_a(t), ok_b(t), {"bias": t(N).to("meta")}), r"\bbias\b"),
        "residual-shape": (lambda t: (ok_a(t), ok_b(t), {"residual": t(N, M)}), r"\bresidual\b"),
        "mul-shape": (lambda t: (ok_a(t), ok_b(t), {"mul": (t(M, N), t(M + 1, N))}), r"\bmul"),
        "mul-three": (lambda t: (ok_a(t), ok_b(t), {"mul": (t(M, N),) * 3}), r"\bmul\b"),
        "mul-bare-tensor": (lambda t: (ok_a(t), ok_b(t), {"mul": t(M, N)}), r"\bmul\b"),
        "activation": (lambda t: (ok_a(t), ok_b(t), {"activation": "tanh"}), r"\bactivation\b"),
        "out-shape": (lambda t: (ok_a(t), ok_b(t), {"out": t(N, M)}), r"\bout\b"),
        "out-dtype-clash": (lambda t: (ok_a(t), ok_b(t), {"out": t(M, N), "out_dtype": f16}), r"\bout"),
        "out-float64": (lambda t: (ok_a(t), ok_b(t), {"out": t(M, N, dtype=torch.float64)}), r"\bout\b"),
        "out-overlapping": (lambda t: (ok_a(t), ok_b(t), {"out": t(1, N).expand(M, N)}), r"\bout\b"),
        "out_dtype-int64": (lambda t: (ok_a(t), ok_b(t), {"out_dtype": torch.int64}), r"\bout_dtype\b"),
        "split_k-0": (lambda t: (ok_a(t), ok_b(t), {"split_k": 0}), r"\bsplit_k\b"),
        "split_k-negative": (lambda t: (ok_a(t), ok_b(t), {"split_k": -2}), r"\bsplit_k\b"),
        "split_k-float": (lambda t: (ok_a(t), ok_b(t), {"split_k": 2.0}), r"\bsplit_k\b"),
        "split_k-string": (lambda t: (ok_a(t), ok_b(t), {"split_k": "max"}), r"\bsplit_k\b"),
        "split_k-bool": (lambda t: (ok_a(t), ok_b(t), {"split_k": True}), r"\bsplit_k\b"),
        "scale_a-shape": (lambda t: (ok_a(t), ok_b(t), {"scale_a": t(M + 1)}), r"\bscale_a\b"),
        "scale_b-shape": (lambda t: (ok_a(t), ok_b(t), {"scale_b": t(M)}), r"\bscale_b\b"),
        "alpha-string": (lambda t: (ok_a(t), ok_b(t), {"alpha": "2"}), r"\balpha\b"),
        "out_dtype-string": (lambda t: (ok_a(t), ok_b(t), {"out_dtype": "bf16"}), r"\bout_dtype\b"),
        "config-type": (lambda t: (ok_a(t), ok_b(t), {"config": (64, 64, 32)}), r"\bconfig\b"),
    }
    return [pytest.param(build, match, id=name) for name, (build, match) in cases.items()]


@pytest.mark.parametrize("build, match", _bad_cases())
def test_bad_input(build, match, device):
    def t(*shape, dtype=torch.float32):
        return random_tensor(shape, dtype, device)

    a, b, kwargs = build(t)
    with pytest.raises((ValueError, TypeError), match=match):
        tk.gemm(a, b, **kwargs)


def test_operand_broadcast_rule_matches_torch():
    """The operand check applies broadcasting's rule to the shape itself (torch.broadcast_shapes costs 10-20 us of
    host time a call): it accepts exactly the shapes torch broadcasts to [M, N], over every shape of up to three
    dimensions built from 0, 1, M, N and M + 1."""
    from tilekernels.gemm.gemm import _check_operand

    for M, N in ((3, 5), (4, 4), (1, 6), (6, 1), (1, 1)):
        sizes = sorted({0, 1, M, N, M + 1})
        shapes = [()] + [(d,) for d in sizes] + list(itertools.product(sizes, sizes))
        shapes += list(itertools.product((1, 2), (1, M), (1, N)))
        for shape in shapes:
            t = torch.empty(shape)
            try:
                ok = len(shape) <= 2 and torch.broadcast_shapes(shape, (M, N)) == (M, N)
            except RuntimeError:
                ok = False
            if ok:
                _check_operand("bias", t, M, N, t.device)
            else:
                with pytest.raises(ValueError, match=r"\bbias\b.*broadcast"):
                    _check_operand("bias", t, M, N, t.device)


def test_out_sharing_memory_with_inputs(device):
    """out= that overlaps an input (or itself) is refused, naming what it overlaps: the kernel reads the
    inputs after other tiles have written C. out=residual (the same elements) and out a column block of a
    buffer whose other columns hold a (a fused QKV buffer) are allowed and exact."""
    M, N, K = 40, 40, 40
    a = random_tensor((M, K), torch.float32, device)
    b = random_tensor((K, N), torch.float32, device)
    for name, out in (("a", a), ("b", b), ("a", a.t()), ("b", b.t())):
        with pytest.raises(ValueError, match=rf"out overlaps {name}\b"):
            tk.gemm(a, b, out=out)
    shared = torch.empty(M * N + N, device=device)
    bias = shared[-N:].normal_()
    with pytest.raises(ValueError, match=r"out overlaps bias\b"):
        tk.gemm(a, b, bias=bias, out=shared[N:].view(M, N))
    self_overlap = torch.empty(M * N, device=device).as_strided((M, N), (1, 1))
    with pytest.raises(ValueError, match=r"\bout\b.*overlapping"):
        tk.gemm(a, b, out=self_overlap)
    # allowed: out is the residual itself; out and a are disjoint column blocks of one buffer
    residual = random_tensor((M, N), torch.float32, device)
    original = residual.clone()
    tk.gemm(a, b, residual=residual, out=residual)
    check("out=residual", residual, a, b, residual=original)
    buffer = random_tensor((M, K + N), torch.float32, device)
    a_view, out_view = buffer[:, :K], buffer[:, K:]
    a_before = a_view.clone()
    tk.gemm(a_view, b, out=out_view)
    assert torch.equal(a_view, a_before)
    check("out beside a", out_view, a_before, b)


def test_out_refuses_autograd(device):
    a = random_tensor((8, 8), torch.float32, device).requires_grad_()
    b = random_tensor((8, 8), torch.float32, device)
    with pytest.raises(ValueError, match=r"out= does not support autograd"):
        tk.gemm(a, b, out=torch.empty(8, 8, device=device))
    with torch.no_grad():
        out = tk.gemm(a, b, out=torch.empty(8, 8, device=device))
    check("no_grad out=", out, a.detach(), b)


def test_alpha_too_large(device):
    a, b = random_tensor((4, 4), torch.float32, device), random_tensor((4, 4), torch.float32, device)
    with pytest.raises(ValueError, match=r"\balpha\b"):
        tk.gemm(a, b, alpha=10 ** 400)


@pytest.mark.parametrize("field, value", [("block_m", 7), ("block_m", 0), ("block_k", "16"), ("num_warps", 3),
                                          ("group_m", 0), ("num_stages", 0), ("programs_per_sm", 0),
                                          ("use_tma", 1), ("block_n", True)])
def test_bad_gemm_config(field, value):
    with pytest.raises((ValueError, TypeError), match=rf"GemmConfig: {field}\b"):
        GemmConfig(**{field: value})


# ====================================================================================================
# GPU lane (-m gpu): real sizes, every config, what only a GPU shows


GPU_SHAPES = [(1, 1, 1), (37, 53, 71), (1, 4096, 4096), (4096, 1, 4096), (1000, 2000, 3001),
              (2048, 2048, 2048)]


@gpu
@pytest.mark.parametrize("layout, dtype, M, N, K", grid(LAYOUTS, DTYPES, GPU_SHAPES))
def test_gpu_layouts(layout, dtype, M, N, K, device):
    a, b = operands(M, N, K, dtype, layout, device)
    out = poisoned((M, N), dtype, device)
    tk.gemm(a, b, out=out)
    check(case_id(layout, dtype, M, N, K), out, a, b)
    check(case_id(layout, dtype, M, N, K) + "-alloc", tk.gemm(a, b), a, b)


@gpu
@pytest.mark.parametrize("layout, dtype, M, N, K", grid(("RR", "CC"), ("bf16",), [(4096, 4096, 4096)]))
def test_gpu_large(layout, dtype, M, N, K, device):
    a, b = operands(M, N, K, dtype, layout, device)
    check(case_id(layout, dtype, M, N, K), tk.gemm(a, b), a, b)


@gpu
@pytest.mark.parametrize("M, N, K", [(4096, 4096, 1024), (4100, 4104, 1000)])
def test_gpu_large_tile_heavy_epilogue(M, N, K, device):
    # The large tile with bias + gelu + residual runs at 3 stages so that C and the residual go through
    # TMA (gemm._epilogue_config); edges and a K tail included, and the output poisoned first.
    a, b = operands(M, N, K, torch.bfloat16, "RR", device)
    epilogue = {"bias": random_tensor((N,), torch.bfloat16, device), "activation": "gelu",
                "residual": random_tensor((M, N), torch.bfloat16, device)}
    out = poisoned((M, N), torch.bfloat16, device)
    tk.gemm(a, b, out=out, **epilogue)
    check(f"heavy-{M}x{N}x{K}", out, a, b, **epilogue)


@gpu
def test_gpu_medium_heavy_epilogue_takes_the_large_tile(device, monkeypatch):
    # configs.HEAVY_EPILOGUE_CLASS on the device: a medium problem with bias + gelu + residual runs the large tile
    # at 3 stages with C and the residual through TMA and its loops fused; edges in M and N, a K tail, the output
    # poisoned first. (gemm_kernel's launch; on Hopper the Gluon kernel takes it by default: test_gemm_gluon.py.)
    monkeypatch.setenv("TILEKERNELS_GEMM_GLUON", "0")
    M, N, K = 1000, 2056, 1000
    a, b = operands(M, N, K, torch.bfloat16, "RR", device)
    epilogue = {"bias": random_tensor((N,), torch.bfloat16, device), "activation": "gelu",
                "residual": random_tensor((M, N), torch.bfloat16, device)}
    out = poisoned((M, N), torch.bfloat16, device)
    _, plan = _planned(a, b, out=out, **epilogue)
    assert (plan.cfg.block_m, plan.cfg.block_n, plan.cfg.num_stages) == (128, 256, 3)
    assert plan.c_desc is not None and plan.res_desc is not None
    check(f"medium-heavy-{M}x{N}x{K}", out, a, b, **epilogue)


@gpu
@pytest.mark.parametrize("layout", ["RR", "RC", "CR"])
def test_gpu_row_tail(layout, device):
    # configs.select_plan on this device: a shape whose last wave of tiles is part-full splits its rows into a main
    # launch and a tail in a smaller tile. Plain and bias + gelu + residual, edges in M and N, out poisoned: within
    # the error rule, and bit-identical to the main config over all rows in one launch (the same K order per
    # element; outputs were bit-identical between the 128x128 and 128x256 tiles too).
    from tilekernels.gemm import configs

    gemm_mod = importlib.import_module("tilekernels.gemm.gemm")
    shapes = [(3000, 3000, 4096), (3072, 3072, 4096), (6144, 3072, 4096), (1536, 6144, 4096), (4096, 4608, 4096)]
    split = [(s, configs.select_plan(*s, torch.bfloat16, device)) for s in shapes]
    split = [(s, plan) for s, plan in split if plan[1] is not None]
    if not split:
        pytest.skip(f"no row tail for these shapes on {configs.sm_count(device)} SMs")
    (M, N, K), _ = split[0]
    a, b = operands(M, N, K, torch.bfloat16, layout, device, unit=True)
    for epilogue in ({}, {"bias": random_tensor((N,), torch.bfloat16, device), "activation": "gelu",
                          "residual": random_tensor((M, N), torch.bfloat16, device)}):
        gemm_mod._PLANS.clear()
        out = poisoned((M, N), torch.bfloat16, device)
        tk.gemm(a, b, out=out, **epilogue)
        mains = [p for p in gemm_mod._PLANS.values() if p.tail is not None]
        planned = configs.select_plan(M, N, K, torch.bfloat16, device, bool(epilogue))
        assert planned[1] is not None and [p.tail for p in mains] == [planned[1]], planned
        check(f"row-tail-{layout}-{M}x{N}x{K}-{sorted(epilogue)}", out, a, b, **epilogue)
        # the main launch's own kernel and config over all rows (a heavy epilogue's is a stage fewer, for its TMA
        # epilogue; a Gluon main launch, gemm._gluon_takes, is compared with the Gluon kernel)
        if mains[0].gluon is not None:
            from tilekernels.gemm._gluon import fused_gemm
            single = fused_gemm(a, b, epilogue.get("bias"), epilogue.get("activation"), epilogue.get("residual"))
        else:
            single = tk.gemm(a, b, config=mains[0].cfg, **epilogue)
        assert torch.equal(out, single), f"{(out != single).sum().item()} elements differ from one launch"


@gpu
def test_gpu_large_tile_fp32_out(device):
    # The 128x256 tile's fp32 C does not fit the TMA epilogue's staging, so the pointer epilogue runs;
    # its layout change needs shared memory beside the operand pipeline if the tile and K loops were
    # fused (320 KiB: tk.dist's reduce-scatter partials failed to launch until the plan checked it).
    M, N, K = 4096, 4096, 512
    a, b = operands(M, N, K, torch.bfloat16, "RR", device)
    check("fp32-out", tk.gemm(a, b, out_dtype=torch.float32), a, b, out_dtype=torch.float32)
    signals = torch.ones(2, dtype=torch.int32, device=device)
    out = tk.gemm(a, b, out_dtype=torch.float32, async_input=tk.AsyncInputScheduler(signals, M // 2, 1))
    check("fp32-out-async", out, a, b, out_dtype=torch.float32)


def test_flatten_only_where_shared_memory_allows():
    from tilekernels.gemm.gemm import _can_flatten

    large = TUNED_HOPPER_16BIT["large"]  # 128x256x64, 4 stages: 192 KiB of operand buffers
    a = torch.empty(1, 1, dtype=torch.bfloat16)
    assert _can_flatten(large, a, 4, tma_epilogue=True, heavy=False)
    assert not _can_flatten(large, a, 1, tma_epilogue=False, heavy=False)  # + 128 KiB fp32 layout change
    three = dataclasses.replace(large, num_stages=3)
    assert _can_flatten(three, a, 2, tma_epilogue=True, heavy=True)  # level or faster fused
    assert not _can_flatten(three, a, 2, tma_epilogue=False, heavy=True)  # pointer epilogue: measured slower fused
    with override_config(three):
        assert _can_flatten(three, a, 2, tma_epilogue=False, heavy=True)  # the caller's choice


def test_heavy_epilogue_gives_up_a_stage_for_the_tma_epilogue():
    from tilekernels.gemm.gemm import _epilogue_config

    def config(cfg, use_tma, c, res, split_k):
        return _epilogue_config(cfg, use_tma, a, c, res, True, split_k)

    large = TUNED_HOPPER_16BIT["large"]  # 4 stages: no room for the staging of C and a residual
    a = torch.empty(4096, 4096, dtype=torch.bfloat16)
    c, res = torch.empty_like(a), torch.empty_like(a)
    cfg, _, c_desc, res_desc = config(large, True, c, res, 1)
    assert cfg.num_stages == 3 and c_desc is not None and res_desc is not None
    assert config(large, True, c, None, 1)[0] is large  # C's staging alone fits
    assert config(large, True, c, res.t(), 1)[0] is large  # a residual TMA cannot read
    assert config(large, True, c, res, 2)[0] is large  # split-K: no TMA epilogue
    assert config(large, False, c, res, 1)[0] is large  # pointer operands
    three = dataclasses.replace(large, num_stages=3)
    assert config(three, True, c, res, 1)[0] is three
    with override_config(large):
        assert config(large, True, c, res, 1)[0] is large  # the caller's choice


@gpu
@pytest.mark.parametrize("kind", EPILOGUES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gpu_epilogue(kind, dtype, device):
    M, N, K = 777, 1025, 1537
    for layout in ("RR", "CC"):
        a, b = operands(M, N, K, dtype, layout, device, unit=True)
        epilogue = epilogue_operands(kind, M, N, dtype, device)
        check(f"{kind}-{case_id(layout, dtype, M, N, K)}", tk.gemm(a, b, **epilogue), a, b, **epilogue)


@gpu
@pytest.mark.parametrize("out_kind", ["col", "padded", "step"])
def test_gpu_out_strided_poisoned(out_kind, device):
    M, N, K = 1000, 2000, 3001
    a, b = operands(M, N, K, torch.bfloat16, "RC", device)
    epilogue = epilogue_operands("all", M, N, torch.bfloat16, device)
    out, base = strided_out(M, N, torch.bfloat16, device, out_kind)
    result = tk.gemm(a, b, out=out, **epilogue)
    check_out_view(out_kind, out, base, result)
    check(f"out-{out_kind}", out, a, b, **epilogue)


@gpu
@pytest.mark.parametrize("M", [16, 64, 128])
@pytest.mark.parametrize("split_k", [1, "auto", 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_skinny(M, split_k, dtype, device):
    # At M = 16, N = 1024 leaves most SMs idle, so "auto" must split; at N = 4096 it must not.
    N, K = (1024 if split_k == "auto" and M == 16 else 4096), 8192
    if split_k == "auto" and M == 16 and dtype == torch.bfloat16:
        cfg = select_config(M, N, K, dtype, device)
        assert auto_split_k(M, N, K, cfg, device) > 1, "auto must split here"
    a, b = operands(M, N, K, dtype, "RC", device)
    epilogue = {"bias": random_tensor((N,), dtype, device), "activation": "gelu_tanh",
                "residual": random_tensor((M, N), dtype, device)}
    out = poisoned((M, N), dtype, device)
    tk.gemm(a, b, out=out, split_k=split_k, **epilogue)
    check(f"skinny-split{split_k}-{case_id('RC', dtype, M, N, K)}", out, a, b, **epilogue)
    for _ in range(3):
        assert torch.equal(tk.gemm(a, b, split_k=split_k, **epilogue), out), "not bit-identical run to run"


def _gpu_configs(dtype, device):
    """Every sweep candidate and every tuned winner (adapted as select_config would on this GPU)."""
    tuned = TUNED_HOPPER_FP32 if dtype == torch.float32 else TUNED_HOPPER_16BIT
    tma_ok = supports_tensor_descriptors(device)
    configs = list(candidate_configs(dtype, device))
    for cfg in tuned.values():
        if not tma_ok:
            cfg = dataclasses.replace(cfg, use_tma=False, warp_specialize=False)
        configs.append(cfg)
    return list(dict.fromkeys(configs))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_every_config(dtype, device):
    """Each candidate and tuned config on one odd shape (edge tiles in M, N and K), the layout rotating
    from config to config so every layout meets TMA and pointer configs; all failures are listed."""
    M, N, K = 515, 769, 1031
    bias = random_tensor((N,), dtype, device)
    inputs = {layout: operands(M, N, K, dtype, layout, device) for layout in LAYOUTS}
    failures = []
    configs = _gpu_configs(dtype, device)
    for i, cfg in enumerate(configs):
        layout = LAYOUTS[i % len(LAYOUTS)]
        a, b = inputs[layout]
        out = poisoned((M, N), dtype, device)
        try:
            tk.gemm(a, b, bias=bias, out=out, config=cfg)
            torch.cuda.synchronize()
            check(f"{cfg.describe()}-{layout}", out, a, b, bias=bias)
        except Exception as err:  # noqa: BLE001 (collect every failing config, compile errors included)
            failures.append(f"{layout} {cfg}: {type(err).__name__}: {str(err)[:300]}")
    assert not failures, f"{len(failures)} of {len(configs)} configs failed:\n" + "\n".join(failures)


@gpu
@pytest.mark.parametrize("layout", ["RR", "CC"])
def test_gpu_tf32_is_tf32_accurate(layout, device):
    """With torch's tf32 switch on, fp32 runs on tf32 tensor cores, within the rule against torch's
    own tf32 answer (operands rounded to nearest tf32, as cuBLAS does, not truncated)."""
    M, N, K = 1000, 2000, 3001
    a, b = operands(M, N, K, torch.float32, layout, device)
    with allow_tf32():
        result = check(f"tf32-{layout}", tk.gemm(a, b), a, b)
    assert result.max_err_torch > 1e-3, "torch's answer should carry tf32 error here"


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_autograd(dtype, device):
    M, N, K = 1000, 2048, 1536
    a, b = operands(M, N, K, dtype, "RC", device)
    bias = random_tensor((N,), dtype, device)
    grad = random_tensor((M, N), dtype, device)
    check_autograd(case_id("RC", dtype, M, N, K), a, b, bias, grad)


@gpu
def test_gpu_first_call_in_a_fresh_thread(device):
    """A thread that has made no CUDA runtime call yet (torch's autograd backward thread is one) has no
    current context, and Triton encodes TMA descriptors before its launcher sets one: the first launch
    of an already compiled kernel there must still work, through a cached plan and through a new one."""
    N, K = 512, 384
    bias = random_tensor((N,), torch.bfloat16, device)
    inputs = {M: operands(M, N, K, torch.bfloat16, "RC", device) for M in (256, 512)}
    for a, b in inputs.values():
        tk.gemm(a, b, bias=bias)  # compiles (one kernel for both M) and leaves the allocator warm
    importlib.import_module("tilekernels.gemm.gemm")._PLANS.clear()
    tk.gemm(*inputs[256], bias=bias)  # only M = 256 is planned now; M = 512 makes a new plan in the thread
    torch.cuda.synchronize()
    for M in (256, 512):
        a, b = inputs[M]
        results = {}

        def run(a=a, b=b, results=results):
            try:
                results["out"] = tk.gemm(a, b, bias=bias)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001  (reported in the main thread)
                results["error"] = e

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert "error" not in results, f"M={M}: tk.gemm in a fresh thread raised {results.get('error')!r}"
        check(f"fresh-thread-M{M}", results["out"], a, b, bias=bias)


@gpu
@pytest.mark.parametrize("split_k", [1, "auto"])
def test_gpu_cuda_graph(split_k, device):
    """Capture tk.gemm (split-K workspace included) in a CUDA graph, change the inputs, replay."""
    M, N, K = 64, 1024, 8192
    a, b = operands(M, N, K, torch.bfloat16, "RR", device)
    bias = random_tensor((N,), torch.bfloat16, device)
    out = poisoned((M, N), torch.bfloat16, device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile and warm up outside the capture
            tk.gemm(a, b, bias=bias, activation="relu", out=out, split_k=split_k)
            fresh = tk.gemm(a, b, bias=bias, split_k=split_k)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.gemm(a, b, bias=bias, activation="relu", out=out, split_k=split_k)
        fresh = tk.gemm(a, b, bias=bias, split_k=split_k)
    for _ in range(2):
        a.copy_(random_tensor((M, K), torch.bfloat16, device))
        bias.copy_(random_tensor((N,), torch.bfloat16, device))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check("graph-out", out, a, b, bias=bias, activation="relu")
        check("graph-alloc", fresh, a, b, bias=bias)


@gpu
@pytest.mark.parametrize("M, dtype", [(16, torch.bfloat16), (300, torch.float32)], ids=["M16-bf16", "M300-fp32"])
def test_gpu_repeated_calls_follow_each_signature(M, dtype, device):
    """The same on a GPU, where a cached plan launches the compiled kernel directly (no re-binding):
    TMA and pointer paths, tiny and ordinary shapes."""
    run_signature_sequence(M, 1000, 520, dtype, device)


@gpu
def test_gpu_torch_compile(device):
    block = GatedBlock(1024, torch.bfloat16, device)
    x = random_tensor((333, 1024), torch.bfloat16, device)
    check_compiled_block(block, x)
    with torch.no_grad():
        eager = block(x)
    graphed = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(graphed(x), eager)


@gpu
@pytest.mark.parametrize("layout", ["RR", "CR"])
def test_gpu_operand_past_2g_elements(layout, device):
    """A with more than 2^31 elements: row (or column) offsets past int32 must be 64-bit. Only the last
    rows are checked against the reference (the full fp64 product would take minutes)."""
    M, N, K = 2**16 + 77, 96, 2**15 + 8  # A has ~2.15e9 elements
    shape_a = (K, M) if layout[0] == "C" else (M, K)
    a = torch.randn(shape_a, dtype=torch.bfloat16, device=device)  # made on the GPU: 4 GiB
    a = a.t() if layout[0] == "C" else a
    b = random_matrix(K, N, torch.bfloat16, device)
    out = poisoned((M, N), torch.bfloat16, device)
    tk.gemm(a, b, out=out)
    tail = slice(M - 100, M)
    check("tail-rows", out[tail], a[tail], b)
    head = slice(0, 50)
    check("head-rows", out[head], a[head], b)
    assert not torch.isnan(out).any(), "some rows were never written"


@gpu
def test_gpu_output_past_2g_elements(device):
    """C and the residual with more than 2^31 elements: the epilogue's loads and stores need 64-bit
    offsets too. The first and last rows are checked against the reference."""
    M, N, K = 2**16 + 77, 2**15 + 8, 40
    a, b = operands(M, N, K, torch.bfloat16, "RC", device)
    residual = torch.randn((M, N), dtype=torch.bfloat16, device=device)
    out = poisoned((M, N), torch.bfloat16, device)
    tk.gemm(a, b, out=out, residual=residual, beta=0.5)
    for rows in (slice(0, 50), slice(M - 50, M)):
        check(f"rows-{rows.start}", out[rows], a[rows], b, residual=residual[rows], beta=0.5)
    assert not torch.isnan(out).any(), "some elements were never written"


@gpu
def test_gpu_mixed_devices(device):
    a, b = operands(64, 64, 64, torch.bfloat16, "RR", device)
    for kwargs, name in (({"bias": random_tensor((64,), torch.bfloat16)}, "bias"),
                         ({"residual": random_tensor((64, 64), torch.bfloat16)}, "residual"),
                         ({"mul": (random_tensor((64, 64), torch.bfloat16),)}, "mul"),
                         ({"out": poisoned((64, 64), torch.bfloat16)}, "out")):
        with pytest.raises((ValueError, TypeError), match=rf"\b{name}"):
            tk.gemm(a, b, **kwargs)
    with pytest.raises((ValueError, TypeError), match=r"\bb\b"):
        tk.gemm(a, b.cpu())
