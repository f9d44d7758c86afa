"""How much slower each GPU of a host runs the same attention step when all of them run at once.

A context-parallel step waits for its slowest rank, while bench_cp.py's efficiency divides by
one GPU running alone. This times one packed row's causal forward+backward (bench_cp.py's mix, a
quarter of its row by default: a rank's share at 4 GPUs) on every GPU alone, one after the
other, then on all of them together (each GPU its own copy, the calls dispatched round-robin in
bursts), with bench_cp.py's timing. Where power or cooling is shared, "together" is slower, and
that loss is in every multi-GPU step, communication or not. Also samples SM clocks and power
(nvidia-smi) in each phase.

  python3 tools/gpu_parallel_slowdown.py [--seq 32768] [--mix doc8k] [--heads 32 8]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_cp  # noqa: E402
import common  # noqa: E402
import doc_mixes  # noqa: E402


BURST = 8  # calls in flight per GPU before waiting (their outputs stay alive until then)


def arrays(seq, mix, hq, hkv, d=128, seed=0):
  seg = doc_mixes.packed_row(np.random.default_rng(seed), seq, mix)[None]
  key = jax.random.PRNGKey(seed)
  shapes = [(1, seq, hq, d), (1, seq, hkv, d), (1, seq, hkv, d), (1, seq, hq, d)]
  qkvd = [jax.random.normal(jax.random.fold_in(key, i), s, jnp.bfloat16) for i, s in enumerate(shapes)]
  return (*qkvd, jnp.asarray(seg), jnp.asarray(doc_mixes.positions(seg)))


class Sampler:
  """nvidia-smi's SM clock and power draw of every GPU, every 100 ms, while active."""

  def __enter__(self):
    self.p = subprocess.Popen(["nvidia-smi", "--query-gpu=index,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                               "-lms", "100"], stdout=subprocess.PIPE, text=True)
    return self

  def __exit__(self, *exc):
    self.p.terminate()
    out = self.p.communicate()[0]
    by_gpu = {}
    for line in out.splitlines():
      parts = [x.strip() for x in line.split(",")]
      if len(parts) == 3 and parts[0].isdigit():
        by_gpu.setdefault(int(parts[0]), []).append((float(parts[1]), float(parts[2])))
    self.summary = {g: (statistics.median(c for c, _ in s), statistics.median(w for _, w in s))
                    for g, s in by_gpu.items()}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq", type=int, default=32768)
  ap.add_argument("--mix", default="doc8k", choices=list(doc_mixes.MIXES))
  ap.add_argument("--heads", type=int, nargs=2, default=[32, 8])
  ap.add_argument("--seconds", type=float, default=5.0, help="how long each phase runs")
  a = ap.parse_args()
  devs = jax.devices()
  host = arrays(a.seq, a.mix, *a.heads)
  fns, args = [], []
  for dev in devs:
    args.append([jax.device_put(x, dev) for x in host])
    fns.append(jax.jit(bench_cp._fwd_bwd("auto")))  # bench_cp's one-GPU step
  alone, s_alone = [], {}
  for g, (f, x) in enumerate(zip(fns, args)):
    t = common.time_fn(f, *x, warmup=2, reps=3)
    n = max(2 * BURST, int(a.seconds / t))
    with Sampler() as sampler:
      t0 = time.perf_counter()
      for _ in range(n // BURST):
        jax.block_until_ready([f(*x) for _ in range(BURST)])
      alone.append((time.perf_counter() - t0) / (n // BURST * BURST))
    s_alone[g] = sampler.summary.get(g, (float("nan"),) * 2)
  with Sampler() as s_all:
    t = max(alone)
    n = max(2 * BURST, int(a.seconds / t))
    done = [0.0] * len(devs)
    for _ in range(n // BURST):
      t0 = time.perf_counter()
      outs = [[f(*x) for f, x in zip(fns, args)] for _ in range(BURST)]
      for g in range(len(devs)):  # each GPU's calls finish in order: time to its last
        jax.block_until_ready([o[g] for o in outs])
        done[g] += time.perf_counter() - t0
      del outs
    done = [x / (n // BURST * BURST) for x in done]
  print(f"{a.seq} tokens, {a.mix}, {a.heads[0]}/{a.heads[1]} heads, causal forward+backward; ms a step")
  print("GPU  alone  together (upper bound: waits for the GPUs before it)  SM MHz / W alone, together")
  for g in range(len(devs)):
    c0, w0 = s_alone[g]
    c1, w1 = s_all.summary.get(g, (float("nan"),) * 2)
    print(f"{g:3d} {alone[g] * 1e3:6.2f} {done[g] * 1e3:9.2f}   {c0:.0f} / {w0:.0f}, {c1:.0f} / {w1:.0f}")
  print(f"all together: {done[-1] * 1e3:.2f} ms a step against {statistics.mean(alone) * 1e3:.2f} alone "
        f"({statistics.mean(alone) / done[-1]:.3f}; GPU 0 alone: {alone[0] * 1e3:.2f})")


if __name__ == "__main__":
  main()
