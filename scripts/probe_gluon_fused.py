"""WIP A/B on a Hopper GPU: the Gluon GEMM (epilogue deferred or not) against gemm_kernel (Triton), plain and
fused, and cuBLAS + torch's ops; CUDA graphs, interleaved rounds. Run under ``timeout``: a barrier mistake hangs."""
import importlib
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

import tilekernels as tk
from tilekernels.gemm._gluon import fused_gemm

gemm_mod = importlib.import_module("tilekernels.gemm.gemm")
rounds = int(os.environ.get("ROUNDS", "3"))
torch.manual_seed(0)


def triton_path(fn):
    def run():
        return fn()
    run.env = "0"
    return run


for M, N, K in [(8192, 8192, 8192), (4096, 4096, 4096)]:
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    fns = {
        "triton fused": triton_path(lambda: tk.gemm(a, b, bias=bias, activation="gelu", residual=r)),
        "tk.gemm fused": lambda: tk.gemm(a, b, bias=bias, activation="gelu", residual=r),
        "gluon defer": lambda: fused_gemm(a, b, bias, "gelu", r),
        "gluon nodefer": lambda: fused_gemm(a, b, bias, "gelu", r, defer=False),
        "torch fused": lambda: F.gelu(a @ b + bias) + r,
        "triton plain": triton_path(lambda: tk.gemm(a, b)),
        "tk.gemm plain": lambda: tk.gemm(a, b),
        "cublas": lambda: a @ b,
    }

    def prep(k):
        os.environ["TILEKERNELS_GEMM_GLUON"] = getattr(fns[k], "env", "1")
        gemm_mod._PLANS.clear()

    prep("triton fused")
    want = fns["triton fused"]()
    for k in ("tk.gemm fused", "gluon defer", "gluon nodefer"):
        prep(k)
        got = fns[k]()
        torch.cuda.synchronize()
        print(k, M, N, K, "max |diff| vs triton", (got.float() - want.float()).abs().max().item(), flush=True)
    flop = 2 * M * N * K
    t = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            prep(k)
            t[k].append(triton.testing.do_bench_cudagraph(f, rep=150))
    print(json.dumps({"shape": f"{M}x{N}x{K}", **{k: [round(flop / ms / 1e9, 1) for ms in v] for k, v in t.items()}}),
          flush=True)
sys.exit(0)
