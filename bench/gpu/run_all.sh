#!/usr/bin/env bash
# Every GPU measure of bench/README.md's open items, in one run on a lent machine (one GPU, no
# network, python3 with jax + CUDA): `bash bench/gpu/run_all.sh` from the repository root, with
# .whl/ (bench/gpu/fetch_wheels.sh) beside it. Results go to $OUT (10 files at most):
#   run_all.log  this script's output (environment, every step's output)
#   servers.log  the `qmill serve` processes' and the flow's commands' output
#   steps.jsonl  one line per step: name, exit code (124: its timeout), seconds
#   parity.json  tests/engine/device_parity.py: qmill vs CPU fixtures vs reference, per case;
#                --require-equal: the step exits 1 (steps.jsonl "rc": 1) unless all 167 cases ran
#                and equal the CPU fixtures; its last line says PASS or FAIL (issue 37)
#   qt_golden.json  bench/gpu/qt_golden.py: issue 40's QT training steps on the device, qmill's
#                and the reference's gradients bit for bit, and against the CPU recording
#   parity-hlo.txt  bench/gpu/parity_detail.py: the optimized HLO of the cases that differed on
#                the H200 (its per-element account of each differing code goes to run_all.log)
#   engine.json  bench/engine_bench.py --size 8192 (baseline: a jitted copy, same run)
#   e2e.json     bench/e2e_bench.py, 12 x 64 MiB f32 -> int8, int4: a server on the GPU, then on
#                the CPU (JAX_PLATFORMS=cpu), one raw gRPC baseline
#   flow.json    bench/calibrated_flow_bench.py: issue 25's export-program -> calibrate --method
#                gptq -> quantize --calibration, GPU server then CPU server (MiniLM shapes,
#                RANDOM weights: the real ones cannot travel)
#   lm_gptq.json bench/gpu/lm_gptq.py: issue 34's `quantize --method gptq` of a SmolLM2-shaped
#                folder (RANDOM weights), in process and through a `qmill serve`, on the GPU
#                (30 layers) and on 2 pinned CPU cores (6 layers); codes compared on the
#                layers both ran, server bytes against in-process bytes
#   summary.json bench/gpu/summarize.py over the above
# Each step runs under its own `timeout` (which also stops its servers: timeout signals the whole
# process group), capped so that the script ends within QMILL_GPU_BUDGET_S (default 400) seconds.
# QMILL_GPU_DRY=1: the same steps, small, on this machine's CPU with .venv (a check before the
# device run, so that nothing fails there on a typo).
# QMILL_GPU_STEPS=parity,parity_detail (say): only the steps named (default: all), for a short
# device lease.
set -u
cd "$(dirname "$0")/../.." || exit 1
START=$(date +%s)
BUDGET=${QMILL_GPU_BUDGET_S:-400}
DRY=${QMILL_GPU_DRY:-0}
if [ "$DRY" = 1 ]; then
    OUT=${OUT:-$(mktemp -d /tmp/qmill-gpu-dry.XXXXXX)}
    export PY=${PY:-.venv/bin/python} JAX_PLATFORMS=cpu
    export QMILL_GPU_TMP=$OUT/tmp QMILL_WHEELS=${QMILL_WHEELS:-.whl/qwix-0.1.8-py3-none-any.whl}
    ENGINE=(--size 1024 --repeats 2)
    E2E=(--gib 0.047 --tensor-mib 4 --recipes int8,int4 --repeat 1)
    FLOW=(--examples 64 --repeat 1)
    LM=(--layers 2 --cpu-layers 1 --samples 4 --seq-len 64)
else
    OUT=${OUT:-/tmp/qmill-gpu-out}
    export PY=${PY:-python3}
    ENGINE=(--size 8192 --repeats 5)
    E2E=(--gib 0.75 --tensor-mib 64 --recipes int8,int4 --repeat 2)
    FLOW=(--examples 256 --repeat 2)
    LM=(--layers 30 --cpu-layers 6 --samples 64 --seq-len 512)
fi
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run_all.log") 2>&1

step() {  # step NAME SECONDS COMMAND...: runs COMMAND under timeout, records its exit code
    local name=$1 limit=$2 left t0 rc
    shift 2
    case ",${QMILL_GPU_STEPS:-$name}," in
    *",$name,"*) ;;
    *)
        echo "=== $name not in QMILL_GPU_STEPS=$QMILL_GPU_STEPS"
        return
        ;;
    esac
    left=$((BUDGET - ($(date +%s) - START) - 20))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 15 ]; then
        echo "=== $name skipped: ${left}s left of the ${BUDGET}s budget"
        echo "{\"step\": \"$name\", \"rc\": null, \"skipped\": true}" >>"$OUT/steps.jsonl"
        return
    fi
    echo "=== $name (timeout ${limit}s) $(date -u +%T)"
    t0=$(date +%s%N)
    timeout -k 5 "$limit" "$@"
    rc=$?
    local ms=$((($(date +%s%N) - t0) / 1000000))
    echo "=== $name: exit $rc after $((ms / 1000)).$((ms % 1000 / 100))s"
    echo "{\"step\": \"$name\", \"rc\": $rc, \"ms\": $ms, \"limit\": $limit}" >>"$OUT/steps.jsonl"
}

echo "=== environment $(date -u +%FT%TZ) dry=$DRY $(git rev-parse --short HEAD 2>/dev/null)"
uname -a
nproc
timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3
# shellcheck source=bench/gpu/setup.sh
source bench/gpu/setup.sh
timeout 60 "$PY" -c "
import grpc, google.protobuf, jax, numpy, flax
print('python', __import__('sys').version.split()[0], 'jax', jax.__version__, 'flax',
      flax.__version__, 'numpy', numpy.__version__, 'grpcio', grpc.__version__,
      'protobuf', google.protobuf.__version__)
print('devices', jax.devices())
import qmill.engine, qmill.server, qmill.cli, qmill.checkpoints, qmill.client, qwix
print('qmill from', qmill.engine.__file__)
"

step parity 95 "$PY" tests/engine/device_parity.py --max-seconds 80 --spread 7 --require-equal \
    --json "$OUT/parity.json"
step qt_golden 120 "$PY" bench/gpu/qt_golden.py --json "$OUT/qt_golden.json"
# The PTX of the cases that differed on 2026-11-27, to see which divisions the device runs:
# div.rn.f64 only (the float64 route held), or div.full.f32 (LLVM folded it back to float32).
XLA_DUMP=${QMILL_GPU_TMP:-/tmp}/xla-dump
rm -rf "$XLA_DUMP"
XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$XLA_DUMP" \
    step parity_detail 60 "$PY" bench/gpu/parity_detail.py --hlo "$OUT/parity-hlo.txt"
echo "=== divisions in the PTX of parity_detail's programs (none on a CPU):"
grep -rhoE "(div|rcp)\.[a-z.]*f(32|64)" --include='*.ptx' "$XLA_DUMP" 2>/dev/null | sort | uniq -c
echo "=== fdiv types in their optimized LLVM IR (double only: the float64 route held):"
grep -rhoE "fdiv (<[0-9]+ x )?(float|double)" --include='*ir-with-opt.ll' "$XLA_DUMP" 2>/dev/null |
    sort | uniq -c
step engine 90 "$PY" bench/engine_bench.py "${ENGINE[@]}" --json "$OUT/engine.json"
step e2e 120 "$PY" bench/e2e_bench.py "${E2E[@]}" --server-platforms default,cpu \
    --server-log "$OUT/servers.log" --json "$OUT/e2e.json"
step flow 150 "$PY" bench/calibrated_flow_bench.py --weights random "${FLOW[@]}" \
    --server-platforms default,cpu --log "$OUT/servers.log" --json "$OUT/flow.json"
step lm 420 "$PY" bench/gpu/lm_gptq.py "${LM[@]}" --log "$OUT/servers.log" \
    --json "$OUT/lm_gptq.json"
timeout 20 "$PY" bench/gpu/summarize.py "$OUT" >/dev/null
echo "=== done in $(($(date +%s) - START))s; results in $OUT:"
ls -la "$OUT"
cat "$OUT/summary.json" 2>/dev/null
sleep 1  # lets tee write the last lines into run_all.log
