#!/usr/bin/env bash
# Compiles the CUDA kernel library (ffi/cuda/*.cu; sm_90a unless JAXCP_CUDA_ARCHS says otherwise)
# on this machine, where compiling costs no GPU time, into .kernels/: libjaxcp_cuda_kernels.a and
# what it was built from (tools/cuda_kernel_sources.sh). Carry .kernels with a device call and
# tools/gpu_build.sh links it instead of compiling the kernels there, as long as the sources,
# architectures, nvcc release and CUTLASS version are the same. Needs nvcc, CMake, ninja and
# nvidia-cutlass here (about 9 minutes on 2 cores).
#   bash tools/prebuild_cuda_kernels.sh        then: run(..., carry=[".whl", ".kernels"])
set -euo pipefail
cd "$(dirname "$0")/.."
archs="${JAXCP_CUDA_ARCHS:-90a-real}"
build=build/prebuilt-kernels
mkdir -p build
cmake -G Ninja -S . -B "$build" -DJAXCP_ENABLE_CUDA=ON -DJAXCP_CUDA_KERNELS_LIB= \
  -DCMAKE_CUDA_ARCHITECTURES="$archs" -DPython_EXECUTABLE="$(command -v python3)" > "$build.log"
ninja -C "$build" jaxcp_cuda_kernels
mkdir -p .kernels
cp "$build/libjaxcp_cuda_kernels.a" .kernels/
bash tools/cuda_kernel_sources.sh "$archs" > .kernels/sources.txt
echo "wrote .kernels/libjaxcp_cuda_kernels.a ($(du -h .kernels/libjaxcp_cuda_kernels.a | cut -f1)) for $archs"
