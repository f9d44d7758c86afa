"""Flax nnx modules built on ``jaxcp.attention``."""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx

from ._attention_fn import document_layout, make_attention_fn
from ._core import check_heads, resolve_token_arrays, self_attention_core

__all__ = ["SelfAttention", "make_attention_fn", "document_layout"]


class SelfAttention(nnx.Module):
  """Packed-document self attention (nnx): q/k/v projections, RoPE, ``jaxcp.attention``, output.

  Same computation and options as :class:`jaxcp.flax.linen.SelfAttention`. Parameters:
  ``query.kernel`` ``[F, H, Dh]``, ``key.kernel``/``value.kernel`` ``[F, Hkv, Dh]``,
  ``out.kernel`` ``[H, Dh, F_out]``.

  Args:
    in_features: input size ``F``.
    num_heads: query heads ``H``.
    num_kv_heads: key/value heads (``H % num_kv_heads == 0``); None: ``num_heads``.
    head_dim: per-head size; None: ``in_features // num_heads``.
    out_features: output size; None: ``in_features``.
    is_causal: causal mask (default True).
    local_window_size: None, ``w`` or ``(left, right)``.
    chunk_size: None or chunked attention block size.
    rope_theta: RoPE base; None disables rotary embeddings.
    scale: softmax scale; None: ``head_dim ** -0.5``.
    use_bias: biases on the projections.
    dtype, param_dtype: computation and parameter dtypes.
    kernel_init, bias_init: initialisers.
    implementation, context_parallel, context_parallel_axis, deterministic: passed to
      ``jaxcp.attention``.
    rngs: ``nnx.Rngs`` for parameter initialisation.
  """

  def __init__(self, in_features: int, num_heads: int, *, num_kv_heads: int | None = None,
               head_dim: int | None = None, out_features: int | None = None, is_causal: bool = True,
               local_window_size: Any = None, chunk_size: int | None = None,
               rope_theta: float | None = 10000.0, scale: float | None = None,
               use_bias: bool = False, dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init: Callable = nnx.initializers.lecun_normal(),
               bias_init: Callable = nnx.initializers.zeros_init(), implementation: str | None = None,
               context_parallel: str = "auto", context_parallel_axis: str | None = None,
               deterministic: bool = False, rngs: nnx.Rngs):
    h, hkv, dh = check_heads(num_heads, num_kv_heads, head_dim, in_features)
    self.in_features = in_features
    self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, dh
    self.out_features = out_features or in_features
    self.is_causal = is_causal
    self.local_window_size = local_window_size
    self.chunk_size = chunk_size
    self.rope_theta = rope_theta
    self.scale = scale
    self.implementation = implementation
    self.context_parallel = context_parallel
    self.context_parallel_axis = context_parallel_axis
    self.deterministic = deterministic
    common = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
                  bias_init=bias_init, rngs=rngs)
    self.query = nnx.LinearGeneral(in_features, (h, dh), **common)
    self.key = nnx.LinearGeneral(in_features, (hkv, dh), **common)
    self.value = nnx.LinearGeneral(in_features, (hkv, dh), **common)
    self.out = nnx.LinearGeneral((h, dh), self.out_features, axis=(-2, -1), **common)

  def __call__(self, x, *, segment_ids=None, positions=None, cu_seqlens=None):
    """Self attention over ``x`` ``[B, S, F]``; arguments as for the linen module."""
    if x.ndim != 3 or x.shape[-1] != self.in_features:
      raise ValueError(f"SelfAttention expects x of shape [batch, seq, {self.in_features}], got {x.shape}.")
    b, s, _ = x.shape
    seg, pos = resolve_token_arrays(b, s, segment_ids, positions, cu_seqlens)
    out = self_attention_core(
        self.query(x), self.key(x), self.value(x), segment_ids=seg, positions=pos,
        rope_theta=self.rope_theta, is_causal=self.is_causal,
        local_window_size=self.local_window_size, chunk_size=self.chunk_size, scale=self.scale,
        context_parallel=self.context_parallel, context_parallel_axis=self.context_parallel_axis,
        implementation=self.implementation, deterministic=self.deterministic)
    return self.out(out)
