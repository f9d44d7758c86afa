// FFI aliases and error helpers shared by the CPU and CUDA handlers.
#pragma once
#include <cstdint>
#include <string>

#include "attention_shape.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcp {

namespace ffi = xla::ffi;

inline ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxcp: " + msg);
}
inline ffi::Error internal_error(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInternal, "jaxcp: " + msg);
}

// Reads the [B, S, H, D] shapes of q and k into an AttentionShape and checks consistency
// (the Python layer already validated; this guards against a mis-wired lowering).
inline ffi::Error attention_shape_from(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                       AttentionShape* out) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) return invalid("q and k must have rank 4");
  out->batch = qd[0];
  out->q_len = qd[1];
  out->q_heads = qd[2];
  out->head_dim = qd[3];
  out->kv_len = kd[1];
  out->kv_heads = kd[2];
  if (kd[0] != qd[0] || kd[3] != qd[3]) return invalid("q and k disagree on batch or head_dim");
  if (out->kv_heads <= 0 || out->q_heads % out->kv_heads != 0)
    return invalid("q heads must be a multiple of kv heads");
  return ffi::Error::Success();
}

inline AttentionArgs attention_args(const AttentionShape& shape, bool causal, int64_t window_left,
                                    int64_t window_right, int64_t chunk_size, float scale,
                                    bool deterministic) {
  AttentionArgs a;
  a.shape = shape;
  a.mask.causal = causal;
  a.mask.window_left = window_left;
  a.mask.window_right = window_right;
  a.mask.chunk_size = chunk_size;
  a.scale = scale;
  a.deterministic = deterministic;
  return a;
}

}  // namespace jaxcp
