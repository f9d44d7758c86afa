"""Merges, summarises and plots the small-seq shape sweep (`bench_small_seq.py --sweep`).

  python benchmarks/plot_small_seq.py RESULTS/small_seq_sweep_h100_part*.json [--out DIR] [--name STEM]

Takes one or more sweep JSON files (the parts of one run: `--part i/n`), and writes to --out
(default: the first file's folder) STEM.json (the merged results), STEM.md and STEM.png. STEM
defaults to the first file's name without its `_partI` suffix (with `_merged` added when that
would overwrite an input).

The markdown holds (a) a summary: points below 1.0x XLA (forward, forward+backward), the lowest
ratios and where, points moving more than 256 MB that are below 1.5x XLA forward+backward, the
lowest % of a device copy at B >= 65536; (b) every point, sorted by (D, heads, Skv, layout, B);
(c) per (group size G = Hq/Hkv, D, Skv): which CUDA kernel family was fastest for the forward and
for the backward kernel and how much slower each family was (the dispatch rule reads off it).
The PNG: speedup over XLA against the bytes each call moves, forward and forward+backward.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

VARIANT_ORDER = ("auto", "mma", "lanes", "cuda_core")
MB = 1e6
BIG_BYTES = 256 * MB  # summary: points moving more than this should beat XLA by 1.5x
BIG_BATCH = 65536     # summary: lowest % of copy over B >= this (bandwidth-bound points)


def sort_key(r: dict):
  return (r["head_dim"], r["q_heads"], r["kv_heads"], r["skv"], r["layout"], r["batch"])


def load(paths):
  """(metas, results): the metadata of every file and the results of all, one per point (a point
  measured in two files keeps the later file's row), sorted by sort_key."""
  metas, by_key, replaced = [], {}, 0
  for path in paths:
    with open(path) as f:
      payload = json.load(f)
    meta = payload.get("meta", {})
    for m in meta.get("parts", [meta]):  # a merged file carries its parts' metadata
      if m not in metas:
        metas.append(m)
    for r in payload["results"]:
      key = sort_key(r)
      replaced += key in by_key and by_key[key] != r
      by_key[key] = r
  if replaced:
    print(f"{replaced} points measured in more than one file: kept the later file's rows",
          file=sys.stderr)
  return metas, sorted(by_key.values(), key=sort_key)


# ---------------------------------------------------------------- markdown


def _f(x, fmt=".2f") -> str:
  return "-" if x is None else format(x, fmt)


def _gbps(x) -> str:
  """GB/s: whole numbers from 100 up, else three significant digits (CPU runs)."""
  return "-" if x is None else (f"{x:.0f}" if x >= 100 else f"{x:.3g}")


def _mb(nbytes) -> str:
  return "-" if nbytes is None else f"{nbytes / MB:.4g}"


def _heads(r) -> str:
  return f"{r['q_heads']}/{r['kv_heads']}"


def _ok(results):
  return [r for r in results if "error" not in r]


def _lowest(rows, field):
  rows = [r for r in rows if r.get(field) is not None]
  return min(rows, key=lambda r: r[field]) if rows else None


def misses_targets(r) -> bool:
  """Whether a point failed, has no XLA time, or is below the targets: 1.0x XLA forward or
  forward+backward, 1.5x forward+backward when it moves more than BIG_BYTES."""
  if "error" in r or r.get("fwdbwd_speedup_vs_xla") is None:
    return True
  return (r["fwd_speedup_vs_xla"] < 1.0 or r["fwdbwd_speedup_vs_xla"] < 1.0
          or (r["fwdbwd_bytes"] > BIG_BYTES and r["fwdbwd_speedup_vs_xla"] < 1.5))


def summary(results) -> str:
  ok = _ok(results)
  with_xla = [r for r in ok if r.get("fwdbwd_speedup_vs_xla") is not None]
  lines = [f"- points: {len(results)} measured, {len(results) - len(ok)} failed, "
           f"{len(ok) - len(with_xla)} without an XLA time"]
  for tag, label in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
    field = f"{tag}_speedup_vs_xla"
    below = [r for r in with_xla if r[field] < 1.0]
    low = _lowest(with_xla, field)
    where = f"; lowest {low[field]:.2f}x at {low['name']}" if low else ""
    lines.append(f"- {label}: {len(below)} of {len(with_xla)} points below 1.0x XLA{where}")
  big = [r for r in with_xla if r["fwdbwd_bytes"] > BIG_BYTES]
  slow = sorted((r for r in big if r["fwdbwd_speedup_vs_xla"] < 1.5),
                key=lambda r: r["fwdbwd_speedup_vs_xla"])
  lines.append(f"- moving more than {BIG_BYTES / MB:.0f} MB (forward+backward bytes): {len(slow)} of "
               f"{len(big)} points below 1.5x XLA forward+backward"
               + (": " + "; ".join(f"{r['name']} {r['fwdbwd_speedup_vs_xla']:.2f}x" for r in slow[:40])
                  + (f"; and {len(slow) - 40} more" if len(slow) > 40 else "") if slow else ""))
  large = [r for r in ok if r["batch"] >= BIG_BATCH]
  for tag, label in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
    low = _lowest(large, f"{tag}_pct_of_copy")
    lines.append(f"- lowest % of copy at B >= {BIG_BATCH}, {label}: " +
                 (f"{low[f'{tag}_pct_of_copy']:.0f}% at {low['name']}" if low else "-"))
  for tag, label in (("fwd", "forward"), ("bwd", "backward kernel")):
    field = f"auto_{tag}_vs_best"
    rated = [r for r in ok if r.get(field) is not None and len(r.get("variants", {})) > 1]
    if rated:
      off = [r for r in rated if r[field] > 1.05]
      worst = max(rated, key=lambda r: r[field])
      lines.append(f"- 'auto' {label} more than 5% slower than the fastest family: {len(off)} of "
                   f"{len(rated)} points; worst {worst[field]:.2f}x at {worst['name']}")
  unavailable = {}
  for r in ok:
    for var, v in r.get("variants", {}).items():
      for tag in ("fwd", "bwd"):
        if f"{tag}_error" in v:
          unavailable.setdefault(f"{var} {tag}", 0)
          unavailable[f"{var} {tag}"] += 1
  if unavailable:
    lines.append("- unavailable (the family raised for the shape): " +
                 ", ".join(f"{k} at {n} points" for k, n in sorted(unavailable.items())))
  return "\n".join(lines) + "\n"


def full_table(results) -> str:
  header = ["D", "heads", "G", "Skv", "layout", "B", "mean len", "MB fwd / fwd+bwd (XLA)",
            "jaxcp fwd ms (GB/s, % copy)", "jaxcp fwd+bwd ms (GB/s, % copy)",
            "bwd kernel ms (GB/s)", "XLA fwd ms", "XLA fwd+bwd ms", "fwd vs XLA",
            "fwd+bwd vs XLA", "fastest fwd / bwd", "auto / fastest fwd, bwd", "max abs diff"]
  rows = []
  for r in sorted(results, key=sort_key):
    head = [r["head_dim"], _heads(r), r["group"], r["skv"], r["layout"], r["batch"]]
    if "error" in r:
      rows.append(head + ["error: " + r["error"][:100]] + [""] * (len(header) - len(head) - 1))
      continue
    rows.append(head + [
        f"{r['mean_len']:.2f}",
        f"{_mb(r['fwd_bytes'])} / {_mb(r['fwdbwd_bytes'])} ({_mb(r['xla_fwd_bytes'])} / "
        f"{_mb(r['xla_fwdbwd_bytes'])})",
        f"{r['jaxcp_fwd_ms']:.4f} ({_gbps(r['jaxcp_fwd_gbps'])}, {r['fwd_pct_of_copy']:.0f}%)",
        f"{r['jaxcp_fwdbwd_ms']:.4f} ({_gbps(r['jaxcp_fwdbwd_gbps'])}, {r['fwdbwd_pct_of_copy']:.0f}%)",
        (f"{r['jaxcp_bwd_ms']:.4f} ({_gbps(r['variants']['auto']['bwd_gbps'])})"
         if r.get("jaxcp_bwd_ms") is not None else "-"),
        _f(r.get("xla_fwd_ms"), ".4f"), _f(r.get("xla_fwdbwd_ms"), ".4f"),
        _f(r.get("fwd_speedup_vs_xla")) + "x", _f(r.get("fwdbwd_speedup_vs_xla")) + "x",
        f"{r.get('fastest_fwd') or '-'} / {r.get('fastest_bwd') or '-'}",
        f"{_f(r.get('auto_fwd_vs_best'))}, {_f(r.get('auto_bwd_vs_best'))}",
        _f(r.get("max_abs_diff_vs_xla"), ".2e") + (f" (XLA: {r['xla_error'][:60]})" if "xla_error" in r else "")])
  return _table(header, rows)


def _variants(results):
  seen = {v for r in _ok(results) for v in r.get("variants", {})}
  return [v for v in VARIANT_ORDER if v in seen] + sorted(seen - set(VARIANT_ORDER))


def _family_cell(points, tag, variants):
  """(winner text, per-family slowdown text) over `points` for the forward or backward: wins
  count among the named families (auto when it ran alone); slowdown = geometric mean over the
  points of the family's time / the fastest family's time."""
  wins, ratios, missing = {}, {v: [] for v in variants}, {v: 0 for v in variants}
  for r in points:
    times = {v: x[f"{tag}_ms"] for v, x in r.get("variants", {}).items() if f"{tag}_ms" in x}
    if not times:
      continue
    best = min(times.values())
    for v in variants:
      if v in times:
        ratios[v].append(times[v] / best)
      elif v in r.get("variants", {}):
        missing[v] += 1
    if r.get(f"fastest_{tag}"):
      wins[r[f"fastest_{tag}"]] = wins.get(r[f"fastest_{tag}"], 0) + 1
  counted = sum(wins.values())
  if not counted:
    return "-", "-"
  geo = {v: math.exp(sum(map(math.log, x)) / len(x)) for v, x in ratios.items() if x}
  winner = max(wins, key=lambda v: (wins[v], -geo.get(v, math.inf)))
  cells = []
  for v in variants:
    text = f"{geo[v]:.2f}" if v in geo else "n/a"
    if missing[v] and v in geo:
      text += f" ({missing[v]} n/a)"
    cells.append(f"{v} {text}")
  return f"**{winner}** ({wins[winner]}/{counted})", ", ".join(cells)


def variant_table(results) -> str:
  variants = _variants(results)
  groups = {}
  for r in _ok(results):
    groups.setdefault((r["group"], r["head_dim"], r["skv"]), []).append(r)
  header = ["G", "D", "Skv", "points", "fwd: fastest (wins)", f"fwd: fastest at B >= {BIG_BATCH}",
            "fwd: time / fastest (geo. mean)", "bwd: fastest (wins)",
            f"bwd: fastest at B >= {BIG_BATCH}", "bwd: time / fastest (geo. mean)"]
  rows = []
  for key in sorted(groups):
    pts = groups[key]
    large = [r for r in pts if r["batch"] >= BIG_BATCH]
    row = list(key) + [len(pts)]
    for tag in ("fwd", "bwd"):
      win, slow = _family_cell(pts, tag, variants)
      win_large, _ = _family_cell(large, tag, variants)
      row += [win, win_large, slow]
    rows.append(row)
  return _table(header, rows)


def _table(header, rows) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return "\n".join(lines) + "\n"


def sweep_markdown(results, metas, note: str | None = None) -> str:
  m = metas[0] if metas else {}
  parts = sorted({x.get("part") for x in metas if x.get("part")})
  dates = sorted({x["date"] for x in metas if x.get("date")}) or ["?"]
  when = dates[0] if len(dates) == 1 else f"runs from {dates[0]} to {dates[-1]}"
  title = (f"## Small-seq attention shape sweep ({m.get('device', '?')}, jax {m.get('jax', '?')}, "
           f"{m.get('dtype', '?')}, {when})\n\n")
  about = (
      f"Kernel families timed alone: {', '.join(m.get('variants', ['auto']))}; reps {m.get('reps')}; "
      f"batch sizes over {m.get('max_gb')} GB of buffers dropped"
      + (f"; parts {', '.join(parts)}" if parts else "") + ".\n"
      "Lengths uniform in [1, Skv] per row (padded: kv_lengths; ragged: kv_cu_seqlens). Bytes: "
      "jaxcp forward = Q, the K/V tokens rows attend to, O, float32 probabilities [B, Hq, max_len] "
      "(max_len = Skv: the ragged calls pass max_kv_len=Skv); backward = Q, dO, attended K/V, probabilities, dQ, all "
      "of dK/dV; fwd+bwd = both; rows of one key (the one-key path): forward V and O, backward "
      "dO, dQ, all of dK/dV. XLA = its padded layout (forward Q, all K/V, O; fwd+bwd adds Q, "
      "K, V, dO read and dQ, dK, dV written). GB/s over those bytes; % copy = the jaxcp GB/s "
      "over the best of three device copies moving the same bytes, timed next to the point "
      "(= copy time / jaxcp time). Calls whose inputs are under half a GiB are timed as up to 16 "
      "calls in one program, each on its own copies of the arrays (time over the calls): the GPU "
      "time, not Python's dispatch of a program per call. 'bwd kernel' = the backward primitive alone ('auto'). "
      "Fastest fwd / bwd: among the named families timed (auto when it ran alone); auto / "
      "fastest = auto's time over the fastest family's.\n\n")
  if note:
    about += f"**Note.** {note}\n\n"
  return (title + about + "### Summary\n\n" + summary(results) + "\n### All points\n\n" +
          full_table(results) + "\n### Fastest kernel family per (G = Hq/Hkv, D, Skv)\n\n"
          "Over the group's points (heads with that G, both layouts, every B): wins of each "
          "family and its time over the point's fastest (geometric mean; n/a: the family raised "
          "for the shape).\n\n" + variant_table(results))


# ---------------------------------------------------------------- plot


def plot(results, path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.lines import Line2D
  from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

  colours = {64: "tab:blue", 128: "tab:orange", 256: "tab:green", 512: "tab:red"}
  markers = {"padded": "o", "ragged": "^"}
  ok = [r for r in _ok(results) if r.get("fwdbwd_speedup_vs_xla") is not None]
  dims = sorted({r["head_dim"] for r in ok})
  extra = iter(["tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan"])
  for d in dims:
    colours.setdefault(d, next(extra, "black"))
  fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), sharey=True)
  for ax, tag, label in ((axes[0], "fwd", "forward"), (axes[1], "fwdbwd", "forward+backward")):
    for layout, marker in markers.items():
      for d in dims:
        pts = [r for r in ok if r["layout"] == layout and r["head_dim"] == d]
        if pts:
          ax.scatter([r[f"{tag}_bytes"] for r in pts], [r[f"{tag}_speedup_vs_xla"] for r in pts],
                     c=colours[d], marker=marker, s=22, alpha=0.75, edgecolors="none")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(FixedLocator([0.125, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 8, 16, 32]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.5, color="black", lw=0.8, ls="--")
    ax.axvline(BIG_BYTES, color="gray", lw=0.8, ls=":")
    ax.set_xlabel(f"bytes moved by jaxcp's {label} (log)")
    ax.set_title(f"{label}: jaxcp speedup over XLA")
    ax.grid(True, which="both", alpha=0.25)
  axes[0].set_ylabel("XLA time / jaxcp time (log)")
  handles = [Line2D([], [], color=colours[d], marker="s", ls="", label=f"D {d}") for d in dims]
  handles += [Line2D([], [], color="black", marker=m, ls="", label=l) for l, m in markers.items()]
  handles += [Line2D([], [], color="black", lw=0.8, label="1.0x"),
              Line2D([], [], color="black", lw=0.8, ls="--", label="1.5x"),
              Line2D([], [], color="gray", lw=0.8, ls=":", label=f"{BIG_BYTES / MB:.0f} MB")]
  axes[1].legend(handles=handles, loc="best", fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("files", nargs="+", help="sweep JSON files (the parts of one run)")
  parser.add_argument("--out", default=None, help="output folder (default: the first file's)")
  parser.add_argument("--name", default=None, help="output file stem (default: see above)")
  parser.add_argument("--note", default=None, help="a paragraph for the markdown, under the title")
  args = parser.parse_args(argv)
  files = [f for f in args.files if f.endswith(".json")]
  metas, results = load(files)
  out_dir = args.out or os.path.dirname(os.path.abspath(files[0]))
  os.makedirs(out_dir, exist_ok=True)
  stem = args.name or re.sub(r"_part\d+$", "", os.path.splitext(os.path.basename(files[0]))[0])
  inputs = {os.path.abspath(f) for f in files}
  if args.name is None and os.path.abspath(os.path.join(out_dir, stem + ".json")) in inputs:
    stem += "_merged"
  base = os.path.join(out_dir, stem)
  with open(base + ".json", "w") as f:
    json.dump(dict(meta=dict(merged_from=[os.path.basename(x) for x in files], parts=metas),
                   results=results), f, indent=1)
  with open(base + ".md", "w") as f:
    f.write(sweep_markdown(results, metas, args.note))
  m = metas[0] if metas else {}
  plot(results, base + ".png", f"small-seq attention vs XLA ({m.get('device', '?')}, "
       f"{m.get('dtype', '?')}): colour = head dim, marker = layout")
  print(f"{len(results)} points from {len(files)} files -> {base}.json, .md, .png")
  print(summary(results))


if __name__ == "__main__":
  main()
