"""Test-suite set-up shared by every tilekernels test.

- Without a CUDA GPU, kernels run on CPU tensors under Triton's interpreter, which triton reads when
  it is imported: so ``TRITON_INTERPRET=1`` is set here, before any test module imports triton
  (``import torch`` alone does not import triton; this is checked, not assumed).
- ``device`` fixture: ``cuda`` when kernels run on the GPU, else ``cpu`` (interpreter).
- Markers: ``gpu`` and ``multigpu`` tests are skipped without CUDA (multigpu also without two GPUs);
  ``slow`` tests are skipped in the CPU lane unless selected with ``-m`` (pyproject's contract). On a GPU
  (no ``TRITON_INTERPRET=1``) the unmarked tests are skipped: they are the interpreter lane, written for
  its lockstep (simulated ranks, waits of a few polls) and CPU tensors, and on the H100 image some hung
  and others failed (benchmarks/NOTES.md, thirty-fourth session).
- Every test starts from a seed derived from its node id, so it is reproducible alone or in a run.
- ``poison_allocations`` fixture: every uninitialised tensor torch allocates comes NaN-filled, for ops
  that allocate their own outputs (no ``out=`` to poison).
- ``compile_in_child`` fixture: runs a test file as a script in a child process that compiles kernels for
  sm_90 (no ``TRITON_INTERPRET``, an empty triton cache) and returns the JSON it prints.
"""

from __future__ import annotations

import os
import pathlib
import random
import sys
import zlib

import numpy
import pytest

_SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
if _SRC.is_dir() and str(_SRC) not in sys.path:
    # The test command runs from a plain checkout; PYTHONPATH=src is not required.
    sys.path.insert(0, str(_SRC))

import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    if "triton" in sys.modules:
        raise pytest.UsageError(
            "triton was imported before tests/conftest.py could set TRITON_INTERPRET=1; run the CPU lane "
            "as `TRITON_INTERPRET=1 python -m pytest ...`"
        )
    os.environ["TRITON_INTERPRET"] = "1"

# A GPU machine may still run the interpreter lane when asked to with TRITON_INTERPRET=1.
ON_GPU = HAS_CUDA and os.environ.get("TRITON_INTERPRET", "0") != "1"


def pytest_collection_modifyitems(config, items):
    marker_expr = config.getoption("-m", default="") or ""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (kernels run on the CPU interpreter here)")
    skip_multigpu = pytest.mark.skip(reason="needs at least two CUDA GPUs")
    skip_slow = pytest.mark.skip(reason="slow: skipped in the CPU lane unless selected with -m slow")
    skip_interpreter = pytest.mark.skip(reason="interpreter lane (CI, on a CPU machine): written for the interpreter's "
                                        "lockstep and CPU tensors, it hangs or fails on a GPU")
    for item in items:
        if ON_GPU and not (item.get_closest_marker("gpu") or item.get_closest_marker("multigpu")):
            item.add_marker(skip_interpreter)
        if item.get_closest_marker("gpu") and not ON_GPU:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("multigpu") and not (ON_GPU and torch.cuda.device_count() >= 2):
            item.add_marker(skip_multigpu)
        if item.get_closest_marker("slow") and not ON_GPU and "slow" not in marker_expr:
            item.add_marker(skip_slow)


@pytest.fixture
def device() -> torch.device:
    """Where test tensors live: the current CUDA device, or the CPU under the interpreter."""
    if ON_GPU:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch.manual_seed(seed)
    numpy.random.seed(seed)


@pytest.fixture
def poison_allocations():
    """Every tensor torch allocates uninitialised (the ops' outputs) comes NaN-filled (integers: their
    maximum): torch's deterministic mode, warn-only so that no op is refused."""
    old_mode, old_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    old_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_mode, warn_only=old_warn)
        torch.utils.deterministic.fill_uninitialized_memory = old_fill


@pytest.fixture(scope="session")
def compile_in_child(tmp_path_factory):
    """``run(script) -> dict``: run ``script`` with this checkout's ``src`` on the path, without
    ``TRITON_INTERPRET`` (under the interpreter triton hands back interpreted functions, which cannot be
    compiled) and with an empty triton cache (its key does not cover every module global a kernel reads, so a
    cached binary could hide a kernel that no longer compiles); the dict is the JSON after ``RESULTS `` on the
    last such line it prints."""
    import json
    import subprocess

    def run(script) -> dict:
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
        src = pathlib.Path(__file__).resolve().parents[1] / "src"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1200)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
        assert proc.returncode == 0 and lines, (f"the compile process failed:\n{proc.stdout[-3000:]}\n"
                                                f"{proc.stderr[-3000:]}")
        return json.loads(lines[-1].removeprefix("RESULTS "))

    return run
