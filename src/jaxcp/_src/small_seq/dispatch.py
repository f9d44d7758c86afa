"""Which CUDA small-seq kernel family runs, per static shape (group G = Hq/Hkv, head dim D,
max_len): the measured rule behind SmallSeqKernelOptions' "auto". The choice is made at trace time
and reaches the CUDA handler as the FFI attribute ``kernel`` (visible in the HLO).

Families (ffi/cuda/small_seq/launch.cu):
  lanes     : D/8 lanes per (row, key/value head), K/V in registers, float32 math. Its registers
              hold 2 x NT x D/8/L chunks (NT = max_len rounded up to 2, 4, 8, 12, 16; L = min(32,
              D/8) lanes), so D = 512 only up to 8 keys, except in the forward of one query
              head a task, which holds K, then V (from 12 keys on; at D 512 half the tokens at
              a time); the backward also holds, for groups of 1 or 2 query heads, the group's P
              and dS, and for larger groups float32 dK/dV of every token (the heads stream
              through): up to 4 keys at D <= 256.
  mma       : one warp per (row, key/value head), math on tensor cores; backward groups <= 16.
  cuda_core : one warp per (row, key/value head), float32 math; any group.
Rule (measured on 4 x H200, 2026-11-27: benchmarks/README.md, small-sequence attention, "Shape
sweep"; lanes time over mma time, geometric mean over batch sizes and layouts):
  - groups of 1-2 heads: lanes 0.3-0.9x mma up to 8 keys (the fewer keys and the smaller D, the
    larger its lead). 9-12 keys run in lanes' 12-token registers (2 x H200, 2026-11-28, B 16384
    and 262144, Skv 12, padded and ragged): D 64 0.69-0.74x mma forward and 0.70-0.90x backward
    with 4-32 heads (0.75-0.95x / 0.74-0.99x with one), D 128 0.94-1.05x / 0.91-1.02x, D 256
    0.94-1.00x / 0.90-0.98x; at 16 keys mma ties or wins (up to 1.36x at D 256) -> lanes up to 12
    keys, mma above (forward and backward). With lane groups walking several rows from 8 keys on
    (one H200, 2026-12-02, B 262144, one head): at 16 keys lanes 0.94-0.98x mma forward at D 64,
    1.00x at D 128 (padded), backward 0.90-1.04x at D 64 and 1.02x at D 128: within a run's
    noise, so the rule stands; at 8-12 keys lanes 0.57-0.91x mma forward;
  - one query head a task (MHA, any head count), forward: from 12 keys on the lane group loads V
    into K's registers once the scores are summed (128 registers, 4 blocks an SM instead of 2-3;
    at D 512 half the tokens a register set, 3 blocks); lanes 0.57-0.90x mma over 12 and 16 keys,
    all 45 points of 1/1, 4/4, 8/8 and 32/32 heads at D 64-256 (one H200, 2026-12-03, B 16384 and
    262144, padded and ragged), 0.64-0.75x on the 7 points of 1/1 and 4/4 heads at D 512 (B 16384)
    -> lanes up to 16 keys at any D (the backward keeps the rule above);
  - groups of 3-4 heads, forward: lanes 0.6-0.8x mma up to 4 keys at D <= 128, even or behind
    otherwise (its float32 work grows with the group) -> lanes up to 4 keys at D <= 128; with
    lane groups walking several rows, 4/1 heads at B 262144 (2026-12-02): lanes 1.11-1.74x mma at
    8-16 keys of D 64, 1.34-1.86x at D 128;
  - groups over 2 heads, backward (heads streamed through the lane group; one H200, 2026-11-29,
    padded): groups of 3-4 (B 262144; 4/1, 6/2, 8/2 heads), lanes over mma at 2 keys 0.51-0.53x
    (D 64), 0.65-0.77x (D 128), 0.81-0.92x (D 256); at 4 keys 0.66-0.78x (D 64), 0.89-1.02x
    (D 128), 1.22x (D 256, 4/1) -> lanes up to 2 keys at D <= 256 and up to 4 keys at D <= 128.
    Groups of 8 (B 65536; 32/4, 16/2): 0.82-0.83x at 2 keys of D 64, 1.12-1.32x at 4 keys or
    D 128 -> lanes only at up to 2 keys of D 64 (groups of 5-16). Groups of 32 (32/1, no mma):
    lanes over cuda_core 0.80-0.89x at D 128, 0.97x / 1.04x at 2 / 4 keys of D 64 -> lanes
    wherever it runs (groups over 16);
  - otherwise: mma (cuda_core for backward groups over 16 where lanes does not run).
`prefer_one_key_path`: rows of one key (padded or ragged, any group) take the pure-JAX one-key
path (one_key.py: V where the key is allowed, without reading Q or K; the ragged backward gathers
dO through a token -> row map instead of scatter-adding; from one_key.PAIRS_MIN_ROWS rows it moves
16-bit rows as 32-bit pairs). Measured on all 104 points of one key (4 x H200, 2026-11-28 16:46
UTC, benchmarks/results/small_seq_one_key_h200.md): at B >= 262144 1.57-2.88x XLA forward and
1.34-5.16x forward+backward. The day before, what ran there instead: the generic pure-JAX program
0.95-1.03x both ways (padded, groups of 1-2), the lane-group kernels 0.71-1.17x forward+backward
(ragged, groups of 1-2), the kernels 1.15-1.43x / 1.47-2.15x (groups of 4).
"""
from __future__ import annotations

import dataclasses

from ..kernel_options import SmallSeqKernelOptions

LANES_MAX_GROUP = 2  # the lane-group backward's register arrays hold 1 or 2 heads' P and dS
LANES_GQA_BWD_MAX_LEN, LANES_GQA_BWD_MAX_DIM = 4, 256  # larger groups: float32 dK/dV per token
LANES_MAX_LEN = 12  # above this many keys (its 16-token registers) mma ties or wins
# One query head a task (MHA): the forward loads V into K's registers (fwd_lanes_one_head) and
# wins up to 16 keys at every head dim
LANES_ONE_HEAD_MAX_LEN = 16
LANES_GQA_MAX_GROUP, LANES_GQA_MAX_LEN, LANES_GQA_MAX_DIM = 4, 4, 128  # lanes forward for GQA
MMA_BWD_MAX_GROUP = 16  # the tensor-core backward keeps the dS of at most 16 heads in registers


def lanes_fit(head_dim: int, max_len: int) -> bool:
  """Whether the lane-group kernels hold a task's K and V in registers together (launch.cu
  lanes_hold_kv)."""
  return head_dim <= 256 or max_len <= 8


def available(direction: str, family: str, group: int, head_dim: int, max_len: int) -> bool:
  """Whether `family` can run the forward ("fwd") or backward ("bwd") of this shape."""
  if family == "lanes":
    if direction == "fwd":  # one query head a task holds K, then V (fwd_lanes_one_head): any D
      return group == 1 or lanes_fit(head_dim, max_len)
    if group <= LANES_MAX_GROUP:
      return lanes_fit(head_dim, max_len)
    return max_len <= LANES_GQA_BWD_MAX_LEN and head_dim <= LANES_GQA_BWD_MAX_DIM
  if family == "mma":
    return direction == "fwd" or group <= MMA_BWD_MAX_GROUP
  return family == "cuda_core"


def default_fwd(group: int, head_dim: int, max_len: int) -> str:
  if group <= LANES_MAX_GROUP and max_len <= LANES_MAX_LEN and lanes_fit(head_dim, max_len):
    return "lanes"
  if group == 1 and max_len <= LANES_ONE_HEAD_MAX_LEN:
    return "lanes"
  if group <= LANES_GQA_MAX_GROUP and max_len <= LANES_GQA_MAX_LEN and head_dim <= LANES_GQA_MAX_DIM:
    return "lanes"
  return "mma"


def _lanes_bwd_wins(group: int, head_dim: int, max_len: int) -> bool:
  """Where the lane-group backward beat the other families (the module docstring's figures)."""
  if group <= LANES_MAX_GROUP:
    return max_len <= LANES_MAX_LEN and lanes_fit(head_dim, max_len)
  if not available("bwd", "lanes", group, head_dim, max_len):
    return False
  if group <= 4:
    return max_len <= 2 or head_dim <= 128
  if group <= MMA_BWD_MAX_GROUP:  # its float32 work grows with the group; mma's hardly
    return max_len <= 2 and head_dim <= 64
  return True  # against cuda_core


def default_bwd(group: int, head_dim: int, max_len: int) -> str:
  if _lanes_bwd_wins(group, head_dim, max_len):
    return "lanes"
  return "mma" if group <= MMA_BWD_MAX_GROUP else "cuda_core"


def prefer_one_key_path(max_len: int) -> bool:
  """Whether implementation=None runs the pure-JAX one-key path (one_key.py) instead of the CUDA
  kernels."""
  return max_len == 1


def resolve(options: SmallSeqKernelOptions, group: int, head_dim: int, max_len: int) -> SmallSeqKernelOptions:
  """`options` with "auto" replaced by the rule's family for this shape."""
  fwd = default_fwd(group, head_dim, max_len) if options.fwd == "auto" else options.fwd
  bwd = default_bwd(group, head_dim, max_len) if options.bwd == "auto" else options.bwd
  return dataclasses.replace(options, fwd=fwd, bwd=bwd)
