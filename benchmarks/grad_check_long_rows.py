"""Gradients of the benchmark's cases against a float32 reference computed one document at a
time: jaxcp and JAX's cuDNN attention (packed form) on the same bf16 inputs as
bench_attention.py, relative L2 error of dq, dk and dv over live tokens, overall and for the
worst document.

Attention never crosses a document, so each document's gradients are those of plain causal
attention over its own tokens: the reference stays small (one document and one query head at a
time) on rows where a whole-row reference would need S x S scores. It tells which of two
disagreeing implementations is wrong.

  python benchmarks/grad_check_long_rows.py [--only SUBSTR] [--out DIR]   (GPU)
  python benchmarks/grad_check_long_rows.py --quick                        (CPU smoke run)

Writes grad_check_<kind>.{json,md} (kind: the device, e.g. h200) to --out, $OUT or
benchmarks/results/.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import bench_attention as ba  # noqa: E402
import common  # noqa: E402

PAD_TO = 1024  # documents are padded to a multiple of this (fewer compiles; see _doc_grads)


@functools.partial(jax.jit, static_argnames="window")
def _doc_grads(q, k, v, dout, window=None):
  """dq, dk, dv of causal attention within one document, float32: q [L, G, D] (G query heads of
  one KV head), k [L, D], v [L, Dv], dout [L, G, Dv]; window: a query sees itself and the
  window - 1 tokens before it. Rows past the document's end carry zero dout, so they add nothing
  to dk / dv, and causality keeps their keys from every real row."""
  scale = q.shape[-1] ** -0.5
  back = jnp.arange(q.shape[0])[:, None] - jnp.arange(q.shape[0])[None, :]  # query - key position
  causal = (back >= 0) & (back < window) if window else back >= 0

  def attend(q, k, v):
    s = jnp.einsum("lgd,md->glm", q, k, precision="highest") * scale
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    return jnp.einsum("glm,md->lgd", p, v, precision="highest")

  return jax.vjp(attend, q, k, v)[1](dout)


def reference_grads(q, k, v, dout, rows, window=None):
  """dq, dk, dv (float32 numpy) of packed causal attention, one document and query head at a time;
  rows: each row's document lengths (tokens after the last are padding)."""
  q, k, v, dout = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (q, k, v, dout))
  dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  group = q.shape[2] // k.shape[2]
  for b, row in enumerate(rows):
    start = 0
    for length in row:
      end, padded = start + length, -(-length // PAD_TO) * PAD_TO

      def take(x, heads):
        piece = x[b, start:end, heads]
        return np.pad(piece, [(0, padded - length)] + [(0, 0)] * (piece.ndim - 1))

      for h in range(q.shape[2]):  # one query head at a time: a 49k-token document's L x L scores fit
        qh = slice(h, h + 1)
        g_q, g_k, g_v = (np.asarray(x)[:length] for x in _doc_grads(
            take(q, qh), take(k, h // group), take(v, h // group), take(dout, qh), window=window))
        dq[b, start:end, qh] = g_q
        dk[b, start:end, h // group] += g_k  # the KV head's gradient sums over its query heads
        dv[b, start:end, h // group] += g_v
      start = end
  return dq, dk, dv


def _rel(a, b):
  return float(np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30))


def errors(grads, ref, rows):
  """Relative errors of (dq, dk, dv) against ref: overall (live tokens) and the worst document."""
  grads = [np.asarray(jnp.asarray(g, jnp.float32)) for g in grads]
  out = {}
  for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
    docs, live = [], []
    for b, row in enumerate(rows):
      start = 0
      for i, length in enumerate(row):
        docs.append((_rel(g[b, start:start + length], r[b, start:start + length]), b, i, start, length))
        live.append((g[b, start:start + length], r[b, start:start + length]))
        start += length
    worst = max(docs, key=lambda d: np.inf if np.isnan(d[0]) else d[0])
    bad = [[d[1], d[2]] for d in docs if not d[0] <= ba.PEER_MAX_REL_ERR]  # [row, index]; NaN counts
    out[name] = dict(rel_err=_rel(np.concatenate([x for x, _ in live]), np.concatenate([y for _, y in live])),
                     worst_doc=dict(rel_err=worst[0], row=worst[1], index=worst[2], start=worst[3], length=worst[4]),
                     docs_over_tolerance=len(bad), docs=len(docs), bad_docs=bad)
  return out


def check_case(case, dtype, gpu: bool):
  if case.chunk:
    raise ValueError(f"case {case.name!r}: the reference has no chunked mask")
  rows = ba.case_rows(case)
  seg, pos = common.segments_and_positions(rows, case.seq_len)
  q, k, v, dout = ba.case_inputs(case, dtype)  # the benchmark's inputs
  ref = reference_grads(q, k, v, dout, rows, case.window)
  impls = {"jaxcp": ba._jaxcp(case, seg, pos)}
  if gpu:
    impls["cudnn_packed"] = ba._cudnn_packed(case, rows, dtype)
  result = dict(case=case.name, docs=sum(len(r) for r in rows))
  for name, fn in impls.items():
    grads = ba.fwd_bwd_fn(fn)(q, k, v, dout)
    result[name] = errors(grads, ref, rows)
    del grads
  return result


def markdown(meta, results):
  header = ["case", "docs", "implementation"] + [f"{g} rel err (worst doc)" for g in ("dq", "dk", "dv")] + [f"docs > {ba.PEER_MAX_REL_ERR:g}"]
  rows = []
  for r in results:
    for name in ("jaxcp", "cudnn_packed"):
      if name not in r:
        continue
      e = r[name]
      rows.append([r["case"], r["docs"], name]
                  + [f"{e[g]['rel_err']:.1e} ({e[g]['worst_doc']['rel_err']:.1e})" for g in ("dq", "dk", "dv")]
                  + [max(e[g]["docs_over_tolerance"] for g in ("dq", "dk", "dv"))])
  cudnn = f", cuDNN {meta['cudnn']}" if "cudnn" in meta else ""
  return (f"Device: {meta['device']}, JAX {meta['jax']}{cudnn}, {meta['date']}. Gradients against a float32 "
          "reference computed one document at a time; relative L2 error over live tokens, the worst "
          "document's in brackets.\n\n" + common.markdown_table(header, rows))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", default=None, help="substring filter on case names")
  ap.add_argument("--quick", action="store_true", help="the benchmark's tiny cases (runs on the CPU)")
  ap.add_argument("--out", default=None, help="output folder (default $OUT or benchmarks/results)")
  args = ap.parse_args(argv)
  gpu = jax.default_backend() == "gpu"
  quick = args.quick or not gpu
  # its reference is causal, windowed or not: no chunked or bidirectional cases
  cases = [c for c in (ba.QUICK_CASES if quick else ba.GPU_CASES) if not c.chunk and c.causal]
  cases = [c for c in cases if not args.only or args.only in c.name]
  dtype = jnp.bfloat16 if gpu else jnp.float32
  meta = common.run_metadata()
  results = []
  for case in cases:
    t0 = time.perf_counter()
    results.append(check_case(case, dtype, gpu and not quick))
    print(f"{time.perf_counter() - t0:.0f} s", results[-1], flush=True)
  md = markdown(meta, results)
  common.write_results(common.result_name("grad_check"), dict(meta=meta, results=results), md, args.out)
  print(md)


if __name__ == "__main__":
  main()
