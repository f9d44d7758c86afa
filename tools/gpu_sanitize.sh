#!/usr/bin/env bash
# compute-sanitizer's four tools over jaxcp's CUDA kernels on a GPU host (build first:
# tools/gpu_build.sh): memcheck (out-of-bounds and misaligned accesses), initcheck (reads of
# global memory nothing wrote), synccheck (barriers used wrongly) and racecheck (shared-memory
# hazards). Exit 0 when every run is clean.
#   bash tools/gpu_sanitize.sh [tool ...]            (default: all four)
#   JAXCP_SANITIZE_DIMS="128 192:128" bash tools/gpu_sanitize.sh racecheck
# Cases: tools/sanitizer_case.py (packed attention forward + both backwards; head dims from
# JAXCP_SANITIZE_DIMS, default all) and tools/sanitizer_small_seq_case.py. Logs:
# $OUT/sanitize_<tool>_<case>.log (OUT: the device tool's folder, or ./gpu_results), in one
# archive, sanitize_logs.tgz, when there are more than 4 of them.
#
# memcheck, synccheck and racecheck check only the kernels of the jaxcp namespace (XLA's run
# unchecked). initcheck checks every kernel, since it would count memory that an unchecked XLA
# kernel wrote as never written. It does not see writes by the TMA engine either
# (tools/initcheck_tma_probe.cu shows it), and the sm_90a forward stores O by TMA, so the
# backward's pre-pass would seem to read O unwritten. initcheck therefore runs the attention case
# on the sm_80 kernels (sanitizer_case.py --sm80), forward and backward, and on the sm_90a forward
# alone. (The sm_90a backward loads its operands by TMA, which initcheck does not check anyway.)
# racecheck counts a thread's accesses as ordered after an mbarrier wait only if that thread
# waited itself; a __syncwarp after another lane's wait does not count.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
# No autotuning: fewer XLA kernels for initcheck to run instrumented.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
tools=("$@")
[[ ${#tools[@]} -eq 0 ]] && tools=(memcheck initcheck synccheck racecheck)
read -r -a dims <<< "${JAXCP_SANITIZE_DIMS:-}"
rc=0

# run <tool> <case> <log name>: one compute-sanitizer run; prints its summary line and leaves its
# exit status in $status and its log's path in $log. Cases: attention (forward and backwards),
# attention_fwd (the forward alone), attention_sm80 (both on the sm_80 kernels), small_seq.
run() {
  local tool=$1 case=$2 name=$3 script=tools/sanitizer_case.py
  local args=("${dims[@]}") flags=(--kernel-name kns=jaxcp)
  [[ "$case" == attention_fwd ]] && args+=(--forward)
  [[ "$case" == attention_sm80 ]] && args+=(--sm80)
  [[ "$case" == small_seq ]] && { script=tools/sanitizer_small_seq_case.py; args=(); }
  # initcheck: every kernel, one line per report (a full backtrace each makes thousands slow).
  [[ "$tool" == initcheck ]] && flags=(--print-limit 0 --show-backtrace no)
  # racecheck: every hazard with its threads and source lines, not only the analysis summary.
  [[ "$tool" == racecheck ]] && flags+=(--racecheck-report hazard)
  log="$OUT/sanitize_${name}.log"
  local t0=$SECONDS
  local try
  for try in 1 2; do
    timeout "${JAXCP_SANITIZE_TIMEOUT:-500}" compute-sanitizer --tool "$tool" "${flags[@]}" \
      --error-exitcode 9 python3 "$script" "${args[@]}" > "$log" 2>&1
    status=$?
    # compute-sanitizer itself segfaults now and then (the kernel log names it, not python): once
    # more, then it counts.
    [[ $status -eq 139 && $try -eq 1 ]] && { echo "$name: compute-sanitizer crashed (139), once more"; continue; }
    break
  done
  local summary
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
  echo "$name: exit $status, $((SECONDS - t0)) s: ${summary:-no summary (see $log)}"
}

for tool in "${tools[@]}"; do
  runs=("attention ${tool}_attention" "small_seq ${tool}_small_seq")
  [[ "$tool" == initcheck ]] && runs=("attention_sm80 initcheck_attention_sm80"
                                      "attention_fwd initcheck_attention_fwd_sm90" "small_seq initcheck_small_seq")
  for r in "${runs[@]}"; do
    read -r -a words <<< "$r"
    run "$tool" "${words[@]}"
    [[ $status -ne 0 ]] && { rc=1; grep -m 12 -E "^=========  *(Invalid|Uninitialized|Barrier|Race|Error|Warning)|^=========     at" "$log"; }
  done
done
# One archive of every log once there are more than a few: the device tool returns at most 8 files.
logs=("$OUT"/sanitize_*.log)
if [[ ${#logs[@]} -gt 4 ]]; then
  tar czf "$OUT/sanitize_logs.tgz" -C "$OUT" "${logs[@]##*/}" && rm -f "${logs[@]}"
fi
exit $rc
