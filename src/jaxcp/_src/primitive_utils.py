"""Pieces shared by the attention and small-seq primitives: building primitives and their FFI
lowerings, reading shardings in partition callbacks, argument checks, implementation choice."""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax.sharding import NamedSharding

from . import compat, registry

IMPLEMENTATIONS = (None, "cuda", "cpu", "xla")
CUDA_DTYPES = (jnp.bfloat16, jnp.float16)


def make_primitive(name, abstract_eval):
  """A multiple-results primitive with an eager impl (compiled through its lowering)."""
  p = compat.Primitive(name)
  p.multiple_results = True
  p.def_impl(functools.partial(compat.apply_primitive, p))
  p.def_abstract_eval(abstract_eval)
  return p


def register_ffi_lowering(primitive, target, attrs_of, platforms=("cpu", "cuda")):
  """Lowers `primitive` to the FFI target on the given kernel platforms; `attrs_of(config)` gives
  the FFI attributes (other primitive parameters are for abstract eval only)."""
  rule = compat.ffi_lowering(target)

  def lower(ctx, *args, config, **_):
    return rule(ctx, *args, **attrs_of(config))

  for platform in platforms:
    compat.mlir.register_lowering(primitive, lower, platform=platform)


def spec_of(shape_struct, ndim):
  """The PartitionSpec of a partition-callback argument, padded to ndim (replicated if unknown)."""
  sharding = getattr(shape_struct, "sharding", None)
  if isinstance(sharding, NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return spec[:ndim]
  return (None,) * ndim


def mesh_axis_size(mesh, axes) -> int:
  """Number of shards along one mesh axis name, a tuple of names, or None (1), read from the mesh
  (partition callbacks; inside a body where the axis is bound, use compat.axis_size)."""
  if axes is None:
    return 1
  if isinstance(axes, str):
    axes = (axes,)
  return math.prod(mesh.shape[a] for a in axes)


def check_int_array(name, x, shape):
  """Validates an integer per-token array of the given shape; returns it as int32."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array (int32), got dtype {x.dtype}.")
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}.")
  return x.astype(jnp.int32)


def _head_dims_text(head_dims) -> str:
  if isinstance(head_dims, range):
    return f"{head_dims.start}..{head_dims.stop - 1}"
  return str(tuple(head_dims))


def choose_implementation(implementation, dtype, head_dim, cuda_head_dims) -> str:
  """"xla", "cpu" or "cuda" for a call; None picks the kernel of the default backend when it
  supports the dtype and head dim, else "xla". An explicit kernel that cannot run raises."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
  if implementation == "xla":
    return "xla"
  platform = registry.kernel_platform()
  cuda_ok = dtype in CUDA_DTYPES and head_dim in cuda_head_dims
  if implementation is None:
    if platform is None:
      registry.warn_fallback()
      return "xla"
    if platform == "cuda":
      return "cuda" if cuda_ok else "xla"
    return platform
  if platform is None:
    raise ValueError(f"implementation={implementation!r}: " + registry.missing_kernel_message())
  if implementation != platform:
    raise ValueError(
        f"implementation={implementation!r} is not available on the {registry.default_backend()!r} "
        f"backend, whose kernels are {platform!r}; use implementation=None (the best available) or 'xla'.")
  if implementation == "cuda" and not cuda_ok:
    raise ValueError(
        f"implementation='cuda' supports bfloat16/float16 and head_dim in {_head_dims_text(cuda_head_dims)}, "
        f"got {dtype} and head_dim={head_dim}; use implementation=None to fall back to 'xla'.")
  return implementation
