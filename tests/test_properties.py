"""Property-based tests: random document layouts, shapes and masks against the NumPy oracle."""
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxcp

from .helpers import numpy_attention, rel_err


@st.composite
def layouts(draw):
  b = draw(st.integers(1, 2))
  sq = draw(st.integers(1, 24))
  cross = draw(st.booleans())
  skv = draw(st.integers(1, 24)) if cross else sq
  hkv = draw(st.sampled_from([1, 2]))
  hq = hkv * draw(st.sampled_from([1, 2, 3]))
  d = draw(st.sampled_from([4, 8, 12]))
  n_docs = draw(st.integers(1, 4))
  q_seg = np.asarray(draw(st.lists(st.lists(st.integers(0, n_docs), min_size=sq, max_size=sq),
                                   min_size=b, max_size=b)), np.int32)
  if cross:
    kv_seg = np.asarray(draw(st.lists(st.lists(st.integers(0, n_docs), min_size=skv, max_size=skv),
                                      min_size=b, max_size=b)), np.int32)
  else:
    kv_seg = q_seg
  q_pos = np.asarray(draw(st.lists(st.lists(st.integers(-3, 30), min_size=sq, max_size=sq),
                                   min_size=b, max_size=b)), np.int32)
  kv_pos = np.asarray(draw(st.lists(st.lists(st.integers(-3, 30), min_size=skv, max_size=skv),
                                    min_size=b, max_size=b)), np.int32)
  mask = dict(is_causal=draw(st.booleans()))
  if draw(st.booleans()):
    mask["local_window_size"] = (draw(st.integers(0, 8)), draw(st.integers(0, 8)))
  if draw(st.booleans()):
    mask["chunk_size"] = draw(st.integers(1, 9))
  seed = draw(st.integers(0, 2**31 - 1))
  return b, sq, skv, hq, hkv, d, q_seg, kv_seg, q_pos, kv_pos, mask, seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_random_layouts_match_oracle(layout):
  b, sq, skv, hq, hkv, d, q_seg, kv_seg, q_pos, kv_pos, mask, seed = layout
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, skv, hkv, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, skv, hkv, d)), jnp.float32)
  out, lse = jaxcp.attention(q, k, v, segment_ids=q_seg, kv_segment_ids=kv_seg, positions=q_pos,
                             kv_positions=kv_pos, implementation="cpu", return_residual=True, **mask)
  ref_out, ref_lse = numpy_attention(q, k, v, q_seg, q_pos, kv_seg, kv_pos, causal=mask["is_causal"],
                                     window=mask.get("local_window_size"), chunk=mask.get("chunk_size"))
  assert not np.isnan(np.asarray(out)).any()
  assert rel_err(out, ref_out) < 1e-5
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(ref_lse))
