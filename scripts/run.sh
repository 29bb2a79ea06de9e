#!/usr/bin/env bash
# One entry point that sets everything up on a fresh machine, then runs the job:
#   bash scripts/run.sh check   # python -m tilekernels check: every op against its reference
#   bash scripts/run.sh test    # the test suite: the CPU interpreter lane, or with a GPU the GPU lane
#   bash scripts/run.sh bench gemm ...   # anything else is passed to python -m tilekernels
# Set-up (once, then skipped): a virtual environment in .venv, torch, triton and this package.
# Without a GPU, torch is the CPU build pinned in TORCH_SPEC (default torch==2.13.0) and kernels run
# under Triton's interpreter; with one, a torch already installed system-wide is reused, else
# PyPI's CUDA build is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${TK_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}

have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

setup() {
  local stamp="$VENV/.tilekernels-setup-$(cksum pyproject.toml | cut -d' ' -f1)"
  [ -f "$stamp" ] && return 0
  if [ ! -x "$VENV/bin/python" ]; then
    local flags=()
    # Reuse a system torch+triton (a GPU image ships them; re-downloading CUDA wheels takes GBs).
    if "$PY" -c "import torch, triton" >/dev/null 2>&1; then flags+=(--system-site-packages); fi
    "$PY" -m venv "${flags[@]}" "$VENV"
  fi
  local vpy="$VENV/bin/python"
  "$vpy" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$vpy" -c "import torch" >/dev/null 2>&1; then
    if have_gpu; then
      "$vpy" -m pip install -q "${TORCH_SPEC:-torch}"
    else
      "$vpy" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
    fi
  fi
  if ! "$vpy" -c "import triton" >/dev/null 2>&1; then
    "$vpy" -m pip install -q "${TRITON_SPEC:-triton}"
  fi
  "$vpy" -m pip install -q -e ".[dev]"
  touch "$stamp"
}

setup 2>&1 | grep -v "^WARNING: Location" || true
[ -x "$VENV/bin/python" ] || { echo "set-up failed: no $VENV/bin/python" >&2; exit 1; }
VPY="$VENV/bin/python"
"$VPY" -c "import tilekernels" || { echo "set-up failed: tilekernels does not import" >&2; exit 1; }

if ! have_gpu; then
  export TRITON_INTERPRET=1
fi

cmd=${1:-check}
[ $# -gt 0 ] && shift
case "$cmd" in
  test)
    if have_gpu; then
      # The GPU lane: the tests marked gpu (multigpu ones: -m multigpu, with two GPUs). The unmarked
      # tests are the interpreter lane that CI runs on a CPU machine: written for it (ranks simulated in
      # lockstep, CPU tensors, waits of a few polls), they hang or fail on a GPU, and the interpreter of
      # the triton that torch pins on a GPU box (3.6 on the device image) lacks what they use.
      exec "$VPY" -m pytest -q tests -m "gpu and not multigpu" "$@"
    else
      # The interpreter runs each test on one core: spread the tests over the cores (pytest-xdist), at most
      # four workers (each holds its own torch), TK_TEST_WORKERS to choose (1: one process).
      workers=${TK_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 1); echo $(( n < 4 ? n : 4 )))}
      par=()
      if [ "$workers" -gt 1 ] && "$VPY" -c "import xdist" >/dev/null 2>&1; then par=(-n "$workers"); fi
      exec "$VPY" -m pytest -q tests -m "not gpu and not multigpu and not slow" "${par[@]}" "$@"
    fi
    ;;
  *)
    exec "$VPY" -m tilekernels "$cmd" "$@"
    ;;
esac
