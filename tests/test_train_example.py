"""examples/train_packed_lm.py: a few tiny training steps on 8 host devices."""
from __future__ import annotations

import importlib.util
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
def test_example_trains(example, cpu_devices, mesh):
  dp, cp, tp = mesh
  check = ["--check", "--check-steps", "3"] if cp == "2" else []
  result = example.main(["--dp", dp, "--cp", cp, "--tp", tp, *check, *_TINY])
  assert result["mesh"] == (int(dp), int(cp), int(tp))
  _assert_learns(result["losses"])
  assert result["tokens_per_s"] > 0
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
