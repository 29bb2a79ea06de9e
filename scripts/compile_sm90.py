"""Compile one tk.gemm launch for an H100 (sm_90) on a machine without a GPU, to read its resources and code.

The device machine is rationed; whether a kernel change fits in shared memory, how many registers it takes,
whether it spills and what its TTGIR looks like can all be answered here. tk.gemm builds its launch plan as
it would on an H100 (TMA descriptors, 132 SMs, the config given), and triton compiles the kernel for
``cuda:90`` instead of launching it. Prints shared memory (what triton checks against the H100's 232,448
bytes a block), registers and spill bytes, and writes ``<name>.ttgir``, ``.ptx``, ``.cubin`` and ``.sass``
under ``--out``.

    .venv/bin/python scripts/compile_sm90.py --shape 8192x8192x8192 --bias --activation gelu --residual \\
        --config 128,256,64,8,8,3 --slices 2

Measured against the device's own compile (triton 3.6, 2026-12-07): 213,032 bytes of shared memory and 250
registers for that call, as the H100 reported. The device image has triton 3.6 and CI 3.9; to compile with
3.6 here, install it aside (``pip install --target /tmp/t36 --no-deps triton==3.6.0``) and put it first:
``PYTHONPATH=/tmp/t36:src``. This is a developer tool: it replaces a few of tk.gemm's device queries in this
process only (see ``_pretend_h100``). ``compile_gemm`` is the same for a script or a test (tests/gemm).
``--gluon`` compiles the Gluon kernel that tk.gemm runs for the large tile on sm_90 instead (``gemm/_gluon.py``).
"""

import argparse
import importlib
import json
import os
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _H100Driver:
    """What triton's JIT asks its driver before compiling: device, stream and target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


_COMPILED: list = []
_pretending = False   # whether _pretend_h100 has run (asking triton's driver instead would start one)


def _pretend_h100():
    """Point triton at an sm_90 target and let tk.gemm plan a CPU call as an H100 launch; every launch is
    compiled (``warmup``) instead of run, and appended to ``_COMPILED``. For the whole process, once."""
    global _pretending
    if _pretending:
        return
    _pretending = True
    triton.runtime.driver.set_active(_H100Driver())
    from tilekernels import _runtime
    gemm_module = importlib.import_module("tilekernels.gemm.gemm")
    gemm_module.supports_tensor_descriptors = lambda device: True
    gemm_module.sm_count = lambda device: 132
    gemm_module.check_runnable = lambda device, name: None

    def compile_only(launch, args, device):
        _COMPILED.append(launch.kernel.warmup(*args, grid=(launch.grid,), **launch.constexprs, **launch.options))

    _runtime.CachedLaunch.__call__ = compile_only


def compile_gemm(a: torch.Tensor, b: torch.Tensor, config, **epilogue) -> list:
    """The kernels that ``tk.gemm(a, b, **epilogue)`` (CPU tensors) launches on an H100 under ``config``, compiled
    for sm_90 exactly as a launch specialises them (triton's own binder); a row tail adds a second kernel."""
    _pretend_h100()
    import tilekernels as tk
    from tilekernels.gemm.configs import override_config

    importlib.import_module("tilekernels.gemm.gemm")._PLANS.clear()
    _COMPILED.clear()
    with override_config(config):
        tk.gemm(a, b, **epilogue)
    return list(_COMPILED)


def _write_outputs(kernel, out_dir: str, name: str) -> str:
    """Write the kernel's TTGIR, PTX, cubin and SASS; return cuobjdump's resource line."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    for ext in ("ttgir", "ptx"):
        with open(f"{path}.{ext}", "w") as fh:
            fh.write(kernel.asm[ext])
    with open(f"{path}.cubin", "wb") as fh:
        fh.write(kernel.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f"{path}.cubin"], capture_output=True,
                          text=True, check=True).stdout
    with open(f"{path}.sass", "w") as fh:
        fh.write(sass)
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f"{path}.cubin"],
                           capture_output=True, text=True, check=True).stdout
    lines = [line.strip() for line in usage.splitlines() if "REG:" in line]
    return lines[-1] if lines else usage.strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x8192x8192", help="MxNxK")
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    parser.add_argument("--layout", default="RR", choices=["RR", "RC", "CR", "CC"],
                        help="A and B row- (R) or column-major (C)")
    parser.add_argument("--bias", action="store_true", help="a bias [N]")
    parser.add_argument("--activation", default=None, choices=["relu", "gelu", "gelu_tanh", "silu"])
    parser.add_argument("--residual", action="store_true", help="a residual [M, N]")
    parser.add_argument("--config", default="128,256,64,8,8,4",
                        help="block_m,block_n,block_k,group_m,num_warps,num_stages")
    parser.add_argument("--pointer", action="store_true", help="operands by pointer loads, not TMA descriptors")
    parser.add_argument("--slices", type=int, default=0, help="epilogue column slices (0: the plan's choice)")
    parser.add_argument("--gluon", action="store_true",
                        help="the Gluon kernel that tk.gemm runs for the large tile on sm_90 (gemm/_gluon.py) in one "
                             "launch, instead of tk.gemm's plan (--config, --pointer and --slices then do not apply)")
    parser.add_argument("--async-input", action="store_true",
                        help="with --gluon: the kernel's async-input form (chunk signals waited on by the loader)")
    parser.add_argument("--out", default="/tmp/sm90", help="folder for the TTGIR, PTX, cubin and SASS")
    parser.add_argument("--name", default="gemm", help="file name stem of the outputs")
    parser.add_argument("--json", action="store_true", help="also print the figures as a RESULTS {json} line")
    args = parser.parse_args(argv)

    from tilekernels.gemm.configs import GemmConfig

    M, N, K = (int(v) for v in args.shape.lower().split("x"))
    dtype = _DTYPES[args.dtype]
    # only shapes, strides and alignment reach the compile: no values to draw
    a = torch.empty(M, K, dtype=dtype) if args.layout[0] == "R" else torch.empty(K, M, dtype=dtype).t()
    b = torch.empty(K, N, dtype=dtype) if args.layout[1] == "R" else torch.empty(N, K, dtype=dtype).t()
    bias = torch.empty(N, dtype=dtype) if args.bias else None
    residual = torch.empty(M, N, dtype=dtype) if args.residual else None
    block_m, block_n, block_k, group_m, num_warps, num_stages = (int(v) for v in args.config.split(","))
    config = GemmConfig(block_m, block_n, block_k, group_m, num_warps, num_stages, use_tma=not args.pointer,
                        epilogue_slices=args.slices)
    if args.gluon:
        _pretend_h100()
        from tilekernels.gemm import _gluon
        compiled = [_gluon.compile_only(a, b, bias, args.activation, residual, async_input=args.async_input)]
    else:
        compiled = compile_gemm(a, b, config, bias=bias, activation=args.activation, residual=residual)
    results = {}
    for i, kernel in enumerate(compiled):
        name = args.name if len(compiled) == 1 else f"{args.name}-{i}"
        usage = _write_outputs(kernel, args.out, name)
        print(f"{name}: shared {kernel.metadata.shared} bytes; {usage}")
        print(f"  {os.path.join(args.out, name)}.{{ttgir,ptx,cubin,sass}}")
        fields = dict(field.split(":", 1) for field in usage.split() if ":" in field)
        results[name] = {"shared": kernel.metadata.shared, "registers": int(fields.get("REG", -1)),
                         "local": int(fields.get("LOCAL", -1)), "files": os.path.join(args.out, name)}
    if args.json:
        print("RESULTS " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
