"""JAX primitives for packed-document attention.

Two layers, as in JAX's own cuDNN attention:
- `*_kernel_p` lowers to the FFI target `jaxcp_attention_<fwd|bwd>` of the current platform (on
  CUDA after `jaxcp_attention_<fwd|bwd>_plan`, which builds the tile plan it takes);
- `*_p` (the public-facing primitive) carries the batching rule (vmap folds into the batch
  axis); sharding.py gives it its lowering, through `custom_partitioning`, which places the
  kernel per shard.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import compat, cuda_capabilities
from ..kernel_options import AttentionKernelOptions
from ..mask_spec import MaskSpec
from ..primitive_utils import make_primitive, register_ffi_lowering
from .context_parallel import gathered_shapes, kept_per_rank, keeps_gathered

FWD_TARGET = "jaxcp_attention_fwd"
BWD_TARGET = "jaxcp_attention_bwd"


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static parameters of one attention call (hashable: it is a primitive parameter)."""
  mask: MaskSpec
  scale: float
  deterministic: bool = False
  context_parallel: object = "auto"     # "auto" | "all_gather" | "ring" | a DocumentPlacement
  context_parallel_axis: str | None = None  # explicit axis inside shard_map
  kernel: AttentionKernelOptions = AttentionKernelOptions()  # which CUDA kernels run

  def ffi_attrs(self, with_deterministic: bool) -> dict:
    """The attention handlers' attributes on every platform (ffi/common/attention_binding.h):
    the mask and scale as one dictionary, and the backward's deterministic flag."""
    attrs = {"mask": dict(self.mask.ffi_attrs(), scale=np.float32(self.scale))}
    if with_deterministic:
      attrs["deterministic"] = bool(self.deterministic)
    return attrs

  def cuda_ffi_attrs(self, with_deterministic: bool) -> dict:
    """The CUDA handlers' (plan handlers too): those of ffi_attrs and the kernel options."""
    return dict(self.ffi_attrs(with_deterministic), kernel=self.kernel.ffi_attrs())


# ---------------------------------------------------------------- kernel primitives


def _fwd_abstract(q, k, v, q_seg, q_pos, kv_seg, kv_pos, *, config):
  b, sq, hq, _ = q.shape
  return (compat.derived_aval(q, (b, sq, hq, v.shape[3]), q.dtype, (0, 1, 2, 3)),
          compat.derived_aval(q, (b, hq, sq), jnp.float32, (0, 2, 1)))


def _bwd_abstract(q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos, *, config):
  same = (0, 1, 2, 3)
  return (compat.derived_aval(q, q.shape, q.dtype, same),
          compat.derived_aval(k, k.shape, k.dtype, same),
          compat.derived_aval(v, v.shape, v.dtype, same))


def _with_workspace(abstract_eval):
  """The kernel primitives also return their device workspace (uint8, last result). The backward's
  phase "end" (bwd_end) takes the first call's workspace as an extra first operand."""
  def abstract(*avals, config, workspace_bytes, phase="whole"):
    outs = abstract_eval(*(avals[1:] if phase == "end" else avals), config=config)
    return outs + (compat.derived_aval(avals[0], (workspace_bytes,), jnp.uint8, (None,)),)
  return abstract


attention_fwd_kernel_p = make_primitive("jaxcp_attention_fwd_kernel", _with_workspace(_fwd_abstract))
attention_bwd_kernel_p = make_primitive("jaxcp_attention_bwd_kernel", _with_workspace(_bwd_abstract))
register_ffi_lowering(attention_fwd_kernel_p, FWD_TARGET, lambda config: config.ffi_attrs(False),
                      platforms=("cpu",))
register_ffi_lowering(attention_bwd_kernel_p, BWD_TARGET, lambda config: config.ffi_attrs(True),
                      platforms=("cpu",))


# The backward as two chained calls (bwd_begin, bwd_end): FFI targets `<target>_begin` and
# `<target>_end`; the second takes the first's workspace as its last operand, aliased to its own
# workspace (result 3), so the query side the first prepared stays in place.
_BWD_END_ALIASES = {12: 3}  # operands: the 11 arrays, the plan, the state


def _register_cuda_lowering(primitive, direction, target):
  """On CUDA a kernel primitive lowers to two FFI calls: `<target>_plan`, which builds the tile plan
  from the token arrays (the primitive's last four operands) alone, and `<target>`, which takes
  that plan as an extra operand. Layers that share segment ids and positions then make identical
  plan calls, which XLA's common-subexpression elimination merges into one."""
  with_deterministic = direction == "bwd"
  kernel_rules = {"whole": compat.ffi_lowering(target)}
  if direction == "bwd":
    kernel_rules["begin"] = compat.ffi_lowering(target + "_begin")
    kernel_rules["end"] = compat.ffi_lowering(target + "_end", operand_output_aliases=_BWD_END_ALIASES)
  plan_rule = compat.ffi_lowering(target + "_plan")

  def lower(ctx, *args, config, phase="whole", **_):
    state = ()
    if phase == "end":  # the state comes first in the primitive, last in the FFI call
      state, args = args[:1], args[1:]
      ctx = ctx.replace(avals_in=[*ctx.avals_in[1:], ctx.avals_in[0]])
    q, k, v = ctx.avals_in[:3]
    tokens = ctx.avals_in[len(args) - 4:len(args)]
    attrs = config.cuda_ffi_attrs(with_deterministic)
    plan_bytes = cuda_capabilities.attention_plan_bytes(direction, q.shape, k.shape, config)
    plan_aval = compat.derived_aval(tokens[0], (plan_bytes,), jnp.uint8, (None,))
    (plan,) = plan_rule(ctx.replace(avals_in=tokens, avals_out=[plan_aval]), *args[-4:],
                        q_heads=np.int64(q.shape[2]), kv_heads=np.int64(k.shape[2]),
                        head_dim=np.int64(q.shape[3]), v_head_dim=np.int64(v.shape[3]), **attrs)
    avals = [*ctx.avals_in[:len(args)], plan_aval, *ctx.avals_in[len(args):]]
    return kernel_rules[phase](ctx.replace(avals_in=avals), *args, plan, *state, **attrs)

  compat.mlir.register_lowering(primitive, lower, platform="cuda")


_register_cuda_lowering(attention_fwd_kernel_p, "fwd", FWD_TARGET)
_register_cuda_lowering(attention_bwd_kernel_p, "bwd", BWD_TARGET)


def fwd_kernel(q, k, v, q_seg, q_pos, kv_seg, kv_pos, config):
  """Unpartitioned forward on local arrays: (out, lse)."""
  ws = cuda_capabilities.attention_workspace_bytes("fwd", q.shape, k.shape, config)
  out, lse, _ = attention_fwd_kernel_p.bind(q, k, v, q_seg, q_pos, kv_seg, kv_pos, config=config,
                                            workspace_bytes=ws)
  return out, lse


def bwd_kernel(q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos, config):
  """Unpartitioned backward on local arrays: (dq, dk, dv)."""
  ws = cuda_capabilities.attention_workspace_bytes("bwd", q.shape, k.shape, config)
  dq, dk, dv, _ = attention_bwd_kernel_p.bind(q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg,
                                              kv_pos, config=config, workspace_bytes=ws)
  return dq, dk, dv


def bwd_begin(q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos, config, workspace_bytes):
  """The first of two chained backward calls over disjoint key sets of the same queries (CUDA,
  where cuda_capabilities.attention_bwd_chains): (state, dk, dv). state is its workspace, sized
  for both calls (workspace_bytes), holding the query side and the unconverted dQ of its keys."""
  _, dk, dv, state = attention_bwd_kernel_p.bind(q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos,
                                                 config=config, workspace_bytes=workspace_bytes, phase="begin")
  return state, dk, dv


def bwd_end(state, q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos, config):
  """The second chained call: (dq over both key sets, dk, dv of its own keys)."""
  dq, dk, dv, _ = attention_bwd_kernel_p.bind(state, q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos,
                                              config=config, workspace_bytes=state.shape[0], phase="end")
  return dq, dk, dv


class LocalBwd:
  """The backward kernel on one shard's arrays (bwd_kernel). Context parallelism also runs it over
  two disjoint key sets of the same queries (a traded pair: the partner's keys, then the rank's
  own under the exchange): as chained calls where `chains` (one preparation of the query side and
  one dQ conversion, no sum of two dQ), with `begin` and `end`."""

  def __init__(self, config: AttentionConfig):
    self.config = config

  def __call__(self, *args):
    return bwd_kernel(*args, self.config)

  def chains(self, q, *key_sets) -> bool:
    return cuda_capabilities.attention_bwd_chains(q.shape, [k.shape for k in key_sets], self.config)

  def begin(self, *args, then_k):
    """bwd_begin, with a workspace for this call's keys and the second call's (then_k)."""
    q, k = args[0], args[1]
    ws = max(cuda_capabilities.attention_workspace_bytes("bwd", q.shape, s.shape, self.config) for s in (k, then_k))
    return bwd_begin(*args, self.config, ws)

  def end(self, state, *args):
    return bwd_end(state, *args, self.config)


# ---------------------------------------------------------------- public-facing primitives


def _fwd_public_abstract(q, k, v, q_seg, q_pos, kv_seg, kv_pos, *, config):
  """(out, lse), then, for a DocumentPlacement that keeps what its forward gathered
  (context_parallel.keeps_gathered), the gathered shared K, V, segment ids and positions: the
  same on every rank (replicated over the context-parallel axis), or with grouped shared regions
  (or a partner's block: context_parallel.trades_with_partner) each rank's own (sharded over it)."""
  outs = _fwd_abstract(q, k, v, q_seg, q_pos, kv_seg, kv_pos, config=config)
  if not keeps_gathered(config.context_parallel):
    return outs
  kg, vg, seg_g, pos_g = gathered_shapes(config.context_parallel, q, k, v)
  # sharded like the keys, or replicated
  seq = 1 if kept_per_rank(config.context_parallel, k.shape[1], q.shape[2], k.shape[2]) else None
  return outs + (compat.derived_aval(k, kg, k.dtype, (0, seq, 2, 3)),
                 compat.derived_aval(v, vg, v.dtype, (0, seq, 2, 3)),
                 compat.derived_aval(kv_seg, seg_g, kv_seg.dtype, (0, seq)),
                 compat.derived_aval(kv_pos, pos_g, kv_pos.dtype, (0, seq)))


def _bwd_public_abstract(*args, config):
  """(dq, dk, dv); the forward's kept arrays, when it kept any, come after the usual operands."""
  return _bwd_abstract(*args[:11], config=config)


attention_fwd_p = make_primitive("jaxcp_attention_fwd", _fwd_public_abstract)
attention_bwd_p = make_primitive("jaxcp_attention_bwd", _bwd_public_abstract)


def _fold_batch(x, dim, n):
  """Moves a vmapped axis next to the batch axis and merges them: [n, B, ...] -> [n*B, ...]."""
  if dim is compat.NOT_MAPPED:
    x = jnp.broadcast_to(x, (n,) + x.shape)
  else:
    x = jnp.moveaxis(x, dim, 0)
  return x.reshape((n * x.shape[1],) + x.shape[2:])


def _batching_rule(primitive):
  def rule(args, dims, *, config):
    n = next(a.shape[d] for a, d in zip(args, dims) if d is not compat.NOT_MAPPED)
    folded = [_fold_batch(a, d, n) for a, d in zip(args, dims)]
    outs = primitive.bind(*folded, config=config)
    outs = [o.reshape((n, o.shape[0] // n) + o.shape[1:]) for o in outs]
    return outs, [0] * len(outs)

  return rule


for _p in (attention_fwd_p, attention_bwd_p):
  compat.batching.primitive_batchers[_p] = _batching_rule(_p)
  compat.requires_devices_during_lowering(_p)  # its lowering runs custom_partitioning

