#!/usr/bin/env bash
# GPU lane for the device machine: info, GPU tests, check, bench (and, when asked, the config sweep).
#
#   scripts/gpu_lane.sh                      # info tests check bench
#   scripts/gpu_lane.sh tests check          # only these steps, in this order
#   scripts/gpu_lane.sh sweep                # launch-config sweep (SWEEP_SHAPES, SWEEP_BUDGET_S, SWEEP_ARGS)
#   NPROC=4 scripts/gpu_lane.sh multigpu bench-dist  # tk.dist: tests on every visible GPU, then the torchrun benches on NPROC
#   BENCH_ARGS="--shapes 8192x8192x8192" scripts/gpu_lane.sh bench
#   TEST_PATHS=tests/attention CHECK_ARGS="--op flash_attn" scripts/gpu_lane.sh tests check bench-attn
#   NORM_OPS="layer_norm rms_norm" NORM_BENCH_ARGS="--quant-dtype int8,fp8e4m3" scripts/gpu_lane.sh bench-norm
#
# Steps: info, tests (pytest -m gpu), check (python -m tilekernels check), bench (gemm, --out $OUT),
# bench-attn (flash_attn, --out $OUT), bench-paged (batch_prefill then batch_decode, --out $OUT),
# bench-norm (each of NORM_OPS, default the six norm/quant ops of issue 7, then their rows merged into
# $OUT/norm.json and their tables into $OUT/norm.txt), sweep (gemm --sweep, --out $OUT). Every step runs
# even after another failed; the exit status is non-zero if any did. Only a few files come back from the
# device machine (8 at most), so everything goes to ${OUT:-/tmp/out} as at most six: lane.log (every
# step's output), gemm.{json,txt,png} from bench and gemm-sweep.{json,txt} from sweep (bench-norm: the
# two merged files; its plots are dropped), and clocks.csv (the card's clocks, power and throttle reasons
# every 250 ms; CLOCKS=0 turns it off). Import the JSON here afterwards with
#   python -m tilekernels bench --update-results <files_at>/gemm.json <files_at>/gemm-graph.json ...
# (a --cuda-graph run writes gemm-graph.*, a sweep gemm-sweep.*; norm.json holds rows of several ops,
# each filed under its own op).
set -o pipefail

# NVLink multicast stays off on these machines (see DESIGN.md); source tree on the path, no buffering
# so a step killed by a time limit still leaves its output in the log.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" || exit 2
LOG="$OUT/lane.log"
PY=${PYTHON:-python3}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(info tests check bench)

# SM and memory clocks, power, temperature and throttle reasons every 250 ms for the whole lane, in
# $OUT/clocks.csv: a slow spell in the timings can then be matched with what the card was doing.
monitor=
if command -v nvidia-smi >/dev/null && [ "${CLOCKS:-1}" = 1 ]; then
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory,clocks_throttle_reasons.active \
        --format=csv,nounits -lms 250 >"$OUT/clocks.csv" 2>/dev/null &
    monitor=$!
fi

failed=()
warned=()

run_step() {
    local name=$1
    shift
    local start=$SECONDS
    echo "=== [$name] $* ($(date -u +%Y-%m-%dT%H:%M:%SZ))" | tee -a "$LOG"
    "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== [$name] exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
    if [ "$name" = tests ] && [ "$rc" -eq 5 ]; then
        warned+=("tests: pytest selected no tests (exit 5)")
    elif [ "$rc" -ne 0 ]; then
        failed+=("$name (exit $rc)")
    fi
}

# The rows and tables of the runs in folder $1 (one <op>.json and <op>.txt each) as $OUT/$2.json and
# $OUT/$2.txt, oldest run first; the folder goes once they are merged.
merge_runs() {
    "$PY" - "$1" "$OUT/$2" <<'EOF' && rm -rf "$1"
import json, pathlib, sys
folder, stem = pathlib.Path(sys.argv[1]), sys.argv[2]
runs = sorted(folder.glob("*.json"), key=lambda f: f.stat().st_mtime)
rows = [row for f in runs for row in json.loads(f.read_text())]
pathlib.Path(stem + ".json").write_text(json.dumps(rows, indent=1) + "\n")
pathlib.Path(stem + ".txt").write_text("\n\n".join(f.with_suffix(".txt").read_text() for f in runs))
print(f"merged {len(rows)} rows of {len(runs)} runs into {stem}.json and {stem}.txt")
EOF
}

for step in "${steps[@]}"; do
    case $step in
        info)
            run_step info "$PY" -m tilekernels info
            if command -v nvidia-smi >/dev/null; then
                # Clocks, power and temperature explain run-to-run noise in the timings.
                run_step nvidia-smi nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,memory.used --format=csv
            fi
            ;;
        tests)
            # shellcheck disable=SC2086  # TEST_PATHS is a list of paths
            run_step tests "$PY" -m pytest -m gpu ${TEST_PATHS:-tests} -q --maxfail=10 --durations=10 -p no:cacheprovider
            ;;
        check)
            # shellcheck disable=SC2086  # CHECK_ARGS is a list of options
            run_step check "$PY" -m tilekernels check $CHECK_ARGS
            ;;
        multigpu)
            run_step multigpu "$PY" -m pytest -m multigpu tests/dist -q --maxfail=10 --durations=10 -p no:cacheprovider
            ;;
        bench-dist)
            # shellcheck disable=SC2086  # DIST_BENCH_ARGS is a list of options
            run_step bench-ag "$PY" -m torch.distributed.run --nproc-per-node "${NPROC:-2}" -m tilekernels bench \
                all_gather_matmul --out "$OUT" $DIST_BENCH_ARGS
            # shellcheck disable=SC2086
            run_step bench-rs "$PY" -m torch.distributed.run --nproc-per-node "${NPROC:-2}" -m tilekernels bench \
                matmul_reduce_scatter --out "$OUT" $DIST_BENCH_ARGS
            ;;
        bench)
            # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
            run_step bench "$PY" -m tilekernels bench gemm --out "$OUT" $BENCH_ARGS
            ;;
        bench-attn)
            # shellcheck disable=SC2086  # ATTN_BENCH_ARGS is a list of options
            run_step bench-attn "$PY" -m tilekernels bench flash_attn --out "$OUT" $ATTN_BENCH_ARGS
            ;;
        bench-paged)
            # shellcheck disable=SC2086  # PAGED_BENCH_ARGS is a list of options
            run_step bench-prefill "$PY" -m tilekernels bench batch_prefill --out "$OUT" $PAGED_BENCH_ARGS
            # shellcheck disable=SC2086
            run_step bench-decode "$PY" -m tilekernels bench batch_decode --out "$OUT" $PAGED_BENCH_ARGS
            ;;
        bench-norm)
            # One bench per op into $OUT/norm, merged below: six ops' json/txt/png would be more files
            # than come back. NORM_BENCH_ARGS is a list of options, NORM_OPS a list of ops.
            for op in ${NORM_OPS:-layer_norm rms_norm add_rms_norm_quant dynamic_quant smooth_quant moe_smooth_quant}; do
                # shellcheck disable=SC2086
                run_step "bench-$op" "$PY" -m tilekernels bench "$op" --out "$OUT/norm" $NORM_BENCH_ARGS
            done
            run_step bench-norm-merge merge_runs "$OUT/norm" norm
            ;;
        sweep)
            # shellcheck disable=SC2086
            run_step sweep "$PY" -m tilekernels bench gemm --sweep --out "$OUT" \
                ${SWEEP_SHAPES:+--shapes "$SWEEP_SHAPES"} --budget-s "${SWEEP_BUDGET_S:-420}" $SWEEP_ARGS
            ;;
        *)
            echo "=== unknown step '$step' (steps: info tests check bench bench-attn bench-paged bench-norm sweep multigpu bench-dist)" | tee -a "$LOG"
            failed+=("$step (unknown step)")
            ;;
    esac
done

[ -n "$monitor" ] && kill "$monitor" 2>/dev/null
{
    echo "=== lane summary: steps ${steps[*]}"
    for w in "${warned[@]}"; do echo "    warning: $w"; done
    if [ ${#failed[@]} -eq 0 ]; then
        echo "    all steps passed"
    else
        for f in "${failed[@]}"; do echo "    FAILED: $f"; done
    fi
    echo "    files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
} | tee -a "$LOG"
[ ${#failed[@]} -eq 0 ]
