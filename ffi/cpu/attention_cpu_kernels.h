// CPU reference kernels for packed-document attention (float32 math on float32 copies).
#pragma once
#include <cstdint>

#include "../common/attention_shape.h"

namespace jaxcp::cpu {

// All tensors float32 in the layouts of AttentionShape. out/lse are fully written.
void attention_fwd(const AttentionArgs& a, const float* q, const float* k, const float* v,
                   const int32_t* q_seg, const int32_t* q_pos, const int32_t* kv_seg,
                   const int32_t* kv_pos, float* out, float* lse);

// dq/dk/dv are fully written (zeros where no pair contributes). dlse is the cotangent of lse
// (zeros when only `out` is differentiated).
void attention_bwd(const AttentionArgs& a, const float* q, const float* k, const float* v,
                   const float* out, const float* lse, const float* dout, const float* dlse,
                   const int32_t* q_seg,
                   const int32_t* q_pos, const int32_t* kv_seg, const int32_t* kv_pos, float* dq,
                   float* dk, float* dv);

}  // namespace jaxcp::cpu
