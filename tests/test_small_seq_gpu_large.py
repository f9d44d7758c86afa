"""GPU tests of the small-seq CUDA kernels at batch sizes of many waves of blocks (one task, a
(row, kv head) pair, per warp), with tasks of different lengths (zero, clamped, masked, longer
than 16) side by side in a block.

Errors are checked row by row (a single wrong row would vanish in a whole-array norm), and
zero-length rows / uncovered key-value tokens must be exactly zero.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcp._src import registry
from jaxcp._src.small_seq.api import small_seq_attention
from jaxcp._src.small_seq.primitive import SmallSeqConfig, local_fwd
from jaxcp._src.small_seq.reference import small_seq_reference

from .helpers import rand, rows_close

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
GRAD_TOL = {jnp.bfloat16: 4e-2, jnp.float16: 8e-3}


def _vjp(fn, args, dout):
  out, pull = jax.vjp(fn, *args)
  return out, pull(dout)


def _cuda_matches_xla(f, q, k, v, dout, dtype):
  """f(impl) -> attention fn. Checks the CUDA output and gradients against XLA's, row by row;
  returns the CUDA (out, (dq, dk, dv))."""
  out, grads = jax.jit(lambda *a: _vjp(f("cuda"), a, dout))(q, k, v)
  rout, rgrads = jax.jit(lambda *a: _vjp(f("xla"), a, dout))(q, k, v)
  rows_close(out, rout, TOL[dtype], "out", rows_leading=True)
  for name, g, w in zip(("dq", "dk", "dv"), grads, rgrads):
    rows_close(g, w, GRAD_TOL[dtype], name, rows_leading=True)
  return out, grads


def _check_uncovered_zero(grads, cu, lens, max_len, t):
  """dK and dV are exactly zero on the tokens that no row i < len(lens) covers (row i: tokens
  cu[i] .. cu[i] + min(lens[i], max_len))."""
  covered = np.zeros(t, bool)
  for i, n in enumerate(lens):
    covered[cu[i]:cu[i] + min(int(n), max_len)] = True
  for g in grads[1:]:
    np.testing.assert_array_equal(np.asarray(g, np.float32)[~covered], 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,s,hq,hkv,b", [
    (jnp.bfloat16, 64, 8, 4, 2, 80000),     # ~90 tasks per warp: many 32-task windows
    (jnp.bfloat16, 64, 14, 2, 2, 60000),    # one head a task over 14 keys, lane groups walking many rows
    (jnp.bfloat16, 128, 16, 16, 4, 20000),  # GQA 4 (head block 4)
    (jnp.float16, 256, 8, 8, 8, 8000),
    (jnp.bfloat16, 128, 5, 6, 2, 30000),    # group 3 (head block 1)
    (jnp.bfloat16, 512, 16, 4, 2, 1500),    # the largest rows: few warps per SM
])
def test_gpu_many_tasks_padded(dtype, d, s, hq, hkv, b):
  rng = np.random.default_rng(21)
  q = rand(rng, (b, hq, d), dtype)
  k, v = rand(rng, (b, s, hkv, d), dtype), rand(rng, (b, s, hkv, d), dtype)
  dout = rand(rng, (b, hq, d), dtype)
  lengths = jnp.asarray(rng.integers(-2, s + 3, b), jnp.int32)  # out of range: clamped
  f = lambda impl: lambda q, k, v: small_seq_attention(q, k, v, kv_lengths=lengths,
                                                       implementation=impl)
  out, grads = _cuda_matches_xla(f, q, k, v, dout, dtype)
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
  q = rand(rng, (b, hq, d), dtype)
  k, v = rand(rng, (t, hkv, d), dtype), rand(rng, (t, hkv, d), dtype)
  dout = rand(rng, (b, hq, d), dtype)
  f = lambda impl: lambda q, k, v: small_seq_attention(q, k, v, kv_cu_seqlens=cu,
                                                       implementation=impl)
  out, grads = _cuda_matches_xla(f, q, k, v, dout, dtype)
  _check_uncovered_zero(grads, cu, lens, 16, t)


@pytest.mark.gpu
def test_gpu_many_tasks_probabilities_and_mask():
  rng = np.random.default_rng(23)
  b, s, hq, hkv, d = 30000, 11, 8, 2, 128
  q = rand(rng, (b, hq, d), jnp.bfloat16)
  k, v = rand(rng, (b, s, hkv, d), jnp.bfloat16), rand(rng, (b, s, hkv, d), jnp.bfloat16)
  lengths = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32)
  mask = jnp.asarray(rng.integers(0, 1 << s, b), jnp.int32)
  config = SmallSeqConfig(0.1, s, False)
  registry.ensure_registered()
  out, probs = jax.jit(lambda *a: local_fwd(*a, config))(q, k, v, lengths, mask)
  ref_out, ref_probs = small_seq_reference(q, k, v, (lengths, mask), config)
  np.testing.assert_allclose(probs, ref_probs, atol=2e-3)
  rows_close(out, ref_out, TOL[jnp.bfloat16], "out", rows_leading=True)


@pytest.mark.gpu
@pytest.mark.parametrize("max_kv_len,hq,hkv,d", [(4, 8, 8, 64),     # lane groups
                                                 (16, 8, 8, 128),   # tensor cores
                                                 (16, 32, 1, 64)])  # backward on CUDA cores
def test_gpu_ragged_decreasing_cu_seqlens(max_kv_len, hq, hkv, d):
  """kv_cu_seqlens that decreases half way: the rows from the decrease on are empty and the rows
  before it exact, dK/dV included. The empty rows' cu_seqlens fall inside the earlier rows: the
  backward zeroes the tokens between one row's end and the next row's start, which must not
  reach tokens a row covers."""
  rng = np.random.default_rng(24)
  b, dtype = 20000, jnp.bfloat16
  lens = rng.integers(0, max_kv_len + 3, b // 2)
  valid = np.concatenate([[3], 3 + np.cumsum(lens)])  # b // 2 rows, then the decrease
  cu = np.concatenate([valid, rng.integers(0, valid[-1], b - b // 2)]).astype(np.int32)
  t = int(valid[-1]) + 5
  q = rand(rng, (b, hq, d), dtype)
  k, v = rand(rng, (t, hkv, d), dtype), rand(rng, (t, hkv, d), dtype)
  dout = rand(rng, (b, hq, d), dtype)
  f = lambda impl: lambda q, k, v: small_seq_attention(q, k, v, kv_cu_seqlens=cu, max_kv_len=max_kv_len,
                                                       implementation=impl)
  out, grads = _cuda_matches_xla(f, q, k, v, dout, dtype)
  np.testing.assert_array_equal(np.asarray(out, np.float32)[b // 2:], 0)
  _check_uncovered_zero(grads, cu, lens, max_kv_len, t)
