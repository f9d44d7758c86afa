"""Pure-JAX semantics of the small-seq kernels (same clamping), for tests and implementation="xla"."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .primitive import SmallSeqConfig, is_default

def _reference_core(q, kg, vg, valid, scale):
  """q [B,Hq,D], kg/vg [B,M,Hkv,D], valid bool [B,M] -> (out [B,Hq,D], probs f32 [B,Hq,M])."""
  b, hq, d = q.shape
  m_len, hkv = kg.shape[1], kg.shape[2]
  qc = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
  s = jnp.einsum("bhgd,bjhd->bhgj", qc, kg.astype(jnp.float32)) * jnp.float32(scale)
  s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1.0)
  out = jnp.einsum("bhgj,bjhd->bhgd", p, vg.astype(jnp.float32)).reshape(b, hq, d)
  return out.astype(q.dtype), p.reshape(b, hq, m_len)


def _mask_bits(mask, m_len):
  j = jnp.arange(m_len, dtype=jnp.int32)
  return ((mask[:, None] >> j) & 1) == 1


def with_defaults(index, batch: int, max_len: int):
  """The index arrays with the empty ones (primitive.default_index) made explicit: lengths
  max_len, masks of every token (the padded layout's starts are not in the index)."""
  fill = lambda x, value: jnp.full((batch,), value, jnp.int32) if is_default(x) else x
  *start, length, mask = index
  return (*start, fill(length, max_len), fill(mask, -1))


def small_seq_reference(q, k, v, index, config: SmallSeqConfig):
  """Pure-JAX semantics of the kernels (same clamping), for tests and implementation="xla"."""
  m_len = config.max_len
  index = with_defaults(index, q.shape[0], m_len)
  j = jnp.arange(m_len, dtype=jnp.int32)
  if config.ragged:
    start, length, mask = index
    t = k.shape[0]
    start = jnp.clip(start, 0, t)
    length = jnp.minimum(jnp.clip(length, 0, m_len), t - start)
    idx = jnp.clip(start[:, None] + j, 0, t - 1)
    kg, vg = k[idx], v[idx]
  else:
    length, mask = index
    length = jnp.clip(length, 0, m_len)
    kg, vg = k, v
  valid = (j < length[:, None]) & _mask_bits(mask, m_len)
  return _reference_core(q, kg, vg, valid, config.scale)
