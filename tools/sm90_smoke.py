"""Quick check of the sm_90a forward kernel against the sm_80 one and the XLA reference, plus a
forward timing of both on a few benchmark shapes (a development aid; tests/test_gpu_attention.py
is the real test).   python tools/sm90_smoke.py"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import common  # noqa: E402

import jaxcp  # noqa: E402


def fwd(q, k, v, **kw):
  return jax.jit(lambda q, k, v: jaxcp.attention(q, k, v, implementation="cuda", return_residual=True, **kw))(q, k, v)


def rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def random_inputs(d, b, s, skv, hq, hkv, dtype):
  """q [b, s, hq, d] and k, v [b, skv, hkv, d] from PRNGKey(d) (keys d, fold_in 1, fold_in 2)."""
  key = jax.random.PRNGKey(d)
  q = jax.random.normal(key, (b, s, hq, d), dtype)
  k = jax.random.normal(jax.random.fold_in(key, 1), (b, skv, hkv, d), dtype)
  v = jax.random.normal(jax.random.fold_in(key, 2), (b, skv, hkv, d), dtype)
  return q, k, v


def check(d, mask, b=2, s=700, hq=4, hkv=2, dtype=jnp.bfloat16, skv=None):
  skv = skv or s
  rng = np.random.default_rng(0)
  q, k, v = random_inputs(d, b, s, skv, hq, hkv, dtype)
  kw = dict(mask)
  if skv == s:
    lengths = [list(rng.integers(1, 300, 8)) for _ in range(b)]
    seg = np.zeros((b, s), np.int32)
    for r, ls in enumerate(lengths):
      pos = 0
      for i, n in enumerate(ls):
        seg[r, pos:pos + n] = i + 1
        pos += n
        if pos >= s:
          break
    kw["segment_ids"] = jnp.asarray(seg)
  out, lse = fwd(q, k, v, **kw)
  os.environ["JAXCP_DISABLE_SM90"] = "1"
  out80, lse80 = fwd(q, k, v, **kw)
  del os.environ["JAXCP_DISABLE_SM90"]
  ref, ref_lse = jax.jit(lambda q, k, v: jaxcp.attention(q, k, v, implementation="xla", return_residual=True, **kw))(q, k, v)
  fin = np.isfinite(np.asarray(ref_lse))
  same_inf = bool((np.isneginf(np.asarray(lse)) == np.isneginf(np.asarray(ref_lse))).all())
  lse_err = float(np.abs(np.asarray(lse)[fin] - np.asarray(ref_lse)[fin]).max()) if fin.any() else 0.0
  print(f"D={d} {mask} s={s} skv={skv} dtype={jnp.dtype(dtype).name}: out rel sm90 {rel(out, ref):.2e} "
        f"sm80 {rel(out80, ref):.2e}; lse max err {lse_err:.2e}; -inf rows agree {same_inf}; "
        f"nan {bool(np.isnan(np.asarray(out, np.float32)).any())}", flush=True)


def timing(name, b, s, mean_doc, hq, hkv, d, window=None):
  rng = np.random.default_rng(0)
  rows = common.packed_rows(rng, b, s, mean_doc)
  seg, pos = common.segments_and_positions(rows, s)
  w = (window - 1, 0) if window else None
  pairs = common.allowed_pairs(rows, causal=True, window=w)
  flops = 4 * d * hq * pairs
  key = jax.random.PRNGKey(1)
  q = jax.random.normal(key, (b, s, hq, d), jnp.bfloat16)
  k = jax.random.normal(jax.random.fold_in(key, 1), (b, s, hkv, d), jnp.bfloat16)
  v = jax.random.normal(jax.random.fold_in(key, 2), (b, s, hkv, d), jnp.bfloat16)
  f = jax.jit(lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos),
                                              is_causal=True, local_window_size=w, implementation="cuda"))
  t90 = common.time_fn(f, q, k, v)
  os.environ["JAXCP_DISABLE_SM90"] = "1"
  t80 = common.time_fn(f, q, k, v)
  del os.environ["JAXCP_DISABLE_SM90"]
  import bench_attention as ba
  case = ba.Case(name, b, s, mean_doc, q_heads=hq, kv_heads=hkv, head_dim=d, window=window)
  t_cudnn = common.time_fn(jax.jit(ba._cudnn_packed(case, rows, jnp.bfloat16)), q, k, v)
  print(f"{name}: sm90 {flops / t90 / 1e12:.0f} TFLOP/s, sm80 {flops / t80 / 1e12:.0f}, "
        f"cudnn {flops / t_cudnn / 1e12:.0f}: sm90/cudnn {t_cudnn / t90:.2f}", flush=True)


if __name__ == "__main__":
  print(jax.devices())
  for d in (64, 128, 256):
    for mask in (dict(is_causal=True), dict(), dict(local_window_size=(37, 11)), dict(is_causal=True, chunk_size=100)):
      check(d, mask)
  check(128, dict(is_causal=True), dtype=jnp.float16)
  check(128, dict(), skv=333)
  check(128, dict(is_causal=True), hq=8, hkv=1)
  check(64, dict(is_causal=True), s=5)
  if "--no-timing" not in sys.argv:
    print(f"matmul {common.measure_matmul_tflops():.0f} TFLOP/s")
    timing("2x8k doc1k", 2, 8192, 1024, 16, 16, 128)
    timing("2x8k doc1k D64", 2, 8192, 1024, 16, 16, 64)
    timing("2x8k doc1k D256", 2, 8192, 1024, 16, 16, 256)
    timing("4x16k doc4k", 4, 16384, 4096, 16, 16, 128)
    timing("4x16k doc4k 32/8", 4, 16384, 4096, 32, 8, 128)
    timing("4x16k doc4k win1024", 4, 16384, 4096, 16, 16, 128, window=1024)
    timing("1x64k doc1k", 1, 65536, 1024, 16, 16, 128)
    timing("1x128k doc8k", 1, 131072, 8192, 16, 16, 128)
