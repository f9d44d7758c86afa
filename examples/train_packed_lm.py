"""Train a small Llama-style language model on packed documents, sharded over dp / tp / cp.

* Data: an endless stream of synthetic documents (repeated random patterns and arithmetic
  progressions: learnable in context, so the loss falls within a few hundred steps) packed into
  rows with ``jaxcp.data.iter_packed_batches``; segment ids, positions, next-token labels and a
  loss mask come from the packer (no prediction across documents).
* Model: token embedding, ``--layers`` blocks of RMSNorm -> ``jaxcp.flax.SelfAttention`` (GQA,
  RoPE from the packer's positions, causal, documents isolated by segment ids) and RMSNorm ->
  SwiGLU MLP, final RMSNorm and an untied LM head; trained with optax AdamW.
* Sharding: a ``(dp, cp, tp)`` mesh. The batch is sharded over ``dp``, the sequence over ``cp``
  (context parallelism: after ``jaxcp.load_balance(..., strategy="striped")`` of every per-token
  array; positions are taken from the packer *before* permuting and passed explicitly), and
  the attention heads / MLP hidden units over ``tp`` (``NamedSharding`` on the parameters).
* ``--implementation xla`` runs the pure-JAX reference attention; the default (None) picks the
  CUDA kernels on GPUs and the CPU kernels elsewhere. ``--check`` runs the first
  ``--check-steps`` steps with both the chosen implementation and the other one from the same
  initial parameters and batches, prints both losses and asserts that they agree (relative
  1e-4 in float32, 2e-2 in bfloat16).

On a CPU-only machine the script uses 8 host devices::

    python examples/train_packed_lm.py --dp 2 --tp 2 --cp 2 --steps 100
    python examples/train_packed_lm.py --dp 8 --steps 100 --check
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # Only affects the CPU platform (8 host devices); harmless on GPU machines.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxcp  # noqa: E402
import jaxcp.data  # noqa: E402
import jaxcp.flax  # noqa: E402

from jaxcp import load_balance  # noqa: E402

PAD, BOS = 0, 1


# --------------------------------------------------------------------------------------------
# synthetic documents


def synthetic_documents(seed: int, vocab_size: int, min_len: int, max_len: int):
  """Endless stream of token documents that a small model can learn to predict in context.

  Each document starts with BOS and is either a random pattern of 2-8 tokens repeated
  (predictable after its first period: an induction task) or an arithmetic progression
  ``a, a + s, a + 2s, ...`` modulo the content vocabulary (predictable after two tokens).
  """
  rng = np.random.default_rng(seed)
  content = vocab_size - 2  # ids 2 .. vocab_size-1
  while True:
    length = int(rng.integers(min_len, max_len + 1))
    if rng.random() < 0.5:
      pattern = rng.integers(0, content, size=int(rng.integers(2, 9)))
      body = np.resize(pattern, length - 1)
    else:
      start, step = rng.integers(0, content), rng.integers(1, 4)
      body = (start + step * np.arange(length - 1)) % content
    yield np.concatenate([[BOS], body + 2]).astype(np.int32)


# --------------------------------------------------------------------------------------------
# model


class RMSNorm(nn.Module):
  """Root-mean-square layer norm with a learned scale (computed in float32)."""
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],), jnp.float32)
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * scale).astype(x.dtype)


class SwiGLU(nn.Module):
  """Llama MLP: down(silu(gate(x)) * up(x))."""
  hidden: int
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(nn.Dense, use_bias=False, dtype=self.dtype)
    h = nn.silu(dense(self.hidden, name="gate")(x)) * dense(self.hidden, name="up")(x)
    return dense(x.shape[-1], name="down")(h)


class Block(nn.Module):
  """Pre-norm decoder block: x + attn(norm(x)); x + mlp(norm(x))."""
  cfg: "Config"

  @nn.compact
  def __call__(self, x, segment_ids, positions):
    c = self.cfg
    attn = jaxcp.flax.SelfAttention(
        num_heads=c.heads, num_kv_heads=c.kv_heads, head_dim=c.head_dim, is_causal=True,
        local_window_size=c.window, rope_theta=c.rope_theta, dtype=c.dtype,
        implementation=c.implementation, name="attn")
    x = x + attn(RMSNorm(name="attn_norm")(x), segment_ids=segment_ids, positions=positions)
    return x + SwiGLU(c.mlp_hidden, c.dtype, name="mlp")(RMSNorm(name="mlp_norm")(x))


class PackedLM(nn.Module):
  """Llama-style decoder over packed rows: tokens [B, S] -> logits [B, S, vocab] (float32)."""
  cfg: "Config"

  @nn.compact
  def __call__(self, tokens, segment_ids, positions):
    c = self.cfg
    x = nn.Embed(c.vocab, c.d_model, embedding_init=nn.initializers.normal(0.02), name="embed")(tokens)
    x = x.astype(c.dtype)
    for i in range(c.layers):
      x = Block(c, name=f"block_{i}")(x, segment_ids, positions)
    x = RMSNorm(name="final_norm")(x)
    return nn.Dense(c.vocab, use_bias=False, dtype=c.dtype, name="lm_head")(x).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Config:
  """Model and run configuration (see the command-line flags)."""
  vocab: int = 64
  d_model: int = 128
  layers: int = 2
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 64
  mlp_hidden: int = 256
  rope_theta: float = 10000.0
  window: int | None = None
  dtype: jnp.dtype = jnp.float32
  implementation: str | None = None


# --------------------------------------------------------------------------------------------
# sharding


def param_spec(path, leaf) -> P:
  """Tensor-parallel layout: attention heads and MLP hidden units over "tp", the rest replicated."""
  names = [getattr(k, "key", getattr(k, "name", str(k))) for k in path]
  if "attn" in names and names[-1] == "kernel":
    if names[-2] in ("query", "key", "value"):
      return P(None, "tp", None)   # [F, H, Dh]
    if names[-2] == "out":
      return P("tp", None, None)   # [H, Dh, F]
  if "mlp" in names and names[-1] == "kernel":
    return P(None, "tp") if names[-2] in ("gate", "up") else P("tp", None)
  return P(*([None] * np.ndim(leaf)))


def make_mesh(dp: int, cp: int, tp: int) -> Mesh:
  n = dp * cp * tp
  devices = jax.devices()
  if n > len(devices):
    raise ValueError(f"dp * cp * tp = {n} needs {n} devices, only {len(devices)} available.")
  kw = {}
  if hasattr(jax.sharding, "AxisType"):  # GSPMD-style propagation (not sharding-in-types)
    kw["axis_types"] = (jax.sharding.AxisType.Auto,) * 3
  return Mesh(np.asarray(devices[:n]).reshape(dp, cp, tp), ("dp", "cp", "tp"), **kw)


# --------------------------------------------------------------------------------------------
# training


def loss_fn(params, model, batch):
  """Mean next-token cross entropy over the tokens where loss_mask is 1."""
  logits = model.apply(params, batch["tokens"], batch["segment_ids"], batch["positions"])
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1)[..., 0]
  mask = batch["loss_mask"]
  return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_train_step(model, tx, param_sh, opt_sh, batch_sh, replicated):
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, model, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return jax.jit(step, in_shardings=(param_sh, opt_sh, batch_sh),
                 out_shardings=(param_sh, opt_sh, replicated))


_BATCH_KEYS = ("tokens", "segment_ids", "positions", "labels", "loss_mask")


def batches(args, cp: int):
  """Host batches (numpy dicts) of ``args.batch`` rows; load-balanced for cp > 1."""
  docs = synthetic_documents(args.seed, args.vocab, args.min_doc, args.max_doc or args.seq_len)
  for packed in jaxcp.data.iter_packed_batches(docs, args.seq_len, args.batch, pad_id=PAD):
    b = {k: getattr(packed, k) for k in _BATCH_KEYS}   # positions: before any permutation
    if cp > 1:
      b = {k: load_balance(v, cp, axis=1, strategy="striped") for k, v in b.items()}
    yield b


class _Progress:
  """tqdm when available, else a printed line every ``every`` steps."""

  def __init__(self, total: int, enabled: bool, every: int):
    self.enabled, self.every, self.total, self.bar = enabled, max(1, every), total, None
    if enabled:
      try:
        from tqdm import tqdm
        self.bar = tqdm(total=total, dynamic_ncols=True)
      except ImportError:
        pass

  def update(self, step: int, loss: float, tok_s: float):
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}")
      self.bar.update(1)
    elif step % self.every == 0 or step == self.total:
      print(f"step {step:5d}/{self.total}  loss {loss:.4f}  tokens/s {tok_s:,.0f}", flush=True)

  def close(self):
    if self.bar is not None:
      self.bar.close()


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: devices / (tp*cp))")
  p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (heads, MLP units)")
  p.add_argument("--cp", type=int, default=1, help="context-parallel size (sequence)")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--batch", type=int, default=16, help="global batch (rows), a multiple of dp")
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--min-doc", type=int, default=8, help="shortest synthetic document")
  p.add_argument("--max-doc", type=int, default=None, help="longest synthetic document (default seq-len)")
  p.add_argument("--vocab", type=int, default=64)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=64,
                 help="up to 256 for the CUDA kernels (64/128/256 natively, others zero-padded)")
  p.add_argument("--mlp-hidden", type=int, default=256)
  p.add_argument("--window", type=int, default=None, help="sliding window (left) size; default: none")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--warmup", type=int, default=10)
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                 help="compute dtype (default: bfloat16 on GPU, float32 elsewhere)")
  p.add_argument("--implementation", choices=("auto", "xla", "cpu", "cuda"), default="auto",
                 help="jaxcp.attention implementation; auto = best available kernel")
  p.add_argument("--check", action="store_true",
                 help="compare the first --check-steps losses against the other implementation")
  p.add_argument("--check-steps", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--quiet", action="store_true", help="no progress output")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  """Runs training; returns a dict with "losses", "tokens_per_s", "check" (rows of step, loss,
  other implementation's loss, relative difference), "check_uses_kernel" (with --check), "mesh"
  ((dp, cp, tp)) and "implementation"."""
  args = parse_args(argv)
  say = (lambda *a: None) if args.quiet else functools.partial(print, flush=True)
  tp, cp = args.tp, args.cp
  dp = args.dp if args.dp is not None else max(1, len(jax.devices()) // (tp * cp))
  if args.batch % dp:
    raise ValueError(f"--batch ({args.batch}) must be a multiple of --dp ({dp}).")
  if args.seq_len % cp:
    raise ValueError(f"--seq-len ({args.seq_len}) must be a multiple of --cp ({cp}).")
  if args.kv_heads % tp or args.heads % tp or args.mlp_hidden % tp:
    raise ValueError(f"--heads ({args.heads}), --kv-heads ({args.kv_heads}) and --mlp-hidden "
                     f"({args.mlp_hidden}) must be multiples of --tp ({tp}).")
  mesh = make_mesh(dp, cp, tp)
  backend = jax.default_backend()
  dtype = jnp.dtype(args.dtype or ("bfloat16" if backend == "gpu" else "float32"))
  impl = None if args.implementation == "auto" else args.implementation
  cfg = Config(vocab=args.vocab, d_model=args.d_model, layers=args.layers, heads=args.heads,
               kv_heads=args.kv_heads, head_dim=args.head_dim, mlp_hidden=args.mlp_hidden,
               window=args.window, dtype=dtype, implementation=impl)
  model = PackedLM(cfg)

  replicated = NamedSharding(mesh, P())
  batch_sh = {k: NamedSharding(mesh, P("dp", "cp")) for k in _BATCH_KEYS}
  dummy = jnp.zeros((1, args.seq_len), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(args.seed), dummy, dummy + 1, dummy)
  param_sh = jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, param_spec(p, x)), params)
  params = jax.device_put(params, param_sh)
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                                end_value=args.lr * 0.1)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98, weight_decay=0.01))
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_sh,
                                 transform_non_params=lambda _: replicated)
  opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
  step_fn = make_train_step(model, tx, param_sh, opt_sh, batch_sh, replicated)

  check_rows, ref = [], None
  if args.check:
    other = "xla" if impl != "xla" else None
    ref_model = PackedLM(dataclasses.replace(cfg, implementation=other))
    ref_step = make_train_step(ref_model, tx, param_sh, opt_sh, batch_sh, replicated)
    ref = [jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state)]
    tol = 1e-4 if dtype == jnp.float32 else 2e-2

  n_params = sum(x.size for x in jax.tree.leaves(params))
  say(f"jaxcp {jaxcp.__version__}: {len(mesh.devices.flat)} {backend} device(s), mesh "
      f"dp={dp} cp={cp} tp={tp}; {n_params / 1e6:.2f}M params, {jnp.dtype(dtype).name}, "
      f"attention implementation={impl or 'auto'}; batch {args.batch} x {args.seq_len} tokens"
      + (", striped load balancing" if cp > 1 else ""))

  losses, times = [], []
  progress = _Progress(args.steps, not args.quiet, args.log_every)
  data = batches(args, cp)
  tokens_per_step = args.batch * args.seq_len
  for step in range(1, args.steps + 1):
    host = next(data)
    batch = {k: jax.device_put(host[k], batch_sh[k]) for k in _BATCH_KEYS}
    t0 = time.perf_counter()
    params, opt_state, loss = step_fn(params, opt_state, batch)
    loss = float(loss)
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    if ref is not None and step <= args.check_steps:
      ref[0], ref[1], ref_loss = ref_step(ref[0], ref[1], batch)
      ref_loss = float(ref_loss)
      rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
      check_rows.append((step, loss, ref_loss, rel))
      if step == args.check_steps:
        ref = None
    steady = times[1:] or times  # the first step includes compilation
    progress.update(step, loss, tokens_per_step * len(steady) / sum(steady))
  progress.close()

  steady = times[1:] or times
  tok_s = tokens_per_step * len(steady) / sum(steady)
  k = max(1, min(10, len(losses) // 4))
  say(f"loss {np.mean(losses[:k]):.4f} (first {k} steps) -> {np.mean(losses[-k:]):.4f} "
      f"(last {k} steps); {tok_s:,.0f} tokens/s after compilation "
      f"(first step incl. compile {times[0]:.1f}s)")
  result = dict(losses=losses, tokens_per_s=tok_s, check=check_rows, mesh=(dp, cp, tp),
                implementation=impl)
  if args.check:
    # Which side really ran jaxcp's FFI kernels (auto falls back to XLA without an extension).
    uses_kernel = [("jaxcp_attention" in str(jax.make_jaxpr(fn)(params, opt_state, batch)))
                   for fn in (step_fn, ref_step)]
    result["check_uses_kernel"] = tuple(uses_kernel)
    names = [f"{n} ({'jaxcp kernel' if k else 'XLA'})"
             for n, k in zip((impl or "auto", "xla" if impl != "xla" else "auto"), uses_kernel)]
    say(f"--check: {names[0]} vs {names[1]} attention, same init and batches (tolerance rel {tol:g}):")
    for step, a, b, rel in check_rows:
      say(f"  step {step}: loss {a:.7f} vs {b:.7f}  rel diff {rel:.2e}")
    worst = max(r[3] for r in check_rows)
    if worst > tol:
      raise AssertionError(f"--check failed: losses differ by rel {worst:.2e} > {tol:g}")
    say(f"--check passed (max rel diff {worst:.2e})")
    if not any(uses_kernel):
      say("note: no jaxcp kernel is available on this backend (extension not built?), so both "
          "sides ran the XLA reference.")
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
