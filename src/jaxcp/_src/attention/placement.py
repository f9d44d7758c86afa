"""Document placement for context parallelism: exchange only the documents that cross ranks.

A context-parallel rank holds ``S / cp`` tokens of each row. Under a :class:`DocumentPlacement`
with ``shared_tokens = R`` its shard is two regions:

* the first ``S / cp - R`` tokens are *local*: whole segments (a segment is every token of one
  segment id in the row) that live on this rank alone, plus padding;
* the last ``R`` tokens are *shared*: pieces of the segments that are spread over all ranks.
  The shared segments, back to back, are cut into blocks of 128 tokens (the kernels' tile) and
  the blocks dealt to the ranks by causal work, heaviest first to the least loaded rank, so the
  shared work is even over the ranks and every piece edge falls on a tile edge. (A region that
  is not a multiple of 128 tokens takes ``2 * cp`` zigzag pieces of each segment instead.)
  With ``shared_group = g`` the ranks form consecutive groups of ``g`` and each shared segment is
  spread over the ranks of one group only: the exchange runs within groups.

Attention on such a layout is two independent problems with no merge: local queries against
the local keys of their own rank (no communication) and shared queries against the shared keys
of every rank of the group (the only exchange: ``R`` tokens per rank). The placement of local segments
balances a per-segment cost ``token_cost * L + pair_cost * L**2`` over the ranks (longest
processing time first, under each rank's local capacity, then moves and swaps off the costliest
rank); the largest segments go to the shared region when that balances better or when they do
not fit.

The permutation is computed with numpy (an input pipeline's job), or under ``jax.jit`` through
``jax.pure_callback`` running the same numpy code. A row whose shared segments need more than
``R`` tokens per rank raises ``ValueError``; :func:`choose_placement` picks, per batch, the
smallest of a few static sizes that fits, the largest being ``S / cp`` (everything shared: the
full exchange), so every input is placed exactly.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

from .document_zigzag import document_layout, zigzag_docs_ranks

# Cost of a segment of L tokens: TOKEN_COST * L + PAIR_COST * L**2 (relative units; only the
# ratio matters). Fitted to jaxcp's own causal forward+backward times on rows of equal documents
# (benchmarks/calibrate_placement.py): a segment's work is its allowed pairs plus a per-token
# part (tile edges, the plan, loads and stores) worth TOKEN_COST pairs.
DEFAULT_TOKEN_COST = 291.0
DEFAULT_PAIR_COST = 0.5
# A placement is balanced when its costliest rank is at most this far above the mean.
DEFAULT_TOLERANCE = 0.02
# Shared tokens are dealt to ranks in blocks of 128 tokens (the kernels' tile; see _blocks_perm)
# of even causal work, so every piece edge is a tile edge. Zigzag pieces of each segment cut
# tiles at every piece edge: on 4 H200s the 128k mean-8k row (R = 24576 of 32768) kept 0.812 of
# ideal with them and 0.883 with blocks (benchmarks/README.md). Blocks even the causal work
# within about 1% from 8 blocks a rank up; below, less so, yet cp_balance.py's tile model still
# has the busiest rank visit fewer tiles than with zigzag pieces (cp 8-64, S 32k-128k). Zigzag
# pieces only where R is not a multiple of the block.
ALL_SHARED_BLOCK = 128
# choose_placement's default sizes: these fractions of S / cp (the last is the full exchange).
DEFAULT_SHARED_FRACTIONS = (0.0, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1.0)
# exchange_cost's defaults, measured on 2 H200s (benchmarks/calibrate_placement.py): seconds of
# one allowed (query, key) pair per query head and head dimension, causal forward+backward (2 b /
# (32 * 128) of the 32/8-head, D 128 fit), and the bytes per second a rank receives in the shared
# region's exchange, half in the all-gather of K/V (235 GB/s) and half in the all-to-all of
# dK/dV partials (256 GB/s), over NVLink.
DEFAULT_PAIR_SECONDS = 2.43e-14
DEFAULT_EXCHANGE_BYTES_PER_S = 2.45e11


@dataclasses.dataclass(frozen=True)
class DocumentPlacement:
  """A context-parallel token layout: whole segments per rank, long ones shared by all ranks.

  Pass the same object to :func:`jaxcp.load_balance_permutation` (``strategy=``), which builds
  the layout, and to :func:`jaxcp.attention` (``context_parallel=``), which relies on it.

  Attributes:
    shared_tokens: R, the tokens per rank (and per row) in the shared region, the last R of
      each rank's ``S / cp``. Static: each value compiles its own program. 0 means no exchange
      at all; ``S / cp`` means every segment is shared (the exchange of all_gather).
    token_cost, pair_cost: the balancing cost of a segment of L tokens,
      ``token_cost * L + pair_cost * L**2``.
    tolerance: how far above the mean the costliest rank may be before more segments are
      moved to the shared region (when R leaves room).
    cp_size: the context-parallel ranks the layout is for (choose_placement sets it), or None.
      With it, the forward keeps the shared keys and values it gathered (cp * R tokens per rank)
      for the backward, which then needs no gather of its own and overlaps its only exchange
      (the shared dK/dV) with the local part; without it (and outside jax.shard_map, where the
      ranks are known anyway) the backward gathers them again and keeps memory O(S / cp).
    shared_group: g, the ranks each shared segment is spread over: consecutive groups of g ranks
      (ranks j * g to j * g + g - 1), g dividing cp_size (which it needs); the shared region's
      gather and its dK/dV exchange then run within each group, (g - 1) * R tokens received per
      rank instead of (cp - 1) * R; what the forward keeps for the backward is its group's
      g * R gathered tokens (in a pair whose shards are all shared, with at most 2 query heads
      a key head, the partner's R: the two ranks trade their regions). None: all cp ranks.
  """
  shared_tokens: int
  token_cost: float = DEFAULT_TOKEN_COST
  pair_cost: float = DEFAULT_PAIR_COST
  tolerance: float = DEFAULT_TOLERANCE
  cp_size: int | None = None
  shared_group: int | None = None

  def __post_init__(self):
    r = self.shared_tokens
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
      raise ValueError(f"DocumentPlacement: shared_tokens must be an int >= 0 (tokens per rank in the "
                       f"shared region), got {r!r}.")
    object.__setattr__(self, "shared_tokens", int(r))
    cp = self.cp_size
    if cp is not None:
      if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1:
        raise ValueError(f"DocumentPlacement: cp_size must be an int >= 1 (the context-parallel ranks) or None, "
                         f"got {cp!r}.")
      object.__setattr__(self, "cp_size", int(cp))
    g = self.shared_group
    if g is not None:
      if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1:
        raise ValueError(f"DocumentPlacement: shared_group must be an int >= 1 (ranks per group) or None, got {g!r}.")
      if cp is None or int(cp) % int(g):
        raise ValueError(f"DocumentPlacement: shared_group={g} needs cp_size, a multiple of it (the ranks form "
                         f"groups of {g}), got cp_size={cp!r}.")
      object.__setattr__(self, "shared_group", int(g))
    for name in ("token_cost", "pair_cost", "tolerance"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or value < 0:
        raise ValueError(f"DocumentPlacement: {name} must be a number >= 0, got {value!r}.")
      object.__setattr__(self, name, float(value))
    if self.token_cost == 0 and self.pair_cost == 0:
      raise ValueError("DocumentPlacement: token_cost and pair_cost cannot both be 0.")

  def check_ranks(self, cp: int, where: str = "cp_size") -> None:
    """ValueError unless the layout is for cp ranks (or says nothing about its ranks)."""
    if self.cp_size is not None and self.cp_size != cp:
      raise ValueError(f"DocumentPlacement(cp_size={self.cp_size}) lays rows out for {self.cp_size} ranks, but "
                       f"{where} is {cp}; choose the placement for {cp} ranks (jaxcp.choose_placement(..., {cp})).")

  def group_size(self, cp: int) -> int:
    """Ranks a shared segment is spread over: shared_group, or all cp."""
    return self.shared_group or cp

  def local_tokens(self, seq_len: int, cp: int) -> int:
    """Tokens per rank in the local region, S / cp - R; raises if R does not fit."""
    shard = seq_len // cp
    if self.shared_tokens > shard:
      raise ValueError(f"DocumentPlacement(shared_tokens={self.shared_tokens}) does not fit a shard of "
                       f"{shard} tokens (S={seq_len}, cp={cp}); use shared_tokens <= S / cp.")
    return shard - self.shared_tokens


# ---------------------------------------------------------------- one row


# Segment ranks besides 0 .. cp-1: shared in group j (shared_code(j); SHARED: group 0, or all
# ranks), left out, or (while _assign runs) not placed yet.
SHARED, EVICTED, _UNPLACED = -1, -(1 << 40), -(1 << 41)


def shared_code(group: int) -> int:
  return SHARED - group


def _is_shared(rank: np.ndarray) -> np.ndarray:
  return (rank < 0) & (rank > EVICTED)


@dataclasses.dataclass
class _Segments:
  """The runs of one row and the segments (non-zero ids) they form."""
  run_start: np.ndarray   # int64 [n_runs]
  run_len: np.ndarray     # int64 [n_runs]
  run_seg: np.ndarray     # int64 [n_runs]: segment index, -1 for padding runs
  length: np.ndarray      # int64 [n_segs]: tokens of each segment


def _segments(row: np.ndarray) -> _Segments:
  s = row.shape[0]
  change = np.flatnonzero(row[1:] != row[:-1]) + 1
  start = np.concatenate([[0], change]).astype(np.int64)
  length = np.diff(np.concatenate([start, [s]])).astype(np.int64)
  ids = row[start]
  real = ids != 0
  run_seg = np.full(start.shape, -1, np.int64)
  if real.any():
    # Segments numbered by first occurrence (a reused id joins its runs into one segment).
    _, first, inv = np.unique(ids[real], return_index=True, return_inverse=True)
    by_first = np.argsort(first, kind="stable")
    rank_of = np.empty_like(by_first)
    rank_of[by_first] = np.arange(by_first.size)
    run_seg[real] = rank_of[inv]
  n_segs = int(run_seg.max()) + 1 if real.any() else 0
  seg_len = np.bincount(run_seg[real], weights=length[real], minlength=n_segs).astype(np.int64)
  return _Segments(start, length, run_seg, seg_len)


def _assign(length: np.ndarray, cost: np.ndarray, cp: int, capacity: int, r_tokens: int,
            tolerance: float, evict: bool, group: int):
  """(rank of every segment: r >= 0 local, shared_code(j) shared in group j, or EVICTED; max /
  mean cost), or None.

  The ranks form cp / group groups, each with a shared stream of group * R tokens whose cost its
  ranks split evenly. For k = 0, 1, ...: the k largest segments (at least every one longer than a
  local region) are shared, each in the group whose ranks carry the least shared cost and that
  has room; the rest go longest first to the cheapest rank with room (LPT); one that finds no
  room goes to a group's shared stream if one has room left (the exchange moves R tokens per rank
  whether or not they are used, so filling it is free), else it is evicted (evict=True) or that k
  fails. An assignment outside `tolerance` is then improved by _rebalance.
  Scored by the costliest rank over the mean, times the tokens of the row over those placed;
  the first k within `tolerance` on both counts wins, else the best score. None when no k fits.
  """
  n = length.size
  n_groups = cp // group
  total = max(int(length.sum()), 1)
  order = np.argsort(-length, kind="stable")
  n_must = int((length > capacity).sum())
  pre_evicted = np.zeros(n, bool)
  if evict:  # segments too long for a local region that no shared stream can take either
    room = np.full(n_groups, group * r_tokens, np.int64)
    for g in order[:n_must]:
      j = int(np.argmax(room))
      if length[g] <= room[j]:
        room[j] -= length[g]
      else:
        pre_evicted[g] = True
    must = order[:n_must]
    order = np.concatenate([must[~pre_evicted[must]], order[n_must:], must[pre_evicted[must]]])
    n_must -= int(pre_evicted.sum())
    n -= int(pre_evicted.sum())
  best = None
  for k in range(n_must, n + 1):
    rank = np.where(pre_evicted, EVICTED, _UNPLACED).astype(np.int64)
    group_room = np.full(n_groups, group * r_tokens, np.int64)
    group_cost = np.zeros(n_groups)

    def share(g, j):
      rank[g] = shared_code(j)
      group_room[j] -= length[g]
      group_cost[j] += cost[g]

    shared_groups = _group_assignment(order[:k], length, cost, n_groups, group * r_tokens)
    if shared_groups is None:
      break
    for g, j in zip(order[:k], shared_groups):
      share(g, j)
    if n_groups > 1:  # the same moves and swaps between the groups' shared streams
      in_group = np.where(_is_shared(rank), SHARED - rank, -1)
      _rebalance(length, cost, in_group, group_cost, group_room)
      rank = np.where(in_group >= 0, SHARED - in_group, rank)
    placed = total - int(length[pre_evicted].sum())
    # Per segment, in Python lists: numpy's per-call overhead on arrays of cp values was most of
    # the search's time.
    load_l = np.repeat(group_cost / group, group).tolist()
    room_l = [capacity] * cp
    fits = True
    for g in order[k:n].tolist():
      lg, cg = int(length[g]), float(cost[g])
      r = _cheapest_open(load_l, room_l, lg)
      if r >= 0:
        rank[g] = r
        load_l[r] += cg
        room_l[r] -= lg
      elif (fits_group := np.flatnonzero(group_room >= lg)).size:
        j = fits_group[np.argmin(group_cost[fits_group])]  # the cheapest group with room
        share(g, j)
        for r in range(j * group, (j + 1) * group):
          load_l[r] += cg / group
      elif evict:
        rank[g] = EVICTED
        placed -= lg
      else:
        fits = False
        break
    if not fits:
      continue
    load, room = np.array(load_l), np.array(room_l, np.int64)
    if load.max() > (1.0 + tolerance) * load.mean():
      _rebalance(length, cost, rank, load, room)
    mean = load.mean()
    imbalance = float(load.max() / mean) if mean > 0 else 1.0
    score = imbalance * total / max(placed, 1)
    if best is None or score < best[2] - 1e-12:
      best = (rank, imbalance, score)
    if imbalance <= 1.0 + tolerance and total <= placed * (1.0 + tolerance):
      break
  return None if best is None else best[:2]


def _cheapest_open(load: list, room: list, length: int) -> int:
  """The rank of least load (the first of equals) with room for `length` tokens, or -1."""
  best, best_load = -1, math.inf
  for r, (l, left) in enumerate(zip(load, room)):
    if left >= length and l < best_load:
      best, best_load = r, l
  return best


# Group assignments of the largest shared segments tried (see _group_assignment), with at most
# _GROUP_SEARCH_MAX_GROUPS groups (more groups: longest first alone).
_GROUP_SEARCH, _GROUP_SEARCH_MAX_GROUPS = 64, 4


def _group_assignment(segs, length, cost, n_groups: int, room: int):
  """The group of each of `segs` (longest first) in the shared streams (`room` tokens each), or
  None when they do not fit: longest first into the cheapest group with room, after the groups
  of the largest few that leave the costliest group cheapest (every assignment of the first m,
  n_groups ** m <= _GROUP_SEARCH, is tried: longest first alone lands a few percent above even
  when the streams are nearly full)."""
  m = 0
  while 1 < n_groups <= _GROUP_SEARCH_MAX_GROUPS and m < len(segs) and n_groups ** (m + 1) <= _GROUP_SEARCH:
    m += 1
  lens, costs = [int(length[g]) for g in segs], [float(cost[g]) for g in segs]
  best = None
  for head in itertools.product(range(n_groups), repeat=m):
    left, load, groups = [room] * n_groups, [0.0] * n_groups, list(head)
    for i, l in enumerate(lens):
      if i >= m:
        open_groups = [j for j in range(n_groups) if left[j] >= l]
        groups.append(min(open_groups, key=load.__getitem__) if open_groups else -1)
      j = groups[i]
      if j < 0 or left[j] < l:
        break
      left[j] -= l
      load[j] += costs[i]
      if best is not None and load[j] >= best[0]:
        break  # loads only grow: this head cannot beat the best
    else:
      if best is None or max(load) < best[0]:
        best = (max(load), groups)
  return None if best is None else best[1]


def _rebalance(length: np.ndarray, cost: np.ndarray, rank: np.ndarray, load: np.ndarray, room: np.ndarray):
  """Local search after the longest-first assignment (rank, load and room updated in place):
  while some segment of the costliest rank can move to another rank, or trade places with a
  cheaper segment there, so that the costliest of the two ends below it (room permitting), take
  the move that lowers it most (of equal gains, the first by destination rank, moves before
  swaps, then by segment). Longest-first leaves a few percent that this recovers (lognormal rows
  at 4 ranks: 2-3% above the mean down to 1.5-2%, often with no shared region at all)."""
  cp = load.size
  ranks = np.arange(cp)
  for _ in range(4 * max(rank.size, 1)):
    m = int(np.argmax(load))
    mine = np.flatnonzero(rank == m)
    if not mine.size:
      return
    c_mine, l_mine = cost[mine][:, None], length[mine][:, None]
    # Moves: segment i of m to rank r, gain [i, r].
    move = load[m] - np.maximum(load[m] - c_mine, load[None, :] + c_mine)
    move = np.where((l_mine <= room[None, :]) & (ranks[None, :] != m), move, -np.inf)
    # Swaps: segment i of m for segment j of another rank, gain [i, j].
    others = np.flatnonzero((rank >= 0) & (rank < cp) & (rank != m))
    their_rank = rank[others]
    dc = c_mine - cost[others][None, :]
    dl = l_mine - length[others][None, :]
    fit = (dl <= room[their_rank][None, :]) & (-dl <= room[m]) & (dc > 0)
    swap = np.where(fit, load[m] - np.maximum(load[m] - dc, load[their_rank][None, :] + dc), -np.inf)
    top = max(move.max(), swap.max() if swap.size else -np.inf)
    if not top > 1e-9 * load[m]:
      return
    keys = [(r, 0, i, 0) for i, r in zip(*np.nonzero(move == top))]
    keys += [(their_rank[j], 1, i, others[j]) for i, j in zip(*np.nonzero(swap == top))]
    r, kind, i, e = min(keys)
    _trade(length, cost, rank, load, room, mine[i], e if kind else None, m, int(r))


def _trade(length, cost, rank, load, room, d: int, e, m: int, r: int):
  """Segment d moves from rank m to rank r and, unless e is None, segment e from r to m (rank,
  load and room updated in place)."""
  for g, src, dst in ((d, m, r),) + (((e, r, m),) if e is not None else ()):
    rank[g] = dst
    load[src] -= cost[g]
    load[dst] += cost[g]
    room[src] += length[g]
    room[dst] -= length[g]


def _zigzag_ranks(stream_seg: np.ndarray, cp: int) -> np.ndarray:
  """Rank of every token of the shared stream: each run cut into 2 * cp zigzag pieces, every
  rank taking exactly len(stream) / cp tokens (load_balance's "zigzag_docs")."""
  return zigzag_docs_ranks(stream_seg[None], cp, np)[0]


def _segment_costs(length: np.ndarray, token_cost: float, pair_cost: float) -> np.ndarray:
  """token_cost * L + pair_cost * L**2 of every segment length L."""
  return token_cost * length + pair_cost * length.astype(np.float64) ** 2


def _row_assignment(seg: _Segments, cp: int, placement: DocumentPlacement, evict: bool, s: int):
  """(rank of every segment, max / mean cost) of one row's segments, or None when R is too small."""
  cost = _segment_costs(seg.length, placement.token_cost, placement.pair_cost)
  return _assign(seg.length, cost, cp, placement.local_tokens(s, cp), placement.shared_tokens,
                 placement.tolerance, evict, placement.group_size(cp))


def _row_permutation(row: np.ndarray, cp: int, placement: DocumentPlacement, evict: bool = False):
  """(perm [S] int32, max / mean cost, evicted [S] bool) of one row, or None when R is too small.

  evict=True: a local segment that finds no room is left out (its tokens are marked evicted and
  placed like padding; the caller turns them into padding and packs them elsewhere)."""
  seg = _segments(row)
  assigned = _row_assignment(seg, cp, placement, evict, row.shape[0])
  if assigned is None:
    return None
  perm, evicted = _layout(row, seg, assigned[0], cp, placement)
  return perm, assigned[1], evicted


def _layout(row: np.ndarray, seg: _Segments, seg_rank: np.ndarray, cp: int, placement: DocumentPlacement):
  """(perm [S] int32, evicted [S] bool) of one row whose segments go to seg_rank."""
  s = row.shape[0]
  shard = s // cp
  r_tokens = placement.shared_tokens
  group = placement.group_size(cp)
  if group == cp and r_tokens == shard and _takes_blocks(r_tokens):
    perm = _blocks_perm(row, cp).astype(np.int32)
    return perm, np.zeros(s, bool)
  capacity = shard - r_tokens
  real_run = seg.run_seg >= 0
  # Padding runs and evicted segments' runs are laid out as padding.
  run_rank = np.full(seg.run_seg.shape, EVICTED, np.int64)
  run_rank[real_run] = seg_rank[seg.run_seg[real_run]]
  dest_start = np.zeros(seg.run_start.shape, np.int64)
  # Local runs: in row order after each other at the start of their rank's shard.
  local = run_rank >= 0
  if local.any():
    idx = np.flatnonzero(local)
    by_rank = idx[np.argsort(run_rank[idx], kind="stable")]
    lens = seg.run_len[by_rank]
    ranks = run_rank[by_rank]
    before = np.cumsum(lens) - lens
    first_of_rank = np.searchsorted(ranks, ranks)           # ranks is sorted
    dest_start[by_rank] = ranks * shard + before - before[first_of_rank]
  dest = np.full(s, -1, np.int64)
  token_run = np.repeat(np.arange(seg.run_start.size), seg.run_len)
  offset_in_run = np.arange(s) - seg.run_start[token_run]
  is_local = local[token_run]
  dest[is_local] = dest_start[token_run[is_local]] + offset_in_run[is_local]

  # Shared runs: each group's stream in row order, padded to group * R and laid out over the
  # group's shared regions.
  token_code = run_rank[token_run]
  for j in range(cp // group):
    shared_tok = np.flatnonzero(token_code == shared_code(j))
    stream = np.zeros(group * r_tokens, row.dtype)
    stream[:shared_tok.size] = row[shared_tok]
    if stream.size:
      dest[shared_tok] = (_stream_places(stream, group, r_tokens, shard, capacity) + j * group * shard)[:shared_tok.size]

  # Padding fills every slot left: local gaps and the shared streams' tails.
  used = np.zeros(s, bool)
  used[dest[dest >= 0]] = True
  pad_tok = np.flatnonzero(dest < 0)
  dest[pad_tok] = np.flatnonzero(~used)
  perm = np.empty(s, np.int32)
  perm[dest] = np.arange(s, dtype=np.int32)
  evicted = ((run_rank == EVICTED) & real_run)[token_run]
  return perm, evicted


def _takes_blocks(r_tokens: int) -> bool:
  """Whether a shared region of R tokens per rank takes blocks (else zigzag pieces)."""
  return r_tokens > 0 and r_tokens % ALL_SHARED_BLOCK == 0


def _blocks_perm(x: np.ndarray, ranks: int) -> np.ndarray:
  """Permutation of the tokens x (a multiple of ranks * ALL_SHARED_BLOCK) that deals their blocks
  of ALL_SHARED_BLOCK tokens to `ranks` ranks, the same number each, evening causal work: heaviest
  block first to the least loaded rank with room (longest processing time first; within 1% of
  even at 8 blocks a rank on packed rows, where dealing in snake order lands up to 18% off).
  Rank r's blocks, in their original order, fill [r * n / ranks, (r + 1) * n / ranks)."""
  idx, real, doc_start = document_layout(x[None], np)
  work = np.where(real, idx - doc_start + 1, 0)[0].reshape(-1, ALL_SHARED_BLOCK).sum(-1)
  per_rank = work.size // ranks
  rank = np.empty(work.size, np.int64)
  heap = [(0, r) for r in range(ranks)]   # (load, rank) of the ranks with room
  count = [0] * ranks
  for b in np.argsort(-work, kind="stable"):
    load, r = heapq.heappop(heap)
    rank[b] = r
    count[r] += 1
    if count[r] < per_rank:
      heapq.heappush(heap, (load + int(work[b]), r))
  order = np.argsort(rank, kind="stable")
  return (order[:, None] * ALL_SHARED_BLOCK + np.arange(ALL_SHARED_BLOCK)).reshape(x.size)


def _stream_places(stream: np.ndarray, group: int, r_tokens: int, shard: int, capacity: int) -> np.ndarray:
  """Where each token of a shared stream (group * R tokens, in row order, padding at the end)
  goes, counted from the start of its group's first shard: the shared region (the last R tokens)
  of one of the group's ranks: blocks of 128 tokens (_blocks_perm; zigzag pieces when R is not a
  multiple of 128; see ALL_SHARED_BLOCK)."""
  n = stream.size
  if _takes_blocks(r_tokens):
    perm = _blocks_perm(stream, group)
    places = np.empty(n, np.int64)
    places[perm] = np.arange(n)          # rank-major: rank places // R, slot places % R
    return places // r_tokens * shard + capacity + places % r_tokens
  stream_rank = _zigzag_ranks(stream, group)
  order = np.argsort(stream_rank, kind="stable")
  slot = np.empty(n, np.int64)
  slot[order] = np.arange(n) - np.repeat(np.arange(group) * r_tokens, r_tokens)
  return stream_rank.astype(np.int64) * shard + capacity + slot


# ---------------------------------------------------------------- batches


def check_cp_size(cp_size) -> int:
  """cp_size as an int >= 1, or a ValueError that names it."""
  if isinstance(cp_size, bool):
    raise ValueError(f"cp_size must be a static Python int >= 1, got {cp_size!r}.")
  try:
    cp = operator.index(cp_size)
  except TypeError:
    raise ValueError(
        f"cp_size must be a static Python int >= 1 (the number of context-parallel ranks), got "
        f"{type(cp_size).__name__}; pass it as a Python int, not a traced value."
    ) from None
  if cp < 1:
    raise ValueError(f"cp_size must be >= 1 (the number of context-parallel ranks), got {cp}.")
  return cp


def _check_segments(segment_ids, cp: int):
  if not hasattr(segment_ids, "shape") or np.ndim(segment_ids) < 1:
    raise ValueError("segment_ids must be an integer array of shape [..., S].")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids must have an integer dtype, got {segment_ids.dtype}.")
  s = segment_ids.shape[-1]
  if s % cp:
    raise ValueError(f"document placement needs the sequence length to be a multiple of cp_size = {cp}, "
                     f"got {s}; pad the rows (segment id 0) to a multiple of {cp}.")


def place_rows(seg: np.ndarray, cp: int, placement: DocumentPlacement, evict: bool = False):
  """(perm [..., S] int32, imbalance [...], evicted [..., S] bool) of a numpy batch; raises
  ValueError naming the row when one does not fit (evict=False) or when its segments longer
  than a local region overflow the shared one (either way)."""
  rows = seg.reshape(-1, seg.shape[-1])
  perms = np.empty(rows.shape, np.int32)
  imbalance = np.ones(rows.shape[0])
  evicted = np.zeros(rows.shape, bool)
  for b, row in enumerate(rows):
    if cp == 1:
      perms[b] = np.arange(row.size, dtype=np.int32)
      continue
    placed = _row_permutation(row, cp, placement, evict)
    if placed is None:
      raise ValueError(
          f"row {b}: its segments do not fit DocumentPlacement(shared_tokens={placement.shared_tokens}) "
          f"over cp={cp} ranks: segments longer than a local region (S / cp - R = "
          f"{placement.local_tokens(row.size, cp)} tokens) must be shared, the shared region holds "
          f"cp * R = {cp * placement.shared_tokens} tokens, and each rank's local segments must fit its "
          f"local region (padding fills the gaps, so full rows rarely fit). Pick R per batch with "
          f"jaxcp.choose_placement, use a larger shared_tokens (S / cp always fits), or let "
          f"jaxcp.data.place_batch leave out what does not fit.")
    perms[b], imbalance[b], evicted[b] = placed
  return perms.reshape(seg.shape), imbalance.reshape(seg.shape[:-1]), evicted.reshape(seg.shape)


def placement_permutation(segment_ids, cp_size: int, placement: DocumentPlacement):
  """The token permutation of a DocumentPlacement: numpy in, numpy out; JAX (traced) in, the same
  numpy computation through jax.pure_callback. See load_balance_permutation."""
  cp = check_cp_size(cp_size)
  _check_segments(segment_ids, cp)
  placement.check_ranks(cp)
  placement.local_tokens(segment_ids.shape[-1], cp)
  if isinstance(segment_ids, (np.ndarray, np.generic)):
    return place_rows(np.asarray(segment_ids), cp, placement)[0]
  result = jax.ShapeDtypeStruct(segment_ids.shape, jnp.int32)
  host = functools.partial(_host_permutation, cp=cp, placement=placement)
  return jax.pure_callback(host, result, segment_ids, vmap_method="expand_dims")


def _host_permutation(seg, *, cp, placement):
  return place_rows(np.asarray(seg), cp, placement)[0]


def shared_sizes(seq_len: int, cp_size: int, fractions=DEFAULT_SHARED_FRACTIONS) -> tuple[int, ...]:
  """Static shared-region sizes for choose_placement: the given fractions of S / cp, rounded up
  to a multiple of 128 tokens where the shard allows, ascending, always ending with S / cp."""
  cp = check_cp_size(cp_size)
  shard = seq_len // cp
  sizes = set()
  for f in fractions:
    r = int(np.ceil(f * shard))
    if shard >= 128:
      r = min(shard, -(-r // 128) * 128)
    sizes.add(min(r, shard))
  sizes.add(shard)
  return tuple(sorted(sizes))


def exchange_cost(q_heads: int, kv_heads: int, head_dim: int, *, v_head_dim: int | None = None, itemsize: int = 2,
                  pair_cost: float = DEFAULT_PAIR_COST, pair_seconds: float = DEFAULT_PAIR_SECONDS,
                  bytes_per_second: float = DEFAULT_EXCHANGE_BYTES_PER_S) -> float:
  """What a rank pays for one shared token it receives, in the placement's cost units (those of
  ``token_cost`` and ``pair_cost``), for :func:`choose_placement`'s ``exchange_cost``.

  A received token brings its K and V in the forward and sends back their dK/dV partials in the
  backward: ``2 * kv_heads * (head_dim + v_head_dim) * itemsize`` bytes at ``bytes_per_second``.
  A cost unit is ``1 / (2 * pair_cost)`` allowed pairs (a causal segment of L tokens has about
  L**2 / 2), each ``pair_seconds * q_heads * head_dim`` seconds. The defaults are H200 numbers
  (benchmarks/calibrate_placement.py measures both on other hardware). The exchange is charged
  whole: at the sizes the placement chooses, the local part it runs under is short (measured on
  4 H200s: the exposed time was that of all the bytes at this rate).
  """
  dv = head_dim if v_head_dim is None else v_head_dim
  for name, value in (("q_heads", q_heads), ("kv_heads", kv_heads), ("head_dim", head_dim), ("v_head_dim", dv),
                      ("itemsize", itemsize)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"exchange_cost: {name} must be an int >= 1, got {value!r}.")
  for name, value in (("pair_cost", pair_cost), ("pair_seconds", pair_seconds), ("bytes_per_second", bytes_per_second)):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value > 0:
      raise ValueError(f"exchange_cost: {name} must be a number > 0, got {value!r}.")
  seconds = 2 * kv_heads * (head_dim + dv) * itemsize / bytes_per_second
  unit_seconds = pair_seconds * q_heads * head_dim / (2 * pair_cost)
  return float(seconds / unit_seconds)


def choose_placement(segment_ids, cp_size: int, sizes=None, *, token_cost: float = DEFAULT_TOKEN_COST,
                     pair_cost: float = DEFAULT_PAIR_COST, tolerance: float = DEFAULT_TOLERANCE, groups=None,
                     exchange_cost: float | None = None):
  """The DocumentPlacement for one batch and its permutation. With ``exchange_cost``: the
  candidate of least predicted time, the costliest rank's work plus the exchange (see below).
  Without: the smallest shared size that places every row within `tolerance` of even work, else
  the one whose worst row is the most even (the largest, S / cp, always fits). Numpy only (an
  input pipeline's job).

  Args:
    segment_ids: int array [B, S] (numpy), the batch's rows in their original order.
    cp_size: context-parallel ranks.
    sizes: ascending static shared sizes to choose from (default: shared_sizes(S, cp_size));
      each distinct size compiles its own program, so keep the list short.
    token_cost, pair_cost, tolerance: as in DocumentPlacement.
    groups: the shared group sizes to choose from (DocumentPlacement.shared_group; each divides
      cp_size; default: cp_size alone, every shared segment over all ranks). The candidates
      (group g, size R) are tried by the tokens a rank receives, (g - 1) * R, fewest first.
    exchange_cost: the cost of one token a rank receives (:func:`jaxcp.exchange_cost` of the
      model's heads and head dim), or None. Given, every candidate that places every row is
      scored by its predicted time, the sum over rows of the costliest rank's cost plus
      exchange_cost * (g - 1) * R per row, and the least wins: a shared region pays for itself
      only where it evens the work by more than its exchange costs (at 16 query heads per 16 key
      heads an exchanged token costs four times what it does at 32 per 8).

  Returns:
    (placement, perm [B, S] int32, imbalance [B]: each row's costliest rank over the mean).
  """
  placement, perm, imbalance, _ = choose_with_eviction(
      segment_ids, cp_size, sizes, token_cost=token_cost, pair_cost=pair_cost, tolerance=tolerance, evict=False,
      groups=groups, exchange_cost=exchange_cost)
  return placement, perm, imbalance


def choose_with_eviction(segment_ids, cp_size: int, sizes=None, *, token_cost: float = DEFAULT_TOKEN_COST,
                         pair_cost: float = DEFAULT_PAIR_COST, tolerance: float = DEFAULT_TOLERANCE,
                         evict: bool = True, max_evicted: float = 0.02, groups=None,
                         exchange_cost: float | None = None):
  """choose_placement that may leave segments out (evict=True): a local segment that finds no
  room in its row is marked evicted (an input pipeline packs it into a later row). A candidate
  qualifies when at most `max_evicted` of the batch's tokens are left out; without
  exchange_cost the first one with every row within `tolerance` of even work is taken. Returns
  (placement, perm, imbalance, evicted [B, S] bool)."""
  seg = np.asarray(segment_ids)
  cp = check_cp_size(cp_size)
  _check_segments(seg, cp)
  s = seg.shape[-1]
  sizes = shared_sizes(s, cp) if sizes is None else tuple(sorted(int(r) for r in sizes))
  if not sizes or sizes[-1] > s // cp or sizes[0] < 0:
    raise ValueError(f"sizes must be shared-region sizes in [0, S / cp = {s // cp}], got {sizes}.")
  groups = (cp,) if groups is None else tuple(int(g) for g in groups)
  if not groups or any(g < 1 or cp % g for g in groups):
    raise ValueError(f"groups must be group sizes that divide cp_size = {cp}, got {groups}.")
  # (g, R) by the tokens a rank receives, then the larger group (the same exchange, fewer limits).
  candidates = sorted({(g, r) for g in groups for r in sizes}, key=lambda c: ((c[0] - 1) * c[1], c[1], -c[0]))
  rows = seg.reshape(-1, s)
  segments = [_segments(row) for row in rows]
  real_tokens = max(int((seg != 0).sum()), 1)
  placements = [DocumentPlacement(r, token_cost, pair_cost, tolerance, cp_size=cp, shared_group=None if g == cp else g)
                for g, r in candidates]
  computed = {}  # (candidate, row) -> _row_assignment, each computed once

  def assignment(c, b):
    if (c, b) not in computed:
      seg_b = segments[b]
      computed[c, b] = (_row_assignment(seg_b, cp, placements[c], evict, s) if cp > 1
                        else (np.zeros(seg_b.length.size, np.int64), 1.0))
    return computed[c, b]

  def left_out(a, b):
    return int(segments[b].length[a[0] == EVICTED].sum())

  taken = None
  if exchange_cost is not None:
    even = [float(_segment_costs(g.length, token_cost, pair_cost).sum()) / cp for g in segments]
    taken = _fastest_candidate(candidates, even, assignment, left_out, _check_exchange_cost(exchange_cost),
                               max_evicted * real_tokens)
  # The first candidate that places every row within tolerance, leaving out at most max_evicted.
  # A candidate is dropped at its first failing row, and the row that failed last is tried first.
  order = list(range(len(segments)))
  for c in range(len(candidates) if taken is None else 0):
    out = 0
    for b in order:
      a = assignment(c, b)
      out += 0 if a is None else left_out(a, b)
      if a is None or a[1] > 1.0 + tolerance or out > max_evicted * real_tokens:
        order.remove(b)
        order.insert(0, b)
        break
    else:
      taken = c
      break
  if taken is None:  # none does: the most even worst row (times the share left out)
    scores = []
    for c in range(len(candidates)):
      rows_c = [assignment(c, b) for b in range(len(segments))]
      if any(a is None for a in rows_c):
        continue
      worst = max((a[1] for a in rows_c), default=1.0)
      scores.append((worst * (1.0 + sum(left_out(a, b) for b, a in enumerate(rows_c)) / real_tokens), c))
    if not scores:
      raise ValueError(f"no size in {sizes} (groups {groups}) places every row; add S / cp = {s // cp} with the "
                       f"group size cp_size (always fits).")
    taken = min(scores)[1]
  placement, assigned = placements[taken], [assignment(taken, b) for b in range(len(segments))]
  perms = np.empty(rows.shape, np.int32)
  evicted = np.zeros(rows.shape, bool)
  for b, (row, g, a) in enumerate(zip(rows, segments, assigned)):
    if cp == 1:
      perms[b] = np.arange(s, dtype=np.int32)
    else:
      perms[b], evicted[b] = _layout(row, g, a[0], cp, placement)
  imbalance = np.array([a[1] for a in assigned]).reshape(seg.shape[:-1])
  return placement, perms.reshape(seg.shape), imbalance, evicted.reshape(seg.shape)


def _check_exchange_cost(value) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value >= 0:
    raise ValueError(f"exchange_cost must be a number >= 0 (cost units per token a rank receives: "
                     f"jaxcp.exchange_cost(q_heads, kv_heads, head_dim)) or None, got {value!r}.")
  return float(value)


def _fastest_candidate(candidates, even, assignment, left_out, exchange: float, max_left_out: float):
  """Index of the candidate (g, R) of least predicted time among those that place every row,
  leaving out at most max_left_out tokens (None when none does): the sum over rows of the
  costliest rank's cost (imbalance times the row's even share, `even`) plus exchange * (g - 1) * R.
  Candidates come fewest received tokens first, so once the exchange alone (with every row
  perfectly even) reaches the best time, no later candidate can win."""
  best, taken = np.inf, None
  for c, (g, r) in enumerate(candidates):
    predicted = sum(even) + exchange * (g - 1) * r * len(even)  # a lower bound until every row is in
    if predicted >= best:
      break
    out = 0
    for b, m in enumerate(even):  # rows in turn; a candidate stops once it cannot win
      a = assignment(c, b)
      if a is None:
        break
      out += left_out(a, b)
      predicted += (a[1] - 1.0) * m
      if out > max_left_out or predicted >= best * (1 - 1e-9):
        break
    else:
      best, taken = predicted, c
  return taken


def placement_violations(permuted_segment_ids, cp_size: int, placement: DocumentPlacement) -> list[str]:
  """What makes a permuted layout unfit for `placement` (empty when it is fit): a segment id in
  the local region of two ranks, in a local region and the shared region, or (shared_group) in
  the shared regions of two groups. Numpy; for tests and for checking a data pipeline."""
  seg = np.asarray(permuted_segment_ids)
  cp = check_cp_size(cp_size)
  s = seg.shape[-1]
  capacity = placement.local_tokens(s, cp)
  group = placement.group_size(cp)
  problems = []
  for b, row in enumerate(seg.reshape(-1, s)):
    shards = row.reshape(cp, s // cp)
    owner = {}
    shared = set(np.unique(shards[:, capacity:])) - {0}
    group_of = {}
    for j in range(cp // group):
      for sid in set(np.unique(shards[j * group:(j + 1) * group, capacity:])) - {0}:
        if group_of.setdefault(sid, j) != j:
          problems.append(f"row {b}: segment {sid} is shared in groups {group_of[sid]} and {j}")
    for r in range(cp):
      for sid in set(np.unique(shards[r, :capacity])) - {0}:
        if sid in shared:
          problems.append(f"row {b}: segment {sid} is local on rank {r} and in the shared region")
        elif owner.setdefault(sid, r) != r:
          problems.append(f"row {b}: segment {sid} is local on ranks {owner[sid]} and {r}")
  return problems
