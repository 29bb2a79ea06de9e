"""tk.dynamic_quant / tk.smooth_quant / tk.moe_smooth_quant / tk.add_rms_norm_quant against the fp64
reference of ``tilekernels.norm.reference``.

The rule (``assert_quant_close``): every element of q within one quantisation step of
``z * QMAX / amax`` and equal to the exact quantisation (int8 rounded half to even, e4m3 to nearest
even) on all but 0.2% of the elements; row_scale by the error-ratio rule against PyTorch's fp32
``amax / QMAX``, with NaN parity. Outputs the ops allocate are NaN-filled by torch
(``fill_uninitialized_memory`` under deterministic mode; int8 gets 127) so an element no kernel wrote
shows up.

CPU lane (no marker; ``TRITON_INTERPRET=1``): fp32/fp16/bf16 x, int8 and float8_e4m3fn, rows of 1 to
4099 columns (multi-pass past 1024 under the interpreter), 1-D, 3-D, padded, strided and transposed x;
smooth scales in fp32 and bf16; hand-picked ties and carries; zero, tiny and NaN rows; MoE rows k-major with
int32/int64 ids, out-of-range ids (NaN row, the others intact); add_rms_norm_quant equal to the
rms_norm it names; empty inputs; torch.compile; argument checks.

GPU lane (``-m gpu``): real sizes, CUDA graph capture with new routing replayed, no host
synchronisation.

Ids read ``bf16-e4m3-M3N4099-padded``.
"""

from __future__ import annotations

import math

import pytest
import torch

import tilekernels as tk
from tilekernels.norm.reference import (
    assert_quant_close,
    reference_moe_rows,
    reference_quant,
    reference_rms_norm,
)
from tilekernels.testing import assert_no_host_sync, capture_graph, random_tensor

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
QUANT_DTYPES = {"int8": torch.int8, "e4m3": torch.float8_e4m3fn}
QUANT_NAMES = {v: k for k, v in QUANT_DTYPES.items()}

gpu = pytest.mark.gpu


# ====================================================================================================
# inputs


def rows(M, N, dtype, device, layout="2d", scale=1.0):
    """x of ``M`` rows of ``N`` in ``layout``: ``2d``, ``padded`` (row stride > N), ``step`` (every other
    column), ``1d`` (one row ``[N]``), ``3d`` (``[2, M, N]``), ``3d-transposed`` (``[M, 2, N]``
    transposed: no single row stride)."""
    def t(*shape):
        return random_tensor(shape, dtype, device, scale=scale)

    if layout == "2d":
        return t(M, N)
    if layout == "padded":
        return t(M, N + 9)[:, 4:N + 4]
    if layout == "step":
        return t(M, 2 * N)[:, ::2]
    if layout == "1d":
        return t(N)
    if layout == "3d":
        return t(2, M, N)
    if layout == "3d-transposed":
        return t(M, 2, N).transpose(0, 1)
    raise ValueError(layout)


def smooth(N, dtype, device):
    """A smooth scale in [0.5, 1.5): every column counts."""
    return (torch.rand(N, device=device) + 0.5).to(dtype)


def grid(shapes, dtypes=None, quant_dtypes=None, marks=()):
    dtypes = DTYPES.values() if dtypes is None else dtypes
    quant_dtypes = QUANT_DTYPES.values() if quant_dtypes is None else quant_dtypes
    return [pytest.param(dt, qdt, M, N, layout, id=f"{DTYPE_NAMES[dt]}-{QUANT_NAMES[qdt]}-M{M}N{N}-{layout}",
                         marks=marks)
            for (M, N, layout) in shapes for dt in dtypes for qdt in quant_dtypes]


SHAPES = [(1, 1, "2d"), (3, 7, "2d"), (5, 1000, "2d"), (3, 4099, "2d"), (1, 1000, "1d"), (3, 33, "3d"),
          (3, 1000, "padded"), (3, 100, "step"), (2, 4099, "3d-transposed")]


# ====================================================================================================
# CPU lane: dynamic and smooth quantisation


@pytest.mark.parametrize("dtype, quant_dtype, M, N, layout", grid(SHAPES))
def test_dynamic_quant(dtype, quant_dtype, M, N, layout, device, poison_allocations):
    x = rows(M, N, dtype, device, layout)
    q, row_scale = tk.dynamic_quant(x, quant_dtype)
    assert q.device == x.device and row_scale.device == x.device
    assert_quant_close(f"dynamic-{layout}", q, row_scale, x.double(), x.float(), quant_dtype)


@pytest.mark.parametrize("smooth_dtype", [torch.float32, torch.bfloat16], ids=["smooth-fp32", "smooth-bf16"])
@pytest.mark.parametrize("dtype, quant_dtype, M, N, layout",
                         grid([(3, 7, "2d"), (5, 1000, "2d"), (3, 4099, "padded"), (2, 33, "3d-transposed")]))
def test_smooth_quant(dtype, quant_dtype, M, N, layout, smooth_dtype, device, poison_allocations):
    x = rows(M, N, dtype, device, layout)
    smooth_scale = smooth(N, smooth_dtype, device)
    q, row_scale = tk.smooth_quant(x, smooth_scale, quant_dtype)
    z = x.to(device="cpu", dtype=torch.float64) * smooth_scale.to(device="cpu", dtype=torch.float64)
    assert_quant_close(f"smooth-{layout}", q, row_scale, z, x.float() * smooth_scale.float(), quant_dtype)


def _forced_config_run(op, x, smooth_scale, quant_dtype, config):
    """(q, row_scale, the kernels planned) of dynamic_quant (``smooth_scale`` None) or smooth_quant with the forward
    config forced to ``config``."""
    from tilekernels.norm import _kernels as kern
    from tilekernels.norm import norm as norm_module

    saved = kern.config_override.copy()
    kern.config_override.clear()
    kern.config_override["forward"] = config
    norm_module._FORWARD_PLANS.clear()
    try:
        out = op(x, quant_dtype) if smooth_scale is None else op(x, smooth_scale, quant_dtype)
        kernels = {plan.kernel for plan in norm_module._FORWARD_PLANS.values()}
    finally:
        kern.config_override.clear()
        kern.config_override.update(saved)
        norm_module._FORWARD_PLANS.clear()
    return (*out, kernels)


@pytest.mark.parametrize("kind", ["dynamic", "smooth"])
@pytest.mark.parametrize("dtype, quant_dtype, M, N, layout",
                         grid([(37, 1000, "2d"), (9, 1024, "padded"), (5, 64, "step"), (1, 7, "2d")],
                              dtypes=[torch.bfloat16, torch.float32]))
def test_lean_quant_rows(kind, dtype, quant_dtype, M, N, layout, device, poison_allocations):
    """``_quant_rows``, the persistent one-row loop the table gives smooth_quant at 32768 columns on a GPU, forced
    here by a config: bit for bit the generic row kernel's q and row_scale (one program per row), and within the
    quantisation rule of the fp64 reference; zero, tiny and NaN rows included, more rows than programs."""
    from tilekernels.norm import _kernels as kern

    x = rows(M, N, dtype, device, layout, scale=3.0)
    if M > 3:
        x[1] = 0.0
        x[2] = x[2] * 2.0**-104     # max|z| below 2^-100: the prescaled path (no fp32 subnormals)
        x[3, N // 2] = float("nan")
    smooth_scale = smooth(N, torch.float32, device) if kind == "smooth" else None
    op = tk.smooth_quant if kind == "smooth" else tk.dynamic_quant
    block_n = max(16, 1 << (N - 1).bit_length())
    lean = kern.RowConfig(1, block_n, 4, programs_per_sm=1, prefetch=False, persistent=True)
    q, row_scale, kernels = _forced_config_run(op, x, smooth_scale, quant_dtype, lean)
    assert kernels == {kern._quant_rows}
    q_ref, scale_ref, kernels = _forced_config_run(op, x, smooth_scale, quant_dtype, kern.RowConfig(1, block_n, 4))
    assert kernels == {kern._row_forward}
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(row_scale.isnan(), scale_ref.isnan())
    assert torch.equal(row_scale.nan_to_num(0.0), scale_ref.nan_to_num(0.0))
    z = x.to(device="cpu", dtype=torch.float64)
    if smooth_scale is not None:
        z = z * smooth_scale.to(device="cpu", dtype=torch.float64)
    assert_quant_close(f"lean-{kind}-{layout}", q, row_scale, z,
                       x.float() * (1.0 if smooth_scale is None else smooth_scale), quant_dtype)


ROUNDING_ROWS = {
    # amax is QMAX in each row, so q = z exactly in fp32 and only the final rounding decides
    torch.int8: [[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5, 3.5, -127.0, 0.49, 63.5]],
    # ties at 17 (-> 16) and 19 (-> 20); carries into the next binade (31.9 -> 32, 7.99 -> 8, 1.99 -> 2);
    # subnormals (0.0155 -> 2^-6, 0.001 -> 2^-9 grid)
    torch.float8_e4m3fn: [[448.0, 17.0, 19.0, -17.0, 31.9, 7.99, 1.99, -0.0155, 0.001, 240.0, 232.0, 3.7]],
}


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
def test_rounding_is_to_nearest_even(quant_dtype, device):
    x = torch.tensor(ROUNDING_ROWS[quant_dtype], dtype=torch.float32, device=device)
    q, row_scale = tk.dynamic_quant(x, quant_dtype)
    q_ref, _ = reference_quant(x, quant_dtype)
    assert row_scale.item() == 1.0, f"row_scale {row_scale.item()} != 1"
    got, expected = q.cpu().float()[0].tolist(), q_ref.float()[0].tolist()
    wrong = [(x[0, i].item(), g, e) for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not wrong, f"(z, q, expected q) where they differ: {wrong}"


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
def test_zero_rows(quant_dtype, device, poison_allocations):
    """A row of zeros (of x, or of x * smooth_scale) has row_scale 0 and q 0, not NaN."""
    x = random_tensor((3, 1000), torch.bfloat16, device)
    x[1] = 0
    q, row_scale = tk.dynamic_quant(x, quant_dtype)
    assert row_scale[1].item() == 0.0 and not bool(q[1].float().any()), "zero row: row_scale or q not 0"
    assert_quant_close("zero-row", q, row_scale, x.double(), x.float(), quant_dtype)
    x = random_tensor((2, 50), torch.float32, device)
    x[:, 7] = 0
    smooth_scale = torch.zeros(50, device=device)
    q, row_scale = tk.smooth_quant(x, smooth_scale, quant_dtype)
    assert not bool(row_scale.any()) and not bool(q.float().any()), "zero smooth scale: row_scale or q not 0"


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
def test_tiny_rows(quant_dtype, device):
    """Rows whose amax is a normal fp32 number below ``QMAX / FLT_MAX`` (~3.7e-37), where
    ``QMAX / amax`` overflows fp32: still quantised to the exact values, zeros to 0."""
    x = torch.tensor([[1e-37, -5e-38, 0.0, 3e-38], [2e-38, 0.0, -1.5e-38, 1e-38]], dtype=torch.float32,
                     device=device)
    q, row_scale = tk.dynamic_quant(x, quant_dtype)
    assert_quant_close("tiny", q, row_scale, x.double(), x.float(), quant_dtype)


@pytest.mark.parametrize("N", [64, 1500])
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
def test_nan_rows(quant_dtype, N, device):
    """A row holding NaN has row_scale NaN and q 0 (the reference's rule), also when it shares a tile
    (N 64: every row in one) or the chunked passes (N 1500 under the interpreter) with a tiny row and
    normal rows, which stay exact."""
    x = random_tensor((4, N), torch.float32, device)
    x[1, 5] = math.nan
    x[2] *= 1e-38
    q, row_scale = tk.dynamic_quant(x, quant_dtype)
    assert math.isnan(row_scale[1].item()), f"NaN row: row_scale {row_scale[1].item()}"
    assert not bool(q[1].float().any()), "NaN row: q not all 0"
    keep = [0, 2, 3]
    assert_quant_close("nan-rows", q[keep], row_scale[keep], x[keep].double(), x[keep].float(), quant_dtype)


def test_empty_rows(device):
    for shape in ((0, 16), (2, 0, 16)):
        x = torch.empty(shape, dtype=torch.bfloat16, device=device)
        q, row_scale = tk.dynamic_quant(x)
        assert q.shape == x.shape and q.dtype == torch.int8 and row_scale.shape == x.shape[:-1]
        q, row_scale = tk.smooth_quant(x, torch.ones(16, device=device), torch.float8_e4m3fn)
        assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn and row_scale.shape == x.shape[:-1]


# ====================================================================================================
# CPU lane: moe_smooth_quant


def routing(T, k, E, id_dtype, device, transposed=False):
    """``[T, k]`` distinct expert ids per token (as top-k routing gives); ``transposed`` returns the
    transposed view of a ``[k, T]`` tensor."""
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(id_dtype)
    if transposed:
        return ids.t().contiguous().to(device).t()
    return ids.to(device)


def torch_moe_rows(x, smooth_scale, topk_ids):
    """PyTorch's fp32 rows ``x[t] * smooth_scale[topk_ids[t, j]]`` at ``j * T + t`` (valid ids only)."""
    ids = topk_ids.t().reshape(-1).long().clamp(0, smooth_scale.shape[0] - 1)
    return x.float().repeat(topk_ids.shape[1], 1) * smooth_scale.float()[ids]


MOE_CASES = [
    # (T, H, E, k, x layout, ids transposed)
    (5, 33, 4, 2, "2d", False),
    (3, 1000, 8, 3, "padded", False),
    (1, 4099, 2, 1, "2d", True),
    (7, 100, 16, 4, "step", True),
    # rows that fill the kernel's block exactly (no column masks in the compiled kernel)
    (6, 64, 4, 2, "2d", False),
    (5, 128, 8, 3, "padded", True),
]


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["ids-int32", "ids-int64"])
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
@pytest.mark.parametrize("T, H, E, k, layout, transposed", [
    pytest.param(*c, id=f"T{c[0]}H{c[1]}E{c[2]}k{c[3]}-{c[4]}" + ("-ids-t" if c[5] else "")) for c in MOE_CASES])
def test_moe_smooth_quant(T, H, E, k, layout, transposed, quant_dtype, id_dtype, device, poison_allocations):
    x = rows(T, H, torch.bfloat16, device, layout)
    smooth_scale = torch.rand(E, H, device=device) + 0.5
    topk_ids = routing(T, k, E, id_dtype, device, transposed)
    q, row_scale = tk.moe_smooth_quant(x, smooth_scale, topk_ids, quant_dtype)
    z = reference_moe_rows(x, smooth_scale, topk_ids)
    assert z.shape == (k * T, H)
    assert_quant_close("moe", q, row_scale, z, torch_moe_rows(x, smooth_scale, topk_ids), quant_dtype)


@pytest.mark.parametrize("H", [40, 64])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["ids-int32", "ids-int64"])
def test_moe_out_of_range_ids(id_dtype, H, device, poison_allocations):
    """Ids E, -1 (and, as int64, 2^32 + 1, which int32 arithmetic would read as 1) give their rows a NaN
    row_scale and q 0; every other row is quantised as usual. H 64 fills the kernel's block exactly."""
    T, E, k = 4, 3, 2
    x = random_tensor((T, H), torch.float16, device)
    smooth_scale = torch.rand(E, H, device=device) + 0.5
    ids = [[0, 1], [E, 2], [1, -1], [2, 0]]
    if id_dtype == torch.int64:
        ids[3][1] = 2 ** 32 + 1
    topk_ids = torch.tensor(ids, dtype=id_dtype, device=device)
    q, row_scale = tk.moe_smooth_quant(x, smooth_scale, topk_ids, torch.int8)
    bad_rows = [1, T + 2] + ([T + 3] if id_dtype == torch.int64 else [])
    for r in range(k * T):
        if r in bad_rows:
            assert math.isnan(row_scale[r].item()), f"row {r}: row_scale {row_scale[r].item()} for an invalid id"
            assert not bool(q[r].any()), f"row {r}: q not 0 for an invalid id"
    z = reference_moe_rows(x, smooth_scale, topk_ids)
    torch_z = torch_moe_rows(x, smooth_scale, topk_ids)
    torch_z[bad_rows] = math.nan
    assert_quant_close("moe-invalid", q, row_scale, z, torch_z, torch.int8)


# ====================================================================================================
# CPU lane: add_rms_norm_quant


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
@pytest.mark.parametrize("dtype, shape", [pytest.param(torch.bfloat16, (3, 1000), id="bf16-3x1000"),
                                          pytest.param(torch.float16, (2, 4099), id="fp16-2x4099"),
                                          pytest.param(torch.float32, (2, 3, 7), id="fp32-2x3x7")])
def test_add_rms_norm_quant(dtype, shape, quant_dtype, device, poison_allocations):
    """Bit-equal to the rms_norm call it names, and within the rule of the reference."""
    a, b = random_tensor(shape, dtype, device), random_tensor(shape, dtype, device)
    weight = random_tensor(shape[-1:], dtype, device)
    q, row_scale, s = tk.add_rms_norm_quant(a, b, weight, 1e-5, quant_dtype)
    q2, row_scale2, s2 = tk.rms_norm(a, weight, 1e-5, residual=b, quant="dynamic", quant_dtype=quant_dtype)
    for label, first, second in (("q", q, q2), ("row_scale", row_scale, row_scale2), ("a + b", s, s2)):
        assert torch.equal(first.float(), second.float()), f"add_rms_norm_quant and rms_norm differ in {label}"
    y, ref_s = reference_rms_norm(a, weight, 1e-5, residual=b)
    assert torch.equal(s.cpu().double(), ref_s), "a + b is not the rounded sum"
    torch_y, _ = reference_rms_norm(a, weight, 1e-5, residual=b, compute_dtype=torch.float32)
    assert_quant_close("add_rms_norm_quant", q, row_scale, y, torch_y, quant_dtype, ratio=3.0)


def test_add_rms_norm_quant_default_eps(device):
    """eps defaults to 1e-6: small rows, where eps is a large part of mean(s^2)."""
    a, b = (random_tensor((3, 64), torch.float32, device, scale=1e-3) for _ in range(2))
    weight = random_tensor((64,), torch.float32, device)
    q, row_scale, _ = tk.add_rms_norm_quant(a, b, weight)
    y, _ = reference_rms_norm(a, weight, 1e-6, residual=b)
    torch_y, _ = reference_rms_norm(a, weight, 1e-6, residual=b, compute_dtype=torch.float32)
    assert_quant_close("default-eps", q, row_scale, y, torch_y, torch.int8, ratio=3.0)


# ====================================================================================================
# CPU lane: torch.compile


def test_torch_compile_fullgraph(device):
    """The four ops under torch.compile(fullgraph=True): bit-equal to eager."""
    torch._dynamo.reset()
    T, H, E, k = 5, 100, 4, 2
    x = random_tensor((T, H), torch.bfloat16, device)
    weight = random_tensor((H,), torch.bfloat16, device)
    smooth_scale = torch.rand(E, H, device=device) + 0.5
    topk_ids = routing(T, k, E, torch.int32, device)

    def step(x, weight, smooth_scale, topk_ids):
        return (*tk.dynamic_quant(x, torch.float8_e4m3fn), *tk.smooth_quant(x, smooth_scale[0]),
                *tk.moe_smooth_quant(x, smooth_scale, topk_ids, torch.int8),
                *tk.add_rms_norm_quant(x, x * 2, weight))

    eager = step(x, weight, smooth_scale, topk_ids)
    got = torch.compile(step, fullgraph=True)(x, weight, smooth_scale, topk_ids)
    labels = ("dynamic q", "dynamic scale", "smooth q", "smooth scale", "moe q", "moe scale", "add-rms q",
              "add-rms scale", "add-rms a + b")
    for label, first, second in zip(labels, eager, got, strict=True):
        assert torch.equal(first.float(), second.float()), f"compiled and eager {label} differ"


# ====================================================================================================
# CPU lane: bad inputs, a ValueError or TypeError that names the argument


def _bad_cases():
    """Builders taking a tensor factory ``t(*shape, dtype=bf16)``; each returns (fn, args)."""
    M, N, E = 3, 16, 4
    f32 = torch.float32

    def ids(t, shape=(M, 2), dtype=torch.int32):
        return torch.zeros(shape, dtype=dtype, device=t(1).device)

    cases = {
        "dynamic-x-int": (lambda t: (tk.dynamic_quant, (ids(t),)), r"\bx\b"),
        "dynamic-x-fp64": (lambda t: (tk.dynamic_quant, (t(M, N, dtype=torch.float64),)), r"\bx\b"),
        "dynamic-x-0d": (lambda t: (tk.dynamic_quant, (t(),)), r"\bx\b"),
        "dynamic-x-N0": (lambda t: (tk.dynamic_quant, (t(M, 0),)), r"\bx\b"),
        "dynamic-quant_dtype-e5m2": (lambda t: (tk.dynamic_quant, (t(M, N), torch.float8_e5m2)), r"quant_dtype"),
        "dynamic-quant_dtype-fnuz": (lambda t: (tk.dynamic_quant, (t(M, N), torch.float8_e4m3fnuz)),
                                     r"quant_dtype"),
        "dynamic-quant_dtype-uint8": (lambda t: (tk.dynamic_quant, (t(M, N), torch.uint8)), r"quant_dtype"),
        "smooth-scale-shape": (lambda t: (tk.smooth_quant, (t(M, N), t(N + 1, dtype=f32))), r"smooth_scale"),
        "smooth-scale-2d": (lambda t: (tk.smooth_quant, (t(M, N), t(1, N, dtype=f32))), r"smooth_scale"),
        "smooth-scale-none": (lambda t: (tk.smooth_quant, (t(M, N), None)), r"smooth_scale"),
        "smooth-scale-int": (lambda t: (tk.smooth_quant, (t(M, N), ids(t, (N,)))), r"smooth_scale"),
        "smooth-scale-device": (lambda t: (tk.smooth_quant, (t(M, N), t(N, dtype=f32).to("meta"))),
                                r"smooth_scale|device"),
        "smooth-quant_dtype-e5m2": (lambda t: (tk.smooth_quant, (t(M, N), t(N, dtype=f32), torch.float8_e5m2)),
                                    r"quant_dtype"),
        "moe-x-3d": (lambda t: (tk.moe_smooth_quant, (t(1, M, N), t(E, N, dtype=f32), ids(t))), r"\bx\b"),
        "moe-scale-1d": (lambda t: (tk.moe_smooth_quant, (t(M, N), t(N, dtype=f32), ids(t))), r"smooth_scale"),
        "moe-scale-H": (lambda t: (tk.moe_smooth_quant, (t(M, N), t(E, N + 1, dtype=f32), ids(t))),
                        r"smooth_scale"),
        "moe-ids-float": (lambda t: (tk.moe_smooth_quant, (t(M, N), t(E, N, dtype=f32), t(M, 2, dtype=f32))),
                          r"topk_ids"),
        "moe-ids-int16": (lambda t: (tk.moe_smooth_quant, (t(M, N), t(E, N, dtype=f32),
                                                           ids(t, dtype=torch.int16))), r"topk_ids"),
        "moe-ids-T": (lambda t: (tk.moe_smooth_quant, (t(M, N), t(E, N, dtype=f32), ids(t, (M + 1, 2)))),
                      r"topk_ids"),
        "moe-ids-1d": (lambda t: (tk.moe_smooth_quant, (t(M, N), t(E, N, dtype=f32), ids(t, (M,)))), r"topk_ids"),
        "moe-ids-device": (lambda t: (tk.moe_smooth_quant, (t(M, N), t(E, N, dtype=f32), ids(t).to("meta"))),
                           r"topk_ids|device"),
        "moe-quant_dtype-e5m2": (lambda t: (tk.moe_smooth_quant, (t(M, N), t(E, N, dtype=f32), ids(t),
                                                                  torch.float8_e5m2)), r"quant_dtype"),
        "add-b-shape": (lambda t: (tk.add_rms_norm_quant, (t(M, N), t(M, N + 1), t(N))), r"\bb\b"),
        "add-b-dtype": (lambda t: (tk.add_rms_norm_quant, (t(M, N), t(M, N, dtype=f32), t(N))), r"\bb\b"),
        "add-a-int": (lambda t: (tk.add_rms_norm_quant, (ids(t, (M, N)), ids(t, (M, N)), t(N))), r"\ba\b|\bx\b"),
        "add-weight-shape": (lambda t: (tk.add_rms_norm_quant, (t(M, N), t(M, N), t(N - 1))), r"weight"),
        "add-eps-negative": (lambda t: (tk.add_rms_norm_quant, (t(M, N), t(M, N), t(N), -1e-6)), r"eps"),
        "add-quant_dtype-e5m2": (lambda t: (tk.add_rms_norm_quant, (t(M, N), t(M, N), t(N), 1e-6,
                                                                    torch.float8_e5m2)), r"quant_dtype"),
    }
    return [pytest.param(build, match, id=name) for name, (build, match) in cases.items()]


@pytest.mark.parametrize("build, match", _bad_cases())
def test_bad_input(build, match, device):
    def t(*shape, dtype=torch.bfloat16):
        return random_tensor(shape, dtype, device)

    fn, args = build(t)
    with pytest.raises((ValueError, TypeError), match=match):
        fn(*args)


def test_quant_rule_catches_errors():
    """``assert_quant_close`` fails on what it must: q rounded the other way everywhere (each element
    still within one step), q far off, a row_scale 1e-4 off."""
    x = random_tensor((4, 300), torch.float32)
    q, row_scale = reference_quant(x, torch.int8)
    scale = row_scale.float()
    assert_quant_close("exact", q, scale, x.double(), x, torch.int8)
    exact = x.double() * (127 / x.double().abs().amax(dim=-1, keepdim=True))
    other_way = torch.where(exact > q.double(), q.to(torch.int16) + 1, q.to(torch.int16) - 1).clamp(-127, 127)
    with pytest.raises(AssertionError, match="differ from the exact"):
        assert_quant_close("other-way", other_way.to(torch.int8), scale, x.double(), x, torch.int8)
    with pytest.raises(AssertionError, match="steps"):
        assert_quant_close("far", q // 2, scale, x.double(), x, torch.int8)
    with pytest.raises(AssertionError, match="row_scale"):
        assert_quant_close("scale", q, scale * (1 + 1e-4), x.double(), x, torch.int8)


# ====================================================================================================
# GPU lane (-m gpu): real sizes, CUDA graphs, no host synchronisation


@gpu
@pytest.mark.parametrize("dtype, quant_dtype, M, N, layout",
                         grid([(4096, 8192, "2d"), (4096, 4096, "padded"), (999, 32768, "2d"), (512, 131072, "2d"),
                               (1000, 5120, "2d"), (700, 14336, "padded")],   # rows below their tile (MASKED_FORWARD)
                              dtypes=[torch.bfloat16, torch.float32]))
def test_gpu_dynamic_and_smooth_quant(dtype, quant_dtype, M, N, layout, device, poison_allocations):
    x = rows(M, N, dtype, device, layout)
    q, row_scale = tk.dynamic_quant(x, quant_dtype)
    assert_quant_close(f"dynamic-{layout}", q, row_scale, x.double(), x.float(), quant_dtype)
    smooth_scale = smooth(N, torch.float32, device)
    q, row_scale = tk.smooth_quant(x, smooth_scale, quant_dtype)
    assert_quant_close(f"smooth-{layout}", q, row_scale, x.double() * smooth_scale.double(),
                       x.float() * smooth_scale, quant_dtype)


@gpu
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_lean_quant_rows(dtype, quant_dtype, device, poison_allocations):
    """smooth_quant at 32768 columns takes ``_quant_rows`` from the table: bit for bit the generic row kernel's
    output (one program per row, forced), zero, tiny and NaN rows included."""
    from tilekernels.norm import _kernels as kern

    x = rows(300, 32768, dtype, device, "padded", scale=3.0)
    x[1] = 0.0
    x[2] = x[2] * 2.0**-104
    x[3, 777] = float("nan")
    smooth_scale = smooth(32768, torch.float32, device)
    q, row_scale, kernels = _forced_config_run(tk.smooth_quant, x, smooth_scale, quant_dtype,
                                               kern.forward_config(32768, x.device, "smooth"))
    assert kernels == {kern._quant_rows}
    q_ref, scale_ref, kernels = _forced_config_run(tk.smooth_quant, x, smooth_scale, quant_dtype,
                                                   kern.RowConfig(1, 32768, 16))
    assert kernels == {kern._row_forward}
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(row_scale.nan_to_num(-1.0), scale_ref.nan_to_num(-1.0))
    assert_quant_close("lean-smooth-32768", q, row_scale, x.double() * smooth_scale.double(),
                       x.float() * smooth_scale, quant_dtype)


@gpu
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["ids-int32", "ids-int64"])
@pytest.mark.parametrize("H", [4096, 32768])   # one program per row; a persistent loop that prefetches
def test_gpu_moe_smooth_quant(H, id_dtype, quant_dtype, device, poison_allocations):
    T, E, k = 2048, 64, 4
    x = rows(T, H, torch.bfloat16, device)
    smooth_scale = torch.rand(E, H, device=device) + 0.5
    topk_ids = routing(T, k, E, id_dtype, device)
    q, row_scale = tk.moe_smooth_quant(x, smooth_scale, topk_ids, quant_dtype)
    assert_quant_close("moe", q, row_scale, reference_moe_rows(x, smooth_scale, topk_ids),
                       torch_moe_rows(x, smooth_scale, topk_ids), quant_dtype)


# moe_smooth_quant's Gluon forward (norm/_gluon._moe_rows_smem): x streamed through a cp.async ring in shared memory
SMEM_QUANT_CASES = [
    # (T, H, k, x dtype, SmemQuantConfig arguments (warps, stages, programs per SM[, maxnreg[, warp_reduce]]))
    (1000, 4096, 2, torch.bfloat16, (4, 2, 4, 128)),     # the table's configs (SMEM_QUANT_CONFIGS)
    (1000, 4096, 2, torch.float16, (4, 2, 4, 128)),      # int64 ids under the register cap
    (500, 8192, 2, torch.float16, (8, 2, 2, 128, True)),
    (500, 8192, 2, torch.bfloat16, (8, 2, 2, 128, True)),
    (333, 7168, 1, torch.bfloat16, (8, 2, 2)),      # H not a power of two: masked columns
    (333, 7168, 1, torch.bfloat16, (8, 2, 2, None, True)),    # one barrier a row, k 1: one scratch buffer
    (200, 4096, 3, torch.float16, (4, 3, 2)),
    (64, 4096, 2, torch.float32, (4, 4, 2)),
    (64, 4096, 2, torch.float32, (4, 2, 2, None, True)),
    (100, 4112, 4, torch.bfloat16, (4, 3, 3)),
    (300, 16384, 2, torch.float16, (16, 4, 1)),
    (400, 16384, 2, torch.bfloat16, (16, 2, 1)),     # the table's 16384 config
    (400, 16384, 2, torch.bfloat16, (16, 3, 1, None, True)),
    (129, 32768, 3, torch.bfloat16, (16, 2, 1)),
    (100, 4096, 4, torch.bfloat16, (4, 2, 2, None, True)),   # warp_reduce does not apply to the many-k form
    # k > 2, the many-k form (ids re-read per row, the rows in a loop), at the table's configs
    (300, 1024, 8, torch.bfloat16, (1, 2, 16)),
    (257, 2048, 6, torch.float16, (1, 2, 8)),
    (1000, 4096, 8, torch.bfloat16, (2, 2, 4)),
    (333, 7168, 5, torch.bfloat16, (4, 2, 2)),
    (200, 8192, 8, torch.float32, (4, 2, 2)),
    (129, 16384, 8, torch.bfloat16, (8, 2, 1)),
]


def _smem_quant_run(x, smooth_scale, topk_ids, quant_dtype, config):
    """(q, row_scale, whether the Gluon kernel ran) of moe_smooth_quant with ``config`` (None: the Triton
    forward)."""
    from tilekernels.norm import _gluon
    from tilekernels.norm import _kernels as kern
    from tilekernels.norm import norm as norm_module

    saved = kern.config_override.copy()
    kern.config_override.clear()
    if config is None:
        kern.config_override["smem_quant"] = None
        kern.config_override["forward"] = kern.forward_config(x.shape[1], x.device, "moe")
    else:
        kern.config_override["smem_quant"] = config
    norm_module._FORWARD_PLANS.clear()
    try:
        out = tk.moe_smooth_quant(x, smooth_scale, topk_ids, quant_dtype)
        ran = any(plan.kernel is getattr(_gluon, "_moe_rows_smem", None)
                  for plan in norm_module._FORWARD_PLANS.values())
    finally:
        kern.config_override.clear()
        kern.config_override.update(saved)
        norm_module._FORWARD_PLANS.clear()
    return (*out, ran)


def test_smem_quant_table():
    """Which calls the Gluon forward's table gives it (on a GPU): MoE rows of 4096, 8192 and 16384 columns with
    k <= 2, and of 1024 to 16384 columns with k > 2 (its many-k configs); no other kind or width; never on the CPU
    lane."""
    from tilekernels.norm import _gluon
    from tilekernels.norm import _kernels as kern

    table = kern.SMEM_QUANT_CONFIGS
    assert kern.smem_quant_config(4096, "moe", 2) is table[("moe", 4096, False)]
    assert kern.smem_quant_config(7168, "moe", 1) is table[("moe", 8192, False)]
    assert kern.smem_quant_config(16384, "moe", 2) is table[("moe", 16384, False)]
    assert kern.smem_quant_config(4096, "moe", 8) is table[("moe", 4096, True)]
    assert kern.smem_quant_config(7168, "moe", 8) is table[("moe", 8192, True)]
    assert kern.smem_quant_config(16384, "moe", 3) is table[("moe", 16384, True)]
    assert kern.smem_quant_config(1000, "moe", 4) is table[("moe", 1024, True)]
    assert kern.smem_quant_config(1024, "moe", 2) is None and kern.smem_quant_config(512, "moe", 8) is None
    assert kern.smem_quant_config(32768, "moe", 2) is None and kern.smem_quant_config(32768, "moe", 8) is None
    assert kern.smem_quant_config(4096, "smooth") is None and kern.smem_quant_config(4096, None) is None
    # one CTA barrier a row: the 8192 config only, and never a many-k one (the kernel would ignore it)
    assert [key for key, config in table.items() if config.warp_reduce] == [("moe", 8192, False)]
    # a register cap lets the programs per SM it names fit in the SM's 64 K registers (int64 ids had taken the k <= 2
    # configs at 4096 and 8192 past them)
    for key in (("moe", 4096, False), ("moe", 8192, False)):
        config = table[key]
        assert config.maxnreg is not None, key
        assert config.maxnreg * 32 * config.num_warps * config.programs_per_sm <= 65536, key
    x = torch.zeros(4, 4096, dtype=torch.bfloat16)
    assert not _gluon.smem_quant_applies(x, 2, table[("moe", 4096, False)], 4096)


def test_masked_forward_table(monkeypatch):
    """Rows shorter than their power-of-two tile take ``MASKED_FORWARD``'s configs on a GPU: 32 columns a thread for
    the norms and dynamic_quant at tiles of 4096 and 8192, a persistent prefetching loop for smooth_quant at the
    16384 tile; full tiles and the other kinds keep ``TUNED_FORWARD`` and the defaults."""
    from tilekernels.norm import _kernels as kern

    monkeypatch.setattr(kern, "_lane", lambda device: "gpu")
    device = torch.device("cpu")
    assert kern.forward_config(5120, device) == kern.RowConfig(1, 8192, 8)
    assert kern.forward_config(2560, device, "dynamic") == kern.RowConfig(1, 4096, 4)
    assert kern.forward_config(8192, device) == kern.RowConfig(1, 8192, 16)   # a full tile: the default
    assert kern.forward_config(14336, device, "smooth") == kern.RowConfig(1, 16384, 16, programs_per_sm=2,
                                                                          prefetch=True, persistent=True)
    assert kern.forward_config(16384, device, "smooth") == kern.RowConfig(1, 16384, 16)
    # no masked entry: the tuned one (smooth_quant at the 8192 tile: a persistent loop, 4 programs per SM)
    assert kern.forward_config(5120, device, "smooth") == kern.forward_config(8192, device, "smooth")
    assert kern.forward_config(12288, device, "dynamic") == kern.RowConfig(1, 16384, 16)
    # a norm's quantised rows alone (kind "layer+dynamic" ...) take their own tuned configs
    assert kern.forward_config(8192, device, "layer+dynamic") == kern.RowConfig(1, 8192, 4, programs_per_sm=2,
                                                                                 prefetch=True, persistent=True)
    assert kern.forward_config(4096, device, "rms+dynamic") == kern.RowConfig(1, 4096, 4)
    monkeypatch.setattr(kern, "_lane", lambda device: "interpreter")
    assert kern.forward_config(5120, device) == kern.RowConfig(1, 1024, 4, programs_per_sm=2)


@gpu
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
@pytest.mark.parametrize("T, H, k, dtype, config", [
    pytest.param(*c, id=f"T{c[0]}H{c[1]}k{c[2]}-{DTYPE_NAMES[c[3]]}-w{c[4][0]}s{c[4][1]}p{c[4][2]}"
                          + (f"r{c[4][3]}" if len(c[4]) > 3 and c[4][3] else "")
                          + ("-wr" if len(c[4]) > 4 and c[4][4] else ""))
    for c in SMEM_QUANT_CASES])
def test_gpu_smem_quant(T, H, k, dtype, config, quant_dtype, device, poison_allocations):
    """The Gluon forward against the fp64 reference and bit for bit against the Triton forward, with rows of
    zeros, of NaN and tiny ones, and out-of-range expert ids among the others."""
    from tilekernels.norm._kernels import SmemQuantConfig

    x = rows(T, H, dtype, device)
    x[3] = 0.0
    x[T // 2, 5] = math.nan
    x[T - 1] *= 1e-35   # tiny: scaled by 2^100 before the division
    E = 16
    smooth_scale = torch.rand(E, H, device=device) + 0.5
    # the ids travel through the ring by cp.async too: 8-byte ids with fp16 x, a column stride with fp32 x
    topk_ids = routing(T, k, E, torch.int64 if dtype == torch.float16 else torch.int32, device,
                       transposed=dtype == torch.float32)
    topk_ids[1, k - 1] = E
    topk_ids[T - 2, 0] = -1
    bad_rows = [(k - 1) * T + 1, T - 2]
    q, row_scale, ran = _smem_quant_run(x, smooth_scale, topk_ids, quant_dtype, SmemQuantConfig(*config))
    assert ran, "the Gluon forward did not run"
    q_ref, scale_ref, ran_ref = _smem_quant_run(x, smooth_scale, topk_ids, quant_dtype, None)
    assert not ran_ref
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), "q differs from the Triton forward's"
    assert torch.equal(row_scale.isnan(), scale_ref.isnan())
    assert torch.equal(row_scale.nan_to_num(0.0), scale_ref.nan_to_num(0.0)), "row_scale differs from the Triton one"
    torch_z = torch_moe_rows(x, smooth_scale, topk_ids)
    torch_z[bad_rows] = math.nan
    assert_quant_close("gluon-moe", q, row_scale, reference_moe_rows(x, smooth_scale, topk_ids), torch_z, quant_dtype)


@gpu
def test_gpu_smem_quant_falls_back():
    """x the Gluon forward cannot copy by cp.async (rows not 16-byte aligned, N not a multiple of 16, a column
    stride), and more expert ids per token than a ring slot holds (k padded to a power of two past the program's
    threads), take the Triton forward, and are right."""
    from tilekernels.norm._kernels import SmemQuantConfig

    device = torch.device("cuda")
    # name: (x, k, E, config)
    cases = {"unaligned rows": (rows(64, 4104, torch.bfloat16, device, "padded"), 2, 4, SmemQuantConfig(4, 3, 2)),
             "N 4100": (rows(64, 4100, torch.bfloat16, device), 2, 4, SmemQuantConfig(4, 3, 2)),
             "column step": (rows(64, 4096, torch.bfloat16, device, "step"), 2, 4, SmemQuantConfig(4, 3, 2)),
             "k 33 at one warp": (rows(40, 1024, torch.bfloat16, device), 33, 40, SmemQuantConfig(1, 2, 16))}
    for name, (x, k, E, config) in cases.items():
        smooth_scale = torch.rand(E, x.shape[1], device=device) + 0.5
        topk_ids = routing(x.shape[0], k, E, torch.int32, device)
        q, row_scale, ran = _smem_quant_run(x, smooth_scale, topk_ids, torch.int8, config)
        assert not ran, f"{name}: the Gluon forward ran"
        assert_quant_close(f"fallback {name}", q, row_scale, reference_moe_rows(x, smooth_scale, topk_ids),
                           torch_moe_rows(x, smooth_scale, topk_ids), torch.int8)


@gpu
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
def test_gpu_add_rms_norm_quant(quant_dtype, device, poison_allocations):
    a, b = (random_tensor((4096, 8192), torch.bfloat16, device) for _ in range(2))
    weight = random_tensor((8192,), torch.bfloat16, device)
    q, row_scale, s = tk.add_rms_norm_quant(a, b, weight, 1e-6, quant_dtype)
    y, ref_s = reference_rms_norm(a, weight, 1e-6, residual=b)
    assert torch.equal(s.cpu().double(), ref_s), "a + b is not the rounded sum"
    torch_y, _ = reference_rms_norm(a, weight, 1e-6, residual=b, compute_dtype=torch.float32)
    assert_quant_close("add_rms_norm_quant", q, row_scale, y, torch_y, quant_dtype, ratio=3.0)


@gpu
def test_gpu_cuda_graph(device):
    """Capture dynamic, smooth and MoE quantisation in one CUDA graph; replay with new data and new
    routing (out-of-range ids included) written into the captured inputs; each replay within the rule."""
    T, H, E, k = 1024, 4096, 16, 2
    x = rows(T, H, torch.bfloat16, device)
    smooth_scale = torch.rand(E, H, device=device) + 0.5
    topk_ids = routing(T, k, E, torch.int32, device)

    def step():
        return (*tk.dynamic_quant(x, torch.float8_e4m3fn), *tk.smooth_quant(x, smooth_scale[1], torch.int8),
                *tk.moe_smooth_quant(x, smooth_scale, topk_ids, torch.float8_e4m3fn))

    graph, results = capture_graph(step)

    for replay in range(2):
        x.copy_(rows(T, H, torch.bfloat16, device))
        topk_ids.copy_(routing(T, k, E, torch.int32, device))
        topk_ids[replay * 7, 1] = E + replay
        for t in results:
            if t.dtype == torch.float32:
                t.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        q_dyn, scale_dyn, q_smooth, scale_smooth, q_moe, scale_moe = results
        name = f"replay{replay}"
        assert_quant_close(f"{name} dynamic", q_dyn, scale_dyn, x.double(), x.float(), torch.float8_e4m3fn)
        assert_quant_close(f"{name} smooth", q_smooth, scale_smooth, x.double() * smooth_scale[1].double(),
                           x.float() * smooth_scale[1], torch.int8)
        torch_z = torch_moe_rows(x, smooth_scale, topk_ids)
        torch_z[T + replay * 7] = math.nan
        assert_quant_close(f"{name} moe", q_moe, scale_moe, reference_moe_rows(x, smooth_scale, topk_ids), torch_z,
                           torch.float8_e4m3fn)


@gpu
def test_gpu_no_host_sync(device):
    """The four ops never synchronise with the host: torch's sync debug mode turns any .item(),
    .tolist() or device-to-host copy into an error."""
    T, H, E, k = 4096, 7168, 32, 8
    x = rows(T, H, torch.bfloat16, device)
    weight = random_tensor((H,), torch.bfloat16, device)
    smooth_scale = torch.rand(E, H, device=device) + 0.5
    topk_ids = routing(T, k, E, torch.int64, device)

    def step():
        tk.dynamic_quant(x, torch.float8_e4m3fn)
        tk.smooth_quant(x, smooth_scale[0])
        tk.moe_smooth_quant(x, smooth_scale, topk_ids)
        tk.add_rms_norm_quant(x, x, weight)

    assert_no_host_sync(step)
