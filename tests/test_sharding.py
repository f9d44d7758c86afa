"""DP and TP sharding under jax.jit: same values and gradients, and no collectives in the HLO."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcp

from .helpers import qkv, random_segments, rel_err

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def _collectives(compiled_text):
  return [c for c in COLLECTIVES if c in compiled_text]


def _mesh(shape, names):
  devices = np.array(jax.devices("cpu")[: int(np.prod(shape))]).reshape(shape)
  return jax.sharding.Mesh(devices, names)


def _put(mesh, x, spec):
  return jax.device_put(x, NamedSharding(mesh, spec))


CASES = [
    # mesh shape, names, q spec, (Hq, Hkv)
    ((8,), ("dp",), P("dp", None, None, None), (4, 2)),
    ((8,), ("tp",), P(None, None, "tp", None), (8, 8)),
    ((2, 4), ("dp", "tp"), P("dp", None, "tp", None), (8, 4)),
    ((4, 2), ("dp", "tp"), P("dp", None, "tp", None), (4, 2)),
]


@pytest.mark.parametrize("dv", [8, 12], ids=["dv=d", "dv12"])  # dv12: V's head dim of its own (MLA)
@pytest.mark.parametrize("mesh_shape,names,qspec,heads", CASES, ids=["dp8", "tp8", "dp2tp4-gqa", "dp4tp2-gqa"])
def test_dp_tp_values_grads_and_no_collectives(cpu_devices, mesh_shape, names, qspec, heads, dv):
  rng = np.random.default_rng(0)
  b, s, d = 8, 32, 8
  q, k, _ = qkv(rng, b, s, s, heads[0], heads[1], d, jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, s, heads[1], dv)), jnp.float32)
  seg = jnp.asarray(random_segments(rng, b, s, mean_doc=9))
  mesh = _mesh(mesh_shape, names)
  kvspec = qspec
  tokspec = P(qspec[0], None)
  args = (_put(mesh, q, qspec), _put(mesh, k, kvspec), _put(mesh, v, kvspec), _put(mesh, seg, tokspec))

  def fwd_bwd(q, k, v, seg, dout):
    out, vjp = jax.vjp(lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True), q, k, v)
    return out, vjp(dout)

  dout = jnp.asarray(rng.standard_normal(q.shape[:3] + (dv,)), jnp.float32)
  f = jax.jit(fwd_bwd)
  sharded = args + (_put(mesh, dout, qspec),)
  assert _collectives(f.lower(*sharded).compile().as_text()) == []
  out, grads = f(*sharded)
  ref_out, ref_vjp = jax.vjp(
      lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True, implementation="xla"), q, k, v)
  assert rel_err(out, ref_out) < 1e-6
  for g, r in zip(grads, ref_vjp(dout)):
    assert rel_err(g, r) < 1e-5
  spec = tuple(out.sharding.spec) + (None,) * 4
  assert spec[0] == qspec[0] and spec[2] == qspec[2]


def test_mqa_under_tensor_parallel_slices_kv_without_forward_collectives(cpu_devices):
  """Hkv (2) smaller than the TP degree (4): each shard uses its one kv head."""
  rng = np.random.default_rng(1)
  b, s, d = 2, 16, 8
  q, k, v = qkv(rng, b, s, s, 8, 2, d, jnp.float32)
  mesh = _mesh((4,), ("tp",))
  qs = _put(mesh, q, P(None, None, "tp", None))
  ks, vs = _put(mesh, k, P()), _put(mesh, v, P())
  fwd = jax.jit(lambda q, k, v: jaxcp.attention(q, k, v, is_causal=True))
  assert _collectives(fwd.lower(qs, ks, vs).compile().as_text()) == []
  assert rel_err(fwd(qs, ks, vs), jaxcp.attention(q, k, v, is_causal=True, implementation="xla")) < 1e-6
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jaxcp.attention(q, k, v, is_causal=True) ** 2), argnums=(1, 2)))
  ref = jax.grad(lambda q, k, v: jnp.sum(jaxcp.attention(q, k, v, is_causal=True, implementation="xla") ** 2),
                 argnums=(1, 2))(q, k, v)
  for g, r in zip(grad(qs, ks, vs), ref):
    assert rel_err(g, r) < 1e-5


def test_sharded_vmap_composes(cpu_devices):
  rng = np.random.default_rng(2)
  q, k, v = qkv(rng, 8, 16, 16, 2, 2, 8, jnp.float32)
  mesh = _mesh((8,), ("dp",))
  spec = P("dp", None, None, None)
  qs = _put(mesh, jnp.stack([q, q * 0.5], axis=1), P("dp", None, None, None, None))
  f = jax.jit(jax.vmap(lambda q, k, v: jaxcp.attention(q, k, v, is_causal=True), in_axes=(1, None, None)))
  out = f(qs, _put(mesh, k, spec), _put(mesh, v, spec))
  assert rel_err(out[1], jaxcp.attention(q * 0.5, k, v, is_causal=True, implementation="xla")) < 1e-6
