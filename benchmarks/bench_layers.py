"""An L-layer attention stack in ONE jax.jit, all layers sharing the same segment ids / positions:
what a model sees when the tile plan that jaxcp's CUDA kernels build from the segment ids and
positions is shared between layers (one plan custom call that XLA's CSE leaves for every layer)
instead of built per call. A single-call benchmark (bench_attention.py) cannot show this.

Layer l: out_l = attention(q_l, k_l, v_l) with q_{l+1} = out_l and (k_l, v_l) L independent
random pairs, so the layers depend on each other with no work between them but attention's.
Peers, forward and forward+backward (jax.vjp of the stack w.r.t. q_0 and every k_l, v_l), timed
interleaved (common.time_interleaved): jaxcp with L layers and with one layer (the per-layer
difference is what sharing the plan and the per-call overheads save), JAX's cuDNN packed form
with the rows' own document count (GPU only), and jaxcp's XLA reference where the case has one.
Each peer's final output and gradients are checked against jaxcp's. For jaxcp the compiled HLO's
plan custom calls (and attention kernel calls) are counted.

FLOPs count allowed pairs only: forward 2*(D+Dv)*Hq*pairs*L (4*D*Hq*pairs*L), fwd+bwd 3.5x.
Writes layers_<kind>.json + .md (kind: the device, e.g. h200) to --out, $OUT or benchmarks/results/.

  python benchmarks/bench_layers.py               # GPU cases, 4 layers
  python benchmarks/bench_layers.py --quick       # tiny shapes, runs on the CPU too
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__file__))
import bench_attention as ba  # noqa: E402
import common  # noqa: E402

CASE_NAMES = ("2x8k doc1k", "2x8k doc1k D64", "2x8k doc1k D256", "4x16k doc4k", "1x64k doc1k")
GPU_CASES = [c for c in ba.GPU_CASES if c.name in CASE_NAMES]
# Custom-call targets counted in jaxcp's compiled HLO. Counted as custom_call_target="...": the
# primitive's name also appears in instruction names and metadata, which a bare substring counts.
HLO_TARGETS = ("jaxcp_attention_fwd_plan", "jaxcp_attention_bwd_plan", "jaxcp_attention_fwd", "jaxcp_attention_bwd")
MODES = ("fwd", "fwd_bwd")


def stack(attn, layers):
  """(q, ks, vs) -> the last layer's output: out_l = attn(q_l, ks[l], vs[l]), q_{l+1} = out_l."""
  def f(q, ks, vs):
    for k, v in zip(ks[:layers], vs[:layers]):
      q = attn(q, k, v)
    return q
  return f


def layer_inputs(case, dtype, layers):
  """q_0, dout and `layers` (k, v) pairs: layer 0's are bench_attention's case_inputs."""
  q, k, v, dout = ba.case_inputs(case, dtype)
  ks, vs = [k], [v]
  for l in range(1, layers):
    key = jax.random.fold_in(jax.random.PRNGKey(2), l)
    ks.append(jax.random.normal(jax.random.fold_in(key, 0), k.shape, dtype))
    vs.append(jax.random.normal(jax.random.fold_in(key, 1), v.shape, dtype))
  return q, tuple(ks), tuple(vs), dout


def hlo_counts(f, args):
  """How many custom calls of each HLO_TARGETS the compiled f holds."""
  text = f.lower(*args).compile().as_text()
  return {t: text.count(f'custom_call_target="{t}"') for t in HLO_TARGETS}


def run_case(case, dtype, layers):
  if (case.v_head_dim or case.head_dim) != case.head_dim:
    raise ValueError(f"{case.name}: q_{{l+1}} = out_l needs Dv == D")
  rows = ba.case_rows(case)
  seg, pos = common.segments_and_positions(rows, case.seq_len)
  pairs = ba.case_pairs(case, rows)
  layer_flops = 4 * case.head_dim * case.q_heads * pairs
  q, ks, vs, dout = layer_inputs(case, dtype, layers)

  peers = {"jaxcp": (ba._jaxcp(case, seg, pos), layers), "jaxcp_1layer": (ba._jaxcp(case, seg, pos), 1)}
  if jax.default_backend() == "gpu":
    peers["cudnn_packed"] = (ba._cudnn_packed(case, rows, dtype), layers)
  if case.xla:
    peers["xla"] = (ba._jaxcp(case, seg, pos, implementation="xla"), layers)
  result = dict(case=dataclasses.asdict(case), layers=layers, docs_per_row=[len(r) for r in rows],
                allowed_pairs=pairs, fwd_flops_per_layer=layer_flops)
  calls = {}
  for name, (attn, n) in peers.items():
    if attn is None:
      continue
    result[name] = dict(layers=n)
    for mode, call in ba._calls(stack(attn, n), q, ks[:n], vs[:n], dout).items():
      try:
        ba._warm(call)
        calls[(name, mode)] = call
        if name.startswith("jaxcp"):
          result[name][f"{mode}_hlo_custom_calls"] = hlo_counts(*call)
      except Exception as e:  # out of memory or unsupported: recorded, never fatal
        result[name][f"{mode}_error"] = ba._error(e)
        if result[name][f"{mode}_error"] != "OOM":
          traceback.print_exc(limit=2)
  times = common.time_interleaved(calls) if calls else {}
  reference, live = {}, seg != 0  # jaxcp's (L layers) output and gradients
  for (name, mode), (f, args) in calls.items():
    t, r, n = times[(name, mode)], result[name], result[name]["layers"]
    if isinstance(t, Exception):
      r[f"{mode}_error"] = ba._error(t)
      continue
    flops = layer_flops * n * (1 if mode == "fwd" else 3.5)
    r[f"{mode}_ms"], r[f"{mode}_ms_per_layer"], r[f"{mode}_tflops"] = t * 1e3, t * 1e3 / n, flops / t / 1e12
    if name == "jaxcp_1layer":
      continue
    got = f(*args)  # the final output, or (dq_0, dks, dvs)
    if name == "jaxcp":
      reference[mode] = got
    elif mode in reference:
      err = max(ba._rel_err(g, g_ref, live) for g, g_ref in zip(jax.tree.leaves(got), jax.tree.leaves(reference[mode])))
      r["rel_err_vs_jaxcp" if mode == "fwd" else "grad_rel_err_vs_jaxcp"] = err
    del got
  for mode in MODES:  # what one layer of the stack saves against a lone call
    one, many = result["jaxcp_1layer"].get(f"{mode}_ms_per_layer"), result["jaxcp"].get(f"{mode}_ms_per_layer")
    if one is not None and many is not None:
      result["jaxcp"][f"{mode}_saved_us_per_layer"] = (one - many) * 1e3
  del calls, reference
  return result


PEERS = ("cudnn_packed", "xla")


def _cell(r, mode):
  """ms per layer (TFLOP/s), or OOM / err / -."""
  if r and r.get(f"{mode}_error"):
    return "OOM" if r[f"{mode}_error"] == "OOM" else "err"
  if not r or f"{mode}_ms_per_layer" not in r:
    return "-"
  return f"{r[f'{mode}_ms_per_layer']:.3f} ({ba._fmt(r, f'{mode}_tflops')})"


def _plans(r):
  """Plan custom calls in jaxcp's compiled HLO, forward / forward+backward (fwd plans + bwd plans)."""
  def one(mode):
    c = r.get(f"{mode}_hlo_custom_calls")
    return "-" if c is None else f"{c['jaxcp_attention_fwd_plan']}+{c['jaxcp_attention_bwd_plan']}"
  return f"{one('fwd')} / {one('fwd_bwd')}" if r else "-"


def markdown(meta, results):
  L = meta["layers"]
  header = (["case", "docs/row"]
            + [f"{p} {m}" for m in ("fwd", "fwd+bwd") for p in ("jaxcp L=1", f"jaxcp L={L}", "cuDNN packed", "XLA")]
            + ["L=1 minus L=%d, us/layer (fwd / fwd+bwd)" % L, "fwd vs cuDNN", "fwd+bwd vs cuDNN",
               "jaxcp plan calls (fwd / fwd+bwd)", "peer rel err vs jaxcp (out / grads)"])
  rows = []
  for r in results:
    jx = r.get("jaxcp", {})
    saved = " / ".join(f"{jx[f'{m}_saved_us_per_layer']:.1f}" if f"{m}_saved_us_per_layer" in jx else "-"
                       for m in MODES)
    rows.append([r["case"]["name"], f"{np.mean(r['docs_per_row']):.1f}"]
                + [_cell(r.get(p), m) for m in MODES for p in ("jaxcp_1layer", "jaxcp") + PEERS]
                + [saved] + [ba._ratio(jx, r.get("cudnn_packed"), f"{m}_tflops") for m in MODES]
                + [_plans(jx), ba._peer_errors(r)])
  cudnn = f", cuDNN {meta['cudnn']}" if "cudnn" in meta else ""
  md = (f"Device: {meta['device']}, JAX {meta['jax']}{cudnn}, {meta['date']}. A {L}-layer attention stack in one "
        f"jit (q_(l+1) = out_l, all layers sharing segment ids / positions); cells: ms per layer (stack time / L) "
        f"and (TFLOP/s over allowed pairs: fwd 4*D*Hq*pairs*L, fwd+bwd 3.5x). Plan calls: custom calls "
        f"jaxcp_attention_fwd_plan+jaxcp_attention_bwd_plan in jaxcp's compiled {L}-layer HLO.")
  if "matmul_bf16_tflops" in meta:
    md += f" Same run: bf16 8k matmul {meta['matmul_bf16_tflops']:.0f} TFLOP/s."
  return md + "\n\n" + common.markdown_table(header, rows)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="tiny shapes (runs on the CPU)")
  ap.add_argument("--only", default=None, help="substring filter on case names")
  ap.add_argument("--out", default=None, help="output folder (default $OUT or benchmarks/results)")
  ap.add_argument("--layers", type=int, default=4, help="attention layers in the stack (default 4)")
  args = ap.parse_args(argv)
  if args.layers < 1:
    ap.error("--layers must be at least 1")
  quick = args.quick or jax.default_backend() == "cpu"
  dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  cases = ba.QUICK_CASES if quick else GPU_CASES
  if args.only:
    cases = [c for c in cases if args.only in c.name]

  meta = dict(common.run_metadata(), layers=args.layers, dtype=jnp.dtype(dtype).name)
  if not quick:
    meta["matmul_bf16_tflops"] = common.measure_matmul_tflops()
  results = []
  for case in cases:
    r = run_case(case, dtype, args.layers)
    results.append(r)
    print(f"{case.name}: " + ", ".join(f"{k} {_cell(r.get(k), 'fwd')} / {_cell(r.get(k), 'fwd_bwd')}"
                                        for k in ("jaxcp_1layer", "jaxcp") + PEERS if k in r), flush=True)
  md = markdown(meta, results)
  common.write_results(common.result_name("layers"), dict(meta=meta, results=results), md, args.out)
  print(md)


if __name__ == "__main__":
  main()
