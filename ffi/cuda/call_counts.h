// Test instrumentation: how often each CUDA handler ran, and how often its stream was being
// captured into a CUDA graph (an XLA command buffer) when it did (tests/test_gpu_command_buffer.py).
// Off until a caller turns it on through the module's set_call_counting: while off, a handler
// call costs one relaxed atomic load, and never a CUDA call.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jaxcp::cuda {

enum class Handler { kAttentionFwd, kAttentionBwd, kAttentionFwdPlan, kAttentionBwdPlan, kSmallSeqFwd, kSmallSeqBwd, kCount };

// Turns counting on (from zero: the counts are reset) or off (the counts stay readable).
void set_call_counting(bool on);

// Called by every handler: counts the call, and whether `stream` is being captured, when on.
void count_call(Handler h, cudaStream_t stream);

struct CallCounts {
  int64_t calls, captured;
};
CallCounts call_counts(Handler h);

}  // namespace jaxcp::cuda
