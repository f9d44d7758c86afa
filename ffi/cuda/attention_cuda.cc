// XLA FFI handlers (platform "CUDA") for packed-document attention. Same binding as the CPU
// handlers (ffi/cpu/attention_cpu.cc), plus the stream from the FFI context. The workspace is
// the last result buffer, sized at trace time by the module's *_workspace_bytes functions: an
// XLA-owned buffer keeps its address under CUDA-graph (command buffer) capture, which a
// per-call scratch allocation would not. Host code only: validation and kernel launches
// (ffi/cuda/attention_kernels.h). No synchronisation, no host-device copies.
#include <cuda_runtime.h>

#include <string>

#include "../common/attention_binding.h"
#include "../common/ffi_helpers.h"
#include "attention_kernels.h"
#include "capture_counts.h"
#include "cuda_handlers.h"

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

ffi::Error workspace_of(ffi::Result<AnyBuffer>& ws, size_t needed, void** out) {
  if (ws->size_bytes() < needed)
    return invalid("workspace has " + std::to_string(ws->size_bytes()) + " bytes, the kernels need " +
                   std::to_string(needed) + " (mis-sized at trace time)");
  *out = needed ? ws->untyped_data() : nullptr;
  return ffi::Error::Success();
}

ffi::Error AttentionFwdImpl(cudaStream_t stream, AnyBuffer q,
                            AnyBuffer k, AnyBuffer v, ffi::Buffer<ffi::S32> q_seg,
                            ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_seg,
                            ffi::Buffer<ffi::S32> kv_pos, ffi::Result<AnyBuffer> out,
                            ffi::ResultBuffer<ffi::F32> lse, ffi::Result<AnyBuffer> workspace,
                            bool is_causal, int64_t window_left,
                            int64_t window_right, int64_t chunk_size, float scale) {
  count_call(Handler::kAttentionFwd, stream);
  AttentionShape shape;
  if (auto e = attention_shape_from(q, k, &shape); e.failure()) return e;
  if (auto e = value_dim_from(v, &shape); e.failure()) return e;
  DType dtype;
  if (auto e = same_dtype({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&(*out), "out"}}, &dtype); e.failure())
    return e;
  const AttentionArgs a = attention_args(shape, is_causal, window_left, window_right, chunk_size,
                                         scale, /*deterministic=*/true);
  if (auto e = check_head_dims(shape, attention_fwd_head_dim_supported(a)); e.failure()) return e;
  if (auto e = check_fwd_operands(shape, *out, *lse, q_seg, q_pos, kv_seg, kv_pos); e.failure()) return e;
  const size_t ws_bytes = attention_fwd_workspace_bytes(a);
  void* ws = nullptr;
  if (auto e = workspace_of(workspace, ws_bytes, &ws); e.failure()) return e;
  return launch_status(
      attention_fwd(a, dtype, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                    q_seg.typed_data(), q_pos.typed_data(), kv_seg.typed_data(),
                    kv_pos.typed_data(), out->untyped_data(), lse->typed_data(), ws, ws_bytes,
                    stream),
      "jaxcp_attention_fwd");
}

ffi::Error AttentionBwdImpl(cudaStream_t stream, AnyBuffer q,
                            AnyBuffer k, AnyBuffer v, AnyBuffer out, ffi::Buffer<ffi::F32> lse,
                            AnyBuffer dout, ffi::Buffer<ffi::F32> dlse, ffi::Buffer<ffi::S32> q_seg,
                            ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_seg,
                            ffi::Buffer<ffi::S32> kv_pos, ffi::Result<AnyBuffer> dq,
                            ffi::Result<AnyBuffer> dk, ffi::Result<AnyBuffer> dv,
                            ffi::Result<AnyBuffer> workspace, bool is_causal,
                            int64_t window_left, int64_t window_right, int64_t chunk_size,
                            float scale, bool deterministic) {
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
  const AttentionArgs a = attention_args(shape, is_causal, window_left, window_right, chunk_size,
                                         scale, deterministic);
  if (auto e = check_head_dims(shape, attention_bwd_head_dim_supported(a)); e.failure()) return e;
  if (auto e = check_bwd_operands(shape, out, dout, lse, dlse, *dq, *dk, *dv, q_seg, q_pos, kv_seg, kv_pos);
      e.failure())
    return e;
  const size_t ws_bytes = attention_bwd_workspace_bytes(a);
  void* ws = nullptr;
  if (auto e = workspace_of(workspace, ws_bytes, &ws); e.failure()) return e;
  return launch_status(
      attention_bwd(a, dtype, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                    out.untyped_data(), lse.typed_data(), dout.untyped_data(), dlse.typed_data(),
                    q_seg.typed_data(),
                    q_pos.typed_data(), kv_seg.typed_data(), kv_pos.typed_data(),
                    dq->untyped_data(), dk->untyped_data(), dv->untyped_data(), ws, ws_bytes,
                    stream),
      "jaxcp_attention_bwd");
}

}  // namespace
}  // namespace jaxcp::cuda

namespace ffi = xla::ffi;
using xla::ffi::AnyBuffer;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cuda_attention_fwd, jaxcp::cuda::AttentionFwdImpl,
                              jaxcp::bind_attention_fwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cuda_attention_bwd, jaxcp::cuda::AttentionBwdImpl,
                              jaxcp::bind_attention_bwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
