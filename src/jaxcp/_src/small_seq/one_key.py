"""Rows of one key: the softmax over one allowed key is 1, so the output is that key's value (0
where the key is not allowed), dV is dO summed over the group's query heads, and dQ and dK are 0.
Written without Q and K, XLA's program moves V and the output only (the kernels and the generic
pure-JAX program read Q and K too, forward and backward, and save probabilities). One difference
from the softmax: a NaN or infinite q . k does not reach the output.

Ragged rows gather V at each row's first token. Autodiff would transpose that gather into a
scatter-add (0.23-0.26x XLA on H200); rows never overlap, so each token is the first token of at
most one allowed row, and the backward instead gathers dO through the inverse map (token ->
row), built by an int32 scatter of distinct indices."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .primitive import SmallSeqConfig
from .reference import with_defaults


def _group_broadcast(rows, hq: int):
  """[B, Hkv, D] -> [B, Hq, D]: each key/value head repeated for its group's query heads."""
  b, hkv, d = rows.shape
  return jnp.broadcast_to(rows[:, :, None, :], (b, hkv, hq // hkv, d)).reshape(b, hq, d)


def _ragged_first_tokens(index, batch: int, tokens: int):
  """(first token of each row, clamped into [0, tokens), bool [B] whether the row attends to it),
  with small_seq_reference's clamping of start and length."""
  start, length, mask = with_defaults(index, batch, 1)
  start = jnp.clip(start, 0, tokens)
  allowed = (jnp.minimum(jnp.clip(length, 0, 1), tokens - start) >= 1) & ((mask & 1) == 1)
  return jnp.minimum(start, tokens - 1), allowed


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_first_tokens(v, first, allowed, hq: int):
  """out [B, Hq, D]: v[first[b]] for each query head of the group where allowed, else 0."""
  rows = jnp.where(allowed[:, None, None], v[first], jnp.zeros((), v.dtype))
  return _group_broadcast(rows, hq)


def _gather_first_tokens_fwd(v, first, allowed, hq):
  # v is not saved: the backward needs only its shape [Tkv, Hkv], carried by a zero-size slice
  return _gather_first_tokens(v, first, allowed, hq), (first, allowed, v[:, :, :0])


def _gather_first_tokens_bwd(hq, residuals, dout):
  first, allowed, v_shape = residuals
  tokens, hkv = v_shape.shape[:2]
  b, _, d = dout.shape
  rows = jnp.arange(b, dtype=jnp.int32)
  # token -> the allowed row that starts there (b: none); disallowed rows aim past the end, each
  # at its own index, so every index is distinct and the scatter needs no atomics
  owner = jnp.full((tokens,), b, jnp.int32).at[jnp.where(allowed, first, tokens + rows)].set(
      rows, mode="drop", unique_indices=True)
  grouped = dout.astype(jnp.float32).reshape(b, hkv, hq // hkv, d).sum(axis=2).astype(dout.dtype)
  dv = jnp.where((owner < b)[:, None, None], grouped[jnp.minimum(owner, b - 1)], jnp.zeros((), dout.dtype))
  return dv, None, None


_gather_first_tokens.defvjp(_gather_first_tokens_fwd, _gather_first_tokens_bwd)


def one_key_attention(q, k, v, index, config: SmallSeqConfig):
  """small_seq_reference's output for rows of one key (max_len 1; k is not read)."""
  del k
  if config.max_len != 1:
    raise ValueError("one_key_attention takes rows of one key (max_len 1).")
  b, hq, _ = q.shape
  if config.ragged:
    first, allowed = _ragged_first_tokens(index, b, v.shape[0])
    return _gather_first_tokens(v, first, allowed, hq).astype(q.dtype)
  length, mask = with_defaults(index, b, 1)
  allowed = (length >= 1) & ((mask & 1) == 1)                       # [B]
  out = jnp.where(allowed[:, None, None], v[:, 0], jnp.zeros((), v.dtype))
  return _group_broadcast(out, hq).astype(q.dtype)
