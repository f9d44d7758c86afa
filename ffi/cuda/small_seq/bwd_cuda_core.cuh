// Small-seq backward on the CUDA cores (float32 math; SmallSeqKernelOptions::cuda_core_bwd, and
// GQA groups of more than 16 heads): dP and dS per (head, token) lane as in the forward's scores,
// dQ by the weighted sum over tokens, dK, dV with lane = (token, chunk) summed over the G heads
// of the group, written once.
#pragma once
#include "device.cuh"

namespace jaxcp::cuda::small_seq {

template <typename T, int D>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * 32)
    small_seq_bwd_kernel(const Params p) {
  using Geo = Geometry<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  Task t;
  if (!task_of(p, &t)) return;
  const int lane = threadIdx.x & 31;
  const int G = p.group, ML = p.max_len;
  T* Ks = reinterpret_cast<T*>(smem + (threadIdx.x >> 5) * p.warp_smem);
  T* Vs = Ks + ML * Geo::kRow;
  T* Qs = Vs + ML * Geo::kRow;
  T* DOs = Qs + G * Geo::kRow;
  float* Ps = reinterpret_cast<float*>(DOs + G * Geo::kRow);
  float* DSs = Ps + ((G * ML + 3) & ~3);
  const int64_t row0 = t.b * p.q_heads + static_cast<int64_t>(t.g) * G;

  stage<T, D>(p, t, lane, Ks, Vs, static_cast<const T*>(p.q) + row0 * D, Qs,
              static_cast<const T*>(p.dout) + row0 * D, DOs, G);
  for (int i = lane; i < G * ML; i += 32) cp_async4(Ps + i, p.probs + row0 * ML + i);
  cp_async_wait_all();
  __syncwarp();

  // dp = dO . V, delta = sum_j p dp, ds = p (dp - delta).
  const ScoreLanes S(lane, ML, G);
  for (int h0 = 0; h0 < G; h0 += S.hpp) {
    const int h = h0 + S.hs;
    const bool valid = h < G && S.j < t.len && allowed(t.mask, S.j);
    float dp = 0.f;
    if (valid) dp = partial_dot<T, D>(DOs + h * Geo::kRow, Vs + S.j * Geo::kRow, S.ds, S.ds_count);
    for (int o = S.tl * S.hpp; o < 32; o <<= 1) dp += __shfl_xor_sync(kFull, dp, o);
    const float pj = valid ? Ps[h * ML + S.j] : 0.f;
    float delta = pj * dp;
    for (int o = 1; o < S.tl; o <<= 1) delta += __shfl_xor_sync(kFull, delta, o);
    __syncwarp();  // every lane has read Ps before it is rewritten
    if (S.ds == 0 && h < G && S.j < ML) {
      Ps[h * ML + S.j] = pj;  // 0 outside the row: later phases need no mask test
      DSs[h * ML + S.j] = valid ? pj * (dp - delta) : 0.f;
    }
  }
  __syncwarp();

  // dq_h = scale * sum_j ds_hj k_j.
  weighted_rows<T, D>(t, lane, G, ML, DSs, Ks, static_cast<T*>(p.dq) + row0 * D, p.scale);

  // dk_j = scale * sum_h ds_hj q_h, dv_j = sum_h p_hj dO_h: lane = (token, chunk).
  T* dk = static_cast<T*>(p.dk);
  T* dv = static_cast<T*>(p.dv);
  constexpr int cl = Geo::kChunkLanes, tj_count = 32 / cl;
  const int c0 = lane % cl, tj = lane / cl;
  for (int j0 = 0; j0 < t.len; j0 += tj_count) {
    const int j = j0 + tj;
    if (j >= t.len) continue;
    float ak[Geo::kChunksPerLane][8], av[Geo::kChunksPerLane][8];
#pragma unroll
    for (int cc = 0; cc < Geo::kChunksPerLane; ++cc)
#pragma unroll
      for (int e = 0; e < 8; ++e) ak[cc][e] = av[cc][e] = 0.f;
    for (int h = 0; h < G; ++h) {
      const float ds = DSs[h * ML + j], pj = Ps[h * ML + j];
#pragma unroll
      for (int cc = 0; cc < Geo::kChunksPerLane; ++cc) {
        const int c = (c0 + cc * cl) * 8;
        float qf[8], of[8];
        Cvt<T>::unpack(lds16(Qs + h * Geo::kRow + c), qf);
        Cvt<T>::unpack(lds16(DOs + h * Geo::kRow + c), of);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          ak[cc][e] = fmaf(ds, qf[e], ak[cc][e]);
          av[cc][e] = fmaf(pj, of[e], av[cc][e]);
        }
      }
    }
    const int64_t off = ((t.start + j) * p.kv_heads + t.g) * D;
#pragma unroll
    for (int cc = 0; cc < Geo::kChunksPerLane; ++cc) {
      const int c = (c0 + cc * cl) * 8;
      stg16(dk + off + c, pack8<T>(ak[cc], p.scale));
      stg16(dv + off + c, pack8<T>(av[cc], 1.f));
    }
  }

  zero_uncovered<T, D>(p, t, lane, next_start(p, t));
}

}  // namespace jaxcp::cuda::small_seq
