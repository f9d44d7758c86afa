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


# XLA moves these rows of 16-bit values at 60-90% of a copy's bandwidth, and as 32-bit pairs at
# 92-113% (H200, B = 262144-1048576: broadcast to a group of 4 heads 63% -> 111%, gathers of one
# head 87-90% -> 107-113%). So the gathers and broadcasts below move bitcast pairs, from this many
# rows: at B = 16384 (a few microseconds a call, timings that move between runs) they were not
# measured faster.
PAIRS_MIN_ROWS = 65536


def _as_pairs(x, pairs: bool = True):
  """[..., D] of a 16-bit dtype with D even -> [..., D / 2] uint32 (bit for bit); else (or
  without `pairs`) x."""
  if not pairs or jnp.dtype(x.dtype).itemsize != 2 or x.shape[-1] % 2:
    return x
  return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint32)


def _from_pairs(u, like):
  """_as_pairs undone: `u` back in the dtype of `like`."""
  if u.dtype == like.dtype:
    return u
  return jax.lax.bitcast_convert_type(u, like.dtype).reshape(*u.shape[:-1], u.shape[-1] * 2)


def _rows_where(allowed, rows):
  """rows [B, H, W] where allowed [B], else zeros."""
  return jnp.where(allowed[:, None, None], rows, jnp.zeros((), rows.dtype))


def _group_broadcast(rows, hq: int):
  """[B, Hkv, W] -> [B, Hq, W]: each key/value head repeated for its group's query heads."""
  b, hkv, w = rows.shape
  return jnp.broadcast_to(rows[:, :, None, :], (b, hkv, hq // hkv, w)).reshape(b, hq, w)


def _spread(rows, allowed, hq: int, like):
  """rows [B, Hkv, W] (pairs or not) where allowed, repeated for each group's query heads, in
  the dtype of `like`."""
  return _from_pairs(_group_broadcast(_rows_where(allowed, rows), hq), like)


def _group_sum(dout, hkv: int):
  """[B, Hq, D] -> [B, Hkv, D]: the sum over each group's query heads, in float32, head by head.
  As adds of slices XLA fuses it into one elementwise loop; as a reduction over the middle axis
  the padded forward+backward took 7-10% longer at groups of 4 (H200, 4/1 heads, D 64 and 128, B =
  262144 and 1048576; level at 8/2 heads of 128, 16/4 of 64 and on ragged rows)."""
  b, hq, d = dout.shape
  heads = dout.reshape(b, hkv, hq // hkv, d)
  total = heads[:, :, 0].astype(jnp.float32)
  for g in range(1, hq // hkv):
    total = total + heads[:, :, g].astype(jnp.float32)
  return total.astype(dout.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _broadcast_rows(rows, allowed, hq: int, pairs: bool):
  """out [B, Hq, D]: rows [B, Hkv, D] for each query head of the group where allowed, else 0
  (moved as 32-bit pairs, which autodiff cannot see through: hence the custom VJP)."""
  return _spread(_as_pairs(rows, pairs), allowed, hq, rows)


def _broadcast_rows_fwd(rows, allowed, hq, pairs):
  return _broadcast_rows(rows, allowed, hq, pairs), (allowed, rows[:, :, :0])


def _broadcast_rows_bwd(hq, pairs, residuals, dout):
  allowed, rows_shape = residuals
  return _rows_where(allowed, _group_sum(dout, rows_shape.shape[1])), None


_broadcast_rows.defvjp(_broadcast_rows_fwd, _broadcast_rows_bwd)


def _ragged_first_tokens(index, batch: int, tokens: int):
  """(first token of each row, clamped into [0, tokens), bool [B] whether the row attends to it),
  with small_seq_reference's clamping of start and length."""
  start, length, mask = with_defaults(index, batch, 1)
  start = jnp.clip(start, 0, tokens)
  allowed = (jnp.minimum(jnp.clip(length, 0, 1), tokens - start) >= 1) & ((mask & 1) == 1)
  return jnp.minimum(start, tokens - 1), allowed


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gather_first_tokens(v, first, allowed, hq: int, pairs: bool):
  """out [B, Hq, D]: v[first[b]] for each query head of the group where allowed, else 0."""
  return _spread(_as_pairs(v, pairs)[first], allowed, hq, v)


def _gather_first_tokens_fwd(v, first, allowed, hq, pairs):
  # v is not saved: the backward needs only its shape [Tkv, Hkv], carried by a zero-size slice
  return _gather_first_tokens(v, first, allowed, hq, pairs), (first, allowed, v[:, :, :0])


def _gather_first_tokens_bwd(hq, pairs, residuals, dout):
  first, allowed, v_shape = residuals
  tokens, hkv = v_shape.shape[:2]
  b = dout.shape[0]
  rows = jnp.arange(b, dtype=jnp.int32)
  # token -> the allowed row that starts there (b: none); disallowed rows aim past the end, each
  # at its own index, so every index is distinct and the scatter needs no atomics
  owner = jnp.full((tokens,), b, jnp.int32).at[jnp.where(allowed, first, tokens + rows)].set(
      rows, mode="drop", unique_indices=True)
  grouped = _group_sum(dout, hkv)
  dv = _from_pairs(_rows_where(owner < b, _as_pairs(grouped, pairs)[jnp.minimum(owner, b - 1)]), grouped)
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
    return _gather_first_tokens(v, first, allowed, hq, b >= PAIRS_MIN_ROWS).astype(q.dtype)
  length, mask = with_defaults(index, b, 1)
  allowed = (length >= 1) & ((mask & 1) == 1)                       # [B]
  if hq == v.shape[2]:
    # No broadcast: as 16-bit rows autodiff's forward and backward kernels together beat the pairs
    # (4/4 heads, D 64, B = 262144: forward+backward 0.21 ms against 0.27-0.31 ms)
    return _rows_where(allowed, v[:, 0]).astype(q.dtype)
  return _broadcast_rows(v[:, 0], allowed, hq, b >= PAIRS_MIN_ROWS).astype(q.dtype)
