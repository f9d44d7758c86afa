"""Simulated context-parallel load balance of jaxcp's token permutations on packed rows.

For every document-length mix, sequence length S and context-parallel size cp, this draws rows of
packed documents, permutes them with each strategy of ``jaxcp.load_balance`` and counts, per rank,
the causal attention work: the number of allowed (query, key) pairs whose query lands on the rank
(keys anywhere, as under all-gather or ring context parallelism). A query at position p of a
causal document has p + 1 allowed keys, so the count is a vectorised per-token sum (numpy only).

Reported: max/mean of the per-rank work (1.0 is perfect balance; the step time of a CP group
follows the busiest rank), per row (mean and worst over the rows drawn) and summed over a batch.

    python benchmarks/cp_balance.py [--out benchmarks/results/cp_balance.json] [--rows 8] [--seed 0]
    python benchmarks/cp_balance.py --speed-only   (re-times the placement only, keeping --out's results)

Writes the JSON to --out, and the markdown table to stdout and next to the JSON (same name, .md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


from jaxcp._src.attention import load_balance as lb  # noqa: E402
from jaxcp._src.attention.placement import choose_with_eviction, exchange_cost  # noqa: E402


STRATEGIES = ("contiguous", "striped", "zigzag", "zigzag_docs", "balanced_blocks", "placement")
# What a DocumentPlacement exchanges: the shared region, cp * R of S tokens (all_gather: all of S).
PLACEMENT = "placement"
GROUPED = "placement_grouped"  # its shared region exchanged within groups of ranks (group_sizes)
TIMED = "placement_timed"  # grouped, the candidate of least predicted time (exchange_cost below)
# The time rule's price of a received token: 32/8 heads, D 128, jaxcp's H200 defaults.
EXCHANGE_COST = exchange_cost(32, 8, 128)
SEQ_LENS = (32 * 1024, 128 * 1024, 256 * 1024)
CP_SIZES = (2, 4, 8, 16, 32, 64)


# --------------------------------------------------------------------------------------------
# work model


def causal_work_per_token(segment_ids: np.ndarray) -> np.ndarray:
  """int64 [..., S]: allowed causal keys of each query, p + 1 at position p of its document.

  Documents are maximal runs of equal non-zero segment ids; padding (segment 0) does no work.
  """
  seg = np.asarray(segment_ids)
  s = seg.shape[-1]
  idx = np.broadcast_to(np.arange(s, dtype=np.int64), seg.shape)
  prev = np.concatenate([np.zeros_like(seg[..., :1]), seg[..., :-1]], axis=-1)
  start = (seg != prev) & (seg != 0)
  doc_start = np.maximum.accumulate(np.where(start, idx, 0), axis=-1)
  return np.where(seg != 0, idx - doc_start + 1, 0)


def rank_work(segment_ids: np.ndarray, perm, cp_size: int) -> np.ndarray:
  """int64 [..., cp]: causal work of each context-parallel rank after permuting with ``perm``.

  ``perm`` is None (contiguous shards, no balancing), a 1-D ``[S]`` permutation, or one per row
  ``[..., S]``, in the convention of ``jaxcp.load_balance``: permuted[j] = x[perm[j]], and rank
  r holds permuted positions [r * S / cp, (r + 1) * S / cp).
  """
  w = causal_work_per_token(segment_ids)
  if perm is not None:
    perm = np.asarray(perm)
    w = w[..., perm] if perm.ndim == 1 else np.take_along_axis(w, perm, axis=-1)
  return w.reshape(w.shape[:-1] + (cp_size, -1)).sum(-1)


def imbalance(work: np.ndarray) -> np.ndarray:
  """max / mean over the last (rank) axis; 1.0 is perfect balance."""
  work = np.asarray(work, dtype=np.float64)
  mean = work.mean(-1)
  return np.where(mean > 0, work.max(-1) / np.maximum(mean, 1e-300), 1.0)


def _tile_summary(seg: np.ndarray, pos: np.ndarray, tile: int):
  """Per tile of `tile` tokens (the last axis padded to whole tiles): min / max non-zero segment
  id and min / max position (an all-padding tile: min > max)."""
  pad = -seg.shape[-1] % tile
  if pad:
    widths = [(0, 0)] * (seg.ndim - 1) + [(0, pad)]
    seg, pos = np.pad(seg, widths), np.pad(pos, widths)
  shape = seg.shape[:-1] + (seg.shape[-1] // tile, tile)
  seg, pos = seg.reshape(shape), pos.reshape(shape)
  real = seg != 0
  big = np.iinfo(np.int64).max
  return (np.where(real, seg, big).min(-1), np.where(real, seg, -1).max(-1),
          np.where(real, pos, big).min(-1), np.where(real, pos, -1).max(-1))


def _visited(queries, keys, tile: int) -> np.ndarray:
  """Area per query tile that a tile-skipping kernel computes: tile**2 for every key tile whose
  segment range overlaps the query tile's and whose first position is not after its last."""
  (qs0, qs1, _, qp1), (ks0, ks1, kp0, _) = queries, keys
  q = lambda a: a[..., :, None]
  k = lambda a: a[..., None, :]
  visit = (q(qs0) <= k(ks1)) & (q(qs1) >= k(ks0)) & (q(qp1) >= k(kp0))
  return visit.sum(-1, dtype=np.int64) * tile * tile


def tile_work(segment_ids: np.ndarray, perm, cp_size: int, tile: int = 128) -> np.ndarray:
  """int64 [..., cp]: (q, k) pairs in the tiles a tile-skipping kernel visits, per rank.

  Models the CUDA kernels' tile skipping on the permuted layout (all-gathered keys in
  the same permuted order): per tile of ``tile`` tokens, a summary (min/max non-zero segment id,
  min/max position); a (query tile, key tile) pair is skipped when the segment ranges do not
  overlap or every query position is below every key position, and costs tile**2 otherwise.
  """
  seg = np.asarray(segment_ids)
  pos = causal_work_per_token(seg) - 1
  if perm is not None:
    perm = np.asarray(perm)
    seg = seg[..., perm] if perm.ndim == 1 else np.take_along_axis(seg, perm, axis=-1)
    pos = pos[..., perm] if perm.ndim == 1 else np.take_along_axis(pos, perm, axis=-1)
  assert seg.shape[-1] % (tile * cp_size) == 0
  summary = _tile_summary(seg, pos, tile)
  per_q_tile = _visited(summary, summary, tile)
  return per_q_tile.reshape(per_q_tile.shape[:-1] + (cp_size, -1)).sum(-1)


def placed_tile_work(row: np.ndarray, perm: np.ndarray, cp: int, placement, tile: int = 128) -> np.ndarray:
  """int64 [cp]: what a tile-skipping kernel visits on each rank of one placed row (tile_work's
  model): its local queries against its local keys, its shared queries against the shared keys
  of its group (every rank, ungrouped)."""
  seg = np.asarray(row)[perm]
  pos = (causal_work_per_token(np.asarray(row)) - 1)[perm]
  shard = seg.size // cp
  r = placement.shared_tokens
  c, g = shard - r, placement.group_size(cp)
  out = np.zeros(cp, np.int64)
  for rank in range(cp):
    lo = rank * shard
    if c:
      local = _tile_summary(seg[lo:lo + c], pos[lo:lo + c], tile)
      out[rank] += _visited(local, local, tile).sum()
    if r:
      first = rank // g * g
      keys = np.concatenate([np.arange(j * shard + c, (j + 1) * shard) for j in range(first, first + g)])
      out[rank] += _visited(_tile_summary(seg[lo + c:lo + shard], pos[lo + c:lo + shard], tile),
                            _tile_summary(seg[keys], pos[keys], tile), tile).sum()
  return out


def permutation(strategy: str, segment_ids: np.ndarray, cp_size: int, block_size: int = 128):
  if strategy == "contiguous":
    return None
  return lb.load_balance_permutation(segment_ids, cp_size, strategy=strategy,
                                     block_size=block_size)


# --------------------------------------------------------------------------------------------
# document-length mixes: each returns the segment ids of `rows` packed rows of length s


def _lognormal(rng, mean, n, sigma=1.0):
  mu = np.log(mean) - sigma**2 / 2
  return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64)


def _pareto(rng, mean, n, alpha=1.5):
  # Lomax (Pareto II) shifted to >= 1 with the given mean: heavy tail, many short documents.
  return (1 + np.rint((mean - 1) * (alpha - 1) * rng.pareto(alpha, n))).astype(np.int64)


def _segments_from_lengths(lengths, s):
  seg = np.zeros(s, np.int32)
  ends = np.cumsum(lengths)
  assert ends[-1] <= s
  seg[: ends[-1]] = np.repeat(np.arange(1, len(lengths) + 1, dtype=np.int32), lengths)
  return seg


def _pack_split(draw, s):
  """Concatenate documents until the row is full; the last one is cut to fit (no padding)."""
  lengths, total = [], 0
  while total < s:
    for n in draw(64):
      n = int(min(n, s - total))
      lengths.append(n)
      total += n
      if total == s:
        break
  return _segments_from_lengths(lengths, s)


def _pack_no_split(draw, s):
  """Next-fit without splitting: close the row at the first document that does not fit."""
  lengths, total = [], 0
  while True:
    n = int(min(draw(1)[0], s))
    if total + n > s:
      break
    lengths.append(n)
    total += n
  return _segments_from_lengths(lengths, s)


def _mix(kind, mean=None):
  def gen(rng, s):
    if kind == "one_doc":
      return np.ones(s, np.int32)
    if kind == "lognormal":
      return _pack_split(lambda n: _lognormal(rng, mean, n), s)
    if kind == "lognormal_padded":
      return _pack_no_split(lambda n: _lognormal(rng, mean, n), s)
    if kind == "pareto":
      return _pack_split(lambda n: _pareto(rng, mean, n), s)
    if kind == "long_short":  # one document of S/2 at a random place among ~1k documents
      lengths, total = [], 0
      while total < s // 2:
        n = int(min(_lognormal(rng, 1024, 1)[0], s // 2 - total))
        lengths.append(n)
        total += n
      lengths.insert(int(rng.integers(0, len(lengths) + 1)), s // 2)
      return _segments_from_lengths(lengths, s)
    raise ValueError(kind)
  return gen


MIXES = {
    "one_doc": _mix("one_doc"),
    "lognormal_1k": _mix("lognormal", 1024),
    "lognormal_2k": _mix("lognormal", 2048),
    "lognormal_4k": _mix("lognormal", 4096),
    "lognormal_8k": _mix("lognormal", 8192),
    "lognormal_32k": _mix("lognormal", 32768),
    "pareto_4k": _mix("pareto", 4096),
    "long_short": _mix("long_short"),
    "lognormal_4k_padded": _mix("lognormal_padded", 4096),
}
MIX_NOTES = {
    "one_doc": "one document of length S per row",
    "lognormal_1k": "lognormal lengths (sigma 1), mean 1k, packed full (last document cut)",
    "lognormal_2k": "lognormal, mean 2k, packed full",
    "lognormal_4k": "lognormal, mean 4k, packed full",
    "lognormal_8k": "lognormal, mean 8k, packed full",
    "lognormal_32k": "lognormal, mean 32k, packed full",
    "pareto_4k": "Pareto II (alpha 1.5) lengths, mean 4k, packed full",
    "long_short": "one document of S/2 at a random place + lognormal mean-1k documents",
    "lognormal_4k_padded": "lognormal, mean 4k, next-fit without cutting: padding tail",
}


# --------------------------------------------------------------------------------------------


def group_sizes(cp: int) -> tuple[int, ...]:
  """The shared group sizes a grouped placement chooses from: powers of two from 2 up to cp."""
  return tuple(g for g in (2 ** i for i in range(1, 7)) if g < cp) + (cp,)


def placement_entry(seg: np.ndarray, cp: int, grouped: bool = False, tile: int | None = None,
                    exchange: float | None = None) -> dict:
  """Causal work balance, bytes and left-out share of a DocumentPlacement chosen per row (the
  data pipeline's rule: the smallest shared size that balances; what finds no room left out).
  grouped: the shared region may also be exchanged within groups of ranks (group_sizes), the
  candidate (group g, R) taken by the tokens a rank receives. Bytes: what a rank receives,
  (g - 1) * R tokens, over all_gather's, (cp - 1) * S / cp (= cp * R / S ungrouped).
  tile: also model the tiles each rank's kernels visit (placed_tile_work). exchange: choose by
  predicted time (choose_with_eviction's exchange_cost) instead."""
  s = seg.shape[-1]
  per_row, shared, left_out, work, groups, tiles = [], [], [], [], [], []
  for row in seg:
    placement, perm, _, evicted = choose_with_eviction(row[None], cp, groups=group_sizes(cp) if grouped else None,
                                                       exchange_cost=exchange)
    placed = np.where(evicted, 0, row[None])
    w = rank_work(placed, perm, cp)
    per_row.append(float(imbalance(w)[0]))
    work.append(w[0])
    if tile:
      tiles.append(placed_tile_work(placed[0], perm[0], cp, placement, tile))
    groups.append(placement.group_size(cp))
    shared.append((groups[-1] - 1) * placement.shared_tokens * cp / ((cp - 1) * s))
    left_out.append(float(evicted.sum()) / max(int((row != 0).sum()), 1))
  sizes, counts = np.unique(np.round(np.asarray(shared) * 8).astype(int), return_counts=True)
  entry = dict(row_mean=float(np.mean(per_row)), row_max=float(np.max(per_row)),
               batch=float(imbalance(np.sum(work, axis=0))), bytes_mean=float(np.mean(shared)),
               bytes_max=float(np.max(shared)), left_out_mean=float(np.mean(left_out)),
               left_out_max=float(np.max(left_out)))
  if tile:
    tiles, work = np.asarray(tiles), np.asarray(work)
    step = tiles.max(-1) / (work.sum(-1) / cp)
    entry.update(tile_overhead=float(tiles.sum() / work.sum()), tile_step_mean=float(step.mean()),
                 tile_step_max=float(step.max()))
  if grouped:
    g, n = np.unique(groups, return_counts=True)
    return dict(entry, groups_taken={int(k): int(c) for k, c in zip(g, n)})
  return dict(entry, sizes_taken={f"{int(k)}/8": int(n) for k, n in zip(sizes, counts)})


def placement_speed(seed: int, batch: int = 8, seq_len: int = 256 * 1024, repeats: int = 3) -> list[dict]:
  """Seconds per batch of choose_with_eviction (the data pipeline's placement step) on the CPU,
  the best of `repeats`."""
  rng = np.random.default_rng(seed)

  def best_of(**kwargs):
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      choose_with_eviction(seg, cp, **kwargs)
      times.append(time.perf_counter() - t0)
    return min(times)

  out = []
  for name in ("lognormal_2k", "lognormal_8k", "one_doc"):
    seg = np.stack([MIXES[name](rng, seq_len) for _ in range(batch)])
    for cp in (4, 8, 16):
      out.append(dict(mix=name, cp=cp, batch=batch, seq_len=seq_len, seconds=best_of(),
                      timed_seconds=best_of(groups=group_sizes(cp), exchange_cost=EXCHANGE_COST)))
  return out


def run(rows: int, seed: int, seq_lens=SEQ_LENS, cp_sizes=CP_SIZES, mixes=None,
        tile: int = 128, tile_max_seq: int = 128 * 1024):
  mixes = list(MIXES) if mixes is None else list(mixes)
  rng = np.random.default_rng(seed)
  results = []
  for s in seq_lens:
    for name in mixes:
      seg = np.stack([MIXES[name](rng, s) for _ in range(rows)])
      docs = int(((seg != 0) & (seg != np.concatenate([np.zeros_like(seg[:, :1]), seg[:, :-1]],
                                                      axis=1))).sum())
      for cp in cp_sizes:
        entry = dict(mix=name, seq_len=s, cp=cp, rows=rows, docs_per_row=docs / rows,
                     padding=float((seg == 0).mean()))
        if s <= tile_max_seq:  # one kernel over the whole row: the reference for the tile model
          entry["one_gpu_tile_overhead"] = float(tile_work(seg, None, 1, tile).sum() / rank_work(seg, None, 1).sum())
        for strategy in STRATEGIES:
          if strategy == PLACEMENT:
            entry[strategy] = placement_entry(seg, cp, tile=tile if s <= tile_max_seq else None)
            entry[GROUPED] = placement_entry(seg, cp, grouped=True)
            entry[TIMED] = placement_entry(seg, cp, grouped=True, exchange=EXCHANGE_COST)
            continue
          perm = permutation(strategy, seg, cp, tile)
          w = rank_work(seg, perm, cp)
          per_row = imbalance(w)
          entry[strategy] = dict(row_mean=float(per_row.mean()), row_max=float(per_row.max()),
                                 batch=float(imbalance(w.sum(0))))
          if s <= tile_max_seq:
            tw = tile_work(seg, perm, cp, tile)
            step = tw.max(-1) / (w.sum(-1) / cp)   # busiest rank vs an even split of the work
            entry[strategy].update(
                tile_overhead=float(tw.sum() / w.sum()), tile_step_mean=float(step.mean()),
                tile_step_max=float(step.max()), tile_row_mean=float(imbalance(tw).mean()),
                tile_row_max=float(imbalance(tw).max()))
        results.append(entry)
  return results


def _placement_row(e, key, taken_key) -> str:
  """A placement table's row: bytes, left out, work balance and what the rows took."""
  p = e[key]
  taken = ", ".join(f"{k}: {n}" for k, n in p[taken_key].items())
  return (f"| {e['mix']} | {e['seq_len'] // 1024}k | {e['cp']} | {p['bytes_mean']:.2f} ({p['bytes_max']:.2f}) | "
          f"{p['left_out_mean']:.2%} ({p['left_out_max']:.2%}) | {p['row_mean']:.3f} ({p['row_max']:.3f}) | "
          f"{taken} |")


def _placement_table(title, description, entries, key, taken_title, taken_key) -> list[str]:
  return ["", title, "", description, "",
          f"| mix | S | cp | bytes vs all_gather | left out | work max/mean | {taken_title} |",
          "|---|---|---|---|---|---|---|"] + [_placement_row(e, key, taken_key) for e in entries]


def markdown(results, speed=()) -> str:
  lines = [
      "# Context-parallel load balance (simulated causal work)",
      "",
      "max/mean of per-rank causal work (allowed (q, k) pairs whose query lands on the rank); "
      "1.00 is even. Cell: mean over rows (worst row). `contiguous` = no permutation.",
      "",
      "| mix | S | cp | docs/row | " + " | ".join(STRATEGIES) + " |",
      "|---|---|---|---|" + "---|" * len(STRATEGIES),
  ]
  for e in results:
    cells = [f"{e[st]['row_mean']:.3f} ({e[st]['row_max']:.3f})" for st in STRATEGIES]
    lines.append(f"| {e['mix']} | {e['seq_len'] // 1024}k | {e['cp']} | {e['docs_per_row']:.1f} | "
                 + " | ".join(cells) + " |")
  lines += ["", "## Worst row over all packed mixes (all but one_doc) and all S", "",
            "| cp | " + " | ".join(STRATEGIES) + " |", "|---|" + "---|" * len(STRATEGIES)]
  for cp in sorted({e["cp"] for e in results}):
    sel = [e for e in results if e["cp"] == cp and e["mix"] != "one_doc"]
    if sel:
      lines.append(f"| {cp} | " + " | ".join(
          f"{max(e[st]['row_max'] for e in sel):.3f}" for st in STRATEGIES) + " |")
  placed = [e for e in results if PLACEMENT in e]
  if placed:
    lines += _placement_table(
        "## Document placement: what it exchanges and leaves out",
        "Per row, the smallest shared size (0, 1/8, 1/4, 3/8, 1/2, 3/4 or all of S/cp per rank) that "
        "balances the cost model within 2% with at most 2% of the tokens left out (a pipeline packs those "
        "into later rows). Cell: bytes exchanged relative to all_gather's (cp * R / S), mean (max) over rows; "
        "tokens left out, mean (max); causal work max/mean, mean (worst row); the sizes taken (R as "
        "eighths of S/cp: rows).", placed, PLACEMENT, "sizes taken", "sizes_taken")
  grouped = [e for e in placed if GROUPED in e]
  if grouped:
    lines += _placement_table(
        "### With grouped shared regions",
        "The same rows, the shared region exchanged within groups of g ranks (g from 2, 4, ..., cp; "
        "`choose_placement(groups=...)` tries each (g, R) by the tokens a rank receives, fewest "
        "first). Cell: bytes a rank receives relative to all_gather's ((g - 1) * R against (cp - 1) * S "
        "/ cp), mean (max) over rows; tokens left out; causal work max/mean; the group sizes taken (g: rows).",
        grouped, GROUPED, "groups taken", "groups_taken")
  timed = [e for e in placed if TIMED in e]
  if timed:
    lines += _placement_table(
        "### By predicted time",
        f"The same rows and groups, each row's (g, R) the one of least predicted time "
        f"(`choose_placement(..., exchange_cost=jaxcp.exchange_cost(32, 8, 128))` = {EXCHANGE_COST:.0f} cost units "
        f"a received token: 32/8 heads, D 128, H200 rates): the costliest rank's cost plus the exchange. "
        f"Cells as above.", timed, TIMED, "groups taken", "groups_taken")
  tiled = [e for e in results if "tile_overhead" in e[STRATEGIES[0]]]
  tile_strategies = list(STRATEGIES)
  if tiled:
    lines += [
        "", "## What a tile-skipping kernel visits (128 x 128 tiles)", "",
        "Per-tile summaries (min/max segment id and position) decide which (query tile, key tile) "
        "pairs are computed, on the permuted layout (keys all-gathered in the same order; the "
        "placement: local queries against the rank's local keys, shared queries against the shared keys). "
        "Cell: `overhead` = visited area / allowed pairs over the batch (1.0 = no waste); then "
        "`step` = visited area of the busiest rank / (allowed pairs / cp), mean over rows (worst "
        "row): the modelled step time relative to a perfect kernel with perfect balance. "
        "balanced_blocks uses block_size = tile. `1 GPU`: the overhead of one kernel over the whole row.", "",
        "| mix | S | cp | 1 GPU | " + " | ".join(tile_strategies) + " |",
        "|---|---|---|---|" + "---|" * len(tile_strategies)]
    for e in tiled:
      cells = [f"{e[st]['tile_overhead']:.2f}, {e[st]['tile_step_mean']:.2f} "
               f"({e[st]['tile_step_max']:.2f})" for st in tile_strategies]
      lines.append(f"| {e['mix']} | {e['seq_len'] // 1024}k | {e['cp']} | {e['one_gpu_tile_overhead']:.2f} | "
                   + " | ".join(cells) + " |")
    lines += ["", "Worst row over all packed mixes, modelled step (busiest rank's visited area / "
              "(allowed / cp)):", "", "| cp | " + " | ".join(tile_strategies) + " |",
              "|---|" + "---|" * len(tile_strategies)]
    for cp in sorted({e["cp"] for e in tiled}):
      sel = [e for e in tiled if e["cp"] == cp and e["mix"] != "one_doc"]
      lines.append(f"| {cp} | " + " | ".join(
          f"{max(e[st]['tile_step_max'] for e in sel):.2f}" for st in tile_strategies) + " |")
  if speed:
    lines += ["", "## Placement speed (CPU, one core, numpy)", "",
              "Seconds for `choose_with_eviction` (choose the shared size, place and permute every row) on one "
              "batch, by the tolerance rule and by predicted time over every group size (best of 3):", "",
              "| mix | B x S | cp | seconds, tolerance | seconds, predicted time |", "|---|---|---|---|---|"]
    lines += [f"| {e['mix']} | {e['batch']} x {e['seq_len'] // 1024}k | {e['cp']} | {e['seconds']:.2f} | "
              f"{e['timed_seconds']:.2f} |" for e in speed]
  lines += ["", "Mixes:", ""] + [f"- `{k}`: {v}" for k, v in MIX_NOTES.items()
                                 if any(e["mix"] == k for e in results)]
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results",
                                                    "cp_balance.json"))
  parser.add_argument("--rows", type=int, default=8, help="rows drawn per (mix, S)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--seq", type=int, nargs="+", default=list(SEQ_LENS))
  parser.add_argument("--cp", type=int, nargs="+", default=list(CP_SIZES))
  parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
  parser.add_argument("--tile", type=int, default=128, help="kernel tile size for the tile model")
  parser.add_argument("--tile-max-seq", type=int, default=128 * 1024,
                      help="largest S for the tile model (its cost grows as S**2)")
  parser.add_argument("--speed-only", action="store_true",
                      help="time the placement only; the simulation's results stay those in --out")
  args = parser.parse_args(argv)
  if args.speed_only:
    with open(args.out) as f:
      kept = json.load(f)
    results, elapsed, rows, seed = kept["results"], kept["seconds"], kept["rows"], kept["seed"]
  else:
    t0 = time.perf_counter()
    results = run(args.rows, args.seed, seq_lens=args.seq, cp_sizes=args.cp, mixes=args.mixes, tile=args.tile,
                  tile_max_seq=args.tile_max_seq)
    elapsed, rows, seed = time.perf_counter() - t0, args.rows, args.seed
  speed = placement_speed(seed)
  md = markdown(results, speed)
  out_dir = os.path.dirname(os.path.abspath(args.out))
  os.makedirs(out_dir, exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(dict(description="max/mean per-rank causal work; see benchmarks/cp_balance.py",
                   rows=rows, seed=seed, seconds=elapsed, mixes=MIX_NOTES,
                   results=results, placement_speed=speed), f, indent=1)
  md_path = os.path.splitext(args.out)[0] + ".md"
  with open(md_path, "w") as f:
    f.write(md)
  sys.stdout.write(md)
  print(f"\n{len(results)} configurations in {elapsed:.1f} s; wrote {args.out} and {md_path}")


if __name__ == "__main__":
  main()
