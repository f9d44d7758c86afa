"""Tests of jaxcp small-sequence attention (one query token over <= 16 key/value tokens).

CPU tests always run (the CPU FFI kernels + the full primitive/sharding path); GPU tests run
under the `gpu` marker against the pure-JAX reference.
"""
from __future__ import annotations

import functools
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxcp._src import registry
from jaxcp._src.small_seq.api import (ragged_rows, small_seq_attention, small_seq_eligible,
                                      small_seq_from_attention)
from jaxcp._src.small_seq.primitive import SmallSeqConfig, local_fwd
from jaxcp._src.small_seq import one_key
from jaxcp._src.small_seq.one_key import one_key_attention
from jaxcp._src.small_seq.reference import small_seq_reference
from tests.helpers import rel_err

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
GRAD_TOL = {jnp.float32: 5e-5, jnp.bfloat16: 4e-2, jnp.float16: 8e-3}

needs_cpu_kernel = pytest.mark.skipif(not registry.cpu_extension_available(),
                                      reason="CPU extension not built")


def _rand(rng, shape, dtype):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)


def _padded(rng, b, s, hq, hkv, d, dtype):
  return (_rand(rng, (b, hq, d), dtype), _rand(rng, (b, s, hkv, d), dtype),
          _rand(rng, (b, s, hkv, d), dtype))


def _numpy_reference(q, k, v, rows, scale):
  """Independent float64 reference: rows[b] = list of token indices into k/v [T, Hkv, D]."""
  q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
  b, hq, d = q.shape
  g = hq // k.shape[1]
  out = np.zeros((b, hq, d))
  for i in range(b):
    if not rows[i]:
      continue
    idx = np.asarray(rows[i])
    for h in range(hq):
      s = k[idx, h // g] @ q[i, h] * scale
      p = np.exp(s - s.max())
      p /= p.sum()
      out[i, h] = p @ v[idx, h // g]
  return out


def _padded_rows(lengths, s):
  return [list(range(i * s, i * s + int(np.clip(n, 0, s)))) for i, n in enumerate(lengths)]


def _ragged_rows(cu, t, max_len=16):
  """Token lists of the ragged rows: cu clamped into [0, t]; empty from the first decrease on;
  at most max_len tokens per row."""
  cu = np.clip(np.asarray(cu), 0, t)
  rows, broken = [], False
  for i in range(len(cu) - 1):
    broken = broken or cu[i + 1] < cu[i]
    rows.append([] if broken else list(range(cu[i], min(cu[i + 1], cu[i] + max_len))))
  return rows


def _assert_close(a, b, tol, what=""):
  err = rel_err(a, b)
  assert err < tol, f"{what}: relative error {err} >= {tol}"


def _vjp(fn, args, dout):
  out, pull = jax.vjp(fn, *args)
  return out, pull(dout)


def _ragged_inputs(rng, b, t, hq, hkv, d):
  """float32 q, k, v, dout: q/dout [b, hq, d], k/v [t, hkv, d] (drawn in that order)."""
  q = _rand(rng, (b, hq, d), jnp.float32)
  k, v = _rand(rng, (t, hkv, d), jnp.float32), _rand(rng, (t, hkv, d), jnp.float32)
  return q, k, v, _rand(rng, (b, hq, d), jnp.float32)


def _cpu_grads_close_to_reference(f, args, dout):
  """(dq, dk, dv) of f("cpu"), checked against f("xla")'s (float32 tolerance)."""
  _, got = jax.jit(lambda *a: _vjp(f("cpu"), a, dout))(*args)
  _, want = jax.jit(lambda *a: _vjp(f("xla"), a, dout))(*args)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    _assert_close(g, w, GRAD_TOL[jnp.float32], name)
  return got


# ---------------------------------------------------------------- forward vs numpy reference


@needs_cpu_kernel
@pytest.mark.parametrize("dtype,hq,hkv", [(jnp.float32, 4, 4), (jnp.bfloat16, 8, 2),
                                           (jnp.float16, 4, 1), (jnp.bfloat16, 4, 4)])
def test_padded_forward(dtype, hq, hkv):
  rng = np.random.default_rng(0)
  b, s, d = 9, 7, 32
  q, k, v = _padded(rng, b, s, hq, hkv, d, dtype)
  lengths = np.array([0, 1, 3, 7, 7, 99, -4, 2, 5], np.int32)  # out-of-range values are clamped
  for impl in ("cpu", "xla"):
    out = jax.jit(functools.partial(small_seq_attention, implementation=impl))(
        q, k, v, kv_lengths=lengths)
    assert out.shape == (b, hq, d) and out.dtype == dtype
    ref = _numpy_reference(q, k.reshape(b * s, hkv, d), v.reshape(b * s, hkv, d),
                           _padded_rows(lengths, s), d ** -0.5)
    _assert_close(out, ref, TOL[dtype], impl)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0)  # zero-length row
    np.testing.assert_array_equal(np.asarray(out[6], np.float32), 0)


@needs_cpu_kernel
@pytest.mark.parametrize("d", [8, 40, 64, 128, 256, 512])
def test_head_dims_cpu(d):
  rng = np.random.default_rng(1)
  q, k, v = _padded(rng, 4, 16, 4, 2, d, jnp.bfloat16)
  lengths = np.array([16, 3, 0, 9], np.int32)
  out = jax.jit(functools.partial(small_seq_attention, implementation="cpu", scale=0.1))(
      q, k, v, kv_lengths=lengths)
  ref = _numpy_reference(q, k.reshape(64, 2, d), v.reshape(64, 2, d), _padded_rows(lengths, 16), 0.1)
  _assert_close(out, ref, TOL[jnp.bfloat16])


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(tokens=st.integers(1, 40),
                  cu=st.lists(st.integers(-5, 45), min_size=2, max_size=12))
def test_ragged_rows_are_disjoint_in_bounds_and_exact_for_valid_input(tokens, cu):
  """Whatever kv_cu_seqlens holds: rows stay inside [0, Tkv] and never overlap (the backward
  writes each token's dK/dV once); they match _ragged_rows; valid input passes unchanged."""
  start, length = (np.asarray(x) for x in jax.jit(ragged_rows, static_argnums=1)(
      jnp.asarray(cu, jnp.int32), tokens))
  assert start.shape == length.shape == (len(cu) - 1,)
  assert np.all(length >= 0) and np.all(start >= 0) and np.all(start + length <= tokens)
  # each row ends at or before the next one's start (the CUDA backward zeroes the tokens between)
  assert np.all(start[:-1] + length[:-1] <= start[1:]), (start, length)
  owner = np.full(tokens, -1)
  for b, (s0, n) in enumerate(zip(start, length)):
    assert np.all(owner[s0:s0 + n] == -1), f"row {b} overlaps row {owner[s0:s0 + n].max()}"
    owner[s0:s0 + n] = b
  want = _ragged_rows(cu, tokens)
  assert [list(range(s0, s0 + min(n, 16))) for s0, n in zip(start, length)] == want
  c = np.clip(cu, 0, tokens)
  if np.all(np.diff(c) >= 0):
    np.testing.assert_array_equal(start, c[:-1])
    np.testing.assert_array_equal(length, np.diff(c))


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_forward(dtype):
  rng = np.random.default_rng(2)
  t, hq, hkv, d = 60, 6, 3, 16
  q = _rand(rng, (8, hq, d), dtype)
  k, v = _rand(rng, (t, hkv, d), dtype), _rand(rng, (t, hkv, d), dtype)
  # empty rows, a row longer than 16 (keeps its first 16), a decreasing value and one past T.
  cu = np.array([2, 5, 5, 30, 28, 40, 41, 41, 99], np.int32)
  ref = _numpy_reference(q, k, v, _ragged_rows(cu, t), d ** -0.5)
  for impl in ("cpu", "xla"):
    out = jax.jit(functools.partial(small_seq_attention, implementation=impl))(
        q, k, v, kv_cu_seqlens=cu)
    _assert_close(out, ref, TOL[dtype], impl)
  np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0)
  np.testing.assert_array_equal(np.asarray(out[3:], np.float32), 0)  # from the decrease on


@needs_cpu_kernel
def test_ragged_max_kv_len():
  """Rows attend to their first max_kv_len tokens; the saved probabilities have that many columns."""
  t, hq, hkv, d = 40, 4, 2, 16
  q, k, v, dout = _ragged_inputs(np.random.default_rng(12), 6, t, hq, hkv, d)
  cu = np.array([0, 3, 4, 4, 10, 12, 40], np.int32)
  ref = _numpy_reference(q, k, v, _ragged_rows(cu, t, 4), d ** -0.5)
  f = lambda impl: lambda q, k, v: small_seq_attention(q, k, v, kv_cu_seqlens=cu, max_kv_len=4,
                                                       implementation=impl)
  for impl in ("cpu", "xla"):
    _assert_close(jax.jit(f(impl))(q, k, v), ref, TOL[jnp.float32], impl)
  got = _cpu_grads_close_to_reference(f, (q, k, v), dout)
  np.testing.assert_array_equal(np.asarray(got[1])[16:], 0)  # past the last row's 4 tokens
  probs_shape = jax.eval_shape(lambda *a: jax.vjp(f("cpu"), *a)[1], q, k, v)
  assert any(x.shape == (6, hq, 4) for x in jax.tree_util.tree_leaves(probs_shape))


@needs_cpu_kernel
def test_saved_probabilities():
  rng = np.random.default_rng(3)
  q, k, v = _padded(rng, 5, 6, 4, 2, 16, jnp.float32)
  lengths = jnp.array([6, 0, 2, 6, 1], jnp.int32)
  mask = jnp.full((5,), -1, jnp.int32)
  config = SmallSeqConfig(0.25, 6, False)
  registry.ensure_registered()
  out, probs = jax.jit(lambda *a: local_fwd(*a, config))(q, k, v, lengths, mask)
  ref_out, ref_probs = jax.jit(lambda *a: small_seq_reference(*a, config))(q, k, v, (lengths, mask))
  assert probs.shape == (5, 4, 6) and probs.dtype == jnp.float32
  np.testing.assert_allclose(probs, ref_probs, atol=1e-6)
  np.testing.assert_allclose(out, ref_out, atol=1e-5)
  np.testing.assert_array_equal(probs[1], 0)
  np.testing.assert_array_equal(probs[2, :, 2:], 0)


_SWEEP_HEADS = [(1, 1), (4, 4), (8, 8), (32, 32), (4, 1), (8, 2), (32, 8)]  # bench_small_seq.py --sweep


@needs_cpu_kernel
@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(skv=st.integers(1, 16), heads=st.sampled_from(_SWEEP_HEADS), d=st.sampled_from([8, 16, 64]),
                  ragged=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_sweep_shapes_forward_and_gradients(skv, heads, d, ragged, seed):
  """The shape space of the sweep (1-16 keys, 1-32 heads, MHA and GQA groups of 4, padded rows
  with lengths in [0, Skv] and ragged rows with max_kv_len = Skv): the CPU kernels against the
  float64 reference (forward) and against the pure-JAX reference (gradients)."""
  rng = np.random.default_rng(seed)
  hq, hkv = heads
  b = 5
  lengths = rng.integers(0, skv + 1, b).astype(np.int32)
  q, dout = _rand(rng, (b, hq, d), jnp.float32), _rand(rng, (b, hq, d), jnp.float32)
  if ragged:
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = max(int(cu[-1]), 1)
    k, v = _rand(rng, (t, hkv, d), jnp.float32), _rand(rng, (t, hkv, d), jnp.float32)
    rows, kwargs = _ragged_rows(cu, t, skv), dict(kv_cu_seqlens=cu, max_kv_len=skv)
    k_flat, v_flat = k, v
  else:
    q, k, v = _padded(rng, b, skv, hq, hkv, d, jnp.float32)
    rows, kwargs = _padded_rows(lengths, skv), dict(kv_lengths=jnp.asarray(lengths))
    k_flat, v_flat = k.reshape(b * skv, hkv, d), v.reshape(b * skv, hkv, d)
  f = lambda impl: lambda q, k, v: small_seq_attention(q, k, v, implementation=impl, **kwargs)
  out, got = _vjp(f("cpu"), (q, k, v), dout)
  _assert_close(out, _numpy_reference(q, k_flat, v_flat, rows, d ** -0.5), TOL[jnp.float32], "out")
  _, want = _vjp(f("xla"), (q, k, v), dout)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    _assert_close(g, w, GRAD_TOL[jnp.float32], name)


# ---------------------------------------------------------------- gradients


@needs_cpu_kernel
@pytest.mark.parametrize("dtype,hq,hkv", [(jnp.float32, 8, 2), (jnp.bfloat16, 4, 4),
                                           (jnp.float16, 8, 2)])
def test_padded_gradients(dtype, hq, hkv):
  rng = np.random.default_rng(4)
  b, s, d = 7, 5, 16
  q, k, v = _padded(rng, b, s, hq, hkv, d, dtype)
  dout = _rand(rng, (b, hq, d), dtype)
  lengths = jnp.array([5, 0, 2, 9, 1, 3, -1], jnp.int32)
  f = lambda impl: lambda q, k, v: small_seq_attention(q, k, v, kv_lengths=lengths,
                                                       implementation=impl)
  _, got = jax.jit(lambda *a: _vjp(f("cpu"), a, dout))(q, k, v)
  _, want = jax.jit(lambda *a: _vjp(f("xla"), a, dout))(q, k, v)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert g.dtype == dtype
    _assert_close(g, w, GRAD_TOL[dtype], name)
  dq, dk, dv = (np.asarray(x, np.float32) for x in got)
  np.testing.assert_array_equal(dq[1], 0)     # zero-length row
  np.testing.assert_array_equal(dq[6], 0)
  np.testing.assert_array_equal(dk[1], 0)
  np.testing.assert_array_equal(dv[2, 2:], 0)  # tokens past a row's length
  np.testing.assert_array_equal(dk[4, 1:], 0)


@needs_cpu_kernel
def test_ragged_gradients():
  t, hq, hkv, d = 50, 4, 2, 16
  q, k, v, dout = _ragged_inputs(np.random.default_rng(5), 6, t, hq, hkv, d)
  cu = jnp.array([3, 8, 8, 30, 33, 34, 45], jnp.int32)  # row 2 has 22 tokens: first 16 used
  f = lambda impl: lambda q, k, v: small_seq_attention(q, k, v, kv_cu_seqlens=cu,
                                                       implementation=impl)
  got = _cpu_grads_close_to_reference(f, (q, k, v), dout)
  dk = np.asarray(got[1])
  covered = np.zeros(t, bool)
  for row in _ragged_rows(np.asarray(cu), t):
    covered[row] = True
  np.testing.assert_array_equal(dk[~covered], 0)  # tokens no row covers get zero gradient
  assert np.abs(dk[covered]).sum() > 0
  np.testing.assert_array_equal(np.asarray(got[0])[1], 0)


# ---------------------------------------------------------------- transformations


@needs_cpu_kernel
def test_vmap_padded_and_grad():
  rng = np.random.default_rng(6)
  n, b, s, hq, hkv, d = 3, 4, 6, 4, 2, 16
  q = _rand(rng, (n, b, hq, d), jnp.float32)
  k, v = _rand(rng, (n, b, s, hkv, d), jnp.float32), _rand(rng, (b, s, hkv, d), jnp.float32)
  lengths = jnp.array([[6, 0, 3, 1], [2, 2, 2, 2], [0, 0, 6, 5]], jnp.int32)

  def loss(impl, q, k):
    fn = lambda q, k, n_: small_seq_attention(q, k, v, kv_lengths=n_, implementation=impl)
    return jnp.sum(jnp.sin(jax.vmap(fn)(q, k, lengths)))

  got = jax.jit(jax.value_and_grad(functools.partial(loss, "cpu"), argnums=(0, 1)))(q, k)
  want = jax.jit(jax.value_and_grad(functools.partial(loss, "xla"), argnums=(0, 1)))(q, k)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(got[1], want[1]):
    _assert_close(g, w, GRAD_TOL[jnp.float32])


@needs_cpu_kernel
def test_vmap_ragged_and_grad():
  rng = np.random.default_rng(7)
  n, t, hq, hkv, d = 2, 20, 4, 4, 8
  q = _rand(rng, (n, 5, hq, d), jnp.float32)
  k = _rand(rng, (n, t, hkv, d), jnp.float32)
  v = _rand(rng, (t, hkv, d), jnp.float32)  # not mapped
  cu = jnp.array([[0, 3, 3, 10, 12, 20], [1, 2, 9, 9, 15, 18]], jnp.int32)

  def loss(impl, q, k, v):
    fn = lambda q, k, c: small_seq_attention(q, k, v, kv_cu_seqlens=c, implementation=impl)
    return jnp.sum(jnp.cos(jax.vmap(fn)(q, k, cu)))

  got = jax.jit(jax.value_and_grad(functools.partial(loss, "cpu"), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.value_and_grad(functools.partial(loss, "xla"), argnums=(0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(got[1], want[1]):
    _assert_close(g, w, GRAD_TOL[jnp.float32])


@needs_cpu_kernel
def test_default_implementation_and_eager():
  rng = np.random.default_rng(8)
  q, k, v = _padded(rng, 3, 4, 2, 2, 8, jnp.float32)
  eager = small_seq_attention(q, k, v)  # implementation None -> the CPU kernel here (eager)
  jitted = jax.jit(small_seq_attention)(q, k, v)
  ref = jax.jit(functools.partial(small_seq_attention, implementation="xla"))(q, k, v)
  np.testing.assert_allclose(eager, ref, atol=1e-5)
  np.testing.assert_allclose(jitted, ref, atol=1e-5)


# ---------------------------------------------------------------- sharding


def _mesh(devices, shape):
  return Mesh(np.array(devices[:8]).reshape(shape), ("dp", "tp"))


def _check_no_collectives(compiled_text):
  found = [c for c in COLLECTIVES if c in compiled_text]
  assert not found, f"unexpected collectives {found} in the compiled HLO"


@needs_cpu_kernel
@pytest.mark.parametrize("with_lengths", [True, False])
@pytest.mark.parametrize("mesh_shape,hq,hkv", [((8, 1), 4, 2), ((1, 8), 16, 8), ((2, 4), 8, 4)])
def test_sharded_padded(cpu_devices, mesh_shape, hq, hkv, with_lengths):
  rng = np.random.default_rng(9)
  b, s, d = 16, 5, 16
  q, k, v = _padded(rng, b, s, hq, hkv, d, jnp.bfloat16)
  dout = _rand(rng, (b, hq, d), jnp.bfloat16)
  lengths = jnp.asarray(rng.integers(0, s + 1, b) if with_lengths else np.full(b, s), jnp.int32)

  def f(q, k, v, lengths, dout):
    fn = lambda q, k, v: small_seq_attention(q, k, v, kv_lengths=lengths if with_lengths else None,
                                             implementation="cpu")
    return _vjp(fn, (q, k, v), dout)

  want = jax.jit(f)(q, k, v, lengths, dout)
  mesh = _mesh(cpu_devices, mesh_shape)
  sq = NamedSharding(mesh, P("dp", "tp", None))
  skv = NamedSharding(mesh, P("dp", None, "tp", None))
  args = (jax.device_put(q, sq), jax.device_put(k, skv), jax.device_put(v, skv),
          jax.device_put(lengths, NamedSharding(mesh, P("dp"))), jax.device_put(dout, sq))
  jf = jax.jit(f)
  _check_no_collectives(jf.lower(*args).compile().as_text())
  got = jf(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout,mesh_shape", [("padded", (2, 4)), ("padded", (8, 1)), ("ragged", (1, 8))])
def test_sharded_one_key_path(cpu_devices, monkeypatch, layout, mesh_shape, dtype):
  """The one-key path (pure JAX, what a GPU runs for rows of one key) sharded like the kernels:
  batch (padded) and heads with no collective, values and gradients equal to the unsharded call;
  bfloat16 rows moved as 32-bit pairs (one_key.PAIRS_MIN_ROWS lowered to these 16 rows)."""
  monkeypatch.setattr(one_key, "PAIRS_MIN_ROWS", 16)
  rng = np.random.default_rng(12)
  b, hq, hkv, d = 16, 16, 8, 8
  q, k, v, index = _one_key_case(rng, layout, b, hq, hkv, d, dtype)
  dout = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
  config = SmallSeqConfig(d ** -0.5, 1, layout == "ragged")

  def f(q, k, v, dout, index):
    return _vjp(lambda q, k, v: one_key_attention(q, k, v, index, config), (q, k, v), dout)

  want = jax.jit(f)(q, k, v, dout, index)
  mesh = _mesh(cpu_devices, mesh_shape)
  rows = "dp" if layout == "padded" else None
  sq = NamedSharding(mesh, P(rows, "tp", None))
  skv = NamedSharding(mesh, P(rows, None, "tp", None) if layout == "padded" else P(None, "tp", None))
  args = (jax.device_put(q, sq), jax.device_put(k, skv), jax.device_put(v, skv), jax.device_put(dout, sq),
          tuple(jax.device_put(x, NamedSharding(mesh, P(rows))) for x in index))
  jf = jax.jit(f)
  _check_no_collectives(jf.lower(*args).compile().as_text())
  for g, w in zip(jax.tree.leaves(jf(*args)), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(tokens=st.integers(1, 30), cu=st.lists(st.integers(-3, 33), min_size=2, max_size=10),
                  mask=st.lists(st.integers(-2, 3), min_size=9, max_size=9))
def test_one_key_ragged_matches_the_reference_for_any_cu(tokens, cu, mask):
  """Ragged rows of one key for any kv_cu_seqlens (decreasing, out of range, empty rows): the
  allowed rows start at distinct tokens (the backward's scatter promises unique indices), and
  output and dV equal the reference's."""
  b = len(cu) - 1
  start, length = ragged_rows(jnp.asarray(cu, jnp.int32), tokens)
  index = (start, length, jnp.asarray(mask[:b], jnp.int32))
  first, allowed = (np.asarray(x) for x in one_key._ragged_first_tokens(index, b, tokens))
  assert len(set(first[allowed])) == allowed.sum()
  rng = np.random.default_rng(len(cu))
  q = jnp.asarray(rng.standard_normal((b, 4, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((tokens, 2, 8)), jnp.float32) for _ in range(2))
  dout = jnp.asarray(rng.standard_normal((b, 4, 8)), jnp.float32)
  config = SmallSeqConfig(8 ** -0.5, 1, True)
  got, got_vjp = jax.vjp(lambda v: one_key_attention(q, k, v, index, config), v)
  want, want_vjp = jax.vjp(lambda v: small_seq_reference(q, k, v, index, config)[0], v)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_allclose(np.asarray(got_vjp(dout)[0]), np.asarray(want_vjp(dout)[0]), atol=1e-6)


@needs_cpu_kernel
def test_padded_defaults_are_not_materialised():
  """Without kv_lengths the padded call passes empty index arrays (the kernels' defaults: rows of
  Skv tokens from b * Skv, every token allowed), so XLA computes no index array, and the result
  is the one with explicit full lengths."""
  rng = np.random.default_rng(4)
  b, s, hq, hkv, d = 8, 3, 4, 2, 16
  q, k, v = _padded(rng, b, s, hq, hkv, d, jnp.float32)
  fn = jax.jit(lambda q, k, v: small_seq_attention(q, k, v, implementation="cpu"))
  hlo = fn.lower(q, k, v).compile().as_text()
  assert "s32[0]" in hlo and "iota" not in hlo and "broadcast" not in hlo, hlo
  full = small_seq_attention(q, k, v, kv_lengths=jnp.full((b,), s, jnp.int32), implementation="cpu")
  np.testing.assert_array_equal(np.asarray(fn(q, k, v)), np.asarray(full))


@needs_cpu_kernel
def test_sharded_ragged_heads(cpu_devices):
  rng = np.random.default_rng(10)
  t, hq, hkv, d = 40, 16, 8, 16
  q = _rand(rng, (6, hq, d), jnp.float32)
  k, v = _rand(rng, (t, hkv, d), jnp.float32), _rand(rng, (t, hkv, d), jnp.float32)
  dout = _rand(rng, (6, hq, d), jnp.float32)
  cu = jnp.array([0, 4, 4, 20, 25, 33, 40], jnp.int32)

  def f(q, k, v, dout):
    fn = lambda q, k, v: small_seq_attention(q, k, v, kv_cu_seqlens=cu, implementation="cpu")
    return _vjp(fn, (q, k, v), dout)

  want = jax.jit(f)(q, k, v, dout)
  mesh = _mesh(cpu_devices, (1, 8))
  sq, skv = NamedSharding(mesh, P(None, "tp", None)), NamedSharding(mesh, P(None, "tp", None))
  args = (jax.device_put(q, sq), jax.device_put(k, skv), jax.device_put(v, skv),
          jax.device_put(dout, sq))
  jf = jax.jit(f)
  _check_no_collectives(jf.lower(*args).compile().as_text())
  got = jf(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6)


# ---------------------------------------------------------------- bad input


def _bad_cases():
  f32, bf16 = jnp.float32, jnp.bfloat16
  q = jnp.zeros((4, 4, 8), f32)
  k = jnp.zeros((4, 6, 2, 8), f32)
  kr = jnp.zeros((20, 2, 8), f32)
  cu = jnp.array([0, 2, 4, 6, 8], jnp.int32)
  return [
      ("query", dict(query=jnp.zeros((4, 1, 4, 8), f32), key=k, value=k)),
      ("query", dict(query=q.astype(jnp.int32), key=k, value=k)),
      ("share a dtype", dict(query=q, key=k.astype(bf16), value=k.astype(bf16))),
      ("same shape", dict(query=q, key=k, value=jnp.zeros((4, 5, 2, 8), f32))),
      ("key must have rank", dict(query=q, key=jnp.zeros((4, 2, 8, 1, 1), f32),
                                  value=jnp.zeros((4, 2, 8, 1, 1), f32))),
      ("sequence length", dict(query=q, key=jnp.zeros((4, 17, 2, 8), f32),
                               value=jnp.zeros((4, 17, 2, 8), f32))),
      ("key batch", dict(query=q, key=jnp.zeros((3, 6, 2, 8), f32),
                         value=jnp.zeros((3, 6, 2, 8), f32))),
      ("head_dim", dict(query=q, key=jnp.zeros((4, 6, 2, 4), f32),
                        value=jnp.zeros((4, 6, 2, 4), f32))),
      ("multiple of key/value heads", dict(query=q, key=jnp.zeros((4, 6, 3, 8), f32),
                                           value=jnp.zeros((4, 6, 3, 8), f32))),
      ("kv_lengths", dict(query=q, key=k, value=k, kv_lengths=jnp.zeros((5,), jnp.int32))),
      ("kv_lengths", dict(query=q, key=k, value=k, kv_lengths=jnp.zeros((4,), f32))),
      ("kv_cu_seqlens", dict(query=q, key=k, value=k, kv_cu_seqlens=cu)),
      ("kv_cu_seqlens", dict(query=q, key=kr, value=kr)),
      ("kv_cu_seqlens", dict(query=q, key=kr, value=kr, kv_cu_seqlens=cu[:4])),
      ("kv_lengths", dict(query=q, key=kr, value=kr, kv_cu_seqlens=cu,
                          kv_lengths=jnp.zeros((4,), jnp.int32))),
      ("max_kv_len", dict(query=q, key=k, value=k, max_kv_len=4)),
      ("max_kv_len", dict(query=q, key=kr, value=kr, kv_cu_seqlens=cu, max_kv_len=17)),
      ("max_kv_len", dict(query=q, key=kr, value=kr, kv_cu_seqlens=cu, max_kv_len=2.0)),
      ("scale", dict(query=q, key=k, value=k, scale="big")),
      ("implementation", dict(query=q, key=k, value=k, implementation="triton")),
  ]


@pytest.mark.parametrize("needle,kwargs", _bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input(needle, kwargs):
  with pytest.raises(ValueError, match=needle):
    small_seq_attention(**kwargs)


@needs_cpu_kernel
def test_cuda_implementation_unavailable_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU backend only")
  q, k = jnp.zeros((2, 2, 64), jnp.bfloat16), jnp.zeros((2, 3, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="implementation"):
    small_seq_attention(q, k, k, implementation="cuda")


# ---------------------------------------------------------------- use from jaxcp.attention


@needs_cpu_kernel
@pytest.mark.parametrize("mask_kind", ["none", "kv_segments", "causal_window", "chunk", "empty"])
def test_from_attention(mask_kind):
  from jaxcp._src import masks
  from jaxcp._src.attention.api import attention

  rng = np.random.default_rng(11)
  b, skv, hq, hkv, d = 5, 9, 4, 2, 16
  q = _rand(rng, (b, 1, hq, d), jnp.float32)
  k, v = _rand(rng, (b, skv, hkv, d), jnp.float32), _rand(rng, (b, skv, hkv, d), jnp.float32)
  dout = _rand(rng, (b, 1, hq, d), jnp.float32)
  kw = {}
  if mask_kind == "kv_segments":  # padding given as kv segment 0, plus a second document
    kv_seg = np.ones((b, skv), np.int32)
    kv_seg[1, 4:] = 0
    kv_seg[2, :] = 2
    kv_seg[3, ::2] = 0
    kw = dict(segment_ids=jnp.ones((b, 1), jnp.int32), kv_segment_ids=jnp.asarray(kv_seg))
  elif mask_kind == "causal_window":
    kw = dict(is_causal=True, local_window_size=(3, 0))
  elif mask_kind == "chunk":
    kw = dict(chunk_size=4)
  elif mask_kind == "empty":
    kw = dict(segment_ids=jnp.zeros((b, 1), jnp.int32), kv_segment_ids=jnp.ones((b, skv), jnp.int32))
  assert small_seq_eligible(q, k, implementation="cpu")
  spec = masks.make_mask_spec(kw.get("is_causal", False), kw.get("local_window_size"),
                              kw.get("chunk_size"))
  tokens = masks.token_arrays(b, 1, skv, segment_ids=kw.get("segment_ids"), positions=None,
                              kv_segment_ids=kw.get("kv_segment_ids"), kv_positions=None,
                              cu_seqlens=None)
  fn = lambda q, k, v: small_seq_from_attention(q, k, v, *tokens, spec, d ** -0.5, "cpu")
  ref = lambda q, k, v: attention(q, k, v, implementation="xla", **kw)
  got, gg = jax.jit(lambda *a: _vjp(fn, a, dout))(q, k, v)
  want, gw = jax.jit(lambda *a: _vjp(ref, a, dout))(q, k, v)
  assert got.shape == (b, 1, hq, d)
  _assert_close(got, want, 1e-5, "out")
  for name, g, w in zip(("dq", "dk", "dv"), gg, gw):
    _assert_close(g, w, 1e-4, name)
  if mask_kind == "empty":
    np.testing.assert_array_equal(np.asarray(got), 0)


def test_eligibility_rules():
  q1 = jnp.zeros((2, 1, 4, 64), jnp.bfloat16)
  k = jnp.zeros((2, 16, 2, 64), jnp.bfloat16)
  assert small_seq_eligible(q1, k, implementation="cuda")
  assert small_seq_eligible(q1, k, implementation="cpu")
  assert not small_seq_eligible(q1, k, implementation="xla")
  assert not small_seq_eligible(q1, k, implementation="cuda", return_residual=True)
  assert not small_seq_eligible(q1, k, implementation="cuda", context_parallel_axis="cp")
  assert not small_seq_eligible(jnp.zeros((2, 2, 4, 64), jnp.bfloat16), k, implementation="cuda")
  assert not small_seq_eligible(q1, jnp.zeros((2, 17, 2, 64), jnp.bfloat16), implementation="cuda")
  assert not small_seq_eligible(q1.astype(jnp.float32), k.astype(jnp.float32), implementation="cuda")
  assert not small_seq_eligible(jnp.zeros((2, 1, 4, 96), jnp.bfloat16),
                                jnp.zeros((2, 16, 2, 96), jnp.bfloat16), implementation="cuda")


# ---------------------------------------------------------------- GPU


def _gpu_case(rng, dtype, b, s, hq, hkv, d):
  q, k, v = _padded(rng, b, s, hq, hkv, d, dtype)
  lengths = jnp.asarray(rng.integers(-1, s + 2, b), jnp.int32).at[0].set(0).at[1].set(s)
  return q, k, v, lengths


_GPU_PADDED = (
    [(jnp.bfloat16, d, 16, 8, 8) for d in (64, 128, 256, 512)]
    + [(jnp.bfloat16, d, 8, 16, 4) for d in (64, 128, 256, 512)]
    + [(jnp.float16, d, 11, 8, 2) for d in (64, 128, 256, 512)]
    + [(jnp.bfloat16, 128, 5, 4, 1), (jnp.bfloat16, 64, 1, 2, 2), (jnp.float16, 256, 12, 6, 2),
       (jnp.bfloat16, 128, 3, 64, 2)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,s,hq,hkv", _GPU_PADDED)
def test_gpu_padded(dtype, d, s, hq, hkv):
  rng = np.random.default_rng(12)
  b = 37
  q, k, v, lengths = _gpu_case(rng, dtype, b, s, hq, hkv, d)
  dout = _rand(rng, (b, hq, d), dtype)
  f = lambda impl: lambda q, k, v: small_seq_attention(q, k, v, kv_lengths=lengths,
                                                       implementation=impl)
  out, grads = jax.jit(lambda *a: _vjp(f("cuda"), a, dout))(q, k, v)
  rout, rgrads = jax.jit(lambda *a: _vjp(f("xla"), a, dout))(q, k, v)
  _assert_close(out, rout, TOL[dtype], "out")
  for name, g, w in zip(("dq", "dk", "dv"), grads, rgrads):
    _assert_close(g, w, GRAD_TOL[dtype], name)
  np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0)
  dk = np.asarray(grads[1], np.float32)
  ln = np.clip(np.asarray(lengths), 0, s)
  for i in range(b):
    np.testing.assert_array_equal(dk[i, ln[i]:], 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 64), (jnp.bfloat16, 128), (jnp.bfloat16, 256),
                                     (jnp.bfloat16, 512), (jnp.float16, 128)])
def test_gpu_ragged(dtype, d):
  rng = np.random.default_rng(13)
  t, hq, hkv = 300, 8, 2
  lens = rng.integers(0, 20, 24)
  cu = np.concatenate([[3], 3 + np.cumsum(lens)]).astype(np.int32)
  cu[-1] = t + 5  # past the end: clamped
  q = _rand(rng, (24, hq, d), dtype)
  k, v = _rand(rng, (t, hkv, d), dtype), _rand(rng, (t, hkv, d), dtype)
  dout = _rand(rng, (24, hq, d), dtype)
  f = lambda impl: lambda q, k, v: small_seq_attention(q, k, v, kv_cu_seqlens=cu,
                                                       implementation=impl)
  out, grads = jax.jit(lambda *a: _vjp(f("cuda"), a, dout))(q, k, v)
  rout, rgrads = jax.jit(lambda *a: _vjp(f("xla"), a, dout))(q, k, v)
  _assert_close(out, rout, TOL[dtype], "out")
  for name, g, w in zip(("dq", "dk", "dv"), grads, rgrads):
    _assert_close(g, w, GRAD_TOL[dtype], name)
  covered = np.zeros(t, bool)
  for row in _ragged_rows(cu, t):
    covered[row] = True
  np.testing.assert_array_equal(np.asarray(grads[1], np.float32)[~covered], 0)
  np.testing.assert_array_equal(np.asarray(grads[2], np.float32)[~covered], 0)


@pytest.mark.gpu
def test_gpu_probabilities_and_mask():
  rng = np.random.default_rng(14)
  q, k, v = _padded(rng, 9, 11, 8, 2, 128, jnp.bfloat16)
  lengths = jnp.array([11, 0, 3, 11, 7, 1, 11, 11, 5], jnp.int32)
  mask = jnp.asarray(rng.integers(0, 1 << 11, 9), jnp.int32)
  config = SmallSeqConfig(0.1, 11, False)
  registry.ensure_registered()
  out, probs = jax.jit(lambda *a: local_fwd(*a, config))(q, k, v, lengths, mask)
  ref_out, ref_probs = small_seq_reference(q, k, v, (lengths, mask), config)
  np.testing.assert_allclose(probs, ref_probs, atol=2e-3)
  _assert_close(out, ref_out, TOL[jnp.bfloat16])


@pytest.mark.gpu
def test_gpu_vmap_and_default():
  rng = np.random.default_rng(15)
  q = _rand(rng, (2, 10, 8, 128), jnp.bfloat16)
  k = _rand(rng, (2, 10, 16, 4, 128), jnp.bfloat16)
  v = _rand(rng, (2, 10, 16, 4, 128), jnp.bfloat16)
  got = jax.jit(jax.vmap(small_seq_attention))(q, k, v)  # implementation None -> cuda
  want = jax.vmap(functools.partial(small_seq_attention, implementation="xla"))(q, k, v)
  _assert_close(got, want, TOL[jnp.bfloat16])


def _small_seq_custom_calls(fn, *args) -> list:
  """The small-seq custom calls of fn's lowered program, each with its "kernel" attribute."""
  hlo = jax.jit(fn).lower(*args).as_text()
  return [line for line in hlo.splitlines() if "jaxcp_small_seq_" in line and "custom_call" in line]


def _one_key_case(rng, layout, b, hq, hkv, d, dtype):
  """q, k, v and the index of rows of one key: padded lengths in and out of [0, 1], or ragged rows
  of 0-2 tokens (the second one not attended) with a tail of tokens no row owns; random mask
  bits in both."""
  q = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
  mask = jnp.asarray(rng.integers(0, 4, b), jnp.int32)
  if layout == "padded":
    k, v = (jnp.asarray(rng.standard_normal((b, 1, hkv, d)), dtype) for _ in range(2))
    return q, k, v, (jnp.asarray(rng.integers(-2, 4, b), jnp.int32), mask)
  cu = np.concatenate([[0], np.cumsum(rng.integers(0, 3, b))]).astype(np.int32)
  t = int(cu[-1]) + 3
  k, v = (jnp.asarray(rng.standard_normal((t, hkv, d)), dtype) for _ in range(2))
  return q, k, v, (*ragged_rows(jnp.asarray(cu), t), mask)


@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("layout", ["padded", "ragged"])
@pytest.mark.parametrize("hq,hkv,dtype", [(8, 8, jnp.bfloat16), (4, 2, jnp.float32), (8, 2, jnp.float16),
                                          (4, 1, jnp.bfloat16)])
def test_one_key_path_matches_the_reference(monkeypatch, layout, hq, hkv, dtype, pairs):
  """The one-key path (implementation=None on a GPU for rows of one key): the reference's output
  and gradients (dQ = dK = 0, dV = dO over the group) for lengths in and out of range and keys
  the mask forbids, also under jit and vmap; with 16-bit rows moved as 32-bit pairs (as from
  PAIRS_MIN_ROWS rows) or as they are."""
  if pairs:
    monkeypatch.setattr(one_key, "PAIRS_MIN_ROWS", 1)
  rng = np.random.default_rng(11)
  b, d = 64, 32
  q, k, v, index = _one_key_case(rng, layout, b, hq, hkv, d, dtype)
  dout = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
  config = SmallSeqConfig(d ** -0.5, 1, layout == "ragged")
  runs = [jax.vjp(lambda q, k, v, f=f: f(q, k, v, index, config), q, k, v)
          for f in (one_key_attention, lambda *a: small_seq_reference(*a)[0])]
  (got, got_vjp), (want, want_vjp) = runs
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  zero_rows = ~np.asarray(want, np.float32).any(axis=(1, 2))
  assert 0 < zero_rows.sum() < b and not np.asarray(got)[zero_rows].any()
  grads = got_vjp(dout)
  assert not np.asarray(grads[0]).any() and not np.asarray(grads[1]).any()
  assert np.asarray(grads[2], np.float32).any()
  for g, w in zip(grads, want_vjp(dout)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)
  batched = jax.jit(jax.vmap(jax.grad(lambda v, i: one_key_attention(q, k, v, i, config).astype(
      jnp.float32).sum()), in_axes=(0, None)))(jnp.stack([v, 2 * v]), index)
  single = jax.grad(lambda v: small_seq_reference(q, k, v, index, config)[0].astype(jnp.float32).sum())(v)
  for g in batched:
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(single, np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("layout", ["padded", "ragged"])
@pytest.mark.parametrize("dtype,d,pairs", [(jnp.bfloat16, 32, True), (jnp.float16, 8, True), (jnp.bfloat16, 7, False),
                                           (jnp.float32, 32, False)])
def test_one_key_path_moves_16_bit_rows_as_pairs(monkeypatch, layout, dtype, d, pairs):
  """From PAIRS_MIN_ROWS rows, 16-bit rows of even D are gathered and broadcast as uint32 pairs,
  forward and backward (XLA moves them at 60-90% of a copy's bandwidth, pairs at 92-113% on an
  H200); other rows, and fewer rows, as they are. Values stay bit for bit
  (test_one_key_path_matches_the_reference)."""
  rng = np.random.default_rng(2)
  q, k, v, index = _one_key_case(rng, layout, 16, 4, 1, d, dtype)
  config = SmallSeqConfig(d ** -0.5, 1, layout == "ragged")
  loss = lambda v: one_key_attention(q, k, v, index, config).astype(jnp.float32).sum()
  casts = lambda: re.findall(r"stablehlo\.bitcast_convert .*-> tensor<[^>]*xui32>",
                             jax.jit(jax.value_and_grad(loss)).lower(v).as_text())
  assert not casts()  # 16 rows
  monkeypatch.setattr(one_key, "PAIRS_MIN_ROWS", 16)
  assert (len(casts()) >= (2 if layout == "ragged" else 1)) == pairs, casts()


def test_one_key_forward_alone_moves_rows_without_groups_as_pairs(monkeypatch):
  """Padded rows without groups (as from PAIRS_MIN_ROWS rows): the forward alone moves them as
  uint32 pairs; differentiated, its forward and dV keep 16-bit rows (faster together on an H200).
  Bit for bit the same output either way."""
  monkeypatch.setattr(one_key, "PAIRS_MIN_ROWS", 16)
  rng = np.random.default_rng(4)
  q, k, v, index = _one_key_case(rng, "padded", 16, 4, 4, 32, jnp.bfloat16)
  config = SmallSeqConfig(32 ** -0.5, 1, False)
  attend = lambda v: one_key_attention(q, k, v, index, config)
  casts = lambda f: re.findall(r"stablehlo\.bitcast_convert .*-> tensor<[^>]*xui32>", jax.jit(f).lower(v).as_text())
  assert casts(attend)
  assert not casts(lambda v: jax.vjp(attend, v))
  assert not casts(jax.grad(lambda v: attend(v).astype(jnp.float32).sum()))
  np.testing.assert_array_equal(np.asarray(jax.jit(attend)(v), np.float32),
                                np.asarray(jax.vjp(attend, v)[0], np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("hq,hkv", [(4, 1), (8, 2), (6, 3)])
def test_one_key_group_sum_of_pairs_is_bit_for_bit(dtype, hq, hkv):
  """dV of rows of one key summed over the group as uint32 pairs (two 16-bit values a word,
  widened and summed separately) equals the sum over 16-bit elements bit for bit, infinities,
  subnormals and overflow included."""
  rng = np.random.default_rng(5)
  b, d = 32, 16
  scales = np.array([1e-6, 1e-3, 1.0, 1e3, 3e4], np.float32)[rng.integers(0, 5, (b, hq, 1))]
  dout = jnp.asarray(rng.standard_normal((b, hq, d)).astype(np.float32) * scales, dtype)
  dout = dout.at[0, 0, :2].set(jnp.asarray([np.inf, -np.inf], dtype))
  plain = one_key._group_sum(dout, hkv, False)
  pairs = one_key._from_pairs(one_key._group_sum(dout, hkv, True), dout)
  assert one_key._group_sum(dout, hkv, True).dtype == jnp.uint32
  np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(pairs, jnp.uint16)),
                                np.asarray(jax.lax.bitcast_convert_type(plain, jnp.uint16)))


@pytest.mark.parametrize("layout", ["padded", "ragged"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1)])
def test_one_key_backward_skips_what_made_q_and_k(layout, hq, hkv):
  """dQ and dK of rows of one key are symbolic zeros: differentiating a model through the one-key
  path traces no matmul for the projections that made q and k (the gradient has the matmuls of a
  model without them), and their weights' gradients are zeros."""
  rng = np.random.default_rng(6)
  _, k, _, index = _one_key_case(rng, layout, 16, hq, hkv, 8, jnp.float32)
  kv_shape = k.shape  # padded [16, 1, Hkv, 8], ragged [tokens, Hkv, 8]
  config = SmallSeqConfig(8 ** -0.5, 1, layout == "ragged")
  x = jnp.asarray(rng.standard_normal((16, 12)), jnp.float32)
  ctx = jnp.asarray(rng.standard_normal((kv_shape[0], 12)), jnp.float32)
  w = {n: jnp.asarray(rng.standard_normal((12, h * 8)), jnp.float32) for n, h in (("q", hq), ("k", hkv), ("v", hkv))}

  def loss(w, with_qk=True):
    q = (x @ w["q"]).reshape(16, hq, 8) if with_qk else jnp.zeros((16, hq, 8))
    k = (ctx @ w["k"]).reshape(kv_shape) if with_qk else jnp.zeros(kv_shape)
    return one_key_attention(q, k, (ctx @ w["v"]).reshape(kv_shape), index, config).sum()

  dots = lambda f: str(jax.make_jaxpr(jax.grad(f))(w)).count("dot_general")
  assert dots(loss) == dots(functools.partial(loss, with_qk=False)) + 2  # + the forward's q and k
  grads = jax.grad(loss)(w)
  np.testing.assert_array_equal(grads["q"], 0)
  np.testing.assert_array_equal(grads["k"], 0)
  assert float(jnp.abs(grads["v"]).sum()) > 0


def test_one_key_ragged_backward_scatters_no_floats():
  """The ragged one-key backward gathers dO through an int32 token -> row map: the program's only
  scatter writes int32 (autodiff of the forward's gather would scatter-add dV)."""
  rng = np.random.default_rng(3)
  q, k, v, index = _one_key_case(rng, "ragged", 16, 4, 2, 8, jnp.bfloat16)
  config = SmallSeqConfig(8 ** -0.5, 1, True)
  hlo = jax.jit(jax.grad(lambda v: one_key_attention(q, k, v, index, config).astype(jnp.float32).sum())
                ).lower(v).compile().as_text()
  scatters = [line for line in hlo.splitlines() if re.search(r"= \S+ scatter\(", line)]
  assert scatters and all(re.search(r"= s32\[", line) for line in scatters), scatters


@needs_cpu_kernel
def test_cpu_default_always_runs_the_kernel():
  """prefer_one_key_path is a GPU rule: on the CPU, implementation=None runs the CPU kernel for
  one key too."""
  if jax.default_backend() != "cpu":
    pytest.skip("CPU backend only")
  q, k = jnp.zeros((4, 2, 16), jnp.float32), jnp.zeros((4, 1, 2, 16), jnp.float32)
  assert _small_seq_custom_calls(lambda q, k: small_seq_attention(q, k, k), q, k)


@pytest.mark.gpu
@pytest.mark.parametrize("skv,hq,hkv,want", [(1, 8, 8, None), (1, 4, 2, None), (1, 8, 2, None),
                                             (4, 8, 8, "fwd = 3"), (16, 8, 8, "fwd = 1"),
                                             (4, 16, 4, "bwd = 3"), (8, 16, 4, "bwd = 1")])
def test_gpu_default_dispatch_in_hlo(skv, hq, hkv, want):
  """implementation=None: padded rows of one key run the pure-JAX path (no custom call; ragged
  rows too: test_gpu_default_ragged_one_key_runs_no_kernel);
  elsewhere the kernel families of dispatch.py, named in the custom call's "kernel" attribute
  (1 = mma, 3 = lanes); implementation="cuda" always runs the kernels."""
  q = jnp.zeros((64, hq, 64), jnp.bfloat16)
  k = jnp.zeros((64, skv, hkv, 64), jnp.bfloat16)
  grad = lambda impl: lambda q, k: jax.grad(
      lambda q: small_seq_attention(q, k, k, implementation=impl).astype(jnp.float32).sum())(q)
  calls = _small_seq_custom_calls(grad(None), q, k)
  if want is None:
    assert not calls
    assert len(_small_seq_custom_calls(grad("cuda"), q, k)) == 2
  else:
    assert len(calls) == 2 and any(want in c for c in calls), calls


@pytest.mark.gpu
def test_gpu_default_ragged_one_key_runs_no_kernel():
  """implementation=None on ragged rows of one key runs the one-key path (no custom call);
  implementation="cuda" keeps the kernels."""
  q, k = jnp.zeros((64, 8, 64), jnp.bfloat16), jnp.zeros((64, 8, 64), jnp.bfloat16)
  cu = jnp.arange(65, dtype=jnp.int32)
  grad = lambda impl: jax.grad(lambda v: small_seq_attention(
      q, k, v, kv_cu_seqlens=cu, max_kv_len=1, implementation=impl).astype(jnp.float32).sum())
  assert not _small_seq_custom_calls(grad(None), k)
  assert len(_small_seq_custom_calls(grad("cuda"), k)) == 2
