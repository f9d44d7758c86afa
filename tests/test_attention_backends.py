"""The shared cases of tests/attention_cases.py on every backend: the pure-JAX reference ("xla")
and the CPU kernels in float32, the CUDA kernels in bfloat16 (`gpu` marker). Outputs and LSE
against an independent float64 NumPy oracle; gradients against the reference's in float32."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcp
from jaxcp._src.masks import token_arrays

from .attention_cases import CASES
from .helpers import numpy_attention, rel_err

B = 2
BACKENDS = {
    "xla": (jnp.float32, 1e-5),
    "cpu": (jnp.float32, 1e-5),
    "cuda": (jnp.bfloat16, 2e-2),
}


def _inputs(case, seed=0):
  rng = np.random.default_rng(seed)
  hq, hkv = case.heads
  dv = case.value_dim or case.head_dim
  shapes = [(B, case.q_len, hq, case.head_dim), (B, case.kv_len, hkv, case.head_dim), (B, case.kv_len, hkv, dv),
            (B, case.q_len, hq, dv)]
  return [rng.standard_normal(s).astype(np.float32) for s in shapes], case.token_kwargs(rng, B)


def _run(case, impl, dtype, q, k, v, do, tokens):
  def f(q, k, v):
    return jaxcp.attention(q, k, v, implementation=impl, return_residual=True, **tokens, **case.mask)
  (out, lse), vjp = jax.vjp(f, *(jnp.asarray(x, dtype) for x in (q, k, v)))
  return out, lse, vjp((jnp.asarray(do, dtype), jnp.zeros_like(lse)))


@pytest.mark.parametrize("backend", [
    "xla", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(backend, case):
  dtype, tol = BACKENDS[backend]
  (q, k, v, do), tokens = _inputs(case)
  out, lse, grads = jax.jit(lambda *a: _run(case, backend, dtype, *a, tokens))(q, k, v, do)
  # The oracle sees the inputs as the backend does (rounded to its dtype).
  rounded = [np.asarray(jnp.asarray(x, dtype), np.float32) for x in (q, k, v)]
  q_seg, q_pos, kv_seg, kv_pos = (np.asarray(x) for x in token_arrays(
      B, case.q_len, case.kv_len, segment_ids=tokens.get("segment_ids"), positions=tokens.get("positions"),
      kv_segment_ids=tokens.get("kv_segment_ids"), kv_positions=None, cu_seqlens=tokens.get("cu_seqlens")))
  want_out, want_lse = numpy_attention(*rounded, q_seg, q_pos, kv_seg, kv_pos,
                                       causal=case.mask.get("is_causal", False),
                                       window=case.mask.get("local_window_size"), chunk=case.mask.get("chunk_size"))
  assert out.shape == want_out.shape and out.dtype == dtype
  assert rel_err(out, want_out) < tol
  lse = np.asarray(lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  fin = np.isfinite(want_lse)
  np.testing.assert_allclose(lse[fin], want_lse[fin], atol=10 * tol, rtol=tol)
  # Gradients against the reference's, float32 from the same rounded inputs.
  ref = jax.jit(lambda *a: _run(case, "xla", jnp.float32, *a, tokens))(*rounded, do)[2]
  for name, g, r in zip("qkv", grads, ref):
    assert not np.isnan(np.asarray(g, np.float32)).any(), name
    assert rel_err(g, r) < 2 * tol, name
  # Queries with no allowed key: output, LSE and dq exactly zero / -inf.
  dead = np.isneginf(want_lse).transpose(0, 2, 1)   # [B, Sq, Hq]
  assert np.all(np.asarray(out, np.float32)[dead] == 0)
  assert np.all(np.asarray(grads[0], np.float32)[dead] == 0)
