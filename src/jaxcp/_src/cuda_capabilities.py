"""What the CUDA kernels support on this device, and the buffers they need: asked of the CUDA
extension at trace time. Which kernels run depends on the device and on the call's kernel
options (AttentionConfig.kernel), never on the environment."""
from __future__ import annotations

import functools

from . import registry


def _cuda_args(direction: str, q_shape, kv_shape, config) -> tuple:
  """The CUDA module's size and support queries' positional arguments for these shapes."""
  b, sq, hq, d = q_shape
  skv, hkv = kv_shape[1], kv_shape[2]
  mask = config.mask
  args = (b, sq, skv, hq, hkv, d, mask.is_causal, mask.window_left, mask.window_right, mask.chunk_size)
  return args + (config.deterministic,) if direction == "bwd" else args


def _cuda_bytes(what: str, direction: str, q_shape, kv_shape, config) -> int:
  """The CUDA module's attention_<direction>_<what>_bytes for these shapes and this AttentionConfig."""
  size = getattr(registry.cuda_module(), f"attention_{direction}_{what}_bytes")
  return int(size(*_cuda_args(direction, q_shape, kv_shape, config), **config.kernel.ffi_attrs()))


def attention_bwd_chains(q_shape, kv_shapes, config) -> bool:
  """Whether the CUDA backward of these queries against each of `kv_shapes` (disjoint key sets)
  runs as chained calls that share the query side (primitive.bwd_begin / bwd_end): the sm_90a
  kernel, keys in every set. False where no CUDA kernel runs."""
  if registry.kernel_platform() != "cuda":
    return False
  module = registry.cuda_module()
  return all(module.attention_bwd_chains(*_cuda_args("bwd", q_shape, s, config), **config.kernel.ffi_attrs())
             for s in kv_shapes)


def attention_workspace_bytes(direction: str, q_shape, kv_shape, config) -> int:
  """Bytes of device workspace the CUDA attention kernels need (0 where no CUDA kernel runs).

  Passed to the FFI call as an extra result buffer: XLA owns it, so its address is stable under
  CUDA-graph capture."""
  if registry.kernel_platform() != "cuda":
    return 0
  return _cuda_bytes("workspace", direction, q_shape, kv_shape, config)


def attention_plan_bytes(direction: str, q_shape, kv_shape, config) -> int:
  """Bytes of the CUDA attention's tile plan, the result of the plan call
  (`jaxcp_attention_<fwd|bwd>_plan`) that the attention call takes as an operand."""
  return _cuda_bytes("plan", direction, q_shape, kv_shape, config)


# The CUDA kernels' head dims (64, 128, 256; on sm_90a also 96 and 192, and the sm_90a forward a
# value head dim of 128 next to 192: attention_head_dim_supported says which run where). Others
# are zero-padded to the next.
CUDA_KERNEL_HEAD_DIMS = (64, 96, 128, 192, 256)


@functools.lru_cache(maxsize=None)
def cuda_kernel_head_dims(direction: str, d: int, dv: int, scale: float, deterministic: bool,
                          kernel) -> tuple[int, int]:
  """(head dim, value head dim) the CUDA attention kernels of `direction` ("fwd" / "bwd") run for
  head dims d and dv on the current device with these kernel options (an AttentionKernelOptions):
  w, the smallest width they support that is at least both (<= 256), and for V the smallest width
  from dv up that they run next to w (w itself but for multi-head latent attention's 192 / 128 in
  the sm_90a kernels)."""
  module = registry.cuda_module()
  options = kernel.ffi_attrs()
  runs = lambda w, wv: module.attention_head_dim_supported(direction == "fwd", w, wv, scale, deterministic,
                                                           **options)
  w = next(w for w in CUDA_KERNEL_HEAD_DIMS if w >= max(d, dv) and runs(w, w))
  wv = next(wv for wv in CUDA_KERNEL_HEAD_DIMS if dv <= wv <= w and (wv == w or runs(w, wv)))
  return w, wv
