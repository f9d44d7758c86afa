// Test counters: how often each CUDA handler ran, and how often its stream was being captured
// into a CUDA graph (an XLA command buffer) when it did. Counted only while JAXCP_COUNT_CAPTURES
// is set (tests/test_gpu_command_buffer.py); otherwise a handler call costs one getenv.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jaxcp::cuda {

enum class Handler { kAttentionFwd, kAttentionBwd, kSmallSeqFwd, kSmallSeqBwd, kCount };

void count_call(Handler h, cudaStream_t stream);

struct CallCounts {
  int64_t calls, captured;
};
CallCounts call_counts(Handler h);

}  // namespace jaxcp::cuda
