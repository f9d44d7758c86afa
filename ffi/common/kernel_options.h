// Which CUDA kernels run: options the caller chooses (private, for tests and measurements; the
// defaults run the best kernel for the device). The CUDA handlers take them as the FFI attribute
// "kernel" (decoded in ffi_attrs.h); src/jaxcp/_src/kernel_options.py has the same fields.
#pragma once
#include <cstdint>

namespace jaxcp {

struct AttentionKernelOptions {
  bool sm80_only = false;        // the sm_80 kernels (and their plans) even on an sm_90 device
  bool fwd_fixed_tiles = false;  // sm_90a forward: query tiles of 128 rows from token 0, not at documents
};

// Small-seq kernel families (kernel_options.py SMALL_SEQ_KERNELS has the same codes). The Python
// layer always names one (src/jaxcp/_src/small_seq/dispatch.py has the rule for the default).
enum class SmallSeqKernel : int32_t {
  kMma = 1,       // one warp per (row, key/value head), math on tensor cores
  kCudaCore = 2,  // one warp per (row, key/value head), float32 math on the CUDA cores
  kLanes = 3,     // D/8 lanes per (row, key/value head), K/V in registers, float32 math
};

struct SmallSeqKernelOptions {
  int32_t fwd = 0;  // a SmallSeqKernel
  int32_t bwd = 0;  // a SmallSeqKernel
};

}  // namespace jaxcp
