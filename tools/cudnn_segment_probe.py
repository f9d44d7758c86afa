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

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_attention as ba  # noqa: E402
import common  # noqa: E402
import grad_check_long_rows as grad_check  # noqa: E402

HEAD_DIM = 128


def probe(seq, hq, hkv, n):
  """cuDNN's first wrong document per gradient on one row of n equal documents."""
  rows = [[seq // n] * (n - 1) + [seq - (seq // n) * (n - 1)]]
  case = ba.Case("probe", 1, seq, seq // n, hq, hkv, HEAD_DIM)
  seg, pos = common.segments_and_positions(rows, seq)
  inputs = ba.case_inputs(case, jnp.bfloat16)
  ref = [np.asarray(g, np.float32) for g in ba.fwd_bwd_fn(ba._jaxcp(case, seg, pos))(*inputs)]
  errs = grad_check.errors(ba.fwd_bwd_fn(ba._cudnn_packed(case, rows, jnp.bfloat16))(*inputs), ref, rows)
  return {g: e["bad_docs"][0][1] for g, e in errs.items() if e["bad_docs"]}, rows[0][0]


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
