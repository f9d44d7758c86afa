// FFI handler symbols of the CPU module and the float32 staging helpers they share.
#pragma once
#include <initializer_list>
#include <utility>
#include <vector>

#include "../common/ffi_helpers.h"

namespace jaxcp::cpu {

// Copy any accepted float dtype to float32 and back (the CPU kernels compute in float32).
ffi::Error to_float32(const ffi::AnyBuffer& b, std::vector<float>* out);
ffi::Error from_float32(const std::vector<float>& in, ffi::AnyBuffer b);

// Widens every (buffer, destination) pair; stops at the first unsupported dtype.
ffi::Error all_to_float32(
    std::initializer_list<std::pair<const ffi::AnyBuffer*, std::vector<float>*>> pairs);

// Float32 gradient staging of a backward: sized like the results, narrowed back into them.
struct GradStaging {
  std::vector<float> dq, dk, dv;
  GradStaging(const ffi::AnyBuffer& dq_out, const ffi::AnyBuffer& dk_out, const ffi::AnyBuffer& dv_out)
      : dq(dq_out.element_count()), dk(dk_out.element_count()), dv(dv_out.element_count()) {}
  ffi::Error store(ffi::AnyBuffer dq_out, ffi::AnyBuffer dk_out, ffi::AnyBuffer dv_out) const;
};

}  // namespace jaxcp::cpu

XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cpu_attention_fwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cpu_attention_bwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cpu_small_seq_fwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cpu_small_seq_bwd);
