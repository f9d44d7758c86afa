// Shape checks shared by the CPU and CUDA small-sequence handlers.
// q [B,Hq,D], k/v [T,Hkv,D], kv_start/kv_len/kv_mask int32 [B] or empty, probs float32 [B,Hq,max_len].
// An empty index array stands for its default, which the callers need not materialise:
// kv_start, row b's tokens from b * max_len (the padded layout); kv_len, max_len; kv_mask, every
// token.
#pragma once
#include <cstdint>

#include "ffi_helpers.h"

namespace jaxcp {

constexpr int64_t kSmallSeqMaxLen = 16;

inline ffi::Error check_small_seq_inputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                         const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& start,
                                         const ffi::Buffer<ffi::S32>& len,
                                         const ffi::Buffer<ffi::S32>& mask, int64_t max_len) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3)
    return invalid("small_seq: q must be [B,Hq,D] and k/v [T,Hkv,D]");
  if (kd[0] != vd[0] || kd[1] != vd[1] || kd[2] != vd[2])
    return invalid("small_seq: k and v must have the same shape");
  if (kd[2] != qd[2]) return invalid("small_seq: q and k disagree on head_dim");
  if (kd[1] <= 0 || qd[1] % kd[1] != 0)
    return invalid("small_seq: q heads must be a multiple of kv heads");
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type())
    return invalid("small_seq: q, k and v must share a dtype");
  if (max_len < 0 || max_len > kSmallSeqMaxLen)
    return invalid("small_seq: max_len must be in [0, 16]");
  for (const ffi::Buffer<ffi::S32>* a : {&start, &len, &mask}) {
    auto d = a->dimensions();
    if (d.size() != 1 || (d[0] != qd[0] && d[0] != 0))
      return invalid("small_seq: index arrays must be [B] (or empty: the default)");
  }
  return ffi::Error::Success();
}

// The kernels' pointer to an index array: null when it is empty (the default).
inline const int32_t* small_seq_index(const ffi::Buffer<ffi::S32>& a) {
  return a.element_count() == 0 ? nullptr : a.typed_data();
}

inline ffi::Error check_small_seq_probs(const ffi::Buffer<ffi::F32>& p, int64_t batch,
                                        int64_t q_heads, int64_t max_len) {
  auto d = p.dimensions();
  if (d.size() != 3 || d[0] != batch || d[1] != q_heads || d[2] != max_len)
    return invalid("small_seq: probs must be float32 [B,Hq,max_len]");
  return ffi::Error::Success();
}

}  // namespace jaxcp
