"""Quick check of the sm_90a backward kernel against the sm_80 one and the XLA reference
(gradients), plus fwd+bwd timings of both against cuDNN on a few benchmark shapes (a development
aid; tests/test_gpu_attention.py is the real test).
  python tools/sm90_bwd_smoke.py [--no-timing | --timing-only] [--head-dim D ...] [--variant NAME=VAR=VALUE ...]
--variant adds a timing column with an environment variable set (A/B of kernel switches)."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import common  # noqa: E402

import jaxcp  # noqa: E402
from sm90_smoke import env, random_inputs, rel  # noqa: E402  (tools/ is on sys.path when run as a script)


def grads(impl, q, k, v, g, **kw):
  def f(q, k, v):
    return jaxcp.attention(q, k, v, implementation=impl, **kw)
  return jax.jit(lambda q, k, v, g: jax.vjp(f, q, k, v)[1](g))(q, k, v, g)


def packed_segments(rng, b, s, max_doc=300, empty_tail=0):
  seg = np.zeros((b, s), np.int32)
  for r in range(b):
    pos, i = 0, 1
    while pos < s - empty_tail:
      n = int(rng.integers(1, max_doc))
      seg[r, pos:min(pos + n, s - empty_tail)] = i
      pos, i = pos + n, i + 1
  return jnp.asarray(seg)


def check(d, mask, b=2, s=700, hq=4, hkv=2, dtype=jnp.bfloat16, skv=None, empty_tail=0, max_doc=300):
  skv = skv or s
  rng = np.random.default_rng(0)
  q, k, v = random_inputs(d, b, s, skv, hq, hkv, dtype)
  g = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(d), 3), (b, s, hq, d), dtype)
  kw = dict(mask)
  if skv == s:
    kw["segment_ids"] = packed_segments(rng, b, s, max_doc=max_doc, empty_tail=empty_tail)
  g90 = grads("cuda", q, k, v, g, **kw)
  with env(JAXCP_DISABLE_SM90="1"):
    g80 = grads("cuda", q, k, v, g, **kw)
  ref = grads("xla", q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
              g.astype(jnp.float32), **kw)
  errs = " ".join(f"{n} {rel(a, r):.1e}/{rel(c, r):.1e}" for n, a, c, r in zip("qkv", g90, g80, ref))
  nan = any(bool(np.isnan(np.asarray(x, np.float32)).any()) for x in g90)
  print(f"D={d} {mask} s={s} skv={skv} {hq}/{hkv} {jnp.dtype(dtype).name} tail={empty_tail}: "
        f"rel err sm90/sm80 d{errs}; nan {nan}", flush=True)


def timed_with_env(values, make, *args):
  with env(**values):
    return common.time_fn(make(), *args)


def timing(name, b, s, mean_doc, hq, hkv, d, window=None, variants=()):
  rng = np.random.default_rng(0)
  rows = common.packed_rows(rng, b, s, mean_doc)
  seg, pos = common.segments_and_positions(rows, s)
  w = (window - 1, 0) if window else None
  pairs = common.allowed_pairs(rows, causal=True, window=w)
  flops = 3.5 * 4 * d * hq * pairs
  key = jax.random.PRNGKey(1)
  q = jax.random.normal(key, (b, s, hq, d), jnp.bfloat16)
  k = jax.random.normal(jax.random.fold_in(key, 1), (b, s, hkv, d), jnp.bfloat16)
  v = jax.random.normal(jax.random.fold_in(key, 2), (b, s, hkv, d), jnp.bfloat16)

  def loss(fn):
    return jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))

  mk = lambda: loss(lambda q, k, v: jaxcp.attention(  # noqa: E731
      q, k, v, segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos), is_causal=True,
      local_window_size=w, implementation="cuda"))
  t90 = common.time_fn(mk(), q, k, v)
  t80 = timed_with_env({"JAXCP_DISABLE_SM90": "1"}, mk, q, k, v)
  extra = "".join(f", {vn} {flops / timed_with_env({var: val}, mk, q, k, v) / 1e12:.0f}"
                  for vn, var, val in variants)
  import bench_attention as ba
  case = ba.Case(name, b, s, mean_doc, q_heads=hq, kv_heads=hkv, head_dim=d, window=window)
  t_cudnn = common.time_fn(loss(ba._cudnn_packed(case, rows, jnp.bfloat16)), q, k, v)
  print(f"{name} fwd+bwd: sm90 {flops / t90 / 1e12:.0f} TFLOP/s, sm80 {flops / t80 / 1e12:.0f}{extra}, "
        f"cudnn {flops / t_cudnn / 1e12:.0f}: sm90/cudnn {t_cudnn / t90:.2f}", flush=True)


if __name__ == "__main__":
  print(jax.devices())
  variants = [tuple(a.split("=", 2)) for i, a in enumerate(sys.argv) if i and sys.argv[i - 1] == "--variant"]
  dims = [int(a) for i, a in enumerate(sys.argv) if i and sys.argv[i - 1] == "--head-dim"] or [64, 128, 256]
  if "--timing-only" not in sys.argv:
    for d in dims:
      for mask in (dict(is_causal=True), dict(), dict(local_window_size=(37, 11)), dict(is_causal=True, chunk_size=100)):
        check(d, mask)
      check(d, dict(is_causal=True), dtype=jnp.float16)
      check(d, dict(), skv=333)
      check(d, dict(is_causal=True), hq=8, hkv=1)
      check(d, dict(is_causal=True), hq=16, hkv=2, b=1, s=300)  # GQA split over blocks
      check(d, dict(is_causal=True), s=5)
      check(d, dict(is_causal=True), empty_tail=90)
    # Long documents with a short window / chunk: runs of skipped tiles longer than a warp's 32.
    if 128 in dims:
      check(128, dict(local_window_size=(200, 0)), s=6000, max_doc=5000)
    if 64 in dims:
      check(64, dict(is_causal=True, chunk_size=512), s=6000, max_doc=5000)
  if "--no-timing" not in sys.argv:
    for case in (("2x8k doc1k", 2, 8192, 1024, 16, 16, 128), ("2x8k doc1k D64", 2, 8192, 1024, 16, 16, 64),
                 ("2x8k doc1k D256", 2, 8192, 1024, 16, 16, 256),
                 ("4x16k doc4k", 4, 16384, 4096, 16, 16, 128), ("4x16k doc4k 32/8", 4, 16384, 4096, 32, 8, 128),
                 ("4x16k doc4k win1024", 4, 16384, 4096, 16, 16, 128, 1024),
                 ("1x128k doc8k", 1, 131072, 8192, 16, 16, 128)):
      if case[6] in dims:
        timing(*case, variants=variants)
