"""Small-sequence attention calls for compute-sanitizer: lengths out of range (clamped) or absent, ragged
cu_seqlens past the end, GQA, head dims 64-512, forward and gradients; the tensor-core kernels
(11 keys, groups of 3-4) and the lane-group kernels (5, 8 and 11 keys, groups of 1-2; 2-4 keys,
groups of 3-32, whose backward streams the group's heads; the forward of one head a task over 16
keys)."""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxcp import small_seq_attention  # noqa: E402

rng = np.random.default_rng(0)
r = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32), jnp.bfloat16)
def grads(f, q, k, v):
  out, pull = jax.vjp(f, q, k, v)
  return jax.block_until_ready((out,) + pull(jnp.ones_like(out)))
b, s = 3000, 11
lengths = jnp.asarray(rng.integers(-3, s + 4, b), jnp.int32)  # out of range: clamped
for hq, hkv, d in ((8, 2, 128), (6, 2, 256), (4, 4, 512), (4, 4, 64), (2, 1, 128)):  # last two: lane groups
  grads(lambda q, k, v: small_seq_attention(q, k, v, kv_lengths=lengths),
        r(b, hq, d), r(b, s, hkv, d), r(b, s, hkv, d))
lengths5 = jnp.asarray(rng.integers(-3, 9, b), jnp.int32)
for hq, hkv, d in ((4, 4, 64), (4, 2, 512), (3, 3, 128)):  # lane groups (3 x 128: half-empty warps)
  grads(lambda q, k, v: small_seq_attention(q, k, v, kv_lengths=lengths5),
        r(b, hq, d), r(b, 5, hkv, d), r(b, 5, hkv, d))
lengths4 = jnp.asarray(rng.integers(-3, 7, b), jnp.int32)
for hq, hkv, d, skv in ((8, 2, 64, 4), (9, 3, 128, 3), (32, 1, 256, 2)):  # lane groups, groups 3-32
  grads(lambda q, k, v: small_seq_attention(q, k, v, kv_lengths=jnp.minimum(lengths4, skv + 2)),
        r(b, hq, d), r(b, skv, hkv, d), r(b, skv, hkv, d))
for hq, hkv, d, skv in ((8, 2, 128, 11), (4, 4, 64, 5), (2, 2, 64, 1)):  # no kv_lengths: default index arrays
  grads(lambda q, k, v: small_seq_attention(q, k, v), r(b, hq, d), r(b, skv, hkv, d), r(b, skv, hkv, d))
lens = rng.integers(0, 21, b)
cu = np.concatenate([[5], 5 + np.cumsum(lens)]).astype(np.int32)
cu[-1] += 1000  # past the end: clamped
t = int(cu[-2]) + 7
grads(lambda q, k, v: small_seq_attention(q, k, v, kv_cu_seqlens=cu),
      r(b, 8, 64), r(t, 2, 64), r(t, 2, 64))
grads(lambda q, k, v: small_seq_attention(q, k, v, kv_cu_seqlens=cu, max_kv_len=8),
      r(b, 4, 128), r(t, 2, 128), r(t, 2, 128))  # lane groups, rows past 8 tokens cut
grads(lambda q, k, v: small_seq_attention(q, k, v, kv_cu_seqlens=cu, max_kv_len=4),
      r(b, 12, 64), r(t, 3, 64), r(t, 3, 64))  # lane groups of 4 heads, rows past 4 tokens cut
grads(lambda q, k, v: small_seq_attention(q, k, v, kv_cu_seqlens=cu),
      r(b, 4, 128), r(t, 4, 128), r(t, 4, 128))  # one head a task over 16 keys: lane-group forward
print("small-seq sanitizer case done")
