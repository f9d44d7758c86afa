"""``attention_fn`` replacements for ``flax.linen.MultiHeadDotProductAttention`` / ``flax.nnx.MultiHeadAttention``.

Flax's attention modules call ``attention_fn(query, key, value, mask=..., dropout_rng=...,
dropout_rate=..., broadcast_dropout=..., deterministic=..., dtype=..., precision=..., module=...)``
(nnx also passes ``is_causal=``; linen only passes the keywords that the function names), with
``query [batch..., Sq, H, D]`` and ``key``/``value [batch..., Skv, Hkv, D]``. jaxcp's mask comes from
per-token segment ids and positions instead of a dense mask, so they reach the function either
through :func:`make_attention_fn` (closure) or through the :func:`document_layout` context.
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import jax.numpy as jnp

import jaxcp

__all__ = ["make_attention_fn", "document_layout"]

_TOKEN_KEYS = ("segment_ids", "positions", "kv_segment_ids", "kv_positions", "cu_seqlens")
_LAYOUT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jaxcp_flax_layout", default=None)

# Keywords that flax versions pass and that jaxcp honours by ignoring them.
_IGNORED_KWARGS = ("broadcast_dropout", "precision", "force_fp32_for_softmax", "promote_dtype")


@contextlib.contextmanager
def document_layout(*, segment_ids=None, positions=None, kv_segment_ids=None, kv_positions=None,
                    cu_seqlens=None):
  """Context that supplies per-token arrays to attention functions from :func:`make_attention_fn`.

  Useful when the Flax module is built once (nnx) and the packing changes every batch::

      mha = nnx.MultiHeadAttention(..., attention_fn=jaxcp.flax.make_attention_fn(is_causal=True))
      with jaxcp.flax.document_layout(segment_ids=seg, positions=pos):
        y = mha(x)

  Use it inside the traced (jitted) function. Arrays given to :func:`make_attention_fn` take
  precedence over the context. Arguments have the meaning of ``jaxcp.attention``'s; for inputs
  with several batch dimensions, their shape is ``[batch..., S]``.
  """
  layout = dict(segment_ids=segment_ids, positions=positions, kv_segment_ids=kv_segment_ids,
                kv_positions=kv_positions, cu_seqlens=cu_seqlens)
  token = _LAYOUT.set(layout)
  try:
    yield layout
  finally:
    _LAYOUT.reset(token)


def _flatten_batch(x, n_lead):
  """[batch..., rest...] -> [prod(batch), rest...] (adds a batch of 1 when there is none)."""
  if x is None:
    return None
  x = jnp.asarray(x)
  return x.reshape((math.prod(x.shape[:n_lead]),) + x.shape[n_lead:])


def make_attention_fn(*, segment_ids=None, positions=None, kv_segment_ids=None, kv_positions=None,
                      cu_seqlens=None, is_causal=False, local_window_size=None, chunk_size=None,
                      scale=None, context_parallel="auto", context_parallel_axis=None,
                      implementation=None, deterministic=False):
  """Returns an ``attention_fn`` for Flax attention modules that runs ``jaxcp.attention``.

  Drop-in for ``flax.linen.MultiHeadDotProductAttention(attention_fn=...)`` and
  ``flax.nnx.MultiHeadAttention(attention_fn=...)`` (GQA included: nnx's ``num_kv_heads``).
  All keyword arguments have the meaning of ``jaxcp.attention``'s; token
  arrays not given here are taken from an enclosing :func:`document_layout` context, else the
  defaults of ``jaxcp.attention`` apply (one document per row). For linen, build the module inside
  the ``@nn.compact`` method so the closure sees this batch's arrays::

      attn = nn.MultiHeadDotProductAttention(
          num_heads=8, attention_fn=jaxcp.flax.make_attention_fn(
              segment_ids=seg, positions=pos, is_causal=True))
      y = attn(x)

  ``is_causal`` is OR-ed with the ``is_causal=`` that nnx passes per call. ``deterministic`` here
  is jaxcp's (bitwise reproducible backward); Flax's own ``deterministic`` call keyword only
  concerns dropout.

  The returned function raises ``ValueError`` for what jaxcp cannot honour: a dense ``mask`` or
  ``bias`` (use segment ids / positions / is_causal / local_window_size / chunk_size instead; this
  also rules out Flax's ``decode=True`` cache, which builds a mask), attention dropout
  (``dropout_rate > 0`` while not deterministic), ``sow_weights`` (``module=``: no attention
  weights are materialised) and custom einsum overrides. ``precision`` and
  ``broadcast_dropout`` are ignored; ``dtype`` casts query, key and value before the call
  (otherwise they are promoted to a common dtype).

  Returns:
    ``attention_fn(query, key, value, bias=None, mask=None, ..., **kwargs)`` returning
    ``[batch..., Sq, H, D]``.
  """
  if not isinstance(is_causal, bool):
    raise ValueError(f"is_causal must be a bool, got {is_causal!r}.")
  fixed = dict(segment_ids=segment_ids, positions=positions, kv_segment_ids=kv_segment_ids,
               kv_positions=kv_positions, cu_seqlens=cu_seqlens)
  jaxcp_deterministic = deterministic
  factory_causal = is_causal

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                   dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                   is_causal=False, force_fp32_for_softmax=False, qk_attn_weights_einsum=None,
                   attn_weights_value_einsum=None, **kwargs):
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    if mask is not None:
      raise ValueError(
          "jaxcp attention_fn got a dense `mask`, which it cannot honour: jaxcp builds the mask "
          "from per-token segment ids and positions. Pass segment_ids= / positions= / is_causal= / "
          "local_window_size= / chunk_size= to jaxcp.flax.make_attention_fn (or use "
          "jaxcp.flax.document_layout) and call the module without mask= (Flax's decode=True "
          "cache also builds a mask and is not supported).")
    if bias is not None:
      raise ValueError("jaxcp attention_fn cannot honour an additive attention `bias`; "
                       "remove bias= (jaxcp supports segment/position based masks only).")
    if dropout_rate and not deterministic:
      raise ValueError(
          f"jaxcp attention_fn cannot apply attention dropout (dropout_rate={dropout_rate}); "
          "set dropout_rate=0.0 on the Flax attention module or call it with deterministic=True.")
    if module is not None:
      raise ValueError("jaxcp attention_fn cannot sow attention weights (sow_weights=True): the "
                       "kernels never materialise the attention matrix; call with sow_weights=False.")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
      raise ValueError("jaxcp attention_fn does not support custom einsum overrides "
                       "(qk_attn_weights_einsum / attn_weights_value_einsum).")
    for name, val in kwargs.items():
      if name in _IGNORED_KWARGS or val is None or val is False:
        continue
      raise ValueError(f"jaxcp attention_fn got an unsupported keyword argument {name}={val!r}.")
    if not isinstance(is_causal, bool):
      raise ValueError(f"is_causal must be a bool, got {is_causal!r}.")

    if dtype is not None:
      query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    else:
      common = jnp.result_type(query, key, value)
      query, key, value = (jnp.asarray(x, common) for x in (query, key, value))
    for name, x in (("query", query), ("key", key), ("value", value)):
      if x.ndim < 3:
        raise ValueError(f"{name} must have shape [batch..., length, heads, head_dim], got {x.shape}.")
    if query.ndim != key.ndim or key.shape[:-1] != value.shape[:-1]:
      raise ValueError(f"query, key and value must have matching ranks and key/value equal shapes but for "
                       f"the head dim, got {query.shape}, {key.shape}, {value.shape}.")
    if query.shape[:-3] != key.shape[:-3]:
      raise ValueError(f"query and key batch dims differ: {query.shape[:-3]} vs {key.shape[:-3]}.")

    context = _LAYOUT.get() or {}
    arrays = {k: fixed[k] if fixed[k] is not None else context.get(k) for k in _TOKEN_KEYS}
    n_lead = query.ndim - 3
    batch_shape = query.shape[:n_lead]
    if n_lead == 0:  # unbatched: [S, H, D]
      query, key, value = query[None], key[None], value[None]
      arrays = {k: None if a is None else jnp.asarray(a)[None] for k, a in arrays.items()}
      n_lead = 1
    q4 = _flatten_batch(query, n_lead)
    k4 = _flatten_batch(key, n_lead)
    v4 = _flatten_batch(value, n_lead)
    arrays = {k: _flatten_batch(a, n_lead) for k, a in arrays.items()}
    out = jaxcp.attention(
        q4, k4, v4, **arrays, is_causal=bool(factory_causal or is_causal),
        local_window_size=local_window_size, chunk_size=chunk_size, scale=scale,
        context_parallel=context_parallel, context_parallel_axis=context_parallel_axis,
        implementation=implementation, deterministic=jaxcp_deterministic)
    return out.reshape(batch_shape + out.shape[1:])

  return attention_fn
