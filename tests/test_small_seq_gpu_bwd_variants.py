"""GPU tests of the two CUDA small-seq backward kernels: the tensor-core backward ("mma", the
default) and the float32 CUDA-core backward ("cuda_core", chosen by
SmallSeqKernelOptions(cuda_core_bwd=True)).

Both must agree with each other and with the gradients of the pure-JAX reference: zero-length
rows (dq exactly zero), tokens no row attends (dk, dv exactly zero), clamped lengths / starts,
key masks, GQA groups (one and two head tiles, and over 16 heads, where the default falls back
to cuda_core), max_len 1..16 (one and two token tiles), head dims 64..512, bfloat16 and float16, and
float16 gradients whose dS would overflow float16 without the kernel's power-of-two scaling.
The saved probabilities of tokens not attended are NaN: the kernels must never use them.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcp._src import registry
from jaxcp._src.kernel_options import SmallSeqKernelOptions
from jaxcp._src.small_seq.primitive import SmallSeqConfig, local_bwd
from jaxcp._src.small_seq.reference import small_seq_reference

from .helpers import padded_small_seq_index, rand, rows_close, token_mask_bits

TOL = {jnp.bfloat16: 4e-2, jnp.float16: 8e-3}
PAIR_TOL = {jnp.bfloat16: 1e-2, jnp.float16: 3e-3}  # mma vs cuda_core: float32 sums, rounded once


def _backward(variant, q, k, v, probs, dout, index, config):
  """(dq, dk, dv) as float32 numpy arrays from the named backward kernel ("mma" or "cuda_core")."""
  config = dataclasses.replace(config, kernel=SmallSeqKernelOptions(cuda_core_bwd=variant == "cuda_core"))
  registry.ensure_registered()  # the kernel primitives are called directly
  grads = jax.jit(lambda *a: local_bwd(*a, config))(q, k, v, probs, dout, *index)
  return tuple(np.asarray(g, np.float32) for g in grads)


def _check(dtype, q, k, v, dout, index, config, valid):
  """Runs both kernels on the reference probabilities (NaN where not attended); valid: bool
  [B, max_len], the tokens each row attends."""
  probs = small_seq_reference(q, k, v, index, config)[1]
  _, pull = jax.vjp(lambda q, k, v: small_seq_reference(q, k, v, index, config)[0], q, k, v)
  ref = [np.asarray(jnp.asarray(g, jnp.float32)) for g in pull(dout)]
  probs = jnp.where(jnp.asarray(valid)[:, None, :], probs, jnp.nan)
  got = {name: _backward(name, q, k, v, probs, dout, index, config)
         for name in ("mma", "cuda_core")}
  empty = ~valid.any(axis=1)
  for name, grads in got.items():
    for what, g, w in zip(("dq", "dk", "dv"), grads, ref):
      rows_close(g, w, TOL[dtype], f"{name} {what}")
    np.testing.assert_array_equal(grads[0][empty], 0, err_msg=f"{name}: dq of rows without a token")
  for what, g, g1 in zip(("dq", "dk", "dv"), got["mma"], got["cuda_core"]):
    rows_close(g, g1, PAIR_TOL[dtype], f"mma vs cuda_core {what}")


def _padded_case(rng, dtype, d, s, hq, hkv, b, v_scale=1.0, dout_scale=1.0):
  q = rand(rng, (b, hq, d), dtype)
  k, v = rand(rng, (b, s, hkv, d), dtype), rand(rng, (b, s, hkv, d), dtype, v_scale)
  dout = rand(rng, (b, hq, d), dtype, dout_scale)
  lengths, mask, valid = padded_small_seq_index(rng, b, s)
  return q, k, v, dout, (jnp.asarray(lengths), jnp.asarray(mask)), valid


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,s,hq,hkv,b", [
    (jnp.bfloat16, 128, 16, 16, 4, 2000),  # the GQA benchmark shape
    (jnp.float16, 128, 16, 16, 4, 500),
    (jnp.bfloat16, 64, 16, 8, 8, 2000),
    (jnp.bfloat16, 256, 8, 8, 8, 1000),    # 8 tokens: one token tile
    (jnp.float16, 512, 11, 8, 2, 300),     # odd max_len over two token tiles
    (jnp.bfloat16, 512, 1, 4, 4, 300),
    (jnp.bfloat16, 128, 5, 6, 2, 1000),    # group 3, odd max_len
    (jnp.float16, 64, 1, 2, 2, 500),
    (jnp.bfloat16, 128, 16, 32, 2, 300),   # group 16: two head tiles
    (jnp.float16, 256, 5, 24, 2, 200),     # group 12: a partial second head tile
    (jnp.bfloat16, 128, 3, 64, 2, 200),    # group 32: cuda_core in both cases
])
def test_gpu_bwd_variants_padded(dtype, d, s, hq, hkv, b):
  rng = np.random.default_rng(41)
  q, k, v, dout, index, valid = _padded_case(rng, dtype, d, s, hq, hkv, b)
  _check(dtype, q, k, v, dout, index, SmallSeqConfig(d ** -0.5, s, False), valid)


@pytest.mark.gpu
@pytest.mark.parametrize("v_scale,dout_scale", [(3.0, 3e3), (1.0, 1e-3)])
def test_gpu_bwd_variants_f16_range(v_scale, dout_scale):
  """|dS| up to ~1e5, past float16's range (the gradients stay inside it), and small gradients
  (|dS| down to ~1e-8)."""
  rng = np.random.default_rng(42)
  q, k, v, dout, index, valid = _padded_case(rng, jnp.float16, 128, 16, 16, 4, 500, v_scale,
                                             dout_scale)
  config = SmallSeqConfig(128 ** -0.5, 16, False)
  _check(jnp.float16, q, k, v, dout, index, config, valid)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,hq,hkv", [(jnp.bfloat16, 128, 8, 8), (jnp.bfloat16, 64, 16, 4),
                                            (jnp.float16, 256, 6, 2), (jnp.bfloat16, 512, 4, 1),
                                            (jnp.float16, 128, 16, 1)])
def test_gpu_bwd_variants_ragged(dtype, d, hq, hkv):
  rng = np.random.default_rng(43)
  b = 600
  lens = rng.integers(0, 21, b)  # zero-length rows and rows over 16 tokens
  lens[5] = 20
  start = (5 + np.concatenate([[0], np.cumsum(lens)[:-1]])).astype(np.int32)  # 5 tokens before
  t = int(start[-2]) + 2  # row b - 2 runs past the last token
  length = lens.astype(np.int32)
  length[3], length[5], length[-2] = -4, 40, 9  # clamped into [0, 16], then [0, T - start]
  start[-1], length[-1] = t + 7, 5              # starts past the end: clamped to T, no token
  mask = np.full(b, -1, np.int32)
  mask[::7] = rng.integers(0, 1 << 16, len(mask[::7]))
  q = rand(rng, (b, hq, d), dtype)
  k, v = rand(rng, (t, hkv, d), dtype), rand(rng, (t, hkv, d), dtype)
  dout = rand(rng, (b, hq, d), dtype)
  config = SmallSeqConfig(0.7 * d ** -0.5, 16, True)
  st = np.clip(start, 0, t)
  ln = np.minimum(np.clip(length, 0, 16), t - st)
  valid = (np.arange(16)[None, :] < ln[:, None]) & token_mask_bits(mask, 16)
  index = tuple(jnp.asarray(x) for x in (start, length, mask))
  _check(dtype, q, k, v, dout, index, config, valid)


@pytest.mark.gpu
def test_gpu_bwd_variant_switch():
  """The kernel option really selects another kernel (their float32 sums differ in the last
  bits), and the default options run the tensor-core kernel."""
  rng = np.random.default_rng(44)
  b, s, hq, hkv, d = 2000, 16, 16, 4, 128
  q = rand(rng, (b, hq, d), jnp.bfloat16)
  k, v = rand(rng, (b, s, hkv, d), jnp.bfloat16), rand(rng, (b, s, hkv, d), jnp.bfloat16)
  dout = rand(rng, (b, hq, d), jnp.bfloat16)
  index = (jnp.full((b,), s, jnp.int32), jnp.full((b,), -1, jnp.int32))
  config = SmallSeqConfig(d ** -0.5, s, False)
  probs = small_seq_reference(q, k, v, index, config)[1]
  mma = _backward("mma", q, k, v, probs, dout, index, config)
  cuda_core = _backward("cuda_core", q, k, v, probs, dout, index, config)
  assert any(not np.array_equal(a, b) for a, b in zip(mma, cuda_core))
  default = jax.jit(lambda *a: local_bwd(*a, config))(q, k, v, probs, dout, *index)
  for a, b in zip(default, mma):
    np.testing.assert_array_equal(np.asarray(a, np.float32), b)


@pytest.mark.gpu
def test_gpu_bwd_million_rows():
  """2^20 rows (a large grid), both kernels, against the reference."""
  rng = np.random.default_rng(45)
  b, s, hq, hkv, d = 1 << 20, 2, 2, 1, 64
  q = rand(rng, (b, hq, d), jnp.bfloat16)
  k, v = rand(rng, (b, s, hkv, d), jnp.bfloat16), rand(rng, (b, s, hkv, d), jnp.bfloat16)
  dout = rand(rng, (b, hq, d), jnp.bfloat16)
  lengths = rng.integers(0, s + 1, b).astype(np.int32)
  mask = np.full(b, -1, np.int32)
  config = SmallSeqConfig(d ** -0.5, s, False)
  valid = np.arange(s)[None, :] < lengths[:, None]
  index = (jnp.asarray(lengths), jnp.asarray(mask))
  _check(jnp.bfloat16, q, k, v, dout, index, config, valid)
