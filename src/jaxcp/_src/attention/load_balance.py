"""Token permutations that balance causal attention work across context-parallel ranks.

Under context parallelism the sequence axis is split into ``cp_size`` contiguous shards and rank
``r`` computes the attention rows of the queries in shard ``r`` (against keys from every shard, by
all-gather or ring). With a causal mask, query ``i`` of a document attends to ``i + 1`` keys, so
a naive split gives the last rank far more work than the first. Because jaxcp's mask depends only
on per-token (segment id, position) values, any token permutation is legal:
permute the tokens before sharding, run the attention unchanged, and undo the permutation after.

Permute *everything that is per token* the same way (tokens or embeddings, segment ids, positions,
labels, loss masks) and pass ``positions`` (and ``segment_ids``) explicitly to
``jaxcp.attention``: positions must be derived from the document layout *before* permuting,
because after permuting, tokens of one document are no longer contiguous and positions can no
longer be inferred from segment ids.

Strategies (``cp`` = ``cp_size``, ``S`` = sequence length); measured in
``benchmarks/cp_balance.py`` (results in ``benchmarks/results/cp_balance.md``):

``"striped"`` (default)
    Token ``t`` goes to rank ``t % cp``: the permuted sequence is
    ``[t for r in range(cp) for t in range(r, S, cp)]``. Static (depends only on ``S``), and
    balanced for any document layout: every rank sees every document at an even stride (a lone
    document of length ``L`` is within about ``cp / L`` of even). But a rank's tokens of one
    document are ``cp`` positions apart, so a kernel tile of ``T`` tokens spans ``cp * T``
    original positions and, on short documents, many documents: tile skipping suffers.

``"zigzag"``
    The sequence is cut into ``2 * cp`` equal chunks; rank ``r`` holds chunks ``r`` and
    ``2 * cp - 1 - r``. Static, exact for one causal document per row, long contiguous runs, but
    unbalanced for packed rows of many documents (the chunks ignore document boundaries).

``"balanced_blocks"`` (document aware)
    Blocks of ``block_size`` tokens (default 128, a kernel tile) are sorted by causal work and
    dealt to the ranks in snake order. Equal block counts, nearly equal work for any document
    mix, and tiles stay whole pieces of documents, so tile skipping works as on the unpermuted
    row. The best modelled step time for packed rows.

``"zigzag_docs"`` (document aware)
    Every document (a maximal run of equal non-zero segment ids) is cut into ``2 * cp`` pieces,
    and one rank gets pieces ``j`` and ``2 * cp - 1 - j`` of it (positions ``p`` and ``L - 1 - p``
    together always cost ``L + 1`` keys), the rank of pair ``j`` rotated per document and piece
    sizes rounded so that every rank holds exactly ``S / cp`` tokens. Token-exact balance for any
    mix; long documents stay in two pieces per rank, short ones are spread like striped.

The document-aware permutations depend on the segment ids, so they are data dependent: compute
them with :func:`load_balance_permutation` (jit-safe on traced segment ids, or numpy in an input
pipeline) and pass the index array as ``strategy=`` to :func:`load_balance` and
:func:`restore_order`, or use :func:`apply_permutation` / :func:`invert_permutation`.

Permutation arrays follow one convention everywhere: ``perm`` has shape ``[..., S]`` and
``permuted[..., j] = x[..., perm[..., j]]``; rank ``r`` holds permuted positions
``[r * S // cp, (r + 1) * S // cp)``.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp

from .. import compat
from .document_zigzag import balanced_blocks_order, zigzag_docs_ranks
from .placement import DocumentPlacement, check_cp_size, placement_permutation

__all__ = [
    "STRATEGIES",
    "load_balance",
    "restore_order",
    "load_balance_permutation",
    "apply_permutation",
    "invert_permutation",
]

#: Strategy names understood by :func:`load_balance_permutation`. ``"striped"`` and ``"zigzag"``
#: are static and can be passed by name to :func:`load_balance` / :func:`restore_order`.
STRATEGIES = ("striped", "zigzag", "zigzag_docs", "balanced_blocks")
_STATIC_STRATEGIES = ("striped", "zigzag")


# --------------------------------------------------------------------------------------------
# validation helpers


def _is_numpy(x: Any) -> bool:
  return isinstance(x, (np.ndarray, np.generic))


def _check_axis(axis: Any, ndim: int) -> int:
  if isinstance(axis, bool):
    raise ValueError(f"axis must be an int, got {axis!r}.")
  try:
    ax = operator.index(axis)
  except TypeError:
    raise ValueError(f"axis must be an int (the sequence axis), got {axis!r}.") from None
  if ndim == 0:
    raise ValueError("x must have at least one dimension (the sequence axis); got a scalar.")
  if not -ndim <= ax < ndim:
    raise ValueError(
        f"axis={ax} is out of range for an array of rank {ndim}; pass the index of the sequence "
        f"axis, in [{-ndim}, {ndim - 1}] (e.g. axis=1 for [batch, seq, ...])."
    )
  return ax % ndim


def _check_divisible(seq_len: int, cp: int, strategy: str) -> None:
  if strategy == "zigzag":
    if seq_len % (2 * cp):
      raise ValueError(
          f"strategy='zigzag' needs the sequence length to be a multiple of 2 * cp_size = "
          f"{2 * cp}, got {seq_len}; pad the sequence to a multiple of {2 * cp} or use "
          f"strategy='striped'."
      )
  elif seq_len % cp:
    raise ValueError(
        f"load balancing needs the sequence length to be a multiple of cp_size = {cp}, got "
        f"{seq_len}; pad the sequence (padding tokens have segment id 0) to a multiple of {cp}."
    )


def _check_strategy_name(strategy: str) -> None:
  if strategy not in STRATEGIES:
    raise ValueError(
        f"Unknown strategy {strategy!r}; expected one of {STRATEGIES} or an int permutation "
        f"array from load_balance_permutation()."
    )


def _zigzag_chunk_order(cp: int) -> np.ndarray:
  return np.asarray([c for r in range(cp) for c in (r, 2 * cp - 1 - r)], dtype=np.int32)


def _static_permutation(seq_len: int, cp: int, strategy: str) -> np.ndarray:
  """The static permutation as a numpy int32 array of shape [seq_len]."""
  idx = np.arange(seq_len, dtype=np.int32)
  if strategy == "striped":
    return idx.reshape(seq_len // cp, cp).T.reshape(-1)
  if strategy == "zigzag":
    return idx.reshape(2 * cp, seq_len // (2 * cp))[_zigzag_chunk_order(cp)].reshape(-1)
  raise AssertionError(strategy)


# --------------------------------------------------------------------------------------------
# static strategies: reshapes, transposes, slices and reverses; no index arrays


def _striped(x, cp: int, axis: int, inverse: bool):
  xp = np if _is_numpy(x) else jnp
  s = x.shape[axis]
  pre, post = x.shape[:axis], x.shape[axis + 1 :]
  split = (cp, s // cp) if inverse else (s // cp, cp)
  y = xp.reshape(x, pre + split + post)
  y = xp.swapaxes(y, axis, axis + 1)
  return xp.reshape(y, x.shape)


def _zigzag(x, cp: int, axis: int, inverse: bool):
  # Chunk c = h * cp + i (h in {0, 1}); rank r holds (0, r) then (1, cp - 1 - r): the second
  # half reversed. Slices, a reverse and a stack: no gather along the (maybe sharded) axis.
  xp = np if _is_numpy(x) else jnp
  s = x.shape[axis]
  pre, post = x.shape[:axis], x.shape[axis + 1 :]
  at = (slice(None),) * axis
  if not inverse:
    y = xp.reshape(x, pre + (2, cp, s // (2 * cp)) + post)
    z = xp.stack([y[at + (0,)], xp.flip(y[at + (1,)], axis=axis)], axis=axis + 1)
  else:
    y = xp.reshape(x, pre + (cp, 2, s // (2 * cp)) + post)
    z = xp.stack([y[at + (slice(None), 0)], xp.flip(y[at + (slice(None), 1)], axis=axis)],
                 axis=axis)
  return xp.reshape(z, x.shape)


# --------------------------------------------------------------------------------------------
# permutation arrays


def _check_perm(perm, x_shape: tuple[int, ...] | None, axis: int | None, name: str = "strategy"):
  if not hasattr(perm, "shape") or not hasattr(perm, "dtype"):
    raise ValueError(
        f"{name} must be a strategy name {STRATEGIES[:2]} or an int permutation array, got "
        f"{type(perm).__name__}."
    )
  if not jnp.issubdtype(perm.dtype, jnp.integer):
    raise ValueError(f"{name} permutation must have an integer dtype, got {perm.dtype}.")
  if perm.ndim < 1:
    raise ValueError(f"{name} permutation must have shape [..., S], got a scalar.")
  if x_shape is None:
    return
  lead = perm.shape[:-1]
  if perm.shape[-1] != x_shape[axis]:
    raise ValueError(
        f"{name} permutation has length {perm.shape[-1]} but x has {x_shape[axis]} tokens along "
        f"axis {axis}; compute the permutation from segment ids of the same sequence length."
    )
  if len(lead) > axis or tuple(x_shape[: len(lead)]) != tuple(lead):
    raise ValueError(
        f"{name} permutation of shape {tuple(perm.shape)} does not match x of shape "
        f"{tuple(x_shape)} with axis={axis}: its leading dims must equal the leading dims of x "
        f"before the sequence axis (e.g. perm [B, S] for x [B, S, ...] with axis=1), or pass a "
        f"1-D [S] permutation shared by all rows."
    )


def apply_permutation(x, perm, *, axis: int = 1):
  """Gathers ``x`` along ``axis`` with a permutation: ``out[..., j, ...] = x[..., perm[j], ...]``.

  Args:
    x: array (numpy or JAX, any rank and dtype) with the sequence along ``axis``.
    perm: integer array ``[S]`` (one permutation for every row) or ``[*lead, S]`` whose leading
      dims equal ``x.shape[:len(lead)]`` (one permutation per row, e.g. ``[B, S]`` from
      :func:`load_balance_permutation` for ``x`` of shape ``[B, S, ...]``).
    axis: the sequence axis of ``x``.

  Returns:
    The permuted array, same shape and dtype as ``x``; numpy in, numpy out (when ``perm`` is
    numpy too). jit-, vmap- and grad-safe.
  """
  ax = _check_axis(axis, np.ndim(x))
  _check_perm(perm, tuple(np.shape(x)), ax, name="perm")
  if _is_numpy(x) and _is_numpy(perm):
    xp = np
  else:
    xp = jnp
    explicit = compat.explicit_sharding(x)
    if explicit is not None:
      return _gather_explicit(x, jnp.asarray(perm), ax, explicit)
  if perm.ndim == 1:
    if xp is np:
      return np.take(x, perm, axis=ax)
    return jnp.take(x, perm, axis=ax, mode="clip")
  lead = perm.shape[:-1]
  shape = lead + (1,) * (ax - len(lead)) + (perm.shape[-1],) + (1,) * (x.ndim - ax - 1)
  idx = xp.reshape(perm, shape)
  if xp is np:
    return np.take_along_axis(x, idx, axis=ax)
  return jnp.take_along_axis(x, idx, axis=ax, mode="clip")


def _gather_explicit(x, perm, ax, sharding):
  """apply_permutation for an array sharded over Explicit mesh axes: one gather whose output keeps
  x's sharding (JAX cannot infer it for a gather along a sharded axis)."""
  if perm.ndim > 1 and perm.ndim - 1 < ax:  # per-row permutation: spell out the dims up to axis
    lead = perm.shape[:-1]
    perm = jnp.broadcast_to(perm.reshape(lead + (1,) * (ax - len(lead)) + perm.shape[-1:]),
                            x.shape[:ax] + perm.shape[-1:])
  if perm.ndim == 1:
    index = (slice(None),) * ax + (perm,)
  else:
    lead = perm.shape[:-1]
    index = tuple(jnp.arange(n).reshape((n,) + (1,) * (len(lead) - i)) for i, n in enumerate(lead)) + (perm,)
  return x.at[index].get(mode="clip", out_sharding=sharding)


def invert_permutation(perm):
  """Inverse of a permutation along its last axis: ``inv[..., perm[..., j]] = j``.

  ``apply_permutation(apply_permutation(x, perm), invert_permutation(perm))`` is ``x``. Works
  on numpy arrays (returns numpy) and on JAX / traced arrays (one scatter per row, O(S)).
  """
  _check_perm(perm, None, None, name="perm")
  s = perm.shape[-1]
  if _is_numpy(perm):
    inv = np.empty(perm.shape, dtype=np.int32)
    np.put_along_axis(inv, perm.astype(np.intp), np.broadcast_to(
        np.arange(s, dtype=np.int32), perm.shape), axis=-1)
    return inv
  flat = jnp.reshape(perm, (-1, s))
  iota = jnp.arange(s, dtype=jnp.int32)
  inv = jax.vmap(lambda p: jnp.zeros((s,), jnp.int32).at[p].set(iota, mode="drop",
                                                               unique_indices=True))(flat)
  return jnp.reshape(inv, perm.shape)


# --------------------------------------------------------------------------------------------
# document-aware permutation


def load_balance_permutation(segment_ids, cp_size: int, *, strategy: str = "balanced_blocks",
                             block_size: int = 128):
  """Per-row token permutation that balances causal attention work over ``cp_size`` ranks.

  Use this for the document-aware strategies, whose permutation depends on the document layout
  (documents are maximal runs of equal non-zero segment ids; 0 is padding):

  * ``"balanced_blocks"`` (default): the row is cut into blocks of ``block_size`` consecutive
    tokens; blocks are sorted by their causal work and dealt to the ranks heaviest first in snake
    order, so every rank gets ``S / (cp_size * block_size)`` blocks and (nearly) the same work.
    Tokens stay in contiguous runs of ``block_size``: with ``block_size`` equal to the kernel's
    tile size, attention tiles are whole pieces of documents, so a tile-skipping kernel wastes
    no more than on the unpermuted row (striped tiles mix tokens from ``cp_size * block_size``
    positions and lose most of the skipping on short documents). Needs
    ``S % (cp_size * block_size) == 0``. The best choice for packed rows under context
    parallelism in ``benchmarks/cp_balance.py``.
  * ``"zigzag_docs"``: every document is cut into ``2 * cp_size`` pieces and one rank gets pieces
    ``j`` and ``2 * cp_size - 1 - j`` (rotated per document, sizes rounded so that every rank
    gets exactly ``S / cp_size`` tokens). Token-exact balance for any mix; long documents stay
    in two contiguous pieces per rank, short ones are spread token by token.
  * ``"striped"`` / ``"zigzag"``: the static permutations, broadcast to ``segment_ids.shape``.
  * a :class:`jaxcp.DocumentPlacement`: every segment whole in one rank's local region (balancing
    ``token_cost * L + pair_cost * L**2`` per rank) or cut into ``2 * cp_size`` zigzag pieces in
    the shared region (the last ``shared_tokens`` of each rank); pass the same object as
    ``jaxcp.attention(..., context_parallel=placement)``, which then exchanges only the shared
    region. Raises ValueError (at run time under jit) when a row does not fit; see
    :func:`jaxcp.choose_placement`.

  Typical use (positions derived *before* permuting and passed explicitly)::

    perm = load_balance_permutation(segment_ids, cp)                 # [B, S] int32
    q, k, v, seg, pos, labels = (load_balance(t, cp, strategy=perm)
                                 for t in (q, k, v, segment_ids, positions, labels))
    out = jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, is_causal=True)
    out = restore_order(out, cp, strategy=perm)

  Args:
    segment_ids: integer array ``[..., S]`` (typically ``[B, S]``): numpy (computed with numpy,
      e.g. in the input pipeline; returns numpy) or JAX, possibly traced (computed with jnp,
      jit-safe; the shape is static, the values may be traced).
    cp_size: number of context-parallel ranks (static int >= 1); ``S % cp_size == 0``.
    strategy: ``"balanced_blocks"``, ``"zigzag_docs"``, ``"striped"``, ``"zigzag"`` or a
      DocumentPlacement.
    block_size: tokens per block for ``"balanced_blocks"`` (static int >= 1; ignored otherwise).

  Returns:
    int32 array of ``segment_ids.shape``: ``perm[..., j]`` is the original index of the token at
    permuted position ``j``; rank ``r`` holds ``perm[..., r * S // cp : (r + 1) * S // cp]``.
  """
  cp = check_cp_size(cp_size)
  if isinstance(strategy, DocumentPlacement):
    return placement_permutation(segment_ids, cp, strategy)
  if not isinstance(strategy, str):
    raise ValueError(f"strategy must be one of {STRATEGIES} or a DocumentPlacement, got {type(strategy).__name__}.")
  _check_strategy_name(strategy)
  if not hasattr(segment_ids, "shape") or np.ndim(segment_ids) < 1:
    raise ValueError("segment_ids must be an integer array of shape [..., S].")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids must have an integer dtype, got {segment_ids.dtype}.")
  s = segment_ids.shape[-1]
  _check_divisible(s, cp, strategy)
  xp = np if _is_numpy(segment_ids) else jnp
  if strategy in _STATIC_STRATEGIES:
    perm = xp.broadcast_to(xp.asarray(_static_permutation(s, cp, strategy)), segment_ids.shape)
    return np.array(perm) if xp is np else perm   # numpy: a writable array, not a view
  if strategy == "balanced_blocks":
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
      raise ValueError(f"block_size must be a static int >= 1 (e.g. the kernel tile size 128), "
                       f"got {block_size!r}.")
    block_size = int(block_size)
    if s % (cp * block_size):
      raise ValueError(
          f"strategy='balanced_blocks' needs the sequence length to be a multiple of "
          f"cp_size * block_size = {cp * block_size}, got {s}; pad the sequence to a multiple of "
          f"{cp * block_size} or pass a smaller block_size.")
    order = balanced_blocks_order(segment_ids, cp, block_size, xp)
    perm = order[..., :, None] * block_size + xp.arange(block_size, dtype=np.int32)
    return xp.reshape(perm, segment_ids.shape).astype(np.int32)
  ranks = zigzag_docs_ranks(segment_ids, cp, xp)
  if xp is np:
    if cp <= 2**16:  # numpy's stable sort is a radix sort for 16-bit keys
      ranks = ranks.astype(np.uint16)
    return np.argsort(ranks, axis=-1, kind="stable").astype(np.int32)
  return jnp.argsort(ranks, axis=-1, stable=True).astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# public entry points


def _prepare(x, cp_size, axis, strategy):
  if not hasattr(x, "shape"):
    x = np.asarray(x)
  cp = check_cp_size(cp_size)
  ax = _check_axis(axis, np.ndim(x))
  s = x.shape[ax]
  if isinstance(strategy, str):
    _check_strategy_name(strategy)
    if strategy not in _STATIC_STRATEGIES:
      raise ValueError(
          f"strategy={strategy!r} depends on the segment ids; compute "
          f"perm = load_balance_permutation(segment_ids, cp_size, strategy={strategy!r}) and pass "
          f"strategy=perm."
      )
    _check_divisible(s, cp, strategy)
  else:
    _check_perm(strategy, tuple(x.shape), ax)
    _check_divisible(s, cp, "perm")
  return x, cp, ax


def load_balance(x, cp_size: int, *, axis: int = 1, strategy="striped"):
  """Permutes tokens along ``axis`` so that contiguous ``cp_size``-way shards get equal causal work.

  Apply it to every per-token array (inputs or embeddings, segment ids, positions, labels, loss
  masks) with the same arguments, then shard the sequence axis over the context-parallel mesh
  axis as usual; the attention call is unchanged, but ``positions`` (and ``segment_ids``) must be
  passed explicitly and derived *before* permuting. Undo with :func:`restore_order`.

  Which strategy:
    * ``"striped"`` (default): token ``t`` to rank ``t % cp_size``. Static; balanced for any
      document mix (simulated causal work within 1% of even for packed rows of realistic
      documents). The choice when in doubt and when the segment ids are not at hand.
    * ``"zigzag"``: ``2 * cp_size`` chunks, rank ``r`` holds chunks ``r`` and
      ``2 * cp_size - 1 - r``. Static; exact for one causal document per row, contiguous tokens,
      but unbalanced for packed rows of many documents.
    * a permutation array from :func:`load_balance_permutation` (``"balanced_blocks"`` or
      ``"zigzag_docs"``): document aware, balanced for any mix while keeping tokens in
      contiguous runs, which suits tile-skipping kernels better than striped on packed rows.

  Args:
    x: numpy or JAX array of any rank and dtype, sequence along ``axis``. jit-safe: static
      strategies are reshapes, transposes, slices and reverses computed from the shape.
    cp_size: number of context-parallel ranks (static int >= 1). The sequence length must be a
      multiple of ``cp_size`` (``2 * cp_size`` for ``"zigzag"``).
    axis: the sequence axis (default 1, for ``[batch, seq, ...]``).
    strategy: ``"striped"``, ``"zigzag"``, or an int permutation array ``[S]`` / ``[*lead, S]``
      (``perm[..., j]`` = original index of permuted token ``j``; leading dims equal the leading
      dims of ``x``).

  Returns:
    The permuted array (same shape and dtype; numpy in, numpy out).

  Raises:
    ValueError: bad ``cp_size``, ``axis`` or ``strategy``, or a sequence length that is not a
      multiple of ``cp_size`` (``2 * cp_size`` for zigzag).
  """
  x, cp, ax = _prepare(x, cp_size, axis, strategy)
  if not isinstance(strategy, str):
    return apply_permutation(x, strategy, axis=ax)
  if cp == 1:
    return x
  if compat.explicit_sharding(x) is not None:  # reshapes of a sharded axis: gather instead
    return apply_permutation(x, _static_permutation(x.shape[ax], cp, strategy), axis=ax)
  if strategy == "striped":
    return _striped(x, cp, ax, inverse=False)
  return _zigzag(x, cp, ax, inverse=False)


def restore_order(x, cp_size: int, *, axis: int = 1, strategy="striped"):
  """Inverse of :func:`load_balance`: ``restore_order(load_balance(x, ...), ...)`` is ``x`` exactly.

  Call it on per-token outputs (attention output, logits, per-token losses) with the same
  ``cp_size``, ``axis`` and ``strategy`` that were given to :func:`load_balance`. For a
  permutation array ``perm``, this gathers with ``invert_permutation(perm)`` (keep the inverse
  yourself and use :func:`apply_permutation` to avoid recomputing it for many arrays).

  Args, Returns and Raises: as for :func:`load_balance`.
  """
  x, cp, ax = _prepare(x, cp_size, axis, strategy)
  if not isinstance(strategy, str):
    return apply_permutation(x, invert_permutation(strategy), axis=ax)
  if cp == 1:
    return x
  if compat.explicit_sharding(x) is not None:
    inverse = np.argsort(_static_permutation(x.shape[ax], cp, strategy)).astype(np.int32)
    return apply_permutation(x, inverse, axis=ax)
  if strategy == "striped":
    return _striped(x, cp, ax, inverse=True)
  return _zigzag(x, cp, ax, inverse=True)
