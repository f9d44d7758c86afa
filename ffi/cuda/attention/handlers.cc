// XLA FFI handlers (platform "CUDA") for packed-document attention. Same binding as the CPU
// handlers (common/attention_binding.h), plus the stream from the FFI context, the kernel options
// (attribute "kernel": which kernels run) and the tile plan operand. The plan handlers
// (jaxcp_attention_<fwd|bwd>_plan) build the plan from the token arrays alone, so XLA can merge
// the plan calls of layers that share segment ids and positions into one. The workspace is the
// last result buffer, sized at trace time by the module's *_workspace_bytes functions (the plan's
// by *_plan_bytes): an XLA-owned buffer keeps its address under CUDA-graph (command buffer)
// capture, which a per-call scratch allocation would not. Host code only: validation and kernel
// launches (launchers.h). No synchronisation, no host-device copies.
#include <cuda_runtime.h>

#include <string>

#include "common/attention_binding.h"
#include "common/ffi_helpers.h"
#include "launchers.h"
#include "cuda/call_counts.h"
#include "cuda/cuda_handlers.h"

namespace jaxcp::cuda {
namespace {

using ffi::AnyBuffer;
using ffi::DataType;

ffi::Error dtype_of(const AnyBuffer& b, const char* name, DType* out) {
  switch (b.element_type()) {
    case DataType::BF16: *out = DType::kBF16; return ffi::Error::Success();
    case DataType::F16: *out = DType::kF16; return ffi::Error::Success();
    default:
      return invalid(std::string(name) +
                     ": CUDA attention supports bfloat16 and float16 only (use the CPU or XLA "
                     "implementation for float32)");
  }
}

ffi::Error same_dtype(std::initializer_list<std::pair<const AnyBuffer*, const char*>> bufs,
                      DType* out) {
  bool first = true;
  for (const auto& [buf, name] : bufs) {
    DType d = DType::kBF16;
    if (auto e = dtype_of(*buf, name, &d); e.failure()) return e;
    if (first) {
      *out = d;
      first = false;
    } else if (d != *out) {
      return invalid(std::string(name) + " must have the dtype of q");
    }
  }
  return ffi::Error::Success();
}

// Whether this direction's kernels run the head dims for these arguments
// (attention_*_head_dim_supported; jaxcp.attention pads any other to one that they do).
ffi::Error check_head_dims(const AttentionShape& s, bool head_dim_ok) {
  if (head_dim_ok) return ffi::Error::Success();
  return invalid("head_dim " + std::to_string(s.head_dim) + " with value head dim " + std::to_string(s.v_dim()) +
                 " is not supported by the CUDA kernels here (64, 128 or 256; on sm_90 also 96 and 192, "
                 "but for a deterministic backward or a forward with scale <= 0; V as wide as q and k but for "
                 "192 / 128 on sm_90, where 96 and 192 run): pad them, as jaxcp.attention does");
}

ffi::Error launch_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  const std::string msg = std::string(what) + " failed: " + cudaGetErrorName(e) + ": " +
                          cudaGetErrorString(e);
  return e == cudaErrorInvalidValue ? invalid(msg) : internal_error(msg);
}

// A buffer sized at trace time (the workspace result, the plan result or operand) against what
// the launchers need.
ffi::Error check_size(const char* name, size_t have, size_t needed) {
  if (have >= needed) return ffi::Error::Success();
  return invalid(std::string(name) + " has " + std::to_string(have) + " bytes, the kernels need " +
                 std::to_string(needed) + " (mis-sized at trace time)");
}

ffi::Error workspace_of(ffi::Result<AnyBuffer>& ws, size_t needed, void** out, const char* name = "workspace") {
  if (auto e = check_size(name, ws->size_bytes(), needed); e.failure()) return e;
  *out = needed ? ws->untyped_data() : nullptr;
  return ffi::Error::Success();
}

// The plan operand's data, checked against what the launchers need.
ffi::Error plan_of(const AnyBuffer& plan, size_t needed, const void** out) {
  if (auto e = check_size("plan", plan.size_bytes(), needed); e.failure()) return e;
  *out = plan.untyped_data();
  return ffi::Error::Success();
}

// A plan call's shape: batch and lengths from the token arrays, heads and head dims from its
// attributes (the lowering gives them the attention call's values).
ffi::Error plan_shape_from(const ffi::Buffer<ffi::S32>& q_seg, const ffi::Buffer<ffi::S32>& q_pos,
                           const ffi::Buffer<ffi::S32>& kv_seg, const ffi::Buffer<ffi::S32>& kv_pos, int64_t q_heads,
                           int64_t kv_heads, int64_t head_dim, int64_t v_head_dim, AttentionShape* s) {
  auto qd = q_seg.dimensions(), kd = kv_seg.dimensions();
  if (qd.size() != 2 || kd.size() != 2 || kd[0] != qd[0])
    return invalid("segment ids must have shapes [B, Sq] and [B, Skv]");
  if (kv_heads <= 0 || q_heads < 0 || q_heads % kv_heads != 0 || head_dim <= 0 || v_head_dim <= 0)
    return invalid("plan: q_heads must be a multiple of kv_heads > 0, and head dims positive");
  *s = AttentionShape{qd[0], qd[1], kd[1], q_heads, kv_heads, head_dim, v_head_dim};
  return check_token_arrays(*s, q_seg, q_pos, kv_seg, kv_pos);
}

// Both plan handlers: the call's arguments, checked as the attention handlers check theirs, then
// the direction's plan launcher.
template <bool kFwd>
ffi::Error plan_impl(cudaStream_t stream, const ffi::Buffer<ffi::S32>& q_seg, const ffi::Buffer<ffi::S32>& q_pos,
                     const ffi::Buffer<ffi::S32>& kv_seg, const ffi::Buffer<ffi::S32>& kv_pos,
                     ffi::Result<AnyBuffer>& plan, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                     int64_t v_head_dim, const MaskAttrs& mask, const AttentionKernelOptions& kernel,
                     bool deterministic) {
  count_call(kFwd ? Handler::kAttentionFwdPlan : Handler::kAttentionBwdPlan, stream);
  AttentionShape shape;
  if (auto e = plan_shape_from(q_seg, q_pos, kv_seg, kv_pos, q_heads, kv_heads, head_dim, v_head_dim, &shape);
      e.failure())
    return e;
  const AttentionArgs a = attention_args(shape, mask, kFwd || deterministic, kernel);  // as the attention handlers set it
  const bool supported = kFwd ? attention_fwd_head_dim_supported(a) : attention_bwd_head_dim_supported(a);
  if (auto e = check_head_dims(shape, supported); e.failure()) return e;
  void* buf = nullptr;
  if (auto e = workspace_of(plan, kFwd ? attention_fwd_plan_bytes(a) : attention_bwd_plan_bytes(a), &buf, "plan");
      e.failure())
    return e;
  const auto launch = kFwd ? attention_fwd_plan : attention_bwd_plan;
  return launch_status(launch(a, q_seg.typed_data(), q_pos.typed_data(), kv_seg.typed_data(), kv_pos.typed_data(),
                              buf, plan->size_bytes(), stream),
                       kFwd ? "jaxcp_attention_fwd_plan" : "jaxcp_attention_bwd_plan");
}

ffi::Error AttentionFwdPlanImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> q_pos,
                                ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> kv_pos,
                                ffi::Result<AnyBuffer> plan, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                int64_t v_head_dim, MaskAttrs mask, AttentionKernelOptions kernel) {
  return plan_impl<true>(stream, q_seg, q_pos, kv_seg, kv_pos, plan, q_heads, kv_heads, head_dim, v_head_dim,
                         mask, kernel, /*deterministic=*/true);
}

ffi::Error AttentionBwdPlanImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> q_pos,
                                ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> kv_pos,
                                ffi::Result<AnyBuffer> plan, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                int64_t v_head_dim, MaskAttrs mask, AttentionKernelOptions kernel,
                                bool deterministic) {
  return plan_impl<false>(stream, q_seg, q_pos, kv_seg, kv_pos, plan, q_heads, kv_heads, head_dim, v_head_dim,
                          mask, kernel, deterministic);
}

ffi::Error AttentionFwdImpl(cudaStream_t stream, AnyBuffer q,
                            AnyBuffer k, AnyBuffer v, ffi::Buffer<ffi::S32> q_seg,
                            ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_seg,
                            ffi::Buffer<ffi::S32> kv_pos, ffi::Result<AnyBuffer> out,
                            ffi::ResultBuffer<ffi::F32> lse, ffi::Result<AnyBuffer> workspace,
                            MaskAttrs mask, AttentionKernelOptions kernel, AnyBuffer plan) {
  count_call(Handler::kAttentionFwd, stream);
  AttentionShape shape;
  if (auto e = attention_shape_from(q, k, &shape); e.failure()) return e;
  if (auto e = value_dim_from(v, &shape); e.failure()) return e;
  DType dtype;
  if (auto e = same_dtype({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&(*out), "out"}}, &dtype); e.failure())
    return e;
  const AttentionArgs a = attention_args(shape, mask, /*deterministic=*/true, kernel);
  if (auto e = check_head_dims(shape, attention_fwd_head_dim_supported(a)); e.failure()) return e;
  if (auto e = check_fwd_operands(shape, *out, *lse, q_seg, q_pos, kv_seg, kv_pos); e.failure()) return e;
  const size_t ws_bytes = attention_fwd_workspace_bytes(a);
  void* ws = nullptr;
  if (auto e = workspace_of(workspace, ws_bytes, &ws); e.failure()) return e;
  const void* plan_data = nullptr;
  if (auto e = plan_of(plan, attention_fwd_plan_bytes(a), &plan_data); e.failure()) return e;
  return launch_status(
      attention_fwd(a, dtype, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                    q_seg.typed_data(), q_pos.typed_data(), kv_seg.typed_data(),
                    kv_pos.typed_data(), plan_data, plan.size_bytes(), out->untyped_data(),
                    lse->typed_data(), ws, ws_bytes, stream),
      "jaxcp_attention_fwd");
}

// The backward, whole or as one of two chained calls (BwdPhase; jaxcp_attention_bwd_begin / _end).
ffi::Error attention_bwd_call(BwdPhase phase, cudaStream_t stream, AnyBuffer q, AnyBuffer k, AnyBuffer v,
                              AnyBuffer out, ffi::Buffer<ffi::F32> lse, AnyBuffer dout, ffi::Buffer<ffi::F32> dlse,
                              ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_seg,
                              ffi::Buffer<ffi::S32> kv_pos, ffi::Result<AnyBuffer> dq, ffi::Result<AnyBuffer> dk,
                              ffi::Result<AnyBuffer> dv, ffi::Result<AnyBuffer> workspace, MaskAttrs mask,
                              bool deterministic, AttentionKernelOptions kernel, AnyBuffer plan) {
  count_call(Handler::kAttentionBwd, stream);
  AttentionShape shape;
  if (auto e = attention_shape_from(q, k, &shape); e.failure()) return e;
  if (auto e = value_dim_from(v, &shape); e.failure()) return e;
  DType dtype;
  if (auto e = same_dtype({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&dout, "dout"},
                           {&(*dq), "dq"}, {&(*dk), "dk"}, {&(*dv), "dv"}},
                          &dtype);
      e.failure())
    return e;
  const AttentionArgs a = attention_args(shape, mask, deterministic, kernel);
  if (auto e = check_head_dims(shape, attention_bwd_head_dim_supported(a)); e.failure()) return e;
  if (auto e = check_bwd_operands(shape, out, dout, lse, dlse, *dq, *dk, *dv, q_seg, q_pos, kv_seg, kv_pos);
      e.failure())
    return e;
  if (phase != BwdPhase::kWhole && (!attention_bwd_chains(a) || shape.kv_len == 0))
    return invalid("jaxcp_attention_bwd_begin / _end: these arguments do not chain (attention_bwd_chains)");
  const size_t ws_bytes = attention_bwd_workspace_bytes(a);
  void* ws = nullptr;
  if (auto e = workspace_of(workspace, ws_bytes, &ws); e.failure()) return e;
  const void* plan_data = nullptr;
  if (auto e = plan_of(plan, attention_bwd_plan_bytes(a), &plan_data); e.failure()) return e;
  return launch_status(
      attention_bwd(a, dtype, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                    out.untyped_data(), lse.typed_data(), dout.untyped_data(), dlse.typed_data(),
                    q_seg.typed_data(), q_pos.typed_data(), kv_seg.typed_data(), kv_pos.typed_data(),
                    plan_data, plan.size_bytes(), dq->untyped_data(), dk->untyped_data(),
                    dv->untyped_data(), ws, workspace->size_bytes(), stream, phase),
      "jaxcp_attention_bwd");
}

template <BwdPhase kPhase>
ffi::Error AttentionBwdImpl(cudaStream_t stream, AnyBuffer q, AnyBuffer k, AnyBuffer v, AnyBuffer out,
                            ffi::Buffer<ffi::F32> lse, AnyBuffer dout, ffi::Buffer<ffi::F32> dlse,
                            ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_seg,
                            ffi::Buffer<ffi::S32> kv_pos, ffi::Result<AnyBuffer> dq, ffi::Result<AnyBuffer> dk,
                            ffi::Result<AnyBuffer> dv, ffi::Result<AnyBuffer> workspace, MaskAttrs mask,
                            bool deterministic, AttentionKernelOptions kernel, AnyBuffer plan) {
  return attention_bwd_call(kPhase, stream, q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos, dq, dk, dv,
                            workspace, mask, deterministic, kernel, plan);
}

// The second of two chained calls: `state` is the first call's workspace, which XLA aliases to
// this call's (the lowering's operand_output_aliases), so the query side it prepared is there.
ffi::Error AttentionBwdEndImpl(cudaStream_t stream, AnyBuffer q, AnyBuffer k, AnyBuffer v, AnyBuffer out,
                               ffi::Buffer<ffi::F32> lse, AnyBuffer dout, ffi::Buffer<ffi::F32> dlse,
                               ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_seg,
                               ffi::Buffer<ffi::S32> kv_pos, ffi::Result<AnyBuffer> dq, ffi::Result<AnyBuffer> dk,
                               ffi::Result<AnyBuffer> dv, ffi::Result<AnyBuffer> workspace, MaskAttrs mask,
                               bool deterministic, AttentionKernelOptions kernel, AnyBuffer plan, AnyBuffer state) {
  if (state.untyped_data() != workspace->untyped_data() || state.size_bytes() != workspace->size_bytes())
    return invalid("jaxcp_attention_bwd_end: its state operand must be aliased to its workspace result");
  return attention_bwd_call(BwdPhase::kEnd, stream, q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos, dq,
                            dk, dv, workspace, mask, deterministic, kernel, plan);
}

}  // namespace
}  // namespace jaxcp::cuda

namespace ffi = xla::ffi;
using xla::ffi::AnyBuffer;

namespace {

// plan: q_seg, q_pos, kv_seg, kv_pos -> plan (uint8); attributes: the attention call's heads, head
// dims, mask and kernel options (and, for the backward's, deterministic).
template <typename Binding>
auto bind_attention_plan(Binding b) {
  return jaxcp::bind_mask_attrs(std::move(b)
                                    .template Arg<ffi::Buffer<ffi::S32>>()  // q_seg
                                    .template Arg<ffi::Buffer<ffi::S32>>()  // q_pos
                                    .template Arg<ffi::Buffer<ffi::S32>>()  // kv_seg
                                    .template Arg<ffi::Buffer<ffi::S32>>()  // kv_pos
                                    .template Ret<ffi::AnyBuffer>()         // plan
                                    .template Attr<int64_t>("q_heads")
                                    .template Attr<int64_t>("kv_heads")
                                    .template Attr<int64_t>("head_dim")
                                    .template Attr<int64_t>("v_head_dim"))
      .template Attr<jaxcp::AttentionKernelOptions>("kernel");
}

auto cuda_bind() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

// The backward handlers' binding: the common one, the kernel options and the plan operand.
auto cuda_bwd_bind() {
  return jaxcp::bind_attention_bwd(cuda_bind()).Attr<jaxcp::AttentionKernelOptions>("kernel").Arg<AnyBuffer>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cuda_attention_fwd_plan, jaxcp::cuda::AttentionFwdPlanImpl,
                              bind_attention_plan(cuda_bind()), {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cuda_attention_bwd_plan, jaxcp::cuda::AttentionBwdPlanImpl,
                              bind_attention_plan(cuda_bind()).Attr<bool>("deterministic"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cuda_attention_fwd, jaxcp::cuda::AttentionFwdImpl,
                              jaxcp::bind_attention_fwd(cuda_bind())
                                  .Attr<jaxcp::AttentionKernelOptions>("kernel")
                                  .Arg<AnyBuffer>(),  // plan
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cuda_attention_bwd,
                              jaxcp::cuda::AttentionBwdImpl<jaxcp::cuda::BwdPhase::kWhole>, cuda_bwd_bind(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cuda_attention_bwd_begin,
                              jaxcp::cuda::AttentionBwdImpl<jaxcp::cuda::BwdPhase::kBegin>, cuda_bwd_bind(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cuda_attention_bwd_end, jaxcp::cuda::AttentionBwdEndImpl,
                              cuda_bwd_bind().Arg<AnyBuffer>(),  // state: the first call's workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});
