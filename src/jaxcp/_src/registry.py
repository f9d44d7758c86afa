"""Loads the compiled extensions once and registers their FFI targets with XLA."""
from __future__ import annotations

import functools
import importlib
import warnings

import jax

from . import compat

# Platform names as jax.ffi.register_ffi_target spells them.
_EXTENSIONS = {"cpu": "jaxcp._jaxcp_cpu", "CUDA": "jaxcp._jaxcp_cuda"}
_load_errors: dict[str, str] = {}


@functools.lru_cache(maxsize=None)
def _load(platform: str):
  try:
    module = importlib.import_module(_EXTENSIONS[platform])
  except ImportError as e:
    _load_errors[platform] = f"{type(e).__name__}: {e}"
    return None
  for name, capsule in module.registrations().items():
    compat.register_ffi_target(name, capsule, platform)
  return module


def cpu_extension_available() -> bool:
  return _load("cpu") is not None


def cuda_extension_available() -> bool:
  return _load("CUDA") is not None


def cuda_module():
  """The loaded CUDA extension (callers first check kernel_platform() == "cuda")."""
  return _load("CUDA")


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


def _backend_platform() -> str | None:
  backend = default_backend()
  if backend == "cpu":
    return "cpu"
  if backend in ("gpu", "cuda"):
    return "CUDA"
  return None


def kernel_platform() -> str | None:
  """The kernel platform for the default backend ("cpu" or "cuda"), if its extension loaded."""
  platform = _backend_platform()
  if platform is None or _load(platform) is None:
    return None
  return platform.lower()


def missing_kernel_message() -> str:
  """Why no jaxcp kernel serves the default backend, and how to fix it."""
  platform = _backend_platform()
  if platform is None:
    return (f"jaxcp has no kernels for the {default_backend()!r} backend (only CPU and CUDA); "
            "implementation='xla' runs the pure-JAX reference there.")
  module = _EXTENSIONS[platform]
  error = _load_errors.get(platform, "not found")
  fix = ("reinstall with `pip install .` from a jaxcp checkout (it compiles the extension)"
         if platform == "cpu" else
         "reinstall with `pip install .` on a machine where `nvcc` (CUDA 12.4 or newer) is on the PATH, "
         "or pass CMAKE_ARGS=-DJAXCP_ENABLE_CUDA=ON to make a missing CUDA compiler an error")
  return (f"jaxcp's compiled {platform} extension ({module}) could not be loaded ({error}); {fix}. "
          "If you run from a jaxcp checkout, make sure `import jaxcp` finds the installed package "
          "(python -c 'import jaxcp; print(jaxcp.__file__)').")


@functools.lru_cache(maxsize=None)
def warn_fallback() -> None:
  """Warns once that implementation=None fell back to the pure-JAX reference."""
  warnings.warn(missing_kernel_message() + " Falling back to implementation='xla' (memory O(S^2)).",
                RuntimeWarning, stacklevel=4)
