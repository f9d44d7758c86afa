"""The GPU timeline of one context-parallel forward+backward step (bench_cp.py's problem), through
jax.profiler: every kernel, copy and collective that rank 0 ran in the last step, per stream, with
its start, duration and the compute stream's idle gaps, then a summary by kind. It shows what the
exposed communication of bench_cp.py is made of.

  python3 tools/cp_timeline.py 131072:doc2k:32/8 --gpus 4 [--strategy placement|all_gather|ring]
"""
import argparse
import collections
import os
import sys
import tempfile

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_cp  # noqa: E402
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
  return jax.jit(bench_cp._fwd_bwd(context_parallel)), args


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
  a = ap.parse_args()
  fn, args = step_fn(a.case, a.gpus, a.strategy, bench_cp.load_calibration(a.calibration), a.time_rule)
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


if __name__ == "__main__":
  main()
