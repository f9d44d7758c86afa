"""Packed-document attention: jaxcp vs JAX's cuDNN (packed q_offsets form and dense causal),
FlashAttention-3 (its varlen form, fa3_peer.py) and XLA, side by side in one process, with a bf16
matmul and a device copy measured in the same run.
cuDNN's packed form runs twice: with the rows' own document count as its capacity M (its best
case) and with a fixed M = S/t ("cudnn_static": the capacity a jitted training loop needs, see
static_doc_capacity; t = 64 by default). Ratios and
geometric means are given against both. Every peer's output and gradients are checked against
jaxcp's; a peer that computes something else gets no ratio. Forward, forward+backward and the
backward alone are compiled and timed apart, so a peer whose backward runs out of memory still has
a forward. The backward alone is jax.vjp's pull function from one forward, passed into a jitted
call, so that only the backward runs in the timed call; where that fails, forward+backward's time
minus the forward's, marked so (bwd_method "fwd_bwd - fwd", "(diff)" in the table).
jaxcp also runs with deterministic=True ("jaxcp_det": forward+backward and the backward alone; its
forward is the default one), checked against the default's gradients; the summary gives what the
fixed order of the dQ adds costs the backward.

FlashAttention-3 runs where its wheel imports (the results' meta "fa3" names the module and
version, or why it is absent) and the case is one it supports: no chunked masks, V's head dim that
of Q and at most 128, bf16 or fp16; elsewhere its entry says "unsupported: ..." (no error).

FLOPs count allowed pairs only: forward 2*(D+Dv)*Hq*pairs (4*D*Hq*pairs when V's head dim Dv is
D), forward+backward 3.5x that, the backward alone 2.5x.
Writes attention_<kind>.{json,md,png} (attention_extra_<kind>.* with --extra; kind: the device,
e.g. h200) to --out, $OUT or benchmarks/results/.

  python benchmarks/bench_attention.py            # the full GPU case list
  python benchmarks/bench_attention.py --quick    # tiny shapes, runs on the CPU too
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__file__))
import common  # noqa: E402
import fa3_peer  # noqa: E402

import jaxcp  # noqa: E402


@dataclasses.dataclass
class Case:
  name: str
  batch: int
  seq_len: int
  mean_doc: int          # 0: one document per row (dense)
  q_heads: int = 16
  kv_heads: int = 16
  head_dim: int = 128
  v_head_dim: int | None = None  # value's head dim when it differs (multi-head latent attention)
  window: int | None = None   # keys within [q - window + 1, q]
  chunk: int | None = None
  xla: bool = False
  pad: int = 0                # the rows' last `pad` tokens are padding (segment 0)
  causal: bool = True         # False: each token attends to its whole document


GPU_CASES = [
    Case("2x8k doc1k", 2, 8192, 1024, xla=True),
    Case("2x8k doc1k D64", 2, 8192, 1024, head_dim=64),
    Case("2x8k doc1k D256", 2, 8192, 1024, head_dim=256),
    Case("2x8k dense", 2, 8192, 0),
    Case("4x16k doc4k", 4, 16384, 4096),
    Case("4x16k doc4k 32/8", 4, 16384, 4096, q_heads=32, kv_heads=8),
    Case("4x16k doc4k win1024", 4, 16384, 4096, window=1024),
    Case("4x16k doc4k chunk2048", 4, 16384, 4096, chunk=2048),
    Case("4x16k doc4k bidir", 4, 16384, 4096, causal=False),
    Case("1x32k doc2k", 1, 32768, 2048),
    Case("1x64k doc1k", 1, 65536, 1024),
    Case("1x64k doc1k pad300", 1, 65536, 1024, pad=300),
    Case("1x128k doc8k", 1, 131072, 8192),
    Case("1x128k doc8k 32/8", 1, 131072, 8192, q_heads=32, kv_heads=8),
]

# Head dims beyond 64 / 128 / 256, with `--extra`: 96 and 192 (the sm_90a kernels' own tiles; padded
# to 128 / 256 elsewhere) and multi-head latent attention's q/k 192 with v 128 (V native in the
# sm_90a kernels). Their own table (attention_extra.*), outside the
# main cases' geometric means. FLOPs count the true head dims, so padding shows as lost throughput.
EXTRA_CASES = [
    Case("2x8k doc1k D96", 2, 8192, 1024, head_dim=96, xla=True),
    Case("2x8k doc1k D192", 2, 8192, 1024, head_dim=192),
    Case("4x16k doc4k D96", 4, 16384, 4096, head_dim=96),
    Case("1x64k doc1k D96", 1, 65536, 1024, head_dim=96),
    Case("2x8k doc1k qk192/v128", 2, 8192, 1024, head_dim=192, v_head_dim=128, xla=True),
    Case("4x16k doc4k qk192/v128", 4, 16384, 4096, head_dim=192, v_head_dim=128),
]

QUICK_CASES = [
    Case("quick 2x256 doc64", 2, 256, 64, q_heads=4, kv_heads=2, head_dim=64, xla=True, pad=20),
    Case("quick 1x512 doc128 win", 1, 512, 128, q_heads=2, kv_heads=2, head_dim=64, window=64, xla=True),
    Case("quick 1x256 doc64 bidir", 1, 256, 64, q_heads=2, kv_heads=2, head_dim=64, xla=True, causal=False),
]


def case_window(case: Case):
  """jaxcp's local_window_size for the case's window of `window` keys (None: no window)."""
  return (case.window - 1, 0) if case.window else None


def case_pairs(case: Case, rows) -> int:
  """The (query, key) pairs the case's mask allows over `rows` (its FLOP count's basis)."""
  return common.allowed_pairs(rows, causal=case.causal, window=case_window(case), chunk=case.chunk)


def cudnn_packed_args(rows, batch, max_docs=None):
  """JAX cuDNN's packed-document arguments: q_seqlen [B, M] (document lengths, -1 after the
  last) and q_offsets [B, M + 1] (document starts within the row, -1 after the last start: JAX
  adds the row offsets itself and drops the -1s, so an end offset here would be read as the
  next row's first document and shift every later row by one document). M is max_docs, or the
  most documents any row has."""
  most = max(len(r) for r in rows)
  max_docs = max_docs or most
  if max_docs < most:
    raise ValueError(f"max_docs={max_docs} is below a row's document count")
  seqlen = np.full((batch, max_docs), -1, np.int32)
  offsets = np.full((batch, max_docs + 1), -1, np.int32)
  for b, lengths in enumerate(rows):
    seqlen[b, :len(lengths)] = lengths
    offsets[b, :len(lengths)] = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  return seqlen, offsets


# Tokens per document t of the "cudnn_static" peer's capacity M = S/t: one document slot per 64
# tokens. At this capacity cuDNN's packed forward+backward asks for 130.5 GiB at 1 x 32k and
# 521 GiB at 1 x 64k (XLA's compiled memory analysis; H200, JAX 0.11.2, cuDNN 9.19.0), so it runs
# out of memory on the long cases, which the tables show as "OOM".
STATIC_TOKENS_PER_DOC = 64


def static_doc_capacity(seq_len, tokens_per_doc=STATIC_TOKENS_PER_DOC):
  """The document capacity M of the "cudnn_static" peer: one document per tokens_per_doc tokens.

  Under jit, q_seqlen / q_offsets need a shape that stays fixed while the number of documents
  per row changes from batch to batch, so a training loop passes a capacity rather than the
  batch's count (which recompiles whenever it changes). JAX's cuDNN packed backward needs memory
  and time in proportion to M: B * M * S * Hq * D float32 elements with 16/16 heads, twice that
  with 32/8 (H200, JAX 0.11.2, cuDNN 9.19.0; read from XLA's compiled memory analysis)."""
  return seq_len // tokens_per_doc


def _cudnn_packed(case: Case, rows, dtype, max_docs=None):
  """JAX's cuDNN attention in its packed-document form (q_seqlen/q_offsets) with document
  capacity max_docs (default: the most documents any row has), or None."""
  if case.chunk is not None:
    return None  # cuDNN has no chunked mask
  from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

  seqlen, offsets = map(jnp.asarray, cudnn_packed_args(rows, case.batch, max_docs))
  scale = case.head_dim ** -0.5

  def f(q, k, v):
    return dot_product_attention(q, k, v, None, None, seqlen, seqlen, offsets, offsets, scale=scale,
                                 mask_type=MaskType.PADDING_CAUSAL if case.causal else MaskType.PADDING,
                                 sliding_window_length=case.window)
  return f


def _cudnn_dense(case: Case):
  if case.mean_doc or case.window or case.chunk:
    return None
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=case.causal, implementation="cudnn")


def _jaxcp(case: Case, seg, pos, implementation=None, deterministic=False):
  seg, pos = jnp.asarray(seg), jnp.asarray(pos)

  def f(q, k, v):
    return jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, is_causal=case.causal,
                           local_window_size=case_window(case),
                           chunk_size=case.chunk, implementation=implementation, deterministic=deterministic)
  return f


def _rel_err(out, ref, live):
  """Relative L2 error of out against ref over live tokens (padding tokens' outputs are free)."""
  m = jnp.asarray(live)[:, :, None, None]
  d = jnp.where(m, out.astype(jnp.float32) - ref.astype(jnp.float32), 0)
  r = jnp.where(m, ref.astype(jnp.float32), 0)
  return float(jnp.linalg.norm(d.ravel()) / jnp.maximum(jnp.linalg.norm(r.ravel()), 1e-30))


def _error(e):
  """An implementation's failure as recorded in the results (key fwd_error or fwd_bwd_error):
  OOM, or the first line."""
  msg = str(e).splitlines()[0][:200]
  return "OOM" if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower() else msg


def fwd_bwd_fn(fn):
  """fn's forward+backward, jitted: (q, k, v, dout) -> (dq, dk, dv)."""
  return jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))


def _calls(fn, q, k, v, dout):
  """The jitted forward and forward+backward of fn with their arguments, by mode."""
  return {"fwd": (jax.jit(fn), (q, k, v)), "fwd_bwd": (fwd_bwd_fn(fn), (q, k, v, dout))}


def bwd_call(fn, q, k, v, dout):
  """The backward of fn alone, jitted, with its arguments: jax.vjp's pull function from one
  forward is a pytree whose leaves are the saved residuals, so the call runs the backward only."""
  _, pull = jax.vjp(jax.jit(fn), q, k, v)
  return jax.jit(lambda pull, do: pull(do)), (pull, dout)


def _fa3(case: Case, rows, dtype, varlen):
  """FlashAttention-3 on the case's packed rows, or the reason it cannot run them."""
  reason = fa3_peer.unsupported(case.head_dim, case.v_head_dim, case.chunk, dtype)
  if reason:
    return None, reason
  return fa3_peer.packed_fn(varlen, rows, case.seq_len, scale=case.head_dim ** -0.5, causal=case.causal,
                            window=case_window(case)), None


def _warm(call):
  """Compiles call and runs it twice."""
  f, args = call
  for _ in range(2):
    jax.block_until_ready(f(*args))


def case_rows(case: Case):
  """The document lengths of the case's rows (seeded: every run and tool draws the same)."""
  rng = np.random.default_rng(0)
  rows = common.packed_rows(rng, case.batch, case.seq_len, case.mean_doc) if case.mean_doc else \
      [[case.seq_len]] * case.batch
  return common.padded_rows(rows, case.seq_len - case.pad) if case.pad else rows


def case_inputs(case: Case, dtype):
  """The case's q, k, v and dout (seeded: every run and tool draws the same)."""
  dv = case.v_head_dim or case.head_dim
  key = jax.random.PRNGKey(1)
  shape_q = (case.batch, case.seq_len, case.q_heads, case.head_dim)
  shape_kv = (case.batch, case.seq_len, case.kv_heads, case.head_dim)
  shape_v, shape_o = shape_kv[:3] + (dv,), shape_q[:3] + (dv,)
  return (jax.random.normal(key, shape_q, dtype), jax.random.normal(jax.random.fold_in(key, 1), shape_kv, dtype),
          jax.random.normal(jax.random.fold_in(key, 2), shape_v, dtype),
          jax.random.normal(jax.random.fold_in(key, 3), shape_o, dtype))


MODES = ("fwd", "fwd_bwd", "bwd")
IMPL_MODES = {"jaxcp_det": ("fwd_bwd", "bwd")}  # implementations timed in some modes only
FLOPS_PER_FWD = {"fwd": 1.0, "fwd_bwd": 3.5, "bwd": 2.5}  # the backward alone: forward+backward less the forward
_ERR_KEY = {"fwd": "rel_err_vs_jaxcp",  # where each mode's error against jaxcp's goes
            "fwd_bwd": "grad_rel_err_vs_jaxcp", "bwd": "bwd_grad_rel_err_vs_jaxcp"}


def _fallback_bwd(r, fwd_flops):
  """Where the backward alone could not be timed: forward+backward's time less the forward's,
  marked bwd_method "fwd_bwd - fwd" (the difference carries both calls' noise), else bwd_error."""
  if "bwd_ms" in r:
    return
  if "fwd_ms" in r and "fwd_bwd_ms" in r and r["fwd_bwd_ms"] > r["fwd_ms"]:
    ms = r["fwd_bwd_ms"] - r["fwd_ms"]
    r.update(bwd_ms=ms, bwd_tflops=FLOPS_PER_FWD["bwd"] * fwd_flops / ms / 1e9, bwd_method="fwd_bwd - fwd")
  else:
    r["bwd_error"] = r.get("bwd_pull_error") or r.get("fwd_bwd_error") or r.get("fwd_error") or "fwd_bwd - fwd <= 0"


def run_case(case: Case, dtype, quick: bool, static_tokens_per_doc=STATIC_TOKENS_PER_DOC, fa3=None):
  """One case: every implementation's time and TFLOP/s per mode (forward, forward+backward,
  backward alone) and each peer's error against jaxcp. fa3: FlashAttention-3's flash_mha_varlen
  (fa3_peer.load), None where it is absent."""
  rows = case_rows(case)
  seg, pos = common.segments_and_positions(rows, case.seq_len)
  pairs = case_pairs(case, rows)
  dv = case.v_head_dim or case.head_dim
  fwd_flops = 2 * (case.head_dim + dv) * case.q_heads * pairs  # q.k and p.v
  q, k, v, dout = case_inputs(case, dtype)

  impls = {"jaxcp": _jaxcp(case, seg, pos), "jaxcp_det": _jaxcp(case, seg, pos, deterministic=True)}
  if not quick:
    impls["cudnn_packed"] = _cudnn_packed(case, rows, dtype)
    impls["cudnn_static"] = _cudnn_packed(case, rows, dtype, static_doc_capacity(case.seq_len, static_tokens_per_doc))
    impls["cudnn_dense"] = _cudnn_dense(case)
  if case.xla:
    impls["xla"] = _jaxcp(case, seg, pos, implementation="xla")
  fa3_skipped = "absent"
  if fa3 is not None:
    impls["fa3"], fa3_skipped = _fa3(case, rows, dtype, fa3)
  result = dict(case=dataclasses.asdict(case), docs_per_row=[len(r) for r in rows], allowed_pairs=pairs,
                fwd_flops=fwd_flops)
  if fa3_skipped:
    result["fa3"] = dict(skipped=fa3_skipped)
  # Compile and warm every implementation, then time them interleaved (common.time_interleaved).
  calls = {}
  for name, fn in impls.items():
    if fn is None:
      continue
    result[name] = {}
    fwd_and_fwd_bwd = _calls(fn, q, k, v, dout)
    for mode in IMPL_MODES.get(name, MODES):
      call = None
      try:
        call = bwd_call(fn, q, k, v, dout) if mode == "bwd" else fwd_and_fwd_bwd[mode]
        _warm(call)
        calls[(name, mode)] = call
      except Exception as e:  # out of memory or unsupported: recorded, never fatal
        # the backward alone falls back to forward+backward less the forward (_fallback_bwd)
        key = "bwd_pull_error" if mode == "bwd" else f"{mode}_error"
        result[name][key] = _error(e)
        if result[name][key] != "OOM":
          traceback.print_exc(limit=2)
      del call  # a failed backward's residuals go now, not after the timing
  times = common.time_interleaved(calls) if calls else {}
  reference = None  # jaxcp's output and gradients: every other implementation is checked against them
  live = seg != 0
  for (name, mode), (f, args) in calls.items():
    t, r = times[(name, mode)], result[name]
    if isinstance(t, Exception):
      r["bwd_pull_error" if mode == "bwd" else f"{mode}_error"] = _error(t)
      continue
    r[f"{mode}_ms"], r[f"{mode}_tflops"] = t * 1e3, FLOPS_PER_FWD[mode] * fwd_flops / t / 1e12
    if mode == "bwd":
      r["bwd_method"] = "vjp"
    got = f(*args)  # the output, or dq, dk, dv
    if name == "jaxcp" and mode != "bwd":
      reference = dict(reference or {}, **{mode: got})
    # A fast peer must also compute the same thing; the backward alone (jaxcp's too) must give
    # jaxcp's forward+backward gradients.
    ref = (reference or {}).get("fwd_bwd" if mode == "bwd" else mode)
    if ref is not None and (name != "jaxcp" or mode == "bwd"):
      leaves = zip(jax.tree.leaves(got), jax.tree.leaves(ref))
      r[_ERR_KEY[mode]] = max(_rel_err(g, g_ref, live) for g, g_ref in leaves)
    del got, ref
  del calls, reference
  for name in impls:
    if name in result and "skipped" not in result[name]:
      _fallback_bwd(result[name], fwd_flops)
  return result


PEERS = ("jaxcp_det", "cudnn_packed", "cudnn_static", "cudnn_dense", "xla", "fa3")  # every implementation but jaxcp
TFLOPS_KEYS = tuple(f"{m}_tflops" for m in MODES)


def _failure(r, key):
  """The error recorded for key's mode (fwd_tflops: fwd, fwd_bwd_tflops: fwd_bwd), or None."""
  return r.get(key.replace("_tflops", "_error"))


def _fmt(r, key):
  if r and "skipped" in r:  # FlashAttention-3 not installed, or a case it does not support
    return "absent" if r["skipped"] == "absent" else "n/a"
  failure = _failure(r, key) if r else None
  if failure:
    return "OOM" if failure == "OOM" else "err"
  if not r or key not in r:
    return "-"
  text = f"{r[key]:.0f}" if r[key] >= 10 else f"{r[key]:.2f}"
  return text + " (diff)" if key == "bwd_tflops" and r.get("bwd_method") == "fwd_bwd - fwd" else text


def _peer_errors(r):
  """Each peer's relative error against jaxcp: output / worst of dq, dk, dv."""
  def grads(e):
    return "-" if e is None else f"{e:.1e}"  # "-": its backward did not run
  def out(e):
    return "-" if e is None else f"{e:.1e}"  # "-": not run (jaxcp_det's forward is jaxcp's)
  errs = [f"{n} {out(r[n].get('rel_err_vs_jaxcp'))} / {grads(r[n].get('grad_rel_err_vs_jaxcp'))}"
          for n in PEERS if n in r and ("rel_err_vs_jaxcp" in r[n] or "grad_rel_err_vs_jaxcp" in r[n])]
  return ", ".join(errs) or "-"


# A peer whose output or gradients are this far from jaxcp's (relative L2 over live tokens; bf16
# rounding gives about 2e-3) computes something else, so its time is no comparison: JAX 0.11.2's
# cuDNN packed form with q/k 192, v 128 returns wrong values (1.3e+00) or NaN, while jaxcp agrees
# with XLA.
PEER_MAX_REL_ERR = 5e-2


def _peer_agrees(r, key):
  """Whether peer result r computes what jaxcp does: its output, for key fwd_bwd_tflops also its
  gradients, and for bwd_tflops those of its backward alone as well."""
  errs = [r.get("rel_err_vs_jaxcp", 0.0)]
  if key in ("fwd_bwd_tflops", "bwd_tflops"):
    errs.append(r.get("grad_rel_err_vs_jaxcp", 0.0))
  if key == "bwd_tflops":
    errs.append(r.get("bwd_grad_rel_err_vs_jaxcp", 0.0))
  return all(bool(np.isfinite(e)) and e <= PEER_MAX_REL_ERR for e in errs)


def _ratio_value(a, b, key):
  """jaxcp / peer TFLOP/s, or None: either missing or failed, or the peer's result wrong."""
  if not a or not b or key not in a or key not in b or not _peer_agrees(b, key):
    return None
  return a[key] / b[key]


def _ratio(a, b, key):
  v = _ratio_value(a, b, key)
  if v is not None:
    return f"{v:.2f}x"
  return "wrong result" if b and key in b and not _peer_agrees(b, key) else "-"


def _cudnn_peer(r, static=False):
  """The cuDNN result jaxcp is compared with: the packed form (with the rows' own document count
  as capacity, or with the static one), else the dense form."""
  return r.get("cudnn_static" if static else "cudnn_packed") or r.get("cudnn_dense")


# The peers of the geometric means, by key prefix of ratio_summary.
SUMMARY_PEERS = (("", lambda r: _cudnn_peer(r)), ("static_", lambda r: _cudnn_peer(r, static=True)),
                 ("fa3_", lambda r: r.get("fa3")))


def ratio_summary(results):
  """Geometric means of jaxcp / cuDNN over the cases with a cuDNN result that agrees with
  jaxcp's: all of them, and those without padding tokens, for the forward, forward+backward and
  backward alone; keys static_*: against cuDNN with the static document capacity (cases where it
  ran out of memory count as not run); keys fa3_*: against FlashAttention-3 (cases it does not
  support, or all where it is absent, count as not run)."""
  out = {}
  for prefix, peer in SUMMARY_PEERS:
    for label, keep in (("all", lambda r: True), ("unpadded", lambda r: not r["case"].get("pad"))):
      for key in TFLOPS_KEYS:
        vals = [_ratio_value(r.get("jaxcp"), peer(r), key) for r in results if keep(r)]
        vals = [v for v in vals if v is not None]
        out[f"{prefix}{label}_{key}"] = dict(cases=len(vals),
                                             geomean=float(np.exp(np.mean(np.log(vals)))) if vals else None)
  out["deterministic_bwd"] = deterministic_cost(results)
  return out


def deterministic_cost(results, max_head_dim=128):
  """The backward alone with deterministic=True over the default (time ratio): geometric mean and
  worst over the cases up to max_head_dim where both ran and agree."""
  vals = []
  for r in results:
    base, det = r.get("jaxcp") or {}, r.get("jaxcp_det") or {}
    if (r["case"].get("head_dim", 0) <= max_head_dim and "bwd_ms" in base and "bwd_ms" in det
        and _peer_agrees(det, "bwd_tflops")):
      vals.append(det["bwd_ms"] / base["bwd_ms"])
  return dict(cases=len(vals), max_head_dim=max_head_dim,
              geomean=float(np.exp(np.mean(np.log(vals)))) if vals else None, worst=max(vals) if vals else None)


def _summary_md(summary, static_tokens_per_doc):
  lines = []
  for prefix, peer in (("", "cuDNN"), ("static_", f"cuDNN with capacity M = S/{static_tokens_per_doc}"),
                       ("fa3_", "FlashAttention-3")):
    parts = []
    for label in ("unpadded", "all"):  # a peer with wrong gradients has a forward ratio only
      means = [(what, summary.get(f"{prefix}{label}_{key}") or {})
               for what, key in zip(("forward", "forward+backward", "backward"), TFLOPS_KEYS)]
      if means[0][1].get("geomean") is not None:
        parts.append(f"{label}: " + ", ".join(f"{what} {m['geomean']:.3f}x ({m['cases']} cases)"
                                              if m.get("geomean") is not None else f"{what} -"
                                              for what, m in means))
    if parts:
      lines.append(f"Geometric mean of jaxcp / {peer} over the cases with a result that agrees with jaxcp's: "
                   + "; ".join(parts) + ".")
  det = summary.get("deterministic_bwd") or {}
  if det.get("geomean") is not None:
    lines.append(f"jaxcp's backward alone with deterministic=True over the default (time), head dims up to "
                 f"{det['max_head_dim']}: geometric mean {det['geomean']:.3f}x, worst {det['worst']:.3f}x "
                 f"({det['cases']} cases).")
  return "\n\n".join(lines)


def markdown(meta, results):
  """The results table (and the geometric means of the ratios) as markdown."""
  tokens_per_doc = meta.get("static_tokens_per_doc", 128)  # result files without the key used S/128
  static = f"M=S/{tokens_per_doc}"
  names = {"jaxcp": "jaxcp", "jaxcp_det": "jaxcp deterministic", "cudnn_packed": "cuDNN packed", "cudnn_static": f"cuDNN {static}",
           "cudnn_dense": "cuDNN dense", "xla": "XLA", "fa3": "FA3"}
  modes = ("fwd", "fwd+bwd", "bwd")  # TFLOPS_KEYS' labels
  header = (["case", "docs/row"] + [f"{names[n]} {m}" for n in ("jaxcp",) + PEERS for m in modes]
            + [f"{m} vs {p}" for p in ("cuDNN", f"cuDNN {static}", "FA3") for m in modes]
            + ["peer rel err vs jaxcp (out / grads)"])
  rows = []
  for r in results:
    peers = (_cudnn_peer(r), _cudnn_peer(r, static=True), r.get("fa3"))
    rows.append([r["case"]["name"], f"{np.mean(r['docs_per_row']):.1f}"]
                + [_fmt(r.get(n), k) for n in ("jaxcp",) + PEERS for k in TFLOPS_KEYS]
                + [_ratio(r.get("jaxcp"), p, k) for p in peers for k in TFLOPS_KEYS] + [_peer_errors(r)])
  cudnn = f", cuDNN {meta['cudnn']}" if "cudnn" in meta else ""
  md = (f"Device: {meta['device']}, JAX {meta['jax']}{cudnn}, {meta['date']}. TFLOP/s over allowed pairs "
        f"(fwd 2*(D+Dv)*Hq*pairs, = 4*D*Hq*pairs when Dv = D; fwd+bwd 3.5x; bwd, the backward alone, 2.5x; "
        f"\"(diff)\": the backward's time taken as fwd+bwd's less fwd's).")
  if "matmul_bf16_tflops" in meta:
    md += f" Same run: bf16 8k matmul {meta['matmul_bf16_tflops']:.0f} TFLOP/s, copy {meta['copy_gbps']:.0f} GB/s."
  fa3 = meta.get("fa3")
  if fa3:  # "n/a" in its columns: a case it does not support (the JSON says why)
    md += f" FA3: {fa3['module']} {fa3.get('version')}." if "module" in fa3 else f" FA3 absent: {fa3['absent']}."
  md = md + "\n\n" + common.markdown_table(header, rows)
  summary_line = _summary_md(ratio_summary(results), tokens_per_doc)
  return md + ("\n" + summary_line + "\n" if summary_line else "")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="tiny shapes (runs on the CPU)")
  ap.add_argument("--only", default=None, help="substring filter on case names (several: comma-separated)")
  ap.add_argument("--extra", action="store_true", help="the head dims between tile widths (EXTRA_CASES)")
  ap.add_argument("--out", default=None, help="output folder (default $OUT or benchmarks/results)")
  ap.add_argument("--static-tokens-per-doc", type=int, default=STATIC_TOKENS_PER_DOC,
                  help="the cudnn_static peer's capacity M = S / this")
  ap.add_argument("--part", default=None, help="i/n: only the cases k with k %% n == i (one process per GPU; "
                  "writes <name>_part<i>), merged afterwards with --merge")
  ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                  help="merge the part files of one run into <name>.{json,md,png} (no measuring)")
  args = ap.parse_args(argv)
  quick = args.quick or jax.default_backend() == "cpu"
  dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  cases = QUICK_CASES if quick else EXTRA_CASES if args.extra else GPU_CASES
  name = common.result_name("attention_extra" if args.extra else "attention")
  if args.merge:
    return merge_parts(args.merge, args.out)
  if args.only:
    wanted = args.only.split(",")
    cases = [c for c in cases if any(w in c.name for w in wanted)]
  if args.part:
    i, n = (int(x) for x in args.part.split("/"))
    if not 0 <= i < n:
      raise ValueError(f"--part {args.part}: want i/n with 0 <= i < n")
    cases, name = cases[i::n], f"{name}_part{i}"

  meta = common.run_metadata()
  meta["static_tokens_per_doc"] = args.static_tokens_per_doc
  fa3, meta["fa3"] = fa3_peer.load()  # the module and version imported, or why FA3 is absent
  if not quick:
    meta["matmul_bf16_tflops"] = common.measure_matmul_tflops()
    meta["copy_gbps"] = common.measure_copy_gbps()
  results = []

  def save():  # after every case: a run cut short (a device call's time limit) keeps what it measured
    md = markdown(meta, results)
    return common.write_results(name, dict(meta=meta, results=results, summary=ratio_summary(results)), md,
                                args.out), md

  out_dir, md = save()
  for case in cases:
    r = run_case(case, dtype, quick, args.static_tokens_per_doc, fa3)
    results.append(r)
    tflops = {k: "/".join(_fmt(r[k], key) for key in TFLOPS_KEYS) for k in ("jaxcp",) + PEERS if k in r}
    print(f"{case.name} (fwd/fwd+bwd/bwd): " + ", ".join(f"{k} {t}" for k, t in tflops.items()), flush=True)
    out_dir, md = save()
  _plot(results, out_dir, name)
  print(md)


def merge_parts(paths, out=None):
  """One result set from the part files of a run (each measured in its own process, with its own
  matmul and copy ceilings, kept per part in meta["parts"]), cases in the case lists' order, named
  after the first part (<name>_part<i>.json -> <name>): the merge may run on another host."""
  name = re.sub(r"_part\d+$", "", os.path.splitext(os.path.basename(paths[0]))[0])
  cases = GPU_CASES + EXTRA_CASES + QUICK_CASES
  payloads = []
  for path in paths:
    with open(path) as f:
      payloads.append(json.load(f))
  order = {c.name: k for k, c in enumerate(cases)}  # the lists' names are distinct
  results = sorted((r for p in payloads for r in p["results"]), key=lambda r: order.get(r["case"]["name"], len(order)))
  meta = dict(payloads[0]["meta"], parts=[p["meta"] for p in payloads])
  md = markdown(meta, results)
  out_dir = common.write_results(name, dict(meta=meta, results=results, summary=ratio_summary(results)), md, out)
  _plot(results, out_dir, name)
  print(md)


def _plot(results, out_dir, name):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  impls = [n for n in ("jaxcp",) + PEERS if any(n in r and r[n].get("skipped") != "absent" for r in results)]
  fig, axes = plt.subplots(1, 3, figsize=(21, 5), sharey=False)
  x = np.arange(len(results))
  width = 0.8 / max(1, len(impls))
  for ax, key, title in zip(axes, TFLOPS_KEYS, ("forward", "forward+backward", "backward alone")):
    for i, n in enumerate(impls):
      vals = [r[n].get(key, 0) if n in r else 0 for r in results]
      bars = ax.bar(x + i * width, vals, width, label=n)
      for bar, r in zip(bars, results):  # a peer computing something else: hatched, no comparison
        if n != "jaxcp" and n in r and key in r[n] and not _peer_agrees(r[n], key):
          bar.set_hatch("xx")
          bar.set_alpha(0.4)
        if n in r and (_failure(r[n], key) or "skipped" in r[n]):  # say why where its bar would be
          ax.text(bar.get_x() + bar.get_width() / 2, 5, _fmt(r[n], key), rotation=90, ha="center",
                  va="bottom", fontsize=6, color=bar.get_facecolor())
    ax.set_xticks(x + width * (len(impls) - 1) / 2)
    ax.set_xticklabels([r["case"]["name"] for r in results], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s (allowed pairs)")
    ax.set_title(f"{title} (hatched: the peer's result is wrong; OOM: out of memory)")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(f"{out_dir}/{name}.png", dpi=120)


if __name__ == "__main__":
  main()
