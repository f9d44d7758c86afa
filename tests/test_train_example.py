"""examples/train_packed_lm.py: a few tiny training steps on 8 host devices, its per-process
batch building, its flags for several processes, and --save-metrics (tests/test_multiprocess.py
runs it as two processes)."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_packed_lm.py"
_TINY = ["--steps", "20", "--batch", "8", "--seq-len", "64", "--min-doc", "6", "--max-doc", "40",
         "--vocab", "32", "--d-model", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "16", "--mlp-hidden", "64", "--lr", "1e-2", "--warmup", "3", "--quiet"]


@pytest.fixture(scope="module")
def example():
  name = "train_packed_lm_example"
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses / flax modules resolve annotations through it
    spec.loader.exec_module(module)
  return sys.modules[name]


def _assert_learns(losses):
  assert len(losses) == 20
  assert np.isfinite(losses).all()
  first, last = np.mean(losses[:5]), np.mean(losses[-5:])
  assert last < first - 0.3, (first, last, losses)


@pytest.mark.parametrize("mesh", [("2", "2", "2"), ("8", "1", "1")], ids=["dp2-cp2-tp2", "dp8"])
def test_example_trains(example, cpu_devices, mesh, tmp_path):
  dp, cp, tp = mesh
  check = ["--check", "--check-steps", "3"] if cp == "2" else []
  metrics = tmp_path / "metrics.json"
  result = example.main(["--dp", dp, "--cp", cp, "--tp", tp, *check, *_TINY,
                         "--save-metrics", str(metrics)])
  assert result["mesh"] == (int(dp), int(cp), int(tp))
  assert result["process_count"] == 1 and result["axes_across_processes"] == []
  _assert_learns(result["losses"])
  assert result["tokens_per_s"] > 0
  saved = json.loads(metrics.read_text())
  assert saved["losses"] == result["losses"] and saved["mesh"] == list(result["mesh"])
  assert saved["process_count"] == 1 and saved["tokens_per_s"] == result["tokens_per_s"]
  if importlib.util.find_spec("matplotlib") is not None:
    assert metrics.with_suffix(".png").stat().st_size > 0
  if check:
    # main() already asserted rel <= 1e-4 (float32); kernel vs XLA reference, same batches.
    assert len(result["check"]) == 3
    assert max(r[3] for r in result["check"]) <= 1e-4
    assert result["check_uses_kernel"] == (True, False)  # CPU FFI kernel vs pure-JAX reference


def test_example_rejects_bad_mesh(example, cpu_devices):
  with pytest.raises(ValueError, match="--kv-heads"):
    example.main(["--dp", "2", "--tp", "4", "--kv-heads", "2", "--steps", "1", "--quiet"])
  with pytest.raises(ValueError, match="devices"):
    example.main(["--dp", "4", "--cp", "2", "--tp", "2", "--steps", "1", "--quiet"])


@pytest.mark.parametrize("cp,strategy", [(1, "striped"), (4, "striped"), (4, "zigzag_docs"),
                                         (2, "balanced_blocks")])
def test_process_parts_make_the_global_batch(example, cp, strategy):
  """Any split of rows and (permuted) columns over processes rebuilds the batch one process
  builds: every row is packed from its own stream and permuted per row."""
  args = example.parse_args(["--seq-len", "64", "--min-doc", "6", "--max-doc", "40",
                             "--load-balance", strategy, "--seed", "3"])
  rows, cols = np.arange(8), np.arange(64)
  whole = example.host_batch_rows(args, rows, cols, cp)
  top = example.host_batch_rows(args, rows[:4], cols[:32], cp)
  bottom = example.host_batch_rows(args, rows[4:], cols[32:], cp)
  for _ in range(3):   # three steps: the streams go on from where they stopped
    w, t, b = next(whole), next(top), next(bottom)
    for k in example._BATCH_KEYS:
      np.testing.assert_array_equal(w[k][:4, :32], t[k])
      np.testing.assert_array_equal(w[k][4:, 32:], b[k])
    assert w["tokens"].shape == (8, 64) and (w["segment_ids"] > 0).any()


def test_process_region_of_a_single_process(example, cpu_devices):
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = example.make_mesh(2, 2, 2)
  rows, cols = example.process_region(NamedSharding(mesh, P("dp", "cp")), (8, 64))
  np.testing.assert_array_equal(rows, np.arange(8))
  np.testing.assert_array_equal(cols, np.arange(64))
  assert example.axes_across_processes(mesh) == []


def test_example_rejects_incomplete_process_flags(example, monkeypatch):
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
              "SLURM_STEP_NODELIST", "OMPI_MCA_orte_hnp_uri"):
    monkeypatch.delenv(var, raising=False)
  with pytest.raises(ValueError, match="--coordinator, --process-id not given"):
    example.main(["--num-processes", "2", "--steps", "1", "--quiet"])
  with pytest.raises(ValueError, match=r"--process-id \(2\) must be in \[0, --num-processes \(2\)\)"):
    example.main(["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2",
                  "--steps", "1", "--quiet"])
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  with pytest.raises(ValueError, match="--coordinator, --process-id not given"):
    example.main(["--steps", "1", "--quiet"])
