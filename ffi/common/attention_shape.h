// Plain description of an attention call, shared by CPU and CUDA code (no FFI types).
#pragma once
#include <cstdint>

#include "kernel_options.h"
#include "mask.h"

namespace jaxcp {

// Layouts: q/dq [B, Sq, Hq, D]; k/dk [B, Skv, Hkv, D]; v/dv [B, Skv, Hkv, Dv]; out [B, Sq, Hq, Dv];
// lse [B, Hq, Sq] float32; q_seg/q_pos [B, Sq] int32; kv_seg/kv_pos [B, Skv] int32. All row-major,
// contiguous. Dv = D except where a kernel runs a value head dim of its own (multi-head latent
// attention): value_dim 0 means D.
struct AttentionShape {
  int64_t batch = 0, q_len = 0, kv_len = 0, q_heads = 0, kv_heads = 0, head_dim = 0, value_dim = 0;
  int64_t group() const { return q_heads / kv_heads; }  // query heads per key/value head
  int64_t v_dim() const { return value_dim > 0 ? value_dim : head_dim; }
};

struct AttentionArgs {
  AttentionShape shape;
  MaskParams mask;
  float scale = 1.0f;
  bool deterministic = false;
  AttentionKernelOptions kernel;  // which CUDA kernels run (the CPU has one kernel)
};

}  // namespace jaxcp
