"""Calibrates DocumentPlacement's cost model on the GPU from jaxcp's own kernel times.

A segment of L tokens costs token_cost * L + pair_cost * L**2. Rows of S tokens cut into equal
documents of L tokens take t(L) = S * (a + b * L) (S / L documents of a * L + b * L**2 each), so a
straight-line fit of t / S against L gives a (the per-token part: tile edges, the plan, loads and
stores) and b (the per-pair part). With pair_cost = 0.5 (a causal document has about L**2 / 2
allowed pairs), token_cost = 0.5 * a / b: the cost of a token in allowed pairs.

    python benchmarks/calibrate_placement.py [--seq 65536] [--heads 32 8] [--head-dim 128]

Writes placement_calibration_<kind>.{json,md} to --out ($OUT or benchmarks/results/).
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import jaxcp  # noqa: E402

LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def fwd_bwd(q, k, v, do, seg):
  f = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True)
  out, vjp = jax.vjp(f, q, k, v)
  return out, vjp(do)


def fit(lengths, seconds, seq_len):
  """(a, b, token_cost) of t = S * (a + b * L), least squares on t / S with weights 1 / (t / S)
  (relative errors: the short documents' times are small)."""
  x = np.asarray(lengths, np.float64)
  y = np.asarray(seconds, np.float64) / seq_len
  w = 1.0 / y
  a_mat = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
  (a, b), *_ = np.linalg.lstsq(a_mat, y * w, rcond=None)
  return float(a), float(b), float(0.5 * a / b)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq", type=int, default=65536)
  ap.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  s, (hq, hkv), d = args.seq, args.heads, args.head_dim
  key = jax.random.PRNGKey(0)
  q = jax.random.normal(key, (1, s, hq, d), jnp.bfloat16)
  k = jax.random.normal(jax.random.fold_in(key, 1), (1, s, hkv, d), jnp.bfloat16)
  v = jax.random.normal(jax.random.fold_in(key, 2), (1, s, hkv, d), jnp.bfloat16)
  do = jax.random.normal(jax.random.fold_in(key, 3), (1, s, hq, d), jnp.bfloat16)
  f = jax.jit(fwd_bwd)
  lengths = [n for n in LENGTHS if n <= s]
  seconds = []
  for n in lengths:
    seg = jnp.asarray(np.repeat(np.arange(1, s // n + 1, dtype=np.int32), n)[None])
    seconds.append(common.time_fn(f, q, k, v, do, seg, warmup=1, reps=args.reps))
    print(f"L={n:6d}: {seconds[-1] * 1e3:8.3f} ms", flush=True)
  a, b, token_cost = fit(lengths, seconds, s)
  model = [s * (a + b * n) for n in lengths]
  meta = common.run_metadata()
  rows = [[n, f"{t * 1e3:.3f}", f"{m * 1e3:.3f}", f"{m / t - 1:+.1%}"] for n, t, m in zip(lengths, seconds, model)]
  md = (f"Device: {meta['device']}, JAX {meta['jax']}, {meta['date']}; S={s}, {hq}/{hkv} heads, D={d}, causal "
        f"forward+backward, bf16, rows of equal documents of L tokens.\n\n"
        + common.markdown_table(["L", "measured ms", "fit ms", "fit error"], rows)
        + f"\nFit t = S * (a + b * L): a = {a:.3e} s, b = {b:.3e} s. DocumentPlacement cost: "
          f"token_cost = {token_cost:.0f}, pair_cost = 0.5.\n")
  common.write_results(common.result_name("placement_calibration", 1), dict(meta=meta, seq=s, heads=[hq, hkv], head_dim=d,
                                                     lengths=lengths, seconds=seconds, a=a, b=b,
                                                     token_cost=token_cost, pair_cost=0.5), md, args.out)
  print(md)


if __name__ == "__main__":
  main()
