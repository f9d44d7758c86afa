"""Shared benchmark utilities: timing, ceilings measured in the same run, packed rows, output."""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from datetime import datetime, timezone

import jax
import jax.numpy as jnp
import numpy as np


def time_fn(fn, *args, warmup: int = 2, reps: int = 10, burst: int = 5, min_burst_s: float = 0.1) -> float:
  """Device time (seconds) of one jitted call: the median over `reps` trials of `burst` calls
  dispatched back to back and waited for together, divided by `burst`. Dispatching a burst keeps
  the GPU busy while the host enqueues the next call, so the host's dispatch and synchronisation
  latency (tens of microseconds, a large and noisy share of a sub-millisecond kernel when every
  call is waited for alone) is not counted; what a training step sees is the same steady state.
  A burst's start still waits for the host: bursts are lengthened to at least `min_burst_s` of
  calls (a 4.7 ms forward+backward measured 4.93 ms in bursts of 5 and 4.74 ms in bursts of 20,
  H200), which the first, untimed burst sizes, as long as the burst's outputs stay under 8 GB."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  outs = jax.block_until_ready([fn(*args) for _ in range(burst)])
  per_call = (time.perf_counter() - t0) / burst
  out_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(outs[0]))
  del outs
  longer = min(64, int(min_burst_s / max(per_call, 1e-9)) + 1, int(8e9 // max(out_bytes, 1)))
  burst = max(burst, longer)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(burst)])
    times.append((time.perf_counter() - t0) / burst)
  return statistics.median(times)


def time_interleaved(calls: dict, rounds: int = 3, reps: int = 4, burst: int = 5) -> dict:
  """Device time (seconds) of each of `calls` (name -> (jitted fn, args), already compiled and
  warm): `rounds` rounds, each timing every call in turn with time_fn(reps, burst); a call's
  time is its best round. A slow spell of a shared machine then lands in one round of every
  call alike instead of in all of one call's trials, which made single peer numbers off by
  2-3x and the ratios with them. A call that raises (a burst can run out of memory where one
  call did not) gets its exception instead of a time and is not timed again."""
  best = {name: float("inf") for name in calls}
  for _ in range(rounds):
    for name, (fn, args) in calls.items():
      if isinstance(best[name], Exception):
        continue
      try:
        best[name] = min(best[name], time_fn(fn, *args, warmup=0, reps=reps, burst=burst))
      except Exception as e:  # recorded by the caller
        best[name] = e
  return best


def measure_matmul_tflops(n: int = 8192, dtype=jnp.bfloat16) -> float:
  """bf16 n x n x n matmul throughput on random data, the compute ceiling of this run."""
  key = jax.random.PRNGKey(0)
  a = jax.random.normal(key, (n, n), dtype)
  b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), dtype)
  t = time_fn(jax.jit(lambda a, b: a @ b), a, b, reps=10)
  return 2 * n**3 / t / 1e12


def measure_copy_gbps(nbytes: int = 2 << 30) -> float:
  """Device-to-device copy bandwidth (bytes read + written per second, GB/s)."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  t = time_fn(jax.jit(lambda x: x * 1.0 + 0.0), x, reps=10)  # a fused elementwise copy
  return 2 * nbytes / t / 1e9


def device_description() -> str:
  d = jax.devices()[0]
  return f"{getattr(d, 'device_kind', d.platform)} x{len(jax.devices())}"


def cudnn_version() -> str | None:
  """The cuDNN library the JAX CUDA plugin loaded (e.g. "9.19.0"), or None without one: peers'
  speeds depend on it, so runs from different hosts are only comparable with it named."""
  try:
    from jax._src.lib import cuda_versions  # private; None without the CUDA plugin
    v = cuda_versions.cudnn_get_version() if cuda_versions is not None else None
  except Exception:  # noqa: BLE001 -- a missing or renamed private API only loses the label
    return None
  return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v else None


def run_metadata() -> dict:
  meta = dict(device=device_description(), backend=jax.default_backend(), jax=jax.__version__,
              date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), host=platform.node())
  if (cudnn := cudnn_version()) is not None:
    meta["cudnn"] = cudnn
  return meta


def packed_rows(rng: np.random.Generator, batch: int, seq_len: int, mean_doc: int):
  """Document lengths per row: exponential around mean_doc (at least 16 tokens), filling the row."""
  rows = []
  for _ in range(batch):
    lengths, total = [], 0
    while total < seq_len:
      n = int(max(16, rng.exponential(mean_doc)))
      n = min(n, seq_len - total)
      lengths.append(n)
      total += n
    rows.append(lengths)
  return rows


def padded_rows(rows, live):
  """Document lengths cut to the first `live` tokens of each row (the rest becomes padding)."""
  out = []
  for lengths in rows:
    kept, total = [], 0
    for n in lengths:
      n = min(n, live - total)
      if n <= 0:
        break
      kept.append(n)
      total += n
    out.append(kept)
  return out


def segments_and_positions(rows, seq_len):
  seg = np.zeros((len(rows), seq_len), np.int32)
  pos = np.zeros((len(rows), seq_len), np.int32)
  for b, lengths in enumerate(rows):
    t = 0
    for i, n in enumerate(lengths):
      seg[b, t:t + n] = i + 1
      pos[b, t:t + n] = np.arange(n)
      t += n
  return seg, pos


def allowed_pairs(rows, *, causal: bool, window=None, chunk=None) -> int:
  """Number of allowed (query, key) pairs: documents are independent, per-query closed form."""
  left, right = window if window is not None else (None, None)
  total = 0
  for lengths in rows:
    for n in lengths:
      p = np.arange(n, dtype=np.int64)
      lo = np.zeros(n, np.int64)
      hi = p.copy() if causal else np.full(n, n - 1, np.int64)
      if left is not None:
        lo = np.maximum(lo, p - left)
      if right is not None and not causal:
        hi = np.minimum(hi, p + right)
      if chunk is not None:
        start = (p // chunk) * chunk
        lo = np.maximum(lo, start)
        hi = np.minimum(hi, np.minimum(start + chunk - 1, n - 1))
      total += int(np.maximum(hi - lo + 1, 0).sum())
  return total


def device_kind(devices: int | None = None) -> str:
  """This run's device kind as result file names spell it: the model of a GPU in lower case
  ("h200", "h100", "a100"), else the platform ("cpu"); with `devices` > 1 the count follows
  ("h200x4")."""
  d = jax.devices()[0]
  text = str(getattr(d, "device_kind", "") or d.platform).lower()
  model = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", text)
  kind = model.group(1) if model else (re.sub(r"[^a-z0-9]+", "_", text).strip("_") or d.platform)
  return f"{kind}x{devices}" if devices and devices > 1 else kind


def result_name(benchmark: str, devices: int | None = None) -> str:
  """File stem of a benchmark's results: `<benchmark>_<device kind>` (e.g. attention_h200,
  cp_h200x4), so that benchmarks/results/ keeps one result set per benchmark and GPU kind."""
  return f"{benchmark}_{device_kind(devices)}"


def write_results(name: str, payload: dict, markdown: str, out_dir: str | None = None) -> str:
  """Writes `<name>.json` and `<name>.md` (name: from result_name) to out_dir, $OUT or
  benchmarks/results/; returns the folder."""
  out_dir = out_dir or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump(payload, f, indent=1)
  with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
    f.write(markdown)
  return out_dir


def markdown_table(header, rows) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return "\n".join(lines) + "\n"
