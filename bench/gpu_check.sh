#!/usr/bin/env bash
# Device checks for a lent CUDA machine, in one go (under 8 minutes):
#   1. the CUDA-only tests (python -m pytest -q tests -m cuda; the decode window's two files, whose
#      kernels take long to compile, run in the background beside the other stages, as does the compile
#      of the decode loop's kernels: on otherwise idle CPU cores, with little GPU work),
#   2. `gpupool replay --pool both` on the whole bundled trace (the device replay loop and the
#      reference must agree; the device's wall time is the whole-trace benchmark),
#   3. the modelled cases of bench/model_cases.py MEASURED with CUDA events (decode step as DecodeStep
#      (a window of one step), K = 8 steps of DecodeStep(steps=8), reserve, at B = 64 and
#      1,024, allocate / free / touch of 4,096 blocks, 10,000 lookups; eager and as CUDA-graph replays;
#      the replay loop on the first 1,000 requests, wall clock; the decode window's own cases, whose
#      variants take long to compile, only on request: --cases window_begin,window_step,window_end,admit),
#   4. the decode loop of a small model (bench/decode_loop_gpu.py at B = 64, 256, 1,024: host, window
#      with K = 1, 2, 4, 8 and spec with D = 1, 2, 4 at K = 4; each window's pool steps and the model's K
#      forward passes captured as one CUDA graph; tests/gpu/test_window_graph.py, in the background,
#      checks such a graph's tokens against an eager run),
#   5. the benchmarks (`gpupool bench`: pytest-benchmark JSON + PNG),
#   6. short tables (measured cases; decode loop; op, pool, N, batch, median us, GPU us), printed last.
# Run from anywhere: bash bench/gpu_check.sh. Without a CUDA device it says so in one line and exits 2;
# GPU_CHECK_ALLOW_CPU=1 bash bench/gpu_check.sh is then its dry run on the CPU (the CUDA-only stage 1
# is skipped with a message and the others run in Triton's interpreter, up to 8 minutes).
# GPU_CHECK_TINY=1 shrinks every stage to seconds (tests/project/test_documented_commands.py runs it so on CPU).
# Output goes to $OUT if set, else bench/out.
# Each stage has a timeout taken from one overall deadline; a failed stage is reported and the
# next one still runs. Exit status: 0 when every stage passed, 1 when one failed, 2 without CUDA (and
# without GPU_CHECK_ALLOW_CPU=1).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-bench/out}"
mkdir -p "$OUTDIR"
START=$(date +%s)
DEADLINE=$((START + ${GPU_CHECK_BUDGET_S:-465}))
FAILED=()
PY=python3

log() { echo "== [$(( $(date +%s) - START ))s] $*"; }

# stage NAME MAX_SECONDS RESERVE_SECONDS CMD...: run CMD with a timeout of min(MAX, time left - RESERVE),
# its full output in $OUTDIR/NAME.log, the last 12 lines on the console.
stage() {
  local name=$1 max=$2 reserve=$3
  shift 3
  local left=$(( DEADLINE - $(date +%s) - reserve ))
  local limit=$(( max < left ? max : left ))
  if (( limit < 10 )); then
    log "$name: SKIPPED (no time left)"; FAILED+=("$name(skipped)"); return 0
  fi
  log "$name: $* (timeout ${limit}s)"
  # SIGINT first: pytest stops and still writes its benchmark JSON; KILL 20 s later.
  timeout -s INT -k 20 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$OUTDIR/$name.log"
  if (( rc == 0 )); then log "$name: ok"; else log "$name: FAILED (exit $rc; 124 = timed out)"; FAILED+=("$name"); fi
}

# background NAME MAX_SECONDS CMD...: run CMD beside the stages (its output in $OUTDIR/NAME.log), with a
# timeout of min(MAX, time left); finish NAME waits for it and reports it as a stage.
declare -A BG_PID=()
background() {
  local name=$1 max=$2
  shift 2
  local left=$(( DEADLINE - $(date +%s) ))
  local limit=$(( max < left ? max : left ))
  log "$name: in the background: $* (timeout ${limit}s)"
  timeout -s INT -k 20 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1 &
  BG_PID[$name]=$!
}
finish() {
  local name=$1
  [[ -n "${BG_PID[$name]:-}" ]] || return 0
  wait "${BG_PID[$name]}"
  local rc=$?
  unset "BG_PID[$name]"
  tail -n 12 "$OUTDIR/$name.log"
  if (( rc == 0 )); then log "$name: ok"; else log "$name: FAILED (exit $rc; 124 = timed out)"; FAILED+=("$name"); fi
}


# 0: torch sees a CUDA device; 1: it sees none; 3: torch or triton is missing (one import of torch, seconds)
cuda_status() {
  $PY -c 'import sys
try:
    import torch, triton
except ImportError:
    sys.exit(3)
sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}
cuda_status; CUDA_STATUS=$?
if (( CUDA_STATUS == 3 )); then
  log "torch/triton missing: pip install -e '.[test]'"
  timeout 240 $PY -m pip install -q -e '.[test]' 2>&1 | tail -n 5
  cuda_status; CUDA_STATUS=$?
  if (( CUDA_STATUS == 3 )); then echo "gpu_check.sh: torch or triton cannot be imported after the install" >&2; exit 1; fi
fi
CUDA=1
if (( CUDA_STATUS != 0 )); then
  if [[ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]]; then  # one line, before any other output
    echo "gpu_check.sh: no CUDA device (torch sees none), and these are GPU checks; for their dry run on the CPU" \
      "(Triton's interpreter, up to 8 minutes) run: GPU_CHECK_ALLOW_CPU=1 bash bench/gpu_check.sh" >&2
    exit 2
  fi
  CUDA=0
fi
log "environment"
if ! $PY -c 'import gpupool.kernels' 2>/dev/null; then  # the package itself (src/ layout)
  timeout 120 $PY -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -n 5 \
    || timeout 120 $PY -m pip install -q -e . 2>&1 | tail -n 5
fi
if ! $PY -c 'import pytest, pytest_benchmark, hypothesis, matplotlib' 2>/dev/null; then
  timeout 120 $PY -m pip install -q pytest pytest-benchmark hypothesis matplotlib 2>&1 | tail -n 5
fi
{
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  else
    echo "nvidia-smi: not installed"
  fi
  $PY -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")' 2>&1
  nproc; date -u +%Y-%m-%dT%H:%M:%SZ
} | tee "$OUTDIR/env.txt"
if (( ! CUDA )); then
  log "no CUDA device; GPU_CHECK_ALLOW_CPU=1: dry run on the CPU (Triton interpreter, quick grid)"
fi
# Sizes: the full check, or (GPU_CHECK_TINY=1) a few seconds a stage, to check the script itself.
# the decode window's cases (window_*, admit) compile a kernel per variant that takes long: measured on request
MEASURE_ARGS=(--reps 50 --sizes 64,1024 --cases decode_step,decode_multi,reserve,alloc,free_4096,lookup_10000,touch_4096,replay,vllm_flush,vllm_per_call)
REPLAY_ARGS=()
BENCH_ARGS=()
DECODE_ARGS=(--iters 5 --compile-jobs 8)  # the window's pool step compiles once per K and D: 8 processes at once
if (( ! CUDA )) || [[ "${GPU_CHECK_TINY:-0}" == 1 ]]; then  # the interpreter: a smoke run of the same code
  DECODE_ARGS=(--batch 2 --modes host spec --draft 1 --spec-steps 2 --iters 1 --warmup 1 --hidden 64 --layers 1
               --dtype float32)  # spec runs the window's code too
  (( CUDA )) || DECODE_ARGS+=(--device cpu --no-graph)
fi
if [[ "${GPU_CHECK_TINY:-0}" == 1 ]]; then
  MEASURE_ARGS=(--reps 2 --sizes 64 --cases alloc_64x64 --num-blocks 8192)
  REPLAY_ARGS=(--limit 20 --device-limit 5)
  BENCH_ARGS=(--quick -k "alloc_free-reference-N4096-B64 or alloc_free-device-eager-N4096-B64")
  export GPUPOOL_BENCH_MAX_TIME=${GPUPOOL_BENCH_MAX_TIME:-0.005}
fi

# The decode window's pool step takes long to compile (once per K and D, and per pool configuration):
# its tests and the decode loop's kernels compile beside the stages before them, on the idle cores.
WINDOW_TESTS=(tests/gpu/test_window_graph.py tests/gpu/test_decode_loop_cuda.py)
if (( CUDA )); then
  background decode_compile 330 $PY bench/decode_loop_gpu.py "${DECODE_ARGS[@]}" --compile-only --compile-jobs 8
  background window_tests 330 $PY -m pytest -q -p no:cacheprovider "${WINDOW_TESTS[@]}" -m cuda
  stage cuda_tests 100 350 $PY -m pytest -q -p no:cacheprovider tests -m cuda "${WINDOW_TESTS[@]/#/--ignore=}"
else
  log "cuda_tests: SKIPPED (no CUDA device: the tests marked cuda need one; not counted as a failure)"
fi
stage measured 120 230 $PY bench/model_cases.py --measure "${MEASURE_ARGS[@]}" --json "$OUTDIR/measured.json"
stage replay 100 220 $PY -m gpupool replay --pool both "${REPLAY_ARGS[@]}" --json "$OUTDIR/replay.json"
finish decode_compile
stage decode_loop 180 70 $PY bench/decode_loop_gpu.py "${DECODE_ARGS[@]}" --json "$OUTDIR/decode_loop.json"
export GPUPOOL_BENCH_MAX_TIME=${GPUPOOL_BENCH_MAX_TIME:-0.05}
stage bench 200 5 $PY -m gpupool bench "${BENCH_ARGS[@]}" --out "$OUTDIR/bench"
finish window_tests

echo
log "stages failed: ${FAILED[*]:-none}"
if [[ -f "$OUTDIR/replay.json" ]]; then
  $PY - "$OUTDIR/replay.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
if r.get("device") and r.get("reference"):
    print(f"replay: match={r['match']} device {r['device']['wall_s']:.3f} s ({r['device']['requests_per_s']:,.0f} req/s), "
          f"reference {r['reference']['wall_s']:.3f} s ({r['reference']['requests_per_s']:,.0f} req/s), hit blocks {r['device']['hit_blocks']} "
          f"vs {r['reference']['hit_blocks']}")
PYEOF
fi
if [[ -f "$OUTDIR/measured.log" ]]; then
  grep '^|' "$OUTDIR/measured.log" || true  # the measured cases (compare with bench/RESULTS.md's modelled ones)
fi
if [[ -f "$OUTDIR/decode_loop.json" ]]; then  # the decode loop (tokens per second, time per window and step)
  $PY bench/decode_loop_gpu.py --table "$OUTDIR/decode_loop.json" || true
fi
if [[ -f "$OUTDIR/bench.json" ]]; then
  $PY bench/plot.py "$OUTDIR/bench.json" --table
else
  echo "no benchmark results ($OUTDIR/bench.json missing)"
fi
(( ${#FAILED[@]} == 0 ))
