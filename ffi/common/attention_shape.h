// Plain description of an attention call, shared by CPU and CUDA code (no FFI types).
#pragma once
#include <cstdint>

#include "mask.h"

namespace jaxcp {

// Layouts: q/out/dq [B, Sq, Hq, D]; k/v/dk/dv [B, Skv, Hkv, D]; lse [B, Hq, Sq] float32;
// q_seg/q_pos [B, Sq] int32; kv_seg/kv_pos [B, Skv] int32. All row-major, contiguous.
struct AttentionShape {
  int64_t batch = 0, q_len = 0, kv_len = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  int64_t group() const { return q_heads / kv_heads; }  // query heads per key/value head
};

struct AttentionArgs {
  AttentionShape shape;
  MaskParams mask;
  float scale = 1.0f;
  bool deterministic = false;
};

}  // namespace jaxcp
