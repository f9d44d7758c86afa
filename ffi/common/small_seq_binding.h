// The one FFI signature of the small-sequence handlers, shared by the CPU and CUDA modules (the
// Python lowering passes operands, results and attributes in this order). Platform context (the
// CUDA stream) is bound before these; the CUDA handlers (ffi/cuda/small_seq/handlers.cc) bind one
// attribute more after them, "kernel" (SmallSeqKernelOptions).
//
// fwd: q [B,Hq,D], k/v [T,Hkv,D], kv_start/kv_len/kv_mask int32 [B]
//      -> out [B,Hq,D] (q's dtype), probs float32 [B,Hq,max_len]; attributes max_len, scale.
// bwd: q, k, v, probs, dout, kv_start, kv_len, kv_mask -> dq, dk, dv; the same attributes.
#pragma once
#include <utility>

#include "ffi_helpers.h"

namespace jaxcp {

template <typename Binding>
auto bind_small_seq_attrs(Binding b) {
  return std::move(b).template Attr<int64_t>("max_len").template Attr<float>("scale");
}

template <typename Binding>
auto bind_small_seq_fwd(Binding b) {
  return bind_small_seq_attrs(std::move(b)
                                  .template Arg<ffi::AnyBuffer>()           // q
                                  .template Arg<ffi::AnyBuffer>()           // k
                                  .template Arg<ffi::AnyBuffer>()           // v
                                  .template Arg<ffi::Buffer<ffi::S32>>()    // kv_start
                                  .template Arg<ffi::Buffer<ffi::S32>>()    // kv_len
                                  .template Arg<ffi::Buffer<ffi::S32>>()    // kv_mask
                                  .template Ret<ffi::AnyBuffer>()           // out
                                  .template Ret<ffi::Buffer<ffi::F32>>());  // probs
}

template <typename Binding>
auto bind_small_seq_bwd(Binding b) {
  return bind_small_seq_attrs(std::move(b)
                                  .template Arg<ffi::AnyBuffer>()         // q
                                  .template Arg<ffi::AnyBuffer>()         // k
                                  .template Arg<ffi::AnyBuffer>()         // v
                                  .template Arg<ffi::Buffer<ffi::F32>>()  // probs
                                  .template Arg<ffi::AnyBuffer>()         // dout
                                  .template Arg<ffi::Buffer<ffi::S32>>()  // kv_start
                                  .template Arg<ffi::Buffer<ffi::S32>>()  // kv_len
                                  .template Arg<ffi::Buffer<ffi::S32>>()  // kv_mask
                                  .template Ret<ffi::AnyBuffer>()         // dq
                                  .template Ret<ffi::AnyBuffer>()         // dk
                                  .template Ret<ffi::AnyBuffer>());       // dv
}

}  // namespace jaxcp
