#!/usr/bin/env bash
# Builds build_harness/attention_harness: the CUDA attention kernels and launchers (ffi/cuda/attention/*.cu),
# the float32 CPU reference (ffi/cpu/attention_cpu_kernels.cc) and tools/cuda_attention_harness.cu.
#   ARCH   nvcc target flags (default: sm_90a; e.g. ARCH="-gencode=arch=compute_80,code=sm_80")
#   JOBS   parallel compilations (default: nproc)
# Objects are rebuilt only when a source or header is newer.
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=${ARCH:-"-gencode=arch=compute_90a,code=sm_90a"}
JOBS=${JOBS:-$(nproc)}
OUT=${OUT_DIR:-build_harness}
CUTLASS_INC=${CUTLASS_INC:-$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")}
NVCC_FLAGS="-std=c++17 -O3 --expt-relaxed-constexpr --use_fast_math -lineinfo -I ffi -I ${CUTLASS_INC} ${ARCH}"
mkdir -p "$OUT/cuda_objects"
HEADERS=$(ls ffi/common/*.h ffi/cuda/*.cuh ffi/cuda/attention/*.h ffi/cuda/attention/*.cuh ffi/cpu/*.h)

stale() {  # stale OBJ SRC: true when OBJ is missing or older than SRC or any header
  local obj=$1 src=$2
  [[ ! -f $obj || $src -nt $obj ]] && return 0
  for h in $HEADERS; do [[ $h -nt $obj ]] && return 0; done
  return 1
}

jobs_cmds=()
for src in ffi/cuda/attention/*.cu tools/cuda_attention_harness.cu; do
  obj="$OUT/cuda_objects/$(basename "${src%.cu}").o"
  if stale "$obj" "$src"; then jobs_cmds+=("nvcc ${NVCC_FLAGS} -c $src -o $obj"); fi
done
obj="$OUT/cpu_reference.o"
if stale "$obj" ffi/cpu/attention_cpu_kernels.cc; then
  jobs_cmds+=("g++ -std=c++17 -O3 -pthread -I ffi -c ffi/cpu/attention_cpu_kernels.cc -o $obj")
fi
if ((${#jobs_cmds[@]})); then
  printf '%s\n' "${jobs_cmds[@]}" | xargs -P "$JOBS" -I{} bash -c '{}'
fi
nvcc ${ARCH} -o "$OUT/attention_harness" "$OUT"/cuda_objects/*.o \
  "$OUT/cpu_reference.o" -lpthread
echo "built $OUT/attention_harness"
