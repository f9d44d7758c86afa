// Launchers of the CUDA small-sequence attention kernels (no FFI types here).
//
// One query token per row attends to at most max_len (<= 16) key/value tokens.
// Layouts (row-major, contiguous): q/out/dq/dout [B, Hq, D]; k/v/dk/dv [T, Hkv, D] (the padded
// layout [B, Skv, Hkv, D] is the same memory viewed as [B*Skv, Hkv, D]); probs float32
// [B, Hq, max_len]. Row b attends to tokens kv_start[b] + j, j < kv_len[b], whose bit j of
// kv_mask[b] is set; a null index array is its default (kv_start[b] = b * max_len, kv_len[b] =
// max_len, every bit set). Runtime values are clamped, never trusted: len into [0, max_len], start into
// [0, T], len into [0, T - start]. Rows must come with non-overlapping ranges in increasing
// order (jaxcp's Python layer guarantees it); otherwise results are unspecified but memory
// accesses stay in bounds.
//
// Every launcher only enqueues kernels on `stream` (no allocation, no synchronisation), so it
// can be captured into a CUDA graph. Outputs are fully written.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/kernel_options.h"

namespace jaxcp::cuda {

enum class SmallSeqDType { kBF16, kF16 };

struct SmallSeqArgs {
  int64_t batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0, tokens = 0, max_len = 0;
  float scale = 1.0f;
  SmallSeqKernelOptions kernel;  // tensor-core (default) or CUDA-core kernels
};

// Head dims with compiled kernels: 64, 128, 256, 512.
bool small_seq_head_dim_supported(int64_t head_dim);

// out = softmax(scale * q k^T) v per row and query head; probs = the softmax probabilities
// (0 for tokens past the row's length or masked). Rows without a token: out 0, probs 0.
// Returns cudaErrorInvalidValue for an unsupported head dim / shape, else the launch status.
cudaError_t small_seq_fwd(const SmallSeqArgs& args, SmallSeqDType dtype, const void* q,
                          const void* k, const void* v, const int32_t* kv_start,
                          const int32_t* kv_len, const int32_t* kv_mask, void* out, float* probs,
                          cudaStream_t stream);

// Gradients from the saved probabilities (scores are not recomputed), one pass over K and V:
//   dp_hj = dout_h . v_j, delta_h = sum_j p_hj dp_hj, ds = p (dp - delta),
//   dq_h = scale sum_j ds_hj k_j, dk_j = scale sum_{h in group} ds_hj q_h,
//   dv_j = sum_{h in group} p_hj dout_h.
// dk/dv rows that no row covers are written as zeros. Deterministic (no atomics).
cudaError_t small_seq_bwd(const SmallSeqArgs& args, SmallSeqDType dtype, const void* q,
                          const void* k, const void* v, const float* probs, const void* dout,
                          const int32_t* kv_start, const int32_t* kv_len, const int32_t* kv_mask,
                          void* dq, void* dk, void* dv, cudaStream_t stream);

}  // namespace jaxcp::cuda
