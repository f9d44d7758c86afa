"""`jaxcp.attention`: argument checking, implementation choice and the custom VJP."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .. import compat, cuda_capabilities, masks, registry
from ..kernel_options import AttentionKernelOptions, check_options
from ..primitive_utils import choose_implementation
from ..small_seq.api import small_seq_eligible, small_seq_from_attention
from . import context_parallel as cp_lib
from . import sharding  # noqa: F401  (gives the primitives their partitioned lowering)
from .primitive import AttentionConfig, attention_bwd_p, attention_fwd_p
from .reference import attention_reference

# Any head dim up to 256 runs on the CUDA kernels: one they have no tiles for is zero-padded to the
# next they do (zero columns change neither q.k nor p.v, and their gradients are sliced off).
_CUDA_ANY_HEAD_DIM = range(1, cuda_capabilities.CUDA_KERNEL_HEAD_DIMS[-1] + 1)
_CPU_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


# ---------------------------------------------------------------- differentiable kernel call


def _cp_inside_shard_map(config, k, q):
  """Strategy, axis and size for an explicit context_parallel_axis (inside jax.shard_map)."""
  axis = config.context_parallel_axis
  cp_size = compat.axis_size(axis)
  strategy = cp_lib.choose_strategy(config.context_parallel, cp_size, q.shape[1], k.shape[1],
                                    q.shape[2], k.shape[2])
  # The per-shard kernel calls inside run no context parallelism of their own.
  inner = dataclasses.replace(config, context_parallel_axis=None, context_parallel="all_gather")
  return strategy, axis, cp_size, inner


def _forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, config):
  """(out, lse, kept): kept, what a DocumentPlacement's forward gathered for the backward, or ()."""
  if config.context_parallel_axis is None:
    out, lse, *kept = attention_fwd_p.bind(q, k, v, q_seg, q_pos, kv_seg, kv_pos, config=config)
    return out, lse, tuple(kept)
  strategy, axis, cp_size, inner = _cp_inside_shard_map(config, k, q)
  local = lambda *a: tuple(attention_fwd_p.bind(*a, config=inner))
  return cp_lib.cp_fwd(strategy, local, axis, cp_size, q, k, v, q_seg, q_pos, kv_seg, kv_pos)


def _backward(q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos, kept, config):
  args = (q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos)
  if config.context_parallel_axis is None:
    return tuple(attention_bwd_p.bind(*args, *kept, config=config))
  strategy, axis, cp_size, inner = _cp_inside_shard_map(config, k, q)
  local = lambda *a: tuple(attention_bwd_p.bind(*a, config=inner))
  return cp_lib.cp_bwd(strategy, local, axis, cp_size, *args, kept=kept)


# widths: ((head dim, value head dim) of the forward kernels, (the same) of the backward's), from
# _kernel_head_dims. Q and K are padded to the head dim around each kernel call, V (and O, dO) to
# the value head dim, and the results sliced back.
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _kernel_attention(q, k, v, q_seg, q_pos, kv_seg, kv_pos, config, widths):
  return _padded_forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, config, widths[0])[:2]


def _padded_forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, config, width):
  """(out, lse, kept) of _forward around head dims padded to `width`; kept K/V stay padded."""
  w, wv = width
  out, lse, kept = _forward(_pad_head_dim(q, w), _pad_head_dim(k, w), _pad_head_dim(v, wv), q_seg, q_pos, kv_seg,
                            kv_pos, config)
  return _slice_head_dim(out, v.shape[-1]), lse, kept


def _kernel_attention_fwd(q, k, v, q_seg, q_pos, kv_seg, kv_pos, config, widths):
  out, lse, kept = _padded_forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, config, widths[0])
  # Named residuals: a remat policy that saves these two skips rerunning the forward kernel.
  out = checkpoint_name(out, "jaxcp_attention_out")
  lse = checkpoint_name(lse, "jaxcp_attention_lse")
  kept = tuple(checkpoint_name(x, "jaxcp_attention_gathered") for x in kept)
  return (out, lse), (q, k, v, q_seg, q_pos, kv_seg, kv_pos, out, lse, kept)


def _kernel_attention_bwd(config, widths, residuals, cotangents):
  q, k, v, q_seg, q_pos, kv_seg, kv_pos, out, lse, kept = residuals
  dout, dlse = cotangents
  # O's padded columns are zeros (those of V are), so O re-padded is the kernel's O.
  w, wv = widths[1]
  qp, kp = (_pad_head_dim(x, w) for x in (q, k))
  vp, outp, doutp = (_pad_head_dim(x, wv) for x in (v, out, dout.astype(out.dtype)))
  if kept:  # padded for the forward's kernels: re-padded for the backward's
    kept = (_pad_head_dim(_slice_head_dim(kept[0], k.shape[-1]), w),
            _pad_head_dim(_slice_head_dim(kept[1], v.shape[-1]), wv), *kept[2:])
  dq, dk, dv = _backward(qp, kp, vp, outp, lse, doutp, dlse.astype(jnp.float32), q_seg, q_pos, kv_seg, kv_pos,
                         kept, config)
  dq, dk, dv = (_slice_head_dim(g, x.shape[-1]) for g, x in ((dq, q), (dk, k), (dv, v)))
  return dq, dk, dv, None, None, None, None


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)


def _kernel_head_dims(impl, d, dv, config):
  """((head dim, value head dim) of the forward kernels, (the same) of the backward's) for head
  dims d and dv: themselves on the CPU; on CUDA the next that the kernels chosen for this device
  and config.kernel have tiles for (cuda_capabilities.cuda_kernel_head_dims)."""
  if impl != "cuda":
    return (d, dv), (d, dv)
  return tuple(cuda_capabilities.cuda_kernel_head_dims(direction, d, dv, config.scale, config.deterministic,
                                                       config.kernel)
               for direction in ("fwd", "bwd"))


def _pad_head_dim(x, width):
  d = x.shape[-1]
  return x if d == width else jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, width - d),))


def _slice_head_dim(x, d):
  return x if x.shape[-1] == d else x[..., :d]


# ---------------------------------------------------------------- validation


def _check_qkv(query, key, value):
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "ndim") or x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 [B, S, H, D], got shape {getattr(x, 'shape', None)}.")
    if x.dtype not in _CPU_DTYPES:
      raise ValueError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}.")
  if not (query.dtype == key.dtype == value.dtype):
    raise ValueError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}.")
  b, _, hq, d = query.shape
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(f"key and value must have the same shape [B, Skv, Hkv] (their head dims may differ), "
                     f"got {key.shape} and {value.shape}.")
  if key.shape[0] != b:
    raise ValueError(f"key batch {key.shape[0]} != query batch {b}.")
  if key.shape[3] != d:
    raise ValueError(f"key head_dim {key.shape[3]} != query head_dim {d}.")
  hkv = key.shape[2]
  if hkv == 0 or hq % hkv:
    raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) (MHA, GQA or MQA).")


# ---------------------------------------------------------------- public API


def attention(query, key, value, *, segment_ids=None, positions=None, kv_segment_ids=None,
              kv_positions=None, cu_seqlens=None, is_causal=False, local_window_size=None,
              chunk_size=None, scale=None, context_parallel="auto", context_parallel_axis=None,
              implementation=None, deterministic=False, return_residual=False):
  """Packed-document attention (the mask model: README, "The mask model").

  A query token i and key token j interact iff they share a non-zero segment id and their
  positions satisfy the causal / window / chunk rules. Rows with no allowed key give output 0
  (and LSE -inf) with zero gradients.

  Args:
    query: [B, Sq, Hq, D]. key: [B, Skv, Hkv, D] with Hq % Hkv == 0. value: [B, Skv, Hkv, Dv]; Dv
      may differ from D (multi-head latent attention), else Dv = D.
    segment_ids, kv_segment_ids: int32 [B, Sq] / [B, Skv]; 0 marks padding.
    positions, kv_positions: int32 positions inside each document (restart at 0 per document).
    cu_seqlens: int32 [B, MAX_DOCS+1], an alternative to segment_ids for self attention.
    is_causal, local_window_size (w or (left, right)), chunk_size: the mask rules.
    scale: softmax scale, default D ** -0.5.
    context_parallel: strategy for a sharded sequence axis: "auto", "all_gather", "ring", or the
      jaxcp.DocumentPlacement that load_balance_permutation laid the rows out with.
    context_parallel_axis: the mesh axis of the sequence inside jax.shard_map (None under jit).
    implementation: None (best available), "cuda", "cpu" or "xla" (pure-JAX reference).
    deterministic: bitwise reproducible backward.
    return_residual: also return the LSE, float32 [B, Hq, Sq].

  Returns:
    out [B, Sq, Hq, Dv] in query's dtype, or (out, lse) with return_residual=True.
  """
  return _attention(query, key, value, segment_ids=segment_ids, positions=positions, kv_segment_ids=kv_segment_ids,
                    kv_positions=kv_positions, cu_seqlens=cu_seqlens, is_causal=is_causal,
                    local_window_size=local_window_size, chunk_size=chunk_size, scale=scale,
                    context_parallel=context_parallel, context_parallel_axis=context_parallel_axis,
                    implementation=implementation, deterministic=deterministic, return_residual=return_residual,
                    kernel_options=AttentionKernelOptions())


def attention_with_options(query, key, value, *, kernel_options: AttentionKernelOptions, **kwargs):
  """`jaxcp.attention` (same keyword arguments) with CUDA kernels picked by `kernel_options`
  (private: tests and measurements; see kernel_options.py). E.g. the sm_80 kernels on Hopper:
  ``attention_with_options(q, k, v, is_causal=True, kernel_options=AttentionKernelOptions(sm80_only=True))``.
  Calls routed to the small-sequence kernel (one query, at most 16 keys) keep its default kernels."""
  return _attention(query, key, value, kernel_options=check_options(kernel_options, AttentionKernelOptions), **kwargs)


def _attention(query, key, value, *, segment_ids=None, positions=None, kv_segment_ids=None,
               kv_positions=None, cu_seqlens=None, is_causal=False, local_window_size=None,
               chunk_size=None, scale=None, context_parallel="auto", context_parallel_axis=None,
               implementation=None, deterministic=False, return_residual=False,
               kernel_options=AttentionKernelOptions()):
  _check_qkv(query, key, value)
  b, sq, hq, d = query.shape
  dv = value.shape[3]
  skv = key.shape[1]
  spec = masks.make_mask_spec(is_causal, local_window_size, chunk_size)
  if scale is None:
    scale = d ** -0.5
  elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
    raise ValueError(f"scale must be None or a Python float, got {scale!r}.")
  cp_lib.check_strategy(context_parallel)
  if isinstance(context_parallel, cp_lib.DocumentPlacement) and sq != skv:
    raise ValueError(f"context_parallel=DocumentPlacement(...) lays out the tokens of one row for self attention "
                     f"(Sq == Skv), got Sq={sq} and Skv={skv}; use context_parallel='all_gather' or 'ring'.")
  if context_parallel_axis is not None and not isinstance(context_parallel_axis, str):
    raise ValueError(f"context_parallel_axis must be a mesh axis name (str) or None, got {context_parallel_axis!r}.")
  if not isinstance(deterministic, bool):
    raise ValueError(f"deterministic must be a bool, got {deterministic!r}.")
  q_seg, q_pos, kv_seg, kv_pos = masks.token_arrays(
      b, sq, skv, segment_ids=segment_ids, positions=positions, kv_segment_ids=kv_segment_ids,
      kv_positions=kv_positions, cu_seqlens=cu_seqlens)
  impl = choose_implementation(implementation, query.dtype, max(d, dv), _CUDA_ANY_HEAD_DIM)
  # One query against at most 16 keys: the memory-bound small-sequence kernel (same results).
  if impl != "xla" and dv == d and small_seq_eligible(
      query, key, implementation=impl, return_residual=return_residual, context_parallel_axis=context_parallel_axis):
    return small_seq_from_attention(query, key, value, q_seg, q_pos, kv_seg, kv_pos, spec, float(scale), impl,
                                    auto=implementation is None)

  if impl == "xla":
    if context_parallel_axis is not None:  # inside shard_map: the reference sees all of K/V
      gather = lambda x: jax.lax.all_gather(x, context_parallel_axis, axis=1, tiled=True)
      key, value, kv_seg, kv_pos = (gather(x) for x in (key, value, kv_seg, kv_pos))
    out, lse = attention_reference(query, key, value, q_seg, q_pos, kv_seg, kv_pos, spec, float(scale))
  else:
    registry.ensure_registered()
    config = AttentionConfig(spec, float(scale), deterministic, context_parallel, context_parallel_axis,
                             kernel_options)
    widths = _kernel_head_dims(impl, d, dv, config)
    out, lse = _kernel_attention(query, key, value, q_seg, q_pos, kv_seg, kv_pos, config, widths)
  return (out, lse) if return_residual else out
