"""WIP A/B on a Hopper GPU: the Gluon GEMM's main loop without an epilogue against tk.gemm and cuBLAS on the
large ANCHORS.md shapes (bf16, row-major, CUDA graphs, interleaved rounds). Run under ``timeout``."""
import json
import os
import sys

import torch
import triton

import tilekernels as tk
from tilekernels.gemm._gluon import fused_gemm

rounds = int(os.environ.get("ROUNDS", "3"))
torch.manual_seed(0)
for M, N, K in [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 3584, 8192), (8192, 28672, 8192),
                (8192, 8192, 28672)]:
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    bc = b.t().contiguous().t()
    fns = {"gluon": lambda: fused_gemm(a, b), "tk.gemm": lambda: tk.gemm(a, b), "cublas": lambda: a @ b,
           "gluon RC": lambda: fused_gemm(a, bc), "tk.gemm RC": lambda: tk.gemm(a, bc), "cublas RC": lambda: a @ bc}
    ref = fns["cublas"]()
    for k in ("gluon", "gluon RC"):
        got = fns[k]()
        torch.cuda.synchronize()
        print(M, N, K, k, "max |diff| vs cublas", (got.float() - ref.float()).abs().max().item(), flush=True)
    flop = 2 * M * N * K
    t = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t[k].append(triton.testing.do_bench_cudagraph(f, rep=150))
    print(json.dumps({"shape": f"{M}x{N}x{K}", **{k: [round(flop / ms / 1e9, 1) for ms in v] for k, v in t.items()}}),
          flush=True)
sys.exit(0)
