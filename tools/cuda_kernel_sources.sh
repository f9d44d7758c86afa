#!/usr/bin/env bash
# Prints what the CUDA kernel library (CMake target jaxcp_cuda_kernels) is built from: checksums
# of ffi/cuda and ffi/common sources, the architectures ($1), nvcc's release and CUTLASS's
# version. tools/prebuild_cuda_kernels.sh stores it beside a prebuilt library; tools/gpu_build.sh
# links that library only when this output is the same on the GPU host.
set -euo pipefail
cd "$(dirname "$0")/.."
find ffi/cuda ffi/common -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' \) | sort | xargs md5sum
echo "archs $1"
nvcc --version | grep -o 'release [0-9.]*'
python3 -c "import importlib.metadata as m; print('nvidia-cutlass', m.version('nvidia-cutlass'))"
