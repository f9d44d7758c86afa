"""Quick check of the sm_90a forward kernel against the sm_80 one and the XLA reference, plus a
forward timing of both on a few benchmark shapes (a development aid; tests/test_gpu_attention.py
is the real test).   python tools/sm90_smoke.py [--no-timing | --timing-only]

The checks compare the sm_90a kernel (the default on Hopper) with the sm_80 one
(JAXCP_DISABLE_SM90=1) on every mask and head dim; the timings show both side by side, which is
how the dispatch rule (fwd_use_sm90) is measured."""
import contextlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import common  # noqa: E402

import jaxcp  # noqa: E402


@contextlib.contextmanager
def env(**values):
  """Sets environment variables (the FFI handlers read them per call) for the duration."""
  old = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


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


def check(d, mask, b=2, s=700, hq=4, hkv=2, dtype=jnp.bfloat16, skv=None, max_doc=300, fixed_tiles=False):
  skv = skv or s
  rng = np.random.default_rng(0)
  q, k, v = random_inputs(d, b, s, skv, hq, hkv, dtype)
  kw = dict(mask)
  if skv == s:
    lengths = [list(rng.integers(1, max_doc, 8)) for _ in range(b)]
    seg = np.zeros((b, s), np.int32)
    for r, ls in enumerate(lengths):
      pos = 0
      for i, n in enumerate(ls):
        seg[r, pos:pos + n] = i + 1
        pos += n
        if pos >= s:
          break
    kw["segment_ids"] = jnp.asarray(seg)
  with env(JAXCP_FWD_FIXED_TILES="1" if fixed_tiles else "0"):
    out, lse = fwd(q, k, v, **kw)
  with env(JAXCP_DISABLE_SM90="1"):
    out80, lse80 = fwd(q, k, v, **kw)
  ref, ref_lse = jax.jit(lambda q, k, v: jaxcp.attention(q, k, v, implementation="xla", return_residual=True, **kw))(q, k, v)
  fin = np.isfinite(np.asarray(ref_lse))
  same_inf = bool((np.isneginf(np.asarray(lse)) == np.isneginf(np.asarray(ref_lse))).all())
  lse_err = float(np.abs(np.asarray(lse)[fin] - np.asarray(ref_lse)[fin]).max()) if fin.any() else 0.0
  print(f"D={d} {mask} s={s} skv={skv}{' fixed tiles' if fixed_tiles else ''} dtype={jnp.dtype(dtype).name}: out rel sm90 {rel(out, ref):.2e} "
        f"sm80 {rel(out80, ref):.2e}; lse max err {lse_err:.2e}; -inf rows agree {same_inf}; "
        f"nan {bool(np.isnan(np.asarray(out, np.float32)).any())}", flush=True)


def timing(name, b, s, mean_doc, hq, hkv, d, window=None, chunk=None):
  rng = np.random.default_rng(0)
  rows = common.packed_rows(rng, b, s, mean_doc)
  seg, pos = common.segments_and_positions(rows, s)
  w = (window - 1, 0) if window else None
  pairs = common.allowed_pairs(rows, causal=True, window=w, chunk=chunk)
  flops = 4 * d * hq * pairs
  key = jax.random.PRNGKey(1)
  q = jax.random.normal(key, (b, s, hq, d), jnp.bfloat16)
  k = jax.random.normal(jax.random.fold_in(key, 1), (b, s, hkv, d), jnp.bfloat16)
  v = jax.random.normal(jax.random.fold_in(key, 2), (b, s, hkv, d), jnp.bfloat16)
  f = jax.jit(lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos),
                                              is_causal=True, local_window_size=w, chunk_size=chunk,
                                              implementation="cuda"))
  t90 = common.time_fn(f, q, k, v)
  with env(JAXCP_DISABLE_SM90="1"):
    t80 = common.time_fn(f, q, k, v)
  import bench_attention as ba
  case = ba.Case(name, b, s, mean_doc, q_heads=hq, kv_heads=hkv, head_dim=d, window=window, chunk=chunk)
  cudnn = ba._cudnn_packed(case, rows, jnp.bfloat16)
  t_cudnn = common.time_fn(jax.jit(cudnn), q, k, v) if cudnn else float("nan")
  tf = lambda t: flops / t / 1e12  # noqa: E731
  print(f"{name}: sm90 {tf(t90):.0f} TFLOP/s, sm80 {tf(t80):.0f}, cudnn {tf(t_cudnn):.0f}: "
        f"sm90/sm80 {t80 / t90:.2f}, sm90/cudnn {t_cudnn / t90:.2f}", flush=True)


if __name__ == "__main__":
  print(jax.devices())
  checks = "--timing-only" not in sys.argv
  for d in (64, 128, 256) if checks else ():
    for mask in (dict(is_causal=True), dict(), dict(local_window_size=(37, 11)), dict(is_causal=True, chunk_size=100)):
      check(d, mask)
  if checks:
    check(128, dict(is_causal=True), dtype=jnp.float16)
    check(128, dict(), skv=333)
    check(128, dict(is_causal=True), hq=8, hkv=1)
    check(64, dict(is_causal=True), s=5)
    check(128, dict(is_causal=True), fixed_tiles=True)
    check(128, dict(local_window_size=(37, 11)), fixed_tiles=True)
    # More query tiles than multiprocessors: each persistent CTA runs several tiles, empty ones too.
    for d in (64, 128, 256):
      check(d, dict(is_causal=True), s=6000, hq=8, hkv=2, max_doc=1400)
    check(128, dict(local_window_size=(300, 0)), s=6000, hq=8, hkv=2, max_doc=1400)
    check(128, dict(is_causal=True, chunk_size=512), b=3, s=9000, hq=6, hkv=6, max_doc=3000)
  if "--no-timing" not in sys.argv:
    print(f"matmul {common.measure_matmul_tflops():.0f} TFLOP/s")
    timing("2x8k doc1k", 2, 8192, 1024, 16, 16, 128)
    timing("2x8k doc1k D64", 2, 8192, 1024, 16, 16, 64)
    timing("2x8k doc1k D256", 2, 8192, 1024, 16, 16, 256)
    timing("4x16k doc4k", 4, 16384, 4096, 16, 16, 128)
    timing("4x16k doc4k 32/8", 4, 16384, 4096, 32, 8, 128)
    timing("4x16k doc4k win1024", 4, 16384, 4096, 16, 16, 128, window=1024)
    timing("4x16k doc4k win256", 4, 16384, 4096, 16, 16, 128, window=256)
    timing("4x16k doc4k chunk2048", 4, 16384, 4096, 16, 16, 128, chunk=2048)
    timing("4x16k doc4k D64", 4, 16384, 4096, 16, 16, 64)
    timing("1x64k doc1k", 1, 65536, 1024, 16, 16, 128)
    timing("1x128k doc8k", 1, 131072, 8192, 16, 16, 128)
