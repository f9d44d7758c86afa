#!/usr/bin/env bash
# The GPU tests on a GPU host (build first: tools/gpu_build.sh), in parallel pytest workers when
# pytest-xdist is installed (offline hosts: its wheel and execnet's in .whl/, which gpu_build.sh
# installs). Compiling the jitted kernels and references dominates these tests, and a GPU host
# has cores to spare. On a host of several GPUs the workers are spread over them (worker i on
# GPU i mod count: tests/conftest.py), 4 workers a GPU by default.
#   bash tools/gpu_tests.sh [pytest args]        (default: every test marked gpu under tests/)
#   JAXCP_TEST_WORKERS=8 bash tools/gpu_tests.sh tests/test_small_seq_gpu_large.py
# Log, one line per test (a run cut short still shows what passed): $OUT/gpu_tests.log
# (OUT: the device tool's folder, or ./gpu_results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
# Workers share a GPU: each allocates what it uses instead of 75% of the memory up front.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
parallel=()
if python3 -c "import xdist" 2>/dev/null; then
  parallel=(-n "${JAXCP_TEST_WORKERS:-$(( gpus > 1 ? 4 * gpus : 6 ))}" --dist worksteal)
  [[ $gpus -gt 1 && -z "${CUDA_VISIBLE_DEVICES:-}" ]] && export JAXCP_TEST_GPUS=$gpus
fi
args=("$@")
[[ ${#args[@]} -eq 0 ]] && args=(tests/)
python3 -m pytest -v -m gpu "${parallel[@]}" -p no:cacheprovider --durations=10 "${args[@]}" 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -25
exit "${PIPESTATUS[0]}"
