"""custom_partitioning of the attention primitives over batch (DP) and heads (TP).

The batch axis and the head axis shard with no communication: every shard runs the kernel on
its own rows and heads. Query heads and key/value heads must agree (GQA groups may not be split
across a key/value head), which gives three cases for heads sharded n ways:
  kv heads divisible by n  -> kv heads sharded like query heads;
  each shard's query heads inside one kv head (n >= Hkv, e.g. MQA) -> K/V replicated on heads
      and each shard slices its kv head (the backward then sums dK/dV over the head axis);
  otherwise -> heads replicated.
A sharded query sequence axis is context parallelism: when K/V are sharded on the sequence too,
the partition runs `context_parallel` (all-gather, ring or a document placement) over that mesh axis; when K/V are not
sharded on the sequence (e.g. cross attention to a short context), every rank attends to all of
K/V with no communication.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import compat
from ..primitive_utils import mesh_axis_size, spec_of
from . import context_parallel
from .primitive import LocalBwd, attention_bwd_p, attention_fwd_p, bwd_kernel, fwd_kernel

# The partitioned functions take the config first (static), then the arrays: the forward's
#   q, k, v, q_seg, q_pos, kv_seg, kv_pos
# and the backward's
#   q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos[, the forward's kept arrays]
# where a DocumentPlacement keeps what its forward gathered (context_parallel.keeps_gathered):
# the forward returns them after (out, lse), replicated over the context-parallel axis, or with
# grouped shared regions sharded over it (each rank's block its group's gathered tokens).
_BWD_ARGS = 11


@dataclasses.dataclass(frozen=True)
class Layout:
  """The shardings chosen for one call: mesh axes (or None) per logical dimension."""
  batch: object
  q_heads: object
  kv_heads: object
  slice_kv_head: bool   # shards pick their single kv head out of replicated K/V
  q_seq: object = None
  kv_seq: object = None

  def q4(self):  # [B, S, Hq, D]
    return P(self.batch, self.q_seq, self.q_heads, None)

  def kv4(self):  # [B, S, Hkv, D]
    return P(self.batch, self.kv_seq, self.kv_heads, None)

  def lse(self):  # [B, Hq, S]
    return P(self.batch, self.q_heads, self.q_seq)

  def q_tok(self):  # [B, Sq]
    return P(self.batch, self.q_seq)

  def kv_tok(self):  # [B, Skv]
    return P(self.batch, self.kv_seq)


def choose_layout(mesh, q, k) -> Layout:
  qspec, kspec = spec_of(q, 4), spec_of(k, 4)
  batch, heads, seq = qspec[0], qspec[2], qspec[1]
  b, sq, hq, _ = q.shape
  skv, hkv = k.shape[1], k.shape[2]
  if b % mesh_axis_size(mesh, batch):
    batch = None
  n_seq = mesh_axis_size(mesh, seq)
  if seq is not None and (sq % n_seq or skv % n_seq):
    seq = None
  kv_seq = seq if (seq is not None and kspec[1] is not None) else None
  n = mesh_axis_size(mesh, heads)
  if heads is None or hq % n:
    return Layout(batch, None, None, False, seq, kv_seq)
  if hkv % n == 0:
    return Layout(batch, heads, heads, False, seq, kv_seq)
  group, local_q = hq // hkv, hq // n
  if group % local_q == 0:
    return Layout(batch, heads, None, True, seq, kv_seq)
  return Layout(batch, None, None, False, seq, kv_seq)


def _cp_plan(config, mesh, layout: Layout, q, k):
  """(strategy, cp_size) when K/V are sharded over a context-parallel axis, else None."""
  if layout.kv_seq is None:
    return None
  cp_size = mesh_axis_size(mesh, layout.kv_seq)
  strategy = context_parallel.choose_strategy(
      config.context_parallel, cp_size, q.shape[1] // cp_size, k.shape[1] // cp_size, q.shape[2], k.shape[2])
  return strategy, cp_size


def _kv_head_slicer(layout: Layout, hq: int, n_heads: int):
  """For shards whose query heads all use one kv head: picks it out of replicated K/V."""
  if not layout.slice_kv_head:
    return None

  def head_index(hkv):
    return (context_parallel.axis_index(layout.q_heads) * (hq // n_heads)) // (hq // hkv)

  return head_index


def _kept_shardings(layout, keep):
  """Of the forward's kept arrays: every rank holds all of them (no sequence sharding), or with
  grouped shared regions (keep == "per_rank") its own block of them."""
  if not keep:
    return ()
  seq = layout.kv_seq if keep == "per_rank" else None
  kv, tok = P(layout.batch, seq, layout.kv_heads, None), P(layout.batch, seq)
  return (kv, kv, tok, tok)


def _fwd_shardings(layout, keep):
  args = (layout.q4(), layout.kv4(), layout.kv4(), layout.q_tok(), layout.q_tok(),
          layout.kv_tok(), layout.kv_tok())
  return args, (layout.q4(), layout.lse(), *_kept_shardings(layout, keep))


def _bwd_shardings(layout, keep):
  args = (layout.q4(), layout.kv4(), layout.kv4(), layout.q4(), layout.lse(), layout.q4(),
          layout.lse(), layout.q_tok(), layout.q_tok(), layout.kv_tok(), layout.kv_tok(),
          *_kept_shardings(layout, keep))
  return args, (layout.q4(), layout.kv4(), layout.kv4())


def _keeps(config, q, k):
  """False, True (the kept arrays replicated over the CP axis) or "per_rank" (sharded over it), for
  the whole problem's q and k (shapes)."""
  strategy = config.context_parallel
  if not context_parallel.keeps_gathered(strategy):
    return False
  return "per_rank" if context_parallel.kept_per_rank(strategy, k.shape[1], q.shape[2], k.shape[2]) else True


def _with_head(x, h, like_heads):
  """A one-kv-head array (this shard's head h) inside zeros of all heads: the kept arrays are
  declared with every kv head where shards slice theirs out of replicated K/V; the backward reads
  head h back only."""
  full = jnp.zeros(x.shape[:2] + (like_heads,) + x.shape[3:], x.dtype)
  return jax.lax.dynamic_update_slice_in_dim(full, x, h, axis=2)


def _named(mesh, specs):
  return tuple(NamedSharding(mesh, s) for s in specs)


# ---------------------------------------------------------------- forward


def _fwd_unpartitioned(config, q, k, v, q_seg, q_pos, kv_seg, kv_pos):
  """The forward on whole arrays: (out, lse), and what a placement keeps, taken from the row."""
  out, lse = fwd_kernel(q, k, v, q_seg, q_pos, kv_seg, kv_pos, config)
  if not _keeps(config, q, k):
    return out, lse
  heads = (q.shape[2], k.shape[2])
  return (out, lse, *context_parallel.shared_of_row(config.context_parallel, heads, k, v, kv_seg, kv_pos))


def _fwd_infer(config, mesh, arg_shapes, result_shape):
  layout = choose_layout(mesh, arg_shapes[0], arg_shapes[1])
  return _named(mesh, _fwd_shardings(layout, _keeps(config, *arg_shapes[:2]))[1])


def _fwd_partition(config, mesh, arg_shapes, result_shape):
  q, k = arg_shapes[0], arg_shapes[1]
  layout = choose_layout(mesh, q, k)
  keep = _keeps(config, q, k)
  arg_specs, out_specs = _fwd_shardings(layout, keep)
  head_index = _kv_head_slicer(layout, q.shape[2], mesh_axis_size(mesh, layout.q_heads))
  plan = _cp_plan(config, mesh, layout, q, k)
  heads = (q.shape[2], k.shape[2])  # the whole problem's (the kept arrays' shapes follow them)
  local = lambda *a: fwd_kernel(*a, config)

  def lower(q, k, v, q_seg, q_pos, kv_seg, kv_pos):
    k_all, v_all = k, v
    if head_index is not None:
      h = head_index(k.shape[2])
      k, v = (jax.lax.dynamic_slice_in_dim(x, h, 1, axis=2) for x in (k, v))
    if plan is None:
      kept = (context_parallel.shared_of_row(config.context_parallel, heads, k_all, v_all, kv_seg, kv_pos)
              if keep else ())
      return (*local(q, k, v, q_seg, q_pos, kv_seg, kv_pos), *kept)
    strategy, cp_size = plan
    out, lse, kept = context_parallel.cp_fwd(strategy, local, layout.kv_seq, cp_size,
                                             q, k, v, q_seg, q_pos, kv_seg, kv_pos, heads=heads)
    if kept and head_index is not None:
      kept = (_with_head(kept[0], h, k_all.shape[2]), _with_head(kept[1], h, v_all.shape[2]), *kept[2:])
    return (out, lse, *kept)

  return mesh, lower, _named(mesh, out_specs), _named(mesh, arg_specs)


_KEPT_FACTORS = ", b u g d, b u g e, b u, b u"  # u: the gathered shared tokens


def _rule(config, rule, q, k):
  """A sharding rule string (t: the key tokens) with the kept arrays' factors after each `{kept}`,
  and its factor sizes. Kept per rank, the key tokens are (c x), c the CP ranks, and the kept ones
  (c u): sharding the keys over the CP axis shards the kept blocks over it too."""
  keep = _keeps(config, q, k)
  if keep != "per_rank":
    return rule.replace("{kept}", _KEPT_FACTORS if keep else "")
  cp = config.context_parallel.cp_size
  rule = rule.replace("{kept}", _KEPT_FACTORS.replace(" u", " (c u)")).replace(" t", " (c x)")
  kv_len = k.shape[1]
  return rule, dict(c=cp, x=kv_len // cp,
                    u=context_parallel.gathered_tokens(config.context_parallel, kv_len, q.shape[2], k.shape[2]) // cp)


def _fwd_rule(config, mesh, value_types, result_types):
  rule = "b s h d, b t g d, b t g e, b s, b s, b t, b t -> b s h e, b h s{kept}"  # e: V's head dim
  return _rule(config, rule, *value_types[:2])


# ---------------------------------------------------------------- backward


def _bwd_unpartitioned(config, *args):
  """The backward on whole arrays (the forward's kept arrays, if any, are not needed)."""
  return bwd_kernel(*args[:_BWD_ARGS], config)


def _bwd_infer(config, mesh, arg_shapes, result_shape):
  layout = choose_layout(mesh, arg_shapes[0], arg_shapes[1])
  return _named(mesh, _bwd_shardings(layout, _keeps(config, *arg_shapes[:2]))[1])


def _bwd_partition(config, mesh, arg_shapes, result_shape):
  q, k = arg_shapes[0], arg_shapes[1]
  layout = choose_layout(mesh, q, k)
  arg_specs, out_specs = _bwd_shardings(layout, _keeps(config, q, k))
  head_index = _kv_head_slicer(layout, q.shape[2], mesh_axis_size(mesh, layout.q_heads))
  plan = _cp_plan(config, mesh, layout, q, k)
  heads = (q.shape[2], k.shape[2])  # the whole problem's (the kept arrays' shapes follow them)
  local = LocalBwd(config)

  def grads(q, k, v, *rest, kept=()):
    if plan is None:
      return local(q, k, v, *rest)
    strategy, cp_size = plan
    return context_parallel.cp_bwd(strategy, local, layout.kv_seq, cp_size, q, k, v, *rest, kept=kept, heads=heads)

  def lower(q, k, v, *rest):
    rest, kept = rest[:_BWD_ARGS - 3], rest[_BWD_ARGS - 3:]
    if head_index is None:
      return grads(q, k, v, *rest, kept=kept)
    h = head_index(k.shape[2])
    k1, v1 = (jax.lax.dynamic_slice_in_dim(x, h, 1, axis=2) for x in (k, v))
    if kept:
      kept = (*(jax.lax.dynamic_slice_in_dim(x, h, 1, axis=2) for x in kept[:2]), *kept[2:])
    dq, dk1, dv1 = grads(q, k1, v1, *rest, kept=kept)
    # Several shards share this kv head: place the partial gradient and sum over the head axis.
    def place(g, like):
      full = jax.lax.dynamic_update_slice_in_dim(
          jnp.zeros(like.shape, jnp.float32), g.astype(jnp.float32), h, axis=2)
      return jax.lax.psum(full, layout.q_heads).astype(like.dtype)
    return dq, place(dk1, k), place(dv1, v)

  return mesh, lower, _named(mesh, out_specs), _named(mesh, arg_specs)


def _bwd_rule(config, mesh, value_types, result_types):
  rule = "b s h d, b t g d, b t g e, b s h e, b h s, b s h e, b h s, b s, b s, b t, b t{kept} -> b s h d, b t g d, b t g e"
  return _rule(config, rule, *value_types[:2])


# ---------------------------------------------------------------- wiring

_fwd_cp = compat.custom_partitioning(_fwd_unpartitioned, static_argnums=(0,))
_fwd_cp.def_partition(partition=_fwd_partition, infer_sharding_from_operands=_fwd_infer,
                      sharding_rule=_fwd_rule)
_bwd_cp = compat.custom_partitioning(_bwd_unpartitioned, static_argnums=(0,))
_bwd_cp.def_partition(partition=_bwd_partition, infer_sharding_from_operands=_bwd_infer,
                      sharding_rule=_bwd_rule)


def _partitioned_fwd(*args, config):
  return _fwd_cp(config, *args)


def _partitioned_bwd(*args, config):
  return _bwd_cp(config, *args)


compat.mlir.register_lowering(attention_fwd_p, compat.mlir.lower_fun(_partitioned_fwd, multiple_results=True))
compat.mlir.register_lowering(attention_bwd_p, compat.mlir.lower_fun(_partitioned_bwd, multiple_results=True))
