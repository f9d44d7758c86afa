#!/usr/bin/env bash
# ncu (hardware counters) over one launch of a kernel in a benchmark case, on a GPU host whose
# runtime gives access to the performance counters. Build first (tools/gpu_build.sh).
#   bash tools/gpu_profile.sh <kernel-regex> <case> [extra profile_case.py args]
# e.g. bash tools/gpu_profile.sh small_seq_fwd_mma ss:ragged30720
#      bash tools/gpu_profile.sh attention_fwd_sm90 "att:1x64k doc1k"
#      bash tools/gpu_profile.sh FlashAttnBwdSm90 "att:1x128k doc8k" --bwd --fa3
# The regex is matched against the demangled name with its template arguments (FlashAttention-3's
# kernels are all cutlass::device_kernel<...>).
set -uo pipefail
cd "$(dirname "$0")/.."
kernel="$1"; shift
ncu --clock-control none --launch-skip 2 --launch-count 1 -k "regex:$kernel" --kernel-name-base demangled \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis ${NCU_EXTRA:-} \
  python3 tools/profile_case.py "$@" 2>&1 | grep -v "^==PROF=="
