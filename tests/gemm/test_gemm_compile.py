"""The GEMM's pointer path (every launch without TMA operands: pre-Hopper GPUs, and on Hopper an operand that
TMA cannot read) loads its operands in 16-byte vectors, checked in the PTX compiled for sm_90 on any machine.

Before the pointer path's hints (``gemm_kernel``: the clamped row and column offsets marked contiguous, the
strides and the K tail marked by ``known_multiple``), a layout whose unit stride runs along M or N, a row
stride of 8 elements mod 16, or a K tail compiled to one 2-byte load per element (bf16 on an H100 with TMA off: 14-53
TFLOP/s). Each case calls ``tk.gemm`` and has its launch compiled for sm_90 as triton would specialise it on an
H100 (``scripts/compile_sm90.py``'s ``compile_gemm``), in a child process without ``TRITON_INTERPRET``, with an
empty triton cache; run this file as a script to see the cases' output.
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
    """Compile ``tk.gemm(a, b)``'s launch for sm_90 (``scripts/compile_sm90.py``); the sizes of its global loads
    and cp.async copies."""
    import importlib.util
    import pathlib

    import torch

    from tilekernels.gemm.configs import GemmConfig

    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "compile_sm90.py"
    spec = importlib.util.spec_from_file_location("compile_sm90", path)
    compile_sm90 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compile_sm90)
    dt = torch.bfloat16
    a = torch.empty(M, K, dtype=dt) if layout[0] == "R" else torch.empty(K, M, dtype=dt).t()
    b = torch.empty(K, N, dtype=dt) if layout[1] == "R" else torch.empty(N, K, dtype=dt).t()
    (kernel,) = compile_sm90.compile_gemm(a, b, GemmConfig(128, 128, 64, 8, 4, 3))
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
