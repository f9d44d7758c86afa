"""Padded rows of one key: the softmax over one allowed key is 1, so the output is that key's
value (0 where the key is not allowed), dV is dO summed over the group's query heads, and dQ and
dK are 0. Written without Q and K, XLA's program moves V and the output only (the generic
pure-JAX program reads Q and K too, forward and backward). One difference from the softmax: a NaN
or infinite q . k does not reach the output."""
from __future__ import annotations

import jax.numpy as jnp

from .primitive import SmallSeqConfig
from .reference import with_defaults


def one_key_attention(q, k, v, index, config: SmallSeqConfig):
  """small_seq_reference's output for padded rows with max_len 1 (k is not read)."""
  del k
  if config.ragged or config.max_len != 1:
    raise ValueError("one_key_attention takes padded rows of one key (max_len 1).")
  b, hq, d = q.shape
  length, mask = with_defaults(index, b, 1)
  hkv = v.shape[2]
  allowed = (length >= 1) & ((mask & 1) == 1)                       # [B]
  value = jnp.broadcast_to(v[:, 0, :, None, :], (b, hkv, hq // hkv, d)).reshape(b, hq, d)
  return jnp.where(allowed[:, None, None], value, jnp.zeros((), v.dtype)).astype(q.dtype)
