"""The float64 rounding model that the GPU property tests' gradient tolerance rests on
(tests/rounded_reference.py), and that tolerance's rule (helpers.grads_close)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcp
from jaxcp._src.masks import positions_from_segments

from .helpers import allowed_pairs, grads_close, random_segments, rel_err
from .rounded_reference import attention_grads

MASK = dict(is_causal=True, local_window_size=(10, 0))


def _case(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  b, s, hq, hkv, d = 2, 96, 4, 2, 32
  seg = random_segments(rng, b, s, mean_doc=20)
  pos = np.asarray(positions_from_segments(jnp.asarray(seg)))
  shapes = [(b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, hq, d)]
  q, k, v, do = (jnp.asarray(rng.standard_normal(x), dtype) for x in shapes)
  pairs = allowed_pairs(seg, pos, seg, pos, causal=True, window=(10, 0))
  return (q, k, v, do), seg, pos, pairs


def test_exact_model_matches_autodiff():
  """Exact mode: the forward and the VJP of jaxcp's XLA path (float32), GQA, causal window."""
  (q, k, v, do), seg, pos, pairs = _case()
  f = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, implementation="xla", **MASK)
  out, vjp = jax.vjp(f, q, k, v)
  for name, got, want in zip(["out", "dq", "dk", "dv"], attention_grads(q, k, v, do, pairs), (out, *vjp(do))):
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_rounded_model_is_off_by_rounding(dtype):
  """Rounding mode moves every tensor by about the dtype's precision: more than nothing, less
  than a few of its units."""
  (q, k, v, do), _, _, pairs = _case(dtype)
  unit = float(jnp.finfo(dtype).eps)
  for name, exact, rounded in zip(["out", "dq", "dk", "dv"], attention_grads(q, k, v, do, pairs),
                                  attention_grads(q, k, v, do, pairs, rounding=dtype)):
    assert 0.05 * unit < rel_err(rounded, exact) < 4 * unit, name


ROWS = 100


def _off(first_row_err):
  """A 100 x 8 gradient of ones whose first row is off by first_row_err (relative)."""
  x = np.ones((ROWS, 8))
  x[0] *= 1 + first_row_err
  return x


def _grads(first_row_err):
  """(name, got, reference, zero rows) of one gradient whose first row is off."""
  return [("dq", _off(first_row_err), _off(0.0), np.zeros(ROWS, bool))]


def test_grads_close_within_tol_needs_no_model():
  grads_close(_grads(0.05), lambda: pytest.fail("model computed"))


def test_grads_close_allows_what_rounding_explains():
  """A row 0.2 off passes where the model rounds it 0.1 off, and fails where it rounds it 0.05
  off; a row 1.0 off fails."""
  model = lambda row_err: lambda: ([_off(0.0)], [_off(row_err)])
  grads_close(_grads(0.2), model(0.1))
  with pytest.raises(AssertionError, match="row 0"):
    grads_close(_grads(0.2), model(0.05))
  with pytest.raises(AssertionError):  # by the whole tensor's error already
    grads_close(_grads(1.0), model(0.1))
