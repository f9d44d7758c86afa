"""Property tests of the CUDA attention kernels (marker `gpu`): random packed rows drawn to hit
the tile plans' edges, against the pure-JAX reference, row by row.

The rows mix documents of 1-8 tokens (they ride in the tiles of the document before them),
documents near the 64-token run that starts a tile of its own (kAnchorRun), long documents,
padding anywhere (not only at the end), segment ids reused further along the row, positions
that start past 0 (a document continued from another shard), and token orders permuted the
way context-parallel load balancing permutes them. Shapes and masks are fixed per test, so
every example reuses one compiled executable: segment ids and positions are runtime values.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxcp
from jaxcp._src.attention.api import attention_with_options
from jaxcp._src.kernel_options import AttentionKernelOptions

from .helpers import allowed_pairs, grads_close, rows_close
from .rounded_reference import attention_grads
from .strategies import packed_row

pytestmark = pytest.mark.gpu

S = 776  # a multiple of 8 (striped load balancing over 2, 4 and 8 ranks), not of 64 or 128
S_KV = 904
HQ, HKV = 4, 2
MASKS = {
    "causal": dict(is_causal=True),
    "causal_window": dict(is_causal=True, local_window_size=(150, 0)),
    "window": dict(local_window_size=(60, 25)),
    "chunk": dict(chunk_size=96),
    "causal_chunk": dict(is_causal=True, chunk_size=200),
    "full": dict(),
}
PIECES = {  # kind of stretch: its length range
    "tiny": (1, 8),
    "near_anchor": (56, 72),
    "long": (100, 700),
    "padding": (1, 40),
}
ORDERS = ["as_is", "reversed", "striped2", "striped4", "striped8", "shuffled"]
SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.large_base_example])


def _permute(order, seg, pos, seed):
  """The token order of a context-parallel layout (or another), applied to one row."""
  if order == "as_is":
    return seg, pos
  if order == "reversed":
    return seg[::-1].copy(), pos[::-1].copy()
  if order == "shuffled":
    perm = np.random.default_rng(seed).permutation(seg.shape[0])
    return seg[perm], pos[perm]
  cp = int(order.removeprefix("striped"))
  return tuple(np.asarray(jaxcp.load_balance(x[None], cp))[0] for x in (seg, pos))


@st.composite
def packed_batch(draw, length, orders=ORDERS):
  rows = [draw(packed_row(length, PIECES)) for _ in range(2)]
  order = draw(st.sampled_from(orders))
  seed = draw(st.integers(0, 2**31 - 1))
  rows = [_permute(order, s, p, seed + i) for i, (s, p) in enumerate(rows)]
  return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


@functools.lru_cache(maxsize=None)
def _runner(impl, mask_name, deterministic=False, options=AttentionKernelOptions()):
  """jit(out, lse, dq, dk, dv) of one implementation, mask and set of CUDA kernels; cached across
  examples."""
  static = dict(MASKS[mask_name], deterministic=deterministic)

  def run(q, k, v, do, q_seg, q_pos, kv_seg, kv_pos):
    f = lambda q, k, v: attention_with_options(q, k, v, segment_ids=q_seg, positions=q_pos, kv_segment_ids=kv_seg,
                                               kv_positions=kv_pos, implementation=impl, return_residual=True,
                                               kernel_options=options, **static)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, lse, *vjp((do, jnp.zeros_like(lse))))

  return jax.jit(run)


def _inputs(head_dim, sq, skv, dtype, hkv):
  """q, k, v, dO. Scores of standard deviation 3 make each row's softmax peaky, so that a key
  masked in or out by mistake moves its row by much more than the rounding."""
  key = jax.random.PRNGKey(head_dim + sq + skv)
  shapes = [(2, sq, HQ, head_dim), (2, skv, hkv, head_dim), (2, skv, hkv, head_dim), (2, sq, HQ, head_dim)]
  q, k, v, do = (jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32) for i, s in enumerate(shapes))
  return [x.astype(dtype) for x in (3 * q, k, v, do)]


def _check(mask_name, head_dim, q_seg, q_pos, kv_seg, kv_pos, dtype=jnp.bfloat16, hkv=HKV,
           deterministic=False, options=AttentionKernelOptions()):
  args = (*_inputs(head_dim, q_seg.shape[1], kv_seg.shape[1], dtype, hkv), q_seg, q_pos, kv_seg, kv_pos)
  got = _runner("cuda", mask_name, deterministic, options)(*args)
  want = _runner("xla", mask_name)(*args)
  if deterministic:  # a second call gives the same bits
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, _runner("cuda", mask_name, True, options)(*args)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  (out, lse, dq, dk, dv), (r_out, r_lse, r_dq, r_dk, r_dv) = got, want
  mask = MASKS[mask_name]
  pairs = allowed_pairs(q_seg, q_pos, kv_seg, kv_pos, causal=mask.get("is_causal", False),
                        window=mask.get("local_window_size"), chunk=mask.get("chunk_size"))
  # Rows (of a token's head) that must be exactly zero: queries with no allowed key (out, dq),
  # keys that no query may attend (dk, dv).
  q_dead = np.repeat(~pairs.any(2), HQ, axis=1)
  kv_dead = np.repeat(~pairs.any(1), hkv, axis=1)
  rows_close(out, r_out, 3e-2, "out", zero_rows=q_dead)
  lse, r_lse = np.asarray(lse), np.asarray(r_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
  fin = np.isfinite(r_lse)
  np.testing.assert_allclose(lse[fin], r_lse[fin], atol=2e-2, rtol=2e-3)
  # Gradient rows: see grads_close; the rounding model is computed only when a row misses 0.1.
  model = lambda: tuple(attention_grads(*args[:4], pairs, rounding=r)[1:] for r in (None, dtype))
  grads_close((("dq", dq, r_dq, q_dead), ("dk", dk, r_dk, kv_dead), ("dv", dv, r_dv, kv_dead)), model)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("kernel", ["default", "sm80"])
@SETTINGS
@given(batch=packed_batch(S))
def test_random_packed_rows(mask, kernel, batch):
  """Self attention at D 128. "sm80" runs the sm_80 kernels (kernel option sm80_only), which an
  A100 runs and an H100 / H200 does not."""
  seg, pos = batch
  _check(mask, 128, seg, pos, seg, pos, options=AttentionKernelOptions(sm80_only=kernel == "sm80"))


@pytest.mark.parametrize("head_dim", [64, 256])
@SETTINGS
@given(batch=packed_batch(S, orders=["as_is", "striped4"]))
def test_random_packed_rows_head_dims(head_dim, batch):
  """The other head dims' tile shapes (D 64: 128-query backward tiles; D 256: 64-key tiles)."""
  seg, pos = batch
  _check("causal", head_dim, seg, pos, seg, pos)


@pytest.mark.parametrize("variant", ["float16_mqa", "deterministic"])
@SETTINGS
@given(batch=packed_batch(S))
def test_random_packed_rows_variants(variant, batch):
  """float16 with one kv head; the deterministic backward (bitwise equal over two calls)."""
  seg, pos = batch
  if variant == "float16_mqa":
    _check("causal_window", 128, seg, pos, seg, pos, dtype=jnp.float16, hkv=1)
  else:
    _check("causal_chunk", 128, seg, pos, seg, pos, deterministic=True)


@st.composite
def cross_batch(draw):
  """Queries and keys with the same documents at other lengths and places (Sq != Skv)."""
  q_rows = [draw(packed_row(S, PIECES)) for _ in range(2)]
  kv_rows = []
  for q_seg, _ in q_rows:
    ids = [i for i in dict.fromkeys(q_seg.tolist()) if i != 0] or [1]
    kv_rows.append(draw(packed_row(S_KV, PIECES, ids=ids)))
  stack = lambda rows, i: np.stack([r[i] for r in rows])
  return stack(q_rows, 0), stack(q_rows, 1), stack(kv_rows, 0), stack(kv_rows, 1)


@pytest.mark.parametrize("mask", ["causal_window", "window", "full"])
@SETTINGS
@given(batch=cross_batch())
def test_random_cross_attention(mask, batch):
  _check(mask, 128, *batch)
