#!/usr/bin/env bash
# ncu (hardware counters) over one launch of a kernel in a benchmark case, on a GPU host whose
# runtime gives access to the performance counters. Build first (tools/gpu_build.sh).
#   bash tools/gpu_profile.sh <kernel-regex> <case> [extra profile_case.py args]
# e.g. bash tools/gpu_profile.sh small_seq_fwd_mma ss:ragged30720
#      bash tools/gpu_profile.sh attention_fwd_sm90 "att:1x64k doc1k"
set -uo pipefail
cd "$(dirname "$0")/.."
kernel="$1"; shift
ncu --clock-control none --launch-skip 2 --launch-count 1 -k "regex:$kernel" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis ${NCU_EXTRA:-} \
  python3 tools/profile_case.py "$@" 2>&1 | grep -v "^==PROF=="
