"""scripts/compile_sm90.py compiles a TMA launch of tk.gemm for sm_90 on a machine without a GPU (CPU lane).

The script is the developer's way to read a kernel change's shared memory, registers and spills before device
time is spent on it; this keeps it working as tk.gemm's launch code changes. It runs in a child process (it
replaces triton's driver and some of tk.gemm's device queries for the whole process) without
``TRITON_INTERPRET`` and with an empty triton cache (the ``compile_in_child`` fixture).
"""

from __future__ import annotations

import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "compile_sm90.py"


def _compile(compile_in_child, tmp_path, *args) -> dict:
    """The one kernel that ``compile_sm90.py *args --out <tmp> --json`` compiles: its RESULTS entry."""
    wrapper = tmp_path / "run.py"
    argv = [str(SCRIPT), *args, "--out", str(tmp_path / "out"), "--json"]
    wrapper.write_text(f"import runpy, sys\nsys.argv = {argv!r}\n"
                       f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    (kernel,) = compile_in_child(wrapper).values()
    return kernel


def test_compile_sm90_heavy_epilogue(compile_in_child, tmp_path):
    """A small heavy-epilogue launch (bias, gelu, residual; C and the residual through TMA): it compiles, its
    outputs are written, and it fits an H100's shared memory."""
    kernel = _compile(compile_in_child, tmp_path, "--shape", "300x520x72", "--bias", "--activation", "gelu",
                      "--residual", "--config", "64,128,32,8,4,2")
    assert 0 < kernel["shared"] <= 232448, kernel
    assert kernel["registers"] > 0 and kernel["local"] >= 0, kernel
    for ext in ("ttgir", "ptx", "cubin", "sass"):
        assert pathlib.Path(f"{kernel['files']}.{ext}").stat().st_size > 0, ext
    # planned as on an H100: the residual read and C written by TMA (what makes this the heavy epilogue's path)
    ttgir = pathlib.Path(f"{kernel['files']}.ttgir").read_text()
    assert "async_tma_copy_local_to_global" in ttgir and ttgir.count("async_tma_copy_global_to_local") >= 3


@pytest.mark.parametrize("async_input", [False, True], ids=["plain", "async-input"])
def test_compile_sm90_gluon_kernel(compile_in_child, tmp_path, async_input):
    """The Gluon kernel tk.gemm runs for Hopper's large tile (``gemm/_gluon.py``; Gluon does not run under the
    interpreter, so this is its CPU lane): bias + gelu + residual, B column-major, compiled for sm_90, and its
    async-input form. It fits an H100's shared memory, does not spill, and issues m64n256 wgmma; the async form
    polls its signals with system-scope atomics (two per wait: the first poll and the last) and sleeps between
    polls."""
    kernel = _compile(compile_in_child, tmp_path, "--gluon", "--shape", "300x520x72", "--layout", "RC", "--bias",
                      "--activation", "gelu", "--residual", *(["--async-input"] if async_input else []))
    assert 0 < kernel["shared"] <= 232448 and kernel["local"] == 0, kernel
    sass = pathlib.Path(f"{kernel['files']}.sass").read_text()
    assert "HGMMA.64x256x16" in sass
    assert sass.count("ATOMG.E.ADD.STRONG.SYS") == (2 if async_input else 0)
    assert ("NANOSLEEP" in sass) == async_input
