"""GPU tests of the CUDA small-seq forward kernel families (SmallSeqKernelOptions(fwd=...)): the
tensor-core forward ("mma"), the float32 CUDA-core forward ("cuda_core") and the lane-group forward
("lanes", where its registers hold the shape: small_seq/dispatch.py).

Each must agree with "mma" and with the pure-JAX reference: outputs, saved probabilities,
zero-length rows (output and probabilities exactly zero), clamped lengths / starts, key masks,
GQA groups (also over 16 heads: several head tiles), head dims 64..512, bfloat16 and float16.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcp._src import registry
from jaxcp._src.kernel_options import SmallSeqKernelOptions
from jaxcp._src.small_seq import dispatch
from jaxcp._src.small_seq.primitive import SmallSeqConfig, local_fwd
from jaxcp._src.small_seq.reference import small_seq_reference

from .helpers import padded_small_seq_index, rand, rows_close, token_mask_bits

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
PAIR_TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}  # family vs mma: float32 sums, rounded once


def _families(q, k, config):
  """The forward families that can run this shape, "mma" first."""
  g, d = q.shape[1] // k.shape[-2], q.shape[-1]
  return [f for f in ("mma", "cuda_core", "lanes") if dispatch.available("fwd", f, g, d, config.max_len)]


def _forward(variant, q, k, v, index, config):
  """(out, probs) as float32 numpy arrays from the named forward kernel family."""
  config = dataclasses.replace(config, kernel=SmallSeqKernelOptions(fwd=variant))
  registry.ensure_registered()  # the kernel primitives are called directly
  out, probs = jax.jit(lambda *a: local_fwd(*a, config))(q, k, v, *index)
  return np.asarray(out, np.float32), np.asarray(probs)


def _check(dtype, q, k, v, index, config, valid):
  """Runs every family that fits; valid: bool [B, max_len], the tokens each row attends."""
  ref_out, ref_probs = small_seq_reference(q, k, v, index, config)
  ref_out, ref_probs = np.asarray(ref_out, np.float32), np.asarray(ref_probs)
  got = {name: _forward(name, q, k, v, index, config) for name in _families(q, k, config)}
  empty = ~valid.any(axis=1)
  for name, (out, probs) in got.items():
    rows_close(out, ref_out, TOL[dtype], f"{name} out")
    np.testing.assert_allclose(probs, ref_probs, atol=2e-3, err_msg=f"{name} probs")
    np.testing.assert_array_equal(probs[np.broadcast_to(~valid[:, None, :], probs.shape)], 0,
                                  err_msg=f"{name}: probabilities of tokens not attended")
    np.testing.assert_array_equal(out[empty], 0, err_msg=f"{name}: rows without a token")
  out, probs = got.pop("mma")
  for name, (out1, probs1) in got.items():
    rows_close(out, out1, PAIR_TOL[dtype], f"mma vs {name} out")
    np.testing.assert_allclose(probs, probs1, atol=5e-5, rtol=0, err_msg=f"mma vs {name} probs")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,s,hq,hkv,b", [
    (jnp.bfloat16, 128, 16, 16, 4, 3000),  # the GQA benchmark shape
    (jnp.bfloat16, 64, 16, 8, 8, 2000),
    (jnp.bfloat16, 256, 8, 8, 8, 1000),    # 8 tokens: one token tile
    (jnp.float16, 512, 11, 8, 2, 300),     # odd max_len over two token tiles
    (jnp.bfloat16, 512, 4, 4, 4, 300),
    (jnp.bfloat16, 128, 5, 6, 2, 1000),    # group 3, odd max_len
    (jnp.float16, 64, 1, 2, 2, 500),
    (jnp.bfloat16, 128, 3, 64, 2, 200),    # group 32: two head tiles
    (jnp.float16, 256, 16, 40, 2, 100),    # group 20: a partial second head tile
    (jnp.bfloat16, 64, 12, 4, 2, 1000),    # lanes: group 2, 12 keys in its 12-token registers
    (jnp.float16, 128, 10, 3, 3, 999),     # lanes: 10 keys in its 12-token registers
    (jnp.bfloat16, 64, 14, 2, 1, 700),     # lanes: group 2, 14 keys in its 16-token registers
    (jnp.float16, 512, 8, 2, 2, 300),      # lanes: D 512 (two chunks per lane), 8 keys
    (jnp.bfloat16, 256, 2, 1, 1, 1000),    # lanes: one head, one lane group per warp
    (jnp.float16, 256, 13, 1, 1, 800),     # lanes: one head over 13 keys, V loaded into K's registers
    (jnp.bfloat16, 512, 16, 2, 2, 300),    # lanes: one head over 16 keys at D 512, 8 tokens a register set
    (jnp.float16, 512, 11, 1, 1, 500),     # lanes: one head over 11 keys at D 512, 6 tokens a register set
    (jnp.bfloat16, 128, 7, 3, 3, 999),     # lanes: two tasks per warp, the last warp half empty
])
def test_gpu_fwd_variants_padded(dtype, d, s, hq, hkv, b):
  rng = np.random.default_rng(31)
  q = rand(rng, (b, hq, d), dtype)
  k, v = rand(rng, (b, s, hkv, d), dtype), rand(rng, (b, s, hkv, d), dtype)
  lengths, mask, valid = padded_small_seq_index(rng, b, s)
  config = SmallSeqConfig(d ** -0.5, s, False)
  _check(dtype, q, k, v, (jnp.asarray(lengths), jnp.asarray(mask)), config, valid)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,hq,hkv", [(jnp.bfloat16, 128, 8, 8), (jnp.bfloat16, 64, 16, 4),
                                            (jnp.float16, 256, 6, 2), (jnp.bfloat16, 512, 4, 1)])
def test_gpu_fwd_variants_ragged(dtype, d, hq, hkv):
  rng = np.random.default_rng(32)
  b = 700
  lens = rng.integers(0, 21, b)  # zero-length rows and rows over 16 tokens
  start = (5 + np.concatenate([[0], np.cumsum(lens)[:-1]])).astype(np.int32)
  t = int(start[-1] + lens[-1]) + 3
  length = lens.astype(np.int32)
  length[3], start[4], length[5] = -4, t + 7, 40  # clamped: into [0, 16], [0, T], [0, T - start]
  start[6], length[6] = t - 2, 9                  # runs past the last token
  mask = np.full(b, -1, np.int32)
  mask[::7] = rng.integers(0, 1 << 16, len(mask[::7]))
  q = rand(rng, (b, hq, d), dtype)
  k, v = rand(rng, (t, hkv, d), dtype), rand(rng, (t, hkv, d), dtype)
  config = SmallSeqConfig(0.7 * d ** -0.5, 16, True)
  st = np.clip(start, 0, t)
  ln = np.minimum(np.clip(length, 0, 16), t - st)
  valid = (np.arange(16)[None, :] < ln[:, None]) & token_mask_bits(mask, 16)
  index = tuple(jnp.asarray(x) for x in (start, length, mask))
  _check(dtype, q, k, v, index, config, valid)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(16, 4), (8, 8)])
def test_gpu_fwd_variant_switch(hq, hkv):
  """The kernel option really selects another kernel (their float32 sums differ in the last
  bits), and the default options run the family dispatch.py names for the shape."""
  rng = np.random.default_rng(33)
  b, s, d = 2000, 16, 128
  q = rand(rng, (b, hq, d), jnp.bfloat16)
  k, v = rand(rng, (b, s, hkv, d), jnp.bfloat16), rand(rng, (b, s, hkv, d), jnp.bfloat16)
  index = (jnp.full((b,), s, jnp.int32), jnp.full((b,), -1, jnp.int32))
  config = SmallSeqConfig(d ** -0.5, s, False)
  probs = {f: _forward(f, q, k, v, index, config)[1] for f in _families(q, k, config)}
  for f in probs:
    if f != "mma":
      assert not np.array_equal(probs[f], probs["mma"]), f
  probs0 = np.asarray(jax.jit(lambda *a: local_fwd(*a, config))(q, k, v, *index)[1])
  np.testing.assert_array_equal(probs0, probs[dispatch.default_fwd(hq // hkv, d, s)])


@pytest.mark.gpu
def test_gpu_fwd_million_rows():
  """2^20 rows (a large grid), every family, against the reference."""
  rng = np.random.default_rng(34)
  b, s, hq, hkv, d = 1 << 20, 2, 2, 1, 64
  q = rand(rng, (b, hq, d), jnp.bfloat16)
  k, v = rand(rng, (b, s, hkv, d), jnp.bfloat16), rand(rng, (b, s, hkv, d), jnp.bfloat16)
  lengths = rng.integers(0, s + 1, b).astype(np.int32)
  mask = np.full(b, -1, np.int32)
  config = SmallSeqConfig(d ** -0.5, s, False)
  valid = np.arange(s)[None, :] < lengths[:, None]
  index = (jnp.asarray(lengths), jnp.asarray(mask))
  _check(jnp.bfloat16, q, k, v, index, config, valid)
