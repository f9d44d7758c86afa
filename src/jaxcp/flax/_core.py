"""Framework-free pieces shared by the linen and nnx modules: positions, RoPE, self-attention core.

Everything here is built on the public jaxcp API only (``jaxcp.attention`` and
``jaxcp.segments_from_cu_seqlens``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxcp

__all__ = ["positions_from_segment_ids", "apply_rope", "resolve_token_arrays", "self_attention_core"]


def positions_from_segment_ids(segment_ids):
  """Position of every token inside its document, for contiguous documents.

  A document is a run of equal segment ids; positions restart at 0 at the start of each run
  (the same rule ``jaxcp.attention`` uses when ``positions`` is None). Compute positions with
  this (or take them from the packer) *before* permuting tokens with ``jaxcp.load_balance``:
  after a permutation, documents are no longer contiguous runs.

  Args:
    segment_ids: integer array ``[..., S]``.

  Returns:
    int32 array of the same shape.
  """
  segment_ids = jnp.asarray(segment_ids)
  if segment_ids.ndim < 1 or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids must be an integer array [..., S], got shape {segment_ids.shape} "
                     f"and dtype {segment_ids.dtype}.")
  s = segment_ids.shape[-1]
  idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), segment_ids.shape)
  prev = jnp.concatenate([segment_ids[..., :1] - 1, segment_ids[..., :-1]], axis=-1)
  run_start = jnp.where(segment_ids != prev, idx, 0)
  return (idx - jax.lax.cummax(run_start, axis=segment_ids.ndim - 1)).astype(jnp.int32)


def apply_rope(x, positions, *, theta: float = 10000.0):
  """Rotary position embedding (rotate-half / Llama convention) from explicit positions.

  Because the phase comes from ``positions`` and not from where a token sits in memory, packed
  documents (positions restart per document) and permuted (load-balanced) rows get the right
  rotation.

  Args:
    x: ``[B, S, H, D]`` queries or keys, ``D`` even.
    positions: integer ``[B, S]`` positions inside each document.
    theta: RoPE base (wavelength scale).

  Returns:
    ``x`` rotated, same shape and dtype (computed in float32).
  """
  if x.ndim != 4:
    raise ValueError(f"apply_rope expects x of shape [B, S, H, D], got {x.shape}.")
  d = x.shape[-1]
  if d % 2:
    raise ValueError(f"apply_rope needs an even head dimension, got head_dim={d}.")
  positions = jnp.asarray(positions)
  if positions.shape != x.shape[:2]:
    raise ValueError(f"positions must have shape {x.shape[:2]} (batch, seq), got {positions.shape}.")
  half = d // 2
  inv_freq = 1.0 / (float(theta) ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / d))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, half]
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., :half], xf[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def resolve_token_arrays(batch: int, seq_len: int, segment_ids=None, positions=None, cu_seqlens=None):
  """Per-token ``(segment_ids, positions)`` int32 ``[B, S]`` for self attention.

  ``cu_seqlens`` (exclusive with ``segment_ids``) is converted with
  ``jaxcp.segments_from_cu_seqlens``; missing positions are derived from contiguous segment runs
  (or ``arange(S)`` without segments); missing segment ids are all ones (one document per row).
  """
  if cu_seqlens is not None:
    if segment_ids is not None:
      raise ValueError("Pass either segment_ids or cu_seqlens, not both.")
    segment_ids, cu_positions = jaxcp.segments_from_cu_seqlens(jnp.asarray(cu_seqlens), seq_len)
    if positions is None:
      positions = cu_positions
  for name, arr in (("segment_ids", segment_ids), ("positions", positions)):
    if arr is not None and tuple(jnp.shape(arr)) != (batch, seq_len):
      raise ValueError(f"{name} must have shape {(batch, seq_len)} (batch, seq), got {tuple(jnp.shape(arr))}.")
  if positions is None:
    if segment_ids is None:
      positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    else:
      positions = positions_from_segment_ids(segment_ids)
  if segment_ids is None:
    segment_ids = jnp.ones((batch, seq_len), jnp.int32)
  return jnp.asarray(segment_ids).astype(jnp.int32), jnp.asarray(positions).astype(jnp.int32)


def self_attention_core(q, k, v, *, segment_ids, positions, rope_theta, is_causal, local_window_size,
                        chunk_size, scale, context_parallel, context_parallel_axis, implementation,
                        deterministic):
  """RoPE on q and k from ``positions`` and ``jaxcp.attention`` with explicit per-token arrays."""
  if rope_theta is not None:
    q = apply_rope(q, positions, theta=rope_theta)
    k = apply_rope(k, positions, theta=rope_theta)
  return jaxcp.attention(
      q, k, v, segment_ids=segment_ids, positions=positions, kv_segment_ids=segment_ids,
      kv_positions=positions, is_causal=is_causal, local_window_size=local_window_size,
      chunk_size=chunk_size, scale=scale, context_parallel=context_parallel,
      context_parallel_axis=context_parallel_axis, implementation=implementation,
      deterministic=deterministic)


def check_heads(num_heads, num_kv_heads, head_dim, features):
  """Validated ``(num_heads, num_kv_heads, head_dim)`` for the SelfAttention modules."""
  for name, val in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
    if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
      raise ValueError(f"{name} must be a positive int, got {val!r}.")
  num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) "
                     "(MHA, GQA or MQA).")
  if head_dim is None:
    if features % num_heads:
      raise ValueError(f"features ({features}) must be divisible by num_heads ({num_heads}), "
                       "or pass head_dim explicitly.")
    head_dim = features // num_heads
  return num_heads, num_kv_heads, head_dim
