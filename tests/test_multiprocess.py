"""Two processes x 4 host devices joined by jax.distributed (gloo, 127.0.0.1) give the
single-process results: attention with the context-parallel axis across the processes, and
three steps of examples/train_packed_lm.py, whose train step moves no part of the input batch
between data-parallel ranks and which makes no per-step cross-process equality check.

The processes run tests/multiprocess_worker.py (one launch, bounded by _TIMEOUT_S; on a failure
or timeout only the process groups started here are killed, and the workers' output is shown). The single-process answers come from this pytest process (8 host
devices) and, for the attention, from one device inside each worker.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_WORKER = _ROOT / "tests" / "multiprocess_worker.py"
_EXAMPLE = _ROOT / "examples" / "train_packed_lm.py"
_NUM_PROCESSES, _LOCAL_DEVICES = 2, 4
_TIMEOUT_S = 300

_TINY = ["--steps", "3", "--batch", "8", "--seq-len", "64", "--min-doc", "6", "--max-doc", "40",
         "--vocab", "32", "--d-model", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "16", "--mlp-hidden", "64", "--lr", "1e-2", "--warmup", "3", "--quiet"]
# name -> (flags, the mesh axis the process boundary cuts): dp across the processes (the
# example's default order) with all_gather and a per-row document-aware permutation; cp (and
# then tp inside each process) across them with the ring and with the document placement.
_RUNS = {
    "dp2_cp2_tp2_all_gather": (["--dp", "2", "--cp", "2", "--tp", "2", "--context-parallel",
                                "all_gather", "--load-balance", "zigzag_docs"], ["dp"]),
    "dp1_cp4_tp2_ring": (["--dp", "1", "--cp", "4", "--tp", "2", "--context-parallel", "ring",
                          "--load-balance", "striped"], ["cp"]),
    "dp1_cp4_tp2_document": (["--dp", "1", "--cp", "4", "--tp", "2", "--load-balance", "document"], ["cp"]),
}


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _load_example():
  name = "train_packed_lm_example"   # shared with test_train_example.py
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
  return sys.modules[name]


def _kill(procs) -> None:
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGKILL)   # the group of a process started here, nothing else
      except ProcessLookupError:
        pass
  for p in procs:
    p.wait()


def _outputs(out: pathlib.Path) -> str:
  text = []
  for i in range(_NUM_PROCESSES):
    for stream in ("stdout", "stderr"):
      f = out / f"worker_{i}.{stream}"
      if f.exists():
        lines = [l for l in f.read_text(errors="replace").splitlines() if "[Gloo]" not in l]
        text.append(f"--- worker {i} {stream} (last 60 lines) ---\n" + "\n".join(lines[-60:]))
  return "\n".join(text)


def _launch(out: pathlib.Path) -> dict:
  """Launches the workers, computes the single-process losses meanwhile, waits for both."""
  port = _free_port()
  spec = dict(port=port, num_processes=_NUM_PROCESSES, out=str(out), attention=True,
              examples={name: [*flags, *_TINY] for name, (flags, _) in _RUNS.items()})
  (out / "spec.json").write_text(json.dumps(spec))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={_LOCAL_DEVICES}",
             JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")  # loopback only
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
              "SLURM_PROCID", "SLURM_STEP_NODELIST", "OMPI_MCA_orte_hnp_uri"):
    env.pop(var, None)
  procs = []
  try:
    for i in range(_NUM_PROCESSES):
      with open(out / f"worker_{i}.stdout", "w") as o, open(out / f"worker_{i}.stderr", "w") as e:
        procs.append(subprocess.Popen(
            [sys.executable, str(_WORKER), str(out / "spec.json"), str(i)], cwd=str(_ROOT),
            env=env, stdout=o, stderr=e, start_new_session=True))  # own group: killpg hits only it
    deadline = time.monotonic() + _TIMEOUT_S
    example = _load_example()
    single = {name: example.main([*flags, *_TINY])["losses"] for name, (flags, _) in _RUNS.items()}
    while any(p.poll() is None for p in procs):
      if any(p.returncode not in (None, 0) for p in procs):
        break
      if time.monotonic() > deadline:
        _kill(procs)
        pytest.fail(f"workers did not finish within {_TIMEOUT_S} s\n{_outputs(out)}")
      time.sleep(0.2)
    codes = [p.returncode for p in procs]
  finally:
    _kill(procs)
  if codes != [0] * _NUM_PROCESSES:
    pytest.fail(f"worker exit codes {codes}\n{_outputs(out)}")
  results = [json.loads((out / f"result_{i}.json").read_text()) for i in range(_NUM_PROCESSES)]
  return dict(out=out, results=results, single=single)


def _check_processes(results):
  for i, r in enumerate(results):
    assert (r["process_index"], r["process_count"]) == (i, _NUM_PROCESSES)
    assert (r["local_devices"], r["devices"]) == (_LOCAL_DEVICES, _NUM_PROCESSES * _LOCAL_DEVICES)


def _check_attention(results):
  """Values and gradients (dq, dk, dv) of ring, all_gather and a document placement, jit and shard_map, with the cp
  axis crossing the processes, against the unsharded call: float32 rounding only."""
  for r in results:
    cases = r["attention"]
    assert {f"{mesh}/{strategy}/jit" for mesh in ("dp1_cp8", "dp2_cp4")
            for strategy in ("ring", "all_gather", "placement")} | {
        f"dp2_cp4/{strategy}/shard_map" for strategy in ("ring", "all_gather", "placement")} == set(cases)
    worst = max(e for errs in cases.values() for e in errs.values())
    assert worst < 2e-6, json.dumps(cases, indent=1)


def _check_example_losses(results, single, name):
  """Three training steps as two processes give the losses of one process with 8 devices."""
  want = np.asarray(single[name])
  for r in results:
    got = r["examples"][name]
    assert got["process_count"] == _NUM_PROCESSES
    assert got["axes_across_processes"] == _RUNS[name][1], got
    np.testing.assert_allclose(got["losses"], want, rtol=1e-5, err_msg=f"{name}, 2 processes "
                               f"vs 1: {got['losses']} vs {want.tolist()}")
    assert len(got["losses"]) == 3
  # The loss is replicated: both processes read the same value.
  assert results[0]["examples"][name]["losses"] == results[1]["examples"][name]["losses"]


def _check_no_equality_checks(results):
  """Batches are built with make_array_from_process_local_data: none of the per-array
  all-gather-and-compare checks that jax.device_put of a host array makes across processes
  (the control device_put shows that the counter sees them)."""
  for r in results:
    ex = r["examples"]
    assert all(ex[name]["equality_checks"] == 0 for name in _RUNS), ex
    assert ex["device_put_control_checks"] >= 1, ex


def test_two_processes_match_one_process(tmp_path, cpu_devices):
  """One launch and every check in one test (a module fixture would launch the processes
  once per pytest-xdist worker)."""
  run = _launch(tmp_path)
  results = run["results"]
  _check_processes(results)
  _check_attention(results)
  for name in _RUNS:
    _check_example_losses(results, run["single"], name)
    _check_train_step_collectives((run["out"] / f"{name}.hlo").read_text(), name)
  _check_no_equality_checks(results)


# ---------------------------------------------------------------------------------------------
# The compiled train step: which device groups its collectives connect.
#
# Replica groups name logical device ids, i.e. positions in the mesh's flattened device order,
# so id // (cp * tp) is the dp rank of a device of the (dp, cp, tp) mesh. XLA prints groups as
# explicit lists "{{0,2},{1,3}}", iota lists "[4,2]<=[2,2,2]T(0,2,1)", or mesh axes
# "mesh['axis_0'=2,'axis_1'=4] {'axis_1'}" (optionally with "device_ids=(...)", the mesh's device
# order); collective-permute lists source-target pairs.

_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%?\S+ = (?P<type>.+?) "
    r"(?P<op>all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce)(?:-start)?\("
    r"(?P<rest>.*)$", re.M)


def _groups(rest: str, n_devices: int) -> list[list[int]]:
  if m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", rest):
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
  if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest):
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest):
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape).tolist()
  if m := re.search(r"replica_groups=mesh\[([^\]]*)\]"
                    r"(?:, device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", rest):
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    ids = np.arange(int(np.prod(sizes)))
    if m.group(2):   # the mesh's devices: an iota "[4,2]T(1,0)" or a list "0,2,1,3"
      if it := re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group(2)):
        ids = ids.reshape([int(x) for x in it.group(1).split(",")])
        if it.group(2):
          ids = ids.transpose([int(x) for x in it.group(2).split(",")])
      else:
        ids = np.asarray([int(x) for x in m.group(2).split(",")])
    ids = ids.reshape(sizes)
    inner = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(3))]
    outer = [i for i in range(len(names)) if i not in inner]
    group_size = int(np.prod([sizes[i] for i in inner]))
    return ids.transpose(outer + inner).reshape(-1, group_size).tolist()
  if "replica_groups={}" in rest:
    return [list(range(n_devices))]
  raise AssertionError(f"unparsed collective: {rest[:300]}")


def _collectives(hlo: str, n_devices: int):
  return [(m.group("op"), m.group("type"), _groups(m.group("rest"), n_devices))
          for m in _COLLECTIVE.finditer(hlo)]


def test_group_parser_reads_every_format():
  assert _groups("x), replica_groups={{0,2},{1,3}}, dimensions={1}", 4) == [[0, 2], [1, 3]]
  assert _groups("x), replica_groups=[2,2]<=[4], to_apply=%a", 4) == [[0, 1], [2, 3]]
  assert _groups("x), replica_groups=[2,2]<=[2,2]T(1,0), to", 4) == [[0, 2], [1, 3]]
  assert _groups("x), replica_groups=mesh['a'=2,'b'=2] {'a'}, use", 4) == [[0, 2], [1, 3]]
  assert _groups("x), replica_groups=mesh['a'=1,'b'=2,'c'=2], device_ids=([2,2]T(1,0)) {'b'}, u",
                 4) == [[0, 1], [2, 3]]
  assert _groups("x), replica_groups=mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'b'}, u", 4) == [
      [3, 2], [1, 0]]
  assert _groups("x), source_target_pairs={{0,1},{1,0}}, ch", 2) == [[0, 1], [1, 0]]


def _check_train_step_collectives(hlo: str, name: str):
  """The input batch is sharded over dp; the only collectives that connect different dp ranks
  are floating-point all-reduces (gradients, loss sums). Anything that could move rows of the
  batch between dp ranks (all-gather, all-to-all, collective-permute, reduce-scatter, or an
  integer all-reduce) stays inside one dp rank's devices, where it is context parallelism
  (K/V with segment ids and positions) or tensor parallelism. With dp across the processes
  this is: no batch data crosses a process boundary."""
  dp, cp, tp = (int(x) for x in _RUNS[name][0][1:6:2])
  found = _collectives(hlo, dp * cp * tp)
  assert found, "no collective found: the HLO pattern no longer matches"
  ops = {op for op, _, _ in found}
  for op, type_, groups in found:
    crosses_dp = any(len({d // (cp * tp) for d in g}) > 1 for g in groups)
    moves_data = op != "all-reduce" or re.search(r"\b[su]\d+\[", type_)
    assert not (crosses_dp and moves_data), f"{op} {type_} across dp ranks: {groups}"
  if "ring" in name:
    assert "collective-permute" in ops and "all-gather" not in ops, ops
  else:
    assert "all-gather" in ops, ops


def test_collective_check_catches_a_gathered_batch(cpu_devices):
  """Control for _check_train_step_collectives: a batch gathered over dp fails it."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.asarray(cpu_devices[:8]).reshape(2, 2, 2), ("dp", "cp", "tp"))

  def step(tokens):
    rows = jax.lax.with_sharding_constraint(tokens, NamedSharding(mesh, P(None, "cp")))
    return jnp.sum(rows * jnp.arange(8)[:, None])

  batch = jax.ShapeDtypeStruct((8, 64), jnp.int32, sharding=NamedSharding(mesh, P("dp", "cp")))
  hlo = jax.jit(step).lower(batch).compile().as_text()
  with pytest.raises(AssertionError, match="across dp ranks"):
    _check_train_step_collectives(hlo, "dp2_cp2_tp2_all_gather")
