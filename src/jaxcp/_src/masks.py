"""Turns the user's mask arguments into per-token (segment id, position) arrays.

Rules (the mask model in README.md): segment 0 is padding; positions default to restarting at 0
per contiguous document, or to bottom-right aligned aranges when there are no segments.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .mask_spec import MaskSpec
from .primitive_utils import check_int_array


def positions_from_segments(segment_ids):
  """Position of each token inside its contiguous run of equal segment ids: [B, S] int32."""
  s = segment_ids.shape[-1]
  idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), segment_ids.shape)
  prev = jnp.concatenate([segment_ids[..., :1] - 1, segment_ids[..., :-1]], axis=-1)
  run_start = jnp.where(segment_ids != prev, idx, 0)
  return idx - jax.lax.cummax(run_start, axis=segment_ids.ndim - 1)


def segments_from_cu_seqlens(cu_seqlens, seq_len: int):
  """Segment ids and positions [B, seq_len] int32 from cu_seqlens [B, MAX_DOCS+1].

  Row b = [0, e1, ..., en, ...]: document i spans [cu[i], cu[i+1]); repeated values are
  zero-length documents; tokens at or after cu[-1] (and before cu[0]) are padding (segment 0).
  Document i gets segment id i + 1. Out-of-range values are clamped into [0, seq_len] and
  made non-decreasing (a running maximum), so nothing is read or written out of bounds.
  """
  cu = jnp.asarray(cu_seqlens)
  if cu.ndim != 2 or cu.shape[1] < 2:
    raise ValueError(f"cu_seqlens must have shape [B, MAX_DOCS+1] with MAX_DOCS >= 1, got {cu.shape}.")
  if not jnp.issubdtype(cu.dtype, jnp.integer):
    raise ValueError(f"cu_seqlens must be an integer array (int32), got dtype {cu.dtype}.")
  if not isinstance(seq_len, (int, np.integer)) or seq_len < 0:
    raise ValueError(f"seq_len must be a non-negative int, got {seq_len!r}.")
  cu = jax.lax.cummax(jnp.clip(cu.astype(jnp.int32), 0, seq_len), axis=1)
  t = jnp.arange(seq_len, dtype=jnp.int32)[None, :, None]
  # Elementwise compare-and-reduce (XLA fuses it; nothing of size S*M is stored), which also
  # keeps it free of gathers and scatters under explicitly sharded meshes.
  ended = cu[:, None, 1:] <= t                              # [B, S, M]
  doc = jnp.sum(ended, axis=-1, dtype=jnp.int32)            # documents ended at or before t
  start = jnp.max(jnp.where(cu[:, None, :] <= t, cu[:, None, :], 0), axis=-1)
  t = t[..., 0]
  inside = (t >= cu[:, :1]) & (t < cu[:, -1:])
  segment_ids = jnp.where(inside, doc + 1, 0).astype(jnp.int32)
  positions = jnp.where(inside, t - start, 0).astype(jnp.int32)
  return segment_ids, positions


def normalize_window(local_window_size):
  if local_window_size is None:
    return -1, -1
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
    left = right = int(local_window_size)
  elif isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2:
    left, right = local_window_size
    if not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in (left, right)):
      raise ValueError(f"local_window_size must hold two ints (left, right), got {local_window_size!r}.")
    left, right = int(left), int(right)
  else:
    raise ValueError(
        f"local_window_size must be None, an int w, or a pair (left, right), got {local_window_size!r}.")
  if left < 0 or right < 0:
    raise ValueError(f"local_window_size entries must be >= 0, got {(left, right)}.")
  return left, right


def make_mask_spec(is_causal, local_window_size, chunk_size) -> MaskSpec:
  if not isinstance(is_causal, (bool, np.bool_)):
    raise ValueError(f"is_causal must be a bool, got {is_causal!r}.")
  left, right = normalize_window(local_window_size)
  if chunk_size is None:
    chunk = 0
  elif isinstance(chunk_size, (int, np.integer)) and not isinstance(chunk_size, bool) and chunk_size > 0:
    chunk = int(chunk_size)
  else:
    raise ValueError(f"chunk_size must be None or an int > 0, got {chunk_size!r}.")
  return MaskSpec(bool(is_causal), left, right, chunk)


def token_arrays(batch, q_len, kv_len, *, segment_ids, positions, kv_segment_ids, kv_positions,
                 cu_seqlens):
  """Returns int32 (q_seg, q_pos, kv_seg, kv_pos) following jaxcp.attention's defaults.

  In self attention (Sq == Skv, no kv_segment_ids) the key side mirrors the query side: kv
  segment ids default to segment_ids and kv positions to `positions` when those are given, so a
  load-balanced (permuted) row needs only segment_ids and positions.
  """
  segment_ids = None if segment_ids is None else check_int_array("segment_ids", segment_ids, (batch, q_len))
  kv_segment_ids = None if kv_segment_ids is None else check_int_array("kv_segment_ids", kv_segment_ids, (batch, kv_len))
  positions = None if positions is None else check_int_array("positions", positions, (batch, q_len))
  kv_positions = None if kv_positions is None else check_int_array("kv_positions", kv_positions, (batch, kv_len))

  q_pos_default = kv_pos_default = None
  if cu_seqlens is not None:
    if segment_ids is not None or kv_segment_ids is not None:
      raise ValueError("Pass either cu_seqlens or segment_ids/kv_segment_ids, not both.")
    if q_len != kv_len:
      raise ValueError(
          f"cu_seqlens describes self attention and needs Sq == Skv (got {q_len} and {kv_len}); "
          "use segment_ids and kv_segment_ids for cross attention.")
    cu = jnp.asarray(cu_seqlens)
    if cu.ndim != 2 or cu.shape[0] != batch:
      raise ValueError(f"cu_seqlens must have shape [B={batch}, MAX_DOCS+1], got {tuple(cu.shape)}.")
    segment_ids, q_pos_default = segments_from_cu_seqlens(cu, q_len)
    kv_segment_ids, kv_pos_default = segment_ids, q_pos_default

  if segment_ids is None:
    q_seg = jnp.ones((batch, q_len), jnp.int32)
  else:
    q_seg = segment_ids
  if kv_segment_ids is None:
    if segment_ids is not None:
      if q_len != kv_len:
        raise ValueError(
            f"kv_segment_ids is required when segment_ids is given and Sq != Skv ({q_len} != {kv_len}).")
      kv_seg = segment_ids
    else:
      kv_seg = jnp.ones((batch, kv_len), jnp.int32)
  else:
    kv_seg = kv_segment_ids

  if positions is not None:
    q_pos = positions
  elif q_pos_default is not None:
    q_pos = q_pos_default
  elif segment_ids is not None:
    q_pos = positions_from_segments(q_seg)
  else:  # no documents: bottom-right alignment of the query block against the keys
    q_pos = jnp.broadcast_to(jnp.arange(q_len, dtype=jnp.int32) + (kv_len - q_len), (batch, q_len))

  self_attention = kv_segment_ids is None and cu_seqlens is None and q_len == kv_len
  if kv_positions is not None:
    kv_pos = kv_positions
  elif self_attention and positions is not None:
    kv_pos = q_pos  # self attention: the key side mirrors the query side (e.g. permuted rows)
  elif kv_pos_default is not None:
    kv_pos = kv_pos_default
  elif kv_segment_ids is not None or segment_ids is not None:
    kv_pos = positions_from_segments(kv_seg)
  else:
    kv_pos = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (batch, kv_len))
  return q_seg, q_pos, kv_seg, kv_pos


def allowed_pairs(q_seg, q_pos, kv_seg, kv_pos, spec: MaskSpec):
  """Boolean [B, Sq, Skv]: the mask model (README.md, "The mask model")."""
  qs, ks = q_seg[:, :, None], kv_seg[:, None, :]
  mask = (qs == ks) & (qs != 0)
  d = q_pos[:, :, None] - kv_pos[:, None, :]
  if spec.is_causal:
    mask &= d >= 0
  if spec.window_left >= 0:
    mask &= d <= spec.window_left
  if spec.window_right >= 0:
    mask &= -d <= spec.window_right
  if spec.chunk_size > 0:
    mask &= jnp.floor_divide(q_pos[:, :, None], spec.chunk_size) == jnp.floor_divide(kv_pos[:, None, :], spec.chunk_size)
  return mask
