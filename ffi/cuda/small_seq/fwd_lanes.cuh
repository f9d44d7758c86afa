// Small-seq forward on lane groups (lanes.cuh): float32 math on the CUDA cores, K/V in registers.
// NT (2, 4, 8, 12 or 16, >= max_len) sizes the register arrays; tokens the row does not attend are
// neither loaded nor counted. Per query head of the group (its Q row prefetched during the
// previous head): scores, a softmax every lane of the group computes redundantly, the
// probabilities written by lane j mod L, then O = P V.
// From 8 tokens on at D <= 256, each lane group walks several tasks (fwd_lanes_persistent).
#pragma once
#include "lanes.cuh"

namespace jaxcp::cuda::small_seq {

template <typename T, int D, int NT>
__device__ __forceinline__ void fwd_lanes_task(const Params& p, const LaneTask<D>& lt) {
  constexpr int L = Lanes<D>::kL, C = Lanes<D>::kC;
  const Task& t = lt.t;
  const int G = p.group, ML = p.max_len;
  const int64_t row0 = t.b * p.q_heads + static_cast<int64_t>(t.g) * G;
  const T* q = static_cast<const T*>(p.q) + row0 * D + lt.lane * 8;

  uint4 qr[C], kr[NT][C], vr[NT][C];
  bool ok[NT];
  load_row<T, D>(q, lt.has, qr);
  load_kv<T, D, NT>(p, lt, ok, kr, vr);
  const float scale_log2 = p.scale * 1.4426950408889634f;

  for (int h = 0; h < G; ++h) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int cc = 0; cc < C; ++cc) {
        opaque(kr[j][cc]);
        opaque(vr[j][cc]);
      }
    float qf[C][8];
    unpack_row<T, D>(qr, qf);
    if (h + 1 < G) load_row<T, D>(q + (h + 1) * D, lt.has, qr);

    float s[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) s[j] = lane_dot<T, D>(qf, kr[j]);
    group_sum<L>(s);
    float m = -INFINITY, l = 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      s[j] = ok[j] ? s[j] * scale_log2 : -INFINITY;
      m = fmaxf(m, s[j]);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      s[j] = ok[j] ? exp2f(s[j] - m) : 0.f;
      l += s[j];
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float o[C][8] = {};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      s[j] *= inv;
      lane_axpy<T, D>(s[j], vr[j], o);
    }
    if (!lt.has) continue;
    float* prow = p.probs_out + (row0 + h) * ML;
#pragma unroll
    for (int j = 0; j < NT; ++j)
      if (j % L == lt.lane && j < ML) prow[j] = s[j];
    store_row<T, D>(static_cast<T*>(p.out) + (row0 + h) * D + lt.lane * 8, o, 1.f);
  }
}

// Whether the forward for D and NT walks several tasks a lane group (lanes_walk): from 8 tokens
// on, where the walk leaves the resident blocks the same (104 -> 128 registers at D 64 and 8
// tokens, 4 blocks of 4 warps either way). At 2 and 4 tokens it cost blocks (44 -> 64, 64 -> 80
// registers; capped by launch bounds, they spilled). D 512 (up to 8 tokens) was not measured
// walking and runs one task a lane group.
constexpr bool fwd_lanes_persistent(int d, int nt) { return nt >= 8 && d <= 256; }

template <typename T, int D, int NT>
__global__ void __launch_bounds__(kLanesBlockThreads) small_seq_fwd_lanes_kernel(const Params p) {
  if constexpr (fwd_lanes_persistent(D, NT))
    lanes_walk<D>(p, [&](const LaneTask<D>& lt) { fwd_lanes_task<T, D, NT>(p, lt); });
  else
    fwd_lanes_task<T, D, NT>(p, LaneTask<D>(p));
}

}  // namespace jaxcp::cuda::small_seq
