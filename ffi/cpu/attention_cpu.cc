// XLA FFI handlers (platform "cpu") for packed-document attention: convert to float32,
// run the reference kernels, convert back.
#include <vector>

#include "common/attention_binding.h"
#include "common/ffi_helpers.h"
#include "common/host_dtypes.h"
#include "attention_cpu_kernels.h"
#include "cpu_handlers.h"

namespace jaxcp::cpu {
namespace {

using ffi::AnyBuffer;
using ffi::DataType;

template <typename T>
void widen(const AnyBuffer& b, std::vector<float>* out) {
  const T* p = reinterpret_cast<const T*>(b.untyped_data());
  out->resize(b.element_count());
  for (size_t i = 0; i < out->size(); ++i) (*out)[i] = to_float(p[i]);
}

template <typename T>
void narrow(const std::vector<float>& in, AnyBuffer* b) {
  T* p = reinterpret_cast<T*>(b->untyped_data());
  for (size_t i = 0; i < in.size(); ++i) p[i] = from_float<T>(in[i]);
}

}  // namespace

ffi::Error to_float32(const AnyBuffer& b, std::vector<float>* out) {
  switch (b.element_type()) {
    case DataType::F32: widen<float>(b, out); return ffi::Error::Success();
    case DataType::BF16: widen<bf16_t>(b, out); return ffi::Error::Success();
    case DataType::F16: widen<f16_t>(b, out); return ffi::Error::Success();
    default: return invalid("unsupported dtype (expected float32, bfloat16 or float16)");
  }
}

ffi::Error from_float32(const std::vector<float>& in, AnyBuffer b) {
  if (in.size() != b.element_count()) return internal_error("output size mismatch");
  switch (b.element_type()) {
    case DataType::F32: narrow<float>(in, &b); return ffi::Error::Success();
    case DataType::BF16: narrow<bf16_t>(in, &b); return ffi::Error::Success();
    case DataType::F16: narrow<f16_t>(in, &b); return ffi::Error::Success();
    default: return invalid("unsupported dtype (expected float32, bfloat16 or float16)");
  }
}

ffi::Error all_to_float32(
    std::initializer_list<std::pair<const AnyBuffer*, std::vector<float>*>> pairs) {
  for (auto [src, dst] : pairs)
    if (auto e = to_float32(*src, dst); e.failure()) return e;
  return ffi::Error::Success();
}

ffi::Error GradStaging::store(AnyBuffer dq_out, AnyBuffer dk_out, AnyBuffer dv_out) const {
  if (auto e = from_float32(dq, dq_out); e.failure()) return e;
  if (auto e = from_float32(dk, dk_out); e.failure()) return e;
  return from_float32(dv, dv_out);
}

namespace {

ffi::Error AttentionFwdImpl(AnyBuffer q, AnyBuffer k, AnyBuffer v, ffi::Buffer<ffi::S32> q_seg,
                            ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_seg,
                            ffi::Buffer<ffi::S32> kv_pos, ffi::Result<AnyBuffer> out,
                            ffi::ResultBuffer<ffi::F32> lse, ffi::Result<AnyBuffer> /*workspace*/,
                            MaskAttrs mask) {
  AttentionShape shape;
  if (auto e = attention_shape_from(q, k, &shape); e.failure()) return e;
  if (auto e = value_dim_from(v, &shape); e.failure()) return e;
  if (auto e = check_fwd_operands(shape, *out, *lse, q_seg, q_pos, kv_seg, kv_pos); e.failure()) return e;
  const AttentionArgs a = attention_args(shape, mask, /*deterministic=*/true);
  std::vector<float> qf, kf, vf, of(out->element_count());
  if (auto e = all_to_float32({{&q, &qf}, {&k, &kf}, {&v, &vf}}); e.failure()) return e;
  attention_fwd(a, qf.data(), kf.data(), vf.data(), q_seg.typed_data(), q_pos.typed_data(),
                kv_seg.typed_data(), kv_pos.typed_data(), of.data(), lse->typed_data());
  return from_float32(of, *out);
}

ffi::Error AttentionBwdImpl(AnyBuffer q, AnyBuffer k, AnyBuffer v, AnyBuffer out,
                            ffi::Buffer<ffi::F32> lse, AnyBuffer dout,
                            ffi::Buffer<ffi::F32> dlse,
                            ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> q_pos,
                            ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> kv_pos,
                            ffi::Result<AnyBuffer> dq, ffi::Result<AnyBuffer> dk,
                            ffi::Result<AnyBuffer> dv, ffi::Result<AnyBuffer> /*workspace*/,
                            MaskAttrs mask, bool deterministic) {
  AttentionShape shape;
  if (auto e = attention_shape_from(q, k, &shape); e.failure()) return e;
  if (auto e = value_dim_from(v, &shape); e.failure()) return e;
  if (auto e = check_bwd_operands(shape, out, dout, lse, dlse, *dq, *dk, *dv, q_seg, q_pos, kv_seg, kv_pos);
      e.failure())
    return e;
  const AttentionArgs a = attention_args(shape, mask, deterministic);
  std::vector<float> qf, kf, vf, of, dof;
  if (auto e = all_to_float32({{&q, &qf}, {&k, &kf}, {&v, &vf}, {&out, &of}, {&dout, &dof}});
      e.failure())
    return e;
  GradStaging g(*dq, *dk, *dv);
  attention_bwd(a, qf.data(), kf.data(), vf.data(), of.data(), lse.typed_data(), dof.data(),
                dlse.typed_data(),
                q_seg.typed_data(), q_pos.typed_data(), kv_seg.typed_data(),
                kv_pos.typed_data(), g.dq.data(), g.dk.data(), g.dv.data());
  return g.store(*dq, *dk, *dv);
}

}  // namespace
}  // namespace jaxcp::cpu

namespace ffi = xla::ffi;
using xla::ffi::AnyBuffer;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cpu_attention_fwd, jaxcp::cpu::AttentionFwdImpl,
                              jaxcp::bind_attention_fwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cpu_attention_bwd, jaxcp::cpu::AttentionBwdImpl,
                              jaxcp::bind_attention_bwd(ffi::Ffi::Bind()));
