"""A training step of one small-seq cross-attention layer, as a recommendation model runs it: each
row's query from its features and its 1..16 keys / values from its memory, through bf16
projections, attention, an output projection and a squared loss; jax.value_and_grad over the four
projection matrices, jitted. jaxcp.small_seq_attention against XLA's jax.nn.dot_product_attention
(padding mask) in the same program shape, timed interleaved (common.time_interleaved); each
step's loss and gradients checked against XLA's, and the matmuls in each compiled HLO counted (a
backward that needs no dQ and dK, as with one key, leaves the q and k projections' backward out).

A single-call benchmark (bench_small_seq.py) times the attention's own VJP, whose dQ and dK a
caller receives as arrays; inside a model JAX passes zeros it knows of (symbolic zeros) on
without computing them.

Writes small_seq_layer_<kind>.json + .md (kind: the device, e.g. h200) to --out, $OUT or
benchmarks/results/.

  python benchmarks/bench_small_seq_layer.py            # GPU shapes
  python benchmarks/bench_small_seq_layer.py --quick    # tiny shapes, runs on the CPU too
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import jaxcp  # noqa: E402

MODEL_DIM = 512
# (rows, keys, query heads, key/value heads, head dim)
GPU_SHAPES = [(262144, 1, 8, 8, 64), (262144, 1, 4, 1, 128), (65536, 1, 32, 8, 64),
              (262144, 4, 4, 4, 64), (262144, 16, 8, 8, 64)]
QUICK_SHAPES = [(256, 1, 4, 1, 64), (256, 4, 4, 4, 64)]


def layer_step(attention, rows, keys, hq, hkv, d):
  """value_and_grad of the layer's loss over its projections, for attention(q, k, v, lengths)."""
  def loss(params, x, memory, lengths):
    q = (x @ params["wq"]).reshape(rows, hq, d)
    k = (memory @ params["wk"]).reshape(rows, keys, hkv, d)
    v = (memory @ params["wv"]).reshape(rows, keys, hkv, d)
    y = attention(q, k, v, lengths).reshape(rows, hq * d) @ params["wo"]
    return jnp.mean(jnp.square(y.astype(jnp.float32) - x.astype(jnp.float32)))
  return jax.jit(jax.value_and_grad(loss))


def jaxcp_attention(q, k, v, lengths):
  return jaxcp.small_seq_attention(q, k, v, kv_lengths=lengths)


def xla_attention(q, k, v, lengths):
  return jax.nn.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=lengths, implementation="xla")[:, 0]


def inputs(rows, keys, hq, hkv, d, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.PRNGKey(0), 6)
  init = lambda key, shape: (jax.random.normal(key, shape, jnp.float32) * shape[0] ** -0.5).astype(dtype)
  params = dict(wq=init(ks[0], (MODEL_DIM, hq * d)), wk=init(ks[1], (MODEL_DIM, hkv * d)),
                wv=init(ks[2], (MODEL_DIM, hkv * d)), wo=init(ks[3], (hq * d, MODEL_DIM)))
  x = jax.random.normal(ks[4], (rows, MODEL_DIM), dtype)
  memory = jax.random.normal(ks[5], (rows, keys, MODEL_DIM), dtype)
  lengths = jnp.asarray(np.random.default_rng(0).integers(1, keys + 1, rows), jnp.int32)
  return params, x, memory, lengths


def matmuls(step, args) -> int:
  """dot instructions and cuBLAS calls in the step's compiled HLO."""
  hlo = step.lower(*args).compile().as_text()
  return hlo.count(" dot(") + hlo.count('custom_call_target="__cublas')


def max_rel_err(a, b) -> float:
  a, b = (np.asarray(x, np.float32) for x in (a, b))
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def run_shape(shape) -> dict:
  rows, keys, hq, hkv, d = shape
  args = inputs(*shape)
  steps = {"jaxcp": layer_step(jaxcp_attention, *shape), "xla": layer_step(xla_attention, *shape)}
  outs = {name: jax.block_until_ready(step(*args)) for name, step in steps.items()}
  times = common.time_interleaved({name: (step, args) for name, step in steps.items()})
  (loss_j, grads_j), (loss_x, grads_x) = outs["jaxcp"], outs["xla"]
  err = max(max_rel_err(loss_j, loss_x), *(max_rel_err(grads_j[n], grads_x[n]) for n in grads_x))
  counts = {name: matmuls(step, args) for name, step in steps.items()}
  r = dict(name=f"B={rows} Skv={keys} {hq}/{hkv} D{d}", rows=rows, keys=keys, q_heads=hq, kv_heads=hkv,
           head_dim=d, model_dim=MODEL_DIM, jaxcp_ms=times["jaxcp"] * 1e3, xla_ms=times["xla"] * 1e3,
           speedup=times["xla"] / times["jaxcp"], jaxcp_matmuls=counts["jaxcp"], xla_matmuls=counts["xla"],
           max_rel_err=err)
  print(f"{r['name']}: step jaxcp {r['jaxcp_ms']:.3f} ms ({r['jaxcp_matmuls']} matmuls), XLA {r['xla_ms']:.3f} "
        f"ms ({r['xla_matmuls']} matmuls), {r['speedup']:.2f}x; max rel err of loss and gradients {err:.1e}",
        flush=True)
  return r


def markdown(meta, results) -> str:
  head = (f"Device: {meta['device']}, JAX {meta['jax']}, {meta['date']}. A training step of one cross-attention "
          f"layer (bf16, {MODEL_DIM}-wide projections of q from the row's features and k, v from its memory; "
          "attention; output projection; squared loss), value_and_grad over the projections, jitted; "
          "key lengths uniform in [1, Skv]. XLA: jax.nn.dot_product_attention (implementation='xla', padding mask).\n\n")
  rows = [(r["name"], f"{r['jaxcp_ms']:.3f}", f"{r['xla_ms']:.3f}", f"{r['speedup']:.2f}x",
           f"{r['jaxcp_matmuls']} / {r['xla_matmuls']}", f"{r['max_rel_err']:.1e}") for r in results]
  return head + common.markdown_table(
      ["shape", "jaxcp step ms", "XLA step ms", "jaxcp speedup", "matmuls jaxcp / XLA", "max rel err vs XLA"], rows)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny shapes (runs on the CPU)")
  parser.add_argument("--out", default=None, help="output folder (default $OUT or benchmarks/results)")
  args = parser.parse_args(argv)
  meta = common.run_metadata()
  print(meta["device"], flush=True)
  results = [run_shape(s) for s in (QUICK_SHAPES if args.quick else GPU_SHAPES)]
  out = common.write_results(common.result_name("small_seq_layer"), dict(meta=meta, results=results),
                             markdown(meta, results), args.out)
  print(f"wrote {out}/{common.result_name('small_seq_layer')}.json and .md")
  worst = max(r["max_rel_err"] for r in results)
  if worst > 2e-2:
    raise SystemExit(f"a step's loss or gradients differ from XLA's by {worst:.1e}")


if __name__ == "__main__":
  main()
