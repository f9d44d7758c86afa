#!/usr/bin/env bash
# Small-sequence attention on one GPU host: build jaxcp with the CUDA extension (sm_90a), run the
# small-seq GPU tests and benchmarks/bench_small_seq.py (timings, bandwidth vs a device copy,
# memory vs inputs + outputs + saved probabilities). Outputs go to $OUT (the device tool's
# folder) or ./gpu_results: build.log, small_seq_tests.log, small_seq.{json,md}, bench log.
#   bash tools/gpu_small_seq_check.sh [all|tests|bench|memcheck]   (default all = tests + bench)
# memcheck: compute-sanitizer over a few small-seq calls (clamped lengths, ragged, GQA, grads).
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
  timeout 300 python3 -m pytest -q -m gpu tests/test_small_seq*.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/small_seq_tests.log" | tail -15
  rc=${PIPESTATUS[0]}
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
  timeout 400 compute-sanitizer --tool memcheck --error-exitcode 9 python3 - > "$OUT/small_seq_memcheck.log" 2>&1 <<'EOF'
import jax, jax.numpy as jnp, numpy as np
from jaxcp import small_seq_attention
rng = np.random.default_rng(0)
r = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32), jnp.bfloat16)
def grads(f, q, k, v):
  out, pull = jax.vjp(f, q, k, v)
  return jax.block_until_ready((out,) + pull(jnp.ones_like(out)))
b, s = 3000, 11
lengths = jnp.asarray(rng.integers(-3, s + 4, b), jnp.int32)  # out of range: clamped
for hq, hkv, d in ((8, 2, 128), (6, 2, 256), (4, 4, 512)):
  grads(lambda q, k, v: small_seq_attention(q, k, v, kv_lengths=lengths),
        r(b, hq, d), r(b, s, hkv, d), r(b, s, hkv, d))
lens = rng.integers(0, 21, b)
cu = np.concatenate([[5], 5 + np.cumsum(lens)]).astype(np.int32)
cu[-1] += 1000  # past the end: clamped
t = int(cu[-2]) + 7
grads(lambda q, k, v: small_seq_attention(q, k, v, kv_cu_seqlens=cu),
      r(b, 8, 64), r(t, 2, 64), r(t, 2, 64))
print("small-seq memcheck case done")
EOF
  rc=$?
  echo "memcheck exit $rc ($(grep -c 'Invalid' "$OUT/small_seq_memcheck.log") invalid accesses)"
  tail -3 "$OUT/small_seq_memcheck.log"
fi
echo "total $((SECONDS - t0)) s"
exit $rc
