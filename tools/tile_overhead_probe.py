"""What a query tile costs beyond its key tiles: jaxcp's and cuDNN's packed causal forward on one
row of equal documents (L tokens: query tile i of a document walks i + 1 key tiles) and of one
document under a sliding window (every query tile walks about window / 128 + 1), with a
least-squares fit of time = a * (key tiles walked) + x * (query tiles), per implementation.
x / a is the per-query-tile overhead in key-tile times: what short documents and windows pay.
  python tools/tile_overhead_probe.py [--seq 65536] [--heads 16] [--head-dim 128]"""
import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_attention as ba  # noqa: E402
import common  # noqa: E402

TILE = 128


def walked_tiles(seq, doc, window):
  """(key tiles walked, query tiles) of one row of equal documents of `doc` tokens."""
  walked = queries = 0
  for i in range(doc // TILE):
    hi = i + 1  # key tiles [lo, hi) of the document, aligned to its start
    lo = 0 if window is None else max(0, (i * TILE - window + 1) // TILE)
    walked += hi - lo
    queries += 1
  return walked * (seq // doc), queries * (seq // doc)


def time_against_cudnn(case, rows, q, k, v):
  """jaxcp's and cuDNN's forward on these rows, timed interleaved: (jaxcp seconds, cuDNN seconds,
  both times with their TFLOP/s over allowed pairs and the ratio, as printed)."""
  seg, pos = common.segments_and_positions(rows, case.seq_len)
  calls = {"jaxcp": (jax.jit(ba._jaxcp(case, seg, pos)), (q, k, v)),
           "cudnn": (jax.jit(ba._cudnn_packed(case, rows, jnp.bfloat16)), (q, k, v))}
  for fn, args in calls.values():
    jax.block_until_ready(fn(*args))
  t = common.time_interleaved(calls, rounds=2)
  window = (case.window - 1, 0) if case.window else None
  flops = 4 * case.head_dim * case.q_heads * common.allowed_pairs(rows, causal=True, window=window)
  text = (f"jaxcp {t['jaxcp'] * 1e3:.3f} ms {flops / t['jaxcp'] / 1e12:4.0f} TFLOP/s  "
          f"cuDNN {t['cudnn'] * 1e3:.3f} ms {flops / t['cudnn'] / 1e12:4.0f}  ratio {t['cudnn'] / t['jaxcp']:.2f}")
  return t["jaxcp"], t["cudnn"], text


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq", type=int, default=65536)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--mix", nargs="?", const="cases", choices=["cases", "docs"],
                  help="instead: the window and short-document benchmark cases with their rows regrouped "
                       "(cases), or the window case's documents changed one property at a time (docs)")
  a = ap.parse_args(argv)
  if a.mix:
    return mix(a)
  shapes = [(doc, None) for doc in (256, 512, 1024, 2048, 4096, 8192)]
  shapes += [(16384, w) for w in (512, 1024, 2048)]
  key = jax.random.PRNGKey(1)
  q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (1, a.seq, a.heads, a.head_dim), jnp.bfloat16)
             for i in range(3))
  print(f"{common.device_description()}, 1 x {a.seq}, {a.heads} heads, D {a.head_dim}, causal, forward")
  rows_out = []
  for doc, window in shapes:
    rows = [[doc] * (a.seq // doc)]
    case = ba.Case("probe", 1, a.seq, doc, q_heads=a.heads, kv_heads=a.heads, head_dim=a.head_dim, window=window)
    t_jaxcp, t_cudnn, text = time_against_cudnn(case, rows, q, k, v)
    walked, queries = walked_tiles(a.seq, doc, window)
    rows_out.append((walked, queries, t_jaxcp, t_cudnn))
    print(f"doc {doc:5d} window {str(window):5s} key tiles/query tile {walked / queries:5.1f}  {text}", flush=True)
  m = np.array([[w, n] for w, n, _, _ in rows_out], np.float64)
  for col, name in ((2, "jaxcp"), (3, "cuDNN")):
    y = np.array([r[col] for r in rows_out])
    (ka, kx), *_ = np.linalg.lstsq(m, y, rcond=None)
    per = a.heads  # tiles per head above; per (tile, head) below
    print(f"{name}: {ka / per * 1e9:.0f} ns per key tile, {kx / per * 1e9:.0f} ns per query tile "
          f"(x / a = {kx / ka:.1f} key tiles)")


def mix(a):
  """The benchmark's window-1024 and mean-1k cases next to the same tokens regrouped (one row of
  all their documents; each row one document), to see what of their gap to cuDNN comes from the
  documents' mix, the batch, or the window."""
  rng = np.random.default_rng(0)
  rows4k = common.packed_rows(rng, 4, 16384, 4096)  # as bench_attention.py draws 4x16k doc4k
  rows1k = common.packed_rows(np.random.default_rng(0), 2, 8192, 1024)
  cases = [("4x16k docs, window 1024", rows4k, 1024), ("1x64k same docs, window 1024", [sum(rows4k, [])], 1024),
           ("4x16k one doc/row, window 1024", [[16384]] * 4, 1024), ("1x64k one doc, window 1024", [[65536]], 1024),
           ("1x64k docs of 4096, window 1024", [[4096] * 16], 1024),
           ("1x64k docs of 4000, window 1024", [[4000] * 16 + [1536]], 1024),
           ("1x64k docs of 4096, causal", [[4096] * 16], None),
           ("1x64k docs of 4000, causal", [[4000] * 16 + [1536]], None),
           ("4x16k docs, causal", rows4k, None), ("2x8k docs (mean 1k)", rows1k, None)]
  if a.mix == "docs":  # which property of the benchmark's documents costs the window case
    flat = sum(rows4k, [])
    merged = []
    for n in flat:  # documents under kAnchorRun tokens folded into the one before
      if n < 64 and merged:
        merged[-1] += n
      else:
        merged.append(n)
    rounded = [max(128, round(n / 128) * 128) for n in flat]
    rounded[-1] += 65536 - sum(rounded)
    cases = [("1x64k bench docs, window 1024", [flat], 1024),
             ("1x64k no docs < 64, window 1024", [merged], 1024),
             ("1x64k docs sorted, window 1024", [sorted(flat)], 1024),
             ("1x64k docs on 128s, window 1024", [rounded], 1024),
             ("1x64k bench docs, causal", [flat], None)]
  key = jax.random.PRNGKey(1)
  print(f"{common.device_description()}, {a.heads} heads, D {a.head_dim}, forward")
  for name, rows, window in cases:
    b, s = len(rows), sum(rows[0])
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (b, s, a.heads, a.head_dim), jnp.bfloat16)
               for i in range(3))
    case = ba.Case(name, b, s, 1, q_heads=a.heads, kv_heads=a.heads, head_dim=a.head_dim, window=window)
    print(f"{name:32s} docs/row {[len(r) for r in rows]}  {time_against_cudnn(case, rows, q, k, v)[2]}", flush=True)

if __name__ == "__main__":
  main()
