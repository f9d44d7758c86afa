"""One process of the multi-process test (tests/test_multiprocess.py): run by path, never by pytest.

    python tests/multiprocess_worker.py SPEC.json PROCESS_ID

SPEC (written by the test): coordinator port, number of processes, output directory, and which
checks to run. The process joins JAX's distributed runtime at 127.0.0.1 (gloo collectives over
the host devices of XLA_FLAGS), then runs

* "examples": examples/train_packed_lm.py's main() for each argument list, with --coordinator,
  --num-processes and --process-id added (the first run joins the runtime through them),
  keeping the losses and writing the compiled train step of each run (process 0), while
  counting the cross-process equality checks that jax.device_put makes for host arrays (must
  stay 0; one deliberate device_put afterwards shows that the counter works);
* "attention": jaxcp.attention values and gradients on meshes whose context-parallel axis
  spans the processes (ring and all_gather, under jit partitioning and inside shard_map, on
  striped rows built with make_array_from_callback), against the unsharded call on one local
  device of this same process: relative errors.

It writes OUT/result_<id>.json; the test compares them with single-process runs.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import traceback

import jax
import numpy as np

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _meshes():
  """Meshes over all processes' devices whose "cp" axis crosses the process boundary."""
  from jax.sharding import Mesh
  procs = sorted({d.process_index for d in jax.devices()})
  local = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
           for p in procs]
  grid = np.asarray(local)                     # [process, local device]
  n_proc, n_local = grid.shape
  # cp over every device, process by process: the ring crosses between processes twice.
  cp_all = Mesh(grid.reshape(1, -1), ("dp", "cp"))
  # dp x cp with cp ranks 0..k-1 on process 0, k..2k-1 on process 1, ...: each dp row takes
  # k = n_local / 2 devices of every process.
  k = n_local // 2
  dp_cp = np.empty((2, n_proc * k), dtype=object)
  for d in range(2):
    for c in range(n_proc * k):
      dp_cp[d, c] = grid[c // k, d * k + c % k]
  return {"dp1_cp8": cp_all, "dp2_cp4": Mesh(dp_cp, ("dp", "cp"))}


def attention_checks() -> dict:
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jaxcp
  from jaxcp._src.compat import shard_map

  b, s, hq, hkv, d = 2, 64, 4, 2, 8
  rng = np.random.default_rng(0)
  q = rng.standard_normal((b, s, hq, d)).astype(np.float32)
  k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
  v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
  dout = rng.standard_normal((b, s, hq, d)).astype(np.float32)
  seg = np.zeros((b, s), np.int32)   # row 0: short documents; row 1: one long one + padding
  seg[0] = np.repeat(np.arange(1, 9), [3, 5, 13, 2, 9, 17, 7, 8])
  seg[1, :56] = 1
  pos = np.zeros_like(seg)
  for row in range(b):
    for sid in np.unique(seg[row][seg[row] > 0]):
      at = seg[row] == sid
      pos[row, at] = np.arange(at.sum())

  def fwd_bwd(strategy, axis=None):
    def run(q, k, v, dout, seg, pos):
      f = lambda q, k, v: jaxcp.attention(q, k, v, segment_ids=seg, positions=pos, is_causal=True,
                                          context_parallel=strategy, context_parallel_axis=axis)
      out, vjp = jax.vjp(f, q, k, v)
      return (out, *vjp(dout))
    return run

  # The single-process answer: the unsharded call (same CPU kernel) on one device of this process.
  local0 = jax.local_devices()[0]
  ref = jax.jit(fwd_bwd("auto"))(*(jax.device_put(x, local0) for x in (q, k, v, dout, seg, pos)))
  ref = [np.asarray(r) for r in ref]

  results = {}
  for mesh_name, mesh in _meshes().items():
    cp = mesh.shape["cp"]
    s4, s2 = P("dp", "cp", None, None), P("dp", "cp")
    specs = (s4, s4, s4, s4, s2, s2)
    # Every process computes the same permutations from the same host rows.
    placement, doc_perm, _ = jaxcp.choose_placement(seg, cp, sizes=(0, 4, s // cp))
    layouts = {"striped": "striped", "placement": doc_perm}
    for strategy in ("ring", "all_gather", "placement"):
      order = layouts["placement" if strategy == "placement" else "striped"]
      lb = lambda x: jaxcp.load_balance(x, cp, axis=1, strategy=order)
      host = [lb(x) for x in (q, k, v, dout, seg, pos)]   # positions derived before permuting
      args = [jax.make_array_from_callback(x.shape, NamedSharding(mesh, sp), lambda idx, x=x: x[idx])
              for x, sp in zip(host, specs)]
      context_parallel = placement if strategy == "placement" else strategy
      for mode in ("jit", "shard_map"):
        if mode == "shard_map" and mesh_name != "dp2_cp4":
          continue  # shard_map once, on the mesh with both axes
        if mode == "jit":
          f = jax.jit(fwd_bwd(context_parallel))
        else:
          f = jax.jit(shard_map(fwd_bwd(context_parallel, axis="cp"), mesh=mesh, in_specs=specs,
                                out_specs=(s4, s4, s4, s4)))
        outs = multihost_utils.process_allgather(f(*args), tiled=True)
        got = [jaxcp.restore_order(np.asarray(o), cp, axis=1, strategy=order) for o in outs]
        errs = {name: _rel_err(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
        results[f"{mesh_name}/{strategy}/{mode}"] = errs
  return results


def _load_example():
  path = _ROOT / "examples" / "train_packed_lm.py"
  spec = importlib.util.spec_from_file_location("train_packed_lm_example", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses / flax modules resolve annotations through it
  spec.loader.exec_module(module)
  return module


def example_runs(runs: dict, hlo_dir: pathlib.Path) -> dict:
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  example = _load_example()
  checks = {"count": 0}
  original = multihost_utils.assert_equal

  def counting_assert_equal(*a, **kw):   # what device_put of a host array calls per array
    checks["count"] += 1
    return original(*a, **kw)

  multihost_utils.assert_equal = counting_assert_equal
  results = {}
  try:
    for name, argv in runs.items():
      before = checks["count"]
      r = example.main([*argv, "--dump-hlo", str(hlo_dir / f"{name}.hlo")])
      results[name] = dict(losses=r["losses"], mesh=list(r["mesh"]),
                           process_count=r["process_count"],
                           axes_across_processes=r["axes_across_processes"],
                           equality_checks=checks["count"] - before)
    # Control: a host array device_put onto a cross-process sharding is checked (counted).
    before = checks["count"]
    mesh = Mesh(np.asarray(jax.devices()), ("x",))
    jax.device_put(np.zeros((len(jax.devices()), 4), np.int32), NamedSharding(mesh, P("x")))
    results["device_put_control_checks"] = checks["count"] - before
  finally:
    multihost_utils.assert_equal = original
  return results


def main(spec_path: str, process_id: int) -> None:
  spec = json.loads(pathlib.Path(spec_path).read_text())
  out = pathlib.Path(spec["out"])
  address = f"127.0.0.1:{spec['port']}"
  join = ["--coordinator", address, "--num-processes", str(spec["num_processes"]),
          "--process-id", str(process_id)]
  result = {}
  try:
    if spec.get("examples"):
      # The example joins the distributed runtime itself, from its flags (the first run).
      runs = {name: [*argv, *join] for name, argv in spec["examples"].items()}
      result["examples"] = example_runs(runs, out)
    else:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(address, spec["num_processes"], process_id,
                                 initialization_timeout=60)
    result.update(process_index=jax.process_index(), process_count=jax.process_count(),
                  local_devices=jax.local_device_count(), devices=jax.device_count())
    if spec.get("attention"):
      result["attention"] = attention_checks()
  except Exception:  # the test prints it; the other process then fails on its own collective
    result["error"] = traceback.format_exc()
    (out / f"result_{process_id}.json").write_text(json.dumps(result, indent=1))
    raise
  (out / f"result_{process_id}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
