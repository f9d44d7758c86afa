"""Document-aware token layouts over cp ranks: a row's document runs, the zigzag cut of every
document ("zigzag_docs", and the shared region of a DocumentPlacement) and the balanced
blocks ("balanced_blocks", and a DocumentPlacement that shares every segment). Works on numpy
(xp=np) and on JAX arrays (xp=jnp), traced or not."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def document_layout(seg, xp):
  """(idx, real, doc_start) for documents = maximal runs of equal non-zero segment ids."""
  s = seg.shape[-1]
  idx = xp.broadcast_to(xp.arange(s, dtype=np.int32), seg.shape)
  real = seg != 0
  zeros = xp.zeros(seg.shape[:-1] + (1,), dtype=seg.dtype)
  start = real & (seg != xp.concatenate([zeros, seg[..., :-1]], axis=-1))
  if xp is np:
    doc_start = np.maximum.accumulate(np.where(start, idx, 0), axis=-1)
  else:
    doc_start = jax.lax.cummax(jnp.where(start, idx, 0), axis=seg.ndim - 1)
  return idx, real, doc_start


def zigzag_docs_ranks(seg, cp: int, xp):
  """Target rank of every token (int32 [..., S]) for strategy 'zigzag_docs'.

  A document of length L starting at index U of the stream of non-padding tokens gets the
  per-rank token counts that striped would give it: slot j (rank (U + j) % cp) takes
  c_j = L // cp + (j < L % cp) tokens. It gets them as pairs of positions (p, L-1-p), a front
  piece and its mirror image at the back (slot 0 outermost), plus, for odd c_j, one token of
  the block of the innermost tokens. A pair costs L + 1 keys wherever it sits, so per-rank work
  is even up to the middle block (at most cp / 2 keys off per slot). Padding tokens continue the
  stream after the last non-padding token (rank u % cp); counts add up over documents exactly as
  for striped, so every rank ends up with exactly S / cp tokens.
  """
  s = seg.shape[-1]
  i32 = np.int32
  idx, real, doc_start = document_layout(seg, xp)
  zeros = xp.zeros(seg.shape[:-1] + (1,), dtype=seg.dtype)
  end = real & (seg != xp.concatenate([seg[..., 1:], zeros], axis=-1))
  if xp is np:
    doc_end = np.flip(np.minimum.accumulate(np.flip(np.where(end, idx, s), -1), axis=-1), -1)
  else:
    doc_end = jax.lax.cummin(jnp.where(end, idx, s), axis=seg.ndim - 1, reverse=True)
  p = idx - doc_start                                  # position inside the document
  length = xp.where(real, doc_end - doc_start + 1, 1)  # document length (1 on padding)
  q = length - 1 - p                                   # position counted from the end
  real_i = real.astype(i32)
  real_excl = xp.cumsum(real_i, axis=-1, dtype=i32) - real_i   # non-padding tokens before t
  u0 = real_excl - p                                   # stream index of the document start

  # Slot j takes c_j = m + (j < e) tokens: floor(c_j / 2) pairs (p, L-1-p), which cost L + 1 keys
  # each whatever p is, as one run of pair indices (P_j = sum_{i<j} floor(c_i / 2) onwards, so
  # a front piece and its mirrored back piece), plus one token of the middle block if c_j is
  # odd. The middle block holds the n_odd innermost tokens, the cheapest to leave unpaired.
  m, e = length // cp, length % cp
  h, a = m // 2, m % 2
  n_odd = xp.where(a == 1, cp - e, e)                  # slots with an odd count
  n_pairs = (length - n_odd) // 2
  in_pair = (p < n_pairs) | (q < n_pairs)
  k = xp.minimum(p, q)                                 # pair index (outermost pair is 0)
  s1 = h + a                                           # pairs per slot j < e (h for j >= e)
  ke = e * s1
  slot_pair = xp.where(k < ke, k // xp.maximum(s1, 1), e + (k - ke) // xp.maximum(h, 1))
  mid = p - n_pairs                                    # index inside the middle block
  slot_mid = xp.where(a == 1, e + mid, mid)            # the mid-th odd slot
  slot = xp.where(in_pair, slot_pair, slot_mid)
  rank_real = (slot + u0) % cp
  n_real = xp.sum(real_i, axis=-1, keepdims=True, dtype=i32)
  rank_pad = (n_real + (idx - real_excl)) % cp
  return xp.where(real, rank_real, rank_pad).astype(i32)


def balanced_blocks_order(seg, cp: int, block_size: int, xp):
  """Block order (int32 [..., S // block_size]) for strategy 'balanced_blocks'.

  Blocks of block_size consecutive tokens are sorted by causal work (sum of position + 1 over
  their non-padding tokens), heaviest first, and dealt to ranks in snake order (0, 1, ..., cp-1,
  cp-1, ..., 0, 0, 1, ...): every rank gets the same number of blocks and the heaviest blocks
  are paired with the lightest. Each rank keeps its blocks in their original order.
  """
  s = seg.shape[-1]
  nb = s // block_size
  idx, real, doc_start = document_layout(seg, xp)
  # Exact integer sums (numpy and JAX agree bit for bit) unless int32 could overflow in JAX.
  wdtype = np.int64 if xp is np else (jnp.int32 if s * block_size < 2**31 else jnp.float32)
  work = xp.where(real, idx - doc_start + 1, 0).astype(wdtype)
  work = xp.sum(xp.reshape(work, seg.shape[:-1] + (nb, block_size)), axis=-1)
  k = np.arange(nb) % (2 * cp)
  snake = np.where(k < cp, k, 2 * cp - 1 - k).astype(np.int32)
  if xp is np:
    by_work = np.argsort(-work, axis=-1, kind="stable")
    rank = np.take(snake, np.argsort(by_work, axis=-1, kind="stable"))
    return np.argsort(rank, axis=-1, kind="stable").astype(np.int32)
  by_work = jnp.argsort(-work, axis=-1, stable=True)
  rank = jnp.take(jnp.asarray(snake), jnp.argsort(by_work, axis=-1, stable=True))
  return jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
