"""Hypothesis strategies shared by the property tests: packed rows of documents."""
import numpy as np
from hypothesis import strategies as st

STARTS = [0, 0, 0, 1, 37, 500]  # a document's first position: mostly 0, else continued from another shard


@st.composite
def packed_row(draw, length, pieces, ids=None, max_pieces=40):
  """Segment ids and positions of one row of `length` tokens, as stretches of the kinds in
  `pieces` ({kind: (min, max) length}; kind "padding" is segment 0). Documents take ids 1, 2, ...,
  now and then one used before (one mask document with two stretches); with `ids`, they take
  those ids in turn (the key side of cross attention). After `max_pieces` stretches one last
  document takes the rest of the row, which bounds the draws."""
  seg = np.zeros(length, np.int32)
  pos = np.zeros(length, np.int32)
  t, doc = 0, 0
  for piece in range(max_pieces + 1):
    if t == length:
      break
    last = piece == max_pieces
    kind = None if last else draw(st.sampled_from(list(pieces)))
    n = length - t if last else min(draw(st.integers(*pieces[kind])), length - t)
    if kind != "padding":
      if ids is not None:
        sid = int(ids[doc % len(ids)])
      elif doc > 0 and draw(st.integers(0, 9)) == 0:
        sid = draw(st.integers(1, doc))
      else:
        sid = doc + 1
      doc += 1
      seg[t:t + n] = sid
      pos[t:t + n] = draw(st.sampled_from(STARTS)) + np.arange(n)
    t += n
  return seg, pos
