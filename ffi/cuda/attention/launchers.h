// Launchers of the CUDA packed-document attention kernels (no FFI types here).
//
// Layouts and mask semantics are those of ../common/attention_shape.h and ../common/mask.h:
// q/out/dq [B,Sq,Hq,D], k/v/dk/dv [B,Skv,Hkv,D], lse float32 [B,Hq,Sq] (natural log),
// q_seg/q_pos [B,Sq], kv_seg/kv_pos [B,Skv] int32; all contiguous.
//
// Every launcher only enqueues work on `stream` (kernels and cudaMemsetAsync): no allocation,
// no synchronisation, no host-device copies, so it can be captured into a CUDA graph. The caller
// provides a plan buffer of *_plan_bytes(args) bytes and a device workspace of at least
// *_workspace_bytes(args) bytes (both 256-byte aligned); their content on entry does not matter
// to the *_plan and attention launchers respectively. Outputs are fully written.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/attention_shape.h"

namespace jaxcp::cuda {

enum class DType { kBF16, kF16 };

// Which kernels run is decided by the device and args alone: args.kernel (AttentionKernelOptions)
// may ask for the sm_80 kernels or the fixed forward tiling; nothing is read from the environment.
//
// Whether the forward kernels run args.shape.head_dim for these arguments: 64, 128 and 256
// always; 96 and 192 where the sm_90a kernel runs (fwd_use_sm90: an sm_90 device, a positive
// scale, kernel options that allow it). Callers zero-pad any other head dim to the next supported
// one.
bool attention_fwd_head_dim_supported(const AttentionArgs& args);

// Whether the backward kernels run args.shape.head_dim for these arguments: 64, 128 and 256
// always; 96 and 192 where the sm_90a kernel runs and deterministic is off (its deterministic dQ
// falls back to the sm_80 kernels on rows long enough, a rule of the local shape that a caller
// under sharding cannot see).
bool attention_bwd_head_dim_supported(const AttentionArgs& args);

// The tile plan of a call: per-tile summaries of segment ids and positions, each tile's range of
// partner tiles, the order of the work. It is built from q_seg / q_pos / kv_seg / kv_pos and
// args alone (never from q, k, v) by attention_*_plan into a buffer of attention_*_plan_bytes,
// which the attention launchers then only read: layers of a model that share segment ids and
// positions can share one plan (XLA merges the identical plan calls).
size_t attention_fwd_plan_bytes(const AttentionArgs& args);
cudaError_t attention_fwd_plan(const AttentionArgs& args, const int32_t* q_seg, const int32_t* q_pos,
                               const int32_t* kv_seg, const int32_t* kv_pos, void* plan, size_t plan_bytes,
                               cudaStream_t stream);

// Bytes of per-call workspace the forward needs besides its plan (the sm_90a kernel's tile counter).
size_t attention_fwd_workspace_bytes(const AttentionArgs& args);

// out = softmax(scale * q k^T, masked) v; lse = log-sum-exp of the masked scaled scores.
// `plan` is attention_fwd_plan's for the same args and token arrays.
// Rows with no allowed key: out 0, lse -inf. Returns cudaErrorInvalidValue for an unsupported
// head dim or inconsistent shape, otherwise the launch status.
cudaError_t attention_fwd(const AttentionArgs& args, DType dtype, const void* q, const void* k,
                          const void* v, const int32_t* q_seg, const int32_t* q_pos,
                          const int32_t* kv_seg, const int32_t* kv_pos, const void* plan,
                          size_t plan_bytes, void* out, float* lse, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);

// The backward's tile plan (as attention_fwd_plan's; it depends on deterministic too).
size_t attention_bwd_plan_bytes(const AttentionArgs& args);
cudaError_t attention_bwd_plan(const AttentionArgs& args, const int32_t* q_seg, const int32_t* q_pos,
                               const int32_t* kv_seg, const int32_t* kv_pos, void* plan, size_t plan_bytes,
                               cudaStream_t stream);

// Bytes of per-call workspace the backward needs besides its plan: dot(dO, O) rows, a float32 dQ
// accumulator (with per-tile turns when deterministic on sm_90a; none for the sm_80
// deterministic dQ kernel), plus
// float32 dK/dV partial sums when the query heads of a GQA group are split over several blocks.
// Depends on the current device (multiprocessor count).
size_t attention_bwd_workspace_bytes(const AttentionArgs& args);

// A backward over two disjoint key sets of the same queries, as two calls that share the
// query side (context parallelism's traded pair: the partner's keys, then the rank's own while
// the partner's dK/dV travel). kBegin prepares delta, lse2, the query ids and the float32 dQ
// accumulator in its workspace and adds its keys' dQ there without converting it; kEnd, whose
// workspace is the first call's (aliased), skips that preparation, adds its keys' dQ and converts
// the sum. dK/dV are each call's own. Both calls take the same queries, out, lse, dout and dlse.
enum class BwdPhase : int { kWhole = 0, kBegin = 1, kEnd = 2 };

// Whether attention_bwd can run as kBegin / kEnd for these args: the sm_90a kernel only (the sm_80
// deterministic dQ kernel writes dQ without an accumulator). Two calls chain when both do: their
// workspaces then share the query side's layout (it comes first and depends on the queries only).
// Chained calls need keys (kv_len > 0).
bool attention_bwd_chains(const AttentionArgs& args);

// Gradients of attention_fwd. `out` and `lse` are the forward's results; `dout` and `dlse`
// (float32 [B,Hq,Sq], may be null = zeros) the cotangents of out and lse; `plan` is
// attention_bwd_plan's for the same args and token arrays. deterministic=true
// gives bitwise reproducible dq/dk/dv (sm_90a: the adds into each dQ tile in a fixed order;
// sm_80 kernels: dQ by a separate pass per query tile, no atomics).
cudaError_t attention_bwd(const AttentionArgs& args, DType dtype, const void* q, const void* k,
                          const void* v, const void* out, const float* lse, const void* dout,
                          const float* dlse, const int32_t* q_seg, const int32_t* q_pos, const int32_t* kv_seg,
                          const int32_t* kv_pos, const void* plan, size_t plan_bytes, void* dq, void* dk,
                          void* dv, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                          BwdPhase phase = BwdPhase::kWhole);

}  // namespace jaxcp::cuda
