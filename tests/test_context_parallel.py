"""Context parallelism on 8 host devices: values and gradients equal to the unsharded call,
and the expected collectives (and no gathered Q) in the compiled HLO."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcp
from jaxcp._src.compat import shard_map
from jaxcp._src.attention.load_balance import load_balance, restore_order
from jaxcp._src.masks import positions_from_segments

from .helpers import rel_err

B, S, HQ, HKV, D = 2, 64, 4, 2, 8
MASKS = {
    "causal": dict(is_causal=True),
    "full": dict(),
    "window": dict(is_causal=True, local_window_size=(9, 0)),
    "chunk": dict(is_causal=True, chunk_size=12),
}


def _mesh(dp, tp, cp):
  devices = np.array(jax.devices("cpu")[: dp * tp * cp]).reshape(dp, tp, cp)
  return jax.sharding.Mesh(devices, ("dp", "tp", "cp"))


def _inputs(seed):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, S, HQ, D)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, S, HKV, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, S, HKV, D)), jnp.float32)
  dout = jnp.asarray(rng.standard_normal((B, S, HQ, D)), jnp.float32)
  # Row 0: documents shorter than a shard (3, 5, ...), row 1: one long document and padding.
  seg = np.zeros((B, S), np.int32)
  seg[0] = np.repeat(np.arange(1, 9), [3, 5, 13, 2, 9, 17, 7, 8])
  seg[1, :56] = 1
  pos = positions_from_segments(jnp.asarray(seg))
  return q, k, v, dout, jnp.asarray(seg), pos


def _reference(q, k, v, dout, seg, pos, mask):
  f = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, implementation="xla", **mask)
  out, vjp = jax.vjp(f, q, k, v)
  return out, vjp(dout)


def _fwd_bwd(strategy, mask, axis=None):
  def run(q, k, v, dout, seg, pos):
    f = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, context_parallel=strategy,
                                        context_parallel_axis=axis, **mask)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(dout)
  return run


def _collectives(text):
  return {c for c in ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
          if c in text}


def _check(out, grads, ref_out, ref_grads):
  assert rel_err(out, ref_out) < 1e-5
  for g, r in zip(grads, ref_grads):
    assert rel_err(g, r) < 1e-5


MESHES = [(2, 2, 2), (1, 1, 8), (2, 1, 4)]


# Every mask on the 2x2x2 mesh; causal and chunk on the others (keeps the suite short).
JIT_CASES = [(m, name) for m in MESHES for name in MASKS if m == (2, 2, 2) or name in ("causal", "chunk")]


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("mesh_shape,mask_name", JIT_CASES,
                         ids=["x".join(map(str, m)) + "-" + n for m, n in JIT_CASES])
def test_jit_context_parallel_matches_unsharded(cpu_devices, strategy, mesh_shape, mask_name):
  mask = MASKS[mask_name]
  q, k, v, dout, seg, pos = _inputs(0)
  mesh = _mesh(*mesh_shape)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", "tp", None)), NamedSharding(mesh, P("dp", "cp"))
  args = [jax.device_put(x, s) for x, s in zip((q, k, v, dout, seg, pos), (s4, s4, s4, s4, s2, s2))]
  f = jax.jit(_fwd_bwd(strategy, mask))
  text = f.lower(*args).compile().as_text()
  found = _collectives(text)
  if strategy == "all_gather":
    assert "all-gather" in found and "collective-permute" not in found
  else:
    assert "collective-permute" in found and "all-gather" not in found
  # Q (the only [*, *, local Hq, D] operand) is never gathered along the sequence.
  gathered = [[int(x) for x in shape.split(",")]
              for shape in re.findall(r"= [fu]32\[([\d,]+)\]\{[^}]*\} all-gather\(", text)]
  if strategy == "all_gather":
    assert gathered, "the all-gather pattern no longer matches the HLO text"
  # K, V, segment ids and positions packed into one [B, S, 2 * local Hkv * D + 2] array.
  assert all(dims == [B // mesh_shape[0], S, 2 * (HKV // mesh_shape[1]) * D + 2] for dims in gathered)
  out, grads = f(*args)
  _check(out, grads, *_reference(q, k, v, dout, seg, pos, mask))


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("balance", ["striped", "zigzag"])
def test_load_balanced_rows_give_the_same_result(cpu_devices, strategy, balance):
  q, k, v, dout, seg, pos = _inputs(1)
  cp = 4
  mesh = _mesh(2, 1, cp)
  lb = lambda x: load_balance(x, cp, axis=1, strategy=balance)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", None, None)), NamedSharding(mesh, P("dp", "cp"))
  # Positions are derived before permuting and passed explicitly.
  args = [jax.device_put(lb(x), s) for x, s in zip((q, k, v, dout, seg, pos), (s4, s4, s4, s4, s2, s2))]
  out, grads = jax.jit(_fwd_bwd(strategy, MASKS["causal"]))(*args)
  ro = lambda x: restore_order(x, cp, axis=1, strategy=balance)
  _check(ro(out), [ro(g) for g in grads], *_reference(q, k, v, dout, seg, pos, MASKS["causal"]))


@pytest.mark.parametrize("strategy", ["all_gather", "ring", "auto"])
def test_shard_map_with_context_parallel_axis(cpu_devices, strategy):
  q, k, v, dout, seg, pos = _inputs(2)
  mesh = _mesh(2, 2, 2)
  s4, s2 = P("dp", "cp", "tp", None), P("dp", "cp")
  body = _fwd_bwd(strategy, MASKS["chunk"], axis="cp")
  f = jax.jit(shard_map(body, mesh=mesh, in_specs=(s4, s4, s4, s4, s2, s2), out_specs=(s4, (s4, s4, s4))))
  out, grads = f(q, k, v, dout, seg, pos)
  _check(out, grads, *_reference(q, k, v, dout, seg, pos, MASKS["chunk"]))


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_value_head_dim_of_its_own_under_context_parallelism(cpu_devices, strategy):
  """A value head dim unlike query/key's (MLA): V, O and dO go through the sharded CPU kernels and
  the exchange of K/V unpadded."""
  q, k, _, _, seg, pos = _inputs(5)
  rng = np.random.default_rng(5)
  v = jnp.asarray(rng.standard_normal((B, S, HKV, 2 * D)), jnp.float32)
  dout = jnp.asarray(rng.standard_normal((B, S, HQ, 2 * D)), jnp.float32)
  mesh = _mesh(2, 1, 4)
  s4, s2 = NamedSharding(mesh, P("dp", "cp", None, None)), NamedSharding(mesh, P("dp", "cp"))
  args = [jax.device_put(x, s) for x, s in zip((q, k, v, dout, seg, pos), (s4, s4, s4, s4, s2, s2))]
  f = jax.jit(_fwd_bwd(strategy, MASKS["causal"]))
  assert "stablehlo.pad" not in f.lower(*args).as_text()
  out, grads = f(*args)
  assert out.shape == (B, S, HQ, 2 * D) and grads[2].shape == v.shape
  _check(out, grads, *_reference(q, k, v, dout, seg, pos, MASKS["causal"]))


def test_xla_implementation_inside_shard_map(cpu_devices):
  q, k, v, dout, seg, pos = _inputs(3)
  mesh = _mesh(1, 1, 8)
  s4, s2 = P(None, "cp", None, None), P(None, "cp")

  def body(q, k, v, seg, pos):
    return jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, is_causal=True, implementation="xla",
                           context_parallel_axis="cp")

  out = jax.jit(shard_map(body, mesh=mesh, in_specs=(s4, s4, s4, s2, s2), out_specs=s4))(q, k, v, seg, pos)
  assert rel_err(out, _reference(q, k, v, dout, seg, pos, MASKS["causal"])[0]) < 1e-5


def test_queries_sharded_keys_replicated_needs_no_communication(cpu_devices):
  """Cross attention to a short replicated context: each rank attends locally."""
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.standard_normal((B, S, HQ, D)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, 16, HKV, D)), jnp.float32)
  mesh = _mesh(1, 1, 8)
  qs = jax.device_put(q, NamedSharding(mesh, P(None, "cp", None, None)))
  ks = jax.device_put(k, NamedSharding(mesh, P()))
  f = jax.jit(lambda q, k: jaxcp.attention(q, k, k))
  assert _collectives(f.lower(qs, ks).compile().as_text()) == set()
  assert rel_err(f(qs, ks), jaxcp.attention(q, k, k, implementation="xla")) < 1e-5


def test_auto_strategy_rule():
  from jaxcp._src.attention.context_parallel import choose_strategy
  assert choose_strategy("auto", 2, 65536, 65536, 32, 32) == "all_gather"      # two ranks
  assert choose_strategy("auto", 8, 1024, 1024, 32, 32) == "all_gather"        # short local blocks
  assert choose_strategy("auto", 8, 65536, 65536, 32, 8) == "all_gather"       # GQA 4: small K/V
  assert choose_strategy("auto", 4, 65536, 65536, 16, 16) == "all_gather"     # measured: all-gather wins
  assert choose_strategy("auto", 8, 65536, 65536, 16, 16) == "ring"
  assert choose_strategy("ring", 2, 16, 16, 1, 1) == "ring"
  placement = jaxcp.DocumentPlacement(8)
  assert choose_strategy(placement, 4, 16, 16, 4, 4) is placement
