// XLA FFI handlers (platform "CUDA") for small-sequence attention: the CPU handlers' binding
// (common/small_seq_binding.h) after the stream, then the kernel options (attribute "kernel").
// The handlers only enqueue work on the FFI stream (command-buffer compatible); see launchers.h.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ffi_attrs.h"
#include "common/ffi_helpers.h"
#include "common/small_seq_binding.h"
#include "common/small_seq_checks.h"
#include "cuda/call_counts.h"
#include "cuda/cuda_handlers.h"
#include "launchers.h"

namespace jaxcp::cuda {
namespace {

using ffi::AnyBuffer;
using I32 = ffi::Buffer<ffi::S32>;

ffi::Error dtype_of(const AnyBuffer& b, SmallSeqDType* out) {
  switch (b.element_type()) {
    case ffi::DataType::BF16: *out = SmallSeqDType::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *out = SmallSeqDType::kF16; return ffi::Error::Success();
    default: return invalid("small_seq (CUDA): dtype must be bfloat16 or float16");
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

ffi::Error shape_of(const AnyBuffer& q, const AnyBuffer& k, const AnyBuffer& v, const I32& start,
                    const I32& len, const I32& mask, int64_t max_len, float scale,
                    const SmallSeqKernelOptions& kernel, SmallSeqArgs* a, SmallSeqDType* dtype) {
  if (auto e = check_small_seq_inputs(q, k, v, start, len, mask, max_len); e.failure()) return e;
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (!small_seq_head_dim_supported(qd[2]))
    return invalid("small_seq (CUDA): head_dim must be 64, 128, 256 or 512, got " +
                   std::to_string(qd[2]));
  if (!aligned16(q.untyped_data()) || !aligned16(k.untyped_data()) ||
      !aligned16(v.untyped_data()))
    return invalid("small_seq (CUDA): q, k and v must be 16-byte aligned");
  a->batch = qd[0];
  a->q_heads = qd[1];
  a->head_dim = qd[2];
  a->tokens = kd[0];
  a->kv_heads = kd[1];
  a->max_len = max_len;
  a->scale = scale;
  a->kernel = kernel;
  return dtype_of(q, dtype);
}

ffi::Error check_probs(const SmallSeqArgs& a, const ffi::Buffer<ffi::F32>& p) {
  return check_small_seq_probs(p, a.batch, a.q_heads, a.max_len);
}

ffi::Error status(cudaError_t launch, const char* what) {
  if (launch != cudaSuccess)
    return internal_error(std::string(what) + ": " + cudaGetErrorString(launch));
  const cudaError_t last = cudaGetLastError();
  if (last != cudaSuccess) return internal_error(std::string(what) + ": " + cudaGetErrorString(last));
  return ffi::Error::Success();
}

ffi::Error SmallSeqFwdImpl(cudaStream_t stream, AnyBuffer q, AnyBuffer k, AnyBuffer v,
                           I32 kv_start, I32 kv_len, I32 kv_mask, ffi::Result<AnyBuffer> out,
                           ffi::ResultBuffer<ffi::F32> probs, int64_t max_len, float scale,
                           SmallSeqKernelOptions kernel) {
  count_call(Handler::kSmallSeqFwd, stream);
  SmallSeqArgs a;
  SmallSeqDType dtype;
  if (auto e = shape_of(q, k, v, kv_start, kv_len, kv_mask, max_len, scale, kernel, &a, &dtype);
      e.failure())
    return e;
  if (auto e = check_probs(a, *probs); e.failure()) return e;
  if (!aligned16(out->untyped_data())) return invalid("small_seq (CUDA): out must be 16-byte aligned");
  return status(small_seq_fwd(a, dtype, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                              small_seq_index(kv_start), small_seq_index(kv_len), small_seq_index(kv_mask),
                              out->untyped_data(), probs->typed_data(), stream),
                "small_seq_fwd");
}

ffi::Error SmallSeqBwdImpl(cudaStream_t stream, AnyBuffer q, AnyBuffer k, AnyBuffer v,
                           ffi::Buffer<ffi::F32> probs, AnyBuffer dout, I32 kv_start, I32 kv_len,
                           I32 kv_mask, ffi::Result<AnyBuffer> dq, ffi::Result<AnyBuffer> dk,
                           ffi::Result<AnyBuffer> dv, int64_t max_len, float scale,
                           SmallSeqKernelOptions kernel) {
  count_call(Handler::kSmallSeqBwd, stream);
  SmallSeqArgs a;
  SmallSeqDType dtype;
  if (auto e = shape_of(q, k, v, kv_start, kv_len, kv_mask, max_len, scale, kernel, &a, &dtype);
      e.failure())
    return e;
  if (auto e = check_probs(a, probs); e.failure()) return e;
  if (dout.element_count() != q.element_count() || dout.element_type() != q.element_type())
    return invalid("small_seq: dout must match q");
  for (const void* ptr : {dout.untyped_data(), dq->untyped_data(), dk->untyped_data(),
                          dv->untyped_data()})
    if (!aligned16(ptr)) return invalid("small_seq (CUDA): gradient buffers must be 16-byte aligned");
  return status(small_seq_bwd(a, dtype, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                              probs.typed_data(), dout.untyped_data(), small_seq_index(kv_start),
                              small_seq_index(kv_len), small_seq_index(kv_mask), dq->untyped_data(),
                              dk->untyped_data(), dv->untyped_data(), stream),
                "small_seq_bwd");
}

}  // namespace
}  // namespace jaxcp::cuda

namespace ffi = xla::ffi;
using xla::ffi::AnyBuffer;

namespace {
auto cuda_bind() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cuda_small_seq_fwd, jaxcp::cuda::SmallSeqFwdImpl,
                              jaxcp::bind_small_seq_fwd(cuda_bind()).Attr<jaxcp::SmallSeqKernelOptions>("kernel"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cuda_small_seq_bwd, jaxcp::cuda::SmallSeqBwdImpl,
                              jaxcp::bind_small_seq_bwd(cuda_bind()).Attr<jaxcp::SmallSeqKernelOptions>("kernel"),
                              {ffi::Traits::kCmdBufferCompatible});
