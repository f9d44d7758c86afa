#include "call_counts.h"

#include <atomic>

namespace jaxcp::cuda {
namespace {

constexpr int kHandlers = static_cast<int>(Handler::kCount);
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_calls[kHandlers];
std::atomic<int64_t> g_captured[kHandlers];

}  // namespace

void set_call_counting(bool on) {
  if (on) {
    for (int h = 0; h < kHandlers; ++h) {
      g_calls[h].store(0, std::memory_order_relaxed);
      g_captured[h].store(0, std::memory_order_relaxed);
    }
  }
  g_counting.store(on, std::memory_order_release);
}

void count_call(Handler h, cudaStream_t stream) {
  if (!g_counting.load(std::memory_order_relaxed)) return;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) (void)cudaGetLastError();
  g_calls[static_cast<int>(h)].fetch_add(1, std::memory_order_relaxed);
  if (status == cudaStreamCaptureStatusActive) g_captured[static_cast<int>(h)].fetch_add(1, std::memory_order_relaxed);
}

CallCounts call_counts(Handler h) {
  return {g_calls[static_cast<int>(h)].load(), g_captured[static_cast<int>(h)].load()};
}

}  // namespace jaxcp::cuda
