"""The CUDA tile plan is a call of its own that layers share (marker `gpu`).

On CUDA each attention kernel call takes its tile plan as an operand, built by a separate call
(`jaxcp_attention_<fwd|bwd>_plan`) from the segment ids and positions alone. Layers of a model
that share them make identical plan calls, which XLA merges: a stack of attention layers then
builds one forward plan and one backward plan, and gives the same bits as the layers run one by
one (each with its own plan).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcp

from .helpers import positions_in_documents, random_segments

pytestmark = pytest.mark.gpu

B, S, HQ, HKV, D, LAYERS = 2, 640, 4, 2, 128, 3


def _plan_calls(compiled_text, direction):
  return len(re.findall(rf'custom_call_target="jaxcp_attention_{direction}_plan"', compiled_text))


def _inputs(seed=0):
  """Queries, LAYERS pairs of keys and values, and packed rows' segment ids and positions."""
  rng = np.random.default_rng(seed)
  seg = random_segments(rng, B, S, mean_doc=100)
  pos = positions_in_documents(seg)
  key = jax.random.PRNGKey(seed)
  normal = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)
  q = normal(0, (B, S, HQ, D))
  kvs = [(normal(2 * l + 1, (B, S, HKV, D)), normal(2 * l + 2, (B, S, HKV, D))) for l in range(LAYERS)]
  return q, kvs, jnp.asarray(seg), jnp.asarray(pos)


def _layer(q, k, v, seg, pos, deterministic=False):
  return jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, is_causal=True, implementation="cuda",
                         deterministic=deterministic)


def _stack(q, kvs, segs, poss):
  """LAYERS attention layers, each layer's output the next one's queries."""
  x = q
  for (k, v), seg, pos in zip(kvs, segs, poss):
    x = _layer(x, k, v, seg, pos)
  return x


def test_layers_share_one_plan_per_direction():
  q, kvs, seg, pos = _inputs()
  fwd = jax.jit(lambda q, kvs, seg, pos: _stack(q, kvs, [seg] * LAYERS, [pos] * LAYERS))
  grad = jax.jit(jax.grad(lambda q, kvs, seg, pos: _stack(q, kvs, [seg] * LAYERS, [pos] * LAYERS)
                          .astype(jnp.float32).sum(), argnums=(0, 1)))
  fwd_text = fwd.lower(q, kvs, seg, pos).compile().as_text()
  grad_text = grad.lower(q, kvs, seg, pos).compile().as_text()
  assert fwd_text.count('custom_call_target="jaxcp_attention_fwd"') == LAYERS
  assert _plan_calls(fwd_text, "fwd") == 1
  assert grad_text.count('custom_call_target="jaxcp_attention_bwd"') == LAYERS
  assert (_plan_calls(grad_text, "fwd"), _plan_calls(grad_text, "bwd")) == (1, 1)

  # The same bits as the layers run one by one, each call with a plan of its own.
  one = jax.jit(_layer)
  x = q
  for k, v in kvs:
    x = one(x, k, v, seg, pos)
  np.testing.assert_array_equal(np.asarray(fwd(q, kvs, seg, pos), np.float32), np.asarray(x, np.float32))


def test_different_segments_keep_their_own_plans():
  """A layer with other segment ids gets its own plan, and its own result; the layers around it
  still share theirs."""
  q, kvs, seg, pos = _inputs()
  seg2 = jnp.where(jnp.arange(S)[None, :] < S // 2, seg, seg + 1000)  # documents cut at S / 2
  fwd = jax.jit(lambda q, kvs, seg, seg2, pos: _stack(q, kvs, [seg, seg2, seg], [pos] * LAYERS))
  text = fwd.lower(q, kvs, seg, seg2, pos).compile().as_text()
  assert _plan_calls(text, "fwd") == 2
  one = jax.jit(_layer)
  x = q
  for (k, v), s in zip(kvs, (seg, seg2, seg)):
    x = one(x, k, v, s, pos)
  np.testing.assert_array_equal(np.asarray(fwd(q, kvs, seg, seg2, pos), np.float32), np.asarray(x, np.float32))


def test_shared_plan_under_scan_and_remat():
  """Layers under lax.scan (as nn.scan builds them) with remat: the results match the unrolled
  stack's, and the plan is built outside the loop or once per step, never wrongly shared."""
  q, kvs, seg, pos = _inputs()
  ks = jnp.stack([k for k, _ in kvs])
  vs = jnp.stack([v for _, v in kvs])

  def scanned(q, ks, vs, seg, pos):
    step = jax.checkpoint(lambda x, kv: (_layer(x, kv[0], kv[1], seg, pos), None))
    return jax.lax.scan(step, q, (ks, vs))[0]

  loss = lambda f: (lambda *a: f(*a).astype(jnp.float32).sum())
  unrolled = lambda q, ks, vs, seg, pos: _stack(q, list(zip(ks, vs)), [seg] * LAYERS, [pos] * LAYERS)
  out_s = jax.jit(scanned)(q, ks, vs, seg, pos)
  out_u = jax.jit(unrolled)(q, ks, vs, seg, pos)
  np.testing.assert_array_equal(np.asarray(out_s, np.float32), np.asarray(out_u, np.float32))
  g_s = jax.jit(jax.grad(loss(scanned), argnums=(0, 1, 2)))(q, ks, vs, seg, pos)
  g_u = jax.jit(jax.grad(loss(unrolled), argnums=(0, 1, 2)))(q, ks, vs, seg, pos)
  for a, b in zip(g_s, g_u):  # the backward's atomic dQ adds: equal up to their order
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max()
