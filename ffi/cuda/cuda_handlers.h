// FFI handler symbols of the CUDA module (defined in the *_cuda.cc handler files).
#pragma once
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cuda_attention_fwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cuda_attention_bwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cuda_attention_bwd_begin);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cuda_attention_bwd_end);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cuda_attention_fwd_plan);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cuda_attention_bwd_plan);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cuda_small_seq_fwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxcp_cuda_small_seq_bwd);
