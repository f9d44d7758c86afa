"""Shared test utilities: random packed batches and error metrics."""
from __future__ import annotations

import re

import numpy as np
import jax.numpy as jnp


def random_segments(rng: np.random.Generator, batch: int, seq_len: int, *, mean_doc: float,
                    pad_tail: bool = True, min_doc: int = 1):
  """Random packed rows: segment ids 1..n (contiguous documents) with an optional padding tail."""
  seg = np.zeros((batch, seq_len), np.int32)
  for b in range(batch):
    t, doc = 0, 1
    end = seq_len - (rng.integers(0, max(1, seq_len // 4)) if pad_tail else 0)
    while t < end:
      length = max(min_doc, int(rng.exponential(mean_doc)))
      seg[b, t:min(end, t + length)] = doc
      t += length
      doc += 1
  return seg


def positions_in_documents(seg: np.ndarray) -> np.ndarray:
  """Each token's position inside its document (segment id) of its row, counting from 0."""
  pos = np.zeros_like(seg)
  for row in range(seg.shape[0]):
    for doc in np.unique(seg[row]):
      at = seg[row] == doc
      pos[row, at] = np.arange(at.sum())
  return pos


def rel_err(a, b) -> float:
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  denom = np.linalg.norm(b)
  return float(np.linalg.norm(a - b) / (denom if denom > 0 else 1.0))


def qkv(rng: np.random.Generator, batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype):
  q = rng.standard_normal((batch, q_len, q_heads, head_dim)).astype(np.float32)
  k = rng.standard_normal((batch, kv_len, kv_heads, head_dim)).astype(np.float32)
  v = rng.standard_normal((batch, kv_len, kv_heads, head_dim)).astype(np.float32)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def allowed_pairs(q_seg, q_pos, kv_seg, kv_pos, *, causal=False, window=None, chunk=None):
  """[B, Sq, Skv] booleans: the (query, key) pairs that the mask model allows."""
  q_seg, q_pos, kv_seg, kv_pos = (np.asarray(x, np.int64) for x in (q_seg, q_pos, kv_seg, kv_pos))
  allowed = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] != 0)
  diff = q_pos[:, :, None] - kv_pos[:, None, :]
  if causal:
    allowed &= diff >= 0
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    allowed &= (diff <= left) & (-diff <= right)
  if chunk is not None:
    allowed &= (q_pos[:, :, None] // chunk) == (kv_pos[:, None, :] // chunk)
  return allowed


def numpy_attention(q, k, v, q_seg, q_pos, kv_seg, kv_pos, *, causal=False, window=None,
                    chunk=None, scale=None):
  """Independent float64 NumPy oracle of the mask model (shares no code with jaxcp)."""
  q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
  b, sq, hq, d = q.shape
  hkv = k.shape[2]
  scale = d ** -0.5 if scale is None else scale
  pairs = allowed_pairs(q_seg, q_pos, kv_seg, kv_pos, causal=causal, window=window, chunk=chunk)
  out = np.zeros((b, sq, hq, v.shape[3]))
  lse = np.full((b, hq, sq), -np.inf)
  for bi in range(b):
    for i in range(sq):
      allowed = pairs[bi, i]
      if not allowed.any():
        continue
      for h in range(hq):
        g = h // (hq // hkv)
        s = (k[bi, allowed, g] @ q[bi, i, h]) * scale
        m = s.max()
        p = np.exp(s - m)
        out[bi, i, h] = (p / p.sum()) @ v[bi, allowed, g]
        lse[bi, h, i] = m + np.log(p.sum())
  return out, lse


def rand(rng: np.random.Generator, shape, dtype, scale: float = 1.0):
  return jnp.asarray(scale * rng.standard_normal(shape).astype(np.float32), dtype)


def _rows(x, rows_leading):
  x = np.asarray(x if isinstance(x, np.ndarray) else jnp.asarray(x, jnp.float32), np.float64)
  return x.reshape((x.shape[0], -1) if rows_leading else (-1, x.shape[-1]))


def row_errors(got, want, *, rows_leading=False, floor=0.1):
  """Per-row relative error (rows over the last axis, or over the leading axis with
  rows_leading), each row's error over its norm or, if larger, `floor` times the rms of all
  rows' norms."""
  a, b = _rows(got, rows_leading), _rows(want, rows_leading)
  nb = np.linalg.norm(b, axis=1)
  return np.linalg.norm(a - b, axis=1) / np.maximum(nb, floor * np.sqrt(np.mean(nb ** 2)) + 1e-30)


def rows_close(got, want, tol, what, *, rows_leading=False, floor=0.1, zero_rows=None):
  """row_errors(got, want) < tol, row by row (`tol` a number, or one per row). Rows that must be
  exactly zero: `zero_rows` (booleans, one per row), or where not given, those whose reference
  is zero."""
  a = _rows(got, rows_leading)
  assert np.all(np.isfinite(a)), f"{what}: non-finite values"
  err = row_errors(a, want, rows_leading=rows_leading, floor=floor)
  tol = np.broadcast_to(np.asarray(tol, np.float64), err.shape)
  worst = int(np.argmax(err / tol))
  assert err[worst] < tol[worst], f"{what}: row {worst} relative error {err[worst]:.3g} >= {tol[worst]:.3g}"
  zero = np.linalg.norm(_rows(want, rows_leading), axis=1) == 0 if zero_rows is None \
      else np.asarray(zero_rows).reshape(-1)
  np.testing.assert_array_equal(a[zero], 0, err_msg=f"{what}: rows that must be zero")


GRAD_ROW_TOL = 0.1      # grads_close: every gradient row within this ...
GRAD_MODEL_MARGIN = 3.0  # ... or within this many times its error under the rounding model


def grads_close(grads, rounding_model, *, tol=GRAD_ROW_TOL, model_margin=GRAD_MODEL_MARGIN):
  """Gradients of a bfloat16 / float16 kernel against a reference, row by row: `grads` holds
  (name, got, reference, rows that must be zero). A gradient row can be a sum that cancels (a
  query with one allowed key has dq = 0 in exact arithmetic, and a rounding-sized one in a
  kernel), so each row's error is taken against the rms of all rows, not its own norm (floor
  1.0). Every row must be within `tol`, except where rounding alone moves it further: rows of
  peaky queries, whose dS is a difference of nearly equal terms. When any row misses `tol`,
  rounding_model() gives (exact, rounded): each gradient in float64, exact and with the roundings
  of a flash-attention kernel (tests/rounded_reference.py). Then each row is held, against the
  exact result, to `model_margin` times what those roundings give it (or `tol`, if larger)."""
  model = None
  for i, (name, got, want, zero_rows) in enumerate(grads):
    assert rel_err(got, want) < 0.4 * tol, name
    row_tol = tol
    if row_errors(got, want, floor=1.0).max() >= tol:
      model = model or rounding_model()
      exact, rounded = model[0][i], model[1][i]
      want, row_tol = exact, np.maximum(tol, model_margin * row_errors(rounded, exact, floor=1.0))
    rows_close(got, want, row_tol, name, floor=1.0, zero_rows=zero_rows)


def token_mask_bits(mask, s):
  """[B, s] booleans of small-seq token masks (bit t of mask[b] keeps token t; -1 keeps all)."""
  return ((np.asarray(mask)[:, None] >> np.arange(s)) & 1) == 1


def padded_small_seq_index(rng: np.random.Generator, b: int, s: int):
  """Padded small-seq lengths and token masks with the edge cases (out-of-range lengths,
  rows of length 0 and s, a row with every token masked off, half the rows unmasked), and the
  [B, s] tokens they leave valid."""
  lengths = rng.integers(-2, s + 3, b).astype(np.int32)  # out of range: clamped
  lengths[:2] = (0, s)
  mask = rng.integers(0, 1 << s, b).astype(np.int32)
  mask[rng.random(b) < 0.5] = -1
  mask[2] = 0  # a row with every token masked off
  valid = (np.arange(s)[None, :] < np.clip(lengths, 0, s)[:, None]) & token_mask_bits(mask, s)
  return lengths, mask, valid


def self_attention_rows_close(got, want, seg, pos, mask: dict, q_heads: int, kv_heads: int, tol: float = 1e-4):
  """(out, dq, dk, dv) of a self-attention call row by row against the reference's (rows_close),
  and exactly zero on the query and key rows that no pair of `mask` allows."""
  pairs = allowed_pairs(seg, pos, seg, pos, causal=mask.get("is_causal", False),
                        window=mask.get("local_window_size"), chunk=mask.get("chunk_size"))
  q_dead = np.repeat(~pairs.any(2), q_heads, axis=1)
  kv_dead = np.repeat(~pairs.any(1), kv_heads, axis=1)
  for name, g, r, dead in zip(["out", "dq", "dk", "dv"], got, want, [q_dead, q_dead, kv_dead, kv_dead]):
    rows_close(g, r, tol, name, floor=1.0, zero_rows=dead)



def placement_gathers(hlo_text: str):
  """The all-gathers of a compiled placed program, as shape lists: (the shared regions' packed K, V
  and key tokens, [B, g * R, 2 * Hkv * D + 2]; the blocks' first key tokens that the backward
  gathers to put the sorted keys' dK/dV back in rank order, [B, g * R / block, 2])."""
  shapes = [[int(x) for x in m.split(",")] for line in hlo_text.splitlines() if re.search(r" all-gather\(", line)
            for m in re.findall(r"= [fsu]32\[([\d,]+)\]", line)[:1]]
  return [s for s in shapes if s[-1] != 2], [s for s in shapes if s[-1] == 2]


def placement_trades(hlo_text: str):
  """The collective-permutes of a compiled placed program: (their result shapes, their
  source_target_pairs as lists of (source, target))."""
  shapes, pairs = [], []
  for line in hlo_text.splitlines():
    if re.search(r" collective-permute\(", line):
      shapes.append([int(x) for x in re.search(r"= [fsu]32\[([\d,]+)\]", line).group(1).split(",")])
      pairs.append([tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])])
  return shapes, pairs


def trades_keys(r: int, shard: int, group: int, hq: int, hkv: int) -> bool:
  """Whether a placed call trades its shared region with one partner rank (collective-permutes)
  instead of gathering: everything shared, in a group of two, up to OWN_KEYS_FIRST_MAX_GROUP query
  heads a key head (context_parallel.trades_with_partner)."""
  from jaxcp._src.attention.context_parallel import OWN_KEYS_FIRST_MAX_GROUP
  return r == shard and group == 2 and hq <= OWN_KEYS_FIRST_MAX_GROUP * hkv


def sorts_keys(r: int, shard: int, hq: int, hkv: int) -> bool:
  """Whether a placed call sorts its gathered shared keys: it has a shared region, and a local
  part or more than OWN_KEYS_FIRST_MAX_GROUP query heads a key head (context_parallel)."""
  from jaxcp._src.attention.context_parallel import OWN_KEYS_FIRST_MAX_GROUP
  return r > 0 and (r < shard or hq > OWN_KEYS_FIRST_MAX_GROUP * hkv)
