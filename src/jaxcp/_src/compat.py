"""Every JAX-internal or version-dependent import lives here (JAX 0.10 on CPU CI, 0.11 on GPUs).

Other modules import from this file only, so a JAX upgrade touches one place.
"""
from __future__ import annotations

import jax
from jax.experimental.custom_partitioning import custom_partitioning  # noqa: F401
from jax.extend.core import Primitive  # noqa: F401
from jax.interpreters import batching, mlir  # noqa: F401

# jax._src.dispatch is private: it provides the eager impl of primitives, and the set of
# primitives whose lowering needs the device assignment (custom_partitioning inside ours).
from jax._src import dispatch as _dispatch

apply_primitive = _dispatch.apply_primitive


def requires_devices_during_lowering(primitive) -> None:
  _dispatch.prim_requires_devices_during_lowering.add(primitive)

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# jax.shard_map is public from 0.7; older versions keep it in jax.experimental.
if hasattr(jax, "shard_map"):
  shard_map = jax.shard_map
else:  # pragma: no cover
  from jax.experimental.shard_map import shard_map  # type: ignore  # noqa: F401


# The batch dimension JAX passes for an operand that vmap does not map (None in 0.10/0.11).
NOT_MAPPED = getattr(batching, "not_mapped", None)


def ffi_lowering(target_name: str, **lowering_args):
  return jax.ffi.ffi_lowering(target_name, **lowering_args)


def register_ffi_target(name: str, capsule, platform: str) -> None:
  jax.ffi.register_ffi_target(name, capsule, platform=platform)


def axis_size(axis_name) -> int:
  """Size of a bound mesh axis (a name or a tuple of names) inside shard_map / custom_partitioning
  bodies; partition callbacks read the mesh instead (primitive_utils.mesh_axis_size)."""
  return jax.lax.axis_size(axis_name) if hasattr(jax.lax, "axis_size") else jax.lax.psum(1, axis_name)

ShapedArray = jax.core.ShapedArray


def derived_aval(base, shape, dtype, dims):
  """An output aval built from an input aval `base`, keeping its sharding-in-types and the
  manual axes it varies over (shard_map's check_vma), with dimension i of the output taking the
  sharding of base dimension dims[i] (None: replicated)."""
  sharding = getattr(base, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return ShapedArray(shape, dtype)
  spec = tuple(spec) + (None,) * (len(base.shape) - len(spec))
  new_sharding = sharding.update(spec=[None if d is None else spec[d] for d in dims])
  return base.update(shape=tuple(shape), dtype=dtype, sharding=new_sharding)


def explicit_sharding(x):
  """x's NamedSharding when its type is sharded over Explicit mesh axes (sharding in types,
  jax.make_mesh's default), where reshapes and gathers of a sharded axis need their output
  sharding spelled out; else None (numpy arrays, Auto meshes, unsharded arrays)."""
  if not isinstance(x, jax.Array):  # tracers included
    return None
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  if explicit is None or not any(t == explicit for t in getattr(mesh, "axis_types", ())):
    return None
  if all(p is None for p in sharding.spec):
    return None
  return sharding

