#!/usr/bin/env bash
# Build jaxcp with the CUDA extension (sm_90a) in place on a GPU host; log to $OUT/build.log.
# Offline hosts: put nvidia-cutlass (and any other missing wheel) in .whl/ first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
fi
# The device tool copies the tree with its files' times, and a warm host keeps build/ between
# calls: ninja would then miss a file that differs from the last build's yet looks older. Touch
# every source whose content changed since the last build here (or every one, with no record).
manifest=build/.jaxcp_sources.md5
mkdir -p build
find ffi CMakeLists.txt -type f | sort | xargs md5sum > "$manifest.new"
if [ -f "$manifest" ]; then
  diff "$manifest" "$manifest.new" | awk '/^>/ {print $3}' | xargs -r touch
else
  awk '{print $2}' "$manifest.new" | xargs touch  # no record of the last build: all of them
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# A kernel library prebuilt elsewhere (tools/prebuild_cuda_kernels.sh, carried in .kernels/) is
# linked when it was built from exactly these sources, architectures, nvcc and CUTLASS.
archs="${JAXCP_CUDA_ARCHS:-90a-real}"
kernels=""
if [ -f .kernels/libjaxcp_cuda_kernels.a ]; then
  if bash tools/cuda_kernel_sources.sh "$archs" | cmp -s - .kernels/sources.txt; then
    kernels="$PWD/.kernels/libjaxcp_cuda_kernels.a"
    echo "linking the prebuilt CUDA kernels (.kernels/)"
  else
    echo "the prebuilt CUDA kernels in .kernels/ are stale: compiling the kernels here"
  fi
fi
CMAKE_ARGS="-DJAXCP_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$archs -DJAXCP_CUDA_KERNELS_LIB=$kernels" \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; rm -f "$manifest"; exit 1; }
mv "$manifest.new" "$manifest"
echo "build ok"
