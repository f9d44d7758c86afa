"""The GPU timeline of one context-parallel forward+backward step (bench_cp.py's problem), through
jax.profiler: every kernel, copy and collective that rank 0 ran in the last step, per stream, with
its start, duration and the compute stream's idle gaps, then a summary by kind. It shows what the
exposed communication of bench_cp.py is made of. Then every rank over a burst of steps run back to
back (as bench_cp.py times them): the period between its steps' starts, and per step its attention
kernels, other XLA kernels and the compute streams' idle time, which shows a rank that waits for
another (imbalance) apart from one that waits for its exchange.

  python3 tools/cp_timeline.py 131072:doc2k:32/8 --gpus 4 [--strategy placement|all_gather|ring]
"""
import argparse
import collections
import os
import sys
import tempfile
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_cp  # noqa: E402
import gpu_parallel_slowdown  # noqa: E402
import gpu_timeline  # noqa: E402

import jaxcp  # noqa: E402


def step_fn(case, gpus, strategy, cal, time_rule=False):
  seq_len, mix, heads = case.split(":")
  heads = tuple(int(h) for h in heads.split("/"))
  arrays, _ = bench_cp.problem(int(seq_len), mix, heads, gpus, bench_cp.placement_cost(cal))
  extra = (None, bench_cp.group_choices(gpus), bench_cp.exchange_cost(cal, heads, gpus))
  context_parallel, perm = bench_cp.layout(strategy, arrays[4], gpus, bench_cp.placement_cost(cal, heads),
                                           *(extra if time_rule else ()))
  if strategy == "placement":
    print(f"placement: R = {context_parallel.shared_tokens} of {int(seq_len) // gpus} tokens per rank, "
          f"groups of {context_parallel.shared_group or gpus}")
  sh = NamedSharding(Mesh(np.array(jax.devices()[:gpus]), ("cp",)), P(None, "cp"))
  args = [jax.device_put(jaxcp.load_balance(x, gpus, axis=1, strategy=perm), sh) for x in arrays]
  return jax.jit(bench_cp._fwd_bwd(context_parallel)), args, arrays


def kind(name):
  n = name.lower()
  if "nccl" in n:
    return "collective"
  if "jaxcp" in n or "attention" in n or "bwd" in n or "fwd" in n or "plan" in n or "tile" in n:
    return "attention kernels"
  if "memcpy" in n or "memset" in n:
    return "copies"
  return "other XLA kernels"


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("case", help="S:MIX:HQ/HKV, e.g. 131072:doc2k:32/8")
  ap.add_argument("--gpus", type=int, default=4)
  ap.add_argument("--strategy", default="placement", choices=list(bench_cp.STRATEGIES))
  ap.add_argument("--calibration", default=None, help="placement_calibration.json (default: built-in costs)")
  ap.add_argument("--time-rule", action="store_true",
                  help="the placement of least predicted time (bench_cp.py's 'time model') instead of the "
                       "tolerance rule")
  ap.add_argument("--clocks", action="store_true",
                  help="also sample SM clocks and power during a burst of sharded steps and of one-GPU steps")
  a = ap.parse_args()
  fn, args, row = step_fn(a.case, a.gpus, a.strategy, bench_cp.load_calibration(a.calibration), a.time_rule)
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  trace_dir = tempfile.mkdtemp()
  with jax.profiler.trace(trace_dir):
    for _ in range(3):
      jax.block_until_ready(fn(*args))
  events = gpu_timeline.gpu_events(trace_dir, plane="/device:GPU:0")
  if not events:
    sys.exit("no GPU 0 events in the profile (a GPU host is needed)")
  # The last step: from the last occurrence of the first step's first op.
  first_name = events[0][2]
  starts = [i for i, e in enumerate(events) if e[2] == first_name]
  events = events[starts[-1]:]
  t0 = events[0][0]
  streams = {s: i for i, s in enumerate(sorted({e[3] for e in events}))}
  end_by_stream = {}
  by_kind = collections.Counter()
  for start, dur, name, stream in events:
    prev = end_by_stream.get(stream)
    gap = (start - prev) / 1e3 if prev is not None else 0.0
    end_by_stream[stream] = max(prev or 0, start + dur)
    by_kind[kind(name)] += dur / 1e3
    print(f"s{streams[stream]} t {(start - t0) / 1e3:9.1f} us  gap {gap:7.1f}  {dur / 1e3:8.1f} us  {name[:110]}")
  span = (max(end_by_stream.values()) - t0) / 1e3
  print(f"step span {span:.1f} us; streams: " + ", ".join(f"s{i} = {s}" for s, i in streams.items()))
  for k, v in by_kind.most_common():
    print(f"  {k}: {v:.1f} us ({v / span:.1%} of the span)")
  burst_summary(fn, args, a.gpus)
  if a.clocks:
    clocks(fn, args, row, a.gpus)


def clocks(fn, args, row, gpus, seconds=4.0, burst=8):
  """SM clock and power of every GPU while the sharded step runs for `seconds`, and of GPU 0 while
  the same row runs on it alone (bench_cp's T1): the H200s run at their power limit, so whatever
  else a rank does while its kernels run (the exchange) can lower the clock they run at."""
  one = jax.jit(bench_cp._fwd_bwd("auto"))
  row = [jax.device_put(x, jax.devices()[0]) for x in row]
  for name, f, x, n in (("sharded step", fn, args, gpus), ("one GPU", one, row, 1)):
    t = bench_cp.common.time_fn(f, *x)
    with gpu_parallel_slowdown.Sampler() as sampler:
      t0 = time.perf_counter()
      reps = max(2, int(seconds / t / burst))
      for _ in range(reps):
        jax.block_until_ready([f(*x) for _ in range(burst)])
      per = (time.perf_counter() - t0) / (reps * burst)
    print(f"{name}: {per * 1e3:.2f} ms a step; SM MHz / W: " +
          ", ".join(f"GPU {g} {c:.0f} / {w:.0f}" for g, (c, w) in sorted(sampler.summary.items()) if g < n))


def burst_summary(fn, args, gpus, steps=8):
  """Per rank over `steps` back-to-back steps (the first two left out): the period between step
  starts and, per step, the time in attention kernels, in other kernels, and the compute streams'
  idle time (the step less the union of its non-collective kernels)."""
  trace_dir = tempfile.mkdtemp()
  with jax.profiler.trace(trace_dir):
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(steps)]
    t1 = time.perf_counter()
    jax.block_until_ready(outs)
    t2 = time.perf_counter()
  del outs
  print(f"\n{steps} steps back to back: the host dispatched them in {(t1 - t0) / steps * 1e3:.2f} ms a step, "
        f"{(t2 - t0) / steps * 1e3:.2f} ms a step until done; without the profiler "
        f"{bench_cp.common.time_fn(fn, *args) * 1e3:.2f} ms a step (bench_cp's timing)")
  print(f"the last {steps - 2} steps (per step, us):")
  print("rank  period  attention  other  idle (not collective)")
  for r in range(gpus):
    events = [e for e in gpu_timeline.gpu_events(trace_dir, plane=f"/device:GPU:{r}")
              if kind(e[2]) != "collective"]
    first = events[0][2]
    starts = [e[0] for e in events if e[2] == first][-(steps - 2):]
    kept = [e for e in events if e[0] >= starts[0]]
    end = max(e[0] + e[1] for e in kept)
    busy, covered_to = 0, starts[0]
    for start, dur, _, _ in kept:  # union of the kernels' intervals
      busy += max(0, start + dur - max(start, covered_to))
      covered_to = max(covered_to, start + dur)
    n = len(starts)
    att = sum(e[1] for e in kept if kind(e[2]) == "attention kernels") / n / 1e3
    other = sum(e[1] for e in kept if kind(e[2]) != "attention kernels") / n / 1e3
    period = (end - starts[0]) / n / 1e3
    print(f"{r:4d} {period:7.0f} {att:10.0f} {other:6.0f} {period - busy / n / 1e3:6.0f}")


if __name__ == "__main__":
  main()
