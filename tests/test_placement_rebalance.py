"""The placement's local search (_rebalance) takes, step by step, the move or swap that a plain loop
over destination ranks takes: the best gain, and of equal gains the first by destination rank,
moves before swaps, then by segment. Layouts then stay the same whatever way it is computed."""
import numpy as np
from hypothesis import given, settings, strategies as st

from jaxcp._src.attention.placement import _rebalance, _trade


def _rebalance_loop(length, cost, rank, load, room):
  """Reference: every destination rank in turn, its best move, then its best swap."""
  cp = load.size
  for _ in range(4 * max(rank.size, 1)):
    m = int(np.argmax(load))
    mine = np.flatnonzero(rank == m)
    if not mine.size:
      return
    best_gain, best = 1e-9 * load[m], None
    for r in range(cp):
      if r == m:
        continue
      fit = length[mine] <= room[r]
      gain = np.where(fit, load[m] - np.maximum(load[m] - cost[mine], load[r] + cost[mine]), -np.inf)
      i = int(np.argmax(gain))
      if gain[i] > best_gain:
        best_gain, best = gain[i], (mine[i], None, r)
      theirs = np.flatnonzero(rank == r)
      if not theirs.size:
        continue
      dc = cost[mine][:, None] - cost[theirs][None, :]
      dl = length[mine][:, None] - length[theirs][None, :]
      fit = (dl <= room[r]) & (-dl <= room[m]) & (dc > 0)
      gain = np.where(fit, load[m] - np.maximum(load[m] - dc, load[r] + dc), -np.inf)
      i, j = np.unravel_index(int(np.argmax(gain)), gain.shape)
      if gain[i, j] > best_gain:
        best_gain, best = gain[i, j], (mine[i], theirs[j], r)
    if best is None:
      return
    d, e, r = best
    _trade(length, cost, rank, load, room, d, e, m, r)


@st.composite
def assignments(draw):
  """Segments on cp ranks (some off every rank: shared or evicted codes), costs a*L + b*L^2 (ties
  likely: lengths from a small set), each rank's room what its capacity leaves."""
  cp = draw(st.integers(2, 9))
  n = draw(st.integers(1, 40))
  length = np.array(draw(st.lists(st.sampled_from([1, 2, 3, 5, 8, 64, 100, 128]), min_size=n, max_size=n)),
                    np.int64)
  cost = 3.0 * length + 0.5 * length.astype(float) ** 2
  rank = np.array(draw(st.lists(st.integers(-3, cp - 1), min_size=n, max_size=n)), np.int64)
  on = rank >= 0
  load = np.bincount(rank[on], weights=cost[on], minlength=cp).astype(float)
  used = np.bincount(rank[on], weights=length[on], minlength=cp).astype(np.int64)
  capacity = int(used.max()) + draw(st.integers(0, 200))
  return length, cost, rank, load, capacity - used


@settings(max_examples=300, deadline=None)
@given(case=assignments())
def test_rebalance_takes_the_loops_moves(case):
  length, cost, rank, load, room = case
  got = [a.copy() for a in (rank, load, room)]
  want = [a.copy() for a in (rank, load, room)]
  _rebalance(length, cost, *got)
  _rebalance_loop(length, cost, *want)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[2], want[2])
  assert got[1].max() <= load.max()  # never worse than it started
