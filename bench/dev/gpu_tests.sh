#!/usr/bin/env bash
# Every `-m gpu` test under tests/ in eleven pytest processes side by side on one GPU: the float64 references are
# CPU work, so the suite (over 15 min in one process) takes about 4 min this way on an H200. The Hopper backward's,
# its modifier rows', the Hopper kernels' dropout and the wide head dims' tests have processes of their own, so
# that a fault there leaves the other groups' CUDA context alone; the Hopper backward's file, the longest, is split
# by test id over three processes. Each group's log is printed in turn; exit 1 if any failed.
#
#   bash bench/dev/gpu_tests.sh        # LIMIT=seconds per process (default 360), PYTHON=interpreter
#
# The last group is every test file the others do not name, so a new file is never left out.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FA2CUPY_HYPOTHESIS_PROFILE="${FA2CUPY_HYPOTHESIS_PROFILE:-device}"
# (BLAS threads capped so that four processes do not oversubscribe the CPU; JAX takes GPU memory as it needs it)
export XLA_PYTHON_CLIENT_PREALLOCATE=false OMP_NUM_THREADS=4 OPENBLAS_NUM_THREADS=4 MKL_NUM_THREADS=4
PY="${PYTHON:-python3}"
groups=(
  "tests/test_kvcache.py"
  "tests/test_hopper_forward_gpu.py tests/test_paged_varlen_gpu.py tests/test_forward_gpu.py tests/test_benchmark.py tests/test_cli.py"
  "tests/test_torch.py tests/test_jax.py tests/test_packed.py tests/test_varlen_mods_gpu.py"
  "tests/test_hopper_forward_wide_gpu.py tests/test_hopper_backward_wide_gpu.py"
  "tests/test_transformers_gpu.py tests/test_torch_sdpa_gpu.py tests/test_headdim_v_gpu.py"
  "tests/test_hopper_backward_mods_gpu.py"
  "tests/test_hopper_dropout_gpu.py"
)
split_file=tests/test_hopper_backward_gpu.py split_parts=3
rest=(tests/ "--ignore=$split_file")
for group in "${groups[@]}"; do for f in $group; do rest+=("--ignore=$f"); done; done
logs=$(mktemp -d)
pids=()
run() {  # run N ARGS...: one pytest process, its output in $logs/N.log
  local n=$1; shift
  timeout -k 15 "${LIMIT:-360}" "$PY" -m pytest -q -m gpu -p no:cacheprovider --durations=5 "$@" > "$logs/$n.log" 2>&1
}
for n in "${!groups[@]}"; do
  # shellcheck disable=SC2086
  run "$n" ${groups[$n]} & pids+=($!)
done
ids=$("$PY" -m pytest -q -m gpu -p no:cacheprovider --collect-only "$split_file" 2>/dev/null | grep '::')
for ((k = 0; k < split_parts; k++)); do
  # shellcheck disable=SC2046
  run "${#pids[@]}" $(awk -v k=$k -v n=$split_parts 'NR % n == k' <<< "$ids") & pids+=($!)
done
run "${#pids[@]}" "${rest[@]}" & pids+=($!)
failed=0
for n in "${!pids[@]}"; do
  wait "${pids[$n]}"; rc=$?
  echo "=== group $((n + 1)) of ${#pids[@]}: rc=$rc"
  cat "$logs/$n.log"
  [ "$rc" = 0 ] || failed=1
done
rm -rf "$logs"
exit $failed
