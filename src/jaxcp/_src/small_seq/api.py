"""Small-sequence attention: one query token per row attending to at most 16 key/value tokens.

`small_seq_attention` validates the user's layout (padded [B, S, Hkv, D] or ragged [T, Hkv, D])
and calls the primitives of primitive.py (partitioned by sharding.py), which see one flat layout.

The forward saves the softmax probabilities (float32 [B, Hq, max_len]); the backward consumes
them and never recomputes the scores.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import registry
from ..kernel_options import SmallSeqKernelOptions, check_options
from ..masks import allowed_pairs
from ..primitive_utils import CUDA_DTYPES, check_int_array, choose_implementation
from . import dispatch, sharding  # noqa: F401  (gives the primitives their partitioned lowering)
from .primitive import MAX_KV_LEN, SmallSeqConfig, default_index, small_seq_bwd_p, small_seq_fwd_p
from .one_key import one_key_attention
from .reference import small_seq_reference

_CUDA_HEAD_DIMS = (64, 128, 256, 512)
_CPU_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


# ---------------------------------------------------------------- differentiable kernel call


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _kernel_call(q, k, v, index, config):
  return small_seq_fwd_p.bind(q, k, v, *index, config=config)[0]


def _kernel_call_fwd(q, k, v, index, config):
  out, probs = small_seq_fwd_p.bind(q, k, v, *index, config=config)
  return out, (q, k, v, probs, index)


def _kernel_call_bwd(config, residuals, dout):
  q, k, v, probs, index = residuals
  dq, dk, dv = small_seq_bwd_p.bind(q, k, v, probs, dout.astype(q.dtype), *index, config=config)
  return dq, dk, dv, tuple(None for _ in index)


_kernel_call.defvjp(_kernel_call_fwd, _kernel_call_bwd)


# ---------------------------------------------------------------- validation and public API


def _check_scale(scale, head_dim) -> float:
  if scale is None:
    return float(head_dim) ** -0.5
  if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
    raise ValueError(f"scale must be None or a Python float, got {scale!r}.")
  return float(scale)


def _run(query, key, value, index, config, impl, auto=False):
  """The call on `impl`; auto (implementation=None) also takes the pure-JAX one-key path where it
  is the faster one on a GPU (dispatch.prefer_one_key_path)."""
  if impl == "xla":
    return small_seq_reference(query, key, value, index, config)[0]
  if auto and impl == "cuda" and dispatch.prefer_one_key_path(config.max_len):
    return one_key_attention(query, key, value, index, config)
  registry.ensure_registered()
  return _kernel_call(query, key, value, tuple(index), config)


def ragged_rows(cu, tokens: int):
  """(start, length) int32 [B] of the ragged rows [cu[b], cu[b+1]), for cu int32 [B+1].

  cu is clamped into [0, tokens]. A row whose end is below its start, and every row after it,
  is empty and starts where the last row before it ends. So each row ends at or before the next
  one's start: rows never overlap, and the CUDA backward, which zeroes the dK/dV tokens between a
  row's end and the next row's start, zeroes only tokens no row covers (each token's dK/dV is
  written once); nothing is read out of bounds. Valid (non-decreasing) cu_seqlens pass
  unchanged. One min-reduction finds the first decrease (a scan, cumsum or a running maximum,
  takes more kernels on a GPU: a few microseconds, as long as a whole call at B = 16384).
  """
  c = jnp.clip(cu, 0, tokens)
  start, end = c[:-1], c[1:]
  rows = jnp.arange(start.shape[0], dtype=jnp.int32)
  first_broken = jnp.min(jnp.where(end < start, rows, start.shape[0]), initial=start.shape[0])
  valid = rows < first_broken
  return jnp.where(valid, start, c[first_broken]), jnp.where(valid, end - start, 0)


def small_seq_attention(query, key, value, *, kv_lengths=None, kv_cu_seqlens=None, max_kv_len=None,
                        scale=None, implementation=None):
  """Attention of one query token per sequence over at most 16 key/value tokens.

  Two layouts:
  - padded: key/value [B, Skv, Hkv, D] with 1 <= Skv <= 16 and optional kv_lengths int32 [B]
    (row b attends to its first kv_lengths[b] tokens; None means Skv). Lengths outside
    [0, Skv] are clamped into it.
  - ragged: key/value [Tkv, Hkv, D] with kv_cu_seqlens int32 [B+1]: row b attends to tokens
    [cu[b], cu[b+1]). cu_seqlens is clamped into [0, Tkv]; from the first row whose end is
    below its start on, rows are empty (see `ragged_rows`). A row longer than max_kv_len
    tokens attends to its first max_kv_len (its other tokens get zero gradients).

  Rows with no token get output 0 and zero gradients. The forward saves the softmax
  probabilities (float32 [B, Hq, Skv]) for the backward, not the LSE.

  Args:
    query: [B, Hq, D]; Hq must be a multiple of Hkv (MHA, GQA, MQA).
    key, value: as above, same dtype as query (bfloat16, float16; float32 on the CPU).
    kv_lengths: padded layout only.
    kv_cu_seqlens: ragged layout only (required there).
    max_kv_len: ragged layout only: a Python int in [1, 16], the most tokens a row attends
      (default 16). The saved probabilities have this many columns and the kernels size their
      registers by it: pass the real bound when rows are short.
    scale: softmax scale, default D ** -0.5.
    implementation: None (the fastest for the device and shape: the CUDA kernels on a GPU, but
      a pure-JAX copy of V for rows of one key, see small_seq/one_key.py and
      small_seq/dispatch.py), "cuda" (head dims 64, 128, 256, 512;
      bf16/f16), "cpu" or "xla" (pure-JAX reference).

  Returns:
    out [B, Hq, D] in query's dtype.

  Sharding: under jit with NamedSharding inputs, the batch axis (padded layout) and the head axis
  (when Hq and Hkv both divide by its size) shard with no collective; otherwise they replicate.
  """
  return _small_seq_attention(query, key, value, kv_lengths=kv_lengths, kv_cu_seqlens=kv_cu_seqlens,
                              max_kv_len=max_kv_len, scale=scale, implementation=implementation,
                              kernel_options=SmallSeqKernelOptions())


def small_seq_attention_with_options(query, key, value, *, kernel_options: SmallSeqKernelOptions, **kwargs):
  """`jaxcp.small_seq_attention` (same keyword arguments) with CUDA kernels picked by
  `kernel_options` (private: tests and measurements; see kernel_options.py), e.g.
  ``kernel_options=SmallSeqKernelOptions(fwd="cuda_core")``."""
  return _small_seq_attention(query, key, value, kernel_options=check_options(kernel_options, SmallSeqKernelOptions),
                              **kwargs)


def _small_seq_attention(query, key, value, *, kv_lengths=None, kv_cu_seqlens=None, max_kv_len=None,
                         scale=None, implementation=None, kernel_options=SmallSeqKernelOptions()):
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
      raise ValueError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}.")
    if x.dtype not in _CPU_DTYPES:
      raise ValueError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}.")
  if query.ndim != 3:
    raise ValueError(f"query must have rank 3 [B, Hq, D] (one query token per sequence), got "
                     f"shape {query.shape}.")
  if not (query.dtype == key.dtype == value.dtype):
    raise ValueError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
                     f"{value.dtype}.")
  if key.shape != value.shape:
    raise ValueError(f"key and value must have the same shape, got {key.shape} and {value.shape}.")
  b, hq, d = query.shape
  if key.ndim == 4:
    if kv_cu_seqlens is not None:
      raise ValueError("kv_cu_seqlens is for the ragged layout (key/value [Tkv, Hkv, D]); with "
                       "padded key/value [B, Skv, Hkv, D] pass kv_lengths instead.")
    if max_kv_len is not None:
      raise ValueError("max_kv_len is for the ragged layout; padded key/value [B, Skv, Hkv, D] "
                       "attend to at most Skv tokens (pass kv_lengths for shorter rows).")
    if key.shape[0] != b:
      raise ValueError(f"key batch {key.shape[0]} != query batch {b}.")
    skv = key.shape[1]
    if not 1 <= skv <= MAX_KV_LEN:
      raise ValueError(f"key/value sequence length must be in [1, {MAX_KV_LEN}], got Skv={skv}; "
                       "use jaxcp.attention for longer sequences.")
    if kv_lengths is None:
      length = default_index()  # every row Skv long
    else:
      length = check_int_array("kv_lengths", kv_lengths, (b,))
    ragged, max_len = False, skv
  elif key.ndim == 3:
    if kv_cu_seqlens is None:
      raise ValueError("kv_cu_seqlens (int32 [B+1]) is required with ragged key/value "
                       "[Tkv, Hkv, D]; for the padded layout pass key/value [B, Skv, Hkv, D].")
    if kv_lengths is not None:
      raise ValueError("kv_lengths is for the padded layout; with ragged key/value pass only "
                       "kv_cu_seqlens.")
    t = key.shape[0]
    if t < 1:
      raise ValueError("key/value must hold at least one token (Tkv >= 1).")
    cu = check_int_array("kv_cu_seqlens", kv_cu_seqlens, (b + 1,))
    start, length = ragged_rows(cu, t)
    if max_kv_len is None:
      max_kv_len = MAX_KV_LEN
    elif isinstance(max_kv_len, bool) or not isinstance(max_kv_len, (int, np.integer)) or not (
        1 <= max_kv_len <= MAX_KV_LEN):
      raise ValueError(f"max_kv_len must be a Python int in [1, {MAX_KV_LEN}], got {max_kv_len!r}.")
    ragged, max_len = True, min(int(max_kv_len), t)
  else:
    raise ValueError(f"key must have rank 4 [B, Skv, Hkv, D] (padded) or rank 3 [Tkv, Hkv, D] "
                     f"(ragged, with kv_cu_seqlens), got shape {key.shape}.")
  hkv = key.shape[-2]
  if key.shape[-1] != d:
    raise ValueError(f"key head_dim {key.shape[-1]} != query head_dim {d}.")
  if hkv == 0 or hq % hkv:
    raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) "
                     "(MHA, GQA or MQA).")
  scale = _check_scale(scale, d)
  impl = choose_implementation(implementation, query.dtype, d, _CUDA_HEAD_DIMS)
  mask = default_index()  # every token
  index = (start, length, mask) if ragged else (length, mask)
  config = SmallSeqConfig(scale, max_len, ragged, kernel_options)
  return _run(query, key, value, index, config, impl, auto=implementation is None)


# ---------------------------------------------------------------- use from jaxcp.attention


def small_seq_eligible(query, key, *, implementation, return_residual=False,
                       context_parallel_axis=None) -> bool:
  """Whether `jaxcp.attention` may route a call to the small-sequence kernel.

  Contract (all static, decided at trace time):
    query [B, Sq, Hq, D], key [B, Skv, Hkv, D] (already validated by jaxcp.attention);
    implementation: the implementation jaxcp.attention resolved ("cuda", "cpu" or "xla").
  True iff Sq == 1, 1 <= Skv <= 16, implementation is "cuda" or "cpu" (the "xla" reference is
  left to jaxcp.attention), the CUDA kernel supports dtype and head dim, return_residual is
  False (this kernel saves probabilities, not the LSE) and context_parallel_axis is None (inside
  shard_map a sharded key sequence needs the context-parallel algorithms). Any mask is fine:
  segment ids, positions, causal, window and chunk rules become a per-row bitmask over the
  <= 16 keys; a row with no allowed key gives 0 and zero gradients, as in jaxcp.attention.
  Deterministic backward is always satisfied (no atomics).
  """
  if query.ndim != 4 or key.ndim != 4:
    return False
  if query.shape[1] != 1 or not 1 <= key.shape[1] <= MAX_KV_LEN:
    return False
  if return_residual or context_parallel_axis is not None:
    return False
  if implementation == "cpu":
    return query.dtype in _CPU_DTYPES
  if implementation == "cuda":
    return query.dtype in CUDA_DTYPES and query.shape[-1] in _CUDA_HEAD_DIMS
  return False


def small_seq_from_attention(query, key, value, q_seg, q_pos, kv_seg, kv_pos, spec, scale,
                             implementation, auto=False):
  """`jaxcp.attention` for an eligible call (see `small_seq_eligible`), differentiable.

  Args:
    query [B, 1, Hq, D], key/value [B, Skv, Hkv, D]: validated by jaxcp.attention.
    q_seg, q_pos [B, 1], kv_seg, kv_pos [B, Skv]: int32 token arrays from masks.token_arrays.
    spec: the MaskSpec; scale: Python float; implementation: "cuda" or "cpu"; auto: the caller
    passed implementation=None (the one-key path may run, see dispatch.prefer_one_key_path).
  Returns:
    out [B, 1, Hq, D] in query's dtype, equal to jaxcp.attention's output (rows without an
    allowed key give 0). Gradients flow to query, key and value.
  """
  b, _, hq, d = query.shape
  skv = key.shape[1]
  allowed = allowed_pairs(q_seg, q_pos, kv_seg, kv_pos, spec)[:, 0, :]  # [B, Skv]
  bits = jnp.left_shift(jnp.int32(1), jnp.arange(skv, dtype=jnp.int32))
  mask = jnp.sum(jnp.where(allowed, bits, 0), axis=1, dtype=jnp.int32)
  config = SmallSeqConfig(float(scale), skv, False)
  length = default_index()  # every row Skv long
  out = _run(query.reshape(b, hq, d), key, value, (length, mask), config, implementation, auto)
  return out.reshape(b, 1, hq, d)
