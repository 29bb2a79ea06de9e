#!/usr/bin/env bash
# WIP branch only: the first GPU run of gemm/_gluon.py, tests then the A/B probe, each under a time limit
# (a barrier mistake hangs rather than fails). Logs under ${OUT:-/tmp/out}.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout "${TEST_S:-240}" python3 -m pytest -q -x -m gpu tests/gemm/test_gluon_fused.py 2>&1 | tail -40 | tee "$OUT/wip-tests.log"
timeout "${PROBE_S:-240}" python3 scripts/probe_gluon_fused.py 2>&1 | grep -v -i warn | tee "$OUT/wip-probe.log"
timeout "${PLAIN_S:-200}" python3 scripts/probe_gluon_plain.py 2>&1 | grep -v -i warn | tee "$OUT/wip-plain.log"
