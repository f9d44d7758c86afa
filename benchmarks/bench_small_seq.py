"""Small-sequence attention (one query token over <= 16 keys, recommendation models): jaxcp vs
jax.nn.dot_product_attention (implementation="xla" with a padding mask; cuDNN rejects these
shapes) and a device copy measured in the same run.

Everything is memory bound, so the figure of merit is bandwidth over the bytes that must move:
  forward : Q, K, V read; O and the saved probabilities (float32 [B, Hq, Skv]) written;
  backward: Q, dO, K, V, probabilities read; dQ, dK, dV written.
K/V bytes count the tokens that exist (for the ragged case: the sum of the lengths). The XLA
baseline runs on the padded layout [B, 16, Hkv, D] with key_value_seq_lengths; its bandwidth is
reported over the same bytes, so bandwidth ratios are speed ratios. The device copy is the
best of three copies of K's bytes (negate in K's dtype, uint32 jnp.copy, float32 x + 1),
bytes read + written, each timed right before and right after the jaxcp timings of the case (the
ceiling is the best of the six).

Memory: for the jitted forward and forward+backward, XLA's buffer assignment
(`.lower().compile().memory_analysis()`: argument, output, temp bytes) and, on GPU, the
allocator's peak during one call (`memory_stats()["peak_bytes_in_use"]`, which cannot be reset:
before the call a ballast array lifts the bytes in use to the previous peak, so the rise of the
peak is what the call itself allocates). Both are compared with the bytes of the inputs, outputs
and saved probabilities ("need"; it also counts the int32 row index arrays start/length/mask,
3 x 4 x B bytes):
  forward : Q, K, V in; O out; probabilities float32 [B, Hq, Skv]
  fwd+bwd : Q, K, V, dO in; O, dQ, dK, dV out; probabilities
Pass when arguments + outputs + temps (and the measured peak) are no larger than need + 1 MiB.

Targets (H100, bf16): forward >= 90% and backward >= 85% of the copy bandwidth; forward+backward
>= 1.15x XLA; memory no larger than the inputs, outputs and saved probabilities.

  python benchmarks/bench_small_seq.py            # the full GPU case list
  python benchmarks/bench_small_seq.py --quick    # small batches, runs on the CPU too
  python benchmarks/bench_small_seq.py --sweep [--variants all] [--part i/n] [filters]

Writes small_seq_<kind>.json and .md (kind: the device, e.g. h100) to --out, $OUT or
benchmarks/results/.

--sweep: the shape sweep (run_sweep): Skv in {1, 2, 4, 8, 12, 16}, heads {1/1, 4/4, 8/8, 32/32,
4/1, 8/2, 32/8}, D {64, 128, 256, 512}, padded (kv_lengths) and ragged (kv_cu_seqlens) K/V with
lengths uniform in [1, Skv], B {16384, 262144, 1048576}; a B whose buffers would exceed --max-gb
is dropped. Filters --skv, --heads, --dims, --layouts, --batches; --part i/n runs point k of the
grid when k % n == i (one process per GPU). Per point: jaxcp and XLA forward and forward+backward,
each CUDA kernel family of --variants (kernel_options.SmallSeqKernelOptions; on a CPU only
"auto") as the forward primitive alone and the backward primitive alone, and best-form device
copies moving the bytes of jaxcp's forward and of its forward+backward. Bytes: the forward reads
Q and the K/V tokens rows attend to (not the padding) and writes O and the float32 probabilities
[B, Hq, max_len] (max_len = Skv: the ragged calls pass max_kv_len=Skv); the backward reads Q, dO, those K/V tokens and
the probabilities and writes dQ and all of dK/dV (padding included); rows of one key run the
one-key path (small_seq/one_key.py), which reads V and writes O, then reads dO and writes dQ and
all of dK/dV; XLA's bytes are its padded layout. Calls whose inputs are under half a GiB are timed
as up to 16 calls in one program (_time). Writes small_seq_sweep_<kind>[_partI].json and .md after every point;
plot_small_seq.py merges the parts, summarises and plots.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
import zlib

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

from jaxcp._src.small_seq import api as ss, dispatch  # noqa: E402
from jaxcp._src.small_seq.primitive import SmallSeqConfig, small_seq_bwd_p, small_seq_fwd_p  # noqa: E402
from jaxcp._src.primitive_utils import choose_implementation  # noqa: E402

MEMORY_SLACK = 1 << 20  # bytes of alignment/rounding allowed over "need"


@dataclasses.dataclass
class Case:
  name: str
  batch: int
  seq_len: int = 16
  q_heads: int = 8
  kv_heads: int = 8
  head_dim: int = 128
  ragged_mean: int = 0  # > 0: ragged layout, lengths uniform in [1, 2*mean - 1] (capped at 16)


def gpu_cases():
  cases = []
  for b in (30720, 262144):
    cases += [
        Case(f"B={b} S=16 8/8 D128", b),
        Case(f"B={b} S=8 8/8 D256", b, seq_len=8, head_dim=256),
        Case(f"B={b} S=16 GQA 16/4 D128", b, q_heads=16, kv_heads=4),
        Case(f"B={b} ragged mean 8, 8/8 D128", b, ragged_mean=8),
    ]
  return cases


QUICK_CASES = [
    Case("quick B=512 S=16 8/8 D64", 512, head_dim=64),
    Case("quick B=512 S=8 4/4 D128", 512, seq_len=8, q_heads=4, kv_heads=4),
    Case("quick B=512 GQA 8/2 D64", 512, q_heads=8, kv_heads=2, head_dim=64),
    Case("quick B=512 ragged mean 8 D64", 512, head_dim=64, ragged_mean=8),
]


def bench(fn, *args, reps: int, min_batch_s: float = 2e-3, warmup: int = 3, stat=statistics.median) -> float:
  """Seconds per call of a jitted fn (the `stat` of `reps` batches, median by default): warm-up,
  then `reps` timed batches of back-to-back calls (enough calls per batch to amortise dispatch),
  each synchronised with block_until_ready."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = time.perf_counter() - t0
  inner = max(1, min(50, math.ceil(min_batch_s / max(one, 1e-7))))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner - 1):
      fn(*args)  # dropped at once: at most two results are alive
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) / inner)
  return stat(times)


def random_arrays(b, hq, d, kv_shape, dtype):
  """q, k, v, dout: standard normal in dtype, q/dout [b, hq, d], k/v kv_shape (fixed keys)."""
  key = jax.random.PRNGKey(0)
  q = jax.random.normal(key, (b, hq, d), dtype)
  dout = jax.random.normal(jax.random.fold_in(key, 3), (b, hq, d), dtype)
  k = jax.random.normal(jax.random.fold_in(key, 1), kv_shape, dtype)
  v = jax.random.normal(jax.random.fold_in(key, 2), kv_shape, dtype)
  return q, k, v, dout


def make_inputs(case: Case, dtype, rng):
  b, s, hq, hkv, d = case.batch, case.seq_len, case.q_heads, case.kv_heads, case.head_dim
  if case.ragged_mean:
    lengths = rng.integers(1, 2 * case.ragged_mean, b).clip(max=s).astype(np.int32)
  else:
    lengths = np.full((b,), s, np.int32)
  tokens = int(lengths.sum())
  kv_shape = (tokens, hkv, d) if case.ragged_mean else (b, s, hkv, d)
  q, k, v, dout = random_arrays(b, hq, d, kv_shape, dtype)
  return q, k, v, dout, jnp.asarray(lengths), tokens


def to_padded(k, lengths, s):
  """Ragged [T, Hkv, D] -> padded [B, s, Hkv, D] (zeros past each length), for the XLA baseline."""
  cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths)])
  idx = cu[:-1, None] + jnp.arange(s, dtype=jnp.int32)
  valid = jnp.arange(s)[None, :] < lengths[:, None]
  g = k[jnp.clip(idx, 0, k.shape[0] - 1)]
  return jnp.where(valid[:, :, None, None], g, 0).astype(k.dtype)


# The copy forms of device_copy, jitted once (a shape compiles once, before and after a case).
_copy_negate = jax.jit(lambda a: -a)
_copy_u32 = jax.jit(lambda a: jnp.copy(a))
_copy_add_f32 = jax.jit(lambda a: a.view(jnp.float32) + 1.0)


def device_copy(x, reps, min_batch_s: float = 2e-3, warmup: int = 3, stat=statistics.median):
  """Bandwidth (GB/s, bytes read + written) of copying x's bytes: an elementwise negate in x's
  dtype, a uint32 copy (jnp.copy) and a float32 x + 1 over the same bytes. Returns
  ({form: GB/s}, {form: ms})."""
  nbytes = x.size * x.dtype.itemsize
  words = jnp.zeros((nbytes // 4,), jnp.uint32)
  forms = {"negate": (_copy_negate, x), "copy_u32": (_copy_u32, words), "add_f32": (_copy_add_f32, words)}
  gbps, ms = {}, {}
  for name, (fn, arg) in forms.items():
    t = bench(fn, arg, reps=reps, min_batch_s=min_batch_s, warmup=warmup, stat=stat)
    gbps[name], ms[name] = 2 * nbytes / t / 1e9, t * 1e3
  del words
  return gbps, ms


def compiled_memory(jitted, *args) -> dict | None:
  """XLA's buffer assignment for one call of `jitted` (bytes): arguments, outputs, aliased, temps,
  and total = arguments + outputs + temps - aliased."""
  try:
    m = jitted.lower(*args).compile().memory_analysis()
  except Exception:  # a backend without memory analysis
    return None
  if m is None:
    return None
  r = dict(argument=int(m.argument_size_in_bytes), output=int(m.output_size_in_bytes),
           alias=int(m.alias_size_in_bytes), temp=int(m.temp_size_in_bytes))
  r["total"] = r["argument"] + r["output"] + r["temp"] - r["alias"]
  return r


def measured_call_bytes(fn, *args, expected: int) -> int | None:
  """Bytes one call of `fn` allocates on the device beyond what is live before it (its outputs
  and temporaries), from the allocator's peak. None where the backend keeps no memory_stats (the
  CPU) or where measuring would not fit.

  peak_bytes_in_use cannot be reset, so a ballast array first lifts the bytes in use up to the
  peak seen so far; any allocation of the call then raises the peak by exactly its size."""
  dev = jax.devices()[0]
  stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  jax.block_until_ready(fn(*args))  # compiled and warm: no autotuning allocation below
  gc.collect()
  stats = dev.memory_stats()
  lift = stats["peak_bytes_in_use"] - stats["bytes_in_use"]
  limit = stats.get("bytes_limit") or 0
  if limit and stats["peak_bytes_in_use"] + 2 * expected > 0.95 * limit:
    return None
  ballast = jnp.zeros((lift,), jnp.uint8) if lift > 0 else None
  if ballast is not None:
    ballast.block_until_ready()
  stats = dev.memory_stats()
  base, peak0 = stats["bytes_in_use"], stats["peak_bytes_in_use"]
  out = fn(*args)
  jax.block_until_ready(out)
  peak = dev.memory_stats()["peak_bytes_in_use"]
  del out, ballast
  gc.collect()
  if peak <= peak0 and base < peak0:  # the lift fell short: the call's peak is not visible
    return None
  return max(0, peak - base)


def memory_report(fwd, fwdbwd, fwd_args, fb_args, *, in_fwd, in_fb, need_fwd, need_fb) -> dict:
  """Compiled buffer sizes and (GPU) measured peaks of the forward and forward+backward calls
  against need = inputs + outputs + saved probabilities (+ row index arrays)."""
  r = dict(need_fwd_bytes=need_fwd, need_fwdbwd_bytes=need_fb)
  for tag, fn, args, inputs, need in (("fwd", fwd, fwd_args, in_fwd, need_fwd),
                                      ("fwdbwd", fwdbwd, fb_args, in_fb, need_fb)):
    comp = compiled_memory(fn, *args)
    r[f"{tag}_compiled"] = comp
    r[f"{tag}_temp_over_need"] = None if comp is None else comp["temp"] / need
    extra = measured_call_bytes(fn, *args, expected=need - inputs)
    r[f"{tag}_peak_bytes"] = None if extra is None else inputs + extra
    checks = []
    if comp is not None:
      checks.append(comp["total"] <= need + MEMORY_SLACK)
    if extra is not None:
      checks.append(inputs + extra <= need + MEMORY_SLACK)
    r[f"{tag}_memory_ok"] = all(checks) if checks else None
  flags = [r["fwd_memory_ok"], r["fwdbwd_memory_ok"]]
  r["memory_ok"] = None if any(f is None for f in flags) else all(flags)
  return r


def _fwd_and_grads(fn, q, k, v, dout):
  out, pull = jax.vjp(fn, q, k, v)
  return (out,) + pull(dout)


def run_case(case: Case, dtype, reps: int, rng) -> dict:
  q, k, v, dout, lengths, tokens = make_inputs(case, dtype, rng)
  b, s, hq, hkv, d = case.batch, case.seq_len, case.q_heads, case.kv_heads, case.head_dim
  es = jnp.dtype(dtype).itemsize
  ragged = bool(case.ragged_mean)
  cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths)]) if ragged else None

  q_bytes = b * hq * d * es
  kv_bytes = 2 * tokens * hkv * d * es
  p_bytes = b * hq * s * 4
  fwd_bytes = q_bytes + kv_bytes + q_bytes + p_bytes               # Q, K, V in; O, P out
  bwd_bytes = 2 * q_bytes + kv_bytes + p_bytes + q_bytes + kv_bytes  # Q, dO, K, V, P in; dQ, dK, dV
  idx_bytes = 3 * 4 * b + (4 * (b + 1) if ragged else 0)  # start, length, mask [, cu_seqlens]
  need_fwd = q_bytes + kv_bytes + q_bytes + p_bytes + idx_bytes        # Q, K, V; O; P
  need_fb = 2 * q_bytes + kv_bytes + 2 * q_bytes + kv_bytes + p_bytes + idx_bytes  # + dO; dQ dK dV
  res = dict(case=case.name, batch=b, seq_len=s, q_heads=hq, kv_heads=hkv, head_dim=d,
             dtype=jnp.dtype(dtype).name, layout="ragged" if ragged else "padded",
             kv_tokens=tokens, fwd_bytes=fwd_bytes, bwd_bytes=bwd_bytes)

  # ---- jaxcp
  def jx(q, k, v):
    if ragged:
      return ss.small_seq_attention(q, k, v, kv_cu_seqlens=cu)
    return ss.small_seq_attention(q, k, v)

  impl = choose_implementation(None, jnp.dtype(dtype), d, ss._CUDA_HEAD_DIMS)  # what None picks
  res["jaxcp_implementation"] = impl
  fwd = jax.jit(jx)
  fwdbwd = jax.jit(functools.partial(_fwd_and_grads, jx))
  copy_before, copy_before_ms = device_copy(k, reps)  # the ceiling, right before and after jaxcp
  t_fwd = bench(fwd, q, k, v, reps=reps)
  t_fb = bench(fwdbwd, q, k, v, dout, reps=reps)
  t_bwd = None
  if impl != "xla":  # the backward kernel alone, on the residuals the forward saved
    mask = jnp.full((b,), -1, jnp.int32)
    if ragged:
      config = SmallSeqConfig(d ** -0.5, min(16, tokens), True)
      index = (cu[:-1], lengths, mask)
    else:
      config = SmallSeqConfig(d ** -0.5, s, False)
      index = (lengths, mask)
    probs = jax.jit(lambda q, k, v: small_seq_fwd_p.bind(q, k, v, *index, config=config)[1])(q, k, v)
    bwd = jax.jit(lambda q, k, v, p, do: small_seq_bwd_p.bind(q, k, v, p, do, *index,
                                                                 config=config))
    t_bwd = bench(bwd, q, k, v, probs, dout, reps=reps)
    del probs
  res.update(jaxcp_fwd_ms=t_fwd * 1e3, jaxcp_fwdbwd_ms=t_fb * 1e3,
             jaxcp_bwd_ms=None if t_bwd is None else t_bwd * 1e3)
  copy_after, copy_after_ms = device_copy(k, reps)

  # ---- memory: compiled buffers and measured peaks against inputs + outputs + probabilities
  extra_in = 4 * (b + 1) if ragged else 0  # cu_seqlens is an argument of the ragged calls
  res.update(memory_report(fwd, fwdbwd, (q, k, v), (q, k, v, dout),
                           in_fwd=q_bytes + kv_bytes + extra_in,
                           in_fb=2 * q_bytes + kv_bytes + extra_in,
                           need_fwd=need_fwd, need_fb=need_fb))

  # ---- XLA: jax.nn.dot_product_attention on the padded layout with a padding mask
  kp, vp = (to_padded(k, lengths, s), to_padded(v, lengths, s)) if ragged else (k, v)

  def xla(q, k, v):
    out = jax.nn.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=lengths,
                                       implementation="xla")
    return out[:, 0]

  xf = jax.jit(xla)
  xfb = jax.jit(functools.partial(_fwd_and_grads, xla))
  res["xla_fwd_ms"] = bench(xf, q, kp, vp, reps=reps) * 1e3
  res["xla_fwdbwd_ms"] = bench(xfb, q, kp, vp, dout, reps=reps) * 1e3
  xla_mem = compiled_memory(xfb, q, kp, vp, dout)
  res["xla_fwdbwd_temp_bytes"] = None if xla_mem is None else xla_mem["temp"]
  err = float(jnp.max(jnp.abs(fwd(q, k, v).astype(jnp.float32) - xf(q, kp, vp).astype(jnp.float32))))
  res["max_abs_diff_vs_xla"] = err
  del kp, vp

  # ---- device copy of K's bytes (read + write): the best of three forms, before and after
  both = list(copy_before.values()) + list(copy_after.values())
  res.update(copy_ms=min(list(copy_before_ms.values()) + list(copy_after_ms.values())),
             copy_gbps=max(both), copy_before_gbps=max(copy_before.values()),
             copy_after_gbps=max(copy_after.values()),
             copy_variants_gbps=dict(before=copy_before, after=copy_after))
  copy_gbps = res["copy_gbps"]

  gbps = lambda nbytes, ms: nbytes / (ms * 1e-3) / 1e9
  res["jaxcp_fwd_gbps"] = gbps(fwd_bytes, res["jaxcp_fwd_ms"])
  res["jaxcp_bwd_gbps"] = None if t_bwd is None else gbps(bwd_bytes, res["jaxcp_bwd_ms"])
  res["jaxcp_fwdbwd_gbps"] = gbps(fwd_bytes + bwd_bytes, res["jaxcp_fwdbwd_ms"])
  res["xla_fwd_gbps"] = gbps(fwd_bytes, res["xla_fwd_ms"])
  res["xla_fwdbwd_gbps"] = gbps(fwd_bytes + bwd_bytes, res["xla_fwdbwd_ms"])
  res["fwd_pct_of_copy"] = 100 * res["jaxcp_fwd_gbps"] / copy_gbps
  res["bwd_pct_of_copy"] = (None if t_bwd is None else 100 * res["jaxcp_bwd_gbps"] / copy_gbps)
  res["fwdbwd_speedup_vs_xla"] = res["xla_fwdbwd_ms"] / res["jaxcp_fwdbwd_ms"]
  res["fwd_speedup_vs_xla"] = res["xla_fwd_ms"] / res["jaxcp_fwd_ms"]
  return res


def _memory_cell(r) -> str:
  """"pass"/"FAIL" and the largest of compiled total and measured peak over need, per call."""
  def one(tag):
    comp, peak, need = r.get(f"{tag}_compiled"), r.get(f"{tag}_peak_bytes"), r[f"need_{tag}_bytes"]
    parts = []
    if comp is not None:
      parts.append(f"{comp['total'] / need:.3f}")
    if peak is not None:
      parts.append(f"peak {peak / need:.3f}")
    return "/".join(parts) or "-"
  ok = r.get("memory_ok")
  verdict = "-" if ok is None else ("pass" if ok else "FAIL")
  return f"{verdict} ({one('fwd')}; {one('fwdbwd')})"


def markdown(results, meta) -> str:
  f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"
  header = ["case", "layout", "jaxcp fwd ms (GB/s, % copy)", "jaxcp bwd ms (GB/s, % copy)",
            "jaxcp fwd+bwd ms", "XLA fwd ms", "XLA fwd+bwd ms", "fwd+bwd vs XLA", "copy GB/s",
            "temp bytes / (inputs+outputs+probs) fwd; fwd+bwd",
            "memory <= inputs+outputs+probs (fwd; fwd+bwd: total/need)"]
  rows = []
  for r in results:
    if "error" in r:
      rows.append([r["case"], "error: " + r["error"][:80]] + [""] * (len(header) - 2))
      continue
    rows.append([
        r["case"], r["layout"],
        f"{f(r['jaxcp_fwd_ms'], 3)} ({f(r['jaxcp_fwd_gbps'], 0)}, {f(r['fwd_pct_of_copy'], 0)}%)",
        (f"{f(r['jaxcp_bwd_ms'], 3)} ({f(r['jaxcp_bwd_gbps'], 0)}, {f(r['bwd_pct_of_copy'], 0)}%)"
         if r["jaxcp_bwd_ms"] is not None else "-"),
        f(r["jaxcp_fwdbwd_ms"], 3), f(r["xla_fwd_ms"], 3), f(r["xla_fwdbwd_ms"], 3),
        f"{f(r['fwdbwd_speedup_vs_xla'])}x",
        f"{f(r['copy_gbps'], 0)} ({f(r['copy_before_gbps'], 0)}/{f(r['copy_after_gbps'], 0)})",
        f"{f(r['fwd_temp_over_need'], 3)}; {f(r['fwdbwd_temp_over_need'], 3)}",
        _memory_cell(r)])
  title = (f"## Small-sequence attention ({meta['device']}, jax {meta['jax']}, {meta['dtype']})\n\n"
           "Bandwidth over the bytes that must move (fwd: Q, K, V, O, probabilities; bwd: Q, dO, "
           "K, V, probabilities, dQ, dK, dV); copy = best of three copies of K's bytes timed "
           "before and after the jaxcp timings of the case (in brackets: best before / after).\n"
           "Memory: need = inputs + outputs + saved probabilities (+ int32 row index arrays); "
           "temp = XLA's temp buffers of the jitted call; total = arguments + outputs + temps "
           "(and, on GPU, 'peak' = inputs + the allocator's peak rise during one call); pass when "
           "each is <= need + 1 MiB.\n\n")
  return title + common.markdown_table(header, rows)


# ---------------------------------------------------------------- shape sweep (--sweep)
# One query token per row over 1..16 keys, across key counts, head layouts, head dims, both K/V
# layouts and batch sizes; per point jaxcp against XLA, the bandwidth of each against a device
# copy of the same bytes, and each CUDA kernel family (forward alone, backward kernel alone) for
# the dispatch rule. plot_small_seq.py merges the parts, summarises and plots.

SWEEP_SKV = (1, 2, 4, 8, 12, 16)
SWEEP_HEADS = ((1, 1), (4, 4), (8, 8), (32, 32), (4, 1), (8, 2), (32, 8))
SWEEP_DIMS = (64, 128, 256, 512)
SWEEP_LAYOUTS = ("padded", "ragged")
SWEEP_BATCHES = (16384, 262144, 1048576)
SWEEP_VARIANTS = ("auto", "mma", "lanes", "cuda_core")  # kernel_options.SmallSeqKernelOptions names
# Sweep timings: batches of >= 10 ms (up to 50 calls queued back to back, so that a call of tens
# of microseconds is timed on the GPU, not in Python's dispatch), the fastest of the batches
# (other processes of a multi-GPU sweep compile on the same host and can stall one).
SWEEP_MIN_BATCH_S = 10e-3
# A call whose inputs are under SWEEP_PROGRAM_BYTES / 2 is timed as up to SWEEP_MAX_COPIES calls in
# one program (see _time).
SWEEP_PROGRAM_BYTES = 1 << 30
SWEEP_MAX_COPIES = 16
GB = 1e9


@dataclasses.dataclass(frozen=True)
class SweepPoint:
  skv: int
  q_heads: int
  kv_heads: int
  head_dim: int
  layout: str  # "padded" (kv_lengths) or "ragged" (kv_cu_seqlens); lengths uniform in [1, skv]
  batch: int

  @property
  def name(self) -> str:
    return (f"B={self.batch} Skv={self.skv} {self.q_heads}/{self.kv_heads} D{self.head_dim} "
            f"{self.layout}")

  @property
  def probs_len(self) -> int:
    """Columns of the saved probabilities: the call's max_len (Skv; the ragged calls pass
    max_kv_len=Skv)."""
    return self.skv


def sweep_buffer_bytes(p: SweepPoint, itemsize: int) -> int:
  """The point's largest buffer set (an upper bound, independent of the random lengths): Q, dO,
  O, dQ; K, V, dK, dV at Skv tokens per row; the float32 probabilities; for the ragged layout
  XLA's padded K/V copies."""
  q = p.batch * p.q_heads * p.head_dim * itemsize
  kv = p.batch * p.skv * p.kv_heads * p.head_dim * itemsize  # one of K, V, dK, dV
  probs = p.batch * p.q_heads * p.probs_len * 4
  xla_copies = 2 * kv if p.layout == "ragged" else 0
  return 4 * q + 4 * kv + probs + xla_copies


def _ints(text: str) -> tuple:
  return tuple(int(x) for x in text.split(",") if x.strip())


def _heads(text: str) -> tuple:
  out = []
  for item in text.split(","):
    hq, hkv = (int(x) for x in item.split("/"))
    if hkv < 1 or hq % hkv:
      raise ValueError(f"--heads {item}: query heads must be a multiple of key/value heads")
    out.append((hq, hkv))
  return tuple(out)


def _part(text: str | None):
  if text is None:
    return None
  i, n = (int(x) for x in text.split("/"))
  if not (n >= 1 and 0 <= i < n):
    raise ValueError(f"--part {text}: want i/n with 0 <= i < n")
  return i, n


def sweep_points(args, itemsize: int):
  """(points of this part, dropped points): the grid in the order (D, heads, Skv, layout, B),
  without the points over --max-gb; point k of what remains runs in part k % n."""
  skvs = _ints(args.skv) if args.skv else SWEEP_SKV
  heads = _heads(args.heads) if args.heads else SWEEP_HEADS
  dims = _ints(args.dims) if args.dims else SWEEP_DIMS
  layouts = tuple(x for x in args.layouts.split(",") if x) if args.layouts else SWEEP_LAYOUTS
  batches = _ints(args.batches) if args.batches else SWEEP_BATCHES
  if bad := [s for s in skvs if not 1 <= s <= 16]:
    raise ValueError(f"--skv: key counts must be in [1, 16], got {bad}")
  if bad := [x for x in layouts if x not in SWEEP_LAYOUTS]:
    raise ValueError(f"--layouts: want {SWEEP_LAYOUTS}, got {bad}")
  kept, dropped = [], []
  for d in dims:
    for hq, hkv in heads:
      for skv in skvs:
        for layout in layouts:
          for b in batches:
            p = SweepPoint(skv, hq, hkv, d, layout, b)
            (dropped if sweep_buffer_bytes(p, itemsize) > args.max_gb * GB else kept).append(p)
  if args.redo:
    redo = _needs_redo(args.redo)
    kept = [p for p in kept if redo(p.name)]
  part = _part(args.part)
  if part is not None:
    kept = [p for k, p in enumerate(kept) if k % part[1] == part[0]]
  return kept, dropped


def _needs_redo(paths: str):
  """name -> whether the sweep results in `paths` (comma-separated JSON files) leave that point
  below the targets (plot_small_seq.misses_targets) or do not hold it."""
  import plot_small_seq

  results = [r for path in paths.split(",") for r in json.load(open(path))["results"]]
  held = {r["name"] for r in results}
  missed = {r["name"] for r in results if plot_small_seq.misses_targets(r)}
  return lambda name: name in missed or name not in held


def _jaxcp_padded(q, k, v, lengths):
  return ss.small_seq_attention(q, k, v, kv_lengths=lengths)


def _jaxcp_ragged(q, k, v, cu, *, max_kv_len):
  return ss.small_seq_attention(q, k, v, kv_cu_seqlens=cu, max_kv_len=max_kv_len)


def _xla_padded(q, k, v, lengths):
  out = jax.nn.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=lengths,
                                     implementation="xla")
  return out[:, 0]


def _with_index(fn):
  """fn(q, k, v, index) as (forward, forward+backward) jitted with the index array an argument
  (not a constant baked into the program)."""
  fwd = jax.jit(fn)
  fwdbwd = jax.jit(lambda q, k, v, dout, index: _fwd_and_grads(
      lambda q, k, v: fn(q, k, v, index), q, k, v, dout))
  return fwd, fwdbwd


@functools.partial(jax.jit, static_argnames="config")
def _kernel_fwd(q, k, v, *index, config):
  return small_seq_fwd_p.bind(q, k, v, *index, config=config)


@functools.partial(jax.jit, static_argnames="config")
def _kernel_bwd(q, k, v, probs, dout, *index, config):
  return small_seq_bwd_p.bind(q, k, v, probs, dout, *index, config=config)


_to_padded = jax.jit(to_padded, static_argnums=2)
_max_abs_diff = jax.jit(lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _copies(args) -> int:
  """How many calls one timed program runs: as many as fit SWEEP_PROGRAM_BYTES of inputs, at most
  SWEEP_MAX_COPIES (1 from half of SWEEP_PROGRAM_BYTES: reading that takes an H200 over 100 us,
  more than Python's dispatch of a program)."""
  nbytes = sum(a.nbytes for a in args if hasattr(a, "nbytes"))
  return max(1, min(SWEEP_MAX_COPIES, SWEEP_PROGRAM_BYTES // max(nbytes, 1)))


def _time(fn, *args, reps: int) -> float:
  """Seconds per call of fn: bench() with the sweep's short batches, one warm-up call (the
  compiling call). A small call runs as `_copies` calls in one program, each on its own copies of
  the float arrays (no common subexpressions, no reuse of a cached input), and the time is the
  program's over the copies: a call of a few microseconds is then timed on the GPU, as inside a
  model's step, rather than in Python's dispatch of a program per call (tens of microseconds)."""
  copies = _copies(args)
  if copies == 1:
    return bench(fn, *args, reps=reps, min_batch_s=SWEEP_MIN_BATCH_S, warmup=2, stat=min)
  fresh = lambda a: jnp.array(a, copy=True) if jnp.issubdtype(a.dtype, jnp.floating) else a
  calls = [tuple(fresh(a) for a in args) for _ in range(copies)]
  program = jax.jit(lambda calls: [fn(*c) for c in calls])
  t = bench(program, calls, reps=reps, min_batch_s=SWEEP_MIN_BATCH_S, warmup=2, stat=min)
  return t / copies


def kernel_options(variant: str):
  from jaxcp._src.kernel_options import SmallSeqKernelOptions
  return SmallSeqKernelOptions(fwd=variant, bwd=variant)


def _copy_of(nbytes: int, dtype, reps: int):
  """Best-form device copy (GB/s over bytes read + written, and ms) moving `nbytes` in all: a
  copy of an array of nbytes / 2, so that % of copy = copy time / kernel time."""
  x = jnp.zeros((max(1, nbytes // 2 // jnp.dtype(dtype).itemsize),), dtype)
  gbps, ms = device_copy(x, reps, SWEEP_MIN_BATCH_S, warmup=2, stat=min)
  del x
  best = max(gbps, key=gbps.get)
  return gbps[best], ms[best], best


def _short(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


def run_sweep_point(p: SweepPoint, dtype, reps: int, variants) -> dict:
  t_start = time.perf_counter()
  b, skv, hq, hkv, d = p.batch, p.skv, p.q_heads, p.kv_heads, p.head_dim
  es = jnp.dtype(dtype).itemsize
  ragged = p.layout == "ragged"
  rng = np.random.default_rng(zlib.crc32(p.name.encode()))
  lengths_np = rng.integers(1, skv + 1, b).astype(np.int32)  # uniform in [1, Skv]
  tokens = int(lengths_np.sum())
  q, k, v, dout = random_arrays(b, hq, d, (tokens, hkv, d) if ragged else (b, skv, hkv, d), dtype)
  lengths = jnp.asarray(lengths_np)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths_np)]).astype(np.int32)) if ragged else None
  probs_len = min(skv, tokens)
  buffer_tokens = tokens if ragged else b * skv

  # ---- bytes each call must move
  q_bytes = b * hq * d * es                   # one of Q, O, dO, dQ
  kv_read = 2 * tokens * hkv * d * es         # the K and V tokens rows attend to
  kv_written = 2 * buffer_tokens * hkv * d * es  # all of dK, dV (padding included)
  p_bytes = b * hq * probs_len * 4
  kv_pad = 2 * b * skv * hkv * d * es         # XLA's padded K and V
  kernel_fwd_bytes = q_bytes + kv_read + q_bytes + p_bytes                    # Q, K, V; O, P
  kernel_bwd_bytes = 2 * q_bytes + kv_read + p_bytes + q_bytes + kv_written  # Q, dO, K, V, P; dQ, dK, dV
  impl = choose_implementation(None, jnp.dtype(dtype), d, ss._CUDA_HEAD_DIMS)
  if impl == "cuda" and dispatch.prefer_one_key_path(skv):
    fwd_bytes = kv_read // 2 + q_bytes                  # V; O
    bwd_bytes = q_bytes + q_bytes + kv_written          # dO; dQ, dK, dV
  else:
    fwd_bytes, bwd_bytes = kernel_fwd_bytes, kernel_bwd_bytes
  xla_fwd_bytes = q_bytes + kv_pad + q_bytes                             # Q, K, V; O
  xla_fwdbwd_bytes = xla_fwd_bytes + 2 * q_bytes + kv_pad + q_bytes + kv_pad  # + Q, K, V, dO; dQ, dK, dV
  res = dict(name=p.name, batch=b, skv=skv, q_heads=hq, kv_heads=hkv, group=hq // hkv, head_dim=d,
             layout=p.layout, dtype=jnp.dtype(dtype).name, kv_tokens=tokens,
             mean_len=tokens / b, probs_len=probs_len,
             buffer_bytes_bound=sweep_buffer_bytes(p, es), fwd_bytes=fwd_bytes,
             bwd_bytes=bwd_bytes, fwdbwd_bytes=fwd_bytes + bwd_bytes,
             xla_fwd_bytes=xla_fwd_bytes, xla_fwdbwd_bytes=xla_fwdbwd_bytes)
  index_arg = cu if ragged else lengths

  # ---- jaxcp (public API; implementation=None)
  res["jaxcp_implementation"] = impl
  fwd, fwdbwd = _with_index(functools.partial(_jaxcp_ragged, max_kv_len=skv) if ragged else _jaxcp_padded)
  res["jaxcp_fwd_ms"] = _time(fwd, q, k, v, index_arg, reps=reps) * 1e3
  res["jaxcp_fwdbwd_ms"] = _time(fwdbwd, q, k, v, dout, index_arg, reps=reps) * 1e3
  out_jaxcp = fwd(q, k, v, index_arg)

  # ---- per kernel family: the forward alone and the backward kernel alone (flat primitives)
  res["variants"] = {}
  if impl != "xla":
    mask = jnp.full((b,), -1, jnp.int32)
    index = (cu[:-1], lengths, mask) if ragged else (lengths, mask)
    base = SmallSeqConfig(d ** -0.5, probs_len, ragged, kernel_options("auto"))
    probs = _kernel_fwd(q, k, v, *index, config=base)[1]  # the backward's input, for every family
    for var in variants:
      r = {}
      try:
        config = SmallSeqConfig(d ** -0.5, probs_len, ragged, kernel_options(var))
      except Exception as e:  # noqa: BLE001 -- an options API without this family
        r["fwd_error"] = r["bwd_error"] = _short(e)
        res["variants"][var] = r
        continue
      for tag, fn, fargs, nbytes in (("fwd", _kernel_fwd, (q, k, v), kernel_fwd_bytes),
                                     ("bwd", _kernel_bwd, (q, k, v, probs, dout), kernel_bwd_bytes)):
        try:
          t = _time(functools.partial(fn, config=config), *fargs, *index, reps=reps)
          r[f"{tag}_ms"], r[f"{tag}_gbps"] = t * 1e3, nbytes / t / GB
        except Exception as e:  # noqa: BLE001 -- this family cannot run the shape
          r[f"{tag}_error"] = _short(e)
      res["variants"][var] = r
    del probs, mask, index

  # ---- device copies of the same bytes, right after the jaxcp timings
  for tag, nbytes in (("fwd", fwd_bytes), ("fwdbwd", fwd_bytes + bwd_bytes)):
    gbps, ms, form = _copy_of(nbytes, dtype, reps)
    res[f"copy_{tag}_gbps"], res[f"copy_{tag}_ms"], res[f"copy_{tag}_form"] = gbps, ms, form

  # ---- XLA on the padded layout with key_value_seq_lengths
  try:
    kp, vp = (_to_padded(k, lengths, skv), _to_padded(v, lengths, skv)) if ragged else (k, v)
    del k, v
    xf, xfb = _with_index(_xla_padded)
    res["xla_fwd_ms"] = _time(xf, q, kp, vp, lengths, reps=reps) * 1e3
    res["xla_fwdbwd_ms"] = _time(xfb, q, kp, vp, dout, lengths, reps=reps) * 1e3
    res["max_abs_diff_vs_xla"] = float(_max_abs_diff(out_jaxcp, xf(q, kp, vp, lengths)))
    del kp, vp
  except Exception as e:  # noqa: BLE001 -- e.g. out of memory: keep jaxcp's numbers
    res["xla_error"] = _short(e)
  del q, dout, out_jaxcp, lengths, cu, index_arg

  # ---- derived numbers
  res["jaxcp_fwd_gbps"] = fwd_bytes / res["jaxcp_fwd_ms"] * 1e3 / GB
  res["jaxcp_fwdbwd_gbps"] = (fwd_bytes + bwd_bytes) / res["jaxcp_fwdbwd_ms"] * 1e3 / GB
  res["fwd_pct_of_copy"] = 100 * res["jaxcp_fwd_gbps"] / res["copy_fwd_gbps"]
  res["fwdbwd_pct_of_copy"] = 100 * res["jaxcp_fwdbwd_gbps"] / res["copy_fwdbwd_gbps"]
  if "xla_fwd_ms" in res:
    res["xla_fwd_gbps"] = xla_fwd_bytes / res["xla_fwd_ms"] * 1e3 / GB
    res["xla_fwdbwd_gbps"] = xla_fwdbwd_bytes / res["xla_fwdbwd_ms"] * 1e3 / GB
    res["fwd_speedup_vs_xla"] = res["xla_fwd_ms"] / res["jaxcp_fwd_ms"]
    res["fwdbwd_speedup_vs_xla"] = res["xla_fwdbwd_ms"] / res["jaxcp_fwdbwd_ms"]
  for tag in ("fwd", "bwd"):
    times = {var: r[f"{tag}_ms"] for var, r in res["variants"].items() if f"{tag}_ms" in r}
    named = {var: t for var, t in times.items() if var != "auto"} or times
    best = min(named, key=named.get) if named else None
    res[f"fastest_{tag}"] = best
    res[f"auto_{tag}_vs_best"] = (times["auto"] / min(times.values())
                                  if "auto" in times else None)
  auto = res["variants"].get("auto", {})
  res["jaxcp_bwd_ms"] = auto.get("bwd_ms")  # the backward kernel alone, as the API runs it
  res["seconds"] = time.perf_counter() - t_start
  return res


def _sweep_line(r: dict) -> str:
  if "error" in r:
    return f"{r['name']}: error {r['error']}"
  f = lambda x, fmt: "-" if x is None else format(x, fmt)
  var = " ".join(
      f"{name}:{f(v.get('fwd_ms'), '.3f') if 'fwd_ms' in v else 'n/a'}/"
      f"{f(v.get('bwd_ms'), '.3f') if 'bwd_ms' in v else 'n/a'}"
      for name, v in r["variants"].items())
  return (f"{r['name']}: fwd {r['jaxcp_fwd_ms']:.3f} ms ({r['fwd_pct_of_copy']:.0f}% copy, "
          f"{f(r.get('fwd_speedup_vs_xla'), '.2f')}x XLA) | fwd+bwd {r['jaxcp_fwdbwd_ms']:.3f} ms "
          f"({r['fwdbwd_pct_of_copy']:.0f}% copy, {f(r.get('fwdbwd_speedup_vs_xla'), '.2f')}x XLA) | "
          f"fwd/bwd ms {var} | fastest {r['fastest_fwd']}/{r['fastest_bwd']} | "
          f"diff {f(r.get('max_abs_diff_vs_xla'), '.2e')} | {r['seconds']:.1f} s")


def run_sweep(args, dtype):
  import plot_small_seq  # the sweep's markdown (summary, table, fastest kernel per shape)

  reps = args.reps or 5
  variants = [x.strip() for x in args.variants.split(",") if x.strip()]
  if variants == ["all"]:
    variants = list(SWEEP_VARIANTS)
  if variants == ["none"]:
    variants = []
  if bad := [x for x in variants if x not in SWEEP_VARIANTS]:
    raise ValueError(f"--variants: want names of {SWEEP_VARIANTS} (or 'all'), got {bad}")
  if jax.default_backend() != "gpu" and variants not in ([], ["auto"]):
    print(f"kernel options are CUDA-only: on the {jax.default_backend()} backend only 'auto' runs")
    variants = ["auto"]
  points, dropped = sweep_points(args, dtype.itemsize)
  part = _part(args.part)
  name = common.result_name("small_seq_sweep") + (f"_part{part[0]}" if part else "")
  meta = dict(common.run_metadata(), dtype=dtype.name, reps=reps, variants=variants,
              max_gb=args.max_gb, part=args.part, min_batch_s=SWEEP_MIN_BATCH_S,
              program_bytes=SWEEP_PROGRAM_BYTES, max_copies=SWEEP_MAX_COPIES,
              filters=dict(skv=args.skv, heads=args.heads, dims=args.dims, layouts=args.layouts,
                           batches=args.batches, redo=args.redo),
              dropped_over_max_gb=[p.name for p in dropped])
  shape = lambda p: (p.skv, p.q_heads, p.kv_heads, p.head_dim, p.layout)
  everything_dropped = {shape(p) for p in dropped} - {shape(p) for p in sweep_points(
      argparse.Namespace(**dict(vars(args), part=None)), dtype.itemsize)[0]}
  print(f"{len(points)} points in this part ({len(dropped)} (shape, B) of the grid over --max-gb "
        f"{args.max_gb} GB dropped; {len(everything_dropped)} shapes with every B dropped, "
        f"skipped), variants {variants}, reps {reps}", flush=True)
  if not points:
    print("nothing to run")
    return
  results, out_dir = [], None
  for i, p in enumerate(points):
    try:
      r = run_sweep_point(p, dtype, reps, variants)
    except Exception as e:  # noqa: BLE001 -- keep going: the failure is a row of the table
      traceback.print_exc()
      r = dict(name=p.name, batch=p.batch, skv=p.skv, q_heads=p.q_heads, kv_heads=p.kv_heads,
               group=p.q_heads // p.kv_heads, head_dim=p.head_dim, layout=p.layout,
               error=_short(e))
    gc.collect()
    jax.clear_caches()  # every point has new shapes: drop its executables
    results.append(r)
    print(f"[{i + 1}/{len(points)}] {_sweep_line(r)}", flush=True)
    md = plot_small_seq.sweep_markdown(results, [meta])  # after every point: partial runs keep theirs
    out_dir = common.write_results(name, dict(meta=meta, results=results), md, args.out)
  if out_dir is not None:
    print(f"wrote {out_dir}/{name}.json and {name}.md")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="small batches (runs on the CPU)")
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
  parser.add_argument("--only", default=None, help="substring filter on case names")
  parser.add_argument("--out", default=None, help="output folder (default $OUT or benchmarks/results)")
  sweep = parser.add_argument_group("shape sweep (--sweep)")
  sweep.add_argument("--sweep", action="store_true",
                     help="the shape sweep: Skv x heads x D x layout x B (see the filters)")
  sweep.add_argument("--skv", default=None, help=f"key counts, e.g. 1,4 (default {SWEEP_SKV})")
  sweep.add_argument("--heads", default=None, help="query/key-value heads, e.g. 8/8,32/8 "
                     "(default " + ",".join(f"{a}/{b}" for a, b in SWEEP_HEADS) + ")")
  sweep.add_argument("--dims", default=None, help=f"head dims, e.g. 64,128 (default {SWEEP_DIMS})")
  sweep.add_argument("--layouts", default=None, help="padded,ragged (default both)")
  sweep.add_argument("--batches", default=None, help=f"batch sizes (default {SWEEP_BATCHES})")
  sweep.add_argument("--max-gb", type=float, default=6.0,
                     help="drop a batch size whose buffers (Q, K, V, dO, O, dQ, dK, dV, "
                     "probabilities, XLA's padded K/V) exceed this many GB (default 6)")
  sweep.add_argument("--variants", default="auto",
                     help="kernel families timed alone, of " + ",".join(SWEEP_VARIANTS) +
                     ", 'all' or 'none' (default auto; CUDA only)")
  sweep.add_argument("--redo", default=None,
                     help="sweep results JSON (comma-separated files): run only the grid points "
                     "they show below the targets or do not hold")
  sweep.add_argument("--part", default=None,
                     help="i/n: run point k of the grid when k %% n == i (one process per GPU)")
  args = parser.parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  if args.sweep:
    if args.quick or args.only:
      parser.error("--sweep takes the sweep's filters, not --quick or --only")
    return run_sweep(args, dtype)
  cases = QUICK_CASES if args.quick else gpu_cases()
  if args.only:
    cases = [c for c in cases if args.only in c.name]
  reps = args.reps or (5 if args.quick else 20)
  rng = np.random.default_rng(0)
  meta = dict(common.run_metadata(), dtype=dtype.name, quick=args.quick, reps=reps)
  name = common.result_name("small_seq")
  results = []
  for case in cases:
    try:
      r = run_case(case, dtype, reps, rng)
    except Exception as e:  # keep going: report the failure in the table
      traceback.print_exc()
      r = dict(case=case.name, error=f"{type(e).__name__}: {e}")
    results.append(r)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    md = markdown(results, meta)  # written after every case: partial runs keep their results
    out_dir = common.write_results(name, dict(meta=meta, results=results), md, args.out)
  print(md)
  print(f"wrote {out_dir}/{name}.json and {name}.md")


if __name__ == "__main__":
  main()
