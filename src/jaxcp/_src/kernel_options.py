"""Which CUDA kernel runs: private options, for tests and measurements.

The public API always runs the best kernel for the device. These options pick an alternative
(the kernels an A100 runs, a fixed tiling, the older float32 small-seq kernels) by argument: they
are part of the primitives' static parameters, so a call with other options is another jit
cache entry, and they reach the CUDA handlers as the FFI attribute ``kernel`` (visible in the
HLO). The CPU kernels and the "xla" reference have one implementation each and ignore them.

Entry points: ``jaxcp._src.attention.api.attention_with_options`` and
``jaxcp._src.small_seq.api.small_seq_attention_with_options``.
"""
from __future__ import annotations

import dataclasses


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


@dataclasses.dataclass(frozen=True)
class SmallSeqKernelOptions:
  """CUDA small-sequence kernels (ffi/common/kernel_options.h has the same fields).

  cuda_core_fwd / cuda_core_bwd: the forward / backward in float32 on the CUDA cores instead of
    on tensor cores (the backward runs there anyway for GQA groups of more than 16 heads).
  """
  cuda_core_fwd: bool = False
  cuda_core_bwd: bool = False

  def __post_init__(self):
    _check_bools(self)

  def ffi_attrs(self) -> dict:
    return {f.name: bool(getattr(self, f.name)) for f in dataclasses.fields(self)}


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
