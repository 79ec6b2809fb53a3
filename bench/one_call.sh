#!/usr/bin/env bash
# Everything an issue's closing note needs from one device call on one H100 (under the tool's 600 s):
# `fa2cupy bench` forward and backward in bursts and at steady clocks (--sustain 1), the window bar
# (bench/window_speed.py), then every `-m gpu` test file in four pytest processes at once.
#
#   bash bench/one_call.sh        # from the repository root; logs under $OUT (7 files)
#   SKIP_TIMING=1 TESTS_LIMIT=290 bash bench/one_call.sh    # the tests alone, each group within 290 s
#
# The timing runs first, on a quiet GPU. The tests share the GPU and the CPU: the float64 references are
# CPU work, so BLAS threads are capped, and JAX does not take the GPU's memory up front. The four groups
# took 155-204 s side by side on an H100 (session 44, SKIP_TIMING=1), the timing ~175 s. Exits 1 if a step failed.
set -u
export PYTHONPATH=. FA2CUPY_HYPOTHESIS_PROFILE=device XLA_PYTHON_CLIENT_PREALLOCATE=false
export OMP_NUM_THREADS=4 OPENBLAS_NUM_THREADS=4 MKL_NUM_THREADS=4
OUT="${OUT:-bench/results/device}"
mkdir -p "$OUT"
S=$(date +%s)
(nvidia-smi -L; git log -1 --oneline 2>/dev/null; date -u) > "$OUT/env.txt"
FAILED=0
st() { echo "$1 rc $2 at $(( $(date +%s) - S ))s" >> "$OUT/env.txt"; [ "$2" = 0 ] || FAILED=1; }

if [ "${SKIP_TIMING:-0}" != 1 ]; then
B="python3 cli.py bench --headdim 64,128 --causal both --seqlens 2048,8192 --dtype bf16 --out /tmp/fa2cupy-bench --no-plot"
timeout 60 $B --mode fwd > "$OUT/bench.log" 2>&1; st fwd $?
timeout 80 $B --mode fwd --sustain 1 --skip-cold --skip-overhead >> "$OUT/bench.log" 2>&1; st fwd_sustain $?
timeout 45 $B --mode bwd --skip-cold --skip-overhead >> "$OUT/bench.log" 2>&1; st bwd $?
timeout 75 $B --mode bwd --sustain 1 --skip-cold --skip-overhead --no-memory >> "$OUT/bench.log" 2>&1; st bwd_sustain $?
timeout 50 python3 bench/window_speed.py --rounds 3 > "$OUT/window.log" 2>&1; st window $?
fi

for f in $(grep -l "pytest.mark.gpu" tests/test_*.py); do  # a GPU test file added later and not listed below
  grep -q "$f" "$0" || echo "WARNING: $f is not in bench/one_call.sh's groups" | tee -a "$OUT/env.txt"
done
limit=${TESTS_LIMIT:-$(( 590 - ($(date +%s) - S) ))}
echo "tests limit ${limit}s" >> "$OUT/env.txt"
P="timeout $limit python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8"
$P tests/test_kvcache.py > "$OUT/tests_1.log" 2>&1 &
$P tests/test_hopper_forward_gpu.py tests/test_paged_varlen_gpu.py tests/test_forward_gpu.py tests/test_benchmark.py \
   tests/test_cli.py > "$OUT/tests_2.log" 2>&1 &
$P tests/test_torch.py tests/test_jax.py tests/test_packed.py tests/test_varlen_mods_gpu.py > "$OUT/tests_3.log" 2>&1 &
$P tests/test_hopper_backward_gpu.py tests/test_backward_gpu.py tests/test_decode.py > "$OUT/tests_4.log" 2>&1 &
for _ in 1 2 3 4; do wait -n; st tests $?; done
cat "$OUT/env.txt"
for f in "$OUT"/tests_*.log; do echo "== $f"; grep -E "passed|failed|error" "$f" | tail -2; done
[ -f "$OUT/bench.log" ] && grep -v "^wrote" "$OUT/bench.log"
[ -f "$OUT/window.log" ] && tail -4 "$OUT/window.log"
exit $FAILED
