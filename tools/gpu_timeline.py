"""The GPU timeline of a benchmark case's calls in steady state, through jax.profiler (CUPTI):
every kernel and memset of the last two calls, with its duration and the idle gap before it,
then the span of those calls against their busy time. Unlike tools/gpu_kernel_times.sh (ncu,
each kernel alone on an idle GPU) it shows memsets and gaps, at the clocks of a busy GPU.

  python3 tools/gpu_timeline.py "2x8k doc1k" [--bwd] [--fa3]
"""
import argparse
import glob
import tempfile

import jax
from jax.profiler import ProfileData

import profile_case


def gpu_events(trace_dir, plane="/device:GPU"):
  """(start ns, duration ns, name, stream) of every op on the GPU planes whose name starts with
  `plane` ("/device:GPU:0": the first GPU's only), in time order."""
  path = glob.glob(trace_dir + "/**/*.xplane.pb", recursive=True)[0]
  events = []
  for p in ProfileData.from_file(path).planes:
    if not p.name.startswith(plane):
      continue
    for line in p.lines:
      if "stream" in line.name.lower():
        events += [(e.start_ns, e.duration_ns, e.name, line.name) for e in line.events]
  return sorted(events)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("case", help="a benchmark case's name (profile_case.py's att: cases)")
  ap.add_argument("--bwd", action="store_true", help="forward+backward instead of forward")
  ap.add_argument("--fa3", action="store_true", help="FlashAttention-3 instead of jaxcp")
  a = ap.parse_args()
  fn, args = profile_case.attention_fn(a.case, a.bwd, a.fa3)
  for _ in range(4):
    jax.block_until_ready(fn(*args))
  trace_dir = tempfile.mkdtemp()
  with jax.profiler.trace(trace_dir):
    jax.block_until_ready([fn(*args) for _ in range(6)])
  events = gpu_events(trace_dir)
  starts = [i for i, e in enumerate(events) if e[2] == events[0][2]]  # a call's first op
  calls = min(2, len(starts))
  first = starts[-calls]
  end, busy = None, 0
  for start, dur, name, _ in events[first:]:
    gap = (start - end) / 1e3 if end is not None else 0.0
    print(f"gap {gap:7.1f} us  {dur / 1e3:9.1f} us  {name[:100]}")
    end = max(end or 0, start + dur)
    busy += dur
  print(f"{calls} calls: span {(end - events[first][0]) / 1e3:.1f} us, busy {busy / 1e3:.1f} us")


if __name__ == "__main__":
  main()
