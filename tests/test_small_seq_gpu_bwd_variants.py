"""GPU tests of the CUDA small-seq backward kernel families (SmallSeqKernelOptions(bwd=...)): the
tensor-core backward ("mma", groups up to 16 heads), the float32 CUDA-core backward ("cuda_core")
and the lane-group backward ("lanes": groups of 1 or 2 heads whose K/V fit its registers, larger
groups up to 4 keys at D <= 256, their heads streamed through one lane group).

Each must agree with "cuda_core" and with the gradients of the pure-JAX reference: zero-length
rows (dq exactly zero), tokens no row attends (dk, dv exactly zero), clamped lengths / starts,
key masks, GQA groups (one and two head tiles, and over 16 heads, where mma does not run), max_len 1..16 (one and two token tiles), head dims 64..512, bfloat16 and float16, and
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
from jaxcp._src.small_seq import dispatch
from jaxcp._src.small_seq.primitive import SmallSeqConfig, local_bwd
from jaxcp._src.small_seq.reference import small_seq_reference

from .helpers import padded_small_seq_index, rand, rows_close, token_mask_bits

TOL = {jnp.bfloat16: 4e-2, jnp.float16: 8e-3}
PAIR_TOL = {jnp.bfloat16: 1e-2, jnp.float16: 3e-3}  # family vs cuda_core: float32 sums, rounded once


def _families(q, k, config):
  """The backward families that can run this shape, "cuda_core" (every shape) first."""
  g, d = q.shape[1] // k.shape[-2], q.shape[-1]
  return [f for f in ("cuda_core", "mma", "lanes") if dispatch.available("bwd", f, g, d, config.max_len)]


def _backward(variant, q, k, v, probs, dout, index, config):
  """(dq, dk, dv) as float32 numpy arrays from the named backward kernel family."""
  config = dataclasses.replace(config, kernel=SmallSeqKernelOptions(bwd=variant))
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
  got = {name: _backward(name, q, k, v, probs, dout, index, config) for name in _families(q, k, config)}
  empty = ~valid.any(axis=1)
  for name, grads in got.items():
    for what, g, w in zip(("dq", "dk", "dv"), grads, ref):
      rows_close(g, w, TOL[dtype], f"{name} {what}")
    np.testing.assert_array_equal(grads[0][empty], 0, err_msg=f"{name}: dq of rows without a token")
  base = got.pop("cuda_core")
  for name, grads in got.items():
    for what, g, g1 in zip(("dq", "dk", "dv"), base, grads):
      rows_close(g1, g, PAIR_TOL[dtype], f"cuda_core vs {name} {what}")


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
    (jnp.bfloat16, 128, 3, 64, 2, 200),    # group 32: cuda_core and lanes (not mma)
    (jnp.bfloat16, 64, 12, 4, 2, 1000),    # lanes: group 2, 12 keys in its 12-token registers
    (jnp.float16, 128, 10, 3, 3, 999),     # lanes: 10 keys in its 12-token registers
    (jnp.bfloat16, 64, 14, 2, 1, 700),     # lanes: group 2, 14 keys in its 16-token registers
    (jnp.float16, 512, 8, 2, 2, 300),      # lanes: D 512 (two chunks per lane), 8 keys
    (jnp.bfloat16, 256, 2, 1, 1, 1000),    # lanes: one head, one lane group per warp
    (jnp.bfloat16, 64, 16, 4, 4, 1000),    # lanes: one head over 16 keys in its 16-token registers
    (jnp.bfloat16, 128, 7, 3, 3, 999),     # lanes: two tasks per warp, the last warp half empty
    (jnp.bfloat16, 64, 4, 16, 4, 1000),    # lanes, group 4: four tasks per warp, heads streamed
    (jnp.float16, 128, 3, 9, 3, 999),      # lanes, group 3, odd max_len, the last warp half empty
    (jnp.float16, 256, 2, 24, 2, 300),     # lanes, group 12, one lane group per warp
    (jnp.bfloat16, 64, 1, 32, 4, 500),     # lanes, group 8, one key
])
def test_gpu_bwd_variants_padded(dtype, d, s, hq, hkv, b):
  rng = np.random.default_rng(41)
  q, k, v, dout, index, valid = _padded_case(rng, dtype, d, s, hq, hkv, b)
  _check(dtype, q, k, v, dout, index, SmallSeqConfig(d ** -0.5, s, False), valid)


@pytest.mark.gpu
@pytest.mark.parametrize("v_scale,dout_scale,s", [(3.0, 3e3, 16), (1.0, 1e-3, 16), (3.0, 3e3, 4)])
def test_gpu_bwd_variants_f16_range(v_scale, dout_scale, s):
  """|dS| up to ~1e5, past float16's range (the gradients stay inside it), and small gradients
  (|dS| down to ~1e-8); 4 keys: the lane-group backward of a group of 4 too."""
  rng = np.random.default_rng(42)
  q, k, v, dout, index, valid = _padded_case(rng, jnp.float16, 128, s, 16, 4, 500, v_scale,
                                             dout_scale)
  config = SmallSeqConfig(128 ** -0.5, s, False)
  _check(jnp.float16, q, k, v, dout, index, config, valid)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,hq,hkv,s", [(jnp.bfloat16, 128, 8, 8, 16), (jnp.bfloat16, 64, 16, 4, 16),
                                              (jnp.float16, 256, 6, 2, 16), (jnp.bfloat16, 512, 4, 1, 16),
                                              (jnp.float16, 128, 16, 1, 16), (jnp.bfloat16, 64, 16, 4, 4),
                                              (jnp.float16, 256, 6, 2, 3)])
def test_gpu_bwd_variants_ragged(dtype, d, hq, hkv, s):
  rng = np.random.default_rng(43)
  b = 600
  lens = rng.integers(0, s + 5, b)  # zero-length rows and rows over s tokens
  lens[5] = s + 4
  start = (5 + np.concatenate([[0], np.cumsum(lens)[:-1]])).astype(np.int32)  # 5 tokens before
  t = int(start[-2]) + 2  # row b - 2 runs past the last token
  length = lens.astype(np.int32)
  length[3], length[5], length[-2] = -4, 40, 9  # clamped into [0, s], then [0, T - start]
  start[-1], length[-1] = t + 7, 5              # starts past the end: clamped to T, no token
  mask = np.full(b, -1, np.int32)
  mask[::7] = rng.integers(0, 1 << 16, len(mask[::7]))
  q = rand(rng, (b, hq, d), dtype)
  k, v = rand(rng, (t, hkv, d), dtype), rand(rng, (t, hkv, d), dtype)
  dout = rand(rng, (b, hq, d), dtype)
  config = SmallSeqConfig(0.7 * d ** -0.5, s, True)
  st = np.clip(start, 0, t)
  ln = np.minimum(np.clip(length, 0, s), t - st)
  valid = (np.arange(s)[None, :] < ln[:, None]) & token_mask_bits(mask, s)
  index = tuple(jnp.asarray(x) for x in (start, length, mask))
  _check(dtype, q, k, v, dout, index, config, valid)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(16, 4), (8, 8)])
def test_gpu_bwd_variant_switch(hq, hkv):
  """The kernel option really selects another kernel (their float32 sums differ in the last
  bits), and the default options run the family dispatch.py names for the shape."""
  rng = np.random.default_rng(44)
  b, s, d = 2000, 16, 128
  q = rand(rng, (b, hq, d), jnp.bfloat16)
  k, v = rand(rng, (b, s, hkv, d), jnp.bfloat16), rand(rng, (b, s, hkv, d), jnp.bfloat16)
  dout = rand(rng, (b, hq, d), jnp.bfloat16)
  index = (jnp.full((b,), s, jnp.int32), jnp.full((b,), -1, jnp.int32))
  config = SmallSeqConfig(d ** -0.5, s, False)
  probs = small_seq_reference(q, k, v, index, config)[1]
  got = {f: _backward(f, q, k, v, probs, dout, index, config) for f in _families(q, k, config)}
  for f in got:
    if f != "cuda_core":
      assert any(not np.array_equal(a, b) for a, b in zip(got[f], got["cuda_core"])), f
  default = jax.jit(lambda *a: local_bwd(*a, config))(q, k, v, probs, dout, *index)
  for a, b in zip(default, got[dispatch.default_bwd(hq // hkv, d, s)]):
    np.testing.assert_array_equal(np.asarray(a, np.float32), b)


@pytest.mark.gpu
def test_gpu_bwd_million_rows():
  """2^20 rows (a large grid), every family, against the reference."""
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
