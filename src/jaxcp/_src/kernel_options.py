"""Which CUDA kernel runs: private options, for tests and measurements.

The public API always runs the best kernel for the device. These options pick an alternative
(the kernels an A100 runs, a fixed tiling, another small-seq kernel family) by argument: they
are part of the primitives' static parameters, so a call with other options is another jit
cache entry, and they reach the CUDA handlers as the FFI attribute ``kernel`` (visible in the
HLO). The CPU kernels and the "xla" reference have one implementation each and ignore them.

Entry points: ``jaxcp._src.attention.api.attention_with_options`` and
``jaxcp._src.small_seq.api.small_seq_attention_with_options``.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class AttentionKernelOptions:
  """CUDA attention kernels (ffi/common/kernel_options.h has the same fields).

  sm80_only: the sm_80 kernels (forward, backward and their tile plans) even on an sm_90 device,
    as an A100 runs them.
  fwd_fixed_tiles: the sm_90a forward takes query tiles of 128 rows from token 0 instead of tiles
    that start at documents (for measuring what document tiles gain).
  """
  sm80_only: bool = False
  fwd_fixed_tiles: bool = False

  def __post_init__(self):
    _check_bools(self)

  def ffi_attrs(self) -> dict:
    return {f.name: bool(getattr(self, f.name)) for f in dataclasses.fields(self)}


# Small-seq kernel families and their codes in ffi/common/kernel_options.h (SmallSeqKernel);
# "auto" is resolved to one of them before lowering (small_seq/dispatch.py).
SMALL_SEQ_KERNELS = {"mma": 1, "cuda_core": 2, "lanes": 3}


@dataclasses.dataclass(frozen=True)
class SmallSeqKernelOptions:
  """CUDA small-sequence kernels for the forward and the backward (ffi/common/kernel_options.h):
    "auto": the measured rule of small_seq/dispatch.py (what the public API runs);
    "mma": one warp per (row, key/value head), the math on tensor cores;
    "cuda_core": one warp per (row, key/value head), float32 math on the CUDA cores;
    "lanes": D/8 lanes per (row, key/value head) holding its K/V in registers, float32 math
      (forward: head dims 64-256, and 512 up to 8 keys; backward: the same for groups of 1 or 2
      query heads, larger groups up to 4 keys at head dims up to 256).
  A family that cannot run a shape fails the call (cudaErrorInvalidValue).
  """
  fwd: str = "auto"
  bwd: str = "auto"

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if value != "auto" and value not in SMALL_SEQ_KERNELS:
        raise ValueError(f"SmallSeqKernelOptions.{f.name} must be 'auto' or one of "
                         f"{sorted(SMALL_SEQ_KERNELS)}, got {value!r}.")

  def ffi_attrs(self) -> dict:
    """The families' codes; "auto" must have been resolved (small_seq/dispatch.py)."""
    if "auto" in (self.fwd, self.bwd):
      raise ValueError(f"{self} still has an 'auto' kernel: resolve it with small_seq.dispatch first.")
    return {f.name: np.int32(SMALL_SEQ_KERNELS[getattr(self, f.name)]) for f in dataclasses.fields(self)}


def _check_bools(options) -> None:
  for f in dataclasses.fields(options):
    value = getattr(options, f.name)
    if not isinstance(value, bool):
      raise ValueError(f"{type(options).__name__}.{f.name} must be a bool, got {value!r}.")


def check_options(options, cls):
  """`options` as given, or a clear error when it is not a `cls`."""
  if not isinstance(options, cls):
    raise ValueError(f"kernel_options must be a {cls.__name__} instance, got {options!r}.")
  return options
