"""Where JAX's cuDNN packed-document backward starts returning wrong dq: rows of n equal
documents at several head layouts, cuDNN's gradients against jaxcp's (which
benchmarks/grad_check_long_rows.py checks against a float32 reference), per document.

Prints, for each layout and document count, the first document whose dq (or dk, dv) is more
than 5e-2 off (relative L2), or "ok". Session 34 (H200, JAX 0.11.2, cuDNN 9.19.0): dq went wrong
from document 2^32 / (Hq * S * D) on, at every point tried; dk and dv never.

  python tools/cudnn_segment_probe.py [--seq 8192,65536] [--heads 16/16,32/8] [--docs 8,33]   (GPU)
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_attention as ba  # noqa: E402
import common  # noqa: E402

HEAD_DIM = 128


def first_bad(grads, ref, rows):
  """Per gradient name, the index of the first document off by more than PEER_MAX_REL_ERR."""
  out = {}
  for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
    g, r = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (g, r))
    start = 0
    for i, n in enumerate(rows[0]):
      a, b = g[0, start:start + n], r[0, start:start + n]
      if not np.linalg.norm(a - b) <= ba.PEER_MAX_REL_ERR * np.linalg.norm(b):
        out[name] = i
        break
      start += n
  return out


def probe(seq, hq, hkv, n):
  """cuDNN's first wrong document per gradient on one row of n equal documents."""
  rows = [[seq // n] * (n - 1) + [seq - (seq // n) * (n - 1)]]
  case = ba.Case("probe", 1, seq, seq // n, hq, hkv, HEAD_DIM)
  seg, pos = common.segments_and_positions(rows, seq)
  key = jax.random.PRNGKey(n)
  q = jax.random.normal(key, (1, seq, hq, HEAD_DIM), jnp.bfloat16)
  k = jax.random.normal(jax.random.fold_in(key, 1), (1, seq, hkv, HEAD_DIM), jnp.bfloat16)
  v = jax.random.normal(jax.random.fold_in(key, 2), (1, seq, hkv, HEAD_DIM), jnp.bfloat16)
  do = jax.random.normal(jax.random.fold_in(key, 3), (1, seq, hq, HEAD_DIM), jnp.bfloat16)
  grads = {name: jax.jit(lambda q, k, v, do, fn=fn: jax.vjp(fn, q, k, v)[1](do))(q, k, v, do)
           for name, fn in (("jaxcp", ba._jaxcp(case, seg, pos)),
                            ("cudnn", ba._cudnn_packed(case, rows, jnp.bfloat16)))}
  return first_bad(grads["cudnn"], grads["jaxcp"], rows), rows[0][0]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seq", default="8192", help="row lengths, comma separated")
  ap.add_argument("--heads", default="16/16,32/32,8/8,32/8,16/8,16/4,8/2", help="q/kv head counts")
  ap.add_argument("--docs", default="4,8,9,16,17,32,33,64", help="documents per row")
  args = ap.parse_args()
  print(common.run_metadata())
  for seq in map(int, args.seq.split(",")):
    for hq, hkv in (tuple(map(int, h.split("/"))) for h in args.heads.split(",")):
      for n in map(int, args.docs.split(",")):
        bad, length = probe(seq, hq, hkv, n)
        print(f"S {seq}, {hq}/{hkv} heads, {n} docs of {length}: "
              + (", ".join(f"{g} wrong from doc {i} (token {i * length})" for g, i in bad.items()) or "ok"), flush=True)


if __name__ == "__main__":
  main()
