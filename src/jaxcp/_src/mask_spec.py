"""The static (trace-time) part of a mask: causal flag, window and chunk size."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  is_causal: bool = False
  window_left: int = -1   # < 0: unbounded
  window_right: int = -1  # < 0: unbounded
  chunk_size: int = 0     # <= 0: no chunking

  def ffi_attrs(self) -> dict:
    return dict(
        is_causal=bool(self.is_causal),
        window_left=np.int64(self.window_left),
        window_right=np.int64(self.window_right),
        chunk_size=np.int64(self.chunk_size),
    )
