"""GPU tests of the persistent small-seq CUDA kernels at batch sizes where every warp walks many
tasks: its shared-memory ring wraps around many times, it crosses several 32-task metadata
windows, and tasks of different lengths (zero, clamped, masked) share a ring.

Errors are checked row by row (a single wrong row would vanish in a whole-array norm), and
zero-length rows / uncovered key-value tokens must be exactly zero.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcp._src import registry
from jaxcp._src.small_seq import SmallSeqConfig, local_fwd, small_seq_attention, small_seq_reference

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
GRAD_TOL = {jnp.bfloat16: 4e-2, jnp.float16: 8e-3}


def _rand(rng, shape, dtype):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)


def _rows_close(got, want, tol, what):
  """Per-row relative error (rows = leading axis); rows whose reference is zero must be zero."""
  a = np.asarray(jnp.asarray(got, jnp.float32), np.float64).reshape(got.shape[0], -1)
  b = np.asarray(jnp.asarray(want, jnp.float32), np.float64).reshape(want.shape[0], -1)
  assert np.all(np.isfinite(a)), f"{what}: non-finite values"
  nb = np.linalg.norm(b, axis=1)
  floor = 0.1 * np.sqrt(np.mean(nb ** 2)) + 1e-30
  err = np.linalg.norm(a - b, axis=1) / np.maximum(nb, floor)
  worst = int(np.argmax(err))
  assert err[worst] < tol, f"{what}: row {worst} relative error {err[worst]:.3g} >= {tol}"
  zero_rows = nb == 0
  np.testing.assert_array_equal(a[zero_rows], 0, err_msg=f"{what}: rows that must be zero")


def _vjp(fn, args, dout):
  out, pull = jax.vjp(fn, *args)
  return out, pull(dout)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,s,hq,hkv,b", [
    (jnp.bfloat16, 64, 8, 4, 2, 80000),     # ~90 tasks per warp: many 32-task windows
    (jnp.bfloat16, 128, 16, 16, 4, 20000),  # GQA 4 (head block 4)
    (jnp.float16, 256, 8, 8, 8, 8000),
    (jnp.bfloat16, 128, 5, 6, 2, 30000),    # group 3 (head block 1)
    (jnp.bfloat16, 512, 16, 4, 2, 1500),    # the largest rows: few warps per SM
])
def test_gpu_many_tasks_padded(dtype, d, s, hq, hkv, b):
  rng = np.random.default_rng(21)
  q = _rand(rng, (b, hq, d), dtype)
  k, v = _rand(rng, (b, s, hkv, d), dtype), _rand(rng, (b, s, hkv, d), dtype)
  dout = _rand(rng, (b, hq, d), dtype)
  lengths = jnp.asarray(rng.integers(-2, s + 3, b), jnp.int32)  # out of range: clamped
  f = lambda impl: lambda q, k, v: small_seq_attention(q, k, v, kv_lengths=lengths,
                                                       implementation=impl)
  out, grads = jax.jit(lambda *a: _vjp(f("cuda"), a, dout))(q, k, v)
  rout, rgrads = jax.jit(lambda *a: _vjp(f("xla"), a, dout))(q, k, v)
  _rows_close(out, rout, TOL[dtype], "out")
  for name, g, w in zip(("dq", "dk", "dv"), grads, rgrads):
    _rows_close(g, w, GRAD_TOL[dtype], name)
  ln = np.clip(np.asarray(lengths), 0, s)
  np.testing.assert_array_equal(np.asarray(out, np.float32)[ln == 0], 0)
  dk = np.asarray(grads[1], np.float32)
  past = np.arange(s)[None, :] >= ln[:, None]  # tokens past each row's length
  np.testing.assert_array_equal(dk[past], 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,hq,hkv", [(jnp.bfloat16, 128, 8, 8), (jnp.bfloat16, 64, 8, 2),
                                            (jnp.float16, 128, 16, 4)])
def test_gpu_many_tasks_ragged(dtype, d, hq, hkv):
  rng = np.random.default_rng(22)
  b = 40000
  lens = rng.integers(0, 21, b)  # zero-length rows and rows longer than 16 (first 16 attended)
  cu = np.concatenate([[7], 7 + np.cumsum(lens)]).astype(np.int32)  # tokens before row 0
  t = int(cu[-1]) + 9  # and after the last row
  q = _rand(rng, (b, hq, d), dtype)
  k, v = _rand(rng, (t, hkv, d), dtype), _rand(rng, (t, hkv, d), dtype)
  dout = _rand(rng, (b, hq, d), dtype)
  f = lambda impl: lambda q, k, v: small_seq_attention(q, k, v, kv_cu_seqlens=cu,
                                                       implementation=impl)
  out, grads = jax.jit(lambda *a: _vjp(f("cuda"), a, dout))(q, k, v)
  rout, rgrads = jax.jit(lambda *a: _vjp(f("xla"), a, dout))(q, k, v)
  _rows_close(out, rout, TOL[dtype], "out")
  for name, g, w in zip(("dq", "dk", "dv"), grads, rgrads):
    _rows_close(g, w, GRAD_TOL[dtype], name)
  covered = np.zeros(t, bool)
  for i in range(b):
    covered[cu[i]:cu[i] + min(int(lens[i]), 16)] = True
  for g in grads[1:]:
    np.testing.assert_array_equal(np.asarray(g, np.float32)[~covered], 0)


@pytest.mark.gpu
def test_gpu_many_tasks_probabilities_and_mask():
  rng = np.random.default_rng(23)
  b, s, hq, hkv, d = 30000, 11, 8, 2, 128
  q = _rand(rng, (b, hq, d), jnp.bfloat16)
  k, v = _rand(rng, (b, s, hkv, d), jnp.bfloat16), _rand(rng, (b, s, hkv, d), jnp.bfloat16)
  lengths = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32)
  mask = jnp.asarray(rng.integers(0, 1 << s, b), jnp.int32)
  config = SmallSeqConfig(0.1, s, False)
  registry.ensure_registered()
  out, probs = jax.jit(lambda *a: local_fwd(*a, config))(q, k, v, lengths, mask)
  ref_out, ref_probs = small_seq_reference(q, k, v, (lengths, mask), config)
  np.testing.assert_allclose(probs, ref_probs, atol=2e-3)
  _rows_close(out, ref_out, TOL[jnp.bfloat16], "out")
