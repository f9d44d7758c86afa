#!/usr/bin/env bash
# A/B of CUDA kernel libraries in one call on one GPU: each variant NAME is a kernel library
# built elsewhere (tools/prebuild_cuda_kernels.sh, then `xz` its libjaxcp_cuda_kernels.a into
# DIR/libNAME.a.xz), installed with the tree's FFI handlers into /tmp/site_NAME (its own build
# dir) and timed by importing from there. Any editable jaxcp is uninstalled first: its import
# hook would take precedence over PYTHONPATH, and every variant would run the same library.
#   AB_DIR=.ab AB_VARIANTS=A,B AB_CASES="att:2x8k dense+det;att:1x128k doc8k" bash tools/gpu_kernel_ab.sh
# AB_MODE=kernels (default): each case's backward kernel duration under ncu (tools/gpu_kernel_times.sh;
#   AB_GREP picks its lines); AB_MODE=time: profile_case.py --bwd --time, in
#   AB_ROUNDS rounds (default 2) that alternate the variants' order. AB_PASS=fwd: the forward alone
#   instead (e.g. small-seq forward kernels: AB_CASES="ss:262144:8:4/1:64:ragged;..." AB_MODE=time
#   AB_PASS=fwd).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
dir="${AB_DIR:-.ab}"
IFS=',' read -ra variants <<< "${AB_VARIANTS:?AB_VARIANTS=A,B,...}"
IFS=';' read -ra cases <<< "${AB_CASES:?AB_CASES=case;case;...}"
pass_flag=(--bwd)
[ "${AB_PASS:-bwd}" = fwd ] && pass_flag=()
python3 -m pip uninstall -y -q jaxcp > /dev/null 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
fi
for v in "${variants[@]}"; do
  (xz -d -c "$dir/lib$v.a.xz" > "/tmp/lib$v.a" || exit 1
   CMAKE_ARGS="-DJAXCP_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real -DJAXCP_CUDA_KERNELS_LIB=/tmp/lib$v.a" \
     CMAKE_BUILD_PARALLEL_LEVEL=4 python3 -m pip install -q --no-build-isolation --no-deps \
     --target "/tmp/site_$v" --config-settings=build-dir="/tmp/build_$v" . > "$OUT/build_$v.log" 2>&1
   echo "build $v rc=$?") &
done
wait
for v in "${variants[@]}"; do  # where each variant imports from, and its extension's checksum
  (cd /tmp && PYTHONPATH="/tmp/site_$v" python3 -c "import hashlib, jaxcp._jaxcp_cuda as m; \
print('$v', m.__file__, hashlib.md5(open(m.__file__, 'rb').read()).hexdigest()[:8])")
done | tee "$OUT/ab_imports.txt"
if [ "$(awk '{print $3}' "$OUT/ab_imports.txt" | sort | uniq -d)" ]; then
  echo "two variants load the same extension: their times would compare a library with itself" >&2
  exit 1
fi
if [ "${AB_MODE:-kernels}" = kernels ]; then
  for c in "${cases[@]}"; do
    for v in "${variants[@]}"; do
      PYTHONPATH="/tmp/site_$v" timeout "${AB_TIMEOUT:-150}" bash tools/gpu_kernel_times.sh "$c" "${pass_flag[@]}" \
        | grep -E "${AB_GREP:-attention_bwd_sm90_kernel}" | cut -c1-70 | sed "s|^|$v $c: |"
    done
  done
else
  for r in $(seq 1 "${AB_ROUNDS:-2}"); do
    order=("${variants[@]}")
    [ $((r % 2)) = 0 ] && order=($(printf '%s\n' "${variants[@]}" | tac))
    for v in "${order[@]}"; do
      PYTHONPATH="/tmp/site_$v" timeout "${AB_TIMEOUT:-150}" python3 tools/profile_case.py "${cases[@]}" \
        "${pass_flag[@]}" --time 2>&1 | grep " ms" | sed "s/^/$v r$r /"
    done
  done
fi
