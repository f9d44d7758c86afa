"""Test setup: 8 host devices for sharding tests; `gpu` marker skipped where no GPU exists;
hypothesis prints the @reproduce_failure line of a failing example (CI and the GPU hosts keep no
example database between runs, so that line is how a failure is replayed)."""
import os

# pytest-xdist workers on a host of several GPUs (tools/gpu_tests.sh sets JAXCP_TEST_GPUS to
# their count): worker i takes GPU i mod count, before JAX initialises its backends.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if os.environ.get("JAXCP_TEST_GPUS") and _worker.startswith("gw") and "CUDA_VISIBLE_DEVICES" not in os.environ:
  os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_worker[2:]) % int(os.environ["JAXCP_TEST_GPUS"]))

# Must be set before JAX initialises its backends.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import hypothesis  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

hypothesis.settings.register_profile("jaxcp", print_blob=True)
hypothesis.settings.load_profile("jaxcp")


def _has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(scope="session")
def cpu_devices():
  devices = jax.devices("cpu")
  if len(devices) < 8:
    pytest.skip("needs 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  return devices
