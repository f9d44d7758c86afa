// XLA FFI handlers (platform "cpu") for small-sequence attention: convert to float32, run the
// reference kernels of small_seq_cpu_kernels.h, convert back. Signature: common/small_seq_binding.h.
#include <string>
#include <vector>

#include "common/ffi_helpers.h"
#include "common/small_seq_binding.h"
#include "common/small_seq_checks.h"
#include "cpu_handlers.h"
#include "small_seq_cpu_kernels.h"

namespace jaxcp::cpu {
namespace {

using ffi::AnyBuffer;
using I32 = ffi::Buffer<ffi::S32>;

ffi::Error small_seq_shape(const AnyBuffer& q, const AnyBuffer& k, const AnyBuffer& v,
                           const I32& start, const I32& len, const I32& mask, int64_t max_len,
                           float scale, SmallSeqShape* s) {
  if (auto e = check_small_seq_inputs(q, k, v, start, len, mask, max_len); e.failure()) return e;
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  s->batch = qd[0];
  s->q_heads = qd[1];
  s->head_dim = qd[2];
  s->tokens = kd[0];
  s->kv_heads = kd[1];
  s->max_len = max_len;
  s->scale = scale;
  return ffi::Error::Success();
}

ffi::Error check_probs(const SmallSeqShape& s, const ffi::Buffer<ffi::F32>& p) {
  return check_small_seq_probs(p, s.batch, s.q_heads, s.max_len);
}

ffi::Error SmallSeqFwdImpl(AnyBuffer q, AnyBuffer k, AnyBuffer v, I32 kv_start, I32 kv_len,
                           I32 kv_mask, ffi::Result<AnyBuffer> out,
                           ffi::ResultBuffer<ffi::F32> probs, int64_t max_len, float scale) {
  SmallSeqShape s;
  if (auto e = small_seq_shape(q, k, v, kv_start, kv_len, kv_mask, max_len, scale, &s);
      e.failure())
    return e;
  if (auto e = check_probs(s, *probs); e.failure()) return e;
  std::vector<float> qf, kf, vf, of(out->element_count());
  if (auto e = all_to_float32({{&q, &qf}, {&k, &kf}, {&v, &vf}}); e.failure()) return e;
  small_seq_fwd(s, qf.data(), kf.data(), vf.data(), small_seq_index(kv_start), small_seq_index(kv_len),
                small_seq_index(kv_mask), of.data(), probs->typed_data());
  return from_float32(of, *out);
}

ffi::Error SmallSeqBwdImpl(AnyBuffer q, AnyBuffer k, AnyBuffer v, ffi::Buffer<ffi::F32> probs,
                           AnyBuffer dout, I32 kv_start, I32 kv_len, I32 kv_mask,
                           ffi::Result<AnyBuffer> dq, ffi::Result<AnyBuffer> dk,
                           ffi::Result<AnyBuffer> dv, int64_t max_len, float scale) {
  SmallSeqShape s;
  if (auto e = small_seq_shape(q, k, v, kv_start, kv_len, kv_mask, max_len, scale, &s);
      e.failure())
    return e;
  if (auto e = check_probs(s, probs); e.failure()) return e;
  if (dout.element_count() != q.element_count()) return invalid("small_seq: dout must match q");
  std::vector<float> qf, kf, vf, dof;
  if (auto e = all_to_float32({{&q, &qf}, {&k, &kf}, {&v, &vf}, {&dout, &dof}}); e.failure())
    return e;
  GradStaging g(*dq, *dk, *dv);
  small_seq_bwd(s, qf.data(), kf.data(), vf.data(), probs.typed_data(), dof.data(),
                small_seq_index(kv_start), small_seq_index(kv_len), small_seq_index(kv_mask), g.dq.data(),
                g.dk.data(), g.dv.data());
  return g.store(*dq, *dk, *dv);
}

}  // namespace
}  // namespace jaxcp::cpu

namespace ffi = xla::ffi;
using xla::ffi::AnyBuffer;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cpu_small_seq_fwd, jaxcp::cpu::SmallSeqFwdImpl,
                              jaxcp::bind_small_seq_fwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcp_cpu_small_seq_bwd, jaxcp::cpu::SmallSeqBwdImpl,
                              jaxcp::bind_small_seq_bwd(ffi::Ffi::Bind()));
