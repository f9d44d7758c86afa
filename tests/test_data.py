"""Property tests of the document packer (jaxcp/data.py)."""

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from jaxcp import data

SETTINGS = hypothesis.settings(max_examples=80, deadline=None)


@st.composite
def corpora(draw, max_len=70):
  lengths = draw(st.lists(st.integers(0, max_len), min_size=0, max_size=14))
  seed = draw(st.integers(0, 2**16))
  rng = np.random.default_rng(seed)
  dtype = draw(st.sampled_from([np.int32, np.int64, np.uint16]))
  return [rng.integers(1, 1000, n).astype(dtype) for n in lengths]


def _segments_from_cu(cu, seq_len):
  """Reference decoder of the cu_seqlens convention (jaxcp.attention's cu_seqlens)."""
  seg = np.zeros((cu.shape[0], seq_len), np.int32)
  pos = np.zeros((cu.shape[0], seq_len), np.int32)
  for b in range(cu.shape[0]):
    for i in range(cu.shape[1] - 1):
      lo, hi = cu[b, i], cu[b, i + 1]
      seg[b, lo:hi] = i + 1
      pos[b, lo:hi] = np.arange(hi - lo)
  return seg, pos


def check_batch(batch, seq_len, pad_id, max_docs=None):
  """Invariants of one PackedBatch; returns {doc index: [(offset, tokens)]} of its pieces."""
  n = batch.num_rows
  for name in ("tokens", "segment_ids", "positions", "labels", "loss_mask"):
    arr = getattr(batch, name)
    assert arr.shape == (n, seq_len), name
  for name in ("tokens", "segment_ids", "positions", "cu_seqlens", "labels", "document_ids",
               "document_offsets"):
    assert getattr(batch, name).dtype == np.int32, name
  assert batch.loss_mask.dtype == np.float32
  cu = batch.cu_seqlens
  width = cu.shape[1] - 1
  if max_docs is not None:
    assert width == max_docs
  assert batch.document_ids.shape == batch.document_offsets.shape == (n, width)
  pieces = {}
  for b in range(n):
    row_cu = cu[b]
    n_docs = int((batch.document_ids[b] >= 0).sum())
    assert (batch.document_ids[b, n_docs:] == -1).all()
    assert row_cu[0] == 0 and (np.diff(row_cu) >= 0).all() and row_cu[-1] <= seq_len
    # real documents are non-empty; the rest are repeats of the last real end
    assert (np.diff(row_cu[:n_docs + 1]) > 0).all()
    assert (row_cu[n_docs:] == row_cu[n_docs]).all()
    used = row_cu[-1]
    seg, pos = batch.segment_ids[b], batch.positions[b]
    assert (seg[used:] == 0).all() and (pos[used:] == 0).all()
    assert (batch.tokens[b, used:] == pad_id).all()
    for i in range(n_docs):
      lo, hi = row_cu[i], row_cu[i + 1]
      assert (seg[lo:hi] == i + 1).all()
      np.testing.assert_array_equal(pos[lo:hi], np.arange(hi - lo))
      pieces.setdefault(int(batch.document_ids[b, i]), []).append(
          (int(batch.document_offsets[b, i]), batch.tokens[b, lo:hi].copy()))
    # labels: next token of the same document only
    same = np.zeros(seq_len, bool)
    same[:-1] = (seg[1:] == seg[:-1]) & (seg[1:] != 0)
    np.testing.assert_array_equal(batch.loss_mask[b], same.astype(np.float32))
    want = np.full(seq_len, pad_id)
    want[:-1] = np.where(same[:-1], batch.tokens[b, 1:], pad_id)
    np.testing.assert_array_equal(batch.labels[b], want)
  if n:
    ref_seg, ref_pos = _segments_from_cu(cu, seq_len)
    np.testing.assert_array_equal(batch.segment_ids, ref_seg)
    np.testing.assert_array_equal(batch.positions, ref_pos)
  return pieces


def check_reconstruction(pieces, documents, seq_len):
  """Every token of every document appears exactly once, in order, in pieces of <= seq_len."""
  nonempty = {i for i, d in enumerate(documents) if len(d)}
  assert set(pieces) == nonempty
  for i, parts in pieces.items():
    parts = sorted(parts, key=lambda p: p[0])
    offsets = [p[0] for p in parts]
    assert offsets == list(range(0, len(documents[i]), seq_len))
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), documents[i])


@SETTINGS
@hypothesis.given(docs=corpora(), seq_len=st.integers(1, 48),
                  strategy=st.sampled_from(data.PACKING_STRATEGIES),
                  max_docs=st.sampled_from([None, 1, 2, 5]), pad_id=st.sampled_from([0, -1, 7]))
def test_pack_documents_invariants(docs, seq_len, strategy, max_docs, pad_id):
  batch = data.pack_documents(docs, seq_len, strategy=strategy, pad_id=pad_id,
                              max_docs_per_row=max_docs)
  pieces = check_batch(batch, seq_len, pad_id, max_docs)
  check_reconstruction(pieces, docs, seq_len)
  total = sum(len(d) for d in docs)
  assert batch.num_rows >= -(-total // seq_len)
  assert (batch.segment_ids != 0).sum() == total
  if strategy == "greedy":  # in input order: rows read left to right give the documents in order
    order = [(int(d), int(o)) for b in range(batch.num_rows)
             for d, o in zip(batch.document_ids[b], batch.document_offsets[b]) if d >= 0]
    assert order == sorted(order)


@SETTINGS
@hypothesis.given(docs=corpora(), seq_len=st.integers(1, 40), batch_size=st.integers(1, 4),
                  strategy=st.sampled_from(data.PACKING_STRATEGIES),
                  max_docs=st.sampled_from([None, 3]), drop=st.booleans(),
                  buffer_rows=st.sampled_from([None, 1, 3]))
def test_iter_packed_batches_invariants(docs, seq_len, batch_size, strategy, max_docs, drop,
                                        buffer_rows):
  batches = list(data.iter_packed_batches(iter(docs), seq_len, batch_size, strategy=strategy,
                                          max_docs_per_row=max_docs, drop_remainder=drop,
                                          buffer_rows=buffer_rows))
  pieces = {}
  for batch in batches:
    assert batch.num_rows == batch_size
    for i, parts in check_batch(batch, seq_len, 0, max_docs).items():
      pieces.setdefault(i, []).extend(parts)
  if not drop:
    check_reconstruction(pieces, docs, seq_len)
  else:  # each piece at most once
    for i, parts in pieces.items():
      offsets = [p[0] for p in parts]
      assert len(offsets) == len(set(offsets))
  if strategy == "greedy":  # streaming greedy == one-shot greedy, padded to whole batches
    ref = data.pack_documents(docs, seq_len, strategy="greedy", max_docs_per_row=max_docs)
    got = np.concatenate([b.tokens for b in batches]) if batches else np.zeros((0, seq_len))
    n = ref.num_rows if not drop else (ref.num_rows // batch_size) * batch_size
    np.testing.assert_array_equal(got[:n], ref.tokens[:n])
    assert len(got) == (n if drop else -(-ref.num_rows // batch_size) * batch_size)


def test_matches_segments_from_cu_seqlens():
  """The lead's decoder (jaxcp._src.masks) reproduces segment ids and positions exactly."""
  masks = pytest.importorskip("jaxcp._src.masks")
  rng = np.random.default_rng(0)
  docs = [rng.integers(1, 100, n) for n in (5, 0, 17, 3, 64, 9, 1, 30)]
  for max_docs in (2, 6):
    batches = [data.pack_documents(docs, 32, strategy=strategy, max_docs_per_row=max_docs)
               for strategy in data.PACKING_STRATEGIES]
    seg, pos = masks.segments_from_cu_seqlens(np.concatenate([b.cu_seqlens for b in batches]), 32)
    np.testing.assert_array_equal(np.asarray(seg), np.concatenate([b.segment_ids for b in batches]))
    np.testing.assert_array_equal(np.asarray(pos), np.concatenate([b.positions for b in batches]))


def test_example_layout():
  docs = [np.arange(1, 6), np.arange(10, 13), [], np.arange(20, 31), np.arange(40, 42)]
  b = data.pack_documents(docs, 8)  # best fit decreasing: 8 (piece of 11), 5 + 3, 3 + 2
  np.testing.assert_array_equal(b.tokens, [[20, 21, 22, 23, 24, 25, 26, 27],
                                           [1, 2, 3, 4, 5, 10, 11, 12],
                                           [28, 29, 30, 40, 41, 0, 0, 0]])
  np.testing.assert_array_equal(b.cu_seqlens, [[0, 8, 8], [0, 5, 8], [0, 3, 5]])
  np.testing.assert_array_equal(b.positions[2], [0, 1, 2, 0, 1, 0, 0, 0])
  np.testing.assert_array_equal(b.labels[1], [2, 3, 4, 5, 0, 11, 12, 0])
  np.testing.assert_array_equal(b.document_offsets[:, 0], [0, 0, 8])
  g = data.pack_documents(docs, 8, strategy="greedy")
  np.testing.assert_array_equal(g.cu_seqlens, [[0, 5, 8], [0, 8, 8], [0, 3, 5]])
  assert set(b.to_dict()) == {"tokens", "segment_ids", "positions", "cu_seqlens", "labels",
                              "loss_mask", "document_ids", "document_offsets"}


def test_best_fit_packs_tighter_than_greedy():
  rng = np.random.default_rng(1)
  docs = [rng.integers(1, 9, n) for n in rng.integers(1, 600, 300)]
  best = data.pack_documents(docs, 1024)
  greedy = data.pack_documents(docs, 1024, strategy="greedy")
  assert best.num_rows < greedy.num_rows
  assert best.num_rows <= -(-sum(map(len, docs)) // 1024) + 2


def test_errors():
  with pytest.raises(ValueError, match="seq_len"):
    data.pack_documents([[1, 2]], 0)
  with pytest.raises(ValueError, match="Unknown strategy"):
    data.pack_documents([[1, 2]], 4, strategy="first_fit")
  with pytest.raises(ValueError, match="max_docs_per_row"):
    data.pack_documents([[1, 2]], 4, max_docs_per_row=0)
  with pytest.raises(ValueError, match=r"documents\[1\] must be a 1-D"):
    data.pack_documents([[1, 2], [[1, 2]]], 4)
  with pytest.raises(ValueError, match=r"documents\[0\] must hold integer"):
    data.pack_documents([np.array([1.5])], 4)
  with pytest.raises(ValueError, match="batch_size"):
    next(data.iter_packed_batches([[1]], 4, 0))
  empty = data.pack_documents([], 4)
  assert empty.tokens.shape == (0, 4) and empty.cu_seqlens.shape == (0, 2)
