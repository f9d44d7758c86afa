"""Flax integration of jaxcp, built only on the public API (``jaxcp.attention``).

* :func:`make_attention_fn` / :func:`document_layout`: an ``attention_fn`` for
  ``flax.linen.MultiHeadDotProductAttention`` and ``flax.nnx.MultiHeadAttention`` that carries
  segment ids and positions (packed documents) into ``jaxcp.attention``.
* :class:`SelfAttention` (linen, also ``jaxcp.flax.linen.SelfAttention``) and
  ``jaxcp.flax.nnx.SelfAttention``: compact GQA self attention with RoPE from explicit positions,
  packed documents, sliding window / chunked masks.
* :func:`apply_rope`, :func:`positions_from_segment_ids`: the building blocks.

Needs ``flax`` (``pip install jaxcp[flax]``).
"""
try:
  import flax  # noqa: F401
except ImportError as e:  # pragma: no cover
  raise ImportError("jaxcp.flax needs flax: pip install 'jaxcp[flax]' (or pip install flax).") from e

from ._attention_fn import document_layout, make_attention_fn
from ._core import apply_rope, positions_from_segment_ids
from . import linen, nnx
from .linen import SelfAttention

__all__ = ["make_attention_fn", "document_layout", "apply_rope", "positions_from_segment_ids",
           "SelfAttention", "linen", "nnx"]
