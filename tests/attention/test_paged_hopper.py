"""The Gluon paged prefill for Hopper (``_paged_kernels._paged_prefill_hopper``) against the fp64 reference.

GPU lane (``-m gpu``; it needs an sm_90 device, and the interpreter does not run Gluon); the CPU lane
checks that forcing it raises where it does not run. Every GPU test forces the kernel
(``_paged_kernels.hopper_mode = True``, which raises where the kernel does not apply, so no case silently
runs the Triton kernel instead): page sizes 8 to 1024 (one TMA box per page, or per key block) and 1, 3
and 48 (rows gathered by cp.async), head dims 128 and 256, fp16 and bf16, 1-D and 2-D tables, causal masks
with more and fewer queries than keys, sliding windows, GQA/MQA, empty sequences, host-side k/v scales.
Every cache comes from ``make_paged_kv`` with page 0 and every unused slot NaN: the key blocks cut by a
sequence's end read them through TMA, and the producer must zero those rows of V (the gathering producer
masks them instead).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tilekernels.attention import _paged_kernels
from tilekernels.attention import paged as paged_api

from test_paged import case, check_against_reference, check_prefill, leave_nan_in_allocator, make_paged_problem, \
    run_prefill

BF16, FP16 = torch.bfloat16, torch.float16
gpu = pytest.mark.gpu
LQ, LK = (1, 700, 0, 129, 1500), (2000, 700, 1, 128, 1400)


@pytest.fixture
def hopper(sm90, monkeypatch):
    monkeypatch.setattr(_paged_kernels, "hopper_mode", True)
    monkeypatch.setattr(paged_api, "_PLANS", {})
    return sm90


HOPPER_CASES = [
    case(LQ, LK, heads=16, heads_kv=4, head_dim=128, page_size=16, dtype=BF16, causal=True, extra_pages=64),
    case(LQ, LK, heads=16, heads_kv=4, head_dim=128, page_size=16, dtype=BF16, causal=False, table="2d"),
    case(LQ, LK, heads=8, heads_kv=1, head_dim=128, page_size=8, dtype=FP16, causal=True),
    case(LQ, LK, heads=8, heads_kv=8, head_dim=128, page_size=64, dtype=BF16, causal=True, table="2d"),
    case(LQ, LK, heads=8, heads_kv=2, head_dim=128, page_size=128, dtype=BF16, causal=False),
    case(LQ, LK, heads=8, heads_kv=2, head_dim=128, page_size=1024, dtype=BF16, causal=True, table="2d"),
    case(LQ, LK, heads=8, heads_kv=2, head_dim=256, page_size=16, dtype=BF16, causal=True),
    case(LQ, LK, heads=8, heads_kv=4, head_dim=256, page_size=256, dtype=FP16, causal=False, table="2d"),
    case(LQ, LK, heads=8, heads_kv=2, head_dim=128, page_size=32, dtype=BF16, causal=True, window_left=200),
    case(LQ, LK, heads=8, heads_kv=2, head_dim=128, page_size=16, dtype=BF16, causal=False, window_left=0),
    case(LQ, LK, heads=8, heads_kv=2, head_dim=128, page_size=16, dtype=BF16, causal=True, softmax_scale=0.05),
    # gathered pages (cp.async): page sizes below 8 or not powers of two
    case(LQ, LK, heads=16, heads_kv=4, head_dim=128, page_size=1, dtype=BF16, causal=True, extra_pages=64),
    case(LQ, LK, heads=8, heads_kv=2, head_dim=128, page_size=1, dtype=FP16, causal=False, table="2d",
         window_left=100),
    case(LQ, LK, heads=8, heads_kv=2, head_dim=256, page_size=3, dtype=BF16, causal=True),
    case(LQ, LK, heads=8, heads_kv=1, head_dim=128, page_size=48, dtype=BF16, causal=True, table="2d"),
    # more queries than keys (rows that see no key: out 0, lse -inf), and empty sequences
    case((300, 5, 0, 77), (100, 0, 9, 300), heads=4, heads_kv=2, head_dim=128, page_size=16, dtype=BF16,
         causal=True),
    case((300, 5, 0, 77), (100, 0, 9, 300), heads=4, heads_kv=2, head_dim=128, page_size=1, dtype=BF16,
         causal=True),
]


@gpu
@pytest.mark.parametrize("c", [c.param() for c in HOPPER_CASES])
def test_hopper_prefill(c, hopper):
    leave_nan_in_allocator(((sum(c.seqlens_q), c.heads, c.head_dim), c.dtype, hopper))
    check_prefill(c, hopper)
    (plan,) = paged_api._PLANS.values()
    assert plan.hopper is not None


@gpu
def test_hopper_prefill_host_scales(hopper):
    """Host-float k_scale / v_scale: k's folds into the score scale, v's multiplies the output."""
    c = case(LQ, LK, heads=8, heads_kv=2, head_dim=128, page_size=16, dtype=BF16, causal=True)
    problem = dataclasses.replace(make_paged_problem(c, hopper), k_scale=0.5, v_scale=3.0)
    out, lse = run_prefill(problem)
    check_against_reference(c.name + "-k0.5-v3", problem, out, lse)


@gpu
def test_hopper_prefill_equals_triton(hopper, monkeypatch):
    """The Gluon and Triton prefills agree to rounding on one problem (both against the reference)."""
    c = case(LQ, LK, heads=16, heads_kv=4, head_dim=128, page_size=16, dtype=BF16, causal=True)
    problem = make_paged_problem(c, hopper)
    out, lse = run_prefill(problem)
    monkeypatch.setattr(_paged_kernels, "hopper_mode", False)
    out_t, lse_t = run_prefill(problem)
    check_against_reference(c.name + "-triton", problem, out_t, lse_t)
    torch.testing.assert_close(out.float(), out_t.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, lse_t, rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.parametrize("what", ["d64", "d96", "softcap", "fp8", "vectorized"])
def test_hopper_mode_raises_where_it_does_not_apply(what, hopper):
    kw = dict(heads=4, heads_kv=2, head_dim=128, page_size=16, dtype=BF16, causal=True)
    kw.update({"d64": dict(head_dim=64), "d96": dict(head_dim=96), "softcap": dict(logits_soft_cap=5.0),
               "fp8": dict(kv_dtype=torch.float8_e4m3fn), "vectorized": dict(layout="vectorized")}[what])
    problem = make_paged_problem(case((5, 9), (20, 7), **kw), hopper)
    with pytest.raises(RuntimeError, match="hopper_mode"):
        run_prefill(problem)


def test_hopper_mode_true_raises_off_hopper(device, monkeypatch):
    """CPU lane (and any GPU but sm_90): forcing the Gluon prefill raises instead of running Triton."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        pytest.skip("sm_90 runs the Gluon prefill")
    monkeypatch.setattr(_paged_kernels, "hopper_mode", True)
    monkeypatch.setattr(paged_api, "_PLANS", {})
    problem = make_paged_problem(case((5, 9), (20, 7), head_dim=128, page_size=16, dtype=BF16), device)
    with pytest.raises(RuntimeError, match="hopper_mode"):
        run_prefill(problem)
