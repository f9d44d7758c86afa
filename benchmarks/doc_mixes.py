"""Realistic document mixes for the context-parallel benchmarks: lognormal document lengths
(sigma 1 in natural log) packed into rows, and rows made placeable for a DocumentPlacement."""
from __future__ import annotations

import numpy as np

from jaxcp._src.attention.placement import choose_with_eviction

SIGMA = 1.0
MIXES = {"doc2k": 2048, "doc8k": 8192, "doc32k": 32768, "single": None}


def lognormal_lengths(rng: np.random.Generator, mean: float, n: int, sigma: float = SIGMA) -> np.ndarray:
  """n document lengths, lognormal with the given mean (at least 1 token)."""
  mu = np.log(mean) - sigma ** 2 / 2
  return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64)


def packed_row(rng: np.random.Generator, seq_len: int, mix: str) -> np.ndarray:
  """Segment ids [S] of one full row: documents of the mix back to back, the last one cut to
  fit; "single" is one document of S tokens."""
  if MIXES[mix] is None:
    return np.ones(seq_len, np.int32)
  lengths, total = [], 0
  while total < seq_len:
    for n in lognormal_lengths(rng, MIXES[mix], 64):
      n = int(min(n, seq_len - total))
      lengths.append(n)
      total += n
      if total == seq_len:
        break
  return np.repeat(np.arange(1, len(lengths) + 1, dtype=np.int32), lengths)


def placeable(seg: np.ndarray, cp: int, **cost) -> tuple[np.ndarray, float]:
  """The rows with what a DocumentPlacement over cp ranks leaves out turned into padding (an
  input pipeline packs those documents into later rows), and the share of tokens left out."""
  _, _, _, evicted = choose_with_eviction(seg, cp, **cost)
  return np.where(evicted, 0, seg).astype(np.int32), float(evicted.mean())


def positions(seg: np.ndarray) -> np.ndarray:
  """Each token's position in its document (contiguous runs of one id), 0 on padding."""
  seg = np.asarray(seg)
  idx = np.broadcast_to(np.arange(seg.shape[-1]), seg.shape)
  prev = np.concatenate([np.full(seg.shape[:-1] + (1,), -1), seg[..., :-1]], axis=-1)
  start = np.maximum.accumulate(np.where(seg != prev, idx, 0), axis=-1)
  return np.where(seg != 0, idx - start, 0).astype(np.int32)


def allowed_causal_pairs(seg: np.ndarray) -> int:
  """Allowed (query, key) pairs of a causal mask: L (L + 1) / 2 per document (segment id)."""
  total = 0
  for row in np.asarray(seg).reshape(-1, seg.shape[-1]):
    _, counts = np.unique(row[row != 0], return_counts=True)
    total += int((counts * (counts + 1) // 2).sum())
  return total
