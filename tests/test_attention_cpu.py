"""CPU kernel parity with the float64 NumPy oracle and the pure-JAX reference, every mask form."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcp
from jaxcp._src.masks import positions_from_segments

from .helpers import allowed_pairs, numpy_attention, qkv, random_segments, rel_err

MASKS = [
    dict(),
    dict(is_causal=True),
    dict(local_window_size=3),
    dict(local_window_size=(4, 1)),
    dict(is_causal=True, local_window_size=(6, 0)),
    dict(chunk_size=5),
    dict(is_causal=True, chunk_size=8),
]


def _oracle_kwargs(kw):
  return dict(causal=kw.get("is_causal", False), window=kw.get("local_window_size"),
              chunk=kw.get("chunk_size"))


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()) or "full")
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_packed_self_attention_matches_oracle(mask, heads):
  rng = np.random.default_rng(0)
  b, s, d = 2, 40, 16
  q, k, v = qkv(rng, b, s, s, heads[0], heads[1], d, jnp.float32)
  seg = random_segments(rng, b, s, mean_doc=9)
  pos = np.asarray(positions_from_segments(jnp.asarray(seg)))
  out, lse = jaxcp.attention(q, k, v, segment_ids=seg, implementation="cpu", return_residual=True, **mask)
  ref_out, ref_lse = numpy_attention(q, k, v, seg, pos, seg, pos, **_oracle_kwargs(mask))
  assert rel_err(out, ref_out) < 1e-5
  np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(ref_lse))
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2), (jnp.float16, 3e-3)])
def test_dtypes_match_reference(dtype, tol):
  rng = np.random.default_rng(1)
  q, k, v = qkv(rng, 2, 33, 33, 4, 2, 24, dtype)
  seg = random_segments(rng, 2, 33, mean_doc=7)
  out = jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True, implementation="cpu")
  ref = jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True, implementation="xla")
  assert out.dtype == dtype
  assert rel_err(out, ref) < tol


def test_cu_seqlens_with_zero_length_docs_and_padding_tail():
  rng = np.random.default_rng(2)
  s = 32
  q, k, v = qkv(rng, 2, s, s, 2, 2, 8, jnp.float32)
  cu = np.array([[0, 5, 5, 12, 30, 30], [0, 1, 2, 32, 32, 32]], np.int32)  # row 0: tail 30..31 padding
  out = jaxcp.attention(q, k, v, cu_seqlens=cu, is_causal=True, implementation="cpu")
  seg, pos = jaxcp.segments_from_cu_seqlens(cu, s)
  ref, _ = numpy_attention(q, k, v, seg, pos, seg, pos, causal=True)
  assert rel_err(out, ref) < 1e-5
  np.testing.assert_array_equal(np.asarray(out)[0, 30:], 0.0)  # padding rows are zero


def test_explicit_positions_any_permutation():
  """The mask depends on (segment, position) only: permuting tokens permutes the output."""
  rng = np.random.default_rng(3)
  s = 36
  q, k, v = qkv(rng, 1, s, s, 2, 1, 8, jnp.float32)
  seg = random_segments(rng, 1, s, mean_doc=10, pad_tail=False)
  pos = positions_from_segments(jnp.asarray(seg))
  perm = rng.permutation(s)
  kw = dict(is_causal=True, local_window_size=(5, 0), implementation="cpu")
  base = jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, **kw)
  permuted = jaxcp.attention(q[:, perm], k[:, perm], v[:, perm], segment_ids=seg[:, perm],
                             positions=pos[:, perm], **kw)
  np.testing.assert_allclose(np.asarray(permuted), np.asarray(base)[:, perm], rtol=1e-5, atol=1e-6)


def test_cross_attention_different_segmentations():
  rng = np.random.default_rng(4)
  q, k, v = qkv(rng, 2, 12, 30, 4, 2, 16, jnp.float32)
  q_seg = np.array([[1] * 4 + [2] * 6 + [0] * 2, [1] * 12], np.int32)
  kv_seg = np.array([[1] * 10 + [2] * 15 + [0] * 5, [1] * 30], np.int32)
  out, lse = jaxcp.attention(q, k, v, segment_ids=q_seg, kv_segment_ids=kv_seg, implementation="cpu",
                             return_residual=True)
  q_pos = np.asarray(positions_from_segments(jnp.asarray(q_seg)))
  kv_pos = np.asarray(positions_from_segments(jnp.asarray(kv_seg)))
  ref, ref_lse = numpy_attention(q, k, v, q_seg, q_pos, kv_seg, kv_pos)
  assert rel_err(out, ref) < 1e-5


def test_bottom_right_alignment_without_segments():
  """No segments: query i sits at position i + (Skv - Sq), as in decoding with a KV cache."""
  rng = np.random.default_rng(5)
  q, k, v = qkv(rng, 1, 4, 10, 2, 2, 8, jnp.float32)
  out = jaxcp.attention(q, k, v, is_causal=True, implementation="cpu")
  ones_q, ones_kv = np.ones((1, 4), np.int32), np.ones((1, 10), np.int32)
  ref, _ = numpy_attention(q, k, v, ones_q, np.arange(6, 10)[None], ones_kv, np.arange(10)[None], causal=True)
  assert rel_err(out, ref) < 1e-5


def test_empty_rows_give_zeros_minus_inf_and_zero_grads():
  rng = np.random.default_rng(6)
  q, k, v = qkv(rng, 1, 8, 8, 2, 2, 8, jnp.float32)
  seg = np.array([[1, 1, 0, 0, 2, 2, 3, 3]], np.int32)
  kv_seg = np.array([[1, 1, 1, 1, 2, 2, 2, 2]], np.int32)  # segment 3 has no keys
  out, lse = jaxcp.attention(q, k, v, segment_ids=seg, kv_segment_ids=kv_seg, implementation="cpu",
                             return_residual=True)
  assert not np.isnan(np.asarray(out)).any()
  np.testing.assert_array_equal(np.asarray(out)[0, [2, 3, 6, 7]], 0.0)
  assert np.all(np.isneginf(np.asarray(lse)[0][:, [2, 3, 6, 7]]))

  def loss(q, k, v):
    return jnp.sum(jaxcp.attention(q, k, v, segment_ids=seg, kv_segment_ids=kv_seg, implementation="cpu") ** 2)

  dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  for g in (dq, dk, dv):
    assert not np.isnan(np.asarray(g)).any()
  np.testing.assert_array_equal(np.asarray(dq)[0, [2, 3, 6, 7]], 0.0)


def test_all_padding_batch_is_all_zero():
  rng = np.random.default_rng(7)
  q, k, v = qkv(rng, 1, 6, 6, 1, 1, 4, jnp.float32)
  out = jaxcp.attention(q, k, v, segment_ids=np.zeros((1, 6), np.int32), implementation="cpu")
  np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("mask", [dict(is_causal=True), dict(local_window_size=(3, 2), chunk_size=6)])
@pytest.mark.parametrize("heads", [(4, 2), (2, 1)])
def test_gradients_match_reference(mask, heads):
  rng = np.random.default_rng(8)
  q, k, v = qkv(rng, 2, 24, 24, heads[0], heads[1], 8, jnp.float32)
  seg = random_segments(rng, 2, 24, mean_doc=6)
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def loss(impl):
    def f(q, k, v):
      out, lse = jaxcp.attention(q, k, v, segment_ids=seg, implementation=impl, return_residual=True, **mask)
      return jnp.sum(out * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return f

  got = jax.grad(loss("cpu"), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(got, want):
    assert rel_err(g, r) < 1e-5


def test_check_grads_numerically():
  from jax.test_util import check_grads
  rng = np.random.default_rng(9)
  q, k, v = qkv(rng, 1, 10, 10, 2, 1, 4, jnp.float32)
  seg = np.array([[1] * 4 + [2] * 6], np.int32)
  f = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True, implementation="cpu")
  check_grads(f, (q, k, v), order=1, modes=("rev",), atol=5e-2, rtol=5e-2)


def test_deterministic_flag_is_bitwise_reproducible():
  rng = np.random.default_rng(10)
  q, k, v = qkv(rng, 2, 20, 20, 4, 2, 8, jnp.bfloat16)
  f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jaxcp.attention(q, k, v, is_causal=True, deterministic=True,
                                                               implementation="cpu").astype(jnp.float32) ** 2),
                       argnums=(0, 1, 2)))
  a, b = f(q, k, v), f(q, k, v)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))


def test_default_implementation_on_cpu_is_the_kernel():
  rng = np.random.default_rng(11)
  q, k, v = qkv(rng, 1, 8, 8, 1, 1, 4, jnp.float32)
  hlo = jax.jit(lambda q, k, v: jaxcp.attention(q, k, v)).lower(q, k, v).as_text()
  assert "jaxcp_attention_fwd" in hlo


@pytest.mark.parametrize("head_dim,widths", [
    (5, ((64, 64), (64, 64))), (40, ((64, 64), (64, 64))), (40, ((48, 48), (64, 64))),
    (48, ((48, 48), (64, 64))), (40, ((64, 48), (64, 64))), (40, ((64, 40), (48, 48)))])
def test_zero_padded_head_dim_gives_the_unpadded_results(head_dim, widths, monkeypatch):
  """The CUDA path runs a head dim between its tile widths zero-padded to the next width, and
  the forward may have a width the backward has not (sm_90a forward: 96, 192): ((48, 48), (64,
  64)) pads only the backward's operands, to another width than the forward's. V may be padded to
  a width of its own ((64, 48): multi-head latent attention's 192 / 128). The same padding through
  the CPU kernel must leave the output, the LSE (scale from the true head dim) and the gradients
  unchanged, and return the true head dim."""
  attention_module = importlib.import_module("jaxcp._src.attention.api")
  rng = np.random.default_rng(12)
  q, k, v = qkv(rng, 2, 24, 24, 4, 2, head_dim, jnp.float32)
  seg = random_segments(rng, 2, 24, mean_doc=6)
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def run(q, k, v):
    def f(q, k, v):
      out, lse = jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True, implementation="cpu",
                                 return_residual=True)
      return jnp.sum(out * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)
    return jax.grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  want_grads, (want_out, want_lse) = run(q, k, v)
  monkeypatch.setattr(attention_module, "_kernel_head_dims", lambda impl, d, dv, config: widths)
  hlo = jax.jit(run).lower(q, k, v).as_text()
  for width, value_width in widths:  # the kernels really ran padded: Q and K to width, V to value_width
    assert f"tensor<2x24x4x{width}xf32>" in hlo and f"tensor<2x24x2x{width}xf32>" in hlo
    assert f"tensor<2x24x2x{value_width}xf32>" in hlo
  got_grads, (got_out, got_lse) = run(q, k, v)
  assert got_out.shape == want_out.shape
  np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6)
  for g, r in zip(got_grads, want_grads):
    assert g.shape == r.shape
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dims", [(8, 12), (12, 4)], ids=["value_wider", "value_narrower"])
def test_value_head_dim_of_its_own(dims):
  """Multi-head latent attention's shapes: value's head dim differs from query/key's (the CPU
  kernels run it unpadded: V, O and dO at Dv). Output [B, Sq, Hq, Dv] and LSE against the float64
  oracle; the gradients (each the shape of its input) against the reference."""
  d, dv = dims
  rng = np.random.default_rng(13)
  q, k, _ = qkv(rng, 2, 24, 24, 4, 2, d, jnp.float32)
  v = jnp.asarray(rng.standard_normal((2, 24, 2, dv)), jnp.float32)
  seg = random_segments(rng, 2, 24, mean_doc=6)
  pos = np.asarray(positions_from_segments(jnp.asarray(seg)))
  run = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True, implementation="cpu",
                                       return_residual=True)
  assert "stablehlo.pad" not in jax.jit(run).lower(q, k, v).as_text()  # V not padded to the wider head dim
  out, lse = run(q, k, v)
  ref_out, ref_lse = numpy_attention(q, k, v, seg, pos, seg, pos, causal=True)
  assert out.shape == (2, 24, 4, dv)
  assert rel_err(out, ref_out) < 1e-5
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)

  w = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
  loss = lambda impl: lambda q, k, v: jnp.sum(jaxcp.attention(
      q, k, v, segment_ids=seg, is_causal=True, implementation=impl) * w)
  got = jax.grad(loss("cpu"), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
  for g, r, x in zip(got, want, (q, k, v)):
    assert g.shape == x.shape
    assert rel_err(g, r) < 1e-5


def _attention_with_sinks(q, k, v, sinks, allowed, scale):
  """Explicit attention sinks (gpt-oss): one more logit per head in every row's softmax, with no
  value. Dense, float32, for small shapes."""
  b, sq, hq, d = q.shape
  g = hq // k.shape[2]
  s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, g, axis=2)) * scale
  s = jnp.where(jnp.asarray(allowed)[:, None], s, -jnp.inf)
  sink = jnp.broadcast_to(sinks[None, :, None, None], (b, hq, sq, 1))
  p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
  return jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(v, g, axis=2))


def test_attention_sinks_from_the_lse():
  """The README's recipe for attention sinks: out * sigmoid(lse - sink) is softmax attention with
  one more logit per head, values and gradients (q, k, v and the sinks), empty rows included."""
  rng = np.random.default_rng(14)
  q, k, v = qkv(rng, 2, 24, 24, 4, 2, 8, jnp.float32)
  sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
  seg = random_segments(rng, 2, 24, mean_doc=6)
  seg[1, -3:] = 0  # padding rows: no key, output 0
  pos = np.asarray(positions_from_segments(jnp.asarray(seg)))
  allowed = allowed_pairs(seg, pos, seg, pos, causal=True, window=(4, 0))
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def with_sinks(q, k, v, sinks):
    out, lse = jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True, local_window_size=(4, 0),
                               implementation="cpu", return_residual=True)
    gate = jax.nn.sigmoid(lse - sinks[None, :, None])  # [B, Hq, Sq]
    return out * jnp.swapaxes(gate, 1, 2)[..., None]

  def explicit(q, k, v, sinks):
    return _attention_with_sinks(q, k, v, sinks, allowed, 8 ** -0.5)

  got, want = with_sinks(q, k, v, sinks), explicit(q, k, v, sinks)
  assert rel_err(got, want) < 1e-5
  assert not np.asarray(got[1, -3:]).any()
  loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
  got_g = jax.grad(loss(with_sinks), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  want_g = jax.grad(loss(explicit), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  for g, r in zip(got_g, want_g):
    assert np.isfinite(np.asarray(g)).all()
    assert rel_err(g, r) < 1e-5
