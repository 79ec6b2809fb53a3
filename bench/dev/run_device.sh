#!/usr/bin/env bash
# One-call device run: GPU tests, correctness sweep, benchmark (and optional sanitizers).
#
#   bash bench/dev/run_device.sh            # from the repository root; $OUT collects the results
#
# Environment knobs:
#   OUT=dir          where logs/results go (default bench/out/device; the device tool sets $OUT)
#   QUICK=1          check --quick and fewer seqlens in the benchmark
#   SKIP_TESTS=1 SKIP_CHECK=1 SKIP_BENCH=1    skip a step
#   TUNE=1           also time every forward tile candidate (bench/dev/tune_fwd.py) -> tune.log
#   TUNE_BWD=1       also time every backward tile candidate (bench/dev/tune_bwd.py) -> tune_bwd.log
#   DECODE=1         also run `cli.py bench --mode decode` (KV bandwidth vs SDPA flash/cuDNN) -> bench_decode.log
#   TUNE_DEC=1       also time every decode candidate (bench/dev/tune_decode.py) -> tune_decode.log
#   PROFILE=1        also profile host dispatch (bench/dev/dispatch_profile.py) -> profile.log
#   SUSTAIN=S        also the bench (and with BWD=1 the backward's) again with --sustain S: each implementation
#                    timed at its own steady clock -> bench_sustain.log
#   WINDOW=1         also the window bar alone: bench/window_speed.py --rounds 3 -> window.log
#   MASKS=1          also the mask speed bars: bench/window_speed.py --candidates ((4096, 0) window over 64k vs
#                    full causal, and the window tile candidates)
#                    and bench/varlen_speed.py --causal --paged 16,256 (varlen vs padded, paged vs packed)
#                    -> masks.log
#   SANITIZE=1       also run compute-sanitizer memcheck + racecheck over bench/dev/sanitize_case.py
#                    (SANITIZE_GROUPS="fwd bwd decode" picks its case groups)
#   BENCH_ARGS="..." extra arguments for `cli.py bench` (e.g. "--headdim 128 --causal off")
#   BWD=1            also run `cli.py bench --mode bwd` (fa2cupy backward vs SDPA flash/cuDNN
#                    backward, peak memory) -> bench_bwd.log; seqlens 2048,8192 with QUICK=1
#                    (else BWD_SEQLENS, default 1024,2048,4096,8192,16384); BWD_ARGS="..." extra
#                    arguments (e.g. "--deterministic" or "--mode fwdbwd").  Its JSON/PNG go to
#                    bench/out/device-bwd (not returned) unless BWD_FILES=1 puts them in $OUT.
#   TESTS_TIMEOUT / CHECK_TIMEOUT / BENCH_TIMEOUT / BWD_TIMEOUT / SANITIZE_TIMEOUT   seconds per
#       step (defaults 300/180/200/180/240; with BWD=1 or SANITIZE=1 use QUICK=1 or skip something else)
#   The GPU tests and every timing in one call (about 6 minutes on an H200):
#       QUICK=1 SKIP_CHECK=1 BWD=1 SUSTAIN=1 WINDOW=1 BENCH_ARGS=--no-plot bash bench/dev/run_device.sh
#
# The tests step runs every `-m gpu` test under tests/ in nine pytest processes side by side
# (bench/dev/gpu_tests.sh, ~3.5 min on an H100); `check` verifies the backward too.
#
# Files written to $OUT (the device tool returns at most 8): env.txt (nvidia-smi, versions,
# then one status line per step), tests.log, check.log, bench.log, fwd_<gpu>_<date>.json/.png,
# sanitize.log, bench_bwd.log (BWD=1; + bwd_<gpu>_<date>.json/.png with BWD_FILES=1: then
# skip a step or set SANITIZE=0 to stay within 8).
set -u -o pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-bench/out/device}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
START=$(date +%s)
# The harness behind `cli.py bench` is the package fa2cupy_bench, bench/ under the name pyproject.toml's package-dir
# gives it when installed; without an install, a link in a scratch folder on PYTHONPATH gives it that name.
if ! "$PY" -c 'import fa2cupy_bench' 2>/dev/null; then
  BENCH_LINK=$(mktemp -d)
  ln -s "$PWD/bench" "$BENCH_LINK/fa2cupy_bench"
  export PYTHONPATH="$PYTHONPATH:$BENCH_LINK"
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo n/a)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>&1 || echo "nvidia-smi failed"
  "$PY" - <<'PY' 2>&1
import platform
parts = [f"python {platform.python_version()}"]
for mod in ("cupy", "torch", "jax", "numpy", "matplotlib", "ml_dtypes"):
    try:
        parts.append(f"{mod} {__import__(mod).__version__}")
    except Exception as exc:
        parts.append(f"{mod} missing ({type(exc).__name__})")
try:
    import cupy
    rt = cupy.cuda.runtime
    parts.append(f"cuda runtime {rt.runtimeGetVersion()} driver {rt.driverGetVersion()} nvrtc {cupy.cuda.nvrtc.getVersion()}")
except Exception as exc:
    parts.append(f"cuda versions unavailable ({exc})")
print(", ".join(parts))
PY
} > "$OUT/env.txt"
cat "$OUT/env.txt"

FAILED=0
step() {  # step NAME TIMEOUT LOG CMD...  -- run CMD with a timeout, tee to LOG, record status
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$(date +%s) rc
  echo "=== $name (timeout ${limit}s): $*"
  timeout -k 15 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "=== $name TIMED OUT after ${limit}s" | tee -a "$log"
  echo "$name: rc=$rc $(( $(date +%s) - t0 ))s" >> "$OUT/env.txt"
  [ "$rc" = 0 ] || FAILED=1
  return 0
}

if [ "${QUICK:-0}" = 1 ]; then
  CHECK_FLAGS="--quick"; SEQLENS="512,2048,8192"
else
  CHECK_FLAGS=""; SEQLENS="512,1024,2048,4096,8192,16384"
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  PYTHON="$PY" LIMIT=$(( ${TESTS_TIMEOUT:-300} - 20 )) step tests "${TESTS_TIMEOUT:-300}" "$OUT/tests.log" \
    bash bench/dev/gpu_tests.sh
fi

if [ "${SKIP_CHECK:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  step check "${CHECK_TIMEOUT:-180}" "$OUT/check.log" "$PY" cli.py check $CHECK_FLAGS
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  step bench "${BENCH_TIMEOUT:-200}" "$OUT/bench.log" \
    "$PY" cli.py bench --mode fwd --headdim 64,128 --causal both --seqlens "$SEQLENS" --dtype bf16 \
    --out "$OUT" ${BENCH_ARGS:-}
fi

if [ "${BWD:-0}" = 1 ]; then  # backward vs SDPA's backward (flash, cuDNN), with peak memory
  if [ "${QUICK:-0}" = 1 ]; then BWD_SL="2048,8192"; else BWD_SL="${BWD_SEQLENS:-1024,2048,4096,8192,16384}"; fi
  if [ "${BWD_FILES:-0}" = 1 ]; then BWD_OUT="$OUT"; else BWD_OUT="bench/out/device-bwd"; fi
  # shellcheck disable=SC2086
  step bench_bwd "${BWD_TIMEOUT:-180}" "$OUT/bench_bwd.log" \
    "$PY" cli.py bench --mode bwd --headdim 64,128 --causal both --seqlens "$BWD_SL" --dtype bf16 \
    --skip-cold --skip-overhead --out "$BWD_OUT" ${BWD_ARGS:-}
fi

if [ -n "${SUSTAIN:-}" ]; then  # the same timings, each implementation at its own steady clock
  # shellcheck disable=SC2086
  step bench_sustain "${BENCH_TIMEOUT:-200}" "$OUT/bench_sustain.log" \
    "$PY" cli.py bench --mode fwd --headdim 64,128 --causal both --seqlens "$SEQLENS" --dtype bf16 \
    --sustain "$SUSTAIN" --skip-cold --skip-overhead --no-plot --out bench/out/device-sustain ${BENCH_ARGS:-}
  if [ "${BWD:-0}" = 1 ]; then
    # shellcheck disable=SC2086
    step bench_bwd_sustain "${BWD_TIMEOUT:-180}" "$OUT/bench_bwd_sustain.log" \
      "$PY" cli.py bench --mode bwd --headdim 64,128 --causal both --seqlens "$BWD_SL" --dtype bf16 \
      --sustain "$SUSTAIN" --skip-cold --skip-overhead --no-memory --no-plot --out bench/out/device-sustain \
      ${BWD_ARGS:-}
  fi
fi

if [ "${WINDOW:-0}" = 1 ]; then  # the window bar: (4096, 0) over 64k against causal, steady clocks
  step window "${WINDOW_TIMEOUT:-90}" "$OUT/window.log" "$PY" bench/window_speed.py --rounds 3
fi

if [ "${DECODE:-0}" = 1 ]; then  # decode KV bandwidth vs SDPA flash / cuDNN (the decode grid)
  step bench_decode "${DECODE_TIMEOUT:-240}" "$OUT/bench_decode.log" \
    "$PY" cli.py bench --mode decode --out "$OUT" ${DECODE_ARGS:-}
fi

if [ "${TUNE_DEC:-0}" = 1 ]; then
  step tune_decode "${TUNE_TIMEOUT:-240}" "$OUT/tune_decode.log" "$PY" bench/dev/tune_decode.py ${TUNE_DEC_ARGS:-}
fi

if [ "${TUNE:-0}" = 1 ]; then  # every tile candidate of bench/dev/candidates.py beside SDPA
  step tune "${TUNE_TIMEOUT:-240}" "$OUT/tune.log" "$PY" bench/dev/tune_fwd.py --seqlens "${TUNE_SEQLENS:-2048,8192}" --headdims "${TUNE_HEADDIMS:-64,128}"
fi

if [ "${TUNE_BWD:-0}" = 1 ]; then  # every backward tile candidate of bench/dev/candidates.py beside SDPA
  step tune_bwd "${TUNE_TIMEOUT:-240}" "$OUT/tune_bwd.log" "$PY" bench/dev/tune_bwd.py --seqlens "${TUNE_SEQLENS:-2048,8192}"
fi

if [ "${MASKS:-0}" = 1 ]; then  # the mask bars: window speed-up, varlen vs padded, paged vs packed
  step masks "${MASKS_TIMEOUT:-240}" "$OUT/masks.log" \
    bash -c "'$PY' bench/window_speed.py --candidates && '$PY' bench/varlen_speed.py --causal --paged 16,256"
fi

if [ "${PROFILE:-0}" = 1 ]; then  # host dispatch cost and where it goes
  step profile "${PROFILE_TIMEOUT:-120}" "$OUT/profile.log" "$PY" bench/dev/dispatch_profile.py
fi

if [ "${SANITIZE:-0}" = 1 ]; then
  if command -v compute-sanitizer >/dev/null 2>&1; then
    {
      for tool in memcheck racecheck; do
        echo "=== compute-sanitizer --tool $tool"
        timeout -k 15 "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 3 \
          --print-limit 20 "$PY" bench/dev/sanitize_case.py ${SANITIZE_GROUPS:-}
        echo "=== $tool rc=$?"
      done
    } 2>&1 | tee "$OUT/sanitize.log"
    grep -E "^=== (memcheck|racecheck) rc=" "$OUT/sanitize.log" | sed 's/^=== /sanitize /' >> "$OUT/env.txt"
    grep -qE "^=== (memcheck|racecheck) rc=[^0]" "$OUT/sanitize.log" && FAILED=1
  else
    echo "compute-sanitizer not found" | tee "$OUT/sanitize.log"
    echo "sanitize: compute-sanitizer not found" >> "$OUT/env.txt"
  fi
fi

echo "total: $(( $(date +%s) - START ))s" >> "$OUT/env.txt"
echo "=== summary"; cat "$OUT/env.txt"
exit $FAILED
