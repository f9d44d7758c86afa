// FFI handler symbols of the CPU module and the float32 staging helpers they share.
#pragma once
#include <vector>

#include "../common/ffi_helpers.h"

namespace jaxcp::cpu {

// Copy any accepted float dtype to float32 and back (the CPU kernels compute in float32).
ffi::Error to_float32(const ffi::AnyBuffer& b, std::vector<float>* out);
ffi::Error from_float32(const std::vector<float>& in, ffi::AnyBuffer b);

}  // namespace jaxcp::cpu

XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cpu_attention_fwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cpu_attention_bwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cpu_small_seq_fwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cpu_small_seq_bwd);
