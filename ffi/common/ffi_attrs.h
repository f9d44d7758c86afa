// FFI attributes passed as dictionaries and decoded into structs: the attention handlers' mask
// (CPU and CUDA) and the CUDA handlers' kernel options. The Python lowering builds the same
// dictionaries (AttentionConfig.ffi_attrs, *KernelOptions.ffi_attrs); a missing, extra or
// mistyped member fails the call with XLA's decoding error.
#pragma once
#include <cstdint>

#include "attention_shape.h"
#include "kernel_options.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcp {

// Attribute "mask": the mask rules (mask.h) and the softmax scale of an attention call.
struct MaskAttrs {
  bool is_causal;
  int64_t window_left;   // < 0: unbounded
  int64_t window_right;  // < 0: unbounded
  int64_t chunk_size;    // <= 0: no chunking
  float scale;
};

inline AttentionArgs attention_args(const AttentionShape& shape, const MaskAttrs& m, bool deterministic,
                                    const AttentionKernelOptions& kernel = {}) {
  AttentionArgs a;
  a.shape = shape;
  a.mask.causal = m.is_causal;
  a.mask.window_left = m.window_left;
  a.mask.window_right = m.window_right;
  a.mask.chunk_size = m.chunk_size;
  a.scale = m.scale;
  a.deterministic = deterministic;
  a.kernel = kernel;
  return a;
}

}  // namespace jaxcp

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxcp::MaskAttrs, ::xla::ffi::StructMember<bool>("is_causal"),
                                      ::xla::ffi::StructMember<int64_t>("window_left"),
                                      ::xla::ffi::StructMember<int64_t>("window_right"),
                                      ::xla::ffi::StructMember<int64_t>("chunk_size"),
                                      ::xla::ffi::StructMember<float>("scale"));

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxcp::AttentionKernelOptions, ::xla::ffi::StructMember<bool>("sm80_only"),
                                      ::xla::ffi::StructMember<bool>("fwd_fixed_tiles"));

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxcp::SmallSeqKernelOptions, ::xla::ffi::StructMember<int32_t>("fwd"),
                                      ::xla::ffi::StructMember<int32_t>("bwd"));
