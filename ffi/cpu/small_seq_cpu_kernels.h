// CPU reference kernels for small-sequence attention: one query token per row attending to at
// most `max_len` (<= 16 in practice) key/value tokens. Float32 math on float32 copies.
//
// Layouts (row-major, contiguous): q/out/dq [B, Hq, D]; k/v/dk/dv [T, Hkv, D] (the padded
// layout [B, Skv, Hkv, D] viewed as [B*Skv, Hkv, D]); probs float32 [B, Hq, max_len].
// Row b attends to tokens kv_start[b] + j for j < kv_len[b] whose bit j of kv_mask[b] is set; a
// null index array is its default (kv_start[b] = b * max_len, kv_len[b] = max_len, every bit).
// Runtime values are clamped, never trusted: len into [0, max_len], start into [0, T] and
// len into [0, T - start]. The caller (jaxcp) passes non-overlapping ranges in increasing order.
#pragma once
#include <cstdint>

namespace jaxcp::cpu {

struct SmallSeqShape {
  int64_t batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0, tokens = 0, max_len = 0;
  float scale = 1.0f;
};

// out and probs are fully written; rows without an allowed key get out 0 and probs 0.
void small_seq_fwd(const SmallSeqShape& s, const float* q, const float* k, const float* v,
                   const int32_t* kv_start, const int32_t* kv_len, const int32_t* kv_mask,
                   float* out, float* probs);

// Gradients from the saved probabilities (the scores are never recomputed). dq/dk/dv are fully
// written: rows of dk/dv that no sequence covers are zero.
void small_seq_bwd(const SmallSeqShape& s, const float* q, const float* k, const float* v,
                   const float* probs, const float* dout, const int32_t* kv_start,
                   const int32_t* kv_len, const int32_t* kv_mask, float* dq, float* dk, float* dv);

}  // namespace jaxcp::cpu
