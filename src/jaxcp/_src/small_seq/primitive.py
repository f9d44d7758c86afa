"""JAX primitives for small-sequence attention, in two layers as for jaxcp.attention:
- kernel primitives (`jaxcp_small_seq_{fwd,bwd}_kernel`) lower to the FFI targets
  `jaxcp_small_seq_{fwd,bwd}` of the current platform. The kernels see one flat layout:
  q [B, Hq, D], k/v [T, Hkv, D], and per row int32 kv_start, kv_len, kv_mask [B] (row b attends
  to tokens kv_start[b] + j, j < kv_len[b], whose bit j of kv_mask[b] is set), with the static
  attribute max_len (<= 16). An index array may be empty ([0], `default_index()`): its default,
  which then costs no kernel of its own (kv_start: b * max_len, the padded layout; kv_len:
  max_len; kv_mask: every token). They clamp len into [0, max_len] and start/len into [0, T], so
  out-of-range runtime values never read or write out of bounds.
- public primitives (`jaxcp_small_seq_{fwd,bwd}`) take the user's layout (padded [B, S, Hkv, D]
  or ragged [T, Hkv, D]) and carry the vmap rule; sharding.py gives them their lowering through
  `custom_partitioning`.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from .. import compat
from ..kernel_options import SmallSeqKernelOptions
from ..primitive_utils import make_primitive, register_ffi_lowering
from . import dispatch

FWD_TARGET = "jaxcp_small_seq_fwd"
BWD_TARGET = "jaxcp_small_seq_bwd"

MAX_KV_LEN = 16


def default_index():
  """An empty index array: the kernels take its default (module docstring)."""
  return jnp.zeros((0,), jnp.int32)


def is_default(x) -> bool:
  return x.shape[0] == 0


@dataclasses.dataclass(frozen=True)
class SmallSeqConfig:
  """Static parameters of one call (hashable: it is a primitive parameter).

  ragged: key/value are [T, Hkv, D] and the index arrays are (kv_start, kv_len, kv_mask);
  otherwise they are [B, S, Hkv, D] and the index arrays are (kv_len, kv_mask).
  kernel: which CUDA kernels run (kernel_options.py).
  """
  scale: float
  max_len: int
  ragged: bool
  kernel: SmallSeqKernelOptions = SmallSeqKernelOptions()

  def ffi_attrs(self) -> dict:
    """The small-seq handlers' attributes on every platform (ffi/common/small_seq_binding.h)."""
    return dict(max_len=np.int64(self.max_len), scale=np.float32(self.scale))

  def cuda_ffi_attrs(self) -> dict:
    """The CUDA handlers': those of ffi_attrs and the kernel options."""
    return dict(self.ffi_attrs(), kernel=self.kernel.ffi_attrs())

  @property
  def num_index(self) -> int:
    return 3 if self.ragged else 2


# ---------------------------------------------------------------- kernel primitives
# Flat layout: q [B,Hq,D], k/v [T,Hkv,D], kv_start/kv_len/kv_mask [B].


def _kfwd_abstract(q, k, v, start, length, mask, *, config):
  b, hq, _ = q.shape
  return (compat.ShapedArray(q.shape, q.dtype),
          compat.ShapedArray((b, hq, config.max_len), jnp.float32))


def _kbwd_abstract(q, k, v, probs, dout, start, length, mask, *, config):
  return (compat.ShapedArray(q.shape, q.dtype), compat.ShapedArray(k.shape, k.dtype),
          compat.ShapedArray(v.shape, v.dtype))


small_seq_fwd_kernel_p = make_primitive("jaxcp_small_seq_fwd_kernel", _kfwd_abstract)
small_seq_bwd_kernel_p = make_primitive("jaxcp_small_seq_bwd_kernel", _kbwd_abstract)
for _kernel_p, _target in ((small_seq_fwd_kernel_p, FWD_TARGET), (small_seq_bwd_kernel_p, BWD_TARGET)):
  register_ffi_lowering(_kernel_p, _target, lambda config: config.ffi_attrs(), platforms=("cpu",))
  register_ffi_lowering(_kernel_p, _target, lambda config: config.cuda_ffi_attrs(), platforms=("cuda",))


def _flat_kv(k, v, index, config):
  """Local (per-shard) views: k/v [T, Hkv, D] and (start, len, mask) [B] int32."""
  if config.ragged:
    start, length, mask = index
    return k, v, start, length, mask
  length, mask = index
  b, s, hkv, d = k.shape
  # Rows of Skv = max_len tokens start at b * max_len, the kernels' default.
  start = default_index() if s == config.max_len else jnp.arange(b, dtype=jnp.int32) * np.int32(s)
  return k.reshape(b * s, hkv, d), v.reshape(b * s, hkv, d), start, length, mask


def _resolved(config, q, k):
  """config with its "auto" kernels named for this shape (dispatch.py)."""
  kernel = dispatch.resolve(config.kernel, q.shape[1] // k.shape[-2], q.shape[-1], config.max_len)
  return dataclasses.replace(config, kernel=kernel)


def local_fwd(q, k, v, *index_and_config):
  """Unpartitioned forward on local arrays: (out, probs)."""
  *index, config = index_and_config
  config = _resolved(config, q, k)
  k3, v3, start, length, mask = _flat_kv(k, v, index, config)
  return tuple(small_seq_fwd_kernel_p.bind(q, k3, v3, start, length, mask, config=config))


def local_bwd(q, k, v, probs, dout, *index_and_config):
  """Unpartitioned backward on local arrays: (dq, dk, dv)."""
  *index, config = index_and_config
  config = _resolved(config, q, k)
  k3, v3, start, length, mask = _flat_kv(k, v, index, config)
  dq, dk, dv = small_seq_bwd_kernel_p.bind(q, k3, v3, probs, dout, start, length, mask,
                                           config=config)
  return dq, dk.reshape(k.shape), dv.reshape(v.shape)


# ---------------------------------------------------------------- public-facing primitives


def _fwd_abstract(q, k, v, *index, config):
  b, hq, _ = q.shape
  return (compat.ShapedArray(q.shape, q.dtype),
          compat.ShapedArray((b, hq, config.max_len), jnp.float32))


def _bwd_abstract(q, k, v, probs, dout, *index, config):
  return (compat.ShapedArray(q.shape, q.dtype), compat.ShapedArray(k.shape, k.dtype),
          compat.ShapedArray(v.shape, v.dtype))


small_seq_fwd_p = make_primitive("jaxcp_small_seq_fwd", _fwd_abstract)
small_seq_bwd_p = make_primitive("jaxcp_small_seq_bwd", _bwd_abstract)


def _move(x, dim, n):
  """[n, ...] with the vmapped axis first (broadcast when not mapped)."""
  if dim is compat.NOT_MAPPED:
    return jnp.broadcast_to(x, (n,) + x.shape)
  return jnp.moveaxis(x, dim, 0)


def _merge(x):
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _batching_rule(primitive, backward):
  start_arg = 5 if backward else 3

  def rule(args, dims, *, config):
    n = next(a.shape[d] for a, d in zip(args, dims) if d is not compat.NOT_MAPPED)
    moved = [_move(a, d, n) for a, d in zip(args, dims)]
    if config.ragged:  # copy i of the flat K/V lives at tokens [i*T, (i+1)*T)
      t = moved[1].shape[1]
      offsets = (jnp.arange(n, dtype=jnp.int32) * np.int32(t))[:, None]
      moved[start_arg] = moved[start_arg] + offsets
    outs = primitive.bind(*[_merge(a) for a in moved], config=config)
    outs = [o.reshape((n, o.shape[0] // n) + o.shape[1:]) for o in outs]
    return outs, [0] * len(outs)

  return rule


compat.batching.primitive_batchers[small_seq_fwd_p] = _batching_rule(small_seq_fwd_p, False)
compat.batching.primitive_batchers[small_seq_bwd_p] = _batching_rule(small_seq_bwd_p, True)
for _p in (small_seq_fwd_p, small_seq_bwd_p):
  compat.requires_devices_during_lowering(_p)  # its lowering runs custom_partitioning
