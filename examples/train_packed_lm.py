"""Train a small Llama-style language model on packed documents, sharded over dp / tp / cp.

* Data: endless streams of synthetic documents (repeated random patterns and arithmetic
  progressions: learnable in context, so the loss falls within a few hundred steps) packed into
  rows with ``jaxcp.data.iter_packed_batches``; segment ids, positions, next-token labels and a
  loss mask come from the packer (no prediction across documents). Row ``r`` of every global
  batch comes from a stream seeded by ``(--seed, r)``, so a process builds only the rows it
  holds, and the global batch is the same for any number of processes.
* Model: token embedding, ``--layers`` blocks of RMSNorm -> ``jaxcp.flax.SelfAttention`` (GQA,
  RoPE from the packer's positions, causal, documents isolated by segment ids) and RMSNorm ->
  SwiGLU MLP, final RMSNorm and an untied LM head; trained with optax AdamW.
* Sharding: a ``(dp, cp, tp)`` mesh. The batch is sharded over ``dp``, the sequence over ``cp``
  (context parallelism: every per-token array is permuted on the host with a per-row token
  permutation, ``--load-balance``; positions are taken from the packer *before* permuting and
  passed explicitly), and the attention heads / MLP hidden units over ``tp`` (``NamedSharding``
  on the parameters).
* Several processes (hosts): ``--coordinator HOST:PORT --num-processes N --process-id I`` (or
  ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, or none of them
  under SLURM's ``srun`` or Open MPI's ``mpirun``) joins JAX's distributed runtime. Every process
  runs this same program with the same flags; each packs and permutes only its own part of the
  batch (:func:`host_batch_rows`) and hands it to ``jax.make_array_from_process_local_data``.
  Devices are ordered process by process, so ``dp`` (the outer mesh axis) is the one that crosses
  hosts (see :func:`make_mesh`). Only process 0 prints and writes files. docs/multi_host.md has
  the launch commands.
* ``--implementation xla`` runs the pure-JAX reference attention; the default (None) picks the
  CUDA kernels on GPUs and the CPU kernels elsewhere. ``--check`` runs the first
  ``--check-steps`` steps with both the chosen implementation and the other one from the same
  initial parameters and batches, prints both losses and asserts that they agree (relative
  1e-4 in float32, 2e-2 in bfloat16).
* ``--save-metrics PATH`` writes the loss curve and tokens/s as JSON (and a PNG plot next to it).

On a CPU-only machine the script uses 8 host devices::

    python examples/train_packed_lm.py --dp 2 --tp 2 --cp 2 --steps 100
    python examples/train_packed_lm.py --dp 8 --steps 100 --check

Two processes of 4 host devices each, on one machine (two shells)::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/train_packed_lm.py \
        --dp 2 --cp 2 --tp 2 --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/train_packed_lm.py \
        --dp 2 --cp 2 --tp 2 --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 1
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
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

PAD, BOS = 0, 1


# --------------------------------------------------------------------------------------------
# synthetic documents


def synthetic_documents(seed, vocab_size: int, min_len: int, max_len: int):
  """Endless stream of token documents that a small model can learn to predict in context.

  ``seed`` is anything ``np.random.default_rng`` takes (an int, or a tuple such as
  ``(seed, row)`` for the stream of one row of the batch).

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
        implementation=c.implementation, context_parallel=c.context_parallel, name="attn")
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
  context_parallel: object = "auto"   # "auto" | "ring" | "all_gather" | a jaxcp.DocumentPlacement


# --------------------------------------------------------------------------------------------
# processes


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  return None if value in (None, "") else int(value)


def _cluster_launcher() -> str | None:
  """The launcher JAX can read the process layout from, when it started several processes."""
  if ("SLURM_STEP_NODELIST" in os.environ and "SLURM_PROCID" in os.environ
      and (_env_int("SLURM_NTASKS") or 1) > 1):
    return "SLURM"
  if "OMPI_MCA_orte_hnp_uri" in os.environ and (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
    return "Open MPI"
  return None


def setup_distributed(args) -> None:
  """Joins JAX's distributed runtime when this is one process of several; else does nothing.

  Must run before anything touches a JAX device. Explicit settings (flags, else the
  ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` variables) win;
  without them JAX reads the layout from SLURM (``srun``) or Open MPI (``mpirun``). Nothing at
  all (or ``--num-processes 1``) is a single-process run.
  """
  if jax.distributed.is_initialized():  # a launcher script or test already joined
    return
  coordinator = args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  num = args.num_processes if args.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
  pid = args.process_id if args.process_id is not None else _env_int("JAX_PROCESS_ID")
  launcher = _cluster_launcher()
  if num == 1 or (launcher is None and (coordinator, num, pid) == (None, None, None)):
    return
  if launcher is None:
    missing = [flag for flag, v in (("--coordinator", coordinator), ("--num-processes", num),
                                    ("--process-id", pid)) if v is None]
    if missing:
      raise ValueError(
          f"{', '.join(missing)} not given: a multi-process run needs --coordinator HOST:PORT, "
          f"--num-processes N and --process-id I on every process (or JAX_COORDINATOR_ADDRESS, "
          f"JAX_NUM_PROCESSES, JAX_PROCESS_ID); under srun or mpirun pass none of them.")
    if num < 1 or not 0 <= pid < num:
      raise ValueError(f"--process-id ({pid}) must be in [0, --num-processes ({num})).")
  local_ids = None
  if args.local_device_ids:
    local_ids = [int(i) for i in args.local_device_ids.split(",")]
  try:  # CPU collectives across processes; gloo is the default where the option exists
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except AttributeError:
    pass
  jax.distributed.initialize(coordinator, num, pid, local_device_ids=local_ids)


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
  """The ``(dp, cp, tp)`` mesh, devices ordered process by process.

  The devices, sorted by (process, id), are laid out row-major over (dp, cp, tp): each
  process's devices are consecutive, so the outer axis, ``dp``, is the one that crosses
  processes (hosts), and a cp x tp group stays inside one host whenever ``cp * tp`` divides the
  devices per host. That is the cheap way round: data parallelism talks across hosts once per
  step (the gradient all-reduce, overlappable), while context parallelism exchanges K/V in
  every attention layer, forward and backward, and tensor parallelism all-reduces activations
  twice per layer; both belong on the fast links inside a host. With ``dp`` smaller than the
  number of processes, cp (then tp) crosses hosts as well: it works, only slower.
  """
  n = dp * cp * tp
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  if jax.process_count() > 1 and n != len(devices):
    raise ValueError(
        f"dp * cp * tp = {n} must equal the number of devices of all processes, "
        f"{len(devices)} ({jax.process_count()} processes x {jax.local_device_count()}); adjust "
        f"--dp, --cp or --tp.")
  if n > len(devices):
    raise ValueError(f"dp * cp * tp = {n} needs {n} devices, only {len(devices)} available.")
  kw = {}
  if hasattr(jax.sharding, "AxisType"):  # GSPMD-style propagation (not sharding-in-types)
    kw["axis_types"] = (jax.sharding.AxisType.Auto,) * 3
  return Mesh(np.asarray(devices[:n]).reshape(dp, cp, tp), ("dp", "cp", "tp"), **kw)


def axes_across_processes(mesh: Mesh) -> list[str]:
  """Mesh axes along which some devices belong to different processes."""
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
  return [name for i, name in enumerate(mesh.axis_names)
          if (np.moveaxis(procs, i, 0) != np.moveaxis(procs, i, 0)[:1]).any()]


def process_region(sharding: NamedSharding, global_shape: tuple[int, ...]) -> list[np.ndarray]:
  """Global indices, per dimension, of the part of an array that this process's devices hold.

  In the order ``jax.make_array_from_process_local_data`` expects its local data: the distinct
  shards of each dimension by increasing offset. For a ``P("dp", "cp")`` batch: the rows of
  this process's dp shards (all rows if dp does not cross processes) and the columns of its cp
  shards (all columns unless cp crosses processes).
  """
  index_map = sharding.addressable_devices_indices_map(global_shape)
  shard_shape = sharding.shard_shape(global_shape)
  region = []
  for dim in range(len(global_shape)):
    starts = sorted({idx[dim].start or 0 for idx in index_map.values()})
    region.append(np.concatenate([np.arange(s, s + shard_shape[dim]) for s in starts]))
  return region


# --------------------------------------------------------------------------------------------
# data: each process builds only its part of the global batch


_BATCH_KEYS = ("tokens", "segment_ids", "positions", "labels", "loss_mask")


def packed_row_stream(args, row: int, cp: int = 1):
  """Endless packed rows (numpy dicts of [S] arrays) for global row index ``row``.

  Row ``row`` of every global batch comes from its own document stream, seeded by
  ``(seed, row)``: a process packs only the rows it holds, and any process count yields the
  same global batch. With ``--load-balance document`` (and cp > 1) the rows come out laid out
  for ``document_placement(args, cp)`` (jaxcp.data.iter_placed_batches: a document that finds no
  room goes back to this row's stream), with their permutation under ``"perm"``.
  """
  docs = synthetic_documents((args.seed, row), args.vocab, args.min_doc,
                             args.max_doc or args.seq_len)
  if args.load_balance == "document" and cp > 1:
    placement = document_placement(args, cp)
    for placed in jaxcp.data.iter_placed_batches(docs, args.seq_len, 1, cp, sizes=(placement.shared_tokens,),
                                                 pad_id=PAD):
      yield dict({k: v[0] for k, v in placed.arrays().items()}, perm=placed.permutation[0])
    return
  for packed in jaxcp.data.iter_packed_batches(docs, args.seq_len, 1, pad_id=PAD):
    yield {k: getattr(packed, k)[0] for k in _BATCH_KEYS}   # positions: before any permutation


def document_placement(args, cp: int):
  """The run's one DocumentPlacement: --shared-tokens per rank (default S / cp / 4), a single
  static size, so one program serves every step on every process."""
  shared = args.shared_tokens if args.shared_tokens is not None else args.seq_len // cp // 4
  return jaxcp.DocumentPlacement(shared, cp_size=cp)


def _balanced_blocks_size(seq_len: int, cp: int) -> int:
  """Up to 128 tokens (a kernel tile), at least 4 blocks per rank, dividing S / cp."""
  block = max(1, min(128, seq_len // (4 * cp)))
  while (seq_len // cp) % block:
    block -= 1
  return block


def placement_permutation(segment_ids: np.ndarray, cp: int, strategy: str) -> np.ndarray | None:
  """Where every token of a row goes across the cp ranks: int32 [rows, S], or None (cp == 1).

  ``perm[r, j]`` is the original index of the token at permuted position ``j`` of row ``r``;
  rank ``c`` holds permuted positions ``[c * S / cp, (c + 1) * S / cp)``. Computed from the
  host rows' segment ids alone, so every process can compute it for its own rows. A placement
  that also picks a static size per batch (e.g. the shared-token budget of a document
  placement) must pick the same one on every process, or the processes compile different
  programs and hang: take it from a fixed list (largest first) or agree on it across processes.
  """
  if cp == 1:
    return None
  block = _balanced_blocks_size(segment_ids.shape[-1], cp)
  return jaxcp.load_balance_permutation(segment_ids, cp, strategy=strategy, block_size=block)


def host_batch_rows(args, rows: np.ndarray, columns: np.ndarray, cp: int):
  """Yields, step after step, this process's part of each global batch, ready to shard.

  Args:
    args: the parsed flags (seed, sizes, ``--load-balance``).
    rows: global row indices this process holds (all rows when dp does not cross processes).
    columns: positions of the *permuted* rows that this process holds (all of them unless cp
      crosses processes).
    cp: context-parallel size.

  Yields:
    dict of numpy arrays ``[len(rows), len(columns)]`` (:data:`_BATCH_KEYS`): packed rows,
    permuted by :func:`placement_permutation` for context parallelism, then cut to
    ``columns``. Deterministic in (seed, global row, step).
  """
  streams = [packed_row_stream(args, int(r), cp) for r in rows]
  while True:
    packed = [next(s) for s in streams]
    batch = {k: np.stack([p[k] for p in packed]) for k in _BATCH_KEYS}
    if "perm" in packed[0]:  # already laid out for the document placement
      yield {k: np.ascontiguousarray(v[:, columns]) for k, v in batch.items()}
      continue
    perm = placement_permutation(batch["segment_ids"], cp, args.load_balance)
    if perm is not None:
      batch = {k: jaxcp.load_balance(v, cp, axis=1, strategy=perm) for k, v in batch.items()}
    yield {k: np.ascontiguousarray(v[:, columns]) for k, v in batch.items()}


def global_batch(local: dict, batch_sh: dict, global_shape: tuple[int, int]) -> dict:
  """Global arrays from each process's part; no cross-process transfer or equality check
  (``jax.device_put`` of a full host batch would all-gather it to check that every process
  holds the same data)."""
  return {k: jax.make_array_from_process_local_data(batch_sh[k], local[k], global_shape)
          for k in _BATCH_KEYS}


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


def save_metrics(path: str, metrics: dict, say) -> None:
  """Writes ``metrics`` as JSON to ``path`` and the loss curve as a PNG next to it."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(metrics, indent=1) + "\n")
  png = path.with_suffix(".png")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    say(f"metrics written to {path}; no plot (matplotlib is not installed)")
    return
  steps = np.arange(1, len(metrics["losses"]) + 1)
  fig, (ax_loss, ax_tok) = plt.subplots(1, 2, figsize=(10, 3.6))
  ax_loss.plot(steps, metrics["losses"])
  ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
  ax_loss.grid(alpha=0.3)
  step_tok_s = [metrics["tokens_per_step"] / t for t in metrics["step_times_s"]]
  ax_tok.plot(steps[1:], step_tok_s[1:])  # step 1 includes compilation
  ax_tok.set(xlabel="step", ylabel="tokens/s",
             title=f"tokens/s per step ({metrics['tokens_per_s']:,.0f} after step 1)")
  ax_tok.grid(alpha=0.3)
  dp, cp, tp = metrics["mesh"]
  procs = metrics["process_count"]
  fig.suptitle(f"{procs} process{'es' if procs > 1 else ''} x {metrics['local_devices']} "
               f"{metrics['backend']} devices, mesh dp={dp} cp={cp} tp={tp}", fontsize=10)
  fig.tight_layout()
  fig.savefig(png, dpi=110)
  plt.close(fig)
  say(f"metrics written to {path} and {png}")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: devices / (tp*cp))")
  p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (heads, MLP units)")
  p.add_argument("--cp", type=int, default=1, help="context-parallel size (sequence)")
  p.add_argument("--context-parallel", choices=("auto", "ring", "all_gather"), default="auto",
                 help="context-parallel algorithm of jaxcp.attention (with --cp > 1)")
  p.add_argument("--load-balance", choices=("document", "striped", "zigzag", "zigzag_docs", "balanced_blocks"),
                 default="document",
                 help="token placement across the cp ranks (with --cp > 1): 'document' lays rows out "
                      "for a jaxcp.DocumentPlacement (documents whole on one rank, only the shared "
                      "region exchanged) and sets --context-parallel to it; the others permute "
                      "packed rows for all_gather / ring")
  p.add_argument("--shared-tokens", type=int, default=None,
                 help="with --load-balance document: shared tokens per rank (default seq-len / cp / 4)")
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
  p.add_argument("--save-metrics", metavar="PATH", default=None,
                 help="write losses, tokens/s and the setup as JSON to PATH, and a plot next to it "
                      "(PATH with the suffix .png)")
  p.add_argument("--dump-hlo", metavar="PATH", default=None,
                 help="write the compiled train step (HLO text) to PATH, to inspect its collectives")
  g = p.add_argument_group("several processes (hosts); every process gets the same other flags")
  g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="address of process 0 (default: $JAX_COORDINATOR_ADDRESS)")
  g.add_argument("--num-processes", type=int, default=None,
                 help="number of processes (default: $JAX_NUM_PROCESSES, or from srun / mpirun)")
  g.add_argument("--process-id", type=int, default=None,
                 help="this process, 0 .. N-1 (default: $JAX_PROCESS_ID, or from srun / mpirun)")
  g.add_argument("--local-device-ids", default=None, metavar="IDS",
                 help="comma-separated GPU ids this process uses (default: JAX's choice: all "
                      "visible GPUs, one per process under srun / mpirun)")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  """Runs training; returns a dict with "losses", "tokens_per_s", "check" (rows of step, loss,
  other implementation's loss, relative difference), "check_uses_kernel" (with --check), "mesh"
  ((dp, cp, tp)), "implementation", "process_count" and "axes_across_processes"."""
  args = parse_args(argv)
  setup_distributed(args)
  is_main = jax.process_index() == 0
  say = functools.partial(print, flush=True) if is_main and not args.quiet else (lambda *a: None)
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
               window=args.window, dtype=dtype, implementation=impl,
               context_parallel=(document_placement(args, cp) if args.load_balance == "document" and cp > 1
                                 else args.context_parallel))
  model = PackedLM(cfg)

  replicated = NamedSharding(mesh, P())
  batch_sh = {k: NamedSharding(mesh, P("dp", "cp")) for k in _BATCH_KEYS}
  dummy = jnp.zeros((1, args.seq_len), jnp.int32)
  init_args = (jax.random.key(args.seed), dummy, dummy + 1, dummy)
  param_sh = jax.tree_util.tree_map_with_path(
      lambda p, x: NamedSharding(mesh, param_spec(p, x)), jax.eval_shape(model.init, *init_args))
  # Initialised in place, sharded: no host copy of the parameters to transfer or compare.
  params = jax.jit(model.init, out_shardings=param_sh)(*init_args)
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

  across = axes_across_processes(mesh)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  procs = (f"{jax.process_count()} processes x {jax.local_device_count()} {backend} devices "
           f"(mesh axes across processes: {', '.join(across)})" if jax.process_count() > 1
           else f"{len(mesh.devices.flat)} {backend} device(s)")
  say(f"jaxcp {jaxcp.__version__}: {procs}, mesh dp={dp} cp={cp} tp={tp}; "
      f"{n_params / 1e6:.2f}M params, {jnp.dtype(dtype).name}, attention implementation="
      f"{impl or 'auto'}; batch {args.batch} x {args.seq_len} tokens"
      + (f", {args.load_balance} load balancing, context_parallel={cfg.context_parallel}"
         if cp > 1 else ""))

  global_shape = (args.batch, args.seq_len)
  rows, columns = process_region(batch_sh["tokens"], global_shape)
  data = host_batch_rows(args, rows, columns, cp)
  losses, times = [], []
  progress = _Progress(args.steps, is_main and not args.quiet, args.log_every)
  tokens_per_step = args.batch * args.seq_len
  for step in range(1, args.steps + 1):
    batch = global_batch(next(data), batch_sh, global_shape)
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
                implementation=impl, process_count=jax.process_count(),
                axes_across_processes=across)
  if args.dump_hlo and is_main:
    text = step_fn.lower(params, opt_state, batch).compile().as_text()
    pathlib.Path(args.dump_hlo).write_text(text)
    say(f"compiled train step written to {args.dump_hlo}")
  if args.save_metrics and is_main:
    save_metrics(args.save_metrics, dict(
        losses=losses, step_times_s=times, tokens_per_s=tok_s, tokens_per_step=tokens_per_step,
        mesh=[dp, cp, tp], axes_across_processes=across, process_count=jax.process_count(),
        local_devices=jax.local_device_count(), backend=backend,
        device_kind=jax.devices()[0].device_kind, dtype=jnp.dtype(dtype).name,
        implementation=impl or "auto", context_parallel=str(cfg.context_parallel),
        load_balance=args.load_balance, jax_version=jax.__version__,
        jaxcp_version=jaxcp.__version__,
        config={k: v for k, v in vars(args).items()
                if k not in ("coordinator", "process_id", "save_metrics", "dump_hlo")}), say)
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
