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

from .. import compat
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
    strategy.check_ranks(cp_size, "the context-parallel mesh axis size")
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


# ---------------------------------------------------------------- gathered keys in document order


# Gathered keys come in rank order, so on a load-balanced or placed layout each document's keys
# lie in one run per rank, with other documents' keys between the runs. The forward kernel walks
# a query tile's keys from the first to the last that it may attend and classifies every key tile
# in between; sorted by (segment, position) in blocks, a document's keys are one run. One H200,
# one rank's shared call of the 128k mean-8k row placed for 4 GPUs (24576 queries, 98304 keys):
# forward 2.46 -> 2.29 ms at 16/16 heads, 4.41 -> 4.02 ms at 32/8; the backward within 1%.
# all_gather and every placed shared part sort, but _own_keys_first's (which splits the keys by
# rank). The placement's forward keeps the sorted keys; the backward puts their dK/dV back in
# rank order for the exchange.
SORT_BLOCK = 128  # the kernels' key tile


def _sort_block(r: int) -> int:
  """Tokens per sorted block: the largest power of two up to SORT_BLOCK that divides a rank's
  shared region (blocks never straddle two ranks' regions)."""
  return min(r & -r, SORT_BLOCK) or 1


def _block_order(seg, pos, block: int):
  """[B, n / block] block indices in (segment, position) order of the blocks' first tokens."""
  return jnp.lexsort((pos[:, ::block], seg[:, ::block]), axis=-1)


def _take_blocks(x, order, block: int):
  """x [B, n, ...] with its blocks of `block` tokens in `order` ([B, n / block])."""
  b, n = x.shape[:2]
  blocks = x.reshape(b, n // block, block, *x.shape[2:])
  idx = order.reshape(b, n // block, *([1] * (blocks.ndim - 2)))
  return jnp.take_along_axis(blocks, idx, axis=1).reshape(x.shape)


def _in_rank_order(xs, order, block: int):
  """Arrays of blocks sorted by `order` (_block_order) back in the order they were gathered."""
  back = jnp.argsort(order, axis=-1)
  return tuple(_take_blocks(x, back, block) for x in xs)


def _sort_keys(gathered, r: int):
  """(the gathered (K, V, segment ids, positions) with their blocks in (segment, position) order,
  the function that puts arrays of the same blocks back in rank order)."""
  block = _sort_block(r)
  order = _block_order(gathered[2], gathered[3], block)
  return tuple(_take_blocks(x, order, block) for x in gathered), lambda xs: _in_rank_order(xs, order, block)


def _sorted_keys(gathered, r: int):
  return _sort_keys(gathered, r)[0]


def _run_on_kept(axis, groups, c: int, r: int, kv_seg, kv_pos, run, args):
  """run(*args) -> (dq, dk, dv) against the sorted shared keys that the forward kept, with dK/dV
  put back in rank order (the exchange's). The order comes from the blocks' first key tokens,
  gathered from every rank (8 bytes a block) while run's kernel runs: left to the scheduler, that
  gather went into the forward, and the forward's K/V gather had to end before the local kernel
  instead of under it (one collective in flight)."""
  block = _sort_block(r)
  moved, unpack = _pack((kv_seg[:, c::block], kv_pos[:, c::block]))
  (dq, *dkv), arrived = _overlapped(lambda m: _all_gather(axis, m, groups), moved, run, args)
  return (dq, *_in_rank_order(dkv, _block_order(*unpack(arrived), 1), block))


# ---------------------------------------------------------------- all-gather


_BITS = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _pack(xs, as_bits: bool = True):
  """[B, n, ...] arrays as one [B, n, m] array, so that one collective moves them all (XLA's
  default GPU schedule keeps one async collective in flight; the others block). as_bits: every
  array bitcast to the unsigned integer of the first one's width (an int32 is two uint16 beside
  bfloat16 K/V), so that nothing on the way can touch a float's bits; otherwise the arrays share
  a float dtype and keep it (their sums are taken on arrival). Returns (arrays to move, the
  function that splits them (of any n) back); arrays that do not bitcast so travel as they are."""
  dtype = _BITS.get(jnp.dtype(xs[0].dtype).itemsize) if as_bits else xs[0].dtype
  if (dtype is None or any(jnp.dtype(x.dtype).itemsize % jnp.dtype(dtype).itemsize for x in xs)
      or (not as_bits and any(x.dtype != dtype for x in xs))):
    return tuple(xs), tuple
  size = jnp.dtype(dtype).itemsize
  b, n = xs[0].shape[:2]
  cols = [(x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)).reshape(b, n, -1) for x in xs]
  widths = [c.shape[2] for c in cols]

  def unpack(moved):
    (packed,), out, lo = moved, [], 0
    for x, w in zip(xs, widths):
      y = packed[:, :, lo:lo + w]
      lo += w
      ratio = jnp.dtype(x.dtype).itemsize // size
      y = y.reshape(*packed.shape[:2], *x.shape[2:], *((ratio,) if ratio > 1 else ()))
      out.append(y if x.dtype == dtype else jax.lax.bitcast_convert_type(y, x.dtype))
    return tuple(out)

  return (jnp.concatenate(cols, axis=2),), unpack


def _all_gather(axis, xs, groups=None):
  return tuple(jax.lax.all_gather(x, axis, axis=1, tiled=True, axis_index_groups=groups) for x in xs)


def _gather(axis, xs, groups=None):
  """Every rank's blocks of `xs` (K, V and the key tokens' arrays) along the sequence, in rank
  order: of all ranks, or (groups: axis_index_groups) of this rank's group."""
  moved, unpack = _pack(xs)
  return unpack(_all_gather(axis, moved, groups))


def all_gather_fwd(local_fwd, axis, q, k, v, q_seg, q_pos, kv_seg, kv_pos):
  """Every rank's K/V, their blocks sorted by document (_sorted_keys: a load-balanced layout deals
  each document's blocks to every rank)."""
  kg, vg, seg_g, pos_g = _sorted_keys(_gather(axis, (k, v, kv_seg, kv_pos)), k.shape[1])
  return local_fwd(q, kg, vg, q_seg, q_pos, seg_g, pos_g)


def all_gather_bwd(local_bwd, axis, cp_size, q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos):
  # Gathered again rather than saved from the forward: memory stays O(local).
  (kg, vg, seg_g, pos_g), rank_order = _sort_keys(_gather(axis, (k, v, kv_seg, kv_pos)), k.shape[1])
  dq, dk, dv = local_bwd(q, kg, vg, out, lse, dout, dlse, q_seg, q_pos, seg_g, pos_g)
  return (dq, *_sum_scatter(axis, cp_size, rank_order((dk, dv))))


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


def keeps_gathered(strategy) -> bool:
  """True when the forward returns the shared K/V it gathered (and the token arrays that go with
  them) for the backward: a DocumentPlacement with a shared region that knows its ranks."""
  return (isinstance(strategy, DocumentPlacement) and strategy.shared_tokens > 0
          and strategy.cp_size is not None and strategy.cp_size > 1)


def trades_with_partner(placement: DocumentPlacement, cp_size: int, shard_len: int, q_heads: int,
                        kv_heads: int) -> bool:
  """Whether an all-shared shard (no local part) in a group of two ranks, with up to
  OWN_KEYS_FIRST_MAX_GROUP query heads a key head, trades its shared region with the other rank
  (one collective-permute each way) instead of gathering the pair's: it runs against its own
  keys under the trade and against the partner's after, so neither its own block nor its dK/dV
  partials (zeros) are copied in and out of a gathered array. Decided by the heads of the whole
  problem: the kept arrays' shapes depend on it (gathered_shapes)."""
  return (placement.group_size(cp_size) == 2 and placement.shared_tokens == shard_len
          and q_heads <= OWN_KEYS_FIRST_MAX_GROUP * kv_heads)


def _trades(placement: DocumentPlacement, kv_len: int, q_heads: int, kv_heads: int) -> bool:
  """trades_with_partner for a placement that knows its ranks, from the whole row's shapes."""
  cp = placement.cp_size
  return trades_with_partner(placement, cp, kv_len // cp, q_heads, kv_heads)


def kept_per_rank(placement: DocumentPlacement, kv_len: int, q_heads: int, kv_heads: int) -> bool:
  """True when the kept arrays differ between ranks (groups gather different keys, or a rank keeps
  its partner's block: trades_with_partner): they are then sharded over the context-parallel
  axis, each rank's block its group's g * R tokens (its partner's R); otherwise every rank keeps
  the same cp * R tokens (replicated). kv_len, q_heads and kv_heads: the whole row's."""
  return (placement.group_size(placement.cp_size) < placement.cp_size
          or _trades(placement, kv_len, q_heads, kv_heads))


def _axis_groups(placement: DocumentPlacement):
  """axis_index_groups of the shared region's collectives: consecutive groups of shared_group
  ranks, or None (all ranks)."""
  cp, g = placement.cp_size, placement.shared_group
  if g is None or g == cp:
    return None
  return [list(range(j * g, (j + 1) * g)) for j in range(cp // g)]


def gathered_tokens(placement: DocumentPlacement, kv_len: int, q_heads: int, kv_heads: int) -> int:
  """Key tokens of what keeps_gathered keeps: cp * R (replicated, or with trades_with_partner one
  block of R a rank), or with groups cp blocks of g * R, one per rank."""
  n, g = placement.cp_size * placement.shared_tokens, placement.group_size(placement.cp_size)
  return n if _trades(placement, kv_len, q_heads, kv_heads) or g == placement.cp_size else n * g


def gathered_shapes(placement: DocumentPlacement, q, k, v):
  """Shapes of what keeps_gathered keeps: K, V, segment ids and positions of its key tokens."""
  b, s, hkv, d = k.shape
  n = gathered_tokens(placement, s, q.shape[2], hkv)
  return (b, n, hkv, d), (b, n, hkv, v.shape[3]), (b, n), (b, n)


def shared_of_row(placement: DocumentPlacement, heads, k, v, kv_seg, kv_pos):
  """What the ranks' all-gather of their shared regions gives, taken from an unsharded row (every
  rank's last R of its S / cp tokens, in rank order; kept_per_rank: for each rank in turn, those
  of its group's ranks, or its partner's with trades_with_partner). heads: the whole problem's
  (query heads, key/value heads)."""
  cp, r, g = placement.cp_size, placement.shared_tokens, placement.group_size(placement.cp_size)
  trades = _trades(placement, k.shape[1], *heads)
  per_rank = kept_per_rank(placement, k.shape[1], *heads)

  def take(x):
    b, s, *rest = x.shape
    regions = x.reshape(b, cp, s // cp, *rest)[:, :, s // cp - r:]
    if trades:  # rank i's block: rank i ^ 1's region
      return regions.reshape(b, cp // 2, 2, r, *rest)[:, :, ::-1].reshape(b, cp * r, *rest)
    if per_rank:  # rank i's block: the regions of ranks i // g * g .. + g - 1
      return jnp.repeat(regions.reshape(b, cp // g, g * r, *rest), g, axis=1).reshape(b, cp * g * r, *rest)
    return regions.reshape(b, cp * r, *rest)

  return tuple(take(x) for x in (k, v, kv_seg, kv_pos))


def _overlapped(collective, moved, run_local, local_args):
  """`collective(moved)` in flight while `run_local(*local_args)` runs; returns both results.

  XLA starts an async collective right after its operands and waits for it right before its
  first user. Optimization barriers pin both ends: the collective's operand passes one barrier
  with the local kernel's arguments (whole arrays: run_local slices them, and a slice that feeds a
  kernel directly is an address, not a copy), and its raw result a second one with the kernel's
  outputs."""
  moved, local_args = jax.lax.optimization_barrier((moved, local_args))
  arrived = collective(moved)
  local = run_local(*local_args)
  local, arrived = jax.lax.optimization_barrier((local, arrived))
  return local, arrived


def _gather_while(axis, xs, run_local, local_args, groups=None):
  """`_gather(axis, xs, groups)` while `run_local(*local_args)` runs (see _overlapped)."""
  moved, unpack = _pack(xs)
  local, gathered = _overlapped(lambda m: _all_gather(axis, m, groups), moved, run_local, local_args)
  return local, unpack(gathered)


def _shared_kv(c, k, v, kv_seg, kv_pos):
  """The shard's shared K/V region and its key tokens' arrays, to be gathered from every rank."""
  return tuple(x[:, c:] for x in (k, v, kv_seg, kv_pos))


def axis_index(axes):
  """Linear index of this shard along (possibly several) mesh axes, in the order the
  collectives over `axes` lay the ranks out."""
  if isinstance(axes, str):
    axes = (axes,)
  idx = 0
  for a in axes:
    idx = idx * compat.axis_size(a) + jax.lax.axis_index(a)
  return idx


def _without_own(placement, axis, cp_size, seg_g):
  """The gathered shared segment ids with this rank's own block made padding (segment 0)."""
  r, ranks = placement.shared_tokens, placement.group_size(cp_size)
  own = axis_index(axis) % ranks  # groups are consecutive ranks; the gather is in rank order
  return jax.lax.dynamic_update_slice_in_dim(seg_g, jnp.zeros((seg_g.shape[0], r), seg_g.dtype), own * r, axis=1)


# A shard with everything shared (no local part) can run against its own shared keys under the
# exchange and against the others' after, at the price of two kernels and a merge. Measured on
# 2 H200s (one document of 64k-128k): with 16 query heads per 16 key heads it won 2.4%, with
# 32 per 8 (four times the work per exchanged byte) it lost 2-4%. So: up to 2 query heads a key head.
OWN_KEYS_FIRST_MAX_GROUP = 2


def _own_keys_first(c, q, k) -> bool:
  """Whether an all-shared shard (c == 0) splits its keys into its own and the others'."""
  return not c and q.shape[2] <= OWN_KEYS_FIRST_MAX_GROUP * k.shape[2]


def _add32(a, b):
  """a + b summed in float32, in a's dtype (partial gradients of two calls)."""
  return (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(a.dtype)


def _two_key_sets(local_bwd, q, k_first, k_second):
  """(first, second) for a backward of the same queries against two disjoint key sets, the second
  call running under an exchange: first(*args) -> (state, dk, dv), second(state, *args) -> (dq over
  both sets, dk, dv). Chained kernel calls that share the query side where local_bwd chains
  (primitive.LocalBwd: one preparation, one dQ conversion), else two whole calls whose dQ are
  summed in float32 (state: the first dQ)."""
  chains = getattr(local_bwd, "chains", None)
  if chains is not None and chains(q, k_first, k_second):
    return (lambda *a: local_bwd.begin(*a, then_k=k_second)), local_bwd.end

  def second(dq_first, *args):
    dq, dk, dv = local_bwd(*args)
    return _add32(dq, dq_first), dk, dv

  return local_bwd, second


def _partner_perm(cp_size: int):
  """Each rank with the other of its pair (groups are consecutive ranks)."""
  return [(j, j ^ 1) for j in range(cp_size)]


def _trade(axis, cp_size, moved):
  return tuple(jax.lax.ppermute(x, axis, _partner_perm(cp_size)) for x in moved)


def _partner_fwd(placement, local_fwd, axis, cp_size, q, k, v, q_seg, q_pos, kv_seg, kv_pos):
  """placed_fwd with trades_with_partner: the queries against the rank's own keys while its K/V
  (packed with their token arrays) and its partner's cross, then against the partner's; kept:
  the partner's block."""
  args = (q, k, v, q_seg, q_pos, kv_seg, kv_pos)
  moved, unpack = _pack((k, v, kv_seg, kv_pos))
  own, arrived = _overlapped(lambda m: _trade(axis, cp_size, m), moved, local_fwd, args)
  partner = unpack(arrived)
  others = local_fwd(q, *partner[:2], q_seg, q_pos, *partner[2:])
  out, lse = _merge(own[0].astype(jnp.float32), own[1], *others)
  return out.astype(q.dtype), lse, partner if keeps_gathered(placement) else ()


def _partner_bwd(local_bwd, axis, cp_size, kept, *args):
  """placed_bwd with trades_with_partner: the part against the partner's keys first, its dK/dV
  sent back while the part against the rank's own keys runs, and summed into that part's on
  arrival; without kept K/V the own part runs under the trade of K/V instead."""
  q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos = args
  trade = lambda m: _trade(axis, cp_size, m)
  on = lambda kp, vp, seg_p, pos_p: (q, kp, vp, out, lse, dout, dlse, q_seg, q_pos, seg_p, pos_p)

  if kept:
    first, second = _two_key_sets(local_bwd, q, kept[0], k)
    state, dkp, dvp = first(*on(*kept))
    moved, unpack = _pack((dkp, dvp), as_bits=False)
    (dq, *own), arrived = _overlapped(trade, moved, second, (state, *args))
  else:  # the partner's block has the shape of the rank's own
    first, second = _two_key_sets(local_bwd, q, k, k)
    moved, unpack_kv = _pack((k, v, kv_seg, kv_pos))
    (state, *own), arrived = _overlapped(trade, moved, first, args)
    dq, dkp, dvp = second(state, *on(*unpack_kv(arrived)))
    moved, unpack = _pack((dkp, dvp), as_bits=False)
    arrived = trade(moved)
  return (dq, *(_add32(x, y) for x, y in zip(own, unpack(arrived))))


def _heads(q, k, heads):
  """(query heads, key/value heads) of the whole problem: `heads`, or the shard's own."""
  return heads if heads is not None else (q.shape[2], k.shape[2])


def placed_fwd(placement, local_fwd, axis, cp_size, q, k, v, q_seg, q_pos, kv_seg, kv_pos, heads=None):
  """Local queries against local keys (no communication); shared queries against the shared
  keys of every rank (of the rank's group), the only exchange, in flight while the local kernel
  runs. Two independent problems: no merge. A shard with no local part (everything shared) runs
  one call after the exchange, or (_own_keys_first) its queries against its own shared keys
  under the exchange, against the other ranks' after, and merges the two partial softmaxes.
  Returns (out, lse, kept): kept is the gathered shared K/V and their token arrays when
  keeps_gathered(placement), else ()."""
  c, r = _regions(placement, q.shape[1])
  args = (q, k, v, q_seg, q_pos, kv_seg, kv_pos)
  run_local = lambda *a: local_fwd(*(x[:, :c] for x in a))
  if not r:
    return (*run_local(*args), ())
  if trades_with_partner(placement, cp_size, q.shape[1], *_heads(q, k, heads)):
    return _partner_fwd(placement, local_fwd, axis, cp_size, *args)
  if not c and not _own_keys_first(c, q, k):
    gathered = _sorted_keys(_gather(axis, (k, v, kv_seg, kv_pos), _axis_groups(placement)), r)
    out = local_fwd(q, *gathered[:2], q_seg, q_pos, *gathered[2:])
    return (*out, gathered if keeps_gathered(placement) else ())
  local_out, gathered = _gather_while(axis, _shared_kv(c, k, v, kv_seg, kv_pos), run_local if c else local_fwd,
                                      args, _axis_groups(placement))
  kg, vg, seg_g, pos_g = _sorted_keys(gathered, r) if c else gathered
  kept = (kg, vg, seg_g, pos_g) if keeps_gathered(placement) else ()
  if not c:
    others = local_fwd(q, kg, vg, q_seg, q_pos, _without_own(placement, axis, cp_size, seg_g), pos_g)
    out, lse = _merge(local_out[0].astype(jnp.float32), local_out[1], *others)
    return out.astype(q.dtype), lse, kept
  shared_out = local_fwd(q[:, c:], kg, vg, q_seg[:, c:], q_pos[:, c:], seg_g, pos_g)
  return (jnp.concatenate([local_out[0], shared_out[0]], axis=1),
          jnp.concatenate([local_out[1], shared_out[1]], axis=2), kept)


def placed_bwd(placement, local_bwd, axis, cp_size, q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos,
               kept=(), heads=None):
  """Gradients of placed_fwd; only the shared keys' dK/dV are summed over the ranks.

  With the forward's gathered shared K/V (kept), the shared part runs first and its dK/dV
  all-to-all is in flight while the local part runs: no exchange waits. Without them, the shared
  keys are gathered again (memory stays O(local)) while the local part runs, and the all-to-all
  follows the shared part. With groups (shared_group) every exchange runs within the group."""
  c, r = _regions(placement, q.shape[1])
  n = q.shape[1]
  groups = _axis_groups(placement)
  ranks = placement.group_size(cp_size)  # the ranks whose keys the shared part gathers

  def part(x, lo, hi, axis_=1):
    return jax.lax.slice_in_dim(x, lo, hi, axis=axis_)

  def query_args(lo, hi, q, out, lse, dout, dlse, q_seg, q_pos):  # the per-query arguments of [lo, hi)
    return (part(q, lo, hi), part(out, lo, hi), part(lse, lo, hi, 2), part(dout, lo, hi), part(dlse, lo, hi, 2),
            part(q_seg, lo, hi), part(q_pos, lo, hi))

  def run(queries, kg, vg, seg_g, pos_g):
    qq, o, l, do, dl, qs, qp = queries
    return local_bwd(qq, kg, vg, o, l, do, dl, qs, qp, seg_g, pos_g)

  per_query = (q, out, lse, dout, dlse, q_seg, q_pos)

  def run_local(*a):
    return run(query_args(0, c, *a[:7]), *(part(x, 0, c) for x in a[7:]))

  args = (*per_query, k, v, kv_seg, kv_pos)
  if not r:
    return run_local(*args)
  if trades_with_partner(placement, cp_size, n, *_heads(q, k, heads)):
    return _partner_bwd(local_bwd, axis, cp_size, kept, q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos)
  if _own_keys_first(c, q, k):  # everything shared: the rank's own shared keys under the exchange
    return _all_shared_bwd(placement, local_bwd, axis, cp_size, kept, q, k, v, out, lse, dout, dlse, q_seg, q_pos,
                           kv_seg, kv_pos)
  # The shared part against the sorted shared keys (_sort_keys), its dK/dV back in rank order.
  run_shared = lambda *a: run(query_args(c, n, *a[:7]), *a[7:])
  if kept:
    dq_shared, *dkv = _run_on_kept(axis, groups, c, r, kv_seg, kv_pos, run_shared, (*per_query, *kept))
  if not c:  # everything shared, one call
    if not kept:
      gathered, rank_order = _sort_keys(_gather(axis, (k, v, kv_seg, kv_pos), groups), r)
      dq_shared, *dkv = run_shared(*per_query, *gathered)
      dkv = rank_order(dkv)
    return (dq_shared, *_sum_scatter(axis, ranks, tuple(dkv), groups))
  if kept:
    blocks, finish = _scatter_parts(ranks, tuple(dkv))
    local_grads, arrived = _overlapped(lambda m: _all_to_all(axis, m, groups), blocks, run_local, args)
    shared_grads = (dq_shared, *finish(arrived))
  else:
    local_grads, gathered = _gather_while(axis, _shared_kv(c, k, v, kv_seg, kv_pos), run_local, args, groups)
    gathered, rank_order = _sort_keys(gathered, r)
    dq, *dkv = run_shared(*per_query, *gathered)
    shared_grads = (dq, *_sum_scatter(axis, ranks, rank_order(dkv), groups))
  return tuple(jnp.concatenate(pair, axis=1) for pair in zip(local_grads, shared_grads))


def _all_shared_bwd(placement, local_bwd, axis, cp_size, kept, *args):
  """placed_bwd of a shard with no local part. The part against the other ranks' shared keys
  runs first (with kept K/V) and its dK/dV all-to-all is in flight while the part against the
  rank's own keys runs, which is summed into what arrives; without kept K/V the own part runs
  under the gather instead."""
  q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos = args
  groups, ranks = _axis_groups(placement), placement.group_size(cp_size)

  def on_others(kg, vg, seg_g, pos_g):
    return (q, kg, vg, out, lse, dout, dlse, q_seg, q_pos, _without_own(placement, axis, cp_size, seg_g), pos_g)

  exchange = lambda m: _all_to_all(axis, m, groups)
  if kept:
    first, second = _two_key_sets(local_bwd, q, kept[0], k)
    state, dkg, dvg = first(*on_others(*kept))
    blocks, finish = _scatter_parts(ranks, (dkg, dvg))
    (dq, *own), arrived = _overlapped(exchange, blocks, second, (state, *args))
  else:
    gathered_k = jax.ShapeDtypeStruct((k.shape[0], ranks * k.shape[1], *k.shape[2:]), k.dtype)
    first, second = _two_key_sets(local_bwd, q, k, gathered_k)
    (state, *own), gathered = _gather_while(axis, (k, v, kv_seg, kv_pos), first, args, groups)
    dq, dkg, dvg = second(state, *on_others(*gathered))
    blocks, finish = _scatter_parts(ranks, (dkg, dvg))
    arrived = exchange(blocks)
  return (dq, *finish(arrived, tuple(own)))


def _scatter_parts(cp_size, xs):
  """The all-to-all of _sum_scatter in two halves: (the blocks to send, the function that sums
  the blocks that arrive, with `extra` arrays like xs, in float32)."""
  moved, unpack = _pack(xs, as_bits=False)
  blocks = tuple(x.reshape(x.shape[0], cp_size, x.shape[1] // cp_size, *x.shape[2:]) for x in moved)

  def finish(arrived, extra=()):  # block j: from rank j
    sums = unpack(tuple(jnp.sum(m.astype(jnp.float32), axis=1) for m in arrived))
    sums = tuple(x + e.astype(jnp.float32) for x, e in zip(sums, extra)) if extra else sums
    return tuple(x.astype(like.dtype) for x, like in zip(sums, xs))

  return blocks, finish


def _all_to_all(axis, blocks, groups=None):
  return tuple(jax.lax.all_to_all(b, axis, split_axis=1, concat_axis=1, tiled=True, axis_index_groups=groups)
               for b in blocks)


def _sum_scatter(axis, ranks, xs, groups=None):
  """Sums the ranks' partial gradients of gathered keys (each [B, ranks * n, ...], block j from
  rank j of all, or of the group) and keeps this rank's blocks. The partials travel in their own
  dtype, packed into one all-to-all (in bfloat16, half the bytes of a float32 reduce-scatter),
  and are summed here in float32."""
  blocks, finish = _scatter_parts(ranks, xs)
  return finish(_all_to_all(axis, blocks, groups))


# ---------------------------------------------------------------- dispatch


def cp_fwd(strategy, local_fwd, axis, cp_size, *args, heads=None):
  """(out, lse, kept): kept as placed_fwd's, () for the other strategies. heads: (query heads,
  key/value heads) of the whole problem where the shards' differ (trades_with_partner)."""
  if isinstance(strategy, DocumentPlacement):
    return placed_fwd(strategy, local_fwd, axis, cp_size, *args, heads=heads)
  if strategy == "ring":
    return (*ring_fwd(local_fwd, axis, cp_size, *args), ())
  return (*all_gather_fwd(local_fwd, axis, *args), ())


def cp_bwd(strategy, local_bwd, axis, cp_size, *args, kept=(), heads=None):
  if isinstance(strategy, DocumentPlacement):
    return placed_bwd(strategy, local_bwd, axis, cp_size, *args, kept=kept, heads=heads)
  if strategy == "ring":
    return ring_bwd(local_bwd, axis, cp_size, *args)
  return all_gather_bwd(local_bwd, axis, cp_size, *args)
