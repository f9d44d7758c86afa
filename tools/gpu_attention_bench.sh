#!/usr/bin/env bash
# benchmarks/bench_attention.py over every GPU of the host: one process per GPU (on its own share
# of the cores), each a part of the case list (--part i/n), then one merged result set,
# attention_<kind>.{json,md,png} (attention_extra_* with --extra), in $OUT (or ./gpu_results).
# The parts' files and logs go into one archive, attention_parts.tgz, so that a tool that returns
# few files gets the result set whole. Build first (tools/gpu_build.sh).
#   bash tools/gpu_attention_bench.sh [--extra]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
parts="$OUT/attention_parts"
mkdir -p "$parts"
export PYTHONUNBUFFERED=1
n=$(nvidia-smi -L | wc -l)
cores=$(( $(nproc) / n ))
for ((i = 0; i < n; i++)); do
  CUDA_VISIBLE_DEVICES=$i taskset -c $((i * cores))-$((i * cores + cores - 1)) \
    timeout "${BENCH_TIMEOUT_S:-540}" python3 benchmarks/bench_attention.py --part "$i/$n" --out "$parts" "$@" \
    > "$parts/part$i.log" 2>&1 &
done
wait
python3 benchmarks/bench_attention.py --merge "$parts"/*_part*.json --out "$OUT" "$@" > "$parts/merge.log" 2>&1
rc=$?
tail -12 "$parts/merge.log"
tar czf "$OUT/attention_parts.tgz" -C "$OUT" attention_parts && rm -rf "$parts"
exit $rc
