"""Shared case specs of packed-document attention, run against every backend ("xla", "cpu",
"cuda") by tests/test_attention_backends.py: each case is the keyword arguments of one
jaxcp.attention call on small random inputs."""
from __future__ import annotations

import dataclasses

import numpy as np

from .helpers import positions_in_documents, random_segments


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  q_len: int = 96
  kv_len: int = 96
  heads: tuple = (4, 2)          # (query heads, key/value heads)
  head_dim: int = 64
  value_dim: int | None = None   # None: head_dim
  mask: dict = dataclasses.field(default_factory=dict)
  tokens: str = "packed"         # how the token arrays are made; see token_kwargs

  def token_kwargs(self, rng: np.random.Generator, batch: int) -> dict:
    """segment_ids / positions / kv_segment_ids / cu_seqlens for this case."""
    if self.tokens == "none":        # one document per row, bottom-right aligned
      return {}
    if self.tokens == "packed":
      return dict(segment_ids=random_segments(rng, batch, self.q_len, mean_doc=20))
    if self.tokens == "empty_rows":   # row 0 all padding, row 1 packed
      seg = random_segments(rng, batch, self.q_len, mean_doc=20)
      seg[0] = 0
      return dict(segment_ids=seg)
    if self.tokens == "cu_seqlens":  # zero-length documents and a padding tail
      cu = np.array([[0, 10, 10, 50, 80, 80], [0, 96, 96, 96, 96, 96]][:batch], np.int32)
      return dict(cu_seqlens=cu)
    if self.tokens == "permuted":     # any token order is legal with explicit positions
      seg = random_segments(rng, batch, self.q_len, mean_doc=20, pad_tail=False)
      pos = positions_in_documents(seg)
      perm = np.stack([rng.permutation(self.q_len) for _ in range(batch)])
      take = lambda x: np.take_along_axis(x, perm, axis=1)
      return dict(segment_ids=take(seg), positions=take(pos))
    if self.tokens == "cross":        # two packings of the same documents' ids
      q_seg = np.sort(rng.integers(0, 4, (batch, self.q_len)), axis=1).astype(np.int32)
      kv_seg = np.sort(rng.integers(1, 4, (batch, self.kv_len)), axis=1).astype(np.int32)
      return dict(segment_ids=q_seg, kv_segment_ids=kv_seg)
    raise ValueError(self.tokens)


CASES = [
    Case("causal_mha", heads=(4, 4), mask=dict(is_causal=True)),
    Case("causal_gqa", mask=dict(is_causal=True)),
    Case("causal_mqa", heads=(4, 1), mask=dict(is_causal=True)),
    Case("bidirectional"),
    Case("window", mask=dict(local_window_size=(9, 3))),
    Case("causal_window", mask=dict(is_causal=True, local_window_size=(12, 0))),
    Case("causal_chunk", mask=dict(is_causal=True, chunk_size=16)),
    Case("cu_seqlens", tokens="cu_seqlens", mask=dict(is_causal=True)),
    Case("empty_rows", tokens="empty_rows", mask=dict(is_causal=True)),
    Case("permuted_tokens", tokens="permuted", mask=dict(is_causal=True)),
    Case("no_segments_bottom_right", q_len=40, kv_len=96, tokens="none", mask=dict(is_causal=True)),
    Case("cross_attention", q_len=64, kv_len=96, tokens="cross"),
    Case("value_dim_of_its_own", value_dim=32, mask=dict(is_causal=True)),
]
