// Queries of the current device that the attention and small-seq launchers share
// (device_query.cu).
#pragma once
#include <cuda_runtime.h>

namespace jaxcp::cuda {

// Multiprocessors of the current device (132 when the query fails).
int multiprocessor_count();

// Enables > 48 KB of dynamic shared memory for `kernel` on the current device (once per device).
cudaError_t set_max_dynamic_smem(const void* kernel, int bytes, unsigned* done_mask);

// Blocks of `kernel` resident on one multiprocessor at once with `block_threads` threads and no
// dynamic shared memory, at least 1 (asked once per kernel: a kernel always runs with the same
// block size).
int resident_blocks_per_sm(const void* kernel, int block_threads);

}  // namespace jaxcp::cuda
