// Does compute-sanitizer's initcheck count a bulk (TMA-engine) store to global memory as a write?
// No (CUDA 13, H200, session 33): it reports the reads of `b` below as uninitialized although the
// sum comes out right, and the same reads of `a`, written by plain stores, not. The sm_90a forward
// stores O by TMA, hence tools/gpu_sanitize.sh's initcheck runs.
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/probe tools/initcheck_tma_probe.cu
//   compute-sanitizer --tool initcheck /tmp/probe
#include <cstdio>
#include <cuda_runtime.h>
__global__ void bulk_store(float* dst, int n) {
  __shared__ alignas(128) float buf[1024];
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = float(i);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(buf));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(s), "r"(n * 4) : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}
__global__ void plain_store(float* dst, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = float(i);
}
__global__ void sum(const float* src, int n, float* out) {
  float s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += src[i];
  atomicAdd(out, s);
}
int main() {
  const int n = 1024;
  float *a, *b, *out;
  cudaMalloc(&a, n * 4); cudaMalloc(&b, n * 4); cudaMalloc(&out, 4);
  cudaMemset(out, 0, 4);
  plain_store<<<1, 256>>>(a, n);
  bulk_store<<<1, 256>>>(b, n);
  sum<<<1, 256>>>(a, n, out);  // reads plain-stored memory
  printf("plain read done\n"); fflush(stdout);
  cudaDeviceSynchronize();
  sum<<<1, 256>>>(b, n, out);  // reads bulk-stored memory
  float h; cudaMemcpy(&h, out, 4, cudaMemcpyDeviceToHost);
  printf("sum %f (expect %f), %s\n", h, 2.0 * n * (n - 1) / 2, cudaGetErrorString(cudaGetLastError()));
}
