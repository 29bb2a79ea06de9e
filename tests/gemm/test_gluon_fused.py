"""The Gluon GEMM with the residual fetched ahead (``gemm._gluon``, WIP branch) against tk.gemm and fp64.

GPU only (Hopper): Gluon's barriers, TMA and wgmma do not run under the interpreter. Every case runs in a
child process with a time limit, so that a barrier mistake shows as a failure instead of a hung lane.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

gpu = pytest.mark.gpu

_CHILD = r"""
import sys, torch
import tilekernels as tk
from tilekernels.gemm._gluon import fused_gemm
from tilekernels.testing import assert_close, poisoned, reference_gemm
M, N, K, dtype, bias_on, activation, res_on, b_col, defer = sys.argv[1:]
M, N, K = int(M), int(N), int(K)
dtype = getattr(torch, dtype)
activation = None if activation == "none" else activation
torch.manual_seed(0)
a = (torch.randn(M, K, device="cuda") * K ** -0.5).to(dtype)
b = torch.randn(K, N, device="cuda").to(dtype)
if b_col == "1":
    b = b.t().contiguous().t()
bias = torch.randn(N, device="cuda").to(dtype) if bias_on == "1" else None
res = torch.randn(M, N, device="cuda").to(dtype) if res_on == "1" else None
out = poisoned((M, N), dtype, torch.device("cuda"))
for _ in range(3):   # persistent programs and barrier phases over repeated calls
    fused_gemm(a, b, bias, activation, res, 0.5, out=out, defer=defer == "1")
torch.cuda.synchronize()
kw = dict(bias=bias, activation=activation, residual=res, beta=0.5 if res is not None else 1.0)
ref = reference_gemm(a, b, **kw)
torch_out = reference_gemm(a, b, compute_dtype=None, **kw)
assert_close(f"gluon-{M}x{N}x{K}", out, ref, torch_out, ratio=2.0)
table = tk.gemm(a, b, **kw)
diff = (out.float() - table.float()).abs().max().item()
print("max |gluon - tk.gemm|", diff, "identical", torch.equal(out, table))
"""


def _run(*args) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _CHILD, *map(str, args)], capture_output=True, text=True,
                          timeout=180, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


CASES = [((4100, 4104, 1000), "bias-gelu-res"), ((8192, 8192, 8192), "bias-gelu-res"), ((128, 256, 64), "bias-gelu-res"),
         ((300, 520, 72), "bias-gelu-res"), ((17, 40, 8), "bias-gelu-res"), ((4100, 4104, 1000), "none"),
         ((4100, 4104, 1000), "res"), ((300, 520, 72), "bias-silu"), ((300, 520, 72), "none"),
         ((4100, 4104, 150), "bias-gelu-res"), ((4100, 4104, 300), "bias-gelu-res"), ((4100, 4104, 1000), "bias-gelu-res-bcol"),
         ((300, 520, 72), "bias-gelu-res-bcol"), ((4100, 4104, 1000), "none-bcol"),
         ((4100, 4104, 1000), "bias-gelu-res-nodefer"), ((300, 520, 72), "bias-gelu-res-nodefer")]


@gpu
@pytest.mark.parametrize(("shape", "epilogue"), CASES, ids=["x".join(map(str, s)) + "-" + e for s, e in CASES])
def test_gpu_gluon_fused(shape, epilogue):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon fused GEMM is written for Hopper")
    bias_on = "1" if "bias" in epilogue else "0"
    res_on = "1" if "res" in epilogue else "0"
    activation = next((x for x in ("gelu", "silu") if x in epilogue), "none")
    b_col = "1" if "bcol" in epilogue else "0"
    defer = "0" if "nodefer" in epilogue else "1"
    print(_run(*shape, "bfloat16", bias_on, activation, res_on, b_col, defer))
