"""Bad input raises ValueError at trace time, naming the argument."""
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcp

B, S, H, D = 2, 8, 4, 8
Q = jnp.zeros((B, S, H, D), jnp.float32)
K = jnp.zeros((B, S, 2, D), jnp.float32)
SEG = np.ones((B, S), np.int32)

BAD = [
    (dict(query=jnp.zeros((B, S, H))), "query"),
    (dict(key=jnp.zeros((B, S, 3, D))), "multiple"),
    (dict(key=jnp.zeros((B, S, 2, D + 1)), value=jnp.zeros((B, S, 2, D + 1))), "head_dim"),
    (dict(value=jnp.zeros((B, S + 1, 2, D))), "same shape"),
    (dict(value=jnp.zeros((B, S, 1, D))), "same shape"),
    (dict(key=jnp.zeros((B + 1, S, 2, D)), value=jnp.zeros((B + 1, S, 2, D))), "batch"),
    (dict(query=jnp.zeros((B, S, H, D), jnp.int32)), "query"),
    (dict(query=jnp.zeros((B, S, H, D), jnp.bfloat16)), "dtype"),
    (dict(segment_ids=np.ones((B, S + 1), np.int32)), "segment_ids"),
    (dict(segment_ids=np.ones((B, S), np.float32)), "segment_ids"),
    (dict(positions=np.ones((B, 3), np.int32)), "positions"),
    (dict(kv_segment_ids=np.ones((B, 2), np.int32)), "kv_segment_ids"),
    (dict(kv_positions=np.ones((B, 2), np.int32)), "kv_positions"),
    (dict(cu_seqlens=np.array([[0, S], [0, S]]), segment_ids=SEG), "cu_seqlens"),
    (dict(cu_seqlens=np.array([[0, S]])), "cu_seqlens"),
    (dict(local_window_size=-1), "local_window_size"),
    (dict(local_window_size=(1, 2, 3)), "local_window_size"),
    (dict(local_window_size=1.5), "local_window_size"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=2.0), "chunk_size"),
    (dict(is_causal="yes"), "is_causal"),
    (dict(scale="big"), "scale"),
    (dict(implementation="triton"), "implementation"),
    (dict(implementation="cuda"), "implementation"),
    (dict(context_parallel="ulysses"), "context_parallel"),
    (dict(context_parallel_axis=3), "context_parallel_axis"),
    (dict(deterministic=1), "deterministic"),
]


@pytest.mark.parametrize("kwargs,needle", BAD, ids=[f"{i}-{n}" for i, (_, n) in enumerate(BAD)])
def test_bad_input_raises_value_error_naming_argument(kwargs, needle):
  kwargs = dict(kwargs)
  q = kwargs.pop("query", Q)
  k = kwargs.pop("key", K)
  v = kwargs.pop("value", k)
  if needle == "dtype":
    k = v = K
  with pytest.raises(ValueError, match=needle):
    jaxcp.attention(q, k, v, **kwargs)


def test_cross_attention_with_segment_ids_needs_kv_segment_ids():
  k = jnp.zeros((B, S + 4, 2, D))
  with pytest.raises(ValueError, match="kv_segment_ids"):
    jaxcp.attention(Q, k, k, segment_ids=SEG)


def test_cu_seqlens_needs_self_attention():
  k = jnp.zeros((B, S + 4, 2, D))
  with pytest.raises(ValueError, match="Sq == Skv"):
    jaxcp.attention(Q, k, k, cu_seqlens=np.array([[0, S], [0, S]]))
