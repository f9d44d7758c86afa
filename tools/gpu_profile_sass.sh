#!/usr/bin/env bash
# Where a kernel's warps wait, per SASS instruction: ncu's warp-state sampling (SourceCounters)
# over one launch of the named kernel in a benchmark case, printed as the source page (CSV, one
# row per SASS instruction with its stall samples by reason). Build first (tools/gpu_build.sh).
#   bash tools/gpu_profile_sass.sh <kernel-regex> <case> <name> [profile_case.py args]
# e.g. bash tools/gpu_profile_sass.sh attention_bwd_sm90_kernel "att:1x128k doc8k" bwd --bwd
#      bash tools/gpu_profile_sass.sh FlashAttnBwdSm90 "att:1x128k doc8k" fa3 --bwd --fa3
# Writes $OUT/<name>_sass.csv and $OUT/<name>_details.txt; tools/sass_profile_compare.py reads
# them (two side by side). The regex is matched against the demangled name.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
kernel="$1"; case_="$2"; name="$3"; shift 3
ncu --clock-control none --launch-skip 2 --launch-count 1 -k "regex:$kernel" --kernel-name-base demangled \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis \
  -f -o "$OUT/$name" python3 tools/profile_case.py "$case_" "$@" 2>&1 | grep -v "^==PROF==" | tail -5
ncu --import "$OUT/$name.ncu-rep" --page details > "$OUT/${name}_details.txt" 2>&1
ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/${name}_sass.csv" 2>&1
rm -f "$OUT/$name.ncu-rep"  # large; the two text pages are what is read
echo "$name: $(wc -l < "$OUT/${name}_sass.csv") SASS rows"; grep -E "Duration|Throughput" "$OUT/${name}_details.txt"
