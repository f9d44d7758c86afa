#!/usr/bin/env bash
# Small-sequence attention on one GPU host: build jaxcp with the CUDA extension (sm_90a), run the
# small-seq GPU tests and benchmarks/bench_small_seq.py (timings, bandwidth vs a device copy,
# memory vs inputs + outputs + saved probabilities). Outputs go to $OUT (the device tool's
# folder) or ./gpu_results: build.log, small_seq_tests.log, small_seq_<kind>.{json,md}, bench log.
#   bash tools/gpu_small_seq_check.sh [all|tests|bench|memcheck|sweep [sweep args]]
#   (default all = tests + bench)
# memcheck: compute-sanitizer over a few small-seq calls (clamped lengths, ragged, GQA, grads).
# sweep: benchmarks/bench_small_seq.py --sweep split over every GPU of the host (one process per
# GPU, --part i/n), then benchmarks/plot_small_seq.py merges the parts (small_seq_sweep_*.{json,
# md,png}; the parts' files and logs in small_seq_sweep_parts.tgz); further arguments go to each
# sweep process (e.g. --variants mma,lanes --dims 64).
# Offline hosts: put nvidia-cutlass (and any other missing wheel) in .whl/ first.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$SECONDS

bash tools/gpu_build.sh || exit 1
echo "build ok ($((SECONDS - t0)) s)"

rc=0
if [[ "$what" == "tests" || "$what" == "all" ]]; then
  # through gpu_tests.sh: its workers are spread over the GPUs and allocate what they use (a bare
  # pytest takes pyproject's "-n auto", a worker per core each taking 75% of one GPU's memory:
  # on a 32-core host the run ended in collection errors)
  timeout 300 bash tools/gpu_tests.sh tests/test_small_seq*.py > /dev/null
  rc=$?
  cp "$OUT/gpu_tests.log" "$OUT/small_seq_tests.log"
  tail -15 "$OUT/small_seq_tests.log"
  echo "tests exit $rc ($((SECONDS - t0)) s)"
fi
if [[ "$what" == "bench" || "$what" == "all" ]]; then
  timeout 420 python3 benchmarks/bench_small_seq.py --out "$OUT" > "$OUT/bench_small_seq.log" 2>&1
  brc=$?
  tail -14 "$OUT/bench_small_seq.log"
  echo "bench exit $brc ($((SECONDS - t0)) s)"
  [[ $rc -eq 0 ]] && rc=$brc
fi
if [[ "$what" == "memcheck" ]]; then
  timeout 400 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/sanitizer_small_seq_case.py \
    > "$OUT/small_seq_memcheck.log" 2>&1
  rc=$?
  echo "memcheck exit $rc ($(grep -c 'Invalid' "$OUT/small_seq_memcheck.log") invalid accesses)"
  tail -3 "$OUT/small_seq_memcheck.log"
fi
if [[ "$what" == "sweep" ]]; then
  shift
  n=$(nvidia-smi -L | wc -l)
  parts="$OUT/sweep_parts"  # archived after the merge: the device tool returns at most 8 files
  mkdir -p "$parts"
  for ((i = 0; i < n; i++)); do
    # each process on its own GPU and its own share of the cores (compiles of one must not stall
    # the timings of another)
    cores=$(( $(nproc) / n ))
    CUDA_VISIBLE_DEVICES=$i taskset -c $((i * cores))-$((i * cores + cores - 1)) timeout "${SWEEP_TIMEOUT_S:-540}" python3 benchmarks/bench_small_seq.py \
      --sweep --part "$i/$n" --out "$parts" "$@" > "$parts/sweep_part$i.log" 2>&1 &
  done
  wait
  python3 benchmarks/plot_small_seq.py "$parts"/small_seq_sweep_*_part*.json --out "$OUT" \
    > "$parts/sweep_plot.log" 2>&1
  rc=$?
  tail -30 "$parts/sweep_plot.log"
  tar czf "$OUT/small_seq_sweep_parts.tgz" -C "$OUT" sweep_parts && rm -rf "$parts"
fi
echo "total $((SECONDS - t0)) s"
exit $rc
