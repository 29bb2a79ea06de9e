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
from tilekernels.testing import assert_close, poisoned, random_tensor, reference_gemm

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
def test_gpu_raw_launch_matches_triton_launcher(device, monkeypatch):
    """A GEMM with C and the residual through TMA descriptors, over fresh allocations (more than the descriptor
    cache keeps, so it is cleared and refilled) and one input set reused at the same addresses: every output of
    the raw path must equal, bit for bit, the output of triton's launcher on the same inputs, which a
    registered launch hook forces (the hook must fire on each of those calls)."""
    gemm_module = importlib.import_module("tilekernels.gemm.gemm")
    monkeypatch.setenv("TILEKERNELS_GEMM_GLUON", "0")   # gemm_kernel's launch (the Gluon one: test_gemm_gluon.py)
    M, N, K = 300, 512, 256
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return random_tensor(shape, torch.bfloat16, device, generator=gen)

    def call(x):
        out = poisoned((M, N), torch.bfloat16, device)
        return tk.gemm(x[0], x[1], bias=x[2], activation="gelu", residual=x[3], out=out)

    sets = [(rand(M, K), rand(K, N), rand(N), rand(M, N)) for _ in range(_runtime._RAW_DESCRIPTOR_CACHE + 8)]
    sets += [sets[0], sets[1], sets[0]]
    gemm_module._PLANS.clear()
    fast = [call(x) for x in sets]
    (plan,) = gemm_module._PLANS.values()
    assert plan.c_desc is not None and plan.res_desc is not None, "the case must pass C and the residual by TMA"
    if triton.__version__.startswith("3.6"):
        assert plan.kernel.launch.raw is not None, "triton 3.6's launcher should take the raw path"

    fired = []
    triton.knobs.runtime.launch_enter_hook.add(fired.append)
    try:
        slow = [call(x) for x in sets]
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(fired.append)
    torch.cuda.synchronize()
    assert len(fired) == len(sets), "a registered launch hook must see every launch"
    for i, (f, s) in enumerate(zip(fast, slow)):
        assert not f.isnan().any(), f"raw launch {i} left NaN in its output"
        assert torch.equal(f, s), f"raw launch {i} differs from triton's launcher"
    a, b, bias, residual = sets[5]
    epilogue = dict(bias=bias, activation="gelu", residual=residual)
    assert_close("raw-launch", fast[5], reference_gemm(a, b, **epilogue),
                 reference_gemm(a, b, compute_dtype=None, **epilogue))


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
    gen = torch.Generator().manual_seed(1)
    B, S, H, H_kv, D = 2, 640, 4, 2, 128

    def fresh(g, *shape):
        return random_tensor(shape, torch.bfloat16, device, generator=g)

    def attention(seed):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (fresh(g, B, S, h, D).requires_grad_() for h in (H, H_kv, H_kv))
        out = tk.flash_attn_func(q, k, v, causal=True, deterministic=True)
        out.backward(fresh(g, B, S, H, D))
        return [out.detach(), q.grad, k.grad, v.grad]

    page, pages = 16, 96
    k_cache, v_cache = (fresh(gen, pages, page, H_kv, D) for _ in range(2))
    kv_lens = [700, 333]
    page_counts = [_runtime.cdiv(n, page) for n in kv_lens]
    kv_indptr = torch.tensor([0, page_counts[0], sum(page_counts)], device=device, dtype=torch.int32)
    kv_pages = torch.randperm(pages, generator=gen)[:sum(page_counts)].to(device=device, dtype=torch.int32)
    last = torch.tensor([n - (c - 1) * page for n, c in zip(kv_lens, page_counts)], device=device,
                        dtype=torch.int32)
    qo_indptr = torch.tensor([0, 300, 400], device=device, dtype=torch.int32)

    def prefill(seed):
        g = torch.Generator().manual_seed(seed)
        q = fresh(g, 400, H, D)
        return [tk.batch_prefill(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_pages, last, causal=True)]

    smooth = (torch.rand(8, 4096, generator=gen) + 0.5).to(device)
    ids = torch.randint(0, 8, (512, 2), generator=gen, dtype=torch.int32).to(device)
    weight = fresh(gen, 4096)

    def moe(seed):
        g = torch.Generator().manual_seed(seed)
        return list(tk.moe_smooth_quant(fresh(g, 512, 4096), smooth, ids))

    def norm(seed):
        g = torch.Generator().manual_seed(seed)
        return [tk.rms_norm(fresh(g, 512, 4096), weight)]

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
