// Small-seq forward on the CUDA cores (float32 math; SmallSeqKernelOptions::cuda_core_fwd):
//   scores : lane = (d-split, head, token); partial dot products reduced with shuffles, then a
//            softmax over the token lanes; probabilities written once (to global and smem).
//   P @ V  : lane = (token-split, head, 16-byte chunk of D); reduced over the token split.
#pragma once
#include "device.cuh"

namespace jaxcp::cuda::small_seq {

template <typename T, int D>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * 32)
    small_seq_fwd_kernel(const Params p) {
  using Geo = Geometry<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  Task t;
  if (!task_of(p, &t)) return;
  const int lane = threadIdx.x & 31;
  const int G = p.group, ML = p.max_len;
  T* Ks = reinterpret_cast<T*>(smem + (threadIdx.x >> 5) * p.warp_smem);
  T* Vs = Ks + ML * Geo::kRow;
  T* Qs = Vs + ML * Geo::kRow;
  float* Ps = reinterpret_cast<float*>(Qs + G * Geo::kRow);
  const int64_t row0 = t.b * p.q_heads + static_cast<int64_t>(t.g) * G;  // first q head of group

  stage<T, D>(p, t, lane, Ks, Vs, static_cast<const T*>(p.q) + row0 * D, Qs, nullptr, nullptr, G);
  cp_async_wait_all();
  __syncwarp();

  // Scores and softmax: probabilities to smem and (once) to global memory.
  const ScoreLanes S(lane, ML, G);
  const float scale_log2 = exp2_scale(p);
  for (int h0 = 0; h0 < G; h0 += S.hpp) {
    const int h = h0 + S.hs;
    const bool valid = h < G && S.j < t.len && allowed(t.mask, S.j);
    float acc = 0.f;
    if (valid) acc = partial_dot<T, D>(Qs + h * Geo::kRow, Ks + S.j * Geo::kRow, S.ds, S.ds_count);
    for (int o = S.tl * S.hpp; o < 32; o <<= 1) acc += __shfl_xor_sync(kFull, acc, o);
    const float s = valid ? acc * scale_log2 : -INFINITY;
    float m = s;
    for (int o = 1; o < S.tl; o <<= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
    const float e = valid ? exp2f(s - m) : 0.f;
    float l = e;
    for (int o = 1; o < S.tl; o <<= 1) l += __shfl_xor_sync(kFull, l, o);
    const float prob = l > 0.f ? e / l : 0.f;
    if (S.ds == 0 && h < G && S.j < ML) {
      Ps[h * ML + S.j] = prob;
      p.probs_out[(row0 + h) * ML + S.j] = prob;
    }
  }
  __syncwarp();

  weighted_rows<T, D>(t, lane, G, ML, Ps, Vs, static_cast<T*>(p.out) + row0 * D, 1.f);
}

}  // namespace jaxcp::cuda::small_seq
