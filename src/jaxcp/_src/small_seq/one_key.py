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
  """_as_pairs undone: `u` back in the dtype of `like` (an array or a jax.ShapeDtypeStruct)."""
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


def _group_sum(dout, hkv: int, pairs: bool):
  """[B, Hq, D] -> [B, Hkv, D] (pairs: [B, Hkv, D / 2] uint32 where _as_pairs applies): the sum
  over each group's query heads in float32, head by head. As adds of slices XLA fuses it into one
  elementwise loop; as a reduction over the middle axis the padded forward+backward took 7-10%
  longer at groups of 4 (H200, 4/1 heads, D 64 and 128, B = 262144 and 1048576; level at 8/2
  heads of 128, 16/4 of 64 and on ragged rows). As pairs each 32-bit word holds two 16-bit
  values, widened and summed separately."""
  b, hq, d = dout.shape
  u = _as_pairs(dout, pairs)
  heads = u.reshape(b, hkv, hq // hkv, u.shape[-1])
  if u.dtype == dout.dtype:
    total = heads[:, :, 0].astype(jnp.float32)
    for g in range(1, hq // hkv):
      total = total + heads[:, :, g].astype(jnp.float32)
    return total.astype(dout.dtype)
  half = jnp.dtype(jnp.uint16)
  widen = lambda w: jax.lax.bitcast_convert_type(w.astype(half), dout.dtype).astype(jnp.float32)
  narrow = lambda x: jax.lax.bitcast_convert_type(x.astype(dout.dtype), half).astype(jnp.uint32)
  lo = widen(heads[:, :, 0] & 0xFFFF)
  hi = widen(heads[:, :, 0] >> 16)
  for g in range(1, hq // hkv):
    lo = lo + widen(heads[:, :, g] & 0xFFFF)
    hi = hi + widen(heads[:, :, g] >> 16)
  return narrow(lo) | (narrow(hi) << 16)


def _ragged_first_tokens(index, batch: int, tokens: int):
  """(first token of each row, clamped into [0, tokens), bool [B] whether the row attends to it),
  with small_seq_reference's clamping of start and length."""
  start, length, mask = with_defaults(index, batch, 1)
  start = jnp.clip(start, 0, tokens)
  allowed = (jnp.minimum(jnp.clip(length, 0, 1), tokens - start) >= 1) & ((mask & 1) == 1)
  return jnp.minimum(start, tokens - 1), allowed


def _allowed_rows(index, batch: int, ragged: bool, tokens: int):
  """(first token of each row (ragged; None padded), bool [B] whether the row attends to it)."""
  if ragged:
    return _ragged_first_tokens(index, batch, tokens)
  length, mask = with_defaults(index, batch, 1)
  return None, (length >= 1) & ((mask & 1) == 1)


def _one_key_output(q, v, index, ragged: bool, pairs: bool, mha_pairs: bool):
  """(out [B, Hq, D], first tokens (ragged) or None, allowed [B]); padded rows without groups
  move as 16-bit rows unless mha_pairs."""
  b, hq, _ = q.shape
  first, allowed = _allowed_rows(index, b, ragged, v.shape[0])
  if not ragged and hq == v.shape[2] and not mha_pairs:
    out = _rows_where(allowed, v[:, 0])
  else:
    rows = _as_pairs(v, pairs)[first] if ragged else _as_pairs(v[:, 0], pairs)  # [B, Hkv, D or D / 2]
    out = _from_pairs(_group_broadcast(_rows_where(allowed, rows), hq), v)
  return out.astype(q.dtype), first, allowed


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _one_key(q, k, v, index, ragged: bool, pairs: bool):
  """out [B, Hq, D]: each row's key's value for each query head of its group where the row
  attends to it, else 0. The VJP is written out (dQ = dK = 0, dV = dO summed over the group,
  through the token -> row map when ragged): the rows move as 32-bit pairs, which autodiff
  cannot see through, and autodiff of the ragged gather would scatter-add. dQ and dK are
  symbolic zeros.

  Padded rows without groups: the forward alone (not differentiated) moves them as pairs, 1.24-1.29x
  faster than 16-bit rows (H200, 8/8 D128, 4/4 D64 and 1/1 D512 at B = 262144, 4/4 D64 and 1/1
  D128 at 1048576); under differentiation the forward keeps 16-bit rows: with pairs
  forward+backward took 1.19-1.21x as long (8/8 D128: 0.99 ms against 0.82), and 1.38-1.43x with dV
  as pairs too."""
  del k
  return _one_key_output(q, v, index, ragged, pairs, mha_pairs=pairs)[0]


def _one_key_fwd(q, k, v, index, ragged, pairs):
  out, first, allowed = _one_key_output(q, v, index, ragged, pairs, mha_pairs=False)
  # v is not saved: the backward needs its shape and dtype, carried by a zero-size slice
  return out, (first, allowed, v[..., :0])


def _one_key_bwd(ragged, pairs, residuals, dout):
  first, allowed, v_stub = residuals
  b, hq, hkv = dout.shape[0], dout.shape[1], v_stub.shape[-2]
  # dQ and dK are symbolic zeros (None): in a model, autodiff then skips the backward of whatever
  # made q and k (their projections' matmuls: a one-key layer's training step 1.31-1.35x faster,
  # H200); jax.vjp and jax.grad of q or k themselves get zeros of their shapes, written by JAX as
  # 16-bit values (under groups 0.72-0.77x the uint32 pairs written here before). dV's group sum
  # goes as pairs under groups.
  dq = dk = None
  dout = dout.astype(v_stub.dtype)
  if not ragged and hq == hkv:
    return dq, dk, _rows_where(allowed, dout)[:, None], None
  grouped = _group_sum(dout, hkv, pairs and hq > hkv)              # [B, Hkv, D] (or D / 2 pairs)
  if not ragged:
    return dq, dk, _from_pairs(_rows_where(allowed, grouped), dout)[:, None], None
  tokens = v_stub.shape[0]
  rows = jnp.arange(b, dtype=jnp.int32)
  # token -> the allowed row that starts there (b: none); disallowed rows aim past the end, each
  # at its own index, so every index is distinct and the scatter needs no atomics
  owner = jnp.full((tokens,), b, jnp.int32).at[jnp.where(allowed, first, tokens + rows)].set(
      rows, mode="drop", unique_indices=True)
  gathered = _as_pairs(grouped, pairs)[jnp.minimum(owner, b - 1)]
  return dq, dk, _from_pairs(_rows_where(owner < b, gathered), dout), None


_one_key.defvjp(_one_key_fwd, _one_key_bwd)


def one_key_attention(q, k, v, index, config: SmallSeqConfig):
  """small_seq_reference's output for rows of one key (max_len 1; k is not read)."""
  if config.max_len != 1:
    raise ValueError("one_key_attention takes rows of one key (max_len 1).")
  return _one_key(q, k, v, tuple(index), config.ragged, q.shape[0] >= PAIRS_MIN_ROWS)
