"""CUDA kernel tests (marker `gpu`; skipped without a GPU). Every case compares the CUDA kernel
with the pure-JAX reference computed in float32 from the same rounded inputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcp
from jaxcp._src.attention.api import attention_with_options
from jaxcp._src.kernel_options import AttentionKernelOptions

from .helpers import random_segments, rel_err

pytestmark = pytest.mark.gpu

MASKS = {
    "full": dict(),
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(37, 11)),
    "causal_window": dict(is_causal=True, local_window_size=(64, 0)),
    "chunk": dict(chunk_size=48),
    "causal_chunk": dict(is_causal=True, chunk_size=100),
}
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
DEFAULT = AttentionKernelOptions()
SM80 = AttentionKernelOptions(sm80_only=True)  # the sm_80 kernels, as an A100 runs them


def _qkv(seed, b, sq, skv, hq, hkv, d, dtype, dv=None):
  """q, k [.., d]; v and the output cotangent [.., dv] (dv: d unless given)."""
  dv = d if dv is None else dv
  key = jax.random.PRNGKey(seed)
  q = jax.random.normal(key, (b, sq, hq, d), dtype)
  k = jax.random.normal(jax.random.fold_in(key, 1), (b, skv, hkv, d), dtype)
  v = jax.random.normal(jax.random.fold_in(key, 2), (b, skv, hkv, dv), dtype)
  do = jax.random.normal(jax.random.fold_in(key, 3), (b, sq, hq, dv), dtype)
  return q, k, v, do


def _compare(q, k, v, do, dtype, backward=True, lse_cotangent=False, options=DEFAULT, **kw):
  """The CUDA kernels (those `options` pick) against the reference, forward and backward."""
  # Segment ids and positions go in as jit arguments: as closure constants XLA would fold the
  # reference's whole mask at compile time (about a minute at S = 1900).
  arrays = {n: jnp.asarray(x) for n, x in kw.items() if isinstance(x, (np.ndarray, jax.Array))}
  static = {n: x for n, x in kw.items() if n not in arrays}

  def run(impl, q, k, v, arrays):
    f = lambda q, k, v: attention_with_options(q, k, v, implementation=impl, return_residual=True,
                                               kernel_options=options, **arrays, **static)
    if not backward:
      return *f(q, k, v), ()
    (out, lse), vjp = jax.vjp(f, q, k, v)
    # A cotangent for the LSE too (attention sinks, context-parallel merges), empty rows included.
    dlse = jax.random.normal(jax.random.PRNGKey(9), lse.shape) if lse_cotangent else jnp.zeros_like(lse)
    return out, lse, vjp((do, dlse))

  out, lse, grads = jax.jit(lambda *a: run("cuda", *a))(q, k, v, arrays)
  ref_out, ref_lse, ref_grads = jax.jit(lambda *a: run("xla", *a))(q, k, v, arrays)
  tol = TOL[dtype]
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert rel_err(out, ref_out) < tol
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(ref_lse)))
  fin = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], atol=2e-2, rtol=2e-3)
  for name, g, r in zip("qkv", grads, ref_grads):
    assert not np.isnan(np.asarray(g, np.float32)).any(), name
    assert rel_err(g, r) < 2 * tol, name


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_masks_and_head_dims(mask, head_dim):
  rng = np.random.default_rng(0)
  s = 700  # not a multiple of any tile size
  seg = random_segments(rng, 2, s, mean_doc=150)
  _compare(*_qkv(0, 2, s, s, 4, 2, head_dim, jnp.bfloat16), jnp.bfloat16, segment_ids=seg, **MASKS[mask])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa"])
def test_dtypes_and_gqa(dtype, heads):
  rng = np.random.default_rng(1)
  seg = random_segments(rng, 2, 513, mean_doc=90)
  _compare(*_qkv(1, 2, 513, 513, *heads, 128, dtype), dtype, segment_ids=seg, is_causal=True)


def test_forward_head_sections():
  """The sm_90a forward takes its work in sections of heads whose K/V over the widest tile's
  keys fit its L2 budget (32 MB): a 12300-token document at D 256 fits 2 of the 5 kv heads, so
  its 10 query heads (groups of 2) run in sections of 4, 4 and 2, the last one short."""
  seg = np.concatenate([np.full(12300, 1), np.full(500, 2)]).astype(np.int32)[None]
  _compare(*_qkv(2, 1, seg.shape[1], seg.shape[1], 10, 5, 256, jnp.bfloat16), jnp.bfloat16, backward=False,
           segment_ids=seg, is_causal=True)


@pytest.mark.parametrize("case", ["f16_mqa", "gqa_split", "cross", "empty_rows"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_backward_tile_designs(head_dim, case):
  """The sm_90a backward's designs other than D 128's: D 256 (64-key tiles, the head dim split
  over warpgroups, dQ reduced from registers) and D 64 (128-query tiles, dQ split by queries),
  on what their plans treat apart: float16 with one kv head, a GQA group split over blocks (few
  key tiles: partial dK / dV sums), keys longer than queries, padded rows. 300 and 200 queries
  end in a ragged query tile of either size."""
  rng = np.random.default_rng(6)
  if case == "f16_mqa":
    seg = random_segments(rng, 2, 300, mean_doc=90)
    _compare(*_qkv(6, 2, 300, 300, 8, 1, head_dim, jnp.float16), jnp.float16, segment_ids=seg, is_causal=True)
  elif case == "gqa_split":
    _compare(*_qkv(7, 1, 300, 300, 16, 2, head_dim, jnp.bfloat16), jnp.bfloat16, is_causal=True)
  elif case == "cross":
    q_seg = random_segments(rng, 2, 200, mean_doc=60, pad_tail=False)
    kv_seg = np.sort(rng.integers(1, q_seg.max() + 1, size=(2, 333)), axis=1).astype(np.int32)
    _compare(*_qkv(8, 2, 200, 333, 4, 2, head_dim, jnp.bfloat16), jnp.bfloat16, segment_ids=q_seg,
             kv_segment_ids=kv_seg)
  else:
    seg = random_segments(rng, 2, 300, mean_doc=90)
    seg[1, 150:] = 0  # a row half padding: its queries attend nothing, their gradients are zero
    _compare(*_qkv(9, 2, 300, 300, 4, 4, head_dim, jnp.bfloat16), jnp.bfloat16, segment_ids=seg, is_causal=True)


@pytest.mark.parametrize("kernel", ["sm90", "sm80"])
@pytest.mark.parametrize("head_dim,dtype", [(64, jnp.bfloat16), (128, jnp.bfloat16), (256, jnp.bfloat16),
                                             (128, jnp.float16)])
def test_forward_reference_max_moves(head_dim, dtype, kernel):
  """Scores that climb along the keys, faster for some rows than for others. The sm_90a
  forward's softmax keeps a reference max until a key tile's max passes it by more than 8 in
  log2 units (kLazyMaxSlack in attention_device.cuh), and rescales O only in warps where a row's
  reference moved. Here references drift below the max for a few tiles (first half of the row),
  then move on every tile (second half), at different tiles for different rows of a warp.
  "sm80": the sm_80 forward (chosen on Hopper by the kernel options), which keeps the running max,
  on the same scores."""
  s = 1024
  rng = np.random.default_rng(9)
  seg = random_segments(rng, 2, s, mean_doc=400)
  q, k, v, do = _qkv(9, 2, s, s, 4, 2, head_dim, dtype)
  j = np.arange(s)
  climb = np.where(j < s // 2, 3.0 * j / 64, 24.0 + 12.0 * (j - s // 2) / 64)  # in log2 units
  scale_log2 = np.log2(np.e) / np.sqrt(head_dim)
  k = k.at[..., 0].set(jnp.asarray(climb / scale_log2, dtype)[None, :, None])
  q = q.at[..., 0].set(1 + 0.25 * q[..., 0])
  # Forward only: the backward does not keep a running max, and its dQ is ill-conditioned here
  # (large, nearly equal k[0] cancel), on the CPU kernel too.
  _compare(q, k, v, do, dtype, backward=False, options=SM80 if kernel == "sm80" else DEFAULT, segment_ids=seg,
           is_causal=True)


def test_length_one_documents_and_empty_rows():
  s = 300
  seg = np.arange(1, s + 1, dtype=np.int32)[None].repeat(2, 0)   # every document has one token
  seg[1, 100:] = 0                                              # padding: empty rows
  kv_seg = seg.copy()
  kv_seg[0, ::2] = 0                                            # half the queries lose their only key
  q, k, v, do = _qkv(2, 2, s, s, 4, 4, 64, jnp.bfloat16)
  _compare(q, k, v, do, jnp.bfloat16, segment_ids=seg, kv_segment_ids=kv_seg, is_causal=True)
  out = jaxcp.attention(q, k, v, segment_ids=seg, kv_segment_ids=kv_seg, is_causal=True, implementation="cuda")
  np.testing.assert_array_equal(np.asarray(out[1, 100:], np.float32), 0.0)


def test_cross_attention_and_permuted_tokens():
  rng = np.random.default_rng(3)
  q_seg = random_segments(rng, 2, 200, mean_doc=60, pad_tail=False)
  kv_seg = np.sort(rng.integers(1, q_seg.max() + 1, size=(2, 333)), axis=1).astype(np.int32)
  perm = rng.permutation(333)
  _compare(*_qkv(3, 2, 200, 333, 4, 2, 128, jnp.bfloat16), jnp.bfloat16, segment_ids=q_seg,
           kv_segment_ids=kv_seg[:, perm], kv_positions=np.tile(np.arange(333, dtype=np.int32)[perm], (2, 1)))


def _one_document_rows(batch, seq_len, pad):
  """Each row one document (segment 1) and a padding tail of pad tokens (segment 0)."""
  seg = np.ones((batch, seq_len), np.int32)
  seg[:, seq_len - pad:] = 0
  return seg


@pytest.mark.parametrize("rows", ["packed", "one_document"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deterministic_backward_is_bitwise_reproducible(head_dim, rows):
  """Long documents, so that many key tiles add into each dQ tile (up to 32 at D 256); rows of one
  document turn the D 128 kernel's key tiles in increasing order, packed rows decreasing."""
  rng = np.random.default_rng(4)
  seg = random_segments(rng, 2, 2048, mean_doc=1500) if rows == "packed" else _one_document_rows(2, 2048, 100)
  q, k, v, do = _qkv(4, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
  f = jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: jaxcp.attention(
      q, k, v, segment_ids=seg, is_causal=True, deterministic=True), q, k, v)[1](do))
  a = f(q, k, v)
  for _ in range(2):
    for x, y in zip(a, f(q, k, v)):
      np.testing.assert_array_equal(np.asarray(x.view(jnp.uint16)), np.asarray(y.view(jnp.uint16)))


@pytest.mark.parametrize("rows", ["packed", "one_document"])
@pytest.mark.parametrize("mask", ["full", "causal", "causal_window", "causal_chunk"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deterministic_backward(mask, head_dim, rows):
  """deterministic=True on Hopper: the sm_90a backward, each dQ tile's adds taking turns in
  key-tile order (blocks start in that order; increasing where every row is one document at D 128,
  else decreasing): the writer warp's bulk adds at D 64 / 128, both warpgroups' register adds
  at D 256. Against the reference, with a GQA group split over blocks, and bitwise equal over two
  calls."""
  rng = np.random.default_rng(8)
  seg = random_segments(rng, 2, 900, mean_doc=300) if rows == "packed" else _one_document_rows(2, 900, 77)
  q, k, v, do = _qkv(8, 2, 900, 900, 8, 2, head_dim, jnp.bfloat16)
  _compare(q, k, v, do, jnp.bfloat16, segment_ids=seg, deterministic=True, **MASKS[mask])
  f = jax.jit(lambda q, k, v, seg: jax.vjp(lambda q, k, v: jaxcp.attention(
      q, k, v, segment_ids=seg, deterministic=True, **MASKS[mask]), q, k, v)[1](do))
  a, b = f(q, k, v, jnp.asarray(seg)), f(q, k, v, jnp.asarray(seg))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x.view(jnp.uint16)), np.asarray(y.view(jnp.uint16)))


@pytest.mark.parametrize("head_dim", [128, 256])
def test_deterministic_backward_sm80_kernels(head_dim):
  """The sm_80 deterministic backward (its own dQ kernel; it runs on rows too long for the
  sm_90a kernel's tickets, and before Hopper) stays correct where sm_90a runs too."""
  rng = np.random.default_rng(9)
  seg = random_segments(rng, 2, 700, mean_doc=150)
  _compare(*_qkv(9, 2, 700, 700, 4, 2, head_dim, jnp.bfloat16), jnp.bfloat16, options=SM80, segment_ids=seg,
           is_causal=True, deterministic=True)


def _check_long_row_gradients(seed, s, mean_doc, head_dim):
  """Forward and backward of one causal packed row of s tokens (8 / 2 heads): finite gradients
  of the inputs' shapes, without running out of memory."""
  rng = np.random.default_rng(seed)
  seg = random_segments(rng, 1, s, mean_doc=mean_doc, pad_tail=False)
  q, k, v, do = _qkv(seed, 1, s, s, 8, 2, head_dim, jnp.bfloat16)
  f = jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: jaxcp.attention(
      q, k, v, segment_ids=seg, is_causal=True), q, k, v)[1](do))
  for g, x in zip(f(q, k, v), (q, k, v)):
    assert g.shape == x.shape
    assert np.isfinite(np.asarray(jnp.abs(g.astype(jnp.float32)).max()))


def test_one_row_of_256k_forward_and_backward_fits():
  _check_long_row_gradients(5, 256 * 1024, 16384, 128)


@pytest.mark.parametrize("doc", [4096, 4160], ids=["index_order", "heaviest_first"])
def test_backward_key_tile_orders(doc):
  """The sm_90a backward runs its key tiles in index order while none walks the query tiles of
  more than 4096 queries (kBwdIndexOrderMaxQueries; 64 tiles at D 128), else heaviest first:
  both orders must give the gradients. A causal document of `doc` tokens, whose first key tile
  walks doc / 64 query tiles, then one of 128 (no padding: before the plan trimmed every range's
  ends, a tile mixing padding and a document lengthened that walk to 66, and the index-order
  case ran heaviest first)."""
  s = doc + 128
  seg = np.full((1, s), 2, np.int32)
  seg[0, :doc] = 1
  _compare(*_qkv(7, 1, s, s, 4, 2, 128, jnp.bfloat16), jnp.bfloat16, segment_ids=seg, is_causal=True)


def test_backward_gqa_blocks_by_document():
  """GQA blocks of several query heads take their key tiles document by document, heaviest
  document first (bwd_plan's by_document), where blocks of one head would run heaviest first by
  tile. Small problems split the group into one head a block, so this one has enough key tiles
  for two heads a block on 132 multiprocessors (4 rows of 33 key tiles x 2 kv heads = 264
  blocks, group of 4 split in 2), and a single document of 4224 tokens in one row: its first key
  tile walks 66 query tiles, more than the light-tile rule's 64."""
  rng = np.random.default_rng(5)
  s = 4224
  seg = random_segments(rng, 4, s, mean_doc=1500)
  seg[0] = 1
  _compare(*_qkv(22, 4, s, s, 8, 2, 128, jnp.bfloat16), jnp.bfloat16, segment_ids=seg, is_causal=True)


def test_backward_gqa_by_document_over_many_rows():
  """The document order of GQA blocks over more key tiles than its one-block sort takes at once
  (8 rows of 20480 tokens: 1280 key tiles, two chunks of 1024) and documents that stop at row
  ends: dQ, dK and dV as the deterministic kernel gives them (its own order, one head a block),
  which needs no reference of 20480^2 scores per row. There each of a group's 4 splits runs in a
  scheduling chunk of its own, over every key tile, so the block that sums a key tile's float32
  partial dK / dV (the last split to finish) reads the other splits' sums back long after they
  were written."""
  rng = np.random.default_rng(11)
  b, s = 8, 20480
  seg = random_segments(rng, b, s, mean_doc=3000)
  seg[1] = 7  # a row of one document
  q, k, v, do = _qkv(23, b, s, s, 8, 2, 128, jnp.bfloat16)
  seg = jnp.asarray(seg)

  def grads(deterministic):
    f = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True, deterministic=deterministic)
    return jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](do))(q, k, v)

  for name, g, r in zip("qkv", grads(False), grads(True)):
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    assert not np.isnan(g).any(), name
    # Per token (a key tile left out or run twice is a few hundred tokens of a million).
    diff = np.linalg.norm((g - r).reshape(b, s, -1), axis=-1)
    ref = np.linalg.norm(r.reshape(b, s, -1), axis=-1)
    assert np.max(diff / (ref + 1e-3 * ref.max())) < 0.05, name


@pytest.mark.parametrize("head_dim", [32, 80, 96, 192])
def test_head_dims_between_tile_widths(head_dim):
  """Head dims other than 64/128/256 run zero-padded to the next tile width: forward, LSE and
  gradients against the reference, GQA, packed documents, and implementation=None picks it."""
  rng = np.random.default_rng(13)
  seg = random_segments(rng, 2, 700, mean_doc=150)
  q, k, v, do = _qkv(13, 2, 700, 700, 4, 2, head_dim, jnp.bfloat16)
  _compare(q, k, v, do, jnp.bfloat16, segment_ids=seg, is_causal=True)
  _compare(q, k, v, do, jnp.bfloat16, segment_ids=seg, local_window_size=(64, 0), deterministic=True)
  hlo = jax.jit(lambda q, k, v: jaxcp.attention(q, k, v, is_causal=True)).lower(q, k, v).as_text()
  assert "jaxcp_attention_fwd" in hlo


# (head dim, value head dim) the sm_90a kernels run as they are beyond 64 / 128 / 256: 96, 192, and
# multi-head latent attention's q/k 192 with v 128 (the deterministic backward pads them).
NATIVE_DIMS = {"d96": (96, 96), "d192": (192, 192), "qk192_v128": (192, 128)}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dims", list(NATIVE_DIMS.values()), ids=list(NATIVE_DIMS))
def test_native_head_dims(mask, dims):
  """The sm_90a kernels' own head dims, forward and backward, under every mask. Off Hopper this
  runs padded."""
  rng = np.random.default_rng(17)
  seg = random_segments(rng, 2, 700, mean_doc=150)
  _compare(*_qkv(17, 2, 700, 700, 4, 2, dims[0], jnp.bfloat16, dims[1]), jnp.bfloat16, segment_ids=seg,
           **MASKS[mask])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("heads", [(8, 2), (8, 1), (4, 4)], ids=["gqa4", "mqa", "mha"])
@pytest.mark.parametrize("dims", [(96, 96), (192, 128)], ids=["d96", "qk192_v128"])
def test_native_head_dim_dtypes_gqa_cross(dtype, heads, dims):
  """D 96 and q/k 192 with v 128 on the sm_90a kernels: float16, GQA / MQA / MHA, cross attention
  (Sq != Skv), documents of length 1 and a row of padding only. The backward of these few key
  tiles splits GQA / MQA groups (float32 partial dK / dV); MHA stores dK / dV by TMA."""
  hq, hkv = heads
  seg_q = np.ones((2, 300), np.int32)
  seg_q[0, 100:] = 2
  seg_q[0, 299] = 4  # a query of its own document, which no key shares: zeros, -inf LSE
  seg_q[1, :] = 0  # padding only: zeros out, -inf LSE, zero gradients
  seg_k = np.ones((2, 530), np.int32)
  seg_k[0, 250:] = 2
  seg_k[0, 249] = 3  # a document of one key, which no query shares
  _compare(*_qkv(18, 2, 300, 530, hq, hkv, dims[0], dtype, dims[1]), dtype, segment_ids=seg_q, kv_segment_ids=seg_k)


def _operand_widths(head_dim, backward=False, options=DEFAULT, **kw):
  """Head dims of the bfloat16 operands in the lowered forward (or gradient) of a D head_dim call."""
  q, k, v, _ = _qkv(19, 1, 256, 256, 2, 2, head_dim, jnp.bfloat16)
  f = lambda q, k, v: jnp.sum(attention_with_options(q, k, v, kernel_options=options, **kw).astype(jnp.float32))
  hlo = jax.jit(jax.grad(f, argnums=(0, 1, 2)) if backward else f).lower(q, k, v).as_text()
  return {w for w in (96, 128, 192, 256) if f"x{w}xbf16>" in hlo}


def _on_hopper():
  device = jax.devices()[0]
  return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


@pytest.mark.skipif(not _on_hopper(), reason="the 96- and 192-wide tiles are sm_90a's")
@pytest.mark.parametrize("head_dim,padded", [(96, 128), (192, 256)])
def test_native_head_dims_run_unpadded_on_hopper(head_dim, padded):
  """On Hopper D 96 / 192 run as they are (no pad, no slice), short windows too, the backward
  unless deterministic; the sm_80 kernels (kernel options) pad to the next tile width; a head dim
  between (80, 176) pads to the native one."""
  assert _operand_widths(head_dim, is_causal=True) == {head_dim}
  assert _operand_widths(head_dim - 16, is_causal=True) == {head_dim}
  assert _operand_widths(head_dim, local_window_size=(64, 0)) == {head_dim}
  assert _operand_widths(head_dim, backward=True, is_causal=True) == {head_dim}
  assert _operand_widths(head_dim, backward=True, is_causal=True, deterministic=True) == {head_dim, padded}
  assert _operand_widths(head_dim, options=SM80, is_causal=True) == {head_dim, padded}


@pytest.mark.parametrize("dims", [(192, 128), (64, 128), (176, 112), (192, 64)],
                         ids=["qk192_v128", "qk64_v128", "qk176_v112", "qk192_v64"])
def test_value_head_dim_of_its_own(dims):
  """A value head dim unlike q/k's: multi-head latent attention (DeepSeek: q/k 192, v 128), V
  wider than q/k, and widths that pad to 192 / 128 (which run natively forward on Hopper) or to
  192 / 128 from a V of 64. Output [B, S, Hq, Dv] and the gradients against the reference."""
  d, dv = dims
  rng = np.random.default_rng(15)
  seg = random_segments(rng, 2, 700, mean_doc=150)
  _compare(*_qkv(15, 2, 700, 700, 4, 2, d, jnp.bfloat16, dv), jnp.bfloat16, segment_ids=seg, is_causal=True)


def _mla_pads(backward, options=DEFAULT, **kw):
  """Whether the lowered forward (or gradient) of a q/k 192, v 128 call pads anything (Q and K
  are as wide as a tile: only V, O and dO may be padded)."""
  q, k, v, _ = _qkv(20, 1, 256, 256, 2, 2, 192, jnp.bfloat16, 128)
  f = lambda q, k, v: jnp.sum(attention_with_options(q, k, v, kernel_options=options, **kw).astype(jnp.float32))
  return "stablehlo.pad" in jax.jit(jax.grad(f, argnums=(0, 1, 2)) if backward else f).lower(q, k, v).as_text()


@pytest.mark.skipif(not _on_hopper(), reason="V's own head dim is the sm_90a kernels'")
def test_mla_value_runs_unpadded_on_hopper():
  """On Hopper q/k 192, v 128 takes V as it is (nothing padded), forward and backward, short
  windows too; the deterministic backward and the sm_80 kernels (kernel options) pad."""
  assert not _mla_pads(False, is_causal=True)
  assert not _mla_pads(True, is_causal=True)
  assert _mla_pads(True, is_causal=True, deterministic=True)
  assert not _mla_pads(True, local_window_size=(64, 0))
  assert _mla_pads(False, options=SM80, is_causal=True)


def test_padded_head_dim_long_row_fits():
  """1 x 64k at head dim 96, forward and backward: before padding this fell back to the S^2
  reference (8 heads x 64k^2 float32 scores, 137 GB)."""
  _check_long_row_gradients(14, 64 * 1024, 4096, 96)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lse_cotangent(head_dim, deterministic):
  """Gradients through the returned LSE (what attention sinks and ring merges use): the backward's
  delta becomes rowsum(dO * O) - dLSE. Padding rows (LSE -inf) must still give zeros."""
  rng = np.random.default_rng(16)
  seg = random_segments(rng, 2, 700, mean_doc=150)
  _compare(*_qkv(16, 2, 700, 700, 4, 2, head_dim, jnp.bfloat16), jnp.bfloat16, lse_cotangent=True,
           segment_ids=seg, is_causal=True, deterministic=deterministic)


def test_default_implementation_picks_cuda():
  q, k, v, _ = _qkv(6, 1, 128, 128, 2, 2, 128, jnp.bfloat16)
  hlo = jax.jit(lambda q, k, v: jaxcp.attention(q, k, v, is_causal=True)).lower(q, k, v).as_text()
  assert "jaxcp_attention_fwd" in hlo


@pytest.mark.parametrize("mask", ["causal", "window", "causal_chunk"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm80_kernels_on_hopper(mask, head_dim):
  """On an H100/H200 the forward and the non-deterministic backward run sm_90a kernels; the sm_80
  kernels (A100) must stay correct too."""
  rng = np.random.default_rng(3)
  seg = random_segments(rng, 2, 700, mean_doc=150)
  _compare(*_qkv(3, 2, 700, 700, 4, 2, head_dim, jnp.bfloat16), jnp.bfloat16, options=SM80, segment_ids=seg,
           **MASKS[mask])


def _attention_calls(options):
  """{FFI target: its custom_call lines} in the StableHLO of a jitted forward and backward with
  these kernel options."""
  q, k, v, do = _qkv(21, 1, 256, 256, 2, 2, 128, jnp.bfloat16)
  f = lambda q, k, v: jax.vjp(lambda q, k, v: attention_with_options(
      q, k, v, is_causal=True, kernel_options=options), q, k, v)[1](do)
  lines = [line for line in jax.jit(f).lower(q, k, v).as_text().splitlines() if "stablehlo.custom_call" in line]
  targets = ("jaxcp_attention_fwd_plan", "jaxcp_attention_fwd", "jaxcp_attention_bwd_plan", "jaxcp_attention_bwd")
  return {t: [line for line in lines if f"@{t}(" in line] for t in targets}


@pytest.mark.parametrize("options", [DEFAULT, SM80, AttentionKernelOptions(fwd_fixed_tiles=True)],
                         ids=["default", "sm80_only", "fwd_fixed_tiles"])
def test_kernel_options_are_ffi_attributes(options):
  """Which kernels run is in the HLO: every CUDA attention call (forward, backward and both plan
  calls) carries the kernel options as its dictionary attribute "kernel" (other options: another
  executable), and the mask as its attribute "mask"."""
  want = (f"kernel = {{fwd_fixed_tiles = {str(options.fwd_fixed_tiles).lower()}, "
          f"sm80_only = {str(options.sm80_only).lower()}}}")
  for target, calls in _attention_calls(options).items():
    assert calls, target
    for line in calls:
      assert want in line, (target, line)
      assert "mask = {chunk_size = 0 : i64, is_causal = true" in line, (target, line)


@pytest.mark.parametrize("mask", ["window", "causal_window"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_forward_on_short_windows(mask, head_dim):
  """Windows under 512 keys on the sm_90a forward: query tiles whose key tiles are nearly all
  partial."""
  rng = np.random.default_rng(4)
  seg = random_segments(rng, 2, 700, mean_doc=150)
  _compare(*_qkv(4, 2, 700, 700, 4, 2, head_dim, jnp.bfloat16), jnp.bfloat16, segment_ids=seg, **MASKS[mask])


@pytest.mark.parametrize("scale", [0.3, 0.0, -0.2])
def test_explicit_scales(scale):
  """The sm_90a forward folds a positive scale into its exponent; zero and negative scales go to
  the sm_80 forward, and every scale must match the reference."""
  rng = np.random.default_rng(6)
  seg = random_segments(rng, 2, 700, mean_doc=150)
  _compare(*_qkv(6, 2, 700, 700, 4, 2, 128, jnp.bfloat16), jnp.bfloat16, segment_ids=seg, is_causal=True,
           scale=scale)


def _segments_from_lengths(lengths, s):
  """One row of consecutive documents of the given lengths (segment ids 1, 2, ...; 0 = padding
  where a length is given as a negative number), padded with 0 up to s."""
  seg = np.zeros(s, np.int32)
  t = 0
  for i, n in enumerate(lengths):
    seg[t:t + abs(n)] = i + 1 if n > 0 else 0
    t += abs(n)
  return seg


DOC_TILE_ROWS = {
  # lengths around the 64-token anchor rule and the 128-row tile, and padding inside the row
  "boundaries": [63, 64, 65, 127, 128, 129, 1, 200, -100, 255, 256, 3, 70],
  # a run of documents shorter than 64 rides in the tiles of the document before it
  "short_runs": [300, 5, 20, 40, 63, 1, 1, 2, 400, 30, 30, 30, 257],
  # a short document riding at the end of a long one: its own run's keys, not the long one's
  "long_then_rider": [1500, 16, 384],
  # segment ids reused non-contiguously (1, 2, 1, 2, ...): still one mask document per id
  "reused_ids": None,
  # every token starts a run that looks 64 long (id = i mod 63): more starts than tile slots,
  # so the row falls back to the fixed grid
  "capacity_fallback": None,
}


@pytest.mark.parametrize("row", list(DOC_TILE_ROWS))
@pytest.mark.parametrize("mask", ["causal", "window", "causal_chunk", "full"])
def test_document_tiles(row, mask):
  """The sm_90a forward starts query tiles at documents and walks key tiles from each tile's
  first allowed key (attention_doc_tiles_kernels.cu); rows built to hit its edge cases."""
  s = 1900
  if row == "reused_ids":
    seg = np.where((np.arange(s) // 70) % 2 == 0, 1, 2).astype(np.int32)
  elif row == "capacity_fallback":
    seg = (np.arange(s) % 63 + 1).astype(np.int32)
  else:
    seg = _segments_from_lengths(DOC_TILE_ROWS[row], s)
  seg = np.stack([seg, seg[::-1].copy()])
  _compare(*_qkv(7, 2, s, s, 4, 2, 128, jnp.bfloat16), jnp.bfloat16, segment_ids=seg, **MASKS[mask])


@pytest.mark.parametrize("fixed_tiles", [False, True], ids=["document_tiles", "fixed_tiles"])
def test_document_tiles_cross_attention(fixed_tiles):
  """Queries and keys with different documents and lengths (Sq != Skv), with document tiles and
  with 128-row tiles from token 0 (kernel option fwd_fixed_tiles)."""
  rng = np.random.default_rng(8)
  q_seg = random_segments(rng, 2, 900, mean_doc=120, pad_tail=False)
  kv_seg = np.sort(rng.integers(1, q_seg.max() + 1, size=(2, 1300)), axis=1).astype(np.int32)
  _compare(*_qkv(8, 2, 900, 1300, 4, 4, 64, jnp.bfloat16), jnp.bfloat16,
           options=AttentionKernelOptions(fwd_fixed_tiles=fixed_tiles), segment_ids=q_seg, kv_segment_ids=kv_seg,
           local_window_size=(500, 40))
