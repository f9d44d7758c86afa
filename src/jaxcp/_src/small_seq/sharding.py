"""custom_partitioning of the small-seq primitives: batch (padded layout) and heads shard with
no collective."""
from __future__ import annotations

from jax.sharding import NamedSharding, PartitionSpec as P

from .. import compat
from ..primitive_utils import mesh_axis_size, spec_of
from .primitive import is_default, local_bwd, local_fwd, small_seq_bwd_p, small_seq_fwd_p

# ---------------------------------------------------------------- sharding (DP + TP, no collective)


def _choose_axes(config, mesh, q, k):
  """(batch axes, head axes) for this call, following the query's sharding.

  Batch shards only in the padded layout (a ragged key/value side cannot follow the rows without
  communication). Heads shard only when Hq and Hkv both divide by the axis size, so that every
  shard holds whole GQA groups.
  """
  qspec = spec_of(q, 3)
  batch, heads = qspec[0], qspec[1]
  if config.ragged or q.shape[0] % mesh_axis_size(mesh, batch):
    batch = None
  n = mesh_axis_size(mesh, heads)
  hkv = k.shape[1] if config.ragged else k.shape[2]
  if heads is not None and (q.shape[1] % n or hkv % n):
    heads = None
  return batch, heads


def _index_empty(shapes, backward):
  """Which index arrays are empty (their default, primitive.default_index): never sharded."""
  return tuple(is_default(x) for x in shapes[5 if backward else 3:])


def _specs(config, batch, heads, backward, empty):
  q = P(batch, heads, None)
  kv = P(None, heads, None) if config.ragged else P(batch, None, heads, None)
  idx = tuple(P(None) if e else P(batch) for e in empty)
  probs = P(batch, heads, None)
  if backward:
    return (q, kv, kv, probs, q) + idx, (q, kv, kv)
  return (q, kv, kv) + idx, (q, probs)


def _named(mesh, specs):
  return tuple(NamedSharding(mesh, s) for s in specs)


def _make_partitioned(local_fn, num_args, backward):
  def infer(config, mesh, arg_shapes, result_shape):
    batch, heads = _choose_axes(config, mesh, arg_shapes[0], arg_shapes[1])
    return _named(mesh, _specs(config, batch, heads, backward, _index_empty(arg_shapes, backward))[1])

  def partition(config, mesh, arg_shapes, result_shape):
    batch, heads = _choose_axes(config, mesh, arg_shapes[0], arg_shapes[1])
    arg_specs, out_specs = _specs(config, batch, heads, backward, _index_empty(arg_shapes, backward))

    def lower(*args):
      return local_fn(*args, config)

    return mesh, lower, _named(mesh, out_specs), _named(mesh, arg_specs)

  def rule(config, mesh, value_types, result_types):
    kv = "t g d" if config.ragged else "b s g d"
    m = "m" if config.ragged else "s"
    idx = ", ".join(f"e{i}" if e else "b" for i, e in enumerate(_index_empty(value_types, backward)))
    if backward:
      return f"b h d, {kv}, {kv}, b h {m}, b h d, {idx} -> b h d, {kv}, {kv}"
    return f"b h d, {kv}, {kv}, {idx} -> b h d, b h {m}"

  cp = compat.custom_partitioning(local_fn, static_argnums=(num_args,))
  cp.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
  return cp


_PARTITIONED = {
    (backward, ragged): _make_partitioned(
        local_bwd if backward else local_fwd,
        (5 if backward else 3) + (3 if ragged else 2), backward)
    for backward in (False, True) for ragged in (False, True)
}


def _partitioned_fwd(*args, config):
  return _PARTITIONED[(False, config.ragged)](*args, config)


def _partitioned_bwd(*args, config):
  return _PARTITIONED[(True, config.ragged)](*args, config)


compat.mlir.register_lowering(small_seq_fwd_p,
                              compat.mlir.lower_fun(_partitioned_fwd, multiple_results=True))
compat.mlir.register_lowering(small_seq_bwd_p,
                              compat.mlir.lower_fun(_partitioned_bwd, multiple_results=True))
