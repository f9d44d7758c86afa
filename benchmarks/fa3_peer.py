"""FlashAttention-3 as a peer of bench_attention.py: imports the flash-attn3-jax wheel (behind the
two names it still needs from older JAX) and calls its varlen form on packed rows.

Packed rows [B, S, H, D] become its varlen form by flattening to [B * S, H, D], with cu_seqlens
over every document of every row. The wheel (flash-attn3-jax 0.2.3) carries sm_90 kernels of head
dim 128 only (bf16 and fp16), so head dims 64 and 96 run on those too.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

MODULES = ("flash_attn3_jax", "flash_attn_jax")  # the wheel's name first
MAX_HEAD_DIM = 128


def _restore_old_jax_names():
  """The wheel imports jax.core.ShapedArray and calls jax.interpreters.xla.apply_primitive, which
  JAX 0.11 no longer exports; put them back where missing."""
  import jax._src.core
  import jax._src.dispatch
  import jax.interpreters.xla
  if not hasattr(jax.core, "ShapedArray"):
    jax.core.ShapedArray = jax._src.core.ShapedArray
  if not hasattr(jax.interpreters.xla, "apply_primitive"):
    jax.interpreters.xla.apply_primitive = jax._src.dispatch.apply_primitive


def load():
  """(flash_mha_varlen, info): info names the module and version imported, or, with
  flash_mha_varlen None, why none could be (dict(absent=reason))."""
  found = [m for m in MODULES if importlib.util.find_spec(m) is not None]
  if not found:
    return None, dict(absent=f"none of {', '.join(MODULES)} is installed")
  errors = []
  try:
    _restore_old_jax_names()
  except (AttributeError, ImportError) as e:  # their private homes moved too: the import says what fails
    errors.append(f"old JAX names not restored: {e}")
  for name in found:
    try:
      module = importlib.import_module(name)
      varlen = module.flash_mha_varlen
    except Exception as e:  # noqa: BLE001 -- any failure to import leaves FA3 absent, with its reason
      errors.append(f"{name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
      continue
    version = getattr(module, "__version__", None)
    if version is None:
      try:
        version = importlib.metadata.version(name.replace("_", "-"))
      except importlib.metadata.PackageNotFoundError:
        pass
    return varlen, dict(module=name, version=version)
  return None, dict(absent="; ".join(errors))


def unsupported(head_dim, v_head_dim=None, chunk=None, dtype=jnp.bfloat16):
  """Why FlashAttention-3 cannot run a case ("unsupported: ..."), or None."""
  if jax.default_backend() != "gpu":
    return "unsupported: needs a CUDA GPU"
  if chunk is not None:
    return "unsupported: chunked (Llama-4) mask"
  if v_head_dim is not None and v_head_dim != head_dim:
    return "unsupported: V head dim != Q head dim"
  if head_dim > MAX_HEAD_DIM:
    return f"unsupported: head dim {head_dim} > {MAX_HEAD_DIM}"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"unsupported: {jnp.dtype(dtype).name} (bf16 and fp16 only)"
  return None


def cu_seqlens(rows, seq_len):
  """cu_seqlens (int32 [n + 1]) over the flattened [B * S] tokens of rows (each row's document
  lengths, from its start; tokens after them are padding), and the longest entry (max_seqlen).

  A row's padding tail is an entry of its own: the entries must tile the flattened tokens for the
  next row's documents to start where they do in [B, S], and tokens outside every entry would be
  left unwritten. As its own entry the padding attends only to itself, so every real token's
  output and gradients are exactly those of its document; the padding's own are left out of the
  comparison, as for every implementation (live tokens only). FlashAttention-3 then does the
  padding runs' causal pairs on top of the case's (300 * 301 / 2 in 1x64k doc1k pad300, 0.06% of
  its allowed pairs), uncounted in its FLOPs. max_seqlen covers the padding runs too:
  FlashAttention-3 sizes its per-entry buffers by it."""
  bounds = [0]
  for b, lengths in enumerate(rows):
    if sum(lengths) > seq_len:
      raise ValueError(f"row {b}'s documents ({sum(lengths)} tokens) exceed its {seq_len}")
    for n in lengths:
      bounds.append(bounds[-1] + n)
    if bounds[-1] < (b + 1) * seq_len:
      bounds.append((b + 1) * seq_len)
  cu = np.asarray(bounds, np.int32)
  return cu, int(np.diff(cu).max())


def packed_fn(varlen, rows, seq_len, *, scale, causal=True, window=None):
  """f(q, k, v) -> out on packed rows [B, S, H, D] through flash_mha_varlen: documents attend
  within themselves; window (left, right) keys around each query as jaxcp's local_window_size
  (a window of W keys, causal: (W - 1, 0)), None for none."""
  cu_np, max_len = cu_seqlens(rows, seq_len)
  cu = jnp.asarray(cu_np)
  window_size = tuple(window) if window is not None else (-1, -1)

  def f(q, k, v):
    b, s = q.shape[:2]
    flat = lambda x: x.reshape(b * s, *x.shape[2:])  # a bitcast in XLA: no copy
    out = varlen(flat(q), flat(k), flat(v), cu, cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
                 softmax_scale=scale, is_causal=causal, window_size=window_size)
    return out.reshape(b, s, *out.shape[1:])
  return f
