"""A small packed-attention forward+backward (and its deterministic backward) for compute-sanitizer
(no XLA autotuning noise). Head dims from the command line, default all; D:DV gives V a head dim
of its own; --forward runs the forward alone: python3 sanitizer_case.py [--forward] 192 192:128"""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxcp  # noqa: E402

seg = np.repeat(np.arange(1, 6, dtype=np.int32), [1, 70, 33, 100, 46])[None].repeat(2, 0)
seg[1, 200:] = 0
# 96, 192: sm_90a's own tiles; 192:128, multi-head latent attention's (V 128 in the sm_90a kernels).
forward_only = "--forward" in sys.argv
dims = [tuple(int(x) for x in (a + ":" + a.split(":")[0]).split(":")[:2])
        for a in [a for a in sys.argv[1:] if a != "--forward"] or ("64", "96", "128", "192", "256", "192:128")]
# 4 query heads on 2 kv heads: the sm_90a backward splits the groups (float32 partial dK / dV);
# 2 on 2: one block per key tile and head, dK / dV by TMA stores (the last key tile ragged).
for q_heads in (4, 2):
  for d, dv in dims:
    for deterministic in (False,) if forward_only else (False, True):
      key = jax.random.PRNGKey(d)
      q = jax.random.normal(key, (2, 250, q_heads, d), jnp.bfloat16)
      k = jax.random.normal(jax.random.fold_in(key, 1), (2, 250, 2, d), jnp.bfloat16)
      v = jax.random.normal(jax.random.fold_in(key, 2), (2, 250, 2, dv), jnp.bfloat16)
      do = jax.random.normal(jax.random.fold_in(key, 3), (2, 250, q_heads, dv), jnp.bfloat16)
      def attend(q, k, v, deterministic=deterministic):
        return jaxcp.attention(q, k, v, segment_ids=seg, is_causal=True, local_window_size=(40, 0),
                               deterministic=deterministic)
      f = jax.jit(attend if forward_only else lambda q, k, v: jax.vjp(attend, q, k, v)[1](do))
      jax.block_until_ready(f(q, k, v))
print("sanitizer case done")
