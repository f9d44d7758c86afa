// Which CUDA kernels run: options the caller chooses (private, for tests and measurements; the
// defaults run the best kernel for the device). The CUDA handlers take them as the FFI attribute
// "kernel" (decoded in ffi_attrs.h); src/jaxcp/_src/kernel_options.py has the same fields.
#pragma once

namespace jaxcp {

struct AttentionKernelOptions {
  bool sm80_only = false;        // the sm_80 kernels (and their plans) even on an sm_90 device
  bool fwd_fixed_tiles = false;  // sm_90a forward: query tiles of 128 rows from token 0, not at documents
};

struct SmallSeqKernelOptions {
  bool cuda_core_fwd = false;  // the float32 CUDA-core forward instead of the tensor-core one
  bool cuda_core_bwd = false;  // the float32 CUDA-core backward instead of the tensor-core one
};

}  // namespace jaxcp
