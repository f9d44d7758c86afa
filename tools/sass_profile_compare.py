"""Reads the per-instruction source pages that gpu_profile_sass.sh writes (<name>_sass.csv, or
.csv.gz) and says where a kernel's instructions and stalls go; given two, side by side (e.g. the
sm_90a backward beside FlashAttention-3's, same case and GPU). No GPU needed.

  python3 tools/sass_profile_compare.py ours_sass.csv.gz fa3_sass.csv.gz

Prints, per kernel: warp instructions executed; the code by execution count (instructions that
run equally often run once per the same event: the consumers' loop runs once per warp and step,
the producer's once per block and step), with the stall samples each group takes; the stall
reasons inside the hottest group (the main loop); its most stalled instructions. Then the opcodes
whose executed counts differ most between the two kernels.
"""
import argparse
import collections
import csv
import gzip
import re


def load(path):
  """(rows as dicts of the columns used, stall reason names) of one source page."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    rows = list(csv.reader(f))
  header = next(r for r in rows if "Address" in r and "Source" in r)
  body = [r for r in rows[rows.index(header) + 1:] if len(r) == len(header)]
  col = {h: i for i, h in enumerate(header)}
  reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
  out = []
  for r in body:
    num = lambda name: int((r[col[name]] or "0").replace(",", ""))
    out.append(dict(address=int(r[col["Address"]], 16), source=r[col["Source"]].strip(),
                    executed=num("Instructions Executed"),
                    samples=num("Warp Stall Sampling (All Samples)"),
                    stalls={h[len("stall_"):]: num(h) for h in reasons}))
  return out


def opcode(source: str) -> str:
  text = re.sub(r"^@!?U?P\w+\s+", "", source)
  return text.split()[0] if text else "?"


def groups_by_count(rows, min_share=0.01):
  """{execution count: rows} for the counts that carry at least min_share of all executions."""
  by = collections.defaultdict(list)
  for r in rows:
    if r["executed"]:
      by[r["executed"]].append(r)
  total = sum(r["executed"] for r in rows)
  return {c: rs for c, rs in sorted(by.items(), key=lambda kv: -kv[0] * len(kv[1]))
          if c * len(rs) >= min_share * total}


def report(name, rows, top=12):
  total = sum(r["executed"] for r in rows)
  samples = sum(r["samples"] for r in rows)
  print(f"== {name}: {total / 1e9:.2f} G warp instructions executed, {samples} stall samples")
  groups = groups_by_count(rows)
  for count, rs in groups.items():
    s = sum(r["samples"] for r in rs)
    print(f"   {len(rs):5d} instructions x {count / 1e6:8.2f} M = {count * len(rs) / 1e9:6.2f} G"
          f"   {s / max(samples, 1):6.1%} of the samples")
  if not groups:
    return
  hot_count = max(groups, key=lambda c: c * len(groups[c]))
  loop = [r for r in rows if r["executed"] and abs(r["executed"] - hot_count) <= 0.05 * hot_count]
  reasons = collections.Counter()
  for r in loop:
    reasons.update(r["stalls"])
  n = sum(reasons.values()) or 1
  print(f"   hottest code ({len(loop)} instructions run {hot_count / 1e6:.2f} M times, +-5%), stall reasons: " +
        ", ".join(f"{k} {v / n:.1%}" for k, v in reasons.most_common(8)))
  for r in sorted(loop, key=lambda r: -r["samples"])[:top]:
    why = ", ".join(f"{k} {v}" for k, v in collections.Counter(r["stalls"]).most_common(2) if v)
    print(f"     {r['samples'] / max(samples, 1):6.2%}  {r['address'] & 0xfffff:05x}  {r['source'][:58]:58s} {why}")


def opcode_diff(a_rows, b_rows, names, top=16):
  a, b = _sum_by_opcode(a_rows), _sum_by_opcode(b_rows)
  keys = sorted(set(a) | set(b), key=lambda k: -abs(a[k] - b[k]))[:top]
  print(f"== opcodes whose executed counts differ most (M warp instructions): {names[0]} / {names[1]}")
  for k in keys:
    print(f"   {k:26s} {a[k] / 1e6:9.1f} {b[k] / 1e6:9.1f} {(a[k] - b[k]) / 1e6:+9.1f}")


def _sum_by_opcode(rows):
  c = collections.Counter()
  for r in rows:
    c[opcode(r["source"])] += r["executed"]
  return c


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("pages", nargs="+", help="one or two <name>_sass.csv[.gz] from gpu_profile_sass.sh")
  args = ap.parse_args()
  if len(args.pages) > 2:
    ap.error("one or two source pages")
  loaded = [load(p) for p in args.pages]
  for path, rows in zip(args.pages, loaded):
    report(path, rows)
  if len(loaded) == 2:
    opcode_diff(*loaded, args.pages)


if __name__ == "__main__":
  main()
