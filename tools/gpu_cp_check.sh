#!/usr/bin/env bash
# Context-parallel benchmark on a multi-GPU host (4 GPUs; on 2, pass --gpus 2):
# builds jaxcp with the CUDA extension and runs benchmarks/bench_cp.py over 1, 2 and 4 GPUs,
# then the small-seq benchmark on GPU 0. Outputs go to $OUT or ./gpu_results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
CMAKE_ARGS="-DJAXCP_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real" CMAKE_BUILD_PARALLEL_LEVEL=32 \
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; exit 1; }
echo "build ok"
python3 benchmarks/bench_cp.py --out "$OUT" "$@" 2>&1 | tail -30
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_small_seq.py --out "$OUT" 2>&1 | tail -14
