"""One rank's shared-region call of a placed row on one GPU: its shared queries against the
gathered shared keys, with the keys in rank order (as the all-gather leaves them) and sorted by
(segment, position) in 128-token blocks (as jaxcp runs them), forward and forward+backward;
beside them the whole row on one GPU and the rank's local part, and where a shard is all shared
its queries against its own keys and against the others' (the two calls of a split shard), and
the backward kernels of those two calls chained (as jaxcp runs them) and whole.
bench_cp.py's problem and placement (the committed calibration).

  python3 tools/probe_key_order.py [--heads 16 16] [--mix doc8k] [--seq 131072] [--gpus 4] [--groups 2]
"""
import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import common  # noqa: E402
from bench_cp import in_document_order, sort_block  # noqa: E402
import doc_mixes  # noqa: E402

import jaxcp  # noqa: E402

D = 128
CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "results",
                           "placement_calibration_h200.json")


def timed(qs, qp, ks, kp, heads, label):
  """Forward and forward+backward times of jaxcp.attention (causal) on these token arrays."""
  hq, hkv = heads
  key = jax.random.PRNGKey(0)
  q, do = (jax.random.normal(jax.random.fold_in(key, i), (1, len(qs), hq, D), jnp.bfloat16) for i in (0, 1))
  k, v = (jax.random.normal(jax.random.fold_in(key, i), (1, len(ks), hkv, D), jnp.bfloat16) for i in (2, 3))
  tokens = [jnp.asarray(x[None].astype(np.int32)) for x in (qs, qp, ks, kp)]

  def attend(q, k, v, seg, pos, kv_seg, kv_pos):
    return jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, kv_segment_ids=kv_seg, kv_positions=kv_pos,
                           is_causal=True)

  def loss(q, k, v, *t):
    return jnp.sum(attend(q, k, v, *t).astype(jnp.float32) * do.astype(jnp.float32))

  t = common.time_interleaved({"fwd": (jax.jit(attend), (q, k, v, *tokens)),
                               "fwd+bwd": (jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v, *tokens))})
  print(f"{label:40s} queries {len(qs):6d} keys {len(ks):6d}: forward {t['fwd'] * 1e3:7.3f} ms, "
        f"forward+backward {t['fwd+bwd'] * 1e3:7.3f} ms", flush=True)
  return t


def two_backwards(qs, qp, first, second, heads, label):
  """The backward kernels of the queries against two key sets (the others' keys, then the rank's
  own), as jaxcp runs them on the GPU (chained: primitive.LocalBwd.begin / end) and as two whole
  calls whose dQ are summed."""
  from jaxcp._src.attention.primitive import AttentionConfig, LocalBwd, fwd_kernel
  from jaxcp._src.mask_spec import MaskSpec
  hq, hkv = heads
  config = AttentionConfig(mask=MaskSpec(is_causal=True), scale=D ** -0.5)
  local = LocalBwd(config)
  key = jax.random.PRNGKey(1)
  q, do = (jax.random.normal(jax.random.fold_in(key, i), (1, len(qs), hq, D), jnp.bfloat16) for i in (0, 1))
  tok = lambda x: jnp.asarray(x[None].astype(np.int32))
  sets = [(*(jax.random.normal(jax.random.fold_in(key, 2 + 2 * j + i), (1, len(ks[0]), hkv, D), jnp.bfloat16)
             for i in (0, 1)), tok(ks[0]), tok(ks[1])) for j, ks in enumerate((first, second))]
  k_all, v_all, seg_all, pos_all = (jnp.concatenate(x, axis=1) for x in zip(*sets))
  out, lse = jax.jit(lambda *a: fwd_kernel(*a, config))(q, k_all, v_all, tok(qs), tok(qp), seg_all, pos_all)
  dlse = jnp.zeros_like(lse)
  args = lambda s: (q, s[0], s[1], out, lse, do, dlse, tok(qs), tok(qp), s[2], s[3])

  if not local.chains(q, sets[0][0], sets[1][0]):
    print(f"{label} shared: the backward does not chain here (CUDA sm_90a only)")
    return

  def chained():
    state, *grads_first = local.begin(*args(sets[0]), then_k=sets[1][0])
    return grads_first, local.end(state, *args(sets[1]))

  def whole():
    (dq0, *g0), (dq1, *g1) = local(*args(sets[0])), local(*args(sets[1]))
    return g0, ((dq0.astype(jnp.float32) + dq1.astype(jnp.float32)).astype(dq0.dtype), *g1)

  t = common.time_interleaved({"chained": (jax.jit(chained), ()), "whole": (jax.jit(whole), ())})
  print(f"{label} shared, backward of both calls: chained {t['chained'] * 1e3:7.3f} ms, "
        f"two whole calls and the dQ sum {t['whole'] * 1e3:7.3f} ms", flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--heads", type=int, nargs=2, default=[16, 16])
  ap.add_argument("--mix", default="doc8k", choices=list(doc_mixes.MIXES))
  ap.add_argument("--seq", type=int, default=131072)
  ap.add_argument("--gpus", type=int, default=4, help="the ranks the row is placed for")
  ap.add_argument("--groups", type=int, default=0, help="let choose_placement share within groups of this size")
  a = ap.parse_args()
  with open(CALIBRATION) as f:
    cal = json.load(f)
  cost = dict(token_cost=cal["token_cost"], pair_cost=cal["pair_cost"])
  seg = doc_mixes.packed_row(np.random.default_rng(0), a.seq, a.mix)[None]
  seg, _ = doc_mixes.placeable(seg, a.gpus, **cost)
  pos = doc_mixes.positions(seg)
  n = a.gpus
  placement, perm, _ = jaxcp.choose_placement(seg, n, **cost, groups=(a.groups, n) if a.groups else None)
  print(placement)
  s2, p2 = seg[0][perm[0]], pos[0][perm[0]]
  shard = a.seq // n
  r = placement.shared_tokens
  c, g = shard - r, placement.group_size(n)
  whole = timed(seg[0], pos[0], seg[0], pos[0], a.heads, "whole row, one GPU")
  print(f"  whole / {n}: forward {whole['fwd'] / n * 1e3:.3f} ms, forward+backward {whole['fwd+bwd'] / n * 1e3:.3f} ms")
  for rank in range(min(n, 2)):
    lo = rank * shard
    if c:
      timed(s2[lo:lo + c], p2[lo:lo + c], s2[lo:lo + c], p2[lo:lo + c], a.heads, f"rank {rank} local")
    if r:
      first = rank // g * g
      keys = np.concatenate([np.arange(j * shard + c, (j + 1) * shard) for j in range(first, first + g)])
      qs, qp = s2[lo + c:lo + shard], p2[lo + c:lo + shard]
      timed(qs, qp, s2[keys], p2[keys], a.heads, f"rank {rank} shared, keys in rank order")
      by_doc = in_document_order(keys, s2, p2, sort_block(r))
      timed(qs, qp, s2[by_doc], p2[by_doc], a.heads, f"rank {rank} shared, keys sorted by block")
      if not c:  # everything shared: the two calls a split shard runs (context_parallel._own_keys_first)
        own = np.arange(lo, lo + shard)
        others = np.setdiff1d(keys, own)
        timed(qs, qp, s2[own], p2[own], a.heads, f"rank {rank} shared, its own keys")
        timed(qs, qp, s2[others], p2[others], a.heads, f"rank {rank} shared, the others' keys")
        two_backwards(qs, qp, (s2[others], p2[others]), (s2[own], p2[own]), a.heads, f"rank {rank}")


if __name__ == "__main__":
  main()
