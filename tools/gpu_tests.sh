#!/usr/bin/env bash
# The GPU tests on a GPU host (build first: tools/gpu_build.sh), in parallel pytest workers when
# pytest-xdist is installed (offline hosts: its wheel and execnet's in .whl/, which gpu_build.sh
# installs). Compiling the jitted kernels and references dominates these tests, and a GPU host
# has cores to spare. On a host of several GPUs the test files are spread over them, one pytest
# per GPU, the slowest file alone on the first.
#   bash tools/gpu_tests.sh [pytest args]        (default: every test marked gpu under tests/)
#   JAXCP_TEST_WORKERS=8 bash tools/gpu_tests.sh tests/test_small_seq_gpu_large.py
# Log, one line per test (a run cut short still shows what passed): $OUT/gpu_tests[_<gpu>].log
# (OUT: the device tool's folder, or ./gpu_results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
# Workers share a GPU: each allocates what it uses instead of 75% of the memory up front.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
parallel=()
if python3 -c "import xdist" 2>/dev/null; then
  parallel=(-n "${JAXCP_TEST_WORKERS:-6}" --dist worksteal)
fi
run() {  # run <log> <pytest args...>
  local log=$1
  shift
  python3 -m pytest -v -m gpu "${parallel[@]}" -p no:cacheprovider --durations=10 "$@" > "$log" 2>&1
}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [[ $# -gt 0 || $gpus -le 1 ]]; then
  args=("$@")
  [[ ${#args[@]} -eq 0 ]] && args=(tests/)
  run "$OUT/gpu_tests.log" "${args[@]}"
  rc=$?
  tail -25 "$OUT/gpu_tests.log"
  exit $rc
fi
# Files that hold gpu tests, the slowest first; dealt to the GPUs, the first keeping its one.
mapfile -t files < <(grep -l "gpu" tests/test_*.py | xargs grep -l "mark.gpu\|pytestmark" \
  | xargs -n1 sh -c 'echo "$(grep -c "^def test_\|^  def test_" "$0") $0"' | sort -rn | awk '{print $2}')
declare -a groups
for i in "${!files[@]}"; do
  g=$(( i == 0 ? 0 : 1 + (i - 1) % (gpus - 1) ))
  groups[$g]+="${files[$i]} "
done
pids=()
for g in "${!groups[@]}"; do
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$g run "$OUT/gpu_tests_$g.log" ${groups[$g]} &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for g in "${!groups[@]}"; do
  echo "== GPU $g: ${groups[$g]}"
  grep -E "passed|failed|error" "$OUT/gpu_tests_$g.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_$g.log" | head -20
done
exit $rc
