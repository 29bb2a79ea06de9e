"""The fused Gluon backward for Hopper (``_bwd._attn_bwd_hopper``) against the fp64 reference.

GPU lane only (``-m gpu``; sm_90, and the interpreter does not run Gluon). Every test forces the kernel
(``_bwd.hopper_mode = True``, which raises where it does not apply, so no case silently runs the
two-kernel backward): batch and varlen modes, head dims 64, 128 and 256, fp16 and bf16, causal masks with
seqlen_q above and below seqlen_k, sliding windows, GQA/MQA, lengths that are not multiples of the
tiles (1, 0, 33, 1000, ...). The forward is whichever kernel applies.

Key and query blocks cut by a sequence's end read the next sequence's rows (or padding) through TMA;
the producer zeroes them. Two tests put NaN there and require it not to reach real rows' gradients.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tilekernels as tk
from tilekernels.attention import _bwd
from tilekernels.testing import random_tensor

from test_fmha import GPU_VARLEN_LENGTHS, batch_case, check_case, varlen_case

pytestmark = pytest.mark.gpu


@pytest.fixture
def hopper(sm90, monkeypatch):
    monkeypatch.setattr(_bwd, "hopper_mode", True)
    return sm90


BF16, FP16 = torch.bfloat16, torch.float16
CASES = [
    batch_case(2, 1024, 1024, 8, 8, 128, BF16, causal=False),
    batch_case(2, 1024, 1024, 8, 2, 128, BF16, causal=True),
    batch_case(2, 1024, 1024, 8, 2, 64, FP16, causal=False),
    batch_case(2, 1024, 1024, 8, 8, 64, BF16, causal=True),
    batch_case(3, 1000, 1537, 8, 2, 128, BF16, causal=True),
    batch_case(3, 1537, 1000, 8, 1, 128, FP16, causal=True),
    batch_case(2, 300, 517, 4, 2, 64, BF16, causal=False),
    batch_case(2, 1, 1, 4, 4, 128, BF16, causal=True),
    batch_case(2, 33, 200, 4, 1, 64, FP16, causal=True),
    batch_case(2, 1024, 1500, 8, 2, 128, BF16, window_size=(100, 300)),
    batch_case(2, 1024, 1024, 8, 2, 128, BF16, window_size=(256, 0)),
    batch_case(2, 777, 777, 8, 4, 64, FP16, window_size=(-1, 50)),
    varlen_case(*GPU_VARLEN_LENGTHS, 8, 2, 128, BF16, causal=True),
    varlen_case(*GPU_VARLEN_LENGTHS, 8, 8, 64, FP16, causal=False),
    varlen_case(*GPU_VARLEN_LENGTHS, 8, 2, 128, BF16, causal=False, window_size=(128, 64)),
    varlen_case((129, 128, 127, 1, 0, 255), (1, 128, 300, 129, 5, 0), 4, 1, 128, FP16, causal=True),
    # head dim 256: the head-dim-split schedule (64 keys per program, each step's dQ partial in its Q/dO slot)
    batch_case(2, 1024, 1024, 4, 4, 256, BF16, causal=False),
    batch_case(2, 1024, 1024, 4, 2, 256, BF16, causal=True),
    batch_case(3, 1000, 1537, 4, 1, 256, FP16, causal=True),
    batch_case(3, 1537, 1000, 4, 2, 256, BF16, causal=True),
    batch_case(2, 1, 1, 4, 4, 256, BF16, causal=True),
    batch_case(2, 33, 200, 4, 1, 256, FP16, causal=False),
    batch_case(2, 1024, 1500, 4, 2, 256, BF16, window_size=(100, 300)),
    varlen_case(*GPU_VARLEN_LENGTHS, 4, 2, 256, BF16, causal=True),
    varlen_case((129, 128, 127, 1, 0, 255), (1, 128, 300, 129, 5, 0), 4, 1, 256, FP16, causal=False),
]


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_hopper_backward(case, hopper):
    check_case(case, hopper)


# deterministic=True: the Gluon kernel for dK and dV, the Triton dQ kernel for dq (HopperBwdConfig.with_dq);
# head dims 64 and 128 (head dim 256's schedule has no dQ-less form)
DETERMINISTIC_CASES = [dataclasses.replace(c, options={**c.options, "deterministic": True})
                       for i, c in enumerate(CASES) if c.head_dim <= 128 and i in (1, 2, 3, 4, 7, 8, 11, 12, 13, 15)]


@pytest.mark.parametrize("case", [c.param() for c in DETERMINISTIC_CASES])
def test_hopper_backward_deterministic(case, hopper):
    check_case(case, hopper)


# each step's LSE and delta loaded a step ahead (HopperBwdConfig.stats_ahead; the tables' at head dim 64) with
# head dim 128 too, with and without dQ in the kernel: steps past the last one load nothing, heads of a GQA group
# and sequence ends (zero-length sequences included) pick the right rows
AHEAD_CASES = [c for i, c in enumerate(CASES) if i in (1, 3, 11, 12, 15)]


@pytest.mark.parametrize("with_dq", [True, False])
@pytest.mark.parametrize("case", [c.param() for c in AHEAD_CASES])
def test_hopper_backward_stats_ahead(case, with_dq, hopper, monkeypatch):
    monkeypatch.setattr(_bwd, "hopper_config_override", _bwd.HopperBwdConfig(64, 2, stats_ahead=True, with_dq=with_dq))
    if not with_dq:
        case = dataclasses.replace(case, options={**case.options, "deterministic": True})
    check_case(case, hopper)


def test_hopper_backward_stale_accumulator(hopper):
    """The fp32 dQ accumulator comes from torch.empty in batch mode and is zeroed by the delta kernel: memory
    that held NaN right before (the caching allocator hands the block back) must not reach dq."""
    q, k, v, dout = (random_tensor((2, 1000, 8, 64), BF16, hopper) for _ in range(4))
    clean = _grads(q, k, v, dout, causal=True)
    for _ in range(3):
        poison = torch.full(q.shape, float("nan"), dtype=torch.float32, device=hopper)
        del poison
        dq = _grads(q, k, v, dout, causal=True)[0]
        assert not torch.isnan(dq).any(), "a stale accumulator reached dq"
        torch.testing.assert_close(dq, clean[0], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_deterministic_pieces(hopper, monkeypatch, head_dim):
    """deterministic=True: the same bits in two runs; dk and dv those of the default Gluon kernel (the same
    sums in the same order), dq that of the two Triton kernels (the same dQ kernel)."""
    q = random_tensor((2, 2048, 16, head_dim), BF16, hopper)
    k = random_tensor((2, 2048, 4, head_dim), BF16, hopper)
    v = random_tensor((2, 2048, 4, head_dim), BF16, hopper)
    dout = random_tensor(q.shape, BF16, hopper)
    first = _grads(q, k, v, dout, causal=True, deterministic=True)
    second = _grads(q, k, v, dout, causal=True, deterministic=True)
    fused = _grads(q, k, v, dout, causal=True)
    monkeypatch.setattr(_bwd, "hopper_mode", False)
    two = _grads(q, k, v, dout, causal=True, deterministic=True)
    for label, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{label} differs between two deterministic runs"
    assert torch.equal(first[0], two[0]), "dq differs from the two-kernel path's"
    assert torch.equal(first[1], fused[1]) and torch.equal(first[2], fused[2]), "dk / dv differ from the fused kernel's"


def _grads(q, k, v, dout, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = tk.flash_attn_func(*leaves, **kwargs) if q.dim() == 4 else tk.flash_attn_varlen_func(*leaves, **kwargs)
    out.backward(dout)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("head_dim", [128, 256])
def test_hopper_backward_matches_deterministic(hopper, monkeypatch, head_dim):
    """The fused kernel against the two-kernel path on the same inputs: dk and dv sum in another order
    only inside a program, dq through atomics; all within a few bf16 rounding steps."""
    q = random_tensor((2, 2048, 16, head_dim), BF16, hopper)
    k = random_tensor((2, 2048, 4, head_dim), BF16, hopper)
    v = random_tensor((2, 2048, 4, head_dim), BF16, hopper)
    dout = random_tensor(q.shape, BF16, hopper)
    fused = _grads(q, k, v, dout, causal=True)
    monkeypatch.setattr(_bwd, "hopper_mode", False)
    two = _grads(q, k, v, dout, causal=True, deterministic=True)
    for label, a, b in zip(("dq", "dk", "dv"), fused, two):
        scale = float(b.abs().max())
        err = float((a.float() - b.float()).abs().max())
        assert err <= 4 * 2 ** -8 * scale, f"{label}: max |fused - two-kernel| {err} against max |g| {scale}"


@pytest.mark.parametrize("head_dim", [128, 256])
def test_hopper_varlen_padding_nan_stays_out(hopper, head_dim):
    """NaN in the rows past ``cu_seqlens[-1]``: the last key and query blocks of the last sequence read
    them through TMA, and must not pass them on to real rows' gradients."""
    lengths_q, lengths_k = (100, 300, 37), (250, 129, 77)
    cu_q = torch.tensor([0, 100, 400, 437], dtype=torch.int32, device=hopper)
    cu_k = torch.tensor([0, 250, 379, 456], dtype=torch.int32, device=hopper)
    q = random_tensor((500, 8, head_dim), BF16, hopper)
    k = random_tensor((600, 2, head_dim), BF16, hopper)
    v = random_tensor((600, 2, head_dim), BF16, hopper)
    dout = random_tensor(q.shape, BF16, hopper)
    q[437:], k[456:], v[456:], dout[437:] = (float("nan"),) * 4
    dq, dk, dv = _grads(q, k, v, dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q),
                        max_seqlen_k=max(lengths_k), causal=True)
    assert not torch.isnan(dq[:437]).any() and not torch.isnan(dk[:456]).any() and not torch.isnan(dv[:456]).any()
    assert not dq[437:].any() and not dk[456:].any() and not dv[456:].any(), "rows past the last sequence: 0"


@pytest.mark.parametrize("head_dim", [128, 256])
def test_hopper_batch_neighbour_nan_stays_out(hopper, head_dim):
    """Batch mode: a sequence's last blocks run into the next batch element's rows. NaN in element 1's
    inputs must leave element 0's gradients finite and unchanged (up to dq's atomic order)."""
    shape = (2, 200, 4, head_dim)
    q, k, v, dout = (random_tensor(shape, BF16, hopper) for _ in range(4))
    clean = _grads(q, k, v, dout)
    for t in (q, k, v, dout):
        t[1] = float("nan")
    poisoned = _grads(q, k, v, dout)
    for label, a, b in zip(("dq", "dk", "dv"), poisoned, clean):
        assert not torch.isnan(a[0]).any(), f"{label}: NaN reached element 0"
        torch.testing.assert_close(a[0], b[0], atol=1e-2, rtol=1e-2, msg=f"{label} of element 0 changed")


def test_hopper_mode_raises_where_it_does_not_apply(hopper):
    q = random_tensor((1, 64, 2, 64), BF16, hopper).requires_grad_()
    out = tk.flash_attn_func(q, q, q, softcap=5.0)  # softcap: the two-kernel path's
    with pytest.raises(RuntimeError, match="hopper_mode"):
        out.sum().backward()
