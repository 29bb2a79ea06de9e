"""WIP A/B on a Hopper GPU: the Gluon GEMM with the residual fetched ahead against tk.gemm (Triton), plain
and cuBLAS + torch's ops, CUDA graphs, interleaved rounds. Run under ``timeout``: a barrier mistake hangs."""
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

import tilekernels as tk
from tilekernels.gemm._gluon import fused_gemm

rounds = int(os.environ.get("ROUNDS", "4"))
stages = [int(s) for s in os.environ.get("STAGES", "3").split(",")]
torch.manual_seed(0)
for M, N, K in [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 3584, 8192)]:
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    fns = {"tk.gemm": lambda: tk.gemm(a, b, bias=bias, activation="gelu", residual=r)}
    fns["gluon defer"] = lambda: fused_gemm(a, b, bias, "gelu", r)
    fns["gluon nodefer"] = lambda: fused_gemm(a, b, bias, "gelu", r, defer=False)
    fns["gluon plain"] = lambda: fused_gemm(a, b)
    fns["plain"] = lambda: tk.gemm(a, b)
    fns["torch"] = lambda: F.gelu(a @ b + bias) + r
    want = fns["tk.gemm"]()
    for k, f in fns.items():
        if k.startswith("gluon") and "plain" not in k:
            got = f()
            torch.cuda.synchronize()
            print(k, M, N, K, "max |diff| vs tk.gemm", (got.float() - want.float()).abs().max().item(), flush=True)
    flop = 2 * M * N * K
    t = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t[k].append(triton.testing.do_bench_cudagraph(f, rep=200))
    print(json.dumps({"shape": f"{M}x{N}x{K}", **{k: [round(flop / ms / 1e9, 1) for ms in v] for k, v in t.items()}}),
          flush=True)
sys.exit(0)
