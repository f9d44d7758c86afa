"""Runs one benchmark case's jaxcp forward (or forward+backward) a few times, for a profiler.

  ncu --clock-control none -k regex:small_seq_fwd --launch-skip 2 --launch-count 1 \
      python3 tools/profile_case.py ss:ragged30720
  python3 tools/profile_case.py att:"1x64k doc1k" --time
  python3 tools/profile_case.py att:"2x8k doc1k" att:"2x8k doc1k D64" --time --both

Several cases time one after another in one process (one JAX start).

Cases: `ss:<name>` picks from the small-seq shorthands below, or `ss:B:SKV:HQ/HKV:D:padded|ragged`
is a point of the shape sweep (lengths uniform in [1, SKV]: `kv_lengths`, or ragged K/V with
`kv_cu_seqlens` and `max_kv_len=SKV`); `att:<name>` a case of
benchmarks/bench_attention.py by its name. `--time` prints the median time per call as well;
`--fa3` runs FlashAttention-3 (its varlen form, benchmarks/fa3_peer.py) on an `att:` case instead
of jaxcp, so that ncu can read both kernels on the same problem.
"""
import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_attention as ba  # noqa: E402
import bench_small_seq as bs  # noqa: E402
import common  # noqa: E402
import fa3_peer  # noqa: E402

import jaxcp  # noqa: E402

SMALL_SEQ = {
    "ragged30720": bs.Case("ragged", 30720, ragged_mean=8),
    "ragged262144": bs.Case("ragged", 262144, ragged_mean=8),
    "mha30720": bs.Case("mha", 30720),
    "gqa30720": bs.Case("gqa", 30720, q_heads=16, kv_heads=4),
}


def small_seq_point(spec):
  """q, k, v, dout and the call's keyword arguments of a sweep point `B:SKV:HQ/HKV:D:LAYOUT`."""
  b, s, heads, d, layout = spec.split(":")
  b, s, d = int(b), int(s), int(d)
  hq, hkv = (int(x) for x in heads.split("/"))
  if layout not in ("padded", "ragged"):
    raise ValueError(f"ss:{spec}: the layout is padded or ragged")
  lengths = np.random.default_rng(0).integers(1, s + 1, b).astype(np.int32)
  kv_shape = (int(lengths.sum()), hkv, d) if layout == "ragged" else (b, s, hkv, d)
  q, k, v, dout = bs.random_arrays(b, hq, d, kv_shape, jnp.bfloat16)
  if layout == "ragged":
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return (q, k, v, dout), dict(kv_cu_seqlens=cu, max_kv_len=s)
  return (q, k, v, dout), dict(kv_lengths=jnp.asarray(lengths))


def small_seq_fn(name, backward):
  if name in SMALL_SEQ:
    case = SMALL_SEQ[name]
    q, k, v, dout, lengths, _ = bs.make_inputs(case, jnp.bfloat16, np.random.default_rng(0))
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths)]) if case.ragged_mean else None
    kwargs = dict(kv_cu_seqlens=cu)
  else:
    (q, k, v, dout), kwargs = small_seq_point(name)
  f = lambda q, k, v: jaxcp.small_seq_attention(q, k, v, **kwargs)
  if backward:
    return jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)), (q, k, v, dout)
  return jax.jit(f), (q, k, v)


def attention_case(name):
  """A bench_attention case by name, or `fixed:B:S:DOC[:WINDOW]` (every document DOC tokens long;
  causal, within a window of WINDOW keys if given); either with `+padN`: the rows' last N tokens
  are padding (the documents cut there), and/or `+dN`: head dim N. (`attention_fn` also takes a
  final `+det`: the deterministic backward.)"""
  if "+d" in name:
    name, dim = name.split("+d")
    case, rows = attention_case(name)
    return dataclasses.replace(case, head_dim=int(dim)), rows
  if "+pad" in name:
    name, pad = name.split("+pad")
    case, rows = attention_case(name)
    return case, common.padded_rows(rows, case.seq_len - int(pad))
  if name.startswith("fixed:"):
    b, s, doc, *window = (int(x) for x in name.split(":")[1:])
    rows = [[doc] * (s // doc) + ([s % doc] if s % doc else []) for _ in range(b)]
    return ba.Case(name, b, s, doc, window=window[0] if window else None), rows
  case = next(c for c in ba.GPU_CASES + ba.EXTRA_CASES + ba.QUICK_CASES if c.name == name)
  return case, ba.case_rows(case)


def attention_fn(name, backward, fa3=False):
  deterministic = name.endswith("+det")
  case, rows = attention_case(name.removesuffix("+det"))
  seg, pos = common.segments_and_positions(rows, case.seq_len)
  key = jax.random.PRNGKey(1)
  q = jax.random.normal(key, (case.batch, case.seq_len, case.q_heads, case.head_dim), jnp.bfloat16)
  kv_shape = (case.batch, case.seq_len, case.kv_heads, case.head_dim)
  dv = case.v_head_dim or case.head_dim
  k = jax.random.normal(jax.random.fold_in(key, 1), kv_shape, jnp.bfloat16)
  v = jax.random.normal(jax.random.fold_in(key, 2), kv_shape[:3] + (dv,), jnp.bfloat16)
  f = ba._jaxcp(case, seg, pos, deterministic=deterministic)
  if fa3:
    varlen, info = fa3_peer.load()
    f, reason = (None, info["absent"]) if varlen is None else ba._fa3(case, rows, jnp.bfloat16, varlen)
    if reason:
      sys.exit(f"FlashAttention-3 cannot run {name}: {reason}")
  if backward:
    do = jax.random.normal(jax.random.fold_in(key, 3), q.shape[:3] + (dv,), jnp.bfloat16)
    return jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)), (q, k, v, do)
  return jax.jit(f), (q, k, v)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("case", nargs="+")
  ap.add_argument("--bwd", action="store_true", help="forward+backward instead of forward")
  ap.add_argument("--both", action="store_true", help="forward, then forward+backward")
  ap.add_argument("--reps", type=int, default=4)
  ap.add_argument("--time", action="store_true")
  ap.add_argument("--fa3", action="store_true", help="FlashAttention-3 instead of jaxcp (att: cases)")
  a = ap.parse_args()
  for case in a.case:
    for backward in ([False, True] if a.both else [a.bwd]):
      run_case(case, backward, a.reps, a.time, a.fa3)


def run_case(spec, backward, reps, timed, fa3=False):
  kind, name = spec.split(":", 1)
  fn, args = small_seq_fn(name, backward) if kind == "ss" else attention_fn(name, backward, fa3)
  for _ in range(reps):
    jax.block_until_ready(fn(*args))
  if timed:
    t = common.time_fn(fn, *args)
    extra = ""
    if kind == "att":
      case, rows = attention_case(name.removesuffix("+det"))
      pairs = ba.case_pairs(case, rows)
      dv = case.v_head_dim or case.head_dim
      flops = 2 * (case.head_dim + dv) * case.q_heads * pairs * (3.5 if backward else 1)
      extra = f" {flops / t / 1e12:.0f} TFLOP/s"
    print(f"{spec}{' (FA3)' if fa3 else ''}{' fwd+bwd' if backward else ''}: {t * 1e3:.3f} ms{extra}", flush=True)


if __name__ == "__main__":
  main()
