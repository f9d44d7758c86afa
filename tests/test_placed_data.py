"""jaxcp.data's placed batches: every document token exactly once over the stream (what does not
fit comes back in a later batch), each batch laid out for its DocumentPlacement, and labels and
loss mask that survive the permutation."""
import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import jaxcp
from jaxcp import data
from jaxcp._src.attention.placement import placement_violations


def _documents(rng, n, mean):
  lengths = np.maximum(1, rng.lognormal(np.log(mean) - 0.5, 1.0, n).astype(int))
  # Token t of document i is i * 10_000 + t: where a token came from is visible in the batch.
  return [np.arange(i * 10_000, i * 10_000 + m, dtype=np.int32) + 2 for i, m in enumerate(lengths)]


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**16), cp=st.sampled_from([2, 4, 8]), mean=st.sampled_from([6, 20, 60]),
                  strategy=st.sampled_from(data.PACKING_STRATEGIES))
def test_placed_stream_keeps_every_token(seed, cp, mean, strategy):
  seq_len, batch_size = 128, 3
  docs = _documents(np.random.default_rng(seed), 40, mean)
  seen = []
  for batch in data.iter_placed_batches(docs, seq_len, batch_size, cp, strategy=strategy, pad_id=0):
    assert isinstance(batch.placement, jaxcp.DocumentPlacement)
    assert batch.tokens.shape == (batch_size, seq_len) and batch.permutation.shape == (batch_size, seq_len)
    assert placement_violations(batch.segment_ids, cp, batch.placement) == []
    assert 0.0 <= batch.left_out < 1.0 and np.all(batch.imbalance >= 1.0 - 1e-9)
    original = {k: jaxcp.restore_order(v, cp, strategy=batch.permutation) for k, v in batch.arrays().items()}
    real = original["segment_ids"] != 0
    np.testing.assert_array_equal(original["tokens"] != 0, real)
    # Positions count up inside each document; labels are the next token of the same document.
    for b in range(batch_size):
      for sid in np.unique(original["segment_ids"][b][real[b]]):
        at = np.flatnonzero(original["segment_ids"][b] == sid)
        toks = original["tokens"][b, at]
        np.testing.assert_array_equal(original["positions"][b, at], np.arange(at.size))
        np.testing.assert_array_equal(np.diff(toks), 1)
        np.testing.assert_array_equal(original["labels"][b, at[:-1]], toks[1:])
        np.testing.assert_array_equal(original["loss_mask"][b, at], np.r_[np.ones(at.size - 1), 0])
    assert np.all(original["loss_mask"][~real] == 0)
    seen.append(original["tokens"][real])
  seen = np.sort(np.concatenate(seen)) if seen else np.zeros(0, np.int32)
  np.testing.assert_array_equal(seen, np.sort(np.concatenate(docs)))


def test_place_packed_reports_what_it_left_out():
  """A full row of short documents has no room for all of them once some are shared: the left
  out ones are marked against document_ids."""
  docs = [np.full(n, 5, np.int32) for n in [40, 30, 20, 10, 9, 8, 7, 4]]
  batch = data.pack_documents(docs, 128)
  placed, evicted = data.place_packed(batch, 4, sizes=(0, 8, 32))
  assert evicted.shape == batch.document_ids.shape
  left = sum(len(docs[i]) for i in batch.document_ids[evicted])
  assert placed.left_out == pytest.approx(left / sum(map(len, docs)))
  assert placement_violations(placed.segment_ids, 4, placed.placement) == []


def test_bad_cp():
  with pytest.raises(ValueError, match="cp must"):
    next(data.iter_placed_batches([np.ones(5, np.int32)], 30, 1, 4))


@pytest.mark.parametrize("shared", [0, 8, 32])
def test_one_static_size_cuts_what_no_region_holds(shared):
  """With one shared size, documents longer than both a local region and the shared region are
  cut into pieces that fit; the stream still ends and keeps every token."""
  cp, seq_len = 4, 128
  docs = _documents(np.random.default_rng(3), 12, 60) + [np.arange(500_000, 500_300, dtype=np.int32)]
  seen = []
  for batch in data.iter_placed_batches(docs, seq_len, 2, cp, sizes=(shared,)):
    assert batch.placement.shared_tokens == shared
    assert placement_violations(batch.segment_ids, cp, batch.placement) == []
    seen.append(batch.tokens[batch.segment_ids != 0])
  np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.sort(np.concatenate(docs)))
