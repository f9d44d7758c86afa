#!/usr/bin/env bash
# One command on a GPU host: build jaxcp with the CUDA extension, run the GPU tests,
# compute-sanitizer's four tools over small cases (tools/gpu_sanitize.sh), and the benchmarks.
# Outputs go to $OUT (the device tool's folder) or ./gpu_results.
#   bash tools/gpu_check.sh [tests|bench|all]   (default all)
# Offline hosts: put nvidia-cutlass (and any other missing wheel) in .whl/ first.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0

bash tools/gpu_build.sh || exit 1
rc=0
if [[ "$what" == "tests" || "$what" == "all" ]]; then
  bash tools/gpu_tests.sh
  rc=$?
  # compute-sanitizer's memcheck, initcheck, synccheck and racecheck over small cases through
  # the whole JAX/FFI stack (3-5 minutes on an H200)
  bash tools/gpu_sanitize.sh || rc=1
fi
if [[ "$what" == "bench" || "$what" == "all" ]]; then
  python3 benchmarks/bench_attention.py --out "$OUT" 2>&1 | tail -25
  python3 benchmarks/bench_layers.py --out "$OUT" 2>&1 | tail -12
  [[ -f benchmarks/bench_small_seq.py ]] && python3 benchmarks/bench_small_seq.py --out "$OUT" 2>&1 | tail -15
fi
exit $rc
