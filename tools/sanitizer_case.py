"""Packed-attention forward+backward (and its deterministic backward) for compute-sanitizer (no
XLA autotuning noise). Head dims from the command line, default all; D:DV gives V a head dim of
its own; --forward runs the forwards alone; --sm80 runs the sm_80 kernels (the private kernel
option sm80_only), as an A100 would: python3 sanitizer_case.py [--forward] [--sm80] 192 192:128

Three shapes per head dim:
- short: 2 rows of 250 tokens (five documents, one of a single token; row 1 padded from 200),
  causal with a window of 40; 4 query heads on 2 kv heads (the sm_90a backward splits the groups:
  float32 partial dK / dV) and 2 on 2 (dK / dV by TMA stores, the last key tile ragged);
- long: 1 row of 4096 tokens, documents of 25-1276 tokens and 96 of padding, causal, 8 query
  heads on 2: more query tiles than multiprocessors, so that the persistent forward takes several
  tiles per block and reuses its shared memory, and the backward's query pipeline wraps around.
  Its backward also runs as two chained calls over the keys before and after token 1900
  (primitive.LocalBwd, as context parallelism's traded pairs run it; sm_90a only).
"""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxcp._src.attention.api import attention_with_options  # noqa: E402
from jaxcp._src.attention.primitive import AttentionConfig, LocalBwd, fwd_kernel  # noqa: E402
from jaxcp._src.kernel_options import AttentionKernelOptions  # noqa: E402
from jaxcp._src.mask_spec import MaskSpec  # noqa: E402

FLAGS = ("--forward", "--sm80")
forward_only = "--forward" in sys.argv
kernel_options = AttentionKernelOptions(sm80_only="--sm80" in sys.argv)
# 96, 192: sm_90a's own tiles; 192:128, multi-head latent attention's (V 128 in the sm_90a kernels).
dims = [tuple(int(x) for x in (a + ":" + a.split(":")[0]).split(":")[:2])
        for a in [a for a in sys.argv[1:] if a not in FLAGS] or ("64", "96", "128", "192", "256", "192:128")]

short_seg = np.repeat(np.arange(1, 6, dtype=np.int32), [1, 70, 33, 100, 46])[None].repeat(2, 0)
short_seg[1, 200:] = 0
long_lengths = np.random.default_rng(0).integers(1, 1500, 12)
long_seg = np.pad(np.repeat(np.arange(1, 13, dtype=np.int32), long_lengths)[:4000], (0, 96))[None]
# (segment ids, query heads, window)
one_doc_seg = np.ones((2, 1024), np.int32)
one_doc_seg[1, 900:] = 0
shapes = [(short_seg, 4, (40, 0)), (short_seg, 2, (40, 0)), (long_seg, 8, None), (one_doc_seg, 4, None)]

for seg, q_heads, window in shapes:
  b, s = seg.shape
  for d, dv in dims:
    for deterministic in (False,) if forward_only else (False, True):
      key = jax.random.PRNGKey(d)
      q = jax.random.normal(key, (b, s, q_heads, d), jnp.bfloat16)
      k = jax.random.normal(jax.random.fold_in(key, 1), (b, s, 2, d), jnp.bfloat16)
      v = jax.random.normal(jax.random.fold_in(key, 2), (b, s, 2, dv), jnp.bfloat16)
      do = jax.random.normal(jax.random.fold_in(key, 3), (b, s, q_heads, dv), jnp.bfloat16)

      def attend(q, k, v, seg=seg, window=window, deterministic=deterministic):
        return attention_with_options(q, k, v, segment_ids=seg, is_causal=True, local_window_size=window,
                                      deterministic=deterministic, kernel_options=kernel_options)
      f = jax.jit(attend if forward_only else lambda q, k, v: jax.vjp(attend, q, k, v)[1](do))
      jax.block_until_ready(f(q, k, v))
      if forward_only or seg is not long_seg or dv != d:
        continue
      config = AttentionConfig(mask=MaskSpec(is_causal=True), scale=d ** -0.5, deterministic=deterministic,
                               kernel=kernel_options)
      local, cut = LocalBwd(config), 1900
      tok = jnp.asarray(seg), jnp.asarray(np.cumsum(np.ones_like(seg), 1) - 1)
      if not local.chains(q, k[:, :cut], k[:, cut:]):
        continue

      def chained(q, k, v, do, seg, pos):
        out, lse = fwd_kernel(q, k, v, seg, pos, seg, pos, config)
        part = lambda lo, hi: (q, k[:, lo:hi], v[:, lo:hi], out, lse, do, jnp.zeros_like(lse), seg, pos,
                               seg[:, lo:hi], pos[:, lo:hi])
        state, *first = local.begin(*part(0, cut), then_k=k[:, cut:])
        return first, local.end(state, *part(cut, s))
      jax.block_until_ready(jax.jit(chained)(q, k, v, do, *tok))
      print(f"chained backward: D {d}, deterministic {deterministic}")
print("sanitizer case done")
