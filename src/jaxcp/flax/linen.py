"""Flax linen modules built on ``jaxcp.attention``."""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from ._attention_fn import document_layout, make_attention_fn
from ._core import check_heads, resolve_token_arrays, self_attention_core

__all__ = ["SelfAttention", "make_attention_fn", "document_layout"]


class SelfAttention(nn.Module):
  """Packed-document self attention (linen): q/k/v projections, RoPE, ``jaxcp.attention``, output.

  GQA/MQA through ``num_kv_heads``; rotary embeddings use the given per-token ``positions`` (so
  packed documents and load-balanced / permuted rows get correct phases); documents are
  isolated through ``segment_ids`` (or ``cu_seqlens``); optional sliding window and chunked
  attention. Parameters: ``query`` ``[F, H, Dh]``, ``key``/``value`` ``[F, Hkv, Dh]``,
  ``out`` ``[H, Dh, F_out]`` kernels (plus biases with ``use_bias``); shard the head axes for
  tensor parallelism.

  Attributes:
    num_heads: query heads ``H``.
    num_kv_heads: key/value heads (``H % num_kv_heads == 0``); None: ``num_heads``.
    head_dim: per-head size; None: ``features // num_heads``.
    out_features: output size; None: input features.
    is_causal: causal mask (default True, for language models).
    local_window_size: None, ``w`` or ``(left, right)`` (as in ``jaxcp.attention``).
    chunk_size: None or chunked attention block size (Llama-4 style).
    rope_theta: RoPE base; None disables rotary embeddings.
    scale: softmax scale; None: ``head_dim ** -0.5``.
    use_bias: biases on the projections.
    dtype: computation dtype (None: from inputs and params).
    param_dtype: parameter dtype.
    kernel_init, bias_init: initialisers.
    implementation, context_parallel, context_parallel_axis, deterministic: passed to
      ``jaxcp.attention``.
  """

  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  out_features: int | None = None
  is_causal: bool = True
  local_window_size: Any = None
  chunk_size: int | None = None
  rope_theta: float | None = 10000.0
  scale: float | None = None
  use_bias: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros_init()
  implementation: str | None = None
  context_parallel: str = "auto"
  context_parallel_axis: str | None = None
  deterministic: bool = False

  @nn.compact
  def __call__(self, x, *, segment_ids=None, positions=None, cu_seqlens=None):
    """Self attention over ``x`` ``[B, S, F]``.

    Args:
      x: inputs ``[B, S, F]``.
      segment_ids: int ``[B, S]`` document ids (0 = padding); None: one document per row.
      positions: int ``[B, S]`` positions inside each document, used for RoPE and the mask;
        None: derived from contiguous ``segment_ids`` runs (or ``cu_seqlens``). Pass them
        explicitly when the rows are permuted (``jaxcp.load_balance``).
      cu_seqlens: int ``[B, MAX_DOCS + 1]``, alternative to ``segment_ids``.

    Returns:
      ``[B, S, out_features]``.
    """
    if x.ndim != 3:
      raise ValueError(f"SelfAttention expects x of shape [batch, seq, features], got {x.shape}.")
    b, s, features = x.shape
    h, hkv, dh = check_heads(self.num_heads, self.num_kv_heads, self.head_dim, features)
    seg, pos = resolve_token_arrays(b, s, segment_ids, positions, cu_seqlens)
    dense = lambda heads, name: nn.DenseGeneral(
        (heads, dh), use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, name=name)
    q = dense(h, "query")(x)
    k = dense(hkv, "key")(x)
    v = dense(hkv, "value")(x)
    out = self_attention_core(
        q, k, v, segment_ids=seg, positions=pos, rope_theta=self.rope_theta,
        is_causal=self.is_causal, local_window_size=self.local_window_size,
        chunk_size=self.chunk_size, scale=self.scale, context_parallel=self.context_parallel,
        context_parallel_axis=self.context_parallel_axis, implementation=self.implementation,
        deterministic=self.deterministic)
    return nn.DenseGeneral(
        self.out_features or features, axis=(-2, -1), use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init, bias_init=self.bias_init,
        name="out")(out)
