"""Document placement with grouped shared regions (DocumentPlacement.shared_group): each shared
segment spread over one group of ranks, the gather and the dK/dV exchange within the group. The
layout's invariants, choose_placement's choice among groups, and values and gradients equal to
the unsharded call on 8 host devices (jit partitioning with cp and dp x cp meshes, shard_map)
with a compiled HLO that gathers only the group's shared regions."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcp
from jaxcp._src.attention.context_parallel import _sort_block
from jaxcp._src.attention.placement import place_rows, placement_violations
from jaxcp._src.compat import shard_map
from jaxcp._src.masks import positions_from_segments

from .helpers import placement_gathers, placement_trades, rel_err, sorts_keys, trades_keys
from .strategies import packed_row

B, S, HQ, HKV, D = 2, 64, 4, 2, 8
MASKS = {"causal": dict(is_causal=True), "window": dict(is_causal=True, local_window_size=(9, 0))}


def _rows():
  """Two rows whose long documents fit a pair of ranks' shared regions at cp = 4, R = 8."""
  seg = np.zeros((B, S), np.int32)
  seg[0, :56] = np.repeat(np.arange(1, 10), [3, 14, 4, 2, 12, 5, 6, 3, 7])
  seg[1, :46] = np.repeat(np.arange(1, 9), [10, 3, 9, 4, 5, 2, 6, 7])
  return seg


def _placed(cp, sizes, groups, seed=0, tolerance=0.02):
  seg = _rows()
  pos = np.asarray(positions_from_segments(jnp.asarray(seg)))
  placement, perm, _ = jaxcp.choose_placement(seg, cp, sizes=sizes, groups=groups, tolerance=tolerance)
  rng = np.random.default_rng(seed)
  qkv = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
         [(B, S, HQ, D), (B, S, HKV, D), (B, S, HKV, D), (B, S, HQ, D)]]
  return placement, [jaxcp.load_balance(jnp.asarray(x), cp, strategy=perm) for x in (*qkv, seg, pos)]


def _fwd_bwd(strategy, mask, axis=None, implementation=None):
  def run(q, k, v, dout, seg, pos):
    f = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, context_parallel=strategy,
                                        context_parallel_axis=axis, implementation=implementation, **mask)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(dout))
  return run


def _check(got, want, tol=1e-5):
  for g, w in zip(got, want):
    assert rel_err(g, w) < tol


def _mesh(dp, cp):
  return jax.sharding.Mesh(np.array(jax.devices("cpu")[:dp * cp]).reshape(dp, cp), ("dp", "cp"))


# ---------------------------------------------------------------- the layout


@st.composite
def grouped_rows(draw):
  """Packed rows, cp, a group size dividing it and a shared size."""
  cp = draw(st.sampled_from([4, 8]))
  group = draw(st.sampled_from([g for g in (1, 2, 4) if cp % g == 0 and g < cp]))
  s = draw(st.sampled_from([64, 128, 512]))
  rows = [draw(packed_row(s, {"short": (1, 6), "medium": (7, 20), "long": (21, s), "padding": (1, 12)}))[0]
          for _ in range(2)]
  r = draw(st.sampled_from([s // cp // 4, s // cp // 2, s // cp]))
  return np.stack(rows), cp, group, r


@settings(max_examples=120, deadline=None)
@given(case=grouped_rows())
def test_grouped_layout_invariants(case):
  """Whatever fits (evicting what does not): a permutation; every segment whole in one rank's
  local region or in the shared regions of one group only; restore_order inverts."""
  seg, cp, group, r = case
  s = seg.shape[1]
  placement = jaxcp.DocumentPlacement(r, cp_size=cp, shared_group=group)
  perm, _, evicted = place_rows(seg, cp, placement, evict=True)
  seg = np.where(evicted, 0, seg)
  for row in perm:
    np.testing.assert_array_equal(np.sort(row), np.arange(s))
  placed = np.take_along_axis(seg, perm, 1)
  assert placement_violations(placed, cp, placement) == []
  np.testing.assert_array_equal(jaxcp.restore_order(placed, cp, strategy=perm), seg)
  shared = placed.reshape(seg.shape[0], cp // group, group, s // cp)[..., s // cp - r:]
  for b in range(seg.shape[0]):
    for sid in np.unique(shared[b][shared[b] != 0]):
      assert ((shared[b] == sid).sum(axis=(1, 2)) > 0).sum() == 1  # one group holds it


def test_choose_placement_takes_the_group_with_fewer_bytes():
  """cp = 4: the rows' long documents fit pairs of ranks at R = 8, which receive 8 tokens each
  where spreading them over all four ranks (R = 8 too) would receive 24; with groups=(4,) alone
  (the default) the choice is today's."""
  seg = _rows()
  placement, perm, imbalance = jaxcp.choose_placement(seg, 4, sizes=(8, 16), groups=(2, 4), tolerance=0.5)
  assert (placement.shared_tokens, placement.shared_group, placement.cp_size) == (8, 2, 4)
  assert placement_violations(np.take_along_axis(seg, perm, 1), 4, placement) == []
  assert np.all(imbalance <= 1.5)
  default, _, _ = jaxcp.choose_placement(seg, 4, sizes=(8, 16), tolerance=0.5)
  assert (default.shared_tokens, default.shared_group) == (8, None)
  with pytest.raises(ValueError, match="divide cp_size"):
    jaxcp.choose_placement(seg, 4, groups=(3,))


def test_bad_groups():
  with pytest.raises(ValueError, match="needs cp_size"):
    jaxcp.DocumentPlacement(8, shared_group=2)
  with pytest.raises(ValueError, match="multiple of it"):
    jaxcp.DocumentPlacement(8, cp_size=6, shared_group=4)
  with pytest.raises(ValueError, match="shared_group must be"):
    jaxcp.DocumentPlacement(8, cp_size=4, shared_group=0)


# ---------------------------------------------------------------- attention on a grouped layout


# (mesh, groups, mask, R as a share of the shard: 1/2 leaves a local region beside the shared one)
CASES = [((1, 4), (2,), "causal", 1 / 2), ((2, 4), (2,), "window", 1), ((1, 8), (2,), "causal", 1),
         ((1, 8), (4,), "causal", 1)]


@pytest.mark.parametrize("mesh_shape,groups,mask_name,share", CASES,
                         ids=[f"{m[0]}x{m[1]}-g{g[0]}-{n}-R{f}" for m, g, n, f in CASES])
def test_jit_grouped_placement_matches_unsharded(cpu_devices, mesh_shape, groups, mask_name, share):
  dp, cp = mesh_shape
  placement, arrays = _placed(cp, sizes=(int(S // cp * share),), groups=groups, tolerance=10.0)
  g, r = placement.shared_group, placement.shared_tokens
  assert g == groups[0] and r == int(S // cp * share)
  mesh = _mesh(dp, cp)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", None, None)), NamedSharding(mesh, P("dp", "cp"))
  args = [jax.device_put(x, s) for x, s in zip(arrays, (s4, s4, s4, s4, s2, s2))]
  f = jax.jit(_fwd_bwd(placement, MASKS[mask_name]))
  text = f.lower(*args).compile().as_text()
  if trades_keys(r, S // cp, g, HQ, HKV):
    # Everything shared in pairs: each rank trades its region with its partner (one collective-
    # permute of packed K, V and key tokens, kept for the backward; one of dK/dV back), nothing
    # else. Q never.
    shapes, pairs = placement_trades(text)
    assert "all-gather" not in text and "all-to-all" not in text
    assert sorted(shapes) == sorted([[B // dp, r, 2 * HKV * D + 2], [B // dp, r, 2 * HKV * D]]), shapes
    assert all(sorted(p) == [(j, j ^ 1) for j in range(dp * cp)] for p in pairs), pairs
    _check(f(*args), jax.jit(_fwd_bwd("auto", MASKS[mask_name], implementation="xla"))(*arrays))
    return
  # The group's shared regions only (g * R tokens, packed K, V and the key tokens' arrays), once:
  # the forward keeps its group's for the backward; in groups of g ranks; Q never.
  lines = [line for line in text.splitlines() if re.search(r" all-gather\(", line)]
  gathered, firsts = placement_gathers(text)
  assert len(gathered) == 1 and gathered[0] == [B // dp, g * r, 2 * HKV * D + 2], gathered
  assert firsts == ([[B // dp, g * r // _sort_block(r), 2]] if sorts_keys(r, S // cp, HQ, HKV) else []), firsts
  assert all(re.search(r"replica_groups=\{(\{[\d,]+\},?)+\}", line) for line in lines)
  assert all(len(grp.split(",")) == g for line in lines
             for grp in re.findall(r"\{([\d,]+)\}", re.search(r"replica_groups=\{(.*?)\}\}", line).group(1) + "}"))
  exchanged = [[int(x) for x in shape.split(",")] for line in text.splitlines() if "all-to-all(" in line
               for shape in re.findall(r"f32\[([\d,]+)\]", line.split("all-to-all(")[0])]
  assert exchanged and all(dims[2] == r for dims in exchanged), exchanged
  _check(f(*args), jax.jit(_fwd_bwd("auto", MASKS[mask_name], implementation="xla"))(*arrays))


@pytest.mark.parametrize("shared", [8, 16])
def test_shard_map_grouped_placement(cpu_devices, shared):
  """Pairs of ranks inside shard_map: a local region and a shared one (R = 8 of 16), or everything
  shared (R = 16), which each rank trades with its partner."""
  placement, arrays = _placed(4, sizes=(shared,), groups=(2,), tolerance=10.0)
  assert (placement.shared_group, placement.shared_tokens) == (2, shared)
  mesh = _mesh(2, 4)
  s4, s2 = P("dp", "cp", None, None), P("dp", "cp")
  body = _fwd_bwd(placement, MASKS["causal"], axis="cp")
  f = jax.jit(shard_map(body, mesh=mesh, in_specs=(s4, s4, s4, s4, s2, s2), out_specs=(s4, s4, s4, s4)))
  stable = f.lower(*arrays).as_text()
  count = lambda op: len(re.findall(rf"stablehlo\.{op}\b", stable))
  if shared == 16:
    # K/V (kept) and dK/dV trade places, each with the queries against the rank's own keys under it.
    assert (count("all_gather"), count("all_to_all"), count("collective_permute")) == (0, 0, 2)
    assert count("optimization_barrier") == 4
  else:
    # kept for the backward, which gathers only the shared blocks' first key tokens (rank order)
    assert (count("all_gather"), count("all_to_all"), count("collective_permute")) == (2, 1, 0)
  _check(f(*arrays), jax.jit(_fwd_bwd("auto", MASKS["causal"], implementation="xla"))(*arrays))


@pytest.mark.parametrize("shared", [8, 16])
def test_grouped_placement_with_heads_sharded_under_remat_and_vmap(cpu_devices, shared):
  """tp x cp (heads over tp) with groups of 2: the kept per-rank blocks (the pair's regions, or
  with everything shared the partner's) are residuals like any other under jax.checkpoint
  (recomputed, or saved by name), and vmap folds them into the batch."""
  placement, arrays = _placed(4, sizes=(shared,), groups=(2,), tolerance=10.0)
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("tp", "cp"))
  s4, s2 = NamedSharding(mesh, P(None, "cp", "tp", None)), NamedSharding(mesh, P(None, "cp"))
  args = [jax.device_put(x, s) for x, s in zip(arrays, (s4, s4, s4, s4, s2, s2))]
  want = jax.jit(_fwd_bwd("auto", MASKS["causal"], implementation="xla"))(*arrays)
  _check(jax.jit(_fwd_bwd(placement, MASKS["causal"]))(*args), want)
  policy = jax.checkpoint_policies.save_only_these_names("jaxcp_attention_gathered")
  for remat in (jax.checkpoint, functools.partial(jax.checkpoint, policy=policy)):
    def run(q, k, v, dout, seg, pos, remat=remat):
      f = remat(lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, is_causal=True,
                                                context_parallel=placement))
      out, vjp = jax.vjp(f, q, k, v)
      return (out, *vjp(dout))
    _check(jax.jit(run)(*args), want)
  got = jax.jit(jax.vmap(_fwd_bwd(placement, MASKS["causal"])))(*[jnp.stack([x, x]) for x in args])
  _check([g[0] for g in got], want)
  _check([g[1] for g in got], want)


def test_pair_trades_again_without_kept(cpu_devices):
  """Everything shared over 2 ranks by a placement that does not name its ranks: nothing is kept,
  so the backward trades K/V again (under the part against the rank's own keys) before dK/dV."""
  seg = _rows()
  pos = np.asarray(positions_from_segments(jnp.asarray(seg)))
  placement = jaxcp.DocumentPlacement(S // 2)
  perm, _, evicted = place_rows(seg, 2, placement, evict=True)
  seg, pos = np.where(evicted, 0, seg), np.where(evicted, 0, pos)
  rng = np.random.default_rng(1)
  qkv = [rng.standard_normal(s).astype(np.float32) for s in [(B, S, HQ, D), (B, S, HKV, D), (B, S, HKV, D),
                                                              (B, S, HQ, D)]]
  arrays = [jaxcp.load_balance(jnp.asarray(x), 2, strategy=perm) for x in (*qkv, seg, pos)]
  mesh = _mesh(1, 2)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", None, None)), NamedSharding(mesh, P("dp", "cp"))
  args = [jax.device_put(x, s) for x, s in zip(arrays, (s4, s4, s4, s4, s2, s2))]
  f = jax.jit(_fwd_bwd(placement, MASKS["causal"]))
  shapes, _ = placement_trades(f.lower(*args).compile().as_text())
  width = 2 * HKV * D
  assert sorted(shapes) == sorted([[B, S // 2, width + 2]] * 2 + [[B, S // 2, width]]), shapes
  _check(f(*args), jax.jit(_fwd_bwd("auto", MASKS["causal"], implementation="xla"))(*arrays))
