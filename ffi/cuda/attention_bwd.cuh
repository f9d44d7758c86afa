// Parameters and launchers shared by the backward kernels (private to ffi/cuda/*.cu).
#pragma once
#include "attention_device.cuh"

namespace jaxcp::cuda::detail {

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const float* lse;    // [B, Hq, Sq]
  const float* delta;  // [B, Hq, Sq]: rowsum(dO * O)
  const int32_t* q_seg;
  const int32_t* q_pos;
  const int32_t* kv_seg;
  const int32_t* kv_pos;
  float* dq_accum;  // [B, Sq, Hq, D] float32, unscaled (atomic dQ mode)
  void* dq;         // [B, Sq, Hq, D] (dQ kernel output)
  void* dk;         // [B, Skv, Hkv, D] (when splits == 1)
  void* dv;
  float* dk_part;  // [splits, B, Skv, Hkv, D] float32 (when splits > 1)
  float* dv_part;
  int64_t B, Sq, Skv;
  int Hq, Hkv, group, splits;
  int64_t q_row, kv_row;
  float scale, scale_log2;
  MaskParams mask;
  // dK/dV kernel plan: query tiles of kBwdBlockM, key tiles of bwd_block_n(D).
  const TileSummary* q_sum;   // [B, nq]
  const TileSummary* kv_sum;  // [B, nkv]
  const TileRange* kv_range;  // [B, nkv]: query tiles per key tile
  const int* kv_order;        // [B * nkv]: (b * nkv + n) key tiles, heaviest first
  int head_chunk;             // (kv head, split) pairs per scheduling chunk, divides Hkv*splits
  int nq, nkv;
  // dQ kernel plan: query tiles of kBwdBlockM, key tiles of dq_block_n(D).
  const TileSummary* kv_sum_dq;  // [B, nkv_dq]
  const TileRange* q_range_dq;   // [B, nq]: key tiles per query tile
  const int* q_order_dq;         // [B * nq]: (b * nq + m) query tiles, heaviest first
  int nkv_dq;
};

// attention_bwd_kernels.cu
template <class Element, int D>
cudaError_t launch_bwd_dkdv(const BwdParams& p, bool atomic_dq, cudaStream_t stream);
// attention_bwd_dq_kernels.cu
template <class Element, int D>
cudaError_t launch_bwd_dq(const BwdParams& p, cudaStream_t stream);

// 2 adjacent float32 -> 2 adjacent 16-bit values, one 32-bit store.
template <class Element>
__forceinline__ __device__ void store_pair(Element* ptr, float a, float b) {
  const Element ea = static_cast<Element>(a), eb = static_cast<Element>(b);
  const uint32_t w = static_cast<uint32_t>(ea.raw()) | (static_cast<uint32_t>(eb.raw()) << 16);
  *reinterpret_cast<uint32_t*>(ptr) = w;
}

}  // namespace jaxcp::cuda::detail
