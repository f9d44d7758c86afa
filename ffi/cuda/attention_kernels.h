// Launchers of the CUDA packed-document attention kernels (no FFI types here).
//
// Layouts and mask semantics are those of ../common/attention_shape.h and ../common/mask.h:
// q/out/dq [B,Sq,Hq,D], k/v/dk/dv [B,Skv,Hkv,D], lse float32 [B,Hq,Sq] (natural log),
// q_seg/q_pos [B,Sq], kv_seg/kv_pos [B,Skv] int32; all contiguous.
//
// Every launcher only enqueues work on `stream` (kernels and cudaMemsetAsync): no allocation,
// no synchronisation, no host-device copies, so it can be captured into a CUDA graph. The caller
// provides a device workspace of at least *_workspace_bytes(args) bytes (256-byte aligned);
// its content on entry does not matter. Outputs are fully written.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../common/attention_shape.h"

namespace jaxcp::cuda {

enum class DType { kBF16, kF16 };

// Whether the forward kernels run args.shape.head_dim for these arguments: 64, 128 and 256
// always; 96 and 192 where the sm_90a kernel runs (fwd_use_sm90: an sm_90 device, no short
// window). Callers zero-pad any other head dim to the next supported one.
bool attention_fwd_head_dim_supported(const AttentionArgs& args);

// Whether the backward kernels run args.shape.head_dim for these arguments: 64, 128 and 256
// always; 96 and 192 where the sm_90a kernel runs and deterministic is off (its deterministic dQ
// falls back to the sm_80 kernels on rows long enough, a rule of the local shape that a caller
// under sharding cannot see).
bool attention_bwd_head_dim_supported(const AttentionArgs& args);

// Bytes of workspace the forward needs (tile summaries and per-tile work ranges: O(B*S)).
size_t attention_fwd_workspace_bytes(const AttentionArgs& args);

// out = softmax(scale * q k^T, masked) v; lse = log-sum-exp of the masked scaled scores.
// Rows with no allowed key: out 0, lse -inf. Returns cudaErrorInvalidValue for an unsupported
// head dim or inconsistent shape, otherwise the launch status.
cudaError_t attention_fwd(const AttentionArgs& args, DType dtype, const void* q, const void* k,
                          const void* v, const int32_t* q_seg, const int32_t* q_pos,
                          const int32_t* kv_seg, const int32_t* kv_pos, void* out, float* lse,
                          void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Bytes of workspace the backward needs: tile summaries, dot(dO, O) rows, a float32 dQ
// accumulator (with per-tile turns when deterministic on sm_90a; none for the sm_80
// deterministic dQ kernel), plus
// float32 dK/dV partial sums when the query heads of a GQA group are split over several blocks.
// Depends on the current device (multiprocessor count).
size_t attention_bwd_workspace_bytes(const AttentionArgs& args);

// Gradients of attention_fwd. `out` and `lse` are the forward's results; `dout` and `dlse`
// (float32 [B,Hq,Sq], may be null = zeros) the cotangents of out and lse. deterministic=true
// gives bitwise reproducible dq/dk/dv (sm_90a: the adds into each dQ tile in a fixed order;
// sm_80 kernels: dQ by a separate pass per query tile, no atomics).
cudaError_t attention_bwd(const AttentionArgs& args, DType dtype, const void* q, const void* k,
                          const void* v, const void* out, const float* lse, const void* dout,
                          const float* dlse, const int32_t* q_seg, const int32_t* q_pos, const int32_t* kv_seg,
                          const int32_t* kv_pos, void* dq, void* dk, void* dv, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);

}  // namespace jaxcp::cuda
