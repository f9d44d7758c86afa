#!/usr/bin/env bash
# Every kernel of one call of a benchmark case, with its duration (ncu's gpu__time_duration),
# next to the call's wall time: how much of a short case goes to the plan kernels and launches.
# Build first (tools/gpu_build.sh).
#   bash tools/gpu_kernel_times.sh <case> [profile_case.py args, e.g. --bwd]
# e.g. bash tools/gpu_kernel_times.sh "att:2x8k doc1k"
set -uo pipefail
cd "$(dirname "$0")/.."
case_="$1"; shift
python3 tools/profile_case.py "$case_" --time "$@" 2>&1 | tail -1
# --reps 3: the first call compiles, the last one is read.
ncu --clock-control none --metrics gpu__time_duration.sum --csv \
  python3 tools/profile_case.py "$case_" --reps 3 "$@" 2>/dev/null | python3 tools/kernel_times.py
