"""Context-parallel scaling: the same global problem on 1, 2 and 4 GPUs.

B = 1, causal packed documents, 32 query / 8 kv heads, D = 128, forward+backward, bf16.
Reports CP efficiency T1 / (N * TN) for "all_gather" and "ring", with and without striped load
balancing; the compute-bound time of the slowest rank (its local kernels timed alone on one GPU)
gives the share of exposed communication (TN - Tcompute) / TN. Also checks every sharded result
against the one-GPU result, and whether the compiled ring schedule overlaps each
collective-permute with a kernel (a custom-call between its start and done).

  python benchmarks/bench_cp.py                      # 128k and 256k, mean docs 8k and 32k
  python benchmarks/bench_cp.py --seq 262144 --docs 32768

Writes cp_<kind>x<N>.{json,md} (kind: the device, N: the most GPUs run, e.g. cp_h200x4) to
--out, $OUT or benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import jaxcp  # noqa: E402
from jaxcp import apply_permutation, load_balance, load_balance_permutation  # noqa: E402

HQ, HKV, D = 32, 8, 128


def _fwd_bwd(strategy):
  def f(q, k, v, do, seg, pos):
    g = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, is_causal=True,
                                        context_parallel=strategy)
    out, vjp = jax.vjp(g, q, k, v)
    return out, vjp(do)
  return f


def _overlap_evidence(hlo: str) -> bool:
  """True if some collective-permute-start .. -done window contains a custom-call (a kernel)."""
  lines = hlo.splitlines()
  starts = {}
  for i, line in enumerate(lines):
    m = re.search(r"(%?[\w.\-]+) = .*collective-permute-start", line)
    if m:
      starts[m.group(1).lstrip("%")] = i
    m = re.search(r"collective-permute-done\((%?[\w.\-]+)", line)
    if m and m.group(1).lstrip("%") in starts:
      window = lines[starts[m.group(1).lstrip("%")]:i]
      if any("custom-call" in w and "jaxcp" in w for w in window):
        return True
  return False


def _rank_local_fwd_bwd(qa, k, v, doa, sq, pq, sk, pk):
  return jax.vjp(lambda qa, k, v: jaxcp.attention(qa, k, v, segment_ids=sq, positions=pq, kv_segment_ids=sk,
                                                  kv_positions=pk, is_causal=True), qa, k, v)[1](doa)


_rank_local = jax.jit(_rank_local_fwd_bwd)


def _rank_compute_time(q, k, v, do, seg, pos, cp):
  """Slowest rank's kernel time with all K/V local: the work a rank does, without communication."""
  dev = jax.devices()[0]
  s = q.shape[1] // cp
  times = []
  for r in range(cp):
    sl = slice(r * s, (r + 1) * s)
    args = [jax.device_put(x, dev) for x in (q[:, sl], k, v, do[:, sl], seg[:, sl], pos[:, sl], seg, pos)]
    times.append(common.time_fn(_rank_local, *args, warmup=1, reps=2))
  return max(times)


def _balancer(balance, n, seg):
  """Token permutation for a balance strategy (applied to every per-token array)."""
  if balance == "none":
    return lambda x: x
  if balance in ("striped", "zigzag"):
    return lambda x: load_balance(x, n, axis=1, strategy=balance)
  perm = load_balance_permutation(seg, n, strategy=balance)
  return lambda x: apply_permutation(x, perm, axis=1)


def run(seq_len, mean_doc, n_list, reps, balances=("none", "striped")):
  rng = np.random.default_rng(0)
  rows = common.packed_rows(rng, 1, seq_len, mean_doc)
  seg, pos = common.segments_and_positions(rows, seq_len)
  pairs = common.allowed_pairs(rows, causal=True)
  flops = 3.5 * 4 * D * HQ * pairs
  key = jax.random.PRNGKey(0)
  q = jax.random.normal(key, (1, seq_len, HQ, D), jnp.bfloat16)
  k = jax.random.normal(jax.random.fold_in(key, 1), (1, seq_len, HKV, D), jnp.bfloat16)
  v = jax.random.normal(jax.random.fold_in(key, 2), (1, seq_len, HKV, D), jnp.bfloat16)
  do = jax.random.normal(jax.random.fold_in(key, 3), (1, seq_len, HQ, D), jnp.bfloat16)
  seg, pos = jnp.asarray(seg), jnp.asarray(pos)

  one = jax.jit(_fwd_bwd("all_gather"))
  t1 = common.time_fn(one, q, k, v, do, seg, pos, warmup=1, reps=reps)
  ref_out, ref_grads = one(q, k, v, do, seg, pos)
  out_rows = [dict(seq=seq_len, mean_doc=mean_doc, docs=len(rows[0]), gpus=1, strategy="-", balance="-",
                   ms=t1 * 1e3, tflops=flops / t1 / 1e12, efficiency=1.0)]
  print(f"S={seq_len} doc={mean_doc}: 1 GPU {t1 * 1e3:.1f} ms ({flops / t1 / 1e12:.0f} TFLOP/s)", flush=True)
  for n in n_list:
    if n > len(jax.devices()):
      continue
    mesh = Mesh(np.array(jax.devices()[:n]), ("cp",))
    s4, s2 = NamedSharding(mesh, P(None, "cp", None, None)), NamedSharding(mesh, P(None, "cp"))
    for balance in balances:
      perm = _balancer(balance, n, seg)
      host = [perm(x) for x in (q, k, v, do, seg, pos)]
      args = [jax.device_put(x, s) for x, s in zip(host, (s4, s4, s4, s4, s2, s2))]
      t_comp = _rank_compute_time(*host, n)
      for strategy in ("all_gather", "ring"):
        f = jax.jit(_fwd_bwd(strategy))
        hlo = f.lower(*args).compile().as_text()
        t = common.time_fn(f, *args, warmup=1, reps=reps)
        out, grads = f(*args)
        err = max(float(common_rel(perm(a), b)) for a, b in zip((ref_out,) + tuple(ref_grads), (out,) + tuple(grads)))
        row = dict(seq=seq_len, mean_doc=mean_doc, docs=len(rows[0]), gpus=n, strategy=strategy, balance=balance,
                   ms=t * 1e3, tflops=flops / t / 1e12, efficiency=t1 / (n * t), compute_ms=t_comp * 1e3,
                   exposed_comm=max(0.0, (t - t_comp) / t), max_rel_err=err,
                   overlap=_overlap_evidence(hlo) if strategy == "ring" else None)
        out_rows.append(row)
        print(f"  {n} GPUs {strategy:10s} {balance:7s}: {t * 1e3:.1f} ms, eff {row['efficiency']:.2f}, "
              f"exposed comm {row['exposed_comm']:.2f}, err {err:.1e}, overlap {row['overlap']}", flush=True)
  return out_rows


def common_rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq", type=int, nargs="+", default=[131072, 262144])
  ap.add_argument("--docs", type=int, nargs="+", default=[8192, 32768])
  ap.add_argument("--gpus", type=int, nargs="+", default=[2, 4])
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--balance", nargs="+", default=["none", "striped", "balanced_blocks"],
                  help="none, striped, zigzag, zigzag_docs, balanced_blocks")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  rows = []
  for s in args.seq:
    for d in args.docs:
      rows += run(s, d, args.gpus, args.reps, args.balance)
  meta = common.run_metadata()
  header = ["S", "mean doc", "GPUs", "strategy", "balance", "ms", "TFLOP/s", "CP efficiency", "exposed comm", "max rel err", "overlap"]
  table = [[r["seq"], r["mean_doc"], r["gpus"], r["strategy"], r["balance"], f"{r['ms']:.1f}", f"{r['tflops']:.0f}",
            f"{r['efficiency']:.2f}", f"{r.get('exposed_comm', 0):.2f}", f"{r.get('max_rel_err', 0):.1e}",
            r.get("overlap", "-")] for r in rows]
  md = f"Device: {meta['device']}, JAX {meta['jax']}, {meta['date']}; 32/8 heads, D=128, causal, fwd+bwd, bf16.\n\n"
  md += common.markdown_table(header, table)
  common.write_results(common.result_name("cp", devices=max(args.gpus)), dict(meta=meta, rows=rows), md,
                       args.out)
  print(md)


if __name__ == "__main__":
  main()
