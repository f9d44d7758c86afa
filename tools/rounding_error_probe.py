"""How far the CUDA kernels' gradients are from the exact result on the GPU property tests' random
rows, next to how far the roundings of a flash-attention kernel alone take them
(tests/rounded_reference.py): the measurement behind those tests' gradient tolerance.

For each of N fresh examples of a property test's strategy it prints, per tensor, the worst row
error (tests/helpers.py's row_errors, floor 1.0) of jaxcp and of JAX's XLA path against the exact
float64 result and of the bfloat16 rounding model; at the end, jaxcp's worst rows over the
model's, and the most of the GPU property tests' gradient tolerance (helpers.grads_close) that
any row used. The rows of the example that used most go to $OUT/rounding_worst.npz.

  python3 tools/rounding_error_probe.py [--test cross|packed] [--mask window] [--examples 100]
      [--head-dim 128] [--dtype bfloat16|float16] [--kv-heads 2]
"""
import argparse
import os
import sys
import warnings

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests import test_gpu_properties as props  # noqa: E402
from tests.helpers import GRAD_MODEL_MARGIN, GRAD_ROW_TOL, allowed_pairs, row_errors  # noqa: E402
from tests.rounded_reference import attention_grads  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--test", choices=["cross", "packed"], default="cross")
  ap.add_argument("--mask", default="window")
  ap.add_argument("--examples", type=int, default=100)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
  ap.add_argument("--kv-heads", type=int, default=props.HKV)
  a = ap.parse_args()
  strategy = props.cross_batch() if a.test == "cross" else props.packed_batch(props.S)
  mask = props.MASKS[a.mask]
  names = ["out", "dq", "dk", "dv"]
  dtype = jnp.dtype(a.dtype)
  worst, worst_used = None, -1.0
  over_model = {name: [] for name in names}  # per example: jaxcp's worst row error / the model's
  # per example: the most of its tolerance that a gradient row uses under tests/helpers.py's
  # grads_close (>= 1 fails): row error / max(GRAD_ROW_TOL, GRAD_MODEL_MARGIN x the model's)
  tol_used = {name: [] for name in names[1:]}
  for n in range(a.examples):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      batch = strategy.example()
    q_seg, q_pos, kv_seg, kv_pos = batch if a.test == "cross" else (*batch, *batch)
    inputs = props._inputs(a.head_dim, q_seg.shape[1], kv_seg.shape[1], dtype, a.kv_heads)
    args = (*inputs, q_seg, q_pos, kv_seg, kv_pos)
    got = props._runner("cuda", a.mask)(*args)
    xla = props._runner("xla", a.mask)(*args)
    pairs = allowed_pairs(q_seg, q_pos, kv_seg, kv_pos, causal=mask.get("is_causal", False),
                          window=mask.get("local_window_size"), chunk=mask.get("chunk_size"))
    exact = attention_grads(*inputs, pairs)
    model = attention_grads(*inputs, pairs, rounding=dtype)
    pick = lambda r: [r[0], *r[2:]]  # drop lse
    line, used = [], 0.0
    for name, g, x, e, m in zip(names, pick(got), pick(xla), exact, model):
      eg, ex, em = (row_errors(t, e, floor=1.0) for t in (g, x, m))
      over_model[name].append(eg.max() / max(em.max(), 1e-6))
      if name in tol_used:
        tol_used[name].append(float(np.max(eg / np.maximum(GRAD_ROW_TOL, GRAD_MODEL_MARGIN * em))))
        used = max(used, tol_used[name][-1])
      line.append(f"{name} jaxcp {eg.max():.3f} xla {ex.max():.3f} model {em.max():.3f}")
    print(f"{n:3d} {' | '.join(line)} | tolerance used {used:.2f}", flush=True)
    if used > worst_used:
      worst_used, worst = used, dict(q_seg=q_seg, q_pos=q_pos, kv_seg=kv_seg, kv_pos=kv_pos)
  print("jaxcp's worst row / the model's worst row, mean (max) over examples: " +
        ", ".join(f"{k} {np.mean(v):.2f} ({np.max(v):.2f})" for k, v in over_model.items()))
  print("the most of grads_close's tolerance a row used (fails at 1): " +
        ", ".join(f"{k} {np.max(v):.2f}" for k, v in tol_used.items()))
  np.savez(os.path.join(os.environ.get("OUT", "."), "rounding_worst.npz"), **worst)


if __name__ == "__main__":
  main()
