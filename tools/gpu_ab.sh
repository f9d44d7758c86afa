#!/usr/bin/env bash
# A/B of source changes on a GPU host, in one device call. Builds side A (the tree as it is),
# then each patch in turn on top of the ones before (rebuild: only the files it touches
# recompile), keeping each side's extension module; then times the cases side by side for
# AB_ROUNDS rounds (default 2: A B .. A B ..), swapping the module in between, so drift over the
# run shows as the spread between rounds instead of as a difference between sides.
#   bash tools/gpu_ab.sh <patch>[,<patch>...] <profile_case.py args...>
# e.g. bash tools/gpu_ab.sh ab/regs.patch,ab/bn80.patch "att:2x8k doc1k D256" --time
# The tree and module are left at the last side when AB_KEEP=1 (tests can follow), else at A.
# Output: $OUT/ab.txt. A side that hangs is cut off after AB_CASE_TIMEOUT seconds (default 240).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
IFS=, read -ra patches <<< "$1"; shift
keep="$(mktemp -d)"
bash tools/gpu_build.sh || exit 1
module="$(python3 -c 'import jaxcp._jaxcp_cuda as m; print(m.__file__)')" || exit 1
names=(A)
cp "$module" "$keep/0.so"
applied=()
for patch in "${patches[@]}"; do
  git apply "$patch" || { echo "$patch does not apply"; break; }
  applied=("$patch" "${applied[@]}")
  bash tools/gpu_build.sh > /dev/null || { echo "rebuild with $patch failed"; git apply -R "$patch"; break; }
  names+=("${names[-1]}+$(basename "$patch" .patch)")
  cp "$module" "$keep/$((${#names[@]} - 1)).so"
done
for round in $(seq "${AB_ROUNDS:-2}"); do
  for side in "${!names[@]}"; do
    cp "$keep/$side.so" "$module"
    echo "== round $round: ${names[$side]}" | tee -a "$OUT/ab.txt"
    timeout "${AB_CASE_TIMEOUT:-240}" python3 tools/profile_case.py "$@" 2>&1 \
      | grep --line-buffered -E " ms|Error|error" | tee -a "$OUT/ab.txt"
  done
done
if [ "${AB_KEEP:-0}" = 1 ]; then exit 0; fi
for patch in "${applied[@]}"; do git apply -R "$patch"; done
cp "$keep/0.so" "$module"
