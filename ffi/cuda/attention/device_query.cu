// Queries of the current device that the launchers share (cached per device where they are asked
// at every call).
#include "device.cuh"

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

}  // namespace jaxcp::cuda
