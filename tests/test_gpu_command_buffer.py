"""The CUDA handlers inside XLA command buffers (CUDA graphs), marker `gpu`.

The handlers declare themselves command-buffer compatible, so XLA may capture them into a CUDA
graph and replay it. A child process (XLA_FLAGS are read once, at start) runs packed-document
attention (forward, deterministic and default backward) and small-sequence attention on inputs
A, B, A, A with command buffers forced on for fusions and custom calls, counting the handler
calls made while XLA captured their stream into a graph (the CUDA module's call counters,
switched on by set_call_counting); a second child runs them with command buffers off. Every
result must match bit for bit (the default backward's up to the order of its atomic adds), so a
replay that kept a pointer or a workspace value of its capture (the forward's tile counter, the
plans) fails.
"""
import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcp

from .helpers import positions_in_documents, random_segments, rel_err

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND_BUFFER_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
TARGETS = ("jaxcp_attention_fwd", "jaxcp_attention_bwd", "jaxcp_attention_fwd_plan", "jaxcp_attention_bwd_plan",
           "jaxcp_small_seq_fwd", "jaxcp_small_seq_bwd")
EXACT = 9  # _program's outputs that must match bit for bit: attention out, lse, dq, dk, dv; small-seq out, dq, dk, dv
RUN_SEEDS = (0, 1, 0, 0)  # the inputs of the runs: A, B, A, A
RUNS = len(RUN_SEEDS)


def _inputs(seed):
  """Packed rows (documents, a padding tail) for attention and a batch of 1-query rows for the
  small-sequence kernel, bf16."""
  rng = np.random.default_rng(seed)
  b, s, hq, hkv, d = 2, 700, 4, 2, 128
  key = jax.random.PRNGKey(seed)
  normal = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)
  seg = random_segments(rng, b, s, mean_doc=150)
  pos = positions_in_documents(seg)
  n, keys = 3000, 11
  lengths = rng.integers(0, keys + 1, size=n)  # 0: an empty row
  kv_seg = (np.arange(keys)[None, :] < lengths[:, None]).astype(np.int32)
  return dict(q=normal(0, (b, s, hq, d)), k=normal(1, (b, s, hkv, d)), v=normal(2, (b, s, hkv, d)),
              do=normal(3, (b, s, hq, d)), seg=jnp.asarray(seg), pos=jnp.asarray(pos),
              sq=normal(4, (n, 1, 2, 64)), sk=normal(5, (n, keys, 2, 64)), sv=normal(6, (n, keys, 2, 64)),
              sdo=normal(7, (n, 1, 2, 64)), sseg=jnp.ones((n, 1), jnp.int32), skv_seg=jnp.asarray(kv_seg))


def _program(x):
  """Attention forward and deterministic backward on packed rows (causal), small-sequence
  attention forward and backward (EXACT outputs: the same bits in every run), then attention's
  default backward (atomic dQ: the same up to the order of its float32 adds)."""
  def attn_grads(deterministic):
    attn = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=x["seg"], positions=x["pos"], is_causal=True,
                                           implementation="cuda", deterministic=deterministic,
                                           return_residual=True)
    (out, lse), vjp = jax.vjp(attn, x["q"], x["k"], x["v"])
    return out, lse, vjp((x["do"], jnp.zeros_like(lse)))

  out, lse, grads = attn_grads(True)

  def small(q, k, v):
    return jaxcp.attention(q, k, v, segment_ids=x["sseg"], kv_segment_ids=x["skv_seg"], implementation="cuda")

  s_out, s_vjp = jax.vjp(small, x["sq"], x["sk"], x["sv"])
  return (out, lse, *grads, s_out, *s_vjp(x["sdo"]), *attn_grads(False)[2])


def child_main(out_path):
  """Runs in a child process, with command buffers forced on (COMMAND_BUFFER_FLAGS) or off."""
  cuda_module = importlib.import_module("jaxcp._jaxcp_cuda")
  cuda_module.set_call_counting(True)
  fn = jax.jit(_program)
  inputs = {seed: _inputs(seed) for seed in set(RUN_SEEDS)}
  arrays = {}
  for i, seed in enumerate(RUN_SEEDS):
    # Each call's outputs are copied out and freed before the next, so that a call may get the
    # last one's buffers back and XLA may replay the graph instead of capturing it again.
    arrays.update({f"run{i}_{j}": np.asarray(jnp.asarray(r, jnp.float32)) for j, r in enumerate(fn(inputs[seed]))})
  counts = cuda_module.handler_call_counts()
  np.savez(out_path, **{f"calls_{t}": np.array(counts[t]) for t in TARGETS}, **arrays)


def _run_child(tmp_path, command_buffers):
  out_path = str(tmp_path / f"command_buffers_{command_buffers}.npz")
  flags = COMMAND_BUFFER_FLAGS if command_buffers else "--xla_gpu_enable_command_buffer="
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
  code = (f"import sys; sys.path.insert(0, {ROOT!r}); from tests import test_gpu_command_buffer as t; "
          f"t.child_main({out_path!r})")
  proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return np.load(out_path)


def test_handlers_replay_in_command_buffers(tmp_path):
  graphs = _run_child(tmp_path, True)
  plain = _run_child(tmp_path, False)
  # (calls, calls while the stream was being captured) per handler. Without command buffers each
  # call site runs in every run (XLA merges the two attention forwards: one site). With them
  # every handler was captured into a graph, and some run replayed a graph without calling it
  # (JAX 0.11.2 on an H200: 3 calls, 1 captured, per call site over the 4 runs).
  for t in TARGETS:
    plain_calls, plain_captured = plain[f"calls_{t}"]
    assert plain_calls > 0 and plain_calls % RUNS == 0 and plain_captured == 0, (t, plain_calls, plain_captured)
    calls, captured = graphs[f"calls_{t}"]
    assert captured >= plain_calls // RUNS and calls < plain_calls, (t, calls, captured, plain_calls)
  n_outputs = sum(name.startswith("run0_") for name in plain.files)
  assert n_outputs == EXACT + 3
  for run in range(RUNS):
    for j in range(n_outputs):
      got, want, what = graphs[f"run{run}_{j}"], plain[f"run{run}_{j}"], f"run {run}, output {j}"
      if j < EXACT:
        np.testing.assert_array_equal(got, want, err_msg=what)
      else:
        assert rel_err(got, want) < 5e-3, what
  for j in range(n_outputs):  # A's results are A's, not the last call's
    assert not np.array_equal(plain[f"run0_{j}"], plain[f"run1_{j}"])
