"""Calibrates DocumentPlacement's cost model on the GPU from jaxcp's own kernel times, and the
exchange rate that jaxcp.exchange_cost charges for a shared token.

A segment of L tokens costs token_cost * L + pair_cost * L**2. Rows of S tokens cut into equal
documents of L tokens take t(L) = S * (a + b * L) (S / L documents of a * L + b * L**2 each), so a
straight-line fit of t / S against L gives a (the per-token part: tile edges, the plan, loads and
stores) and b (the per-pair part). With pair_cost = 0.5 (a causal document has about L**2 / 2
allowed pairs), token_cost = 0.5 * a / b: the cost of a token in allowed pairs. The ratio depends
on the heads (fewer query heads per key head: more per-token work), so each --heads pair gets
its own fit; pair_seconds = 2 b / (q_heads * head_dim) is what jaxcp.exchange_cost takes.

With more than one GPU visible, the exchange rate is timed too: bytes a rank receives per second
in an all-gather and in an all-to-all over 2, 4, ... GPUs (the shared region's two exchanges),
--exchange-mb per rank.

    python benchmarks/calibrate_placement.py [--seq 65536] [--heads 32 8 16 16] [--head-dim 128]

Writes placement_calibration_<kind>.{json,md} to --out ($OUT or benchmarks/results/): the first
pair's token_cost and pair_cost at the top (what bench_cp.py uses by default), every pair's fit
under "fits", the exchange rates under "exchange_bytes_per_s".
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import jaxcp  # noqa: E402
from jaxcp._src import compat  # noqa: E402

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


def kernel_fit(s, hq, hkv, d, reps):
  """One heads pair's fit: dict(heads, lengths, seconds, a, b, token_cost, pair_cost, pair_seconds)."""
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
    seconds.append(common.time_fn(f, q, k, v, do, seg, warmup=1, reps=reps))
    print(f"{hq}/{hkv} L={n:6d}: {seconds[-1] * 1e3:8.3f} ms", flush=True)
  a, b, token_cost = fit(lengths, seconds, s)
  return dict(heads=[hq, hkv], lengths=lengths, seconds=seconds, a=a, b=b, token_cost=token_cost, pair_cost=0.5,
              pair_seconds=2 * b / (hq * d))


def exchange_rates(reps, bytes_per_rank):
  """{"all_gather" | "all_to_all": {n: bytes a rank receives per second}} over the first n GPUs,
  n = 2, 4, ... up to the devices visible, bytes_per_rank sent by each."""
  rates = {"all_gather": {}, "all_to_all": {}}
  n = 2
  while n <= len(jax.devices()):
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    per_rank = bytes_per_rank // 2  # bf16 elements
    x = jax.device_put(jnp.zeros((n * per_rank,), jnp.bfloat16), NamedSharding(mesh, P("x")))
    ops = {"all_gather": (lambda a: jax.lax.all_gather(a, "x", tiled=True), (n - 1) * bytes_per_rank),
           "all_to_all": (lambda a: jax.lax.all_to_all(a.reshape(n, -1), "x", 0, 0, tiled=True).reshape(-1),
                          (n - 1) * bytes_per_rank // n)}
    for name, (op, received) in ops.items():
      f = jax.jit(compat.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
      t = common.time_fn(f, x, warmup=1, reps=reps)
      rates[name][n] = received / t
      print(f"{name} over {n} GPUs: {received / t / 1e9:.0f} GB/s received per rank", flush=True)
    n *= 2
  return rates


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq", type=int, default=65536)
  ap.add_argument("--heads", type=int, nargs="+", default=[32, 8], help="pairs of query / key-value heads")
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--exchange-mb", type=int, default=256, help="MB each rank sends in the timed exchanges")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  if len(args.heads) % 2:
    ap.error("--heads takes pairs: query heads, key-value heads")
  s, d = args.seq, args.head_dim
  fits = [kernel_fit(s, hq, hkv, d, args.reps) for hq, hkv in zip(args.heads[::2], args.heads[1::2])]
  rates = exchange_rates(args.reps, args.exchange_mb << 20)
  meta = common.run_metadata()
  md = (f"Device: {meta['device']}, JAX {meta['jax']}, {meta['date']}; S={s}, D={d}, causal forward+backward, bf16, "
        f"rows of equal documents of L tokens.\n")
  for ft in fits:
    model = [s * (ft["a"] + ft["b"] * n) for n in ft["lengths"]]
    rows = [[n, f"{t * 1e3:.3f}", f"{m * 1e3:.3f}", f"{m / t - 1:+.1%}"]
            for n, t, m in zip(ft["lengths"], ft["seconds"], model)]
    md += (f"\n{ft['heads'][0]}/{ft['heads'][1]} heads:\n\n"
           + common.markdown_table(["L", "measured ms", "fit ms", "fit error"], rows)
           + f"\nFit t = S * (a + b * L): a = {ft['a']:.3e} s, b = {ft['b']:.3e} s. DocumentPlacement cost: "
             f"token_cost = {ft['token_cost']:.0f}, pair_cost = 0.5; pair_seconds = {ft['pair_seconds']:.3e}.\n")
  if any(rates.values()):
    md += f"\nExchange rate (bytes a rank receives per second, {args.exchange_mb} MB sent per rank):\n\n" + common.markdown_table(
        ["GPUs", "all-gather GB/s", "all-to-all GB/s"],
        [[n, f"{rates['all_gather'][n] / 1e9:.0f}", f"{rates['all_to_all'][n] / 1e9:.0f}"] for n in rates["all_gather"]])
  first = fits[0]
  common.write_results(common.result_name("placement_calibration", 1),
                       dict(meta=meta, seq=s, head_dim=d, heads=first["heads"], token_cost=first["token_cost"],
                            pair_cost=first["pair_cost"], a=first["a"], b=first["b"], fits=fits,
                            exchange_bytes_per_s=rates), md, args.out)
  print(md)


if __name__ == "__main__":
  main()
