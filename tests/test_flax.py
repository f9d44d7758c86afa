"""jaxcp.flax: attention_fn integrations (linen, nnx) and the SelfAttention modules."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

import jax
import jax.numpy as jnp

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jaxcp  # noqa: E402
import jaxcp.flax as jf  # noqa: E402
from tests.helpers import numpy_attention, rel_err  # noqa: E402

B, S, F = 2, 32, 32
TOL = 1e-5


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
  # Exact float32 projections on every backend (GPUs may otherwise use TF32).
  with jax.default_matmul_precision("highest"):
    yield


def _packed(rng, pad=True):
  """Two rows of several documents (second row with a padding tail)."""
  seg = np.zeros((B, S), np.int32)
  seg[0] = np.repeat([1, 2, 3], [9, 15, 8])
  seg[1, :27 if pad else S] = np.repeat([1, 2], [13, (27 if pad else S) - 13])
  x = rng.standard_normal((B, S, F)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(seg), jf.positions_from_segment_ids(jnp.asarray(seg))


def _dense_mask(seg, causal=True):
  mask = nn.make_attention_mask(seg, seg, jnp.equal) * nn.make_attention_mask(seg > 0, seg > 0)
  if causal:
    mask = mask * nn.make_causal_mask(seg)  # contiguous documents: causal in memory == in position
  return mask


# ------------------------------------------------------------------ attention_fn: linen


def test_positions_from_segment_ids():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0], [3, 3, 1, 1, 1, 1, 2]])
  np.testing.assert_array_equal(jf.positions_from_segment_ids(seg),
                                [[0, 1, 2, 0, 1, 0, 1], [0, 1, 0, 1, 2, 3, 0]])


def test_linen_mha_matches_flax_dense_mask_and_direct_call():
  x, seg, pos = _packed(np.random.default_rng(0))
  ours = nn.MultiHeadDotProductAttention(
      num_heads=4, attention_fn=jf.make_attention_fn(segment_ids=seg, positions=pos, is_causal=True))
  params = ours.init(jax.random.key(0), x)
  y = ours.apply(params, x)

  # Independent: Flax's own softmax attention with the equivalent dense mask.
  dense = nn.MultiHeadDotProductAttention(num_heads=4)
  y_dense = dense.apply(params, x, mask=_dense_mask(seg))
  valid = np.asarray(seg) > 0  # padding rows: jaxcp gives 0, Flax averages
  np.testing.assert_allclose(np.asarray(y)[valid], np.asarray(y_dense)[valid], atol=TOL, rtol=TOL)

  # Same as calling jaxcp.attention directly on the module's projections.
  def direct(query, key, value, **_):
    return jaxcp.attention(query, key, value, segment_ids=seg, positions=pos, is_causal=True)
  y_direct = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=direct).apply(params, x)
  np.testing.assert_allclose(y, y_direct, atol=1e-6, rtol=1e-6)


def test_linen_mha_inside_compact_module_and_grad():
  x, seg, pos = _packed(np.random.default_rng(1))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, seg, pos):
      fn = jf.make_attention_fn(segment_ids=seg, positions=pos, is_causal=True,
                                local_window_size=(4, 0))
      return nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn)(x)

  net = Net()
  params = jax.jit(net.init)(jax.random.key(0), x, seg, pos)
  loss = lambda p: jnp.sum(net.apply(p, x, seg, pos) ** 2)
  g = jax.jit(jax.grad(loss))(params)
  leaves = jax.tree.leaves(g)
  assert all(np.isfinite(np.asarray(l)).all() for l in leaves)
  assert all(float(jnp.abs(l).max()) > 0 for l in leaves)


def test_extra_batch_dims_and_unbatched():
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 3, 16, 2, 8)), jnp.float32) for _ in range(3))
  seg = jnp.asarray(np.repeat(np.repeat([[1] * 7 + [2] * 9], 3, 0)[None], 2, 0), jnp.int32)
  fn = jf.make_attention_fn(segment_ids=seg, is_causal=True)
  out = fn(q, k, v)
  ref = jaxcp.attention(q.reshape(6, 16, 2, 8), k.reshape(6, 16, 2, 8), v.reshape(6, 16, 2, 8),
                        segment_ids=seg.reshape(6, 16), is_causal=True)
  np.testing.assert_allclose(out, ref.reshape(out.shape), atol=1e-6)
  out1 = jf.make_attention_fn(segment_ids=seg[0, 0], is_causal=True)(q[0, 0], k[0, 0], v[0, 0])
  np.testing.assert_allclose(out1, ref[0], atol=1e-6)


# ------------------------------------------------------------------ attention_fn: nnx


_NNX_INIT = inspect.signature(nnx.MultiHeadAttention.__init__).parameters
_NNX_CALL = inspect.signature(nnx.MultiHeadAttention.__call__).parameters


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_nnx_mha_document_layout_matches_dense(num_kv_heads):
  x, seg, pos = _packed(np.random.default_rng(3))
  kw = dict(num_heads=4, in_features=F, decode=False)
  if num_kv_heads != 4:
    if "num_kv_heads" not in _NNX_INIT:
      pytest.skip("this flax version's nnx.MultiHeadAttention has no num_kv_heads")
    kw["num_kv_heads"] = num_kv_heads
  call_causal = "is_causal" in _NNX_CALL
  ours = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0),
                                attention_fn=jf.make_attention_fn(is_causal=not call_causal))
  dense = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))

  @nnx.jit
  def run(m, x, seg, pos):
    with jf.document_layout(segment_ids=seg, positions=pos):
      # recent nnx passes is_causal on to attention_fn
      return m(x, is_causal=True) if call_causal else m(x)

  y = run(ours, x, seg, pos)
  y_closure = nnx.MultiHeadAttention(
      **kw, rngs=nnx.Rngs(0),
      attention_fn=jf.make_attention_fn(segment_ids=seg, positions=pos, is_causal=True))(x)
  np.testing.assert_allclose(y, y_closure, atol=1e-6)
  valid = np.asarray(seg) > 0
  if num_kv_heads == 4:
    y_dense = dense(x, mask=_dense_mask(seg))
  else:  # reference for GQA: jaxcp.attention called directly inside the same module
    def direct(query, key, value, **_):
      return jaxcp.attention(query, key, value, segment_ids=seg, positions=pos, is_causal=True,
                             implementation="xla")
    y_dense = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0), attention_fn=direct)(x)
  np.testing.assert_allclose(np.asarray(y)[valid], np.asarray(y_dense)[valid], atol=TOL, rtol=TOL)


def test_attention_fn_rejects_what_it_cannot_honour():
  x, seg, _ = _packed(np.random.default_rng(4))
  fn = jf.make_attention_fn(segment_ids=seg)
  m = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn)
  params = m.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="mask"):
    m.apply(params, x, mask=_dense_mask(seg))
  drop = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn, dropout_rate=0.1)
  with pytest.raises(ValueError, match="dropout"):
    drop.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  drop.apply(params, x, deterministic=True)  # no dropout at eval: fine
  q = jnp.zeros((B, S, 2, 8))
  with pytest.raises(ValueError, match="bias"):
    fn(q, q, q, bias=jnp.zeros((B, 2, S, S)))
  with pytest.raises(ValueError, match="sow"):
    fn(q, q, q, module=m)
  with pytest.raises(ValueError, match="unsupported keyword"):
    fn(q, q, q, something_new=3)
  n = nnx.MultiHeadAttention(num_heads=2, in_features=F, decode=False, rngs=nnx.Rngs(0),
                             attention_fn=fn)
  with pytest.raises(ValueError, match="mask"):
    n(x, mask=_dense_mask(seg))


# ------------------------------------------------------------------ SelfAttention modules


def _project(params, x):
  p = params["params"]
  q = jnp.einsum("bsf,fhd->bshd", x, p["query"]["kernel"])
  k = jnp.einsum("bsf,fhd->bshd", x, p["key"]["kernel"])
  v = jnp.einsum("bsf,fhd->bshd", x, p["value"]["kernel"])
  return q, k, v, p["out"]["kernel"]


@pytest.mark.parametrize("window,chunk", [(None, None), ((5, 0), None), (None, 8)])
def test_linen_self_attention_matches_numpy_oracle(window, chunk):
  x, seg, pos = _packed(np.random.default_rng(5))
  m = jf.SelfAttention(num_heads=4, num_kv_heads=2, head_dim=8, local_window_size=window,
                       chunk_size=chunk)
  params = m.init(jax.random.key(0), x, segment_ids=seg)
  y = m.apply(params, x, segment_ids=seg)  # positions derived from segment runs
  assert y.shape == x.shape
  assert params["params"]["key"]["kernel"].shape == (F, 2, 8)
  q, k, v, wo = _project(params, x)
  q, k = jf.apply_rope(q, pos), jf.apply_rope(k, pos)
  o, _ = numpy_attention(q, k, v, seg, pos, seg, pos, causal=True, window=window, chunk=chunk)
  ref = np.einsum("bshd,hdf->bsf", o, np.asarray(wo, np.float64))
  assert rel_err(y, ref) < 1e-5


def test_apply_rope_is_relative():
  rng = np.random.default_rng(6)
  q = jnp.asarray(rng.standard_normal((1, 5, 2, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 5, 2, 16)), jnp.float32)
  pos = jnp.asarray([[0, 3, 7, 2, 11]], jnp.int32)
  scores = lambda p: jnp.einsum("bqhd,bkhd->bhqk", jf.apply_rope(q, p), jf.apply_rope(k, p))
  np.testing.assert_allclose(scores(pos), scores(pos + 37), atol=1e-4)
  assert not np.allclose(scores(pos), scores(pos * 2), atol=1e-2)
  np.testing.assert_allclose(jf.apply_rope(q, jnp.zeros_like(pos)), q)  # position 0: identity


def test_permuted_row_gives_permuted_output():
  x, seg, pos = _packed(np.random.default_rng(7))
  m = jf.SelfAttention(num_heads=4, num_kv_heads=2)
  params = m.init(jax.random.key(0), x, segment_ids=seg, positions=pos)
  y = m.apply(params, x, segment_ids=seg, positions=pos)
  perm = np.random.default_rng(8).permutation(S)
  y_perm = m.apply(params, x[:, perm], segment_ids=seg[:, perm], positions=pos[:, perm])
  np.testing.assert_allclose(y_perm, y[:, perm], atol=1e-5)
  from jaxcp import load_balance, restore_order
  lb = lambda a: load_balance(a, 4, axis=1)
  y_lb = m.apply(params, lb(x), segment_ids=lb(seg), positions=lb(pos))
  np.testing.assert_allclose(restore_order(y_lb, 4, axis=1), y, atol=1e-5)


def test_documents_are_isolated_and_position_restart():
  x, seg, pos = _packed(np.random.default_rng(9), pad=False)
  m = jf.SelfAttention(num_heads=2, is_causal=False)  # bidirectional: both neighbours could leak
  params = m.init(jax.random.key(0), x, segment_ids=seg)
  y = m.apply(params, x, segment_ids=seg)
  doc2 = np.asarray(seg) == 2
  x2 = jnp.where(doc2[..., None], x + 3.0, x)
  y2 = m.apply(params, x2, segment_ids=seg)
  np.testing.assert_allclose(np.asarray(y2)[~doc2], np.asarray(y)[~doc2], atol=1e-6)
  assert not np.allclose(np.asarray(y2)[doc2], np.asarray(y)[doc2])
  # A document alone at the start of a row gives the same outputs as inside the packed row
  # (positions restart per document, so RoPE phases match).
  start, length = 9, 15
  alone = m.apply(params, x[:1, start:start + length])
  np.testing.assert_allclose(alone[0], y[0, start:start + length], atol=1e-5)


def test_cu_seqlens_equals_segment_ids():
  x, seg, _ = _packed(np.random.default_rng(10))
  cu = jnp.asarray([[0, 9, 24, 32], [0, 13, 27, 27]], jnp.int32)
  m = jf.SelfAttention(num_heads=2)
  params = m.init(jax.random.key(0), x, segment_ids=seg)
  np.testing.assert_allclose(m.apply(params, x, cu_seqlens=cu), m.apply(params, x, segment_ids=seg),
                             atol=1e-6)


def test_self_attention_grads_kernel_vs_xla():
  x, seg, pos = _packed(np.random.default_rng(11))
  kernel = jf.SelfAttention(num_heads=4, num_kv_heads=1, head_dim=8)
  ref = jf.SelfAttention(num_heads=4, num_kv_heads=1, head_dim=8, implementation="xla")
  params = kernel.init(jax.random.key(0), x, segment_ids=seg)

  def grads(m):
    f = lambda p, x: jnp.sum(jnp.sin(m.apply(p, x, segment_ids=seg, positions=pos)))
    return jax.jit(jax.grad(f, argnums=(0, 1)))(params, x)

  g, g_ref = grads(kernel), grads(ref)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    assert np.isfinite(np.asarray(a)).all() and float(jnp.abs(a).max()) > 0
    assert rel_err(a, b) < 1e-5
  assert np.isfinite(np.asarray(g[1])).all()  # padding tokens included: no NaN


def test_nnx_self_attention_matches_linen_and_trains():
  x, seg, pos = _packed(np.random.default_rng(12))
  lin = jf.linen.SelfAttention(num_heads=4, num_kv_heads=2, local_window_size=6)
  params = lin.init(jax.random.key(0), x, segment_ids=seg)
  mod = jf.nnx.SelfAttention(F, 4, num_kv_heads=2, local_window_size=6, rngs=nnx.Rngs(0))
  for name in ("query", "key", "value", "out"):
    getattr(mod, name).kernel = nnx.Param(params["params"][name]["kernel"])
  y_lin = lin.apply(params, x, segment_ids=seg, positions=pos)
  np.testing.assert_allclose(mod(x, segment_ids=seg, positions=pos), y_lin, atol=1e-6)

  @nnx.jit
  def loss_and_grad(mod, x):
    return nnx.value_and_grad(lambda m: jnp.mean(m(x, segment_ids=seg, positions=pos) ** 2))(mod)

  loss, g = loss_and_grad(mod, x)
  assert np.isfinite(float(loss))
  assert all(float(jnp.abs(l).max()) > 0 for l in jax.tree.leaves(g))


def test_self_attention_bad_heads():
  x, seg, _ = _packed(np.random.default_rng(13))
  with pytest.raises(ValueError, match="num_kv_heads"):
    jf.SelfAttention(num_heads=4, num_kv_heads=3).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="num_kv_heads"):
    jf.nnx.SelfAttention(F, 4, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="head_dim"):
    jf.SelfAttention(num_heads=2, head_dim=7).init(jax.random.key(0), x)  # RoPE needs even
