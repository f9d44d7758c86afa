"""Context-parallel scaling: the same global problem on 1, 2 and 4 GPUs, every strategy in one run.

B = 1 row of S tokens, causal, D = 128, bf16, forward+backward. Rows: lognormal document lengths
(sigma 1) with means 2k, 8k and 32k, or one document of S tokens, packed full; then what a
DocumentPlacement over the largest GPU count leaves out becomes padding (an input pipeline packs
those documents into later rows; the share is reported), and that row is the problem for every
GPU count and strategy.

Strategies: "placement" (jaxcp.choose_placement per GPU count and balance tolerance,
context_parallel=placement),
"all_gather" on balanced_blocks rows and "ring" on striped rows (the best of the others).
Reported per case:
  efficiency     T1 / (N * TN), T1 the one-GPU time of the same row;
  split work     (in the JSON, with each rank's time) the ranks' kernel times added up over T1:
                 what cutting the row costs in kernel work, before any imbalance;
  exposed comm   (TN - Tcompute) / TN, Tcompute the slowest rank's kernels timed alone on one
                 GPU (its queries against the keys it attends to, all local);
  MB/rank        bytes a rank receives per forward+backward (K and V in bf16, segment ids and
                 positions: gathered once by a placement that keeps them for the backward; dK/dV
                 summed over the ranks: bf16 in the all-to-all of all_gather and the placement,
                 float32 in the ring);
  R              the placement's shared tokens per rank (of S / N);
  max rel err    against the one-GPU outputs and gradients;
  overlap        the compiled schedule has a jaxcp kernel inside an all-gather-start/done
                 (placement; and inside the backward's all-to-all-start/done, where the forward
                 kept the gathered K/V) or collective-permute-start/done (ring) window.

  python benchmarks/bench_cp.py                                   # everything (two device calls' worth)
  python benchmarks/bench_cp.py --seq 131072 --mixes doc8k --heads 32 8
  python benchmarks/bench_cp.py --gpus 2 --cases 131072:doc8k:32/8 --hlo-dir $OUT/hlo   # + schedules

Writes cp_<kind>x<N>.{json,md} (kind: the device, N: the most GPUs run, e.g. cp_h200x4) to
--out, $OUT or benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import doc_mixes  # noqa: E402

import jaxcp  # noqa: E402
from jaxcp._src.attention.context_parallel import keeps_gathered as jaxcp_keeps_gathered  # noqa: E402
from jaxcp._src.attention.context_parallel import _own_keys_first, _sort_block as sort_block  # noqa: E402
from jaxcp._src.attention.context_parallel import trades_with_partner as jaxcp_trades  # noqa: E402

D = 128
STRATEGIES = {"placement": "placement", "all_gather": "balanced_blocks", "ring": "striped"}


def _fwd_bwd(strategy):
  def f(q, k, v, do, seg, pos):
    g = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, is_causal=True,
                                        context_parallel=strategy)
    out, vjp = jax.vjp(g, q, k, v)
    return (out, *vjp(do))
  return f


def _local_fwd_bwd(q, k, v, do, qs, qp, ks, kp):
  g = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=qs, positions=qp, kv_segment_ids=ks, kv_positions=kp,
                                      is_causal=True)
  out, vjp = jax.vjp(g, q, k, v)
  return (out, *vjp(do))


_local = jax.jit(_local_fwd_bwd)


def _kernel_computations(lines) -> set:
  """Computations that call a jaxcp kernel (XLA wraps a kernel whose operands are slices in a
  fusion that passes it addresses into the whole arrays)."""
  holders, current = set(), None
  for line in lines:
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
    elif "custom-call" in line and "jaxcp_attention" in line:
      holders.add(current)
  return holders


def overlap_evidence(hlo: str, op: str) -> bool:
  """True if some `op`-start .. `op`-done window of the compiled schedule runs a jaxcp kernel."""
  lines = hlo.splitlines()
  holders = _kernel_computations(lines)
  runs_kernel = lambda w: (("custom-call" in w and "jaxcp_attention" in w)
                           or any(f"calls=%{h}" in w or f"calls={h}" in w for h in holders))
  starts = {}
  for i, line in enumerate(lines):
    m = re.search(rf"(%?[\w.\-]+) = .*{op}-start", line)
    if m:
      starts[m.group(1).lstrip("%")] = i
    m = re.search(rf"{op}-done\((%?[\w.\-]+)", line)
    if m and m.group(1).lstrip("%") in starts:
      if any(runs_kernel(w) for w in lines[starts[m.group(1).lstrip("%")]:i]):
        return True
  return False


def bytes_per_rank(strategy, n, s, hkv, shared=0, gathers=2, group=None):
  """Bytes one rank receives per forward+backward (see the module doc); gathers: how many times
  the placement gathers the shared K/V (1 when the forward keeps them); group: the ranks a
  placement's shared region is exchanged among (default all n)."""
  kv_token = 2 * hkv * D * 2 + 8          # K and V in bf16, segment id and position
  grad_token = 2 * hkv * D * 2            # dK and dV in bf16 (all-to-all, summed in float32 on arrival)
  if strategy == "placement":
    return ((group or n) - 1) * shared * (gathers * kv_token + grad_token)
  if strategy == "ring":
    return (n - 1) * (s // n) * 2 * kv_token + n * (s // n) * 2 * grad_token   # float32 accumulators
  return (n - 1) * (s // n) * (2 * kv_token + grad_token)


def in_document_order(keys, seg, pos, block):
  """Gathered key indices as jaxcp orders them for its kernels: blocks of `block` tokens sorted by
  the (segment, position) of their first token (context_parallel._sort_keys)."""
  blocks = keys.reshape(-1, block)
  return blocks[np.lexsort((pos[blocks[:, 0]], seg[blocks[:, 0]]))].reshape(-1)


def rank_compute_times(strategy, arrays, n, shared, reps, group=None):
  """Each rank's own kernels timed alone on one GPU (what it computes, no communication), in
  seconds, with the gathered keys in the order jaxcp gives them (in_document_order; rank order
  where an all-shared shard of at most 2 query heads a key head runs its own keys and the
  others' as two calls, timed so; in jaxcp the others' call of a group of more than 2 sees the
  rank's own keys too, masked); group: the ranks whose shared keys a placement's shared queries
  see (default all n)."""
  dev = jax.devices()[0]
  q, k, v, do, seg, pos = arrays
  shard = q.shape[1] // n
  row_seg, row_pos = np.asarray(seg[0]), np.asarray(pos[0])
  order = lambda keys, r: in_document_order(keys, row_seg, row_pos, sort_block(r))
  times = []
  for r in range(n):
    mine = slice(r * shard, (r + 1) * shard)
    if strategy == "placement":
      c = shard - shared
      parts = []
      if c:
        lo = slice(r * shard, r * shard + c)
        parts.append((lo, lo))
      if shared:
        g = group or n
        ranks = range(r // g * g, r // g * g + g)
        region = lambda j: np.arange(j * shard + c, (j + 1) * shard)
        queries = slice(r * shard + c, (r + 1) * shard)
        if _own_keys_first(c, q, k):  # two calls: the rank's own keys, then the others' (rank order)
          parts += [(queries, region(r)), (queries, np.concatenate([region(j) for j in ranks if j != r]))]
        else:
          parts.append((queries, order(np.concatenate([region(j) for j in ranks]), shared)))
    elif strategy == "all_gather":
      parts = [(mine, order(np.arange(q.shape[1]), shard))]
    else:
      parts = [(mine, slice(None))]
    total = 0.0
    for qi, ki in parts:
      args = [jax.device_put(x, dev) for x in (q[:, qi], k[:, ki], v[:, ki], do[:, qi], seg[:, qi], pos[:, qi],
                                                seg[:, ki], pos[:, ki])]
      total += common.time_fn(_local, *args, warmup=1, reps=reps)
    times.append(total)
  return times


def rel_err(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def load_calibration(calibration=None) -> dict:
  """calibrate_placement.py's JSON ({}: none)."""
  if not calibration:
    return {}
  with open(calibration) as f:
    return json.load(f)


def _fit(cal: dict, heads):
  """The calibration's kernel fit for these (query, key-value) heads, or None."""
  return next((f for f in cal.get("fits", []) if heads is not None and tuple(f["heads"]) == tuple(heads)), None)


def placement_cost(cal: dict, heads=None) -> dict:
  """token_cost and pair_cost of the calibration's fit for these heads (its first fit when it has
  none for them; {}: the built-in costs)."""
  fit = _fit(cal, heads) or cal
  return dict(token_cost=fit["token_cost"], pair_cost=fit["pair_cost"]) if fit else {}


def group_choices(n: int) -> tuple[int, ...]:
  """The shared group sizes the time-model placement chooses from over n GPUs: every divisor > 1."""
  return tuple(g for g in range(2, n + 1) if n % g == 0)


def exchange_cost(cal: dict, heads, gpus: int) -> float:
  """jaxcp.exchange_cost of these heads at D = 128 with the calibration's rates for this GPU count
  (half the bytes in the all-gather, half in the all-to-all) and its pair time for these heads
  (jaxcp's defaults where it has none)."""
  hq, hkv = heads
  fit = _fit(cal, heads)
  rates = [cal.get("exchange_bytes_per_s", {}).get(op, {}).get(str(gpus)) for op in ("all_gather", "all_to_all")]
  kw = dict(pair_cost=fit["pair_cost"], pair_seconds=fit["pair_seconds"]) if fit else {}
  if all(rates):
    kw["bytes_per_second"] = 2 / sum(1 / r for r in rates)
  return jaxcp.exchange_cost(hq, hkv, D, **kw)


def problem(seq_len, mix, heads, max_gpus, cost, seed=0):
  """One row of the mix with what a placement over max_gpus leaves out turned into padding:
  ((q, k, v, dO, segment ids, positions) as JAX arrays, the share of tokens left out)."""
  hq, hkv = heads
  seg = doc_mixes.packed_row(np.random.default_rng(seed), seq_len, mix)[None]
  seg, left_out = doc_mixes.placeable(seg, max_gpus, **cost)
  pos = doc_mixes.positions(seg)
  key = jax.random.PRNGKey(seed)
  shapes = [(1, seq_len, hq, D), (1, seq_len, hkv, D), (1, seq_len, hkv, D), (1, seq_len, hq, D)]
  q, k, v, do = (jax.random.normal(jax.random.fold_in(key, i), s, jnp.bfloat16) for i, s in enumerate(shapes))
  return (q, k, v, do, jnp.asarray(seg), jnp.asarray(pos)), left_out


def layout(strategy, seg, n, cost, tolerance=None, groups=None, exchange=None):
  """(jaxcp.attention's context_parallel, the permutation for jaxcp.load_balance) of a strategy
  over n GPUs: the placement chosen for the row (among `groups` of ranks for its shared region,
  default all n; by predicted time with exchange, jaxcp.exchange_cost's), or the other
  strategies on STRATEGIES' layouts."""
  if strategy == "placement":
    placement, perm, _ = jaxcp.choose_placement(np.asarray(seg), n, **cost, groups=groups, exchange_cost=exchange,
                                                **({} if tolerance is None else dict(tolerance=tolerance)))
    return placement, perm
  balance = STRATEGIES[strategy]
  return strategy, (jaxcp.load_balance_permutation(np.asarray(seg), n, strategy=balance) if balance != "striped"
                    else balance)


def run_case(seq_len, mix, heads, gpu_counts, reps, cal, tolerances, exposed_gpus, others=("all_gather", "ring"),
             seed=0, hlo_dir=None, groups=(), time_rule=True):
  hq, hkv = heads
  # The row: left out by the first fit's costs, the same row for every heads pair.
  (q, k, v, do, seg, pos), left_out = problem(seq_len, mix, heads, max(gpu_counts), placement_cost(cal), seed)
  cost = placement_cost(cal, heads)
  flops = 3.5 * 4 * D * hq * doc_mixes.allowed_causal_pairs(np.asarray(seg))
  base = dict(seq=seq_len, mix=mix, heads=f"{hq}/{hkv}", left_out=left_out,
              docs=int(len(np.unique(np.asarray(seg)[np.asarray(seg) != 0]))))

  one = jax.jit(_fwd_bwd("auto"))
  t1 = common.time_fn(one, q, k, v, do, seg, pos, warmup=1, reps=reps)
  ref = one(q, k, v, do, seg, pos)
  rows = [dict(base, gpus=1, strategy="-", ms=t1 * 1e3, tflops=flops / t1 / 1e12, efficiency=1.0)]
  print(f"S={seq_len} {mix} {hq}/{hkv}: 1 GPU {t1 * 1e3:.1f} ms ({flops / t1 / 1e12:.0f} TFLOP/s), "
        f"{base['docs']} documents, {left_out:.2%} left out", flush=True)
  for n in gpu_counts:
    if n > len(jax.devices()):
      continue
    mesh = Mesh(np.array(jax.devices()[:n]), ("cp",))
    sh = NamedSharding(mesh, P(None, "cp"))
    cases = ([("placement", "time model", (None, group_choices(n), exchange_cost(cal, heads, n)))]
             if time_rule and n > 1
             else [])
    cases += [("placement", f"tolerance {t:g}", (t, None)) for t in tolerances]
    cases += [("placement", f"tolerance {t:g}, groups of {g}", (t, (g, n))) for t in tolerances for g in groups
              if g < n and n % g == 0]
    cases += [(s, b, (None, None)) for s, b in STRATEGIES.items() if s != "placement" and s in others]
    for strategy, balance, variant in cases:
      context_parallel, perm = layout(strategy, seg, n, cost, *variant)
      shared = context_parallel.shared_tokens if strategy == "placement" else 0
      group = getattr(context_parallel, "shared_group", None)
      permute = lambda x: jaxcp.load_balance(x, n, axis=1, strategy=perm)
      host = [permute(x) for x in (q, k, v, do, seg, pos)]
      args = [jax.device_put(x, sh) for x in host]
      f = jax.jit(_fwd_bwd(context_parallel))
      hlo = f.lower(*args).compile().as_text()
      if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        tag = strategy + ("_time" if len(variant) > 2 else f"_groups{variant[1][0]}" if variant[1] else "")
        with open(os.path.join(hlo_dir, f"{seq_len // 1024}k_{mix}_{hq}-{hkv}_{n}gpus_{tag}.hlo.txt"), "w") as fh:
          fh.write(hlo)
      t = common.time_fn(f, *args, warmup=1, reps=reps)
      got = f(*args)
      err = max(rel_err(jaxcp.restore_order(a, n, axis=1, strategy=perm), b) for a, b in zip(got, ref))
      ranks_t = (rank_compute_times(strategy, host, n, shared, max(2, reps // 2), group) if n in exposed_gpus
                 else [float("nan")])
      t_comp = max(ranks_t)
      trades = strategy == "placement" and shared and jaxcp_trades(context_parallel, n, seq_len // n, hq, hkv)
      op = "collective-permute" if trades else {"placement": "all-gather", "ring": "collective-permute"}.get(strategy)
      row = dict(base, gpus=n, strategy=strategy, balance=balance, shared_tokens=shared, shared_group=group, ms=t * 1e3,
                 tflops=flops / t / 1e12, efficiency=t1 / (n * t), compute_ms=t_comp * 1e3,
                 rank_compute_ms=[x * 1e3 for x in ranks_t], split_work=sum(ranks_t) / t1,
                 exposed_comm=max(0.0, (t - t_comp) / t) if t_comp == t_comp else None, max_rel_err=err,
                 mb_per_rank=bytes_per_rank(strategy, n, seq_len, hkv, shared, group=group,
                                            gathers=1 if jaxcp_keeps_gathered(context_parallel) else 2) / 1e6,
                 overlap=overlap_evidence(hlo, op) if op and (strategy != "placement" or shared) else None)
      if strategy == "placement" and shared and jaxcp_keeps_gathered(context_parallel):
        # The backward's dK/dV exchange has the local part inside it (the forward kept the gather).
        row["overlap"] = row["overlap"] and overlap_evidence(hlo, op if trades else "all-to-all")
      rows.append(row)
      print(f"  {n} GPUs {strategy:10s} {balance:15s} R={shared:6d}: {t * 1e3:7.1f} ms, eff {row['efficiency']:.3f}, "
            f"exposed {row['exposed_comm']}, ranks {sum(ranks_t) / t1:.3f} x T1 (max {t_comp * n / t1:.3f}), "
            f"{row['mb_per_rank']:.0f} MB/rank, err {err:.1e}, "
            f"overlap {row['overlap']}", flush=True)
  return rows


def table(rows) -> str:
  header = ["S", "mix", "heads", "GPUs", "strategy", "R", "ms", "TFLOP/s", "CP efficiency", "exposed comm",
            "MB/rank", "max rel err", "overlap", "left out"]
  out = []
  for r in rows:
    out.append([f"{r['seq'] // 1024}k", r["mix"], r["heads"], r["gpus"],
                r["strategy"] if r["gpus"] == 1 else f"{r['strategy']} ({r['balance']})",
                (f"{r['shared_tokens']}" + (f" in groups of {r['shared_group']}" if r.get("shared_group") else ""))
                if r["strategy"] == "placement" else "-",
                f"{r['ms']:.1f}", f"{r['tflops']:.0f}", f"{r['efficiency']:.3f}",
                "-" if r.get("exposed_comm") is None else f"{r['exposed_comm']:.3f}", f"{r.get('mb_per_rank', 0):.0f}",
                f"{r.get('max_rel_err', 0):.1e}", r.get("overlap", "-"), f"{r['left_out']:.2%}"])
  return common.markdown_table(header, out)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq", type=int, nargs="+", default=[131072, 262144])
  ap.add_argument("--mixes", nargs="+", default=list(doc_mixes.MIXES), choices=list(doc_mixes.MIXES))
  ap.add_argument("--heads", type=int, nargs="+", default=[32, 8, 16, 16],
                  help="pairs of query / key-value heads (default 32 8 16 16)")
  ap.add_argument("--gpus", type=int, nargs="+", default=[2, 4])
  ap.add_argument("--exposed-gpus", type=int, nargs="*", default=None,
                  help="GPU counts whose exposed communication is measured (each rank's kernels timed "
                       "alone; default: every count)")
  ap.add_argument("--cases", nargs="*", default=None, metavar="S:MIX:HQ/HKV",
                  help="run these cases instead of --seq x --mixes x --heads, e.g. 131072:doc8k:32/8")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--others", nargs="*", default=["all_gather", "ring"], choices=["all_gather", "ring"],
                  help="the other strategies to run beside the placement")
  ap.add_argument("--tolerances", type=float, nargs="*", default=[0.02],
                  help="placement balance tolerances to run (each a strategy of its own: the smallest "
                       "shared size within the tolerance)")
  ap.add_argument("--no-time-rule", action="store_true",
                  help="leave out the placement chosen by predicted time (choose_placement's exchange_cost, "
                       "from the calibration's rates, every group size)")
  ap.add_argument("--groups", type=int, nargs="*", default=[],
                  help="also run placements whose shared region may be exchanged within groups of this many "
                       "ranks (choose_placement(groups=(g, n))), one strategy per g")
  ap.add_argument("--calibration", default=None,
                  help="placement_calibration.json from calibrate_placement.py (default: the built-in costs)")
  ap.add_argument("--hlo-dir", default=None, help="write each sharded program's compiled HLO (its schedule) here")
  ap.add_argument("--append", action="store_true", help="add to the rows of an earlier run in --out")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  heads = list(zip(args.heads[::2], args.heads[1::2]))
  cal = load_calibration(args.calibration)
  out_dir = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
  rows = []
  name = common.result_name("cp", max(n for n in args.gpus if n <= len(jax.devices())))
  path = os.path.join(out_dir, name + ".json")
  if args.append and os.path.exists(path):
    with open(path) as f:
      rows = json.load(f)["rows"]
  cases = [(s, mix, h) for s in args.seq for mix in args.mixes for h in heads]
  if args.cases:
    cases = [(int(c.split(":")[0]), c.split(":")[1], tuple(int(x) for x in c.split(":")[2].split("/")))
             for c in args.cases]
  exposed = args.gpus if args.exposed_gpus is None else args.exposed_gpus
  for s, mix, h in cases:
    rows += run_case(s, mix, h, args.gpus, args.reps, cal, args.tolerances, exposed, args.others,
                     hlo_dir=args.hlo_dir, groups=args.groups, time_rule=not args.no_time_rule)
  meta = common.run_metadata()
  md = (f"Device: {meta['device']}, JAX {meta['jax']}, {meta['date']}; B=1, D=128, causal, forward+backward, bf16; "
        f"placement cost {placement_cost(cal) or 'built-in'} (per heads: the calibration's fits).\n\n" + table(rows))
  common.write_results(name, dict(meta=meta, cost=placement_cost(cal), calibration=cal, rows=rows), md, out_dir)
  print(md)


if __name__ == "__main__":
  main()
