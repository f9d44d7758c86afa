// Test counters: how often each CUDA handler ran, and how often its stream was being captured
// into a CUDA graph (an XLA command buffer) when it did. Counted only in a process started with
// JAXCP_COUNT_CAPTURES set (tests/test_gpu_command_buffer.py; read at the first call).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jaxcp::cuda {

enum class Handler { kAttentionFwd, kAttentionBwd, kAttentionFwdPlan, kAttentionBwdPlan, kSmallSeqFwd, kSmallSeqBwd, kCount };

void count_call(Handler h, cudaStream_t stream);

struct CallCounts {
  int64_t calls, captured;
};
CallCounts call_counts(Handler h);

}  // namespace jaxcp::cuda
