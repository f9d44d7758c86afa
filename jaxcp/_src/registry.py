"""Loads the compiled extensions once and registers their FFI targets with XLA."""
from __future__ import annotations

import functools
import importlib

import jax

from . import compat

# Platform names as jax.ffi.register_ffi_target spells them.
_EXTENSIONS = {"cpu": "jaxcp._jaxcp_cpu", "CUDA": "jaxcp._jaxcp_cuda"}


@functools.lru_cache(maxsize=None)
def _load(platform: str):
  try:
    module = importlib.import_module(_EXTENSIONS[platform])
  except ImportError:
    return None
  for name, capsule in module.registrations().items():
    compat.register_ffi_target(name, capsule, platform)
  return module


def cpu_extension_available() -> bool:
  return _load("cpu") is not None


def cuda_extension_available() -> bool:
  return _load("CUDA") is not None


def _gpu_present() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def ensure_registered() -> None:
  """Registers the extensions of the backends present; safe to call many times."""
  _load("cpu")
  if _gpu_present():
    _load("CUDA")


def default_backend() -> str:
  return jax.default_backend()


def kernel_platform() -> str | None:
  """The kernel platform for the default backend ("cpu" or "cuda"), if its extension loaded."""
  backend = default_backend()
  if backend == "cpu" and cpu_extension_available():
    return "cpu"
  if backend in ("gpu", "cuda") and cuda_extension_available():
    return "cuda"
  return None
