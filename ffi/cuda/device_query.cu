// Queries of the current device that the attention and small-seq launchers share.
#include "cuda/device_query.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace jaxcp::cuda {

int multiprocessor_count() {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 132;
}

cudaError_t set_max_dynamic_smem(const void* kernel, int bytes, unsigned* done_mask) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const unsigned bit = dev < 32 ? (1u << dev) : 0u;
  if (bit && (__atomic_load_n(done_mask, __ATOMIC_ACQUIRE) & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && bit) __atomic_fetch_or(done_mask, bit, __ATOMIC_ACQ_REL);
  return err;
}

int resident_blocks_per_sm(const void* kernel, int block_threads) {
  static std::mutex mu;
  static std::unordered_map<const void*, int> known;
  const std::lock_guard<std::mutex> lock(mu);
  if (auto it = known.find(kernel); it != known.end()) return it->second;
  int blocks = 0;
  const cudaError_t err =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, block_threads, 0);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not the launch's error: it runs with one block a multiprocessor
    blocks = 1;
  }
  return known[kernel] = std::max(blocks, 1);
}

}  // namespace jaxcp::cuda
