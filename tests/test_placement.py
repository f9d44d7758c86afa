"""Document placement (context_parallel=DocumentPlacement): the layout's invariants, values and
gradients equal to the unsharded call on 8 host devices (jit partitioning with cp, dp x cp and
tp x cp meshes, shard_map, every mask, GQA), and a compiled HLO that gathers only the shared
region and never Q."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcp
from jaxcp._src.attention.context_parallel import _sort_block
from jaxcp._src.attention.placement import place_rows, placement_violations, shared_sizes
from jaxcp._src.compat import shard_map
from jaxcp._src.masks import positions_from_segments

from .helpers import (placement_gathers, placement_trades, positions_in_documents, rel_err, self_attention_rows_close,
                      sorts_keys, trades_keys)
from .strategies import packed_row

B, S, HQ, HKV, D = 2, 64, 4, 2, 8
MASKS = {
    "causal": dict(is_causal=True),
    "full": dict(),
    "window": dict(is_causal=True, local_window_size=(9, 0)),
    "chunk": dict(is_causal=True, chunk_size=12),
}


def _rows():
  """Row 0: short documents and a tail of padding; row 1: one document longer than a shard."""
  seg = np.zeros((B, S), np.int32)
  seg[0, :56] = np.repeat(np.arange(1, 9), [3, 5, 13, 2, 9, 11, 7, 6])
  seg[1, :40] = 1
  seg[1, 44:52] = 2
  return seg


def _qkv(seed, hq=HQ, hkv=HKV):
  rng = np.random.default_rng(seed)
  shapes = [(B, S, hq, D), (B, S, hkv, D), (B, S, hkv, D), (B, S, hq, D)]
  return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def _fwd_bwd(strategy, mask, axis=None, implementation=None, remat=None):
  def run(q, k, v, dout, seg, pos):
    f = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, context_parallel=strategy,
                                        context_parallel_axis=axis, implementation=implementation, **mask)
    out, vjp = jax.vjp(remat(f) if remat else f, q, k, v)
    return (out, *vjp(dout))
  return run


def _placed(cp, sizes, seed=0, hq=HQ, hkv=HKV):
  """Inputs laid out by choose_placement (positions derived before permuting)."""
  seg = _rows()
  pos = np.asarray(positions_from_segments(jnp.asarray(seg)))
  placement, perm, _ = jaxcp.choose_placement(seg, cp, sizes=sizes)
  arrays = [*_qkv(seed, hq, hkv), seg, pos]
  return placement, [jaxcp.load_balance(jnp.asarray(x), cp, strategy=perm) for x in arrays]


def _check(got, want, tol=1e-5):
  for g, w in zip(got, want):
    assert rel_err(g, w) < tol


def _mesh(dp, tp, cp):
  return jax.sharding.Mesh(np.array(jax.devices("cpu")[:dp * tp * cp]).reshape(dp, tp, cp), ("dp", "tp", "cp"))


# ---------------------------------------------------------------- the layout


@st.composite
def placed_rows(draw):
  """Rows of documents short and long (some longer than a shard), reused ids, padding anywhere,
  all-padding rows and one-document rows; cp and a shared size."""
  cp = draw(st.sampled_from([2, 4, 8]))
  s = draw(st.sampled_from([64, 128, 512]))   # 512: all-shared rows take balanced blocks at cp 2, 4
  kind = draw(st.sampled_from(["packed", "packed", "one_document", "padding"]))
  rows = []
  for _ in range(2):
    if kind == "one_document":
      n = draw(st.integers(1, s))
      seg = np.zeros(s, np.int32)
      seg[:n] = 1
    elif kind == "padding":
      seg = np.zeros(s, np.int32)
    else:
      seg = draw(packed_row(s, {"short": (1, 6), "medium": (7, 20), "long": (21, s), "padding": (1, 12)}))[0]
    rows.append(seg)
  r = draw(st.sampled_from(shared_sizes(s, cp, (0, 1 / 8, 1 / 4, 1 / 2, 1))))
  return np.stack(rows), cp, r


@settings(max_examples=150, deadline=None)
@given(case=placed_rows())
def test_layout_invariants(case):
  seg, cp, r = case
  s = seg.shape[1]
  placement = jaxcp.DocumentPlacement(r)
  try:
    perm = jaxcp.load_balance_permutation(seg, cp, strategy=placement)
  except ValueError as e:
    assert "do not fit" in str(e)
    # It did not fit: evicting what finds no room always places the rest.
    perm, _, evicted = place_rows(seg, cp, placement, evict=True)
    seg = np.where(evicted, 0, seg)
  assert perm.dtype == np.int32 and perm.shape == seg.shape
  for row in perm:
    np.testing.assert_array_equal(np.sort(row), np.arange(s))
  placed = np.take_along_axis(seg, perm, 1)
  assert placement_violations(placed, cp, placement) == []
  np.testing.assert_array_equal(jaxcp.restore_order(placed, cp, strategy=perm), seg)
  # Every segment's tokens are all in one rank's local region or all in the shared region.
  shards = placed.reshape(seg.shape[0], cp, s // cp)
  local = shards[:, :, :s // cp - r]
  for b in range(seg.shape[0]):
    for sid in np.unique(seg[b][seg[b] != 0]):
      n_local = (local[b] == sid).sum(axis=1)
      assert n_local.sum() in (0, (seg[b] == sid).sum())
      assert (n_local > 0).sum() <= 1


@settings(max_examples=40, deadline=None)
@given(case=placed_rows())
def test_choose_placement_always_places(case):
  seg, cp, _ = case
  placement, perm, imbalance = jaxcp.choose_placement(seg, cp)
  assert placement.shared_tokens in shared_sizes(seg.shape[1], cp)
  assert placement_violations(np.take_along_axis(seg, perm, 1), cp, placement) == []
  assert imbalance.shape == (seg.shape[0],) and np.all(imbalance >= 1.0 - 1e-9)


def test_overflowing_rows_take_a_larger_shared_region():
  """A document longer than a local region must be shared; R too small for it raises, and
  choose_placement moves on to a size that fits."""
  cp = 4
  seg = np.zeros((1, 64), np.int32)
  seg[0, :30] = 1
  seg[0, 30:36] = 2
  with pytest.raises(ValueError, match="do not fit"):
    jaxcp.load_balance_permutation(seg, cp, strategy=jaxcp.DocumentPlacement(4))
  # (a tolerance that takes any balance: the smallest size that fits wins)
  placement, perm, _ = jaxcp.choose_placement(seg, cp, sizes=(0, 4, 8, 16), tolerance=10.0)
  assert placement.shared_tokens == 8   # document 1 shared: cp * R >= 30
  assert placement_violations(np.take_along_axis(seg, perm, 1), cp, placement) == []


def test_traced_permutation_equals_numpy():
  seg = _rows()
  placement, want, _ = jaxcp.choose_placement(seg, 4, sizes=(0, 8, 12, 16))
  got = jax.jit(lambda s: jaxcp.load_balance_permutation(s, 4, strategy=placement))(jnp.asarray(seg))
  np.testing.assert_array_equal(np.asarray(got), want)
  batched = jax.vmap(lambda s: jaxcp.load_balance_permutation(s, 4, strategy=placement))(jnp.asarray(seg))
  np.testing.assert_array_equal(np.asarray(batched), want)


def test_traced_permutation_raises_at_run_time_when_a_row_does_not_fit():
  seg = jnp.asarray(_rows())
  f = jax.jit(lambda s: jaxcp.load_balance_permutation(s, 4, strategy=jaxcp.DocumentPlacement(0)))
  with pytest.raises(Exception, match="do not fit"):
    jax.block_until_ready(f(seg))


def test_bad_arguments():
  with pytest.raises(ValueError, match="shared_tokens"):
    jaxcp.DocumentPlacement(-1)
  with pytest.raises(ValueError, match="pair_cost"):
    jaxcp.DocumentPlacement(4, pair_cost=-1.0)
  with pytest.raises(ValueError, match="multiple of cp_size"):
    jaxcp.load_balance_permutation(np.ones((1, 30), np.int32), 4, strategy=jaxcp.DocumentPlacement(0))
  with pytest.raises(ValueError, match="does not fit a shard"):
    jaxcp.load_balance_permutation(np.ones((1, 32), np.int32), 4, strategy=jaxcp.DocumentPlacement(9))
  with pytest.raises(ValueError, match="context_parallel must be"):
    q = jnp.zeros((1, 8, 2, 4))
    jaxcp.attention(q, q, q, context_parallel="placement")


# ---------------------------------------------------------------- attention on a placed layout


JIT_CASES = [((1, 1, 4), m) for m in MASKS] + [((1, 1, 8), "causal"), ((1, 1, 2), "chunk"),
                                               ((2, 1, 4), "causal"), ((2, 2, 2), "window")]


@pytest.mark.parametrize("mesh_shape,mask_name", JIT_CASES, ids=["x".join(map(str, m)) + "-" + n for m, n in JIT_CASES])
def test_jit_placement_matches_unsharded(cpu_devices, mesh_shape, mask_name):
  dp, tp, cp = mesh_shape
  placement, arrays = _placed(cp, sizes=shared_sizes(S, cp, (0, 1 / 4, 1 / 2, 1)))
  mesh = _mesh(dp, tp, cp)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", "tp", None)), NamedSharding(mesh, P("dp", "cp"))
  args = [jax.device_put(x, s) for x, s in zip(arrays, (s4, s4, s4, s4, s2, s2))]
  f = jax.jit(_fwd_bwd(placement, MASKS[mask_name]))
  text = f.lower(*args).compile().as_text()
  r = placement.shared_tokens
  assert placement.cp_size == cp
  want = jax.jit(_fwd_bwd("auto", MASKS[mask_name], implementation="xla"))(*arrays)
  if trades_keys(r, S // cp, cp, HQ, HKV):
    # Everything shared over 2 ranks: each trades its region with the other (one collective-permute
    # of packed K, V and key tokens, kept for the backward, and one of dK/dV back); nothing else.
    shapes, _ = placement_trades(text)
    assert "all-gather" not in text and "all-to-all" not in text and "reduce-scatter" not in text
    width = 2 * (HKV // tp) * D
    assert sorted(shapes) == sorted([[B // dp, r, width + 2], [B // dp, r, width]]), shapes
    _check(f(*args), want)
    return
  # Only the shared region is gathered (the gathered sequence is cp * R, never all of S) and only
  # K, V and the key tokens' arrays, packed into one [B, cp * R, 2 * local Hkv * D + 2] array, once:
  # the forward keeps it for the backward (choose_placement's placements know their ranks). Q never.
  # The backward also gathers the shared blocks' first key tokens (8 bytes a block of
  # _sort_block(R) tokens) to put the sorted keys' dK/dV back in rank order.
  gathered, firsts = placement_gathers(text)
  assert ("all-gather" in text) == (r > 0) and "collective-permute" not in text
  assert len(gathered) == (1 if r else 0)
  assert all(dims == [B // dp, cp * r, 2 * (HKV // tp) * D + 2] for dims in gathered)
  assert len(firsts) == (1 if sorts_keys(r, S // cp, HQ, HKV) else 0)
  assert all(dims == [B // dp, cp * r // _sort_block(r), 2] for dims in firsts)
  # The backward sums only the shared keys' dK/dV: blocks of R tokens ([B, 1 or cp, R, Hkv, D])
  # sent to their rank by an all-to-all, never a reduce-scatter of the whole shard.
  assert "reduce-scatter" not in text
  exchanged = [[int(x) for x in shape.split(",")] for line in text.splitlines() if "all-to-all(" in line
               for shape in re.findall(r"f32\[([\d,]+)\]", line.split("all-to-all(")[0])]
  assert (len(exchanged) > 0) == (r > 0)
  assert all(dims[2] == r for dims in exchanged)
  _check(f(*args), want)


@pytest.mark.parametrize("tp,cp", [(2, 4), (4, 2)])
def test_placement_with_gqa_heads_sharded(cpu_devices, tp, cp):
  """GQA 8 / 2 with the heads over tp and the sequence over cp: at tp = 4 each shard's two query
  heads share one kv head, which it slices out of replicated K/V (and of the kept shared K/V)."""
  placement, arrays = _placed(cp, sizes=shared_sizes(S, cp, (0, 1 / 2, 3 / 4, 1)), hq=8, hkv=2)
  assert placement.shared_tokens > 0
  mesh = _mesh(1, tp, cp)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", "tp", None)), NamedSharding(mesh, P("dp", "cp"))
  kv = s4 if tp <= 2 else NamedSharding(mesh, P("dp", "cp", None, None))
  args = [jax.device_put(x, s) for x, s in zip(arrays, (s4, kv, kv, s4, s2, s2))]
  got = jax.jit(_fwd_bwd(placement, MASKS["causal"]))(*args)
  _check(got, jax.jit(_fwd_bwd("auto", MASKS["causal"], implementation="xla"))(*arrays))


def test_traded_pair_with_kv_heads_sliced(cpu_devices):
  """4 / 2 heads over tp = 4, everything shared over cp = 2: each shard's one query head slices
  its kv head out of replicated K/V, trades that head's block with its partner (the kept block is
  declared with every kv head) and reads the head back in the backward."""
  placement, arrays = _placed(2, sizes=(S // 2,))
  assert placement.shared_tokens == S // 2
  mesh = _mesh(1, 4, 2)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", "tp", None)), NamedSharding(mesh, P("dp", "cp"))
  kv = NamedSharding(mesh, P("dp", "cp", None, None))
  args = [jax.device_put(x, s) for x, s in zip(arrays, (s4, kv, kv, s4, s2, s2))]
  f = jax.jit(_fwd_bwd(placement, MASKS["causal"]))
  shapes, _ = placement_trades(f.lower(*args).compile().as_text())
  assert sorted(shapes) == sorted([[B, S // 2, 2 * D + 2], [B, S // 2, 2 * D]]), shapes
  _check(f(*args), jax.jit(_fwd_bwd("auto", MASKS["causal"], implementation="xla"))(*arrays))


def test_placement_without_its_ranks_gathers_again(cpu_devices):
  """A DocumentPlacement that does not name its ranks keeps memory O(S / cp): the backward
  gathers the shared K/V again instead of keeping the forward's."""
  cp = 4
  placement, arrays = _placed(cp, sizes=(0, 8, 16))
  assert placement.shared_tokens > 0
  placement = dataclasses.replace(placement, cp_size=None)
  mesh = _mesh(1, 1, cp)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", "tp", None)), NamedSharding(mesh, P("dp", "cp"))
  args = [jax.device_put(x, s) for x, s in zip(arrays, (s4, s4, s4, s4, s2, s2))]
  f = jax.jit(_fwd_bwd(placement, MASKS["causal"]))
  gathered, firsts = placement_gathers(f.lower(*args).compile().as_text())
  assert len(gathered) == 2 and not firsts  # the order of the sorted keys from the gathered ones
  _check(f(*args), jax.jit(_fwd_bwd("auto", MASKS["causal"], implementation="xla"))(*arrays))


def test_placement_for_other_ranks_is_refused(cpu_devices):
  placement, arrays = _placed(4, sizes=(0, 8, 16))
  mesh = _mesh(1, 1, 2)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", "tp", None)), NamedSharding(mesh, P("dp", "cp"))
  args = [jax.device_put(x, s) for x, s in zip(arrays, (s4, s4, s4, s4, s2, s2))]
  # Raised by the partitioner, inside the compilation (which reports it as its own error).
  with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match="cp_size=4"):
    jax.jit(_fwd_bwd(placement, MASKS["causal"])).lower(*args).compile()
  with pytest.raises(ValueError, match="cp_size=4"):
    jaxcp.load_balance_permutation(np.asarray(arrays[4]), 2, strategy=placement)
  with pytest.raises(ValueError, match="cp_size"):
    jaxcp.DocumentPlacement(8, cp_size=0)


def test_placement_under_remat_and_vmap(cpu_devices):
  """The kept shared K/V are residuals like any other: jax.checkpoint recomputes them (or a policy
  saves them by name), and vmap folds them into the batch."""
  cp = 4
  placement, arrays = _placed(cp, sizes=(0, 8, 16))
  mesh = _mesh(1, 1, cp)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", "tp", None)), NamedSharding(mesh, P("dp", "cp"))
  args = [jax.device_put(x, s) for x, s in zip(arrays, (s4, s4, s4, s4, s2, s2))]
  want = jax.jit(_fwd_bwd("auto", MASKS["causal"], implementation="xla"))(*arrays)
  policy = jax.checkpoint_policies.save_only_these_names("jaxcp_attention_gathered")
  for remat in (jax.checkpoint, functools.partial(jax.checkpoint, policy=policy)):
    _check(jax.jit(_fwd_bwd(placement, MASKS["causal"], remat=remat))(*args), want)
  # vmap over a leading axis of two copies of the batch.
  stack = lambda xs: [jnp.stack([x, x]) for x in xs]
  got = jax.jit(jax.vmap(_fwd_bwd(placement, MASKS["causal"])))(*stack(args))
  for g in got:
    np.testing.assert_array_equal(np.asarray(g[0]), np.asarray(g[1]))
  _check([g[0] for g in got], want)


def test_all_shared_rows_take_even_blocks(cpu_devices):
  """R = S / cp gathers every key: the row is dealt to the ranks in whole blocks of 128 tokens
  of even causal work, and the attention on it equals the unsharded call."""
  cp, s = 2, 2048
  seg = np.zeros((1, s), np.int32)
  seg[0, :1400], seg[0, 1400:1980] = 1, 2
  pos = np.asarray(positions_from_segments(jnp.asarray(seg)))
  placement = jaxcp.DocumentPlacement(s // cp)
  perm = jaxcp.load_balance_permutation(seg, cp, strategy=placement)
  blocks = perm[0].reshape(-1, 128)
  np.testing.assert_array_equal(blocks, blocks[:, :1] + np.arange(128))     # whole blocks
  work = np.where(seg[0] != 0, pos[0] + 1, 0)[perm[0]].reshape(cp, -1).sum(-1)
  assert work.max() <= 1.01 * work.mean(), work
  np.testing.assert_array_equal(perm, np.asarray(jax.jit(
      lambda x: jaxcp.load_balance_permutation(x, cp, strategy=placement))(jnp.asarray(seg))))
  # A region that is not a multiple of the 128-token block: zigzag pieces, every rank evened.
  odd = seg[:, :1000]
  zig = jaxcp.load_balance_permutation(odd, 4, strategy=jaxcp.DocumentPlacement(250))
  work = np.where(odd[0] != 0, pos[0, :1000] + 1, 0)[zig[0]].reshape(4, -1).sum(-1)
  assert work.max() <= 1.01 * work.mean(), work
  assert not placement_violations(np.take_along_axis(odd, zig, 1), 4, jaxcp.DocumentPlacement(250))
  rng = np.random.default_rng(5)
  qkv = [jnp.asarray(rng.standard_normal((1, s, h, D)), jnp.float32) for h in (HQ, HKV, HKV, HQ)]
  arrays = [jaxcp.load_balance(jnp.asarray(x), cp, strategy=perm) for x in (*qkv, seg, pos)]
  mesh = _mesh(1, 1, cp)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", "tp", None)), NamedSharding(mesh, P("dp", "cp"))
  args = [jax.device_put(x, sh) for x, sh in zip(arrays, (s4, s4, s4, s4, s2, s2))]
  got = jax.jit(_fwd_bwd(placement, MASKS["causal"]))(*args)
  _check(got, jax.jit(_fwd_bwd("auto", MASKS["causal"], implementation="xla"))(*arrays))


@pytest.mark.parametrize("cp,group", [(2, None), (4, None), (4, 2)])
def test_shared_stream_takes_tile_blocks(cp, group):
  """A shared region of R < S / cp tokens (a multiple of 128) holds whole
  128-token blocks of the shared stream: each block is one run of the stream (every piece edge
  on a tile edge), and the shared causal work is even over the ranks."""
  s, r_tokens = 4096 * cp, 2048 if cp == 2 else 1024
  rng = np.random.default_rng(cp)
  lengths = np.maximum(rng.lognormal(np.log(900), 1.0, 64).astype(int), 1)
  lengths[0] = s // cp - r_tokens + 500             # longer than a local region: shared
  seg = np.repeat(np.arange(1, 65, dtype=np.int32), lengths)[:s]
  seg = np.pad(seg, (0, s - seg.size))[None]
  placement = jaxcp.DocumentPlacement(r_tokens, cp_size=cp if group else None, shared_group=group)
  perm, _, evicted = place_rows(seg, cp, placement, evict=True)
  seg = np.where(evicted, 0, seg)
  shard = s // cp
  src = perm[0].reshape(cp, shard)[:, shard - r_tokens:]          # row index of each shared token
  blocks = src.reshape(cp, -1, 128)
  real = seg[0][blocks] != 0
  assert real.sum() > r_tokens                       # more than one rank's worth is shared
  stream = np.searchsorted(np.sort(blocks[real]), blocks)        # index in the shared stream
  for b, m in zip(stream.reshape(-1, 128), real.reshape(-1, 128)):
    assert np.all(np.diff(b[m]) == 1), "a block holds more than one run of the stream"
  pos = np.asarray(positions_from_segments(jnp.asarray(seg)))[0]
  work = np.where(real, pos[blocks] + 1, 0).sum(axis=(1, 2))
  g = group or cp
  for j in range(cp // g):
    w = work[j * g:(j + 1) * g]
    assert w.max() <= 1.03 * w.mean(), w
  assert not placement_violations(np.take_along_axis(seg, perm, 1), cp, placement)


@pytest.mark.parametrize("shared,keep,hq", [(0, False, HQ), (8, False, HQ), (16, False, HQ), (8, True, HQ),
                                            (16, True, HQ), (16, False, 4 * HKV), (16, True, 4 * HKV)])
def test_shard_map_placement(cpu_devices, shared, keep, hq):
  """Inside shard_map with context_parallel_axis: every shared size, 0 (no exchange at all) to the
  whole shard, with the forward's gathered K/V kept for the backward (a placement that names its
  ranks) or gathered again; a whole shard shared with 4 query heads a key head runs one call."""
  seg = _rows()
  pos = np.asarray(positions_from_segments(jnp.asarray(seg)))
  placement = jaxcp.DocumentPlacement(shared, cp_size=4 if keep else None)
  perm, _, evicted = place_rows(seg, 4, placement, evict=True)
  seg, pos = np.where(evicted, 0, seg), np.where(evicted, 0, pos)
  arrays = [jaxcp.load_balance(jnp.asarray(x), 4, strategy=perm) for x in (*_qkv(3, hq=hq), seg, pos)]
  mesh = _mesh(2, 1, 4)
  s4, s2 = P("dp", "cp", "tp", None), P("dp", "cp")
  body = _fwd_bwd(placement, MASKS["causal"], axis="cp")
  f = jax.jit(shard_map(body, mesh=mesh, in_specs=(s4, s4, s4, s4, s2, s2), out_specs=(s4, s4, s4, s4)))
  lowered = f.lower(*arrays)
  text = lowered.compile().as_text()
  assert ("all-gather" in text) == (shared > 0)
  # K, V, segment ids and positions travel packed (one all-gather per direction, or only the
  # forward's when it keeps them; one all-to-all for dK/dV), and two optimization barriers per
  # direction hold the work that needs no other rank's keys (the local part, or with everything
  # shared the queries against the rank's own shared keys, up to 2 query heads a key head) inside
  # the exchange (the gather's start and done, or with kept K/V the backward's all-to-all).
  count = lambda op: len(re.findall(rf"stablehlo\.{op}\b", lowered.as_text()))
  has_shared = shared > 0
  overlapped = has_shared and (shared < S // 4 or hq <= 2 * HKV)
  # With kept K/V sorted by document, the backward gathers the blocks' first key tokens (to put
  # dK/dV back in rank order) under its shared kernel, between two more barriers.
  kept_sorted = keep and sorts_keys(shared, S // 4, hq, HKV)
  assert count("all_gather") == ((1 + kept_sorted if keep else 2) if has_shared else 0)
  assert count("all_to_all") == (1 if has_shared else 0)
  assert count("optimization_barrier") == (4 if overlapped else 0) + 2 * kept_sorted
  _check(f(*arrays), jax.jit(_fwd_bwd("auto", MASKS["causal"], implementation="xla"))(*arrays))


def test_placement_needs_self_attention(cpu_devices):
  mesh = _mesh(1, 1, 4)
  q = jax.device_put(jnp.zeros((1, 64, 2, 8)), NamedSharding(mesh, P(None, "cp")))
  k = jax.device_put(jnp.zeros((1, 32, 2, 8)), NamedSharding(mesh, P(None, "cp")))
  seg_q = jax.device_put(jnp.ones((1, 64), jnp.int32), NamedSharding(mesh, P(None, "cp")))
  seg_k = jax.device_put(jnp.ones((1, 32), jnp.int32), NamedSharding(mesh, P(None, "cp")))
  f = jax.jit(lambda q, k, a, b: jaxcp.attention(q, k, k, segment_ids=a, kv_segment_ids=b,
                                                 context_parallel=jaxcp.DocumentPlacement(4)))
  with pytest.raises(ValueError, match="self attention"):
    f.lower(q, k, seg_q, seg_k)


# ---------------------------------------------------------------- random rows


@functools.lru_cache(maxsize=None)
def _runner(strategy, mask_name):
  f = _fwd_bwd("auto" if strategy is None else strategy, MASKS[mask_name],
               implementation="xla" if strategy is None else None)
  return jax.jit(f)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(case=placed_rows(), mask_name=st.sampled_from(list(MASKS)))
def test_random_rows_match_unsharded(cpu_devices, case, mask_name):
  """Random mixes, placed with choose_placement at any cp (rows that overflow a small R take a
  larger one); values and gradients row by row, exactly zero where no pair is allowed."""
  seg, cp, _ = case
  s = seg.shape[1]
  pos = positions_in_documents(seg)
  placement, perm, _ = jaxcp.choose_placement(seg, cp, sizes=shared_sizes(s, cp, (0, 1 / 4, 1)))
  rng = np.random.default_rng(0)
  shapes = [(2, s, HQ, D), (2, s, HKV, D), (2, s, HKV, D), (2, s, HQ, D)]
  arrays = [jnp.asarray(rng.standard_normal(x), jnp.float32) for x in shapes] + [seg, pos]
  arrays = [jaxcp.load_balance(jnp.asarray(x), cp, strategy=perm) for x in arrays]
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:cp]), ("cp",))
  s4, s2 = NamedSharding(mesh, P(None, "cp")), NamedSharding(mesh, P(None, "cp"))
  args = [jax.device_put(x, sh) for x, sh in zip(arrays, (s4, s4, s4, s4, s2, s2))]
  got = _runner(placement, mask_name)(*args)
  want = _runner(None, mask_name)(*arrays)
  self_attention_rows_close(got, want, arrays[4], arrays[5], MASKS[mask_name], HQ, HKV)


class _ChainsOnTheCpu:
  """primitive.LocalBwd's chained calls as the CUDA kernels give them (begin: the first key set's
  dQ kept unconverted in its state; end: dQ over both sets), emulated by whole calls, so that the
  context-parallel code's chained branch runs on the CPU. Records each pair of calls."""
  calls = []

  def __init__(self, config):
    from jaxcp._src.attention.primitive import LocalBwd
    self.whole = LocalBwd(config)

  def __call__(self, *args):
    return self.whole(*args)

  def chains(self, q, *key_sets):
    return True

  def begin(self, *args, then_k):
    dq, dk, dv = self.whole(*args)
    self.calls.append(("begin", args[1].shape, then_k.shape))
    return dq.astype(jnp.float32), dk, dv

  def end(self, state, *args):
    dq, dk, dv = self.whole(*args)
    self.calls.append(("end", args[1].shape))
    return (state + dq.astype(jnp.float32)).astype(dq.dtype), dk, dv


@pytest.mark.parametrize("cp,kept", [(2, True), (2, False), (4, True), (4, False)])
def test_chained_backward_calls(cpu_devices, monkeypatch, cp, kept):
  """An all-shared shard's backward as two chained calls (a traded pair at cp = 2; its own keys
  and the other ranks' at cp = 4), with and without the forward's kept K/V: each pair of calls
  is begin then end, begin sized for end's keys, and the gradients equal the unsharded call's."""
  from jaxcp._src.attention import sharding
  monkeypatch.setattr(sharding, "LocalBwd", _ChainsOnTheCpu)
  monkeypatch.setattr(_ChainsOnTheCpu, "calls", [])
  placement, arrays = _placed(cp, sizes=(S // cp,))
  assert placement.shared_tokens == S // cp
  if not kept:
    placement = dataclasses.replace(placement, cp_size=None)
  mesh = _mesh(1, 1, cp)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", "tp", None)), NamedSharding(mesh, P("dp", "cp"))
  args = [jax.device_put(x, s) for x, s in zip(arrays, (s4, s4, s4, s4, s2, s2))]
  got = jax.jit(_fwd_bwd(placement, MASKS["causal"]))(*args)
  calls = _ChainsOnTheCpu.calls
  assert len(calls) == 2 and calls[0][0] == "begin" and calls[1][0] == "end", calls
  assert calls[0][2] == calls[1][1]  # the first call's workspace is sized for the second's keys
  _check(got, jax.jit(_fwd_bwd("auto", MASKS["causal"], implementation="xla"))(*arrays))
