"""Context parallelism on random packed rows (8 host devices): all-gather and ring, sharded
under jax.jit, on rows of short and long documents, padding anywhere, reused segment ids and
positions past 0, in the token orders of every load-balancing strategy. Values and gradients
must equal the unsharded reference row by row, and be exactly zero where no pair is allowed
(the ring merges a query's partial results over ranks where it may have no key at all)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcp

from .helpers import self_attention_rows_close
from .strategies import packed_row

B, S, HQ, HKV, D = 2, 64, 4, 2, 8
CP = 4
MASKS = {
    "causal": dict(is_causal=True),
    "full": dict(),
    "causal_window": dict(is_causal=True, local_window_size=(9, 0)),
    "chunk": dict(chunk_size=12),
}
PIECES = {"short": (1, 6), "medium": (7, 20), "long": (21, 64), "padding": (1, 8)}
ORDERS = ["as_is", "striped", "zigzag", "balanced_blocks", "zigzag_docs"]


@st.composite
def balanced_batch(draw):
  """Segment ids and positions of B rows, then the token order of one load-balancing strategy
  (positions derived before permuting, as load_balance asks), with that order."""
  rows = [draw(packed_row(S, PIECES)) for _ in range(B)]
  seg, pos = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
  order = draw(st.sampled_from(ORDERS))
  if order == "as_is":
    return seg, pos, None
  if order in ("balanced_blocks", "zigzag_docs"):
    order = jaxcp.load_balance_permutation(seg, CP, strategy=order, block_size=4)
  return seg, pos, order


@functools.lru_cache(maxsize=None)
def _runner(strategy, mask_name):
  """jit(out, dq, dk, dv) of the sharded (strategy) or unsharded (None) call; cached."""
  def run(q, k, v, dout, seg, pos):
    f = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, positions=pos,
                                        implementation="xla" if strategy is None else None,
                                        context_parallel=strategy or "auto", **MASKS[mask_name])
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(dout))
  return jax.jit(run)


def _inputs():
  rng = np.random.default_rng(0)
  shapes = [(B, S, HQ, D), (B, S, HKV, D), (B, S, HKV, D), (B, S, HQ, D)]
  q, k, v, dout = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
  return 3 * q, k, v, dout  # peaky softmax: a key wrongly in or out moves its row visibly


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("mask_name", list(MASKS))
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(batch=balanced_batch())
def test_random_rows_match_unsharded(cpu_devices, strategy, mask_name, batch):
  seg, pos, order = batch
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2 * CP]).reshape(2, CP), ("dp", "cp"))
  s4, s2 = NamedSharding(mesh, P("dp", "cp", None, None)), NamedSharding(mesh, P("dp", "cp"))
  arrays = (*_inputs(), jnp.asarray(seg), jnp.asarray(pos))
  if order is not None:
    arrays = tuple(jaxcp.load_balance(x, CP, strategy=order) for x in arrays)
  args = [jax.device_put(x, s) for x, s in zip(arrays, (s4, s4, s4, s4, s2, s2))]
  got = _runner(strategy, mask_name)(*args)
  want = _runner(None, mask_name)(*arrays)
  self_attention_rows_close(got, want, arrays[4], arrays[5], MASKS[mask_name], HQ, HKV)
