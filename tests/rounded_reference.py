"""Attention and its gradients in float64 NumPy, exact or with the roundings of a flash-attention
kernel: the measure of how far a bfloat16 kernel may rightly be from the exact result.

A kernel of this kind (jaxcp's, FlashAttention's, cuDNN's) rounds to the storage dtype the
probabilities P before P @ V and P^T @ dO, the output O (from which the backward's delta = rowsum(dO
* O) is taken), and dS = P * (dP - delta) before dS @ K and dS^T @ Q. With peaky rows (a query whose
few keys are far apart in score) dS is a difference of nearly equal terms, and those roundings alone
move a dQ row by several percent; this model says by how much, example by example.
"""
import jax.numpy as jnp
import numpy as np


def _to(dtype):
  if dtype is None:
    return lambda x: x
  return lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)


def attention_grads(q, k, v, do, pairs, *, scale=None, rounding=None):
  """out, dq, dk, dv (float64) of attention over the allowed `pairs` [B, Sq, Skv], q / do [B, Sq,
  Hq, D], k / v [B, Skv, Hkv, D] (GQA: query head h reads kv head h // (Hq // Hkv)). `rounding`: a
  dtype (e.g. jnp.bfloat16) to round to where a flash-attention kernel does, or None (exact)."""
  r = _to(rounding)
  q, k, v, do = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, do))
  hq, hkv, d = q.shape[2], k.shape[2], q.shape[3]
  group = hq // hkv
  scale = d ** -0.5 if scale is None else scale
  kx, vx = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  allowed = np.asarray(pairs, bool)[:, None]                      # [B, 1, Sq, Skv]
  s = np.where(allowed, np.einsum("bqhd,bkhd->bhqk", q, kx, optimize=True) * scale, -np.inf)
  live = allowed.any(-1, keepdims=True)                           # rows with a key
  m = np.where(live, s.max(-1, keepdims=True), 0.0)
  e = np.exp(s - m)                                               # 0 where masked
  denom = np.where(live, e.sum(-1, keepdims=True), 1.0)
  p = e / denom
  out = r(np.einsum("bhqk,bkhd->bqhd", r(e), vx, optimize=True) / np.moveaxis(denom, 1, 2))
  dp = np.einsum("bqhd,bkhd->bhqk", do, vx, optimize=True)
  delta = np.moveaxis((do * out).sum(-1), 1, 2)[..., None]        # [B, Hq, Sq, 1]
  ds = r(p * (dp - delta))
  dq = np.einsum("bhqk,bkhd->bqhd", ds, kx, optimize=True) * scale
  fold = lambda x: x.reshape(*x.shape[:2], hkv, group, d).sum(3)  # sum a GQA group's heads
  dk = fold(np.einsum("bhqk,bqhd->bkhd", ds, q, optimize=True) * scale)
  dv = fold(np.einsum("bhqk,bqhd->bkhd", r(p), do, optimize=True))
  return out, dq, dk, dv
