"""How much device memory JAX's cuDNN packed-document attention asks for, as a function of its
document capacity M (the width of q_seqlen / q_offsets), from XLA's compiled memory analysis: no
kernel runs, so capacities far past the card's memory can be read too.

../shared/ANCHORS.md lists cuDNN running out of memory on 1 x 32k (130 GiB asked), 1 x 64k
(520 GiB) and 4 x 16k with 32/8 heads (258 GiB): the capacities that ask for those sizes are the
form of the call the anchors measured. Session 35 (H200, JAX 0.11.2, cuDNN 9.19.0): M = S/64 asks
130.5 and 521.0 GiB for the first two; the third fits M = S/128 (259.3 GiB), not S/64 (517.3).

  python tools/cudnn_capacity_probe.py [--only 1x32k] [--per-doc own,128,64]   (GPU)
"""
from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_attention as ba  # noqa: E402
import common  # noqa: E402

GIB = 2 ** 30


def asked_gib(jitted, args):
  """Bytes the compiled call needs beyond its arguments (temporaries + outputs), in GiB."""
  stats = jitted.lower(*args).compile().memory_analysis()
  return (stats.temp_size_in_bytes + stats.output_size_in_bytes) / GIB


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", default="", help="substring of the benchmark's case names")
  ap.add_argument("--per-doc", default="own,128,64",
                  help="capacities: 'own' (the rows' own count) or tokens per document t (M = S/t)")
  args = ap.parse_args()
  print(common.run_metadata())
  for case in (c for c in ba.GPU_CASES if args.only in c.name and c.chunk is None):
    rows = ba.case_rows(case)
    q, k, v, dout = ba.case_inputs(case, jnp.bfloat16)
    for per_doc in args.per_doc.split(","):
      m = None if per_doc == "own" else ba.static_doc_capacity(case.seq_len, int(per_doc))
      calls = ba._calls(ba._cudnn_packed(case, rows, jnp.bfloat16, m), q, k, v, dout)
      asked = {mode: asked_gib(f, call_args) for mode, (f, call_args) in calls.items()}
      label = f"M = {max(map(len, rows))} (own)" if m is None else f"M = S/{per_doc} = {m}"
      print(f"{case.name}: {label}: fwd {asked['fwd']:.1f} GiB, fwd+bwd {asked['fwd_bwd']:.1f} GiB", flush=True)


if __name__ == "__main__":
  main()
