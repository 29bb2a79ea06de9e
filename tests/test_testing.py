"""The assertion helpers must be able to fail: a test suite built on a rule that always passes proves
nothing. Plain PyTorch on the CPU; no triton."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tilekernels.testing import assert_close, compare, poisoned, random_matrix, random_tensor, reference_gemm

LOW_DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16"),
              pytest.param(torch.float32, id="fp32")]


def _problem(dtype, M=19, N=23, K=41):
    a = random_matrix(M, K, dtype)
    b = random_matrix(K, N, dtype)
    return a, b, reference_gemm(a, b), reference_gemm(a, b, compute_dtype=None)


# ----------------------------------------------------------------------------------------------------
# inputs and outputs


def test_random_matrix_column_major_is_a_transposed_view():
    x = random_matrix(5, 7, torch.bfloat16, column_major=True)
    assert x.shape == (5, 7) and x.stride() == (1, 5) and x.dtype == torch.bfloat16
    assert x.t().is_contiguous()
    y = random_matrix(5, 7, torch.float16)
    assert y.shape == (5, 7) and y.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8],
                         ids=["fp16", "bf16", "fp32", "int8"])
def test_random_tensor_is_not_zeros(dtype):
    x = random_tensor((64, 33), dtype)
    assert x.dtype == dtype
    assert int((x != 0).sum()) > x.numel() // 2
    assert len(torch.unique(x)) > 4


def test_poisoned_is_nan_or_int_min():
    assert torch.isnan(poisoned((3, 4), torch.bfloat16)).all()
    assert torch.isnan(poisoned((3, 4), torch.float32)).all()
    p = poisoned((3, 4), torch.int32)
    assert (p == torch.iinfo(torch.int32).min).all()


# ----------------------------------------------------------------------------------------------------
# the reference's epilogue order


def test_reference_gemm_epilogue_order():
    """acc*alpha*scale_a*scale_b + bias -> activation -> * mul -> + beta*residual, spelled out."""
    M, N, K = 6, 5, 4
    a = random_matrix(M, K, torch.float32)
    b = random_matrix(K, N, torch.float32)
    bias, m1, m2, res = (random_tensor(s, torch.float32) for s in ((N,), (M, N), (M, N), (M, N)))
    scale_a, scale_b = random_tensor((M,), torch.float32), random_tensor((N,), torch.float32)
    pre = (a.double() @ b.double()) * 0.5 * scale_a.double()[:, None] * scale_b.double() + bias.double()
    expect = F.gelu(pre, approximate="tanh") * m1.double() * m2.double() + 1.5 * res.double()
    got = reference_gemm(a, b, bias=bias, residual=res, mul=(m1, m2), activation="gelu_tanh", alpha=0.5,
                         beta=1.5, scale_a=scale_a, scale_b=scale_b)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-12)
    # A different order (activation after mul) gives a different answer, so the check above has teeth.
    wrong = F.gelu(pre * m1.double() * m2.double(), approximate="tanh") + 1.5 * res.double()
    assert not torch.allclose(got, wrong)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_reference_gemm_low_precision_dtype(dtype):
    a, b, ref, low = _problem(dtype)
    assert low.dtype == dtype and ref.dtype == torch.float64
    assert reference_gemm(a, b, out_dtype=torch.float32, compute_dtype=None).dtype == torch.float32


# ----------------------------------------------------------------------------------------------------
# the rule passes a correct answer ...


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_correctly_rounded_answer_passes(dtype):
    _, _, ref, low = _problem(dtype)
    result = assert_close("rounded", ref.to(dtype), ref, low)
    assert result.passed and result.parity_ok
    assert "PASS" in str(result)


def test_nan_and_inf_in_the_same_places_pass():
    ref = torch.randn(8, 8, dtype=torch.float64)
    ref[1, 2], ref[3, 4], ref[5, 6] = math.nan, math.inf, -math.inf
    out = ref.to(torch.bfloat16)
    assert compare("parity", out, ref, out).passed


def test_exact_torch_leaves_an_atol_floor():
    """Where PyTorch is exact, the rule still tolerates one rounding to the output dtype, no more."""
    ref = torch.randn(16, 16, dtype=torch.float64) * 100
    torch_out = ref.clone()
    assert compare("floor", ref.to(torch.float32), ref, torch_out).passed
    assert not compare("floor", (ref + 1e-2).to(torch.float32), ref, torch_out).passed


# ----------------------------------------------------------------------------------------------------
# ... and fails a wrong one


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_one_wrong_element_fails_and_is_located(dtype):
    _, _, ref, low = _problem(dtype)
    out = ref.to(dtype)
    out[7, 11] += 0.25 * float(ref.abs().max()) + 1.0
    with pytest.raises(AssertionError, match=r"FAIL wrong-element: .* at \(7, 11\)"):
        assert_close("wrong-element", out, ref, low)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_transposed_output_fails(dtype):
    _a, _b, ref, low = _problem(dtype, M=17, N=17, K=33)
    with pytest.raises(AssertionError, match="FAIL"):
        assert_close("transposed", ref.t().contiguous().to(dtype), ref, low)


def test_ratio_is_the_bound():
    ref = torch.randn(32, 32, dtype=torch.float64) * 10
    torch_out = ref + 1e-2 * torch.randn_like(ref).sign()
    torch_err = float((torch_out - ref).abs().max())
    within = ref.clone()
    within[0, 0] += 1.9 * torch_err
    beyond = ref.clone()
    beyond[0, 0] += 2.5 * torch_err
    assert compare("within", within, ref, torch_out, ratio=2.0).passed
    result = compare("beyond", beyond, ref, torch_out, ratio=2.0)
    assert not result.passed and result.ratio == pytest.approx(2.5, rel=1e-6)
    assert compare("beyond", beyond, ref, torch_out, ratio=3.0).passed


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_in_the_wrong_place_fails(bad):
    _, _, ref, low = _problem(torch.bfloat16)
    out = ref.to(torch.bfloat16)
    out[4, 9] = bad
    with pytest.raises(AssertionError, match=r"parity broken: 1 elements differ .* first at \(4, 9\)"):
        assert_close("nonfinite", out, ref, low)


def test_missing_nan_fails():
    """A NaN the reference has (e.g. from a NaN input) must also be in the output."""
    ref = torch.randn(8, 8, dtype=torch.float64)
    ref[2, 3] = math.nan
    out = torch.where(torch.isnan(ref), torch.zeros_like(ref), ref).float()
    assert not compare("missing-nan", out, ref, ref.float()).passed


def test_inf_sign_matters():
    ref = torch.randn(8, 8, dtype=torch.float64)
    ref[0, 1] = math.inf
    out = ref.clone()
    out[0, 1] = -math.inf
    assert not compare("inf-sign", out, ref, ref).passed


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_unwritten_poisoned_element_fails(dtype):
    M, N = 19, 23
    _, _, ref, low = _problem(dtype, M=M, N=N)
    out = poisoned((M, N), dtype)
    out.copy_(ref.to(dtype))
    out[M - 1, N - 1] = math.nan  # as if the kernel skipped the last edge element
    with pytest.raises(AssertionError, match=r"NaN.*first at \(18, 22\)"):
        assert_close("unwritten", out, ref, low)
    # A whole unwritten edge column is caught as well.
    out = poisoned((M, N), dtype)
    out[:, : N - 1] = ref[:, : N - 1].to(dtype)
    assert not compare("unwritten-column", out, ref, low).passed


def test_shape_mismatch_fails():
    ref = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(AssertionError, match="shape"):
        compare("shape", torch.randn(6, 4), ref, ref)
    with pytest.raises(AssertionError, match="shape"):
        compare("shape", torch.randn(4, 6, 1), ref, ref)
