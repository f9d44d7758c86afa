"""Tests of the context-parallel load-balancing permutations (jaxcp/_src/attention/load_balance.py)."""

import importlib.util
import os

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcp._src.attention import load_balance as lb

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_simulator():
  spec = importlib.util.spec_from_file_location(
      "cp_balance", os.path.join(_ROOT, "benchmarks", "cp_balance.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


sim = _load_simulator()

DOC_AWARE = ("zigzag_docs", "balanced_blocks")


def _packed_segments(rng, batch, seq_len, mean_len, pad_frac=0.0):
  """Random packed rows: lognormal document lengths, optional padding tail."""
  seg = np.zeros((batch, seq_len), np.int32)
  for b in range(batch):
    end = seq_len - int(pad_frac * seq_len)
    t, i = 0, 1
    while t < end:
      n = max(1, int(rng.lognormal(np.log(mean_len), 1.0)))
      seg[b, t:min(end, t + n)] = i
      t += n
      i += 1
  return seg


def _perm(strategy, seg, cp, block_size=4):
  return lb.load_balance_permutation(seg, cp, strategy=strategy, block_size=block_size)


# ---------------------------------------------------------------------------------------------
# definitions


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_striped_matches_definition(cp):
  s = 48
  want = [t for r in range(cp) for t in range(r, s, cp)]
  x = np.arange(s)[None]
  np.testing.assert_array_equal(lb.load_balance(x, cp)[0], want)
  np.testing.assert_array_equal(lb.load_balance(jnp.asarray(x), cp)[0], want)
  np.testing.assert_array_equal(lb.load_balance_permutation(x, cp, strategy="striped")[0], want)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_zigzag_matches_definition(cp):
  s = 2 * cp * 5
  chunks = np.arange(s).reshape(2 * cp, -1)
  want = np.concatenate([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])
  x = np.arange(s)[None]
  np.testing.assert_array_equal(lb.load_balance(x, cp, strategy="zigzag")[0], want)
  np.testing.assert_array_equal(lb.load_balance(jnp.asarray(x), cp, strategy="zigzag")[0], want)
  np.testing.assert_array_equal(lb.load_balance_permutation(x, cp, strategy="zigzag")[0], want)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_docs_is_zigzag_for_one_document(cp):
  s = 2 * cp * 6
  seg = np.ones((2, s), np.int32)
  np.testing.assert_array_equal(lb.load_balance_permutation(seg, cp, strategy="zigzag_docs"),
                                lb.load_balance_permutation(seg, cp, strategy="zigzag"))


def test_balanced_blocks_keeps_blocks_whole():
  rng = np.random.default_rng(0)
  seg = _packed_segments(rng, 3, 256, 20, pad_frac=0.1)
  for bs in (1, 4, 8):
    perm = lb.load_balance_permutation(seg, 4, block_size=bs)
    blocks = perm.reshape(3, -1, bs)
    np.testing.assert_array_equal(blocks - blocks[..., :1], np.broadcast_to(np.arange(bs),
                                                                             blocks.shape))
    assert (blocks[..., 0] % bs == 0).all()


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("strategy", ["striped", "zigzag"] + list(DOC_AWARE))
@pytest.mark.parametrize("cp", [1, 3, 8])
def test_round_trip_jit(strategy, cp):
  rng = np.random.default_rng(cp)
  b, s, h, d = 2, 96, 3, 5
  seg = _packed_segments(rng, b, s, 10, pad_frac=0.2)
  x = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16)

  @jax.jit
  def f(x, seg):
    strat = strategy if strategy in ("striped", "zigzag") else _perm(strategy, seg, cp)
    y = lb.load_balance(x, cp, strategy=strat)
    return y, lb.restore_order(y, cp, strategy=strat)

  y, back = f(x, jnp.asarray(seg))
  assert y.dtype == x.dtype and y.shape == x.shape
  np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
  # numpy in, numpy out, same permutation
  strat = strategy if strategy in ("striped", "zigzag") else _perm(strategy, seg, cp)
  y_np = lb.load_balance(np.asarray(x), cp, strategy=strat)
  assert isinstance(y_np, np.ndarray)
  np.testing.assert_array_equal(y_np, np.asarray(y))


@pytest.mark.parametrize("strategy", ["striped", "zigzag"] + list(DOC_AWARE))
@pytest.mark.parametrize("axis,shape,dtype", [
    (0, (16,), np.float32), (1, (2, 16), np.int32), (1, (2, 16, 3), jnp.bfloat16),
    (2, (2, 3, 16, 4), np.bool_), (-2, (2, 3, 16, 4), np.float16), (-1, (3, 16), np.int8)])
def test_round_trip_axes_dtypes(strategy, axis, shape, dtype):
  cp = 4
  rng = np.random.default_rng(0)
  x = (rng.standard_normal(shape) * 10).astype(dtype)
  ax = axis % len(shape)
  if strategy in DOC_AWARE:
    lead = shape[:min(ax, 1)]  # one permutation per row of axis 0, or one shared [S]
    seg = _packed_segments(rng, int(np.prod(lead)), shape[ax], 5).reshape(lead + (shape[ax],))
    strat = _perm(strategy, seg, cp)
  else:
    strat = strategy
  for arr in (x, jnp.asarray(x)):
    y = lb.load_balance(arr, cp, axis=axis, strategy=strat)
    back = lb.restore_order(y, cp, axis=axis, strategy=strat)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(back), x)
  # the permutation acts along `axis` only
  perm = strat if not isinstance(strat, str) else lb.load_balance_permutation(
      np.zeros(shape[ax], np.int32), cp, strategy=strat)
  y = lb.load_balance(x, cp, axis=axis, strategy=strat)
  if perm.ndim == 1:
    np.testing.assert_array_equal(y, np.take(x, perm, axis=ax))


def test_vmap_and_grad():
  cp, s = 4, 32
  x = jnp.arange(3 * s, dtype=jnp.float32).reshape(3, s)
  y = jax.vmap(lambda r: lb.load_balance(r, cp, axis=0, strategy="zigzag"))(x)
  np.testing.assert_array_equal(y, lb.load_balance(x, cp, strategy="zigzag"))
  w = jnp.arange(3 * s, dtype=jnp.float32).reshape(3, s) ** 2
  g = jax.grad(lambda x: jnp.sum(lb.load_balance(x, cp) * w))(x)
  np.testing.assert_array_equal(g, lb.restore_order(w, cp))


def test_invert_and_apply_permutation():
  rng = np.random.default_rng(1)
  perm = np.stack([rng.permutation(24) for _ in range(3)]).astype(np.int32)
  inv = lb.invert_permutation(perm)
  np.testing.assert_array_equal(np.take_along_axis(perm, inv, -1), np.broadcast_to(
      np.arange(24), (3, 24)))
  np.testing.assert_array_equal(jax.jit(lb.invert_permutation)(jnp.asarray(perm)), inv)
  x = rng.standard_normal((3, 5, 24, 2)).astype(np.float32)
  y = lb.apply_permutation(x, perm, axis=2)
  np.testing.assert_array_equal(y[1, 3, :, 0], x[1, 3, perm[1], 0])
  np.testing.assert_array_equal(lb.apply_permutation(y, inv, axis=2), x)
  np.testing.assert_array_equal(lb.apply_permutation(jnp.asarray(x), jnp.asarray(perm), axis=2), y)


# ---------------------------------------------------------------------------------------------
# document-aware permutations


@pytest.mark.parametrize("strategy", DOC_AWARE)
def test_doc_aware_numpy_matches_jit(strategy):
  rng = np.random.default_rng(2)
  seg = _packed_segments(rng, 4, 192, 30, pad_frac=0.15)   # 192 = 2 * 3 * 8 * 4
  seg[1] = np.sort(rng.integers(0, 4, 192))  # padding first, then documents
  for cp in (1, 3, 8):
    want = _perm(strategy, seg, cp)
    got = jax.jit(lambda s, cp=cp: _perm(strategy, s, cp))(jnp.asarray(seg))
    assert want.dtype == np.int32 and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    cp=st.sampled_from([1, 2, 3, 4, 8]),
    strategy=st.sampled_from(DOC_AWARE),
    pad_front=st.integers(0, 5),
)
def test_doc_aware_is_a_permutation(lengths, cp, strategy, pad_front):
  block = 2
  s = -(-(sum(lengths) + pad_front) // (cp * block)) * cp * block
  seg = np.zeros(s, np.int32)
  t = pad_front
  for i, n in enumerate(lengths):
    seg[t:t + n] = i % 3 + 1  # ids may repeat between non-adjacent documents
    t += n
  perm = lb.load_balance_permutation(seg, cp, strategy=strategy, block_size=block)
  np.testing.assert_array_equal(np.sort(perm), np.arange(s))
  x = np.arange(s) * 7
  np.testing.assert_array_equal(lb.restore_order(lb.load_balance(x, cp, axis=0, strategy=perm),
                                                 cp, axis=0, strategy=perm), x)


# ---------------------------------------------------------------------------------------------
# balance (with the simulator of benchmarks/cp_balance.py)


def _brute_force_rank_work(seg, perm, cp):
  """Allowed causal (q, k) pairs per rank, from the mask itself."""
  s = seg.shape[-1]
  prev = np.concatenate([[0], seg[:-1]])
  idx = np.arange(s)
  start = np.maximum.accumulate(np.where((seg != prev) & (seg != 0), idx, 0))
  doc_start = np.where(seg != 0, start, -1)
  pos = idx - start
  allowed = ((seg[:, None] == seg[None, :]) & (seg[:, None] != 0)
             & (doc_start[:, None] == doc_start[None, :]) & (pos[None, :] <= pos[:, None]))
  rank_of_token = np.empty(s, np.int64)
  rank_of_token[perm] = np.arange(s) // (s // cp)
  return np.bincount(rank_of_token, weights=allowed.sum(1), minlength=cp)


def test_simulator_grouped_placement_receives_no_more():
  """The simulation's grouped placement: a rank receives at most what the ungrouped one receives
  (the chooser tries candidates by received tokens), and the table lists it."""
  results = sim.run(rows=2, seed=1, seq_lens=(16384,), cp_sizes=(4, 8), mixes=["lognormal_2k", "lognormal_8k"])
  for e in results:
    assert e[sim.GROUPED]["bytes_max"] <= e[sim.PLACEMENT]["bytes_max"] + 1e-9, e
    assert sum(e[sim.GROUPED]["groups_taken"].values()) == 2
  assert "With grouped shared regions" in sim.markdown(results)


@pytest.mark.parametrize("strategy", ["contiguous", "striped", "zigzag"] + list(DOC_AWARE))
def test_simulator_matches_brute_force(strategy):
  rng = np.random.default_rng(3)
  seg = _packed_segments(rng, 3, 64, 9, pad_frac=0.1)
  seg[2, 10:20] = 0  # padding in the middle
  seg[2, 20:30] = seg[2, 0]  # a segment id reused by a later, separate document
  cp = 4
  perm = sim.permutation(strategy, seg, cp, 4)
  got = sim.rank_work(seg, perm, cp)
  for b in range(3):
    p = np.arange(64) if perm is None else perm[b]
    np.testing.assert_array_equal(got[b], _brute_force_rank_work(seg[b], p, cp))


@pytest.mark.parametrize("mix", ["lognormal_1k", "lognormal_4k", "pareto_4k", "long_short",
                                 "lognormal_4k_padded", "one_doc"])
def test_striped_and_doc_aware_are_balanced(mix):
  s = 32 * 1024
  rng = np.random.default_rng(4)
  seg = np.stack([sim.MIXES[mix](rng, s) for _ in range(2)])
  for cp in (2, 4, 8):
    striped = sim.imbalance(sim.rank_work(seg, sim.permutation("striped", seg, cp), cp))
    assert striped.max() < 1.01, (mix, cp, striped)
    zz = sim.imbalance(sim.rank_work(seg, sim.permutation("zigzag_docs", seg, cp), cp))
    assert zz.max() < 1.01, (mix, cp, zz)
    bb = sim.imbalance(sim.rank_work(seg, sim.permutation("balanced_blocks", seg, cp), cp))
    assert bb.max() < 1.05, (mix, cp, bb)
    contiguous = sim.imbalance(sim.rank_work(seg, None, cp))
    assert contiguous.mean() > 1.1  # the problem being solved is real


# ---------------------------------------------------------------------------------------------
# errors


def test_errors():
  x = np.zeros((2, 12, 3))
  with pytest.raises(ValueError, match="multiple of cp_size = 5"):
    lb.load_balance(x, 5)
  with pytest.raises(ValueError, match="2 \\* cp_size = 8"):
    lb.load_balance(x, 4, strategy="zigzag")
  with pytest.raises(ValueError, match="Unknown strategy"):
    lb.load_balance(x, 2, strategy="spiral")
  with pytest.raises(ValueError, match="load_balance_permutation"):
    lb.load_balance(x, 2, strategy="zigzag_docs")
  with pytest.raises(ValueError, match="axis=3 is out of range"):
    lb.load_balance(x, 2, axis=3)
  with pytest.raises(ValueError, match="axis"):
    lb.restore_order(x, 2, axis=1.5)
  for bad in (0, -1):
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
      lb.load_balance(x, bad)
  for bad in (2.0, True, "2"):
    with pytest.raises(ValueError, match="cp_size"):
      lb.load_balance(x, bad)
  with pytest.raises(ValueError, match="cp_size"):
    jax.jit(lambda x, cp: lb.load_balance(x, cp))(x, 2)
  with pytest.raises(ValueError, match="length 10 but x has 12"):
    lb.load_balance(x, 2, strategy=np.arange(10))
  with pytest.raises(ValueError, match="leading dims"):
    lb.load_balance(x, 2, strategy=np.zeros((3, 12), np.int32))
  with pytest.raises(ValueError, match="integer dtype"):
    lb.load_balance(x, 2, strategy=np.zeros(12, np.float32))
  seg = np.ones((2, 12), np.int32)
  with pytest.raises(ValueError, match="cp_size \\* block_size = 16"):
    lb.load_balance_permutation(seg, 2, strategy="balanced_blocks", block_size=8)
  with pytest.raises(ValueError, match="block_size"):
    lb.load_balance_permutation(seg, 2, strategy="balanced_blocks", block_size=0)
  with pytest.raises(ValueError, match="integer dtype"):
    lb.load_balance_permutation(seg.astype(np.float32), 2)
  with pytest.raises(ValueError, match="Unknown strategy"):
    lb.load_balance_permutation(seg, 2, strategy="nope")


@pytest.mark.parametrize("strategy", ["striped", "zigzag", "zigzag_docs"])
def test_arrays_sharded_over_explicit_mesh_axes(cpu_devices, strategy):
  """jax.make_mesh's default Explicit axes: the permutation keeps the input's sharding, eagerly
  and under jit, and restore_order undoes it."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  x_host = np.arange(2 * 64 * 3, dtype=np.float32).reshape(2, 64, 3)
  x = jax.device_put(x_host, NamedSharding(mesh, P("dp", "cp")))
  if strategy == "zigzag_docs":
    strategy = lb.load_balance_permutation(np.repeat(np.arange(1, 9), 8)[None].repeat(2, 0).astype(np.int32), 4,
                                           strategy="zigzag_docs")
  want = lb.load_balance(x_host, 4, strategy=strategy)
  for f in (lambda x: lb.load_balance(x, 4, strategy=strategy), jax.jit(lambda x: lb.load_balance(x, 4, strategy=strategy))):
    y = f(x)
    assert tuple(y.sharding.spec)[:2] == ("dp", "cp")
    np.testing.assert_array_equal(np.asarray(y), want)
    np.testing.assert_array_equal(np.asarray(lb.restore_order(y, 4, strategy=strategy)), x_host)
