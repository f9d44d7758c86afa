"""The backward as two chained kernel calls (primitive.LocalBwd.begin / end: one preparation of
the query side, one dQ conversion) against one call over both key sets, on the CUDA kernels."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcp._src.attention.primitive import AttentionConfig, LocalBwd, fwd_kernel
from jaxcp._src.mask_spec import MaskSpec

from .helpers import positions_in_documents, random_segments, rel_err

pytestmark = pytest.mark.gpu

MASKS = {
    "causal": MaskSpec(is_causal=True),
    "window": MaskSpec(is_causal=True, window_left=200, window_right=0),
    "chunk": MaskSpec(chunk_size=300),
}


def _row(seed, b, s, hq, hkv, d):
  key = jax.random.PRNGKey(seed)
  q, k, v, do = (jax.random.normal(jax.random.fold_in(key, i), (b, s, h, d), jnp.bfloat16)
                 for i, h in enumerate((hq, hkv, hkv, hq)))
  seg = random_segments(np.random.default_rng(seed), b, s, mean_doc=400)
  return q, k, v, do, jnp.asarray(seg), jnp.asarray(positions_in_documents(seg))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("heads,d", [((4, 4), 128), ((8, 2), 64), ((2, 2), 256)])
@pytest.mark.parametrize("mask", list(MASKS))
def test_chained_calls_equal_one_call(mask, heads, d, deterministic):
  b, s, cut = 2, 1344, 704  # the key sets: tokens [0, cut) and [cut, s), a partial tile each
  q, k, v, do, seg, pos = _row(0, b, s, *heads, d)
  config = AttentionConfig(mask=MASKS[mask], scale=d ** -0.5, deterministic=deterministic)
  local = LocalBwd(config)
  ka, kb = k[:, :cut], k[:, cut:]
  assert local.chains(q, ka, kb)
  dlse = jax.random.normal(jax.random.PRNGKey(5), (b, heads[0], s), jnp.float32)

  def chained(q, k, v, do, dlse, seg, pos):
    out, lse = fwd_kernel(q, k, v, seg, pos, seg, pos, config)
    args = lambda lo, hi: (q, k[:, lo:hi], v[:, lo:hi], out, lse, do, dlse, seg, pos, seg[:, lo:hi], pos[:, lo:hi])
    state, dk_a, dv_a = local.begin(*args(0, cut), then_k=k[:, cut:])
    dq, dk_b, dv_b = local.end(state, *args(cut, s))
    whole = local(q, k, v, out, lse, do, dlse, seg, pos, seg, pos)
    return (dq, jnp.concatenate([dk_a, dk_b], 1), jnp.concatenate([dv_a, dv_b], 1)), whole

  fn = jax.jit(chained)
  hlo = fn.lower(q, k, v, do, dlse, seg, pos).compile().as_text()
  assert "jaxcp_attention_bwd_begin" in hlo and "jaxcp_attention_bwd_end" in hlo
  assert "output_to_operand_aliasing" in hlo
  got, want = fn(q, k, v, do, dlse, seg, pos)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert not np.isnan(np.asarray(g, np.float32)).any(), name
    assert rel_err(g, w) < 1e-2, name
  if deterministic:  # and reproducible, bit for bit
    again, _ = fn(q, k, v, do, dlse, seg, pos)
    for g, h in zip(got, again):
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h, np.float32))
