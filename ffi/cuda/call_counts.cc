#include "call_counts.h"

#include <atomic>

#include "common/env_flag.h"

namespace jaxcp::cuda {
namespace {

constexpr int kHandlers = static_cast<int>(Handler::kCount);
std::atomic<int64_t> g_calls[kHandlers];
std::atomic<int64_t> g_captured[kHandlers];

}  // namespace

void count_call(Handler h, cudaStream_t stream) {
  static const bool counting = env_flag("JAXCP_COUNT_CAPTURES");  // read once: off the hot path
  if (!counting) return;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) (void)cudaGetLastError();
  g_calls[static_cast<int>(h)]++;
  if (status == cudaStreamCaptureStatusActive) g_captured[static_cast<int>(h)]++;
}

CallCounts call_counts(Handler h) {
  return {g_calls[static_cast<int>(h)].load(), g_captured[static_cast<int>(h)].load()};
}

}  // namespace jaxcp::cuda
