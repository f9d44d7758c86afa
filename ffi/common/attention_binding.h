// The one FFI signature of the attention handlers, shared by the CPU and CUDA modules so the
// two can never drift apart (the Python lowering passes operands, results and attributes in
// this order). Platform context (e.g. the CUDA stream) is bound before these. The CUDA handlers
// (ffi/cuda/attention/handlers.cc) bind two more after these: the attribute "kernel" (the kernel
// options) and the operand "plan" (the tile plan), the handler's last parameters (operands,
// results and attributes are decoded apart, attributes by name).
#pragma once
#include <utility>

#include "ffi_attrs.h"
#include "ffi_helpers.h"

namespace jaxcp {

// The attribute every attention handler takes: "mask", the mask rules and the scale (MaskAttrs).
template <typename Binding>
auto bind_mask_attrs(Binding b) {
  return std::move(b).template Attr<MaskAttrs>("mask");
}

// fwd: q, k, v, q_seg, q_pos, kv_seg, kv_pos -> out, lse, workspace.
template <typename Binding>
auto bind_attention_fwd(Binding b) {
  return bind_mask_attrs(std::move(b).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()               // k
      .template Arg<ffi::AnyBuffer>()               // v
      .template Arg<ffi::Buffer<ffi::S32>>()        // q_seg
      .template Arg<ffi::Buffer<ffi::S32>>()        // q_pos
      .template Arg<ffi::Buffer<ffi::S32>>()        // kv_seg
      .template Arg<ffi::Buffer<ffi::S32>>()        // kv_pos
      .template Ret<ffi::AnyBuffer>()               // out
      .template Ret<ffi::Buffer<ffi::F32>>()        // lse
      .template Ret<ffi::AnyBuffer>());             // workspace (uint8; empty on the CPU)
}

// bwd: q, k, v, out, lse, dout, dlse, q_seg, q_pos, kv_seg, kv_pos -> dq, dk, dv, workspace.
template <typename Binding>
auto bind_attention_bwd(Binding b) {
  return bind_mask_attrs(std::move(b).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()               // k
      .template Arg<ffi::AnyBuffer>()               // v
      .template Arg<ffi::AnyBuffer>()               // out
      .template Arg<ffi::Buffer<ffi::F32>>()        // lse
      .template Arg<ffi::AnyBuffer>()               // dout
      .template Arg<ffi::Buffer<ffi::F32>>()        // dlse
      .template Arg<ffi::Buffer<ffi::S32>>()        // q_seg
      .template Arg<ffi::Buffer<ffi::S32>>()        // q_pos
      .template Arg<ffi::Buffer<ffi::S32>>()        // kv_seg
      .template Arg<ffi::Buffer<ffi::S32>>()        // kv_pos
      .template Ret<ffi::AnyBuffer>()               // dq
      .template Ret<ffi::AnyBuffer>()               // dk
      .template Ret<ffi::AnyBuffer>()               // dv
      .template Ret<ffi::AnyBuffer>())              // workspace (uint8; empty on the CPU)
      .template Attr<bool>("deterministic");
}

}  // namespace jaxcp
