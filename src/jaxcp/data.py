"""Document packing for packed-document training: numpy only, for the input pipeline.

:func:`pack_documents` packs a list of token arrays into rows of ``seq_len`` tokens and returns
everything ``jaxcp.attention`` and a next-token loss need (:class:`PackedBatch`);
:func:`iter_packed_batches` does the same over a stream of documents, batch by batch.

Conventions (those of ``jaxcp.attention``):

* ``segment_ids``: documents of a row are numbered 1..n in row order; padding is 0.
* ``positions``: position inside the document, restarting at 0 for each document (a document
  longer than ``seq_len`` is split into pieces of at most ``seq_len`` tokens, and each piece is
  a document of its own, positions restarting at 0).
* ``cu_seqlens``: ``[0, e1, ..., en, en, ..., en]``: document ``i`` is ``[cu[i], cu[i+1])``,
  repeated values are zero-length documents, and tokens at or after ``cu[-1]`` are padding. The
  row is padded with repeats of its last real end (not with ``seq_len``), so the padding tail is
  not a document; ``jaxcp.segments_from_cu_seqlens(cu_seqlens, seq_len)`` gives back exactly
  ``segment_ids`` and ``positions`` (padding positions are 0).
* ``labels[t] = tokens[t + 1]`` when ``t + 1`` is in the same document, and ``loss_mask[t] = 1``
  exactly there: no prediction across a document boundary (nor across the cut of a split
  document), none from padding; elsewhere ``labels`` is ``pad_id`` and ``loss_mask`` 0.

Packing strategies: ``"best_fit"`` (best-fit decreasing: pieces longest first, each into the
open row with the least room that still fits it; the least padding) and ``"greedy"`` (next fit
in input order: a row is closed when the next document does not fit; keeps document order).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import Iterable, Iterator, Sequence

import numpy as np

from jaxcp._src.attention.placement import choose_with_eviction

__all__ = ["PackedBatch", "PlacedBatch", "pack_documents", "iter_packed_batches", "iter_placed_batches",
           "place_packed", "PACKING_STRATEGIES"]

PACKING_STRATEGIES = ("best_fit", "greedy")


@dataclasses.dataclass(frozen=True)
class PackedBatch:
  """Packed rows; all arrays are numpy, ``N`` rows of ``S = seq_len`` tokens.

  Attributes:
    tokens: int32 [N, S]; padding is ``pad_id``.
    segment_ids: int32 [N, S]; 1..n per row in row order, 0 for padding.
    positions: int32 [N, S]; position inside the document (0 on padding).
    cu_seqlens: int32 [N, MAX_DOCS + 1]; ``[0, e1, ..., en, en, ..., en]`` (see module doc).
    labels: int32 [N, S]; next token inside the document, ``pad_id`` where ``loss_mask`` is 0.
    loss_mask: float32 [N, S]; 1.0 where ``labels`` is a real next token of the same document.
    document_ids: int32 [N, MAX_DOCS]; index of the source document (in the input list or the
      stream) of each segment, -1 for unused slots.
    document_offsets: int32 [N, MAX_DOCS]; where each segment starts inside its source
      document (non-zero for the later pieces of a split document), 0 for unused slots.
  """

  tokens: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  cu_seqlens: np.ndarray
  labels: np.ndarray
  loss_mask: np.ndarray
  document_ids: np.ndarray
  document_offsets: np.ndarray

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]

  @property
  def seq_len(self) -> int:
    return self.tokens.shape[1]

  def to_dict(self) -> dict[str, np.ndarray]:
    """The arrays as a dict (field name -> array), e.g. to feed ``jax.device_put``."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# A piece of a document: (document index, offset inside the document, token view).
_Piece = tuple[int, int, np.ndarray]


def _check_args(seq_len, strategy, max_docs_per_row, pad_id):
  if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
    raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}.")
  if strategy not in PACKING_STRATEGIES:
    raise ValueError(f"Unknown strategy {strategy!r}; expected one of {PACKING_STRATEGIES}.")
  if max_docs_per_row is not None and (
      isinstance(max_docs_per_row, bool) or not isinstance(max_docs_per_row, (int, np.integer))
      or max_docs_per_row < 1):
    raise ValueError(f"max_docs_per_row must be None or an int >= 1, got {max_docs_per_row!r}.")
  if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)):
    raise ValueError(f"pad_id must be an int, got {pad_id!r}.")


def _as_document(doc, index: int) -> np.ndarray:
  arr = np.asarray(doc)
  if arr.ndim != 1:
    raise ValueError(f"documents[{index}] must be a 1-D array of token ids, got shape {arr.shape}.")
  if arr.size == 0:
    return arr.astype(np.int32)
  if not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"documents[{index}] must hold integer token ids, got dtype {arr.dtype}.")
  return arr


def _split(index: int, doc: np.ndarray, seq_len: int) -> list[_Piece]:
  """Pieces of at most seq_len tokens (none for an empty document)."""
  return [(index, off, doc[off:off + seq_len]) for off in range(0, len(doc), seq_len)]


def _next_fit(pieces: Iterable[_Piece], seq_len: int, max_docs: int | None):
  """Greedy in order: yields each completed row (a list of pieces) as soon as it is closed."""
  row, used = [], 0
  for piece in pieces:
    n = len(piece[2])
    if row and (used + n > seq_len or (max_docs is not None and len(row) >= max_docs)):
      yield row
      row, used = [], 0
    row.append(piece)
    used += n
  if row:
    yield row


def _best_fit_decreasing(pieces: Sequence[_Piece], seq_len: int, max_docs: int | None):
  """Best-fit decreasing bin packing; rows in creation order, pieces in input order in a row."""
  order = sorted(range(len(pieces)), key=lambda i: -len(pieces[i][2]))  # stable: ties in order
  rows: list[list[int]] = []
  room: list[int] = []
  open_bins: list[tuple[int, int]] = []  # sorted (remaining room, row index) of rows that can grow
  for i in order:
    n = len(pieces[i][2])
    k = bisect.bisect_left(open_bins, (n, -1))
    if k < len(open_bins):
      _, r = open_bins.pop(k)
    else:
      r = len(rows)
      rows.append([])
      room.append(seq_len)
    rows[r].append(i)
    room[r] -= n
    if room[r] > 0 and (max_docs is None or len(rows[r]) < max_docs):
      bisect.insort(open_bins, (room[r], r))
  return [[pieces[i] for i in sorted(row)] for row in rows]


def _build(rows: Sequence[Sequence[_Piece]], seq_len: int, pad_id: int,
           max_docs: int | None, num_rows: int | None = None) -> PackedBatch:
  """Arrays for the given rows; num_rows > len(rows) appends empty (all padding) rows."""
  n_rows = len(rows) if num_rows is None else num_rows
  width = max_docs if max_docs is not None else max([len(r) for r in rows], default=1)
  width = max(width, 1)
  tokens = np.full((n_rows, seq_len), pad_id, np.int32)
  segment_ids = np.zeros((n_rows, seq_len), np.int32)
  positions = np.zeros((n_rows, seq_len), np.int32)
  cu = np.zeros((n_rows, width + 1), np.int32)
  doc_ids = np.full((n_rows, width), -1, np.int32)
  doc_offsets = np.zeros((n_rows, width), np.int32)
  for b, row in enumerate(rows):
    if len(row) > width:
      raise AssertionError("row holds more documents than max_docs_per_row")
    lengths = np.array([len(p[2]) for p in row], np.int64)
    ends = np.cumsum(lengths)
    if len(row):
      assert ends[-1] <= seq_len
      used = int(ends[-1])
      tokens[b, :used] = np.concatenate([p[2] for p in row])
      segment_ids[b, :used] = np.repeat(np.arange(1, len(row) + 1, dtype=np.int32), lengths)
      positions[b, :used] = np.arange(used) - np.repeat(ends - lengths, lengths)
      cu[b, 1:len(row) + 1] = ends
      cu[b, len(row) + 1:] = used
      doc_ids[b, :len(row)] = [p[0] for p in row]
      doc_offsets[b, :len(row)] = [p[1] for p in row]
  same_doc = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
  loss_mask = np.zeros((n_rows, seq_len), np.float32)
  loss_mask[:, :-1] = same_doc
  labels = np.full((n_rows, seq_len), pad_id, np.int32)
  labels[:, :-1] = np.where(same_doc, tokens[:, 1:], pad_id)
  return PackedBatch(tokens=tokens, segment_ids=segment_ids, positions=positions, cu_seqlens=cu,
                     labels=labels, loss_mask=loss_mask, document_ids=doc_ids,
                     document_offsets=doc_offsets)


def pack_documents(documents: Sequence, seq_len: int, *, strategy: str = "best_fit",
                   pad_id: int = 0, max_docs_per_row: int | None = None) -> PackedBatch:
  """Packs documents into rows of ``seq_len`` tokens.

  Every token of every document lands in exactly one row, in document order within its piece;
  documents longer than ``seq_len`` are split into pieces of ``seq_len`` tokens (the last piece
  shorter), each piece packed as a document of its own. Empty documents are skipped.

  Args:
    documents: sequence of 1-D integer token arrays (numpy arrays or lists).
    seq_len: tokens per row (S).
    strategy: ``"best_fit"`` (best-fit decreasing, the fewest rows / least padding) or
      ``"greedy"`` (next fit in input order: keeps the document order, more padding).
    pad_id: token id of padding (and of masked labels).
    max_docs_per_row: at most this many documents (pieces) per row, and the width of
      ``cu_seqlens`` (``max_docs_per_row + 1``); None: no limit, width from the fullest row.
      Set it to keep shapes static across batches (no recompilation).

  Returns:
    A :class:`PackedBatch` of numpy arrays (rows in creation order; within a row, documents
    in input order).
  """
  _check_args(seq_len, strategy, max_docs_per_row, pad_id)
  seq_len = int(seq_len)
  pieces = [p for i, d in enumerate(documents) for p in _split(i, _as_document(d, i), seq_len)]
  if strategy == "greedy":
    rows = list(_next_fit(pieces, seq_len, max_docs_per_row))
  else:
    rows = _best_fit_decreasing(pieces, seq_len, max_docs_per_row)
  return _build(rows, seq_len, int(pad_id), max_docs_per_row)


class _PieceStream:
  """The pieces of a stream of documents (see _split), which takes pieces back: those come out
  again first (a placed batch returns the documents it left out)."""

  def __init__(self, documents: Iterable, piece_len: int):
    self._pieces = (p for i, d in enumerate(documents) for p in _split(i, _as_document(d, i), piece_len))
    self._back: collections.deque[_Piece] = collections.deque()

  def push_back(self, pieces: Sequence[_Piece]) -> None:
    self._back.extendleft(reversed(list(pieces)))

  def pending(self) -> bool:
    """Whether pieces were pushed back since the stream last ran dry."""
    return bool(self._back)

  def __iter__(self):
    return self

  def __next__(self) -> _Piece:
    if self._back:
      return self._back.popleft()
    return next(self._pieces)


def _check_batch_args(seq_len, batch_size, strategy, max_docs_per_row, pad_id, buffer_rows):
  _check_args(seq_len, strategy, max_docs_per_row, pad_id)
  if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
    raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}.")
  if buffer_rows is None:
    buffer_rows = 4 * batch_size
  if isinstance(buffer_rows, bool) or not isinstance(buffer_rows, (int, np.integer)) or buffer_rows < 1:
    raise ValueError(f"buffer_rows must be None or an int >= 1, got {buffer_rows!r}.")
  return int(seq_len), int(batch_size), int(pad_id), max(int(buffer_rows), int(batch_size))


def _row_batches(stream: _PieceStream, seq_len: int, batch_size: int, strategy: str,
                 max_docs: int | None, buffer_rows: int, drop_remainder: bool):
  """Yields lists of up to batch_size rows (lists of pieces), pulling pieces from the stream only
  as it needs them, so that pieces pushed back between batches go into the next one."""
  if strategy == "greedy":
    while True:
      rows = []
      # Next fit, a batch at a time: the row in progress when the batch fills stays open.
      row, used = [], 0
      for piece in stream:
        n = len(piece[2])
        if row and (used + n > seq_len or (max_docs is not None and len(row) >= max_docs)):
          rows.append(row)
          row, used = [], 0
          if len(rows) == batch_size:
            stream.push_back([piece])
            break
        row.append(piece)
        used += n
      else:
        if row:
          rows.append(row)
        if rows and (len(rows) == batch_size or not drop_remainder):
          yield rows
        if stream.pending():  # the consumer gave pieces back after the last batch
          continue
        return
      yield rows

  buffer: list[_Piece] = []
  tokens = 0
  exhausted = False
  while True:
    while tokens < buffer_rows * seq_len:
      piece = next(stream, None)
      if piece is None:
        exhausted = True
        break
      buffer.append(piece)
      tokens += len(piece[2])
    rows = _best_fit_decreasing(buffer, seq_len, max_docs)
    if not exhausted:
      # Keep the emptiest rows' documents for the next round: they pack better with new ones.
      rows.sort(key=lambda r: -sum(len(p[2]) for p in r))
      n_out = (len(rows) // batch_size) * batch_size
      rows, kept = rows[:n_out], rows[n_out:]
      buffer = sorted((p for r in kept for p in r), key=lambda p: (p[0], p[1]))
      tokens = sum(len(p[2]) for p in buffer)
    for k in range(0, len(rows), batch_size):
      chunk = rows[k:k + batch_size]
      if len(chunk) == batch_size or not drop_remainder:
        yield chunk
    if exhausted:
      if not stream.pending():
        return
      exhausted, buffer, tokens = False, [], 0  # pieces given back after the last batch


def iter_packed_batches(documents: Iterable, seq_len: int, batch_size: int, *,
                        strategy: str = "greedy", pad_id: int = 0,
                        max_docs_per_row: int | None = None, buffer_rows: int | None = None,
                        drop_remainder: bool = False) -> Iterator[PackedBatch]:
  """Packs a stream of documents and yields :class:`PackedBatch` es of ``batch_size`` rows.

  Same conventions as :func:`pack_documents`; ``document_ids`` count documents in the stream
  (from 0, empty documents included).

  Args:
    documents: iterable (possibly unbounded) of 1-D integer token arrays.
    seq_len: tokens per row.
    batch_size: rows per batch.
    strategy: ``"greedy"`` (default; next fit in stream order, constant memory) or
      ``"best_fit"`` (buffers about ``buffer_rows * seq_len`` tokens, packs them best-fit
      decreasing, yields the fullest rows and puts the documents of the rest back in the buffer).
    pad_id: token id of padding.
    max_docs_per_row: cap on documents per row and width of ``cu_seqlens``; set it for static
      shapes across batches (otherwise the width follows the fullest row of each batch).
    buffer_rows: best_fit only: rows of tokens to buffer before packing (default
      ``4 * batch_size``; at least ``batch_size``).
    drop_remainder: drop the last, incomplete batch instead of filling it with empty rows
      (all padding: segment 0, ``cu_seqlens`` all 0).

  Yields:
    PackedBatch with ``batch_size`` rows.
  """
  seq_len, batch_size, pad_id, buffer_rows = _check_batch_args(seq_len, batch_size, strategy, max_docs_per_row,
                                                               pad_id, buffer_rows)
  stream = _PieceStream(documents, seq_len)
  for rows in _row_batches(stream, seq_len, batch_size, strategy, max_docs_per_row, buffer_rows, drop_remainder):
    yield _build(rows, seq_len, pad_id, max_docs_per_row, num_rows=batch_size)


# --------------------------------------------------------------------------------------------
# context parallelism: placed batches


@dataclasses.dataclass(frozen=True)
class PlacedBatch:
  """A batch laid out for ``jaxcp.attention(..., context_parallel=placement)`` over ``cp`` ranks:
  every per-token array is already permuted (shard the sequence axis over the CP mesh axis).

  Attributes:
    tokens, segment_ids, positions, labels, loss_mask: as in :class:`PackedBatch`, permuted;
      positions were taken before permuting.
    placement: the ``jaxcp.DocumentPlacement`` chosen for this batch (static: pass it to the
      jitted step as a static argument; each distinct ``shared_tokens`` compiles once).
    permutation: int32 [N, S]: ``permuted[..., j] = original[..., permutation[..., j]]``
      (``jaxcp.restore_order(x, cp, strategy=permutation)`` undoes it).
    imbalance: float [N]: each row's costliest rank over the mean (1.0 is even).
    left_out: share of the batch's document tokens that did not fit and were put back into the
      stream for a later batch (their slots are padding here).
  """
  tokens: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  labels: np.ndarray
  loss_mask: np.ndarray
  placement: object
  permutation: np.ndarray
  imbalance: np.ndarray
  left_out: float

  def arrays(self) -> dict[str, np.ndarray]:
    """The per-token arrays as a dict (field name -> array)."""
    return {k: getattr(self, k) for k in ("tokens", "segment_ids", "positions", "labels", "loss_mask")}


def place_packed(batch: PackedBatch, cp: int, *, sizes=None, pad_id: int = 0, **cost):
  """Lays one packed batch out for document-placement context parallelism over ``cp`` ranks.

  Chooses the shared size (``jaxcp.choose_placement``'s rule, by predicted time when ``cost`` has
  ``exchange_cost``) with what finds no room left out:
  those documents' tokens become padding. Returns ``(PlacedBatch, evicted)`` with ``evicted`` a
  bool [N, MAX_DOCS] mask over ``batch.document_ids`` of the segments left out (a stream puts
  them back; :func:`iter_placed_batches` does)."""
  placement, perm, imbalance, evicted_tok = choose_with_eviction(batch.segment_ids, cp, sizes, **cost)
  real = batch.segment_ids != 0
  left_out = float(evicted_tok.sum()) / max(int(real.sum()), 1)
  keep = ~evicted_tok
  arrays = dict(tokens=np.where(keep, batch.tokens, pad_id), segment_ids=np.where(keep, batch.segment_ids, 0),
                positions=np.where(keep, batch.positions, 0), labels=np.where(keep, batch.labels, pad_id),
                loss_mask=np.where(keep, batch.loss_mask, 0).astype(np.float32))
  arrays = {k: np.take_along_axis(v, perm, axis=1) for k, v in arrays.items()}
  width = batch.document_ids.shape[1]
  evicted = np.zeros((batch.num_rows, width), bool)
  rows, cols = np.nonzero(evicted_tok)
  evicted[rows, batch.segment_ids[rows, cols] - 1] = True
  placed = PlacedBatch(**arrays, placement=placement, permutation=perm, imbalance=imbalance, left_out=left_out)
  return placed, evicted


def iter_placed_batches(documents: Iterable, seq_len: int, batch_size: int, cp: int, *,
                        sizes=None, strategy: str = "best_fit", pad_id: int = 0,
                        buffer_rows: int | None = None, drop_remainder: bool = False,
                        **cost) -> Iterator[PlacedBatch]:
  """Packs a stream of documents into batches laid out for document placement over ``cp``
  context-parallel ranks (see ``jaxcp.DocumentPlacement``).

  Each batch is packed like :func:`iter_packed_batches`, then placed: every document whole on one
  rank's local region or cut into zigzag pieces in the shared region, whose size (tokens per rank)
  is chosen per batch from ``sizes`` (default ``jaxcp._src.attention.placement.shared_sizes``; the
  largest, S / cp, always fits). A document that finds no room goes back to the stream and comes
  out first in the next batch, so no document is dropped.

  Args:
    documents, seq_len, batch_size, strategy, pad_id, buffer_rows, drop_remainder: as in
      :func:`iter_packed_batches` (default strategy "best_fit": fuller rows).
    cp: context-parallel ranks (the CP mesh axis size); ``seq_len % cp == 0``.
    sizes: static shared sizes to choose from (default: S / cp times 0, 1/8, 1/4, 3/8, 1/2, 3/4
      and 1). Each distinct size compiles its own program; one size gives one program. Documents
      longer than any size can hold (a local region, S / cp - R, or the shared one, cp * R) are
      cut into pieces that fit, each piece a document of its own.
    **cost: ``token_cost``, ``pair_cost``, ``tolerance`` of the placement (see DocumentPlacement),
      ``groups``, the shared group sizes ``jaxcp.choose_placement`` may choose from, and
      ``exchange_cost`` (``jaxcp.exchange_cost(q_heads, kv_heads, head_dim)``): choose each
      batch's layout by predicted time (see ``jaxcp.choose_placement``).

  Yields:
    PlacedBatch with ``batch_size`` rows.
  """
  seq_len, batch_size, pad_id, buffer_rows = _check_batch_args(seq_len, batch_size, strategy, None, pad_id,
                                                               buffer_rows)
  if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1 or seq_len % cp:
    raise ValueError(f"cp must be an int >= 1 that divides seq_len ({seq_len}), got {cp!r}.")
  sizes = None if sizes is None else tuple(sorted(int(r) for r in sizes))
  shard = seq_len // int(cp)
  if sizes is not None and (not sizes or sizes[0] < 0 or sizes[-1] > shard):
    raise ValueError(f"sizes must be shared-region sizes in [0, seq_len / cp = {shard}], got {sizes}.")
  # The longest document a placement can hold: a whole local region, or the whole shared one (of
  # the largest group). Longer ones are cut into pieces of that length (each a document of its
  # own, as for seq_len).
  group = int(cp) if cost.get("groups") is None else max(int(g) for g in cost["groups"])
  longest = max(max(shard - r, group * r) for r in ((0, shard) if sizes is None else sizes))
  stream = _PieceStream(documents, min(seq_len, longest))
  for rows in _row_batches(stream, seq_len, batch_size, strategy, None, buffer_rows, drop_remainder):
    batch = _build(rows, seq_len, pad_id, None, num_rows=batch_size)
    placed, evicted = place_packed(batch, int(cp), sizes=sizes, pad_id=pad_id, **cost)
    stream.push_back([row[i] for b, row in enumerate(rows) for i in range(len(row)) if evicted[b, i]])
    yield placed
