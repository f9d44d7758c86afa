"""jit, vmap, remat and grad compose with the kernel path."""
import jax
import jax.numpy as jnp
import numpy as np

import jaxcp

from .helpers import qkv, random_segments, rel_err


def _inputs(seed=0, b=2, s=24, hq=4, hkv=2, d=8):
  rng = np.random.default_rng(seed)
  q, k, v = qkv(rng, b, s, s, hq, hkv, d, jnp.float32)
  return q, k, v, random_segments(rng, b, s, mean_doc=7)


def test_jit_equals_eager():
  q, k, v, seg = _inputs()
  f = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True, implementation="cpu")
  np.testing.assert_allclose(np.asarray(jax.jit(f)(q, k, v)), np.asarray(f(q, k, v)), rtol=1e-6, atol=1e-6)


def test_vmap_over_leading_axis_and_unmapped_operands():
  q, k, v, seg = _inputs()
  qs = jnp.stack([q, 2 * q, -q])
  f = lambda q, k, v, s: jaxcp.attention(q, k, v, segment_ids=s, is_causal=True, implementation="cpu")
  got = jax.vmap(f, in_axes=(0, None, None, None))(qs, k, v, seg)
  for i in range(3):
    np.testing.assert_allclose(np.asarray(got[i]), np.asarray(f(qs[i], k, v, seg)), rtol=1e-5, atol=1e-6)


def test_vmap_on_a_non_leading_axis_with_grad():
  q, k, v, seg = _inputs()
  qs = jnp.stack([q, 0.5 * q], axis=2)  # vmapped axis 2

  def loss(q, k, v):
    return jnp.sum(jaxcp.attention(q, k, v, segment_ids=seg, implementation="cpu") ** 2)

  got = jax.vmap(jax.grad(loss), in_axes=(2, None, None))(qs, k, v)
  want = jnp.stack([jax.grad(loss)(qs[:, :, i], k, v) for i in range(2)])
  assert rel_err(got, want) < 1e-5


def test_remat_gives_same_gradients():
  q, k, v, seg = _inputs()

  def loss(q, k, v):
    return jnp.sum(jnp.tanh(jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True, implementation="cpu")))

  plain = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(plain, remat):
    assert rel_err(a, b) < 1e-6


def test_remat_policy_can_save_the_attention_output():
  """Under jax.checkpoint in a scan over layers, the policy that saves the named residuals
  ("jaxcp_attention_out", "jaxcp_attention_lse") keeps the backward from rerunning the forward
  kernel; nothing_saveable reruns it. Same gradients either way."""
  q, k, v, seg = _inputs()
  wk, wv = jnp.asarray(0.5 * k), jnp.asarray(0.5 * v)

  def layer(x, _):
    y = jnp.sin(x)
    out = jaxcp.attention(y, wk + y[:, :, :2], wv, segment_ids=seg, is_causal=True, implementation="cpu")
    return jnp.cos(out) + x, None

  def grads_and_forward_calls(policy):
    loss = lambda x: jnp.sum(jax.lax.scan(jax.checkpoint(layer, policy=policy), x, None, length=3)[0])
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(q))
    return jax.jit(jax.grad(loss))(q), jaxpr.count("jaxcp_attention_fwd[")

  policies = jax.checkpoint_policies
  saved, saved_calls = grads_and_forward_calls(
      policies.save_only_these_names("jaxcp_attention_out", "jaxcp_attention_lse"))
  recomputed, recomputed_calls = grads_and_forward_calls(policies.nothing_saveable)
  assert (saved_calls, recomputed_calls) == (1, 2)
  assert rel_err(saved, recomputed) < 1e-6


def test_second_layer_composition_under_jit():
  """Two stacked attention calls inside one jitted loss (a tiny two-layer model)."""
  q, k, v, seg = _inputs()

  def model(q, k, v, impl):
    h = jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True, implementation=impl)
    return jaxcp.attention(h, k, v, segment_ids=seg, is_causal=True, implementation=impl)

  f = lambda impl: jax.jit(jax.grad(lambda q: jnp.sum(model(q, k, v, impl) ** 2)))
  assert rel_err(f("cpu")(q), f("xla")(q)) < 1e-5
