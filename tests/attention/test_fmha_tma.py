"""Alternative paths of the attention kernels against the default ones, bit for bit.

TMA (tensor-descriptor) loads against pointer loads:

On Hopper the kernels read q/k/v (forward), q/dO (dK/dV) and k/v (dQ) through descriptors over
``[rows, heads, D]``, where a block that runs past its sequence reads the next sequence's rows, or
padding. The interpreter runs descriptors too, so the CPU lane forces that path here
(``_fwd.tma_mode = True``) and requires results bit-identical to the pointer path, with NaN in the
padding rows past ``cu_seqlens[-1]`` (0 * NaN would leak into real rows if the masked blocks did not
zero them).

The dK/dV kernel split into one launch per gradient (head dim 256 on a GPU) against one launch.

Which forward a call takes: the Gluon kernel for Hopper (tested in test_fmha_hopper.py, GPU lane; the
interpreter does not run Gluon) only where it applies.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tilekernels as tk
from tilekernels.attention import _bwd, _fwd
from tilekernels.testing import random_tensor


def _run(fn, q, k, v, dout):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(qq, kk, vv)
    out.backward(dout)
    return out.detach(), qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_tma_path_matches_pointer_path(device, monkeypatch, varlen):
    dtype, heads, kv_heads, head_dim = torch.float16, 4, 2, 40
    if varlen:
        cu_q = torch.tensor([0, 20, 65, 68], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 52, 62, 93], dtype=torch.int32, device=device)
        q = random_tensor((70, heads, head_dim), dtype, device)
        k = random_tensor((100, kv_heads, head_dim), dtype, device)
        v = random_tensor((100, kv_heads, head_dim), dtype, device)
        # padding past the last sequence, as in a buffer sized for more tokens
        q[68:], k[93:], v[93:] = float("nan"), float("nan"), float("nan")
        rows_q, rows_k = 68, 93

        def fn(q, k, v):
            return tk.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 45, 52, causal=True, window_size=(20, -1))
    else:
        q = random_tensor((3, 45, heads, head_dim), dtype, device)
        k = random_tensor((3, 52, kv_heads, head_dim), dtype, device)
        v = random_tensor((3, 52, kv_heads, head_dim), dtype, device)
        rows_q = rows_k = None

        def fn(q, k, v):
            return tk.flash_attn_func(q, k, v, causal=True)
    dout = random_tensor(q.shape, dtype, device)
    if varlen:
        dout[68:] = float("nan")

    monkeypatch.setattr(_fwd, "tma_mode", False)
    expected = _run(fn, q, k, v, dout)
    monkeypatch.setattr(_fwd, "tma_mode", True)
    assert _fwd.use_tensor_descriptors((q, k, v), varlen)
    got = _run(fn, q, k, v, dout)
    for name, want, have, rows in zip(("out", "dq", "dk", "dv"), expected, got, (rows_q, rows_q, rows_k, rows_k)):
        assert not torch.isnan(have[:rows]).any(), f"{name}: NaN from the padding rows reached real rows"
        assert torch.equal(have[:rows], want[:rows]), f"{name}: TMA path differs from the pointer path"


def test_tma_needs_aligned_strides(device, monkeypatch):
    monkeypatch.setattr(_fwd, "tma_mode", True)
    q = random_tensor((1, 8, 2, 20), torch.float16, device)   # row stride 40 bytes: not 16-byte aligned
    assert not _fwd.use_tensor_descriptors((q, q, q), False)
    padded = random_tensor((2, 8, 2, 32), torch.float16, device)[:, :, :, :24]  # last dim 24 of 32: aligned
    assert _fwd.use_tensor_descriptors((padded, padded, padded), False)
    gapped = random_tensor((2, 9, 2, 32), torch.float16, device)[:, :8]        # batch stride != S * row stride
    assert not _fwd.use_tensor_descriptors((gapped, gapped, gapped), False)


def test_split_dkdv_matches_one_launch(device):
    """``BwdConfig.split_dkdv``: dK and dV from two launches equal the one-launch gradients exactly."""
    q = random_tensor((2, 37, 4, 40), torch.bfloat16, device)
    k = random_tensor((2, 53, 2, 40), torch.bfloat16, device)
    v = random_tensor((2, 53, 2, 40), torch.bfloat16, device)
    dout = random_tensor(q.shape, torch.bfloat16, device)

    def fn(q, k, v):
        return tk.flash_attn_func(q, k, v, causal=True, softcap=5.0, dropout_p=0.2)

    dkdv_cfg, dq_cfg = _bwd.bwd_configs(40)
    results = []
    try:
        for split in (False, True):
            _bwd.config_override = (dataclasses.replace(dkdv_cfg, split_dkdv=split), dq_cfg)
            torch.manual_seed(7)
            results.append(_run(fn, q, k, v, dout))
    finally:
        _bwd.config_override = None
    for name, one, two in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(one, two), f"{name}: split dK/dV launches differ from one launch"


def test_tma_skips_empty_operands(device, monkeypatch):
    """Batch mode allows S_k = 0; a descriptor over a zero-sized dimension is invalid, so such a call
    takes the pointer path (every row sees no key: out 0, LSE +inf)."""
    monkeypatch.setattr(_fwd, "tma_mode", None if device.type == "cuda" else True)
    q = random_tensor((2, 5, 2, 32), torch.float16, device)
    k = torch.empty((2, 0, 2, 32), dtype=torch.float16, device=device)
    assert not _fwd.use_tensor_descriptors((q, k, k), False)
    out, lse, _ = tk.flash_attn_func(q, k, k, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert bool((lse == float("inf")).all())


def test_hopper_kernel_dispatch(device, monkeypatch):
    """The Gluon forward only takes calls it supports: never under the interpreter or off sm_90, and
    ``hopper_mode=True`` raises instead of silently running the Triton kernel."""
    q = random_tensor((1, 64, 2, 128), torch.bfloat16, device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        prob = _fwd.Problem(1, 2, 2, 128, 64, 64, None, None, 128 ** -0.5, -1, 0, 0.0, None, 0.0, None)
        assert not _fwd.hopper_kernel_applies(q, q, q, prob, True)
        monkeypatch.setattr(_fwd, "hopper_mode", True)
        with pytest.raises(RuntimeError, match="hopper_mode"):
            tk.flash_attn_func(q, q, q, causal=True)
    else:
        prob = _fwd.Problem(1, 2, 2, 128, 64, 64, None, None, 128 ** -0.5, -1, 0, 0.0, None, 0.0, None)
        assert _fwd.hopper_kernel_applies(q, q, q, prob, True)
        assert not _fwd.hopper_kernel_applies(q, q, q, dataclasses.replace(prob, softcap=5.0), True)
