"""Forward accuracy against a float64 reference: jaxcp's kernels and JAX's cuDNN attention on the
same packed bf16 / fp16 inputs, relative L2 error of the output over live tokens.

Each implementation rounds P (the probabilities) to the input dtype before the P V product, at
a scale set by the max it subtracts (the running max, or the sm_90a kernel's lazy reference).
Two implementations that subtract the same max round identically and agree with each other far
more closely than either agrees with the exact answer, so this script measures against float64
instead of against each other:
- "jaxcp": the default kernel (sm_90a on Hopper: a lazy reference max, ffi/cuda/attention/device.cuh);
- "jaxcp sm80": the sm_80 kernel (private kernel option sm80_only; it keeps the running max, like cuDNN);
- "cudnn_packed": JAX's cuDNN attention in its packed-document form.
Score spreads: q as drawn ("x1") and q times 4 ("x4": peaked rows, whose max moves more).

  python benchmarks/accuracy_attention.py [--out DIR]      (GPU; on the CPU: jaxcp only)
  python benchmarks/accuracy_attention.py --quick          (1 x 256, D 64: a smoke run)

Writes accuracy_<kind>.{json,md} (kind: the device, e.g. h100) to --out, $OUT or benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jaxcp._src.attention.api import attention_with_options
from jaxcp._src.kernel_options import AttentionKernelOptions

sys.path.insert(0, os.path.dirname(__file__))
import bench_attention as ba  # noqa: E402
import common  # noqa: E402

BATCH, SEQ, Q_HEADS, KV_HEADS, MEAN_DOC = 2, 2048, 4, 2, 512
CONFIGS = [(64, jnp.bfloat16), (128, jnp.bfloat16), (256, jnp.bfloat16), (128, jnp.float16)]
QUICK = dict(batch=1, seq=256, mean_doc=64, configs=[(64, jnp.bfloat16)])
SPREADS = (1.0, 4.0)


def reference_f64(q, k, v, seg, pos):
  """Causal attention within documents, in float64 on the host."""
  q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  out = np.zeros_like(q)
  for b in range(q.shape[0]):
    allowed = (seg[b][:, None] == seg[b][None, :]) & (pos[b][None, :] <= pos[b][:, None]) & (seg[b][:, None] != 0)
    for h in range(q.shape[2]):
      s = q[b, :, h] @ k[b, :, h // group].T / np.sqrt(q.shape[-1])
      s = np.where(allowed, s, -np.inf)
      m = s.max(axis=1, keepdims=True)
      p = np.exp(s - np.where(np.isfinite(m), m, 0))
      denom = p.sum(axis=1, keepdims=True)
      out[b, :, h] = (p @ v[b, :, h // group]) / np.where(denom > 0, denom, 1)
  return out


def _jaxcp_sm80(case, seg, pos):
  """ba._jaxcp's call on the sm_80 kernels, chosen by the private kernel options."""
  seg, pos = jnp.asarray(seg), jnp.asarray(pos)
  window = (case.window - 1, 0) if case.window else None
  options = AttentionKernelOptions(sm80_only=True)

  def f(q, k, v):
    return attention_with_options(q, k, v, segment_ids=seg, positions=pos, is_causal=True, local_window_size=window,
                                  chunk_size=case.chunk, kernel_options=options)
  return f


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="output folder (default $OUT or benchmarks/results)")
  parser.add_argument("--quick", action="store_true", help="one tiny case (runs on the CPU too)")
  args = parser.parse_args(argv)
  size = QUICK if args.quick else dict(batch=BATCH, seq=SEQ, mean_doc=MEAN_DOC, configs=CONFIGS)
  batch, seq = size["batch"], size["seq"]
  gpu = jax.default_backend() == "gpu"
  rows = common.packed_rows(np.random.default_rng(0), batch, seq, size["mean_doc"])
  seg, pos = common.segments_and_positions(rows, seq)
  live = seg != 0
  results = []
  for head_dim, dtype in size["configs"]:
    case = ba.Case("accuracy", batch, seq, size["mean_doc"], Q_HEADS, KV_HEADS, head_dim)
    jaxcp_fn = jax.jit(ba._jaxcp(case, seg, pos))
    impls = {"jaxcp": jaxcp_fn}
    if gpu:
      impls["jaxcp sm80"] = jax.jit(_jaxcp_sm80(case, seg, pos))
      impls["cudnn_packed"] = jax.jit(ba._cudnn_packed(case, rows, dtype))
    for spread in SPREADS:
      key = jax.random.PRNGKey(head_dim)
      q = (spread * jax.random.normal(key, (batch, seq, Q_HEADS, head_dim), jnp.float32)).astype(dtype)
      k = jax.random.normal(jax.random.fold_in(key, 1), (batch, seq, KV_HEADS, head_dim), dtype)
      v = jax.random.normal(jax.random.fold_in(key, 2), (batch, seq, KV_HEADS, head_dim), dtype)
      ref = reference_f64(q, k, v, seg, pos)
      errs = {name: ba._rel_err(fn(q, k, v), ref, live) for name, fn in impls.items()}
      results.append(dict(head_dim=head_dim, dtype=jnp.dtype(dtype).name, spread=spread, rel_err_vs_f64=errs))
      print(head_dim, jnp.dtype(dtype).name, f"x{spread:g}", {n: f"{e:.2e}" for n, e in errs.items()}, flush=True)
  names = list(results[0]["rel_err_vs_f64"])
  table = common.markdown_table(
      ["D", "dtype", "q spread"] + names,
      [[r["head_dim"], r["dtype"], f"x{r['spread']:g}"] + [f"{r['rel_err_vs_f64'][n]:.2e}" for n in names]
       for r in results])
  header = (f"Device: {common.device_description()}. Forward output, relative L2 error against float64, "
            f"B x S = {batch} x {seq}, {Q_HEADS}/{KV_HEADS} heads, causal, mean document {size['mean_doc']}.\n\n")
  path = common.write_results(common.result_name("accuracy"), dict(meta=common.run_metadata(), results=results),
                              header + table, args.out)
  print(header + table)
  print("written:", path)


if __name__ == "__main__":
  main()
