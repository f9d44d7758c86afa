"""Context-parallel attention over a sharded sequence axis: all-gather, ring and document placement.

Both algorithms run on per-rank shards inside a body where the context-parallel mesh axis is
bound (a custom_partitioning lowering under jax.jit, or a jax.shard_map). Because the mask
depends only on per-token (segment id, position), K/V only need their segment ids and
positions carried along; which rank a block came from never matters, so any load-balancing
permutation of the tokens works unchanged.

`local_fwd(q, k, v, q_seg, q_pos, kv_seg, kv_pos) -> (out, lse)` and
`local_bwd(q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos) -> (dq, dk, dv)` are
the single-device kernels (already partitioned over any other mesh axes).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .placement import DocumentPlacement

STRATEGIES = ("auto", "all_gather", "ring")

# "auto": all-gather wherever it was measured (2 and 4 H200s, S 128k-256k, GQA 32/8 and MHA
# 16/16: all-gather on balanced rows beat ring on striped rows in every case, 0.46-0.99 against
# 0.34-0.97 of ideal); ring only past that, with MHA-sized K/V and long local blocks, where
# gathering all of K/V costs memory that the ring's one block in flight does not.
AUTO_RING_MIN_CP = 5
AUTO_RING_MIN_LOCAL_KV = 4096
AUTO_RING_MAX_GQA_RATIO = 4


def check_strategy(strategy) -> None:
  """ValueError unless `strategy` is a context_parallel value jaxcp.attention takes."""
  if not (isinstance(strategy, DocumentPlacement) or (isinstance(strategy, str) and strategy in STRATEGIES)):
    raise ValueError(f"context_parallel must be one of {STRATEGIES} or a jaxcp.DocumentPlacement, got {strategy!r}.")


def choose_strategy(strategy, cp_size: int, local_q_len: int, local_kv_len: int, q_heads: int, kv_heads: int):
  """Resolves "auto" to "all_gather" or "ring" (see the constants above); a DocumentPlacement
  stays, once checked against the local shard."""
  if isinstance(strategy, DocumentPlacement):
    if local_q_len != local_kv_len:
      raise ValueError(f"context_parallel=DocumentPlacement(...) places the tokens of one row for self attention; "
                       f"the query and key/value shards differ ({local_q_len} and {local_kv_len} tokens). Use "
                       f"context_parallel='all_gather' or 'ring' for cross attention.")
    if strategy.shared_tokens > local_kv_len:
      raise ValueError(f"context_parallel=DocumentPlacement(shared_tokens={strategy.shared_tokens}) does not fit a "
                       f"shard of {local_kv_len} tokens (S / cp); use the placement that load_balance_permutation "
                       f"laid the rows out with, for this cp.")
    return strategy
  if strategy != "auto":
    return strategy
  if (cp_size < AUTO_RING_MIN_CP or local_kv_len < AUTO_RING_MIN_LOCAL_KV
      or q_heads // kv_heads >= AUTO_RING_MAX_GQA_RATIO):
    return "all_gather"
  return "ring"


def _ring_perm(cp_size: int):
  return [(j, (j + 1) % cp_size) for j in range(cp_size)]


def _merge(out, lse, out_i, lse_i):
  """Combines two partial softmax results over disjoint key sets (float32 accumulators)."""
  lse_new = jnp.logaddexp(lse, lse_i)
  finite = jnp.isfinite(lse_new)
  safe = jnp.where(finite, lse_new, 0.0)
  w_old = jnp.where(finite, jnp.exp(lse - safe), 0.0)
  w_new = jnp.where(finite, jnp.exp(lse_i - safe), 0.0)
  # lse is [B, H, S]; out is [B, S, H, D].
  to_out = lambda w: jnp.swapaxes(w, 1, 2)[..., None]
  return out * to_out(w_old) + out_i.astype(jnp.float32) * to_out(w_new), lse_new


# ---------------------------------------------------------------- all-gather


def all_gather_fwd(local_fwd, axis, q, k, v, q_seg, q_pos, kv_seg, kv_pos):
  gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
  return local_fwd(q, gather(k), gather(v), q_seg, q_pos, gather(kv_seg), gather(kv_pos))


def all_gather_bwd(local_bwd, axis, q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos):
  # Gathered again rather than saved from the forward: memory stays O(local).
  gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
  dq, dk, dv = local_bwd(q, gather(k), gather(v), out, lse, dout, dlse, q_seg, q_pos,
                         gather(kv_seg), gather(kv_pos))
  return dq, _reduce_scatter(dk, axis, k.dtype), _reduce_scatter(dv, axis, v.dtype)


# ---------------------------------------------------------------- ring


def ring_fwd(local_fwd, axis, cp_size, q, k, v, q_seg, q_pos, kv_seg, kv_pos):
  """cp steps; step i attends to the K/V block that started i ranks back. The next block's
  collective-permute is issued before this step's kernel so the two overlap."""
  perm = _ring_perm(cp_size)
  b, sq, hq, _ = q.shape
  out = jnp.zeros((b, sq, hq, v.shape[3]), jnp.float32)
  lse = jnp.full((b, hq, sq), -jnp.inf, jnp.float32)
  block = (k, v, kv_seg, kv_pos)
  for step in range(cp_size):
    nxt = jax.lax.ppermute(block, axis, perm) if step + 1 < cp_size else None
    out_i, lse_i = local_fwd(q, *block[:2], q_seg, q_pos, *block[2:])
    out, lse = _merge(out, lse, out_i, lse_i)
    block = nxt
  return out.astype(q.dtype), lse


def ring_bwd(local_bwd, axis, cp_size, q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos):
  """dK/dV accumulators travel with their K/V block and take one last hop home."""
  perm = _ring_perm(cp_size)
  dq = jnp.zeros(q.shape, jnp.float32)
  block = (k, v, kv_seg, kv_pos)
  dk_acc = jnp.zeros(k.shape, jnp.float32)
  dv_acc = jnp.zeros(v.shape, jnp.float32)
  for step in range(cp_size):
    nxt = jax.lax.ppermute(block, axis, perm) if step + 1 < cp_size else None
    kb, vb, segb, posb = block
    dq_i, dk_i, dv_i = local_bwd(q, kb, vb, out, lse, dout, dlse, q_seg, q_pos, segb, posb)
    dq = dq + dq_i.astype(jnp.float32)
    dk_acc = dk_acc + dk_i.astype(jnp.float32)
    dv_acc = dv_acc + dv_i.astype(jnp.float32)
    dk_acc, dv_acc = jax.lax.ppermute((dk_acc, dv_acc), axis, perm)
    block = nxt
  return dq.astype(q.dtype), dk_acc.astype(k.dtype), dv_acc.astype(v.dtype)


# ---------------------------------------------------------------- document placement


def _regions(placement: DocumentPlacement, shard_len: int):
  """(local, shared) lengths of a shard: its first S/cp - R and last R tokens."""
  shared = placement.shared_tokens
  return shard_len - shared, shared


def placed_fwd(placement, local_fwd, axis, q, k, v, q_seg, q_pos, kv_seg, kv_pos):
  """Local queries against local keys (no communication); shared queries against the shared
  keys of every rank, the only exchange. Two independent problems: no merge."""
  c, r = _regions(placement, q.shape[1])
  outs, lses = [], []
  if r:  # the gather has no dependence on the local part: XLA overlaps the two
    gather = lambda x: jax.lax.all_gather(x[:, c:], axis, axis=1, tiled=True)
    shared_kv = (gather(k), gather(v), gather(kv_seg), gather(kv_pos))
  if c:
    out, lse = local_fwd(q[:, :c], k[:, :c], v[:, :c], q_seg[:, :c], q_pos[:, :c], kv_seg[:, :c], kv_pos[:, :c])
    outs.append(out)
    lses.append(lse)
  if r:
    kg, vg, seg_g, pos_g = shared_kv
    out, lse = local_fwd(q[:, c:], kg, vg, q_seg[:, c:], q_pos[:, c:], seg_g, pos_g)
    outs.append(out)
    lses.append(lse)
  return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)


def placed_bwd(placement, local_bwd, axis, q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos):
  """Gradients of placed_fwd: the shared keys gathered again (memory stays O(local)) and only
  their dK/dV reduce-scattered."""
  c, r = _regions(placement, q.shape[1])
  dqs, dks, dvs = [], [], []

  def part(x, lo, hi, axis_=1):
    return jax.lax.slice_in_dim(x, lo, hi, axis=axis_)

  if c:
    dq, dk, dv = local_bwd(*(part(x, 0, c) for x in (q, k, v, out)), part(lse, 0, c, 2), part(dout, 0, c),
                           part(dlse, 0, c, 2), *(part(x, 0, c) for x in (q_seg, q_pos, kv_seg, kv_pos)))
    dqs.append(dq)
    dks.append(dk)
    dvs.append(dv)
  if r:
    n = q.shape[1]
    gather = lambda x: jax.lax.all_gather(part(x, c, n), axis, axis=1, tiled=True)
    dq, dkg, dvg = local_bwd(part(q, c, n), gather(k), gather(v), part(out, c, n), part(lse, c, n, 2),
                             part(dout, c, n), part(dlse, c, n, 2), part(q_seg, c, n), part(q_pos, c, n),
                             gather(kv_seg), gather(kv_pos))
    dqs.append(dq)
    dks.append(_reduce_scatter(dkg, axis, k.dtype))
    dvs.append(_reduce_scatter(dvg, axis, v.dtype))
  cat = lambda xs: jnp.concatenate(xs, axis=1)
  return cat(dqs), cat(dks), cat(dvs)


def _reduce_scatter(x, axis, dtype):
  """Sums the ranks' partial gradients of gathered keys and keeps this rank's slice (float32 sums)."""
  return jax.lax.psum_scatter(x.astype(jnp.float32), axis, scatter_dimension=1, tiled=True).astype(dtype)


# ---------------------------------------------------------------- dispatch


def cp_fwd(strategy, local_fwd, axis, cp_size, *args):
  if isinstance(strategy, DocumentPlacement):
    return placed_fwd(strategy, local_fwd, axis, *args)
  if strategy == "ring":
    return ring_fwd(local_fwd, axis, cp_size, *args)
  return all_gather_fwd(local_fwd, axis, *args)


def cp_bwd(strategy, local_bwd, axis, cp_size, *args):
  if isinstance(strategy, DocumentPlacement):
    return placed_bwd(strategy, local_bwd, axis, *args)
  if strategy == "ring":
    return ring_bwd(local_bwd, axis, cp_size, *args)
  return all_gather_bwd(local_bwd, axis, *args)
