"""The GPU timeline of small-seq attention calls in steady state (jax.profiler): every kernel,
memset and copy of one call of jaxcp (padded layout with kv_lengths, the public API) and of
XLA's jax.nn.dot_product_attention on the same arrays, forward and forward+backward, with each
op's duration and the idle gap before it. It shows what a call's fixed cost is made of at small
batches, where the bytes take a few microseconds. With --ragged jaxcp gets the same rows as
ragged K/V (kv_cu_seqlens over the rows' tokens, max_kv_len = Skv); XLA keeps the padded layout.

  python3 tools/small_seq_timeline.py --batch 16384 --skv 2 --heads 1/1 --dim 512 [--ragged]
"""
import argparse
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timeline  # noqa: E402

import jaxcp  # noqa: E402


def calls(b, skv, hq, hkv, d, ragged=False, dtype=jnp.bfloat16):
  """{name: (jitted function, arguments)} for jaxcp and XLA, forward and forward+backward."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((b, skv, hkv, d)), dtype) for _ in range(2))
  lengths_np = rng.integers(1, skv + 1, b)
  lengths = jnp.asarray(lengths_np, jnp.int32)
  dout = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
  jx_kv = (k, v, lengths)

  def jx(q, k, v, lengths):
    return jaxcp.small_seq_attention(q, k, v, kv_lengths=lengths)

  if ragged:  # the rows' tokens packed: k/v [T, Hkv, D], and kv_cu_seqlens in the lengths' place
    cu = np.concatenate([[0], np.cumsum(lengths_np)])
    row_start = np.repeat(np.arange(b) * skv - cu[:-1], lengths_np)  # token t of row i: i * skv + t - cu[i]
    tokens = row_start + np.arange(cu[-1])
    jx_kv = tuple(x.reshape(b * skv, hkv, d)[tokens] for x in (k, v)) + (jnp.asarray(cu, jnp.int32),)

    def jx(q, k, v, cu):
      return jaxcp.small_seq_attention(q, k, v, kv_cu_seqlens=cu, max_kv_len=skv)

  def xla(q, k, v, lengths):
    out = jax.nn.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=lengths, implementation="xla")
    return out[:, 0]

  def fwd_bwd(f):
    def run(q, k, v, lengths, dout):
      out, pull = jax.vjp(lambda q, k, v: f(q, k, v, lengths), q, k, v)
      return out, pull(dout)
    return run

  return {"jaxcp fwd": (jax.jit(jx), (q,) + jx_kv), "xla fwd": (jax.jit(xla), (q, k, v, lengths)),
          "jaxcp fwd+bwd": (jax.jit(fwd_bwd(jx)), (q,) + jx_kv + (dout,)),
          "xla fwd+bwd": (jax.jit(fwd_bwd(xla)), (q, k, v, lengths, dout))}


def timeline(fn, args, reps=5):
  """The ops of the last of `reps` calls: (start us from the call's first op, gap us, duration us, name)."""
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  trace_dir = tempfile.mkdtemp()
  with jax.profiler.trace(trace_dir):
    for _ in range(reps):
      jax.block_until_ready(fn(*args))
  events = gpu_timeline.gpu_events(trace_dir, plane="/device:GPU:0")
  if not events:
    sys.exit("no GPU events in the profile (a GPU host is needed)")
  per_call = len(events) // reps
  events = events[-per_call:]
  t0, end, out = events[0][0], None, []
  for start, dur, name, _ in events:
    out.append(((start - t0) / 1e3, 0.0 if end is None else (start - end) / 1e3, dur / 1e3, name))
    end = start + dur if end is None else max(end, start + dur)
  return out, (end - t0) / 1e3


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, default=16384)
  ap.add_argument("--skv", type=int, default=2)
  ap.add_argument("--heads", default="1/1", help="HQ/HKV")
  ap.add_argument("--dim", type=int, default=512)
  ap.add_argument("--ragged", action="store_true", help="jaxcp on ragged K/V (kv_cu_seqlens)")
  a = ap.parse_args()
  hq, hkv = (int(h) for h in a.heads.split("/"))
  for name, (fn, args) in calls(a.batch, a.skv, hq, hkv, a.dim, a.ragged).items():
    ops, span = timeline(fn, args)
    layout = "ragged" if a.ragged and name.startswith("jaxcp") else "padded"
    print(f"== {name}: B={a.batch} Skv={a.skv} heads {a.heads} D={a.dim} {layout}: {len(ops)} ops, span {span:.1f} us, "
          f"busy {sum(o[2] for o in ops):.1f} us")
    for t, gap, dur, op in ops:
      print(f"  t {t:7.1f} us  gap {gap:5.1f}  {dur:7.1f} us  {op[:100]}")


if __name__ == "__main__":
  main()
