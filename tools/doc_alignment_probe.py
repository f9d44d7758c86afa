"""How much of the short-document gap to cuDNN comes from documents that do not start on a tile
boundary: jaxcp's and cuDNN's packed forward on one row of equal documents whose length is a
multiple of the 128-token tile (each document starts a tile) or not (every document boundary
falls inside a query tile and a key tile), and on the benchmark's random mean-1k row.
  python tools/doc_alignment_probe.py [--seq 65536] [--heads 16] [--head-dim 128]
cuDNN takes documents as separate sequences (q_offsets), so its tiles always start at a document;
jaxcp's sm_90a forward starts its query tiles at documents (attention_doc_tiles_kernels.cu); the
"fixed" column is the same kernel with 128-token query tiles from token 0
(JAXCP_FWD_FIXED_TILES=1), which is how it ran before session 10."""
import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_attention as ba  # noqa: E402
import common  # noqa: E402


def equal_documents(seq_len, length):
  lengths, total = [], 0
  while total < seq_len:
    lengths.append(min(length, seq_len - total))
    total += lengths[-1]
  return [lengths]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq", type=int, default=65536)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--head-dim", type=int, default=128)
  a = ap.parse_args(argv)
  rows_by_name = {f"equal docs of {n}": equal_documents(a.seq, n) for n in (1024, 1000, 1100, 2048, 2000)}
  rows_by_name["random, mean 1k"] = common.packed_rows(np.random.default_rng(0), 1, a.seq, 1024)
  case = ba.Case("probe", 1, a.seq, 1024, q_heads=a.heads, kv_heads=a.heads, head_dim=a.head_dim)
  key = jax.random.PRNGKey(1)
  q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (1, a.seq, a.heads, a.head_dim), jnp.bfloat16)
             for i in range(3))
  print(f"{common.device_description()}, 1 x {a.seq}, {a.heads} heads, D {a.head_dim}, causal, forward")
  for name, rows in rows_by_name.items():
    seg, pos = common.segments_and_positions(rows, a.seq)
    flops = 4 * a.head_dim * a.heads * common.allowed_pairs(rows, causal=True)
    t_jaxcp = common.time_fn(jax.jit(ba._jaxcp(case, seg, pos)), q, k, v)
    os.environ["JAXCP_FWD_FIXED_TILES"] = "1"  # read per launch; a fresh jit captures it
    t_fixed = common.time_fn(jax.jit(ba._jaxcp(case, seg, pos)), q, k, v)
    del os.environ["JAXCP_FWD_FIXED_TILES"]
    t_cudnn = common.time_fn(jax.jit(ba._cudnn_packed(case, rows, jnp.bfloat16)), q, k, v)
    tf = lambda t: flops / t / 1e12  # noqa: E731
    print(f"{name:18s} jaxcp {tf(t_jaxcp):4.0f}  fixed tiles {tf(t_fixed):4.0f}  cuDNN {tf(t_cudnn):4.0f} TFLOP/s"
          f"  ratio {t_cudnn / t_jaxcp:.2f} (fixed {t_cudnn / t_fixed:.2f})", flush=True)


if __name__ == "__main__":
  main()
