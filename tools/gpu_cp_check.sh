#!/usr/bin/env bash
# Context-parallel benchmark on a multi-GPU host (4 GPUs; on 2, pass --gpus 2): builds jaxcp with
# the CUDA extension, calibrates the document placement's cost model on GPU 0 and the exchange
# rates over all GPUs (benchmarks/calibrate_placement.py), then runs benchmarks/bench_cp.py over
# 1, 2 and 4 GPUs with that calibration. Outputs go to $OUT or ./gpu_results (the compiled schedules in cp_hlo.tgz).
#   bash tools/gpu_cp_check.sh [bench_cp.py args]
#   SKIP_CALIBRATION=1 bash tools/gpu_cp_check.sh --seq 262144 --append   (reuse $OUT's calibration)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash tools/gpu_build.sh || exit 1
if [[ -z "${SKIP_CALIBRATION:-}" ]]; then
  # Kernel fits on GPU 0 for both head layouts of the benchmark, exchange rates over all GPUs.
  python3 benchmarks/calibrate_placement.py --heads 32 8 16 16 --out "$OUT" 2>&1 | tail -40
fi
calibration=$(ls "$OUT"/placement_calibration_*.json 2>/dev/null | head -1)
python3 benchmarks/bench_cp.py --out "$OUT" ${calibration:+--calibration "$calibration"} --hlo-dir "$OUT/cp_hlo" "$@" \
  2>&1 | tail -60
rc=${PIPESTATUS[0]}
# The compiled schedules (one file per sharded program) as one archive: the device tool returns few files.
[[ -d "$OUT/cp_hlo" ]] && tar czf "$OUT/cp_hlo.tgz" -C "$OUT" cp_hlo && rm -rf "$OUT/cp_hlo"
exit $rc
