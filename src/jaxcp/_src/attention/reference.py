"""Pure-JAX reference attention ("xla" implementation): materialises the mask and scores.

It defines the semantics every kernel is tested against. Memory is O(B*H*Sq*Skv), so use it
for tests and small shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..mask_spec import MaskSpec
from ..masks import allowed_pairs


def attention_reference(q, k, v, q_seg, q_pos, kv_seg, kv_pos, spec: MaskSpec, scale: float,
                        compute_dtype=jnp.float32):
  """Returns (out [B,Sq,Hq,Dv] in q.dtype, lse float32 [B,Hq,Sq]); Dv is v's head dim.

  Rows with no allowed key give out 0 and lse -inf, and their gradients are zero (no NaN).
  """
  B, Sq, Hq, D = q.shape
  Hkv = k.shape[2]
  G = Hq // Hkv
  qc = q.astype(compute_dtype).reshape(B, Sq, Hkv, G, D)
  kc, vc = k.astype(compute_dtype), v.astype(compute_dtype)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qc, kc) * jnp.asarray(scale, compute_dtype)
  mask = allowed_pairs(q_seg, q_pos, kv_seg, kv_pos, spec)[:, None, None]
  s = jnp.where(mask, s, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)  # masked entries: exp(-inf) = 0 with zero gradient
  l = jnp.sum(p, axis=-1, keepdims=True)
  has_key = l > 0
  l_safe = jnp.where(has_key, l, 1.0)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", p / l_safe, vc).reshape(B, Sq, Hq, v.shape[3])
  lse = jnp.where(has_key, m + jnp.log(l_safe), -jnp.inf)[..., 0].reshape(B, Hq, Sq)
  return out.astype(q.dtype), lse.astype(jnp.float32)
