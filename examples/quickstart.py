"""jaxcp quickstart: packed-document causal attention, sharded over every available device.

Builds a random batch of rows that each pack several documents (given by `cu_seqlens`, with a
padding tail), runs `jaxcp.attention` forward and backward under `jax.jit` with the batch sharded
over a data-parallel mesh axis and the heads over a tensor-parallel one, checks the output and
the gradients against jaxcp's pure-JAX reference (implementation="xla"), and prints a summary.

It also says which implementation ran, read from the compiled program: jaxcp's CPU kernels on a
CPU, its CUDA kernels on an NVIDIA GPU. If the compiled kernels should have run but did not (the
extension was not built, or `import jaxcp` found a source tree without it), it fails with the
reason instead of quietly timing the O(S^2) reference.

    python examples/quickstart.py

On a CPU-only machine it uses 8 host devices (a 4 x 2 mesh).
"""
import os
import time
import warnings

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxcp  # noqa: E402

# The kernels jaxcp has for each JAX backend; elsewhere implementation=None runs the reference.
KERNELS = {"cpu": "cpu", "gpu": "cuda"}


def random_cu_seqlens(rng, batch, seq_len, max_docs, mean_doc):
  """Document boundaries per row in the sentinel convention: [0, e1, ..., en, en, ...]; the
  tokens after en are padding."""
  cu = np.zeros((batch, max_docs + 1), np.int32)
  for b in range(batch):
    ends = np.cumsum(np.maximum(1, rng.exponential(mean_doc, max_docs)).astype(int))
    ends = ends[ends < seq_len - seq_len // 8]  # leave a padding tail
    cu[b, 1:len(ends) + 1] = ends
    cu[b, len(ends) + 1:] = ends[-1] if len(ends) else 0
  return cu


def implementation_that_ran(compiled_text: str, backend: str) -> str:
  """"cpu" or "cuda" when jaxcp's kernels are custom calls of the compiled program (forward and
  backward), else "xla" (the pure-JAX reference was traced instead)."""
  kernels = "jaxcp_attention_fwd" in compiled_text and "jaxcp_attention_bwd" in compiled_text
  return KERNELS.get(backend, "xla") if kernels else "xla"


def main():
  devices = jax.devices()
  n = len(devices)
  tp = 2 if n % 2 == 0 and n > 1 else 1
  mesh = jax.make_mesh((n // tp, tp), ("dp", "tp"))
  backend = jax.default_backend()
  dtype = jnp.bfloat16 if backend == "gpu" else jnp.float32  # the CUDA kernels take bf16 / fp16
  batch, seq_len, q_heads, kv_heads, head_dim = 2 * (n // tp), 1024 if backend == "gpu" else 256, 8, 2, 64

  rng = np.random.default_rng(0)
  cu = random_cu_seqlens(rng, batch, seq_len, max_docs=16, mean_doc=seq_len / 6)
  q = jnp.asarray(rng.standard_normal((batch, seq_len, q_heads, head_dim)), dtype)
  k = jnp.asarray(rng.standard_normal((batch, seq_len, kv_heads, head_dim)), dtype)
  v = jnp.asarray(rng.standard_normal((batch, seq_len, kv_heads, head_dim)), dtype)

  # Batch over "dp", heads over "tp": the kernels partition themselves, with no communication.
  heads = NamedSharding(mesh, P("dp", None, "tp", None))
  rows = NamedSharding(mesh, P("dp", None))
  q_s, k_s, v_s = (jax.device_put(x, heads) for x in (q, k, v))
  cu_s = jax.device_put(jnp.asarray(cu), rows)

  def loss_and_out(q, k, v, cu, implementation):
    out = jaxcp.attention(q, k, v, cu_seqlens=cu, is_causal=True, implementation=implementation)
    return jnp.mean(out.astype(jnp.float32) ** 2), out

  step = jax.jit(jax.value_and_grad(lambda *a: loss_and_out(*a, None), argnums=(0, 1, 2), has_aux=True))
  ref_step = jax.jit(jax.value_and_grad(lambda *a: loss_and_out(*a, "xla"), argnums=(0, 1, 2), has_aux=True))

  # implementation=None picks the best available kernel and warns when it has to fall back to
  # the reference; keep that warning to explain a failure below.
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    compiled = step.lower(q_s, k_s, v_s, cu_s).compile()
  ran = implementation_that_ran(compiled.as_text(), backend)
  expected = KERNELS.get(backend, "xla")

  (_, out), grads = compiled(q_s, k_s, v_s, cu_s)
  jax.block_until_ready(grads)
  t0 = time.perf_counter()
  (_, out), grads = compiled(q_s, k_s, v_s, cu_s)
  jax.block_until_ready(grads)
  elapsed = time.perf_counter() - t0
  (_, ref_out), ref_grads = ref_step(q, k, v, jnp.asarray(cu))

  def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)

  out_err = rel(out.astype(jnp.float32), ref_out.astype(jnp.float32))
  grad_err = max(rel(g.astype(jnp.float32), r.astype(jnp.float32)) for g, r in zip(grads, ref_grads))
  seg, _ = jaxcp.segments_from_cu_seqlens(jnp.asarray(cu), seq_len)
  docs = [len(set(np.asarray(row).tolist()) - {0}) for row in seg]
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4

  print(f"jaxcp {jaxcp.__version__} ({os.path.dirname(jaxcp.__file__)}) on {n} {backend} device(s), "
        f"mesh {dict(mesh.shape)}")
  print(f"implementation: {ran}" + (" (jaxcp's compiled kernels)" if ran != "xla" else " (pure-JAX reference)"))
  print(f"batch {batch} x {seq_len} tokens, {q_heads} query / {kv_heads} kv heads, head_dim {head_dim}, "
        f"{jnp.dtype(dtype).name}")
  print(f"documents per row: {docs} (causal, padding tail per row)")
  print(f"output sharding: {out.sharding.spec}")
  print(f"forward+backward step: {elapsed * 1e3:.1f} ms")
  print(f"relative error vs reference: output {out_err:.2e}, gradients {grad_err:.2e} (tolerance {tol:g})")

  if ran != expected:
    reasons = " ".join(str(w.message) for w in caught) or "no warning was raised."
    print(f"FAILED: jaxcp's {expected!r} kernels should have run on the {backend!r} backend, but the "
          f"compiled program has no jaxcp kernel call (it ran the {ran!r} reference). {reasons}")
    return 1
  ok = out_err < tol and grad_err < tol
  print("OK" if ok else "MISMATCH: the kernels disagree with the reference")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
