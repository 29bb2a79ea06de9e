"""The direct launch path of cached launches (``_runtime.direct_launcher``): on a GPU with triton 3.6 and no
launch hook registered it calls triton's C launcher itself, with host tensor descriptors' CUtensorMaps from a
cache; otherwise triton's own launcher. Both must launch the same kernel with the same arguments."""

from __future__ import annotations

import importlib

import pytest
import torch
import triton

import tilekernels as tk
from tilekernels import _runtime

gpu = pytest.mark.gpu


def test_idle_hook():
    """Only no hook at all (None or an empty chain) lets a launch skip triton's launcher."""
    from triton.knobs import HookChain

    chain = HookChain()
    assert _runtime._idle(None) and _runtime._idle(chain)
    chain.add(lambda metadata: None)
    assert not _runtime._idle(chain)
    assert not _runtime._idle(lambda metadata: None)


@gpu
def test_gpu_raw_launch_matches_triton_launcher(device):
    """A GEMM with C and the residual through TMA descriptors, over fresh allocations (more than the descriptor
    cache keeps, so it is cleared and refilled) and one input set reused at the same addresses: every output of
    the raw path must equal, bit for bit, the output of triton's launcher on the same inputs, which a
    registered launch hook forces (the hook must fire on each of those calls)."""
    gemm_module = importlib.import_module("tilekernels.gemm.gemm")
    M, N, K = 300, 512, 256
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen)

    def call(x, out):
        return tk.gemm(x[0], x[1], bias=x[2], activation="gelu", residual=x[3], out=out)

    sets = [(rand(M, K), rand(K, N), rand(N), rand(M, N)) for _ in range(_runtime._RAW_DESCRIPTOR_CACHE + 8)]
    sets += [sets[0], sets[1], sets[0]]
    gemm_module._PLANS.clear()
    fast = [call(x, torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)) for x in sets]
    (plan,) = gemm_module._PLANS.values()
    assert plan.c_desc is not None and plan.res_desc is not None, "the case must pass C and the residual by TMA"
    if triton.__version__.startswith("3.6"):
        assert plan.kernel.launch.raw is not None, "triton 3.6's launcher should take the raw path"

    fired = []

    def hook(metadata):
        fired.append(metadata)

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        slow = [call(x, torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)) for x in sets]
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(fired) == len(sets), "a registered launch hook must see every launch"
    for i, (f, s) in enumerate(zip(fast, slow)):
        assert not f.isnan().any(), f"raw launch {i} left NaN in its output"
        assert torch.equal(f, s), f"raw launch {i} differs from triton's launcher"
    a, b, bias, residual = (t.double() for t in sets[5])
    ref = torch.nn.functional.gelu(a @ b + bias) + residual
    assert (fast[5].double() - ref).abs().max().item() < 0.5, "the raw path's GEMM is wrong"


def _fresh(gen, device, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=device, dtype=dtype, generator=gen)


@gpu
def test_gpu_raw_launch_matches_triton_launcher_across_ops(device, monkeypatch):
    """Each op's cached launches, Gluon kernels with host descriptors included (the Hopper attention forward,
    deterministic backward and paged prefill, forced so that they cannot fall back), the Gluon MoE quantiser
    and a Triton norm: a call on new inputs after the compiling call (the raw path) equals, bit for bit, the
    same call through triton's launcher (forced by a launch hook, which must fire)."""
    if torch.cuda.get_device_capability(device) != (9, 0):
        pytest.skip("the Gluon kernels need sm_90")
    from tilekernels.attention import _bwd, _fwd, _paged_kernels

    for module in (_fwd, _bwd, _paged_kernels):
        monkeypatch.setattr(module, "hopper_mode", True)
    gen = torch.Generator(device=device).manual_seed(1)
    B, S, H, H_kv, D = 2, 640, 4, 2, 128

    def attention(seed):
        g = torch.Generator(device=device).manual_seed(seed)
        q, k, v = (_fresh(g, device, B, S, h, D).requires_grad_() for h in (H, H_kv, H_kv))
        out = tk.flash_attn_func(q, k, v, causal=True, deterministic=True)
        out.backward(_fresh(g, device, B, S, H, D))
        return [out.detach(), q.grad, k.grad, v.grad]

    page, pages = 16, 96
    k_cache, v_cache = (_fresh(gen, device, pages, page, H_kv, D) for _ in range(2))
    kv_lens = [700, 333]
    page_counts = [-(-n // page) for n in kv_lens]
    kv_indptr = torch.tensor([0, page_counts[0], sum(page_counts)], device=device, dtype=torch.int32)
    kv_pages = torch.randperm(pages, device=device, generator=gen)[:sum(page_counts)].to(torch.int32)
    last = torch.tensor([n - (c - 1) * page for n, c in zip(kv_lens, page_counts)], device=device,
                        dtype=torch.int32)
    qo_indptr = torch.tensor([0, 300, 400], device=device, dtype=torch.int32)

    def prefill(seed):
        g = torch.Generator(device=device).manual_seed(seed)
        q = _fresh(g, device, 400, H, D)
        return [tk.batch_prefill(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_pages, last, causal=True)]

    smooth = torch.rand(8, 4096, device=device, generator=gen) + 0.5
    ids = torch.randint(0, 8, (512, 2), device=device, generator=gen, dtype=torch.int32)
    weight = _fresh(gen, device, 4096)

    def moe(seed):
        g = torch.Generator(device=device).manual_seed(seed)
        return list(tk.moe_smooth_quant(_fresh(g, device, 512, 4096), smooth, ids))

    def norm(seed):
        g = torch.Generator(device=device).manual_seed(seed)
        return [tk.rms_norm(_fresh(g, device, 512, 4096), weight)]

    fired = []
    for name, call in (("attention", attention), ("prefill", prefill), ("moe", moe), ("norm", norm)):
        call(0)   # compiles, through triton
        fast = call(1)
        fired.clear()
        triton.knobs.runtime.launch_enter_hook.add(fired.append)
        try:
            slow = call(1)
        finally:
            triton.knobs.runtime.launch_enter_hook.remove(fired.append)
        torch.cuda.synchronize()
        assert fired, f"{name}: a registered launch hook must see the launches"
        for i, (f, s) in enumerate(zip(fast, slow, strict=True)):
            assert torch.equal(f, s), f"{name}: output {i} of the raw path differs from triton's launcher"
