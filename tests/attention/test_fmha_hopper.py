"""The Gluon forward for Hopper (``_fwd._attn_fwd_hopper``) against the fp64 reference and the Triton kernel.

GPU lane only (``-m gpu``; it needs an sm_90 device, and the interpreter does not run Gluon). Every test
forces the kernel (``_fwd.hopper_mode = True``, which raises where the kernel does not apply, so no case
silently runs the Triton kernel instead): batch and varlen modes, head dims 128 and 256, fp16 and bf16,
causal masks with seqlen_q above and below seqlen_k, sliding windows, GQA/MQA, lengths that are not
multiples of the 128-row tile (1, 0, 33, 1000, ...). Gradients come from the Triton backward fed with
this forward's out and LSE, so the LSE is checked twice.

The key blocks cut by a sequence's end read the next sequence's rows (or padding) through TMA; the
producer zeroes those rows of V. Two tests put NaN there and require it not to reach real rows.
"""

from __future__ import annotations

import pytest
import torch

import tilekernels as tk
from tilekernels.attention import _fwd
from tilekernels.testing import random_tensor

from test_fmha import GPU_VARLEN_LENGTHS, batch_case, check_case, varlen_case

pytestmark = pytest.mark.gpu


@pytest.fixture
def hopper(sm90, monkeypatch):
    monkeypatch.setattr(_fwd, "hopper_mode", True)
    return sm90


BF16, FP16 = torch.bfloat16, torch.float16
HOPPER_CASES = [
    batch_case(2, 1024, 1024, 8, 8, 128, BF16, causal=False),
    batch_case(2, 1024, 1024, 8, 8, 128, BF16, causal=True),
    batch_case(2, 1024, 1024, 8, 2, 256, FP16, causal=False),
    batch_case(2, 1024, 1024, 8, 2, 256, BF16, causal=True),
    batch_case(3, 1000, 1537, 8, 2, 128, BF16, causal=True),
    batch_case(3, 1537, 1000, 8, 1, 128, FP16, causal=True),
    batch_case(2, 300, 517, 4, 2, 128, BF16, causal=False),
    batch_case(2, 1, 1, 4, 4, 256, BF16, causal=True),
    batch_case(2, 1024, 1500, 8, 2, 128, BF16, window_size=(100, 300)),
    batch_case(2, 1024, 1024, 8, 2, 128, BF16, window_size=(256, 0)),
    batch_case(2, 777, 777, 8, 4, 256, FP16, window_size=(-1, 50)),
    varlen_case(*GPU_VARLEN_LENGTHS, 8, 2, 128, BF16, causal=True),
    varlen_case(*GPU_VARLEN_LENGTHS, 8, 8, 256, FP16, causal=False),
    varlen_case(*GPU_VARLEN_LENGTHS, 8, 2, 128, BF16, causal=False, window_size=(128, 64)),
    varlen_case((129, 128, 127, 1, 0, 255), (1, 128, 300, 129, 5, 0), 4, 1, 128, FP16, causal=True),
]


@pytest.mark.parametrize("case", [c.param() for c in HOPPER_CASES])
def test_hopper_forward(case, hopper):
    check_case(case, hopper)


def test_hopper_varlen_padding_nan_stays_out(hopper, monkeypatch):
    """NaN in the rows past ``cu_seqlens[-1]`` (a buffer sized for more tokens): the last key block of
    the last sequence reads them, and must not pass them on."""
    lengths_q, lengths_k = (100, 300, 37), (250, 129, 77)
    cu_q = torch.tensor([0, 100, 400, 437], dtype=torch.int32, device=hopper)
    cu_k = torch.tensor([0, 250, 379, 456], dtype=torch.int32, device=hopper)
    q = random_tensor((500, 8, 128), BF16, hopper)
    k = random_tensor((600, 2, 128), BF16, hopper)
    v = random_tensor((600, 2, 128), BF16, hopper)
    q[437:], k[456:], v[456:] = float("nan"), float("nan"), float("nan")

    def run():
        return tk.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                         return_attn_probs=True)

    out, lse, _ = run()
    assert not torch.isnan(out[:437]).any() and not torch.isnan(lse[:, :437]).any()
    monkeypatch.setattr(_fwd, "hopper_mode", False)
    want, want_lse, _ = run()
    torch.testing.assert_close(out[:437], want[:437], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[:, :437], want_lse[:, :437], atol=1e-4, rtol=1e-4)


def test_hopper_batch_neighbour_nan_stays_out(hopper):
    """Batch mode: a sequence's last key block runs into the next batch element's rows. NaN in element
    1's values must leave element 0's output finite and unchanged."""
    q = random_tensor((2, 200, 4, 128), BF16, hopper)
    k = random_tensor((2, 200, 4, 128), BF16, hopper)
    v = random_tensor((2, 200, 4, 128), BF16, hopper)
    clean = tk.flash_attn_func(q, k, v)
    v[1] = float("nan")
    poisoned = tk.flash_attn_func(q, k, v)
    assert torch.equal(poisoned[0], clean[0])


def test_hopper_deterministic(hopper):
    """The forward is bit-identical run to run."""
    q = random_tensor((2, 2048, 16, 128), BF16, hopper)
    k = random_tensor((2, 2048, 4, 128), BF16, hopper)
    v = random_tensor((2, 2048, 4, 128), BF16, hopper)
    first = tk.flash_attn_func(q, k, v, causal=True)
    for _ in range(3):
        assert torch.equal(tk.flash_attn_func(q, k, v, causal=True), first)


def test_hopper_mode_raises_where_it_does_not_apply(hopper):
    q = random_tensor((1, 64, 2, 64), BF16, hopper)  # head dim 64: the Triton kernel's
    with pytest.raises(RuntimeError, match="hopper_mode"):
        tk.flash_attn_func(q, q, q)
