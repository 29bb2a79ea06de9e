"""The GEMM's pointer path (every launch without TMA operands: pre-Hopper GPUs, and on Hopper an operand that
TMA cannot read) loads its operands in 16-byte vectors, checked in the PTX compiled for sm_90 on any machine.

Before the pointer path's hints (``gemm_kernel``: the clamped row and column offsets marked contiguous, the
strides and the K tail marked by ``known_multiple``), a layout whose unit stride runs along M or N, a row
stride of 8 elements mod 16, or a K tail compiled to one 2-byte load per element (bf16 on an H100 with TMA off: 14-53
TFLOP/s). Each case here builds its launch exactly as ``tk.gemm`` does (``gemm._launch``, with the kernel's
launch replaced by a capture of its arguments) and compiles it for sm_90 in a child process without
``TRITON_INTERPRET``, with an empty triton cache; run this file as a script to see the cases' output.
"""

from __future__ import annotations

import json
import re

import pytest

# layout (A then B: R row-major, C column-major), M, N, K; bf16, the pointer path (use_tma off)
CASES = {
    "RR-aligned": ("RR", 256, 256, 256),        # unit stride of B along N
    "RR-stride8": ("RR", 256, 3000, 256),       # B's row stride 8 mod 16 elements
    "CR-stride8": ("CR", 3000, 256, 256),       # A column-major: unit stride along M, stride 8 mod 16
    "RC-ktail": ("RC", 256, 256, 3000),         # K-contiguous rows 8 mod 16 and a K tail (3000 % 64)
    "CC-ktail": ("CC", 3000, 256, 3000),
}


def _compile_case(layout: str, M: int, N: int, K: int) -> dict:
    """Compile ``tk.gemm(a, b)``'s launch for sm_90; the sizes of its global loads and cp.async copies."""
    import importlib

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    from tilekernels import _runtime
    from tilekernels.gemm.configs import GemmConfig, override_config

    gemm_mod = importlib.import_module("tilekernels.gemm.gemm")
    captured = {}

    def capture(self, args, device):
        captured["launch"] = (self.kernel, args, self.constexprs, self.options)

    _runtime.CachedLaunch.__call__ = capture
    dt = torch.bfloat16
    a = torch.empty(M, K, dtype=dt) if layout[0] == "R" else torch.empty(K, M, dtype=dt).t()
    b = torch.empty(K, N, dtype=dt) if layout[1] == "R" else torch.empty(N, K, dtype=dt).t()
    c = torch.empty(M, N, dtype=dt)
    with override_config(GemmConfig(128, 128, 64, 8, 4, 3)):
        gemm_mod._launch(a, b, c, None, None, [], None, 1.0, 0.0, None, None, 1)
    fn, args, constexprs, options = captured["launch"]
    names = fn.arg_names
    values = dict(zip([n for n in names if n not in constexprs], args))
    constexprs = dict(constexprs)
    for name, value in list(values.items()):  # as a launch specialises: None and the integer 1 are constants
        if value is None or (type(value) is int and value == 1):
            constexprs[name] = values.pop(name)

    def divisible(value) -> bool:
        if isinstance(value, torch.Tensor):
            return value.data_ptr() % 16 == 0
        return type(value) is int and value % 16 == 0

    signature = {n: "constexpr" if n in constexprs else mangle_type(values[n]) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in values and divisible(values[n])}
    source = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()}, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=options["num_warps"], num_stages=options["num_stages"]))
    ptx = kernel.asm["ptx"]
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\d+B)? \[[^\]]*\], \[[^\]]*\], (0x[0-9a-f]+|\d+)",
                        ptx)
    return {"cp_async_bytes": sorted({int(size, 0) for size in copies}),
            "global_loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx)))}


def _main() -> None:
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = _compile_case(*case)
        except Exception as error:  # reported per case by the test
            results[name] = f"{type(error).__name__}: {str(error)[-2000:]}"
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def compiled(compile_in_child) -> dict:
    return compile_in_child(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_gemm_pointer_path_loads_16_byte_vectors(case, compiled):
    result = compiled[case]
    assert isinstance(result, dict), f"{case}: {result}"
    # every operand load is a pipelined 16-byte cp.async; no element-wise global load is left
    assert result["cp_async_bytes"] == [16], f"{case}: {result}"
    assert result["global_loads"] == [], f"{case}: {result}"


if __name__ == "__main__":
    _main()
