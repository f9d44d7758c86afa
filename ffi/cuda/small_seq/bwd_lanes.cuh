// Small-seq backward on lane groups (lanes.cuh): float32 math on the CUDA cores, for groups of
// GH = 1 or 2 query heads per key/value head (the register arrays hold the group's P and dS;
// larger groups take the tensor-core backward). One pass: K, V, Q, dO and P into registers,
//   dP_hj = dO_h . V_j (reduced over the lane group), delta_h = sum_j P_hj dP_hj,
//   dS_hj = P_hj (dP_hj - delta_h),
//   dQ_h = scale sum_j dS_hj K_j,  dK_j = scale sum_h dS_hj Q_h,  dV_j = sum_h P_hj dO_h,
// each output row written once from registers. Tokens below the row's length that it does not
// attend get zero dK/dV from the same code (their P and dS are 0); tokens no row covers are
// zeroed by zero_uncovered. From 8 tokens on at D <= 128, each lane group walks several tasks
// (bwd_lanes_persistent).
#pragma once
#include "lanes.cuh"

namespace jaxcp::cuda::small_seq {

template <typename T, int D, int NT, int GH>
__device__ __forceinline__ void bwd_lanes_task(const Params& p, const LaneTask<D>& lt) {
  constexpr int L = Lanes<D>::kL, C = Lanes<D>::kC;
  const Task& t = lt.t;
  const int ML = p.max_len;
  const int64_t row0 = t.b * p.q_heads + static_cast<int64_t>(t.g) * GH;
  const int64_t next = lt.has ? next_start(p, t) : 0;
  const int64_t lane_row = row0 * D + lt.lane * 8;

  uint4 qr[GH][C], dor[GH][C], kr[NT][C], vr[NT][C];
  bool ok[NT];
  float pr[GH][NT], ds[GH][NT];
#pragma unroll
  for (int h = 0; h < GH; ++h) {
    load_row<T, D>(static_cast<const T*>(p.q) + lane_row + h * D, lt.has, qr[h]);
    load_row<T, D>(static_cast<const T*>(p.dout) + lane_row + h * D, lt.has, dor[h]);
  }
  load_kv<T, D, NT>(p, lt, ok, kr, vr);
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int h = 0; h < GH; ++h) pr[h][j] = ok[j] ? __ldg(p.probs + (row0 + h) * ML + j) : 0.f;

  // dP (in ds), reduced over the group, then dS in place.
#pragma unroll
  for (int h = 0; h < GH; ++h) {
    float dof[C][8];
    unpack_row<T, D>(dor[h], dof);
#pragma unroll
    for (int j = 0; j < NT; ++j) ds[h][j] = lane_dot<T, D>(dof, vr[j]);
  }
#pragma unroll
  for (int h = 0; h < GH; ++h) {
    group_sum<L>(ds[h]);
    float delta = 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j) delta = fmaf(pr[h][j], ds[h][j], delta);
#pragma unroll
    for (int j = 0; j < NT; ++j) ds[h][j] = pr[h][j] * (ds[h][j] - delta);
  }
  if (!lt.has) return;

#pragma unroll
  for (int h = 0; h < GH; ++h) {
    float dq[C][8] = {};
#pragma unroll
    for (int j = 0; j < NT; ++j) lane_axpy<T, D>(ds[h][j], kr[j], dq);
    store_row<T, D>(static_cast<T*>(p.dq) + lane_row + h * D, dq, p.scale);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (j >= t.len) break;
    float dk[C][8] = {}, dv[C][8] = {};
#pragma unroll
    for (int h = 0; h < GH; ++h) {
      lane_axpy<T, D>(ds[h][j], qr[h], dk);
      lane_axpy<T, D>(pr[h][j], dor[h], dv);
    }
    const int64_t off = lt.kv_offset(p, j);
    store_row<T, D>(static_cast<T*>(p.dk) + off, dk, p.scale);
    store_row<T, D>(static_cast<T*>(p.dv) + off, dv, 1.f);
  }
  zero_uncovered<T, D>(p, t, lt.lane, next, L);
}

// Whether the backward for D and NT walks several tasks a lane group (lanes_walk): from 8 tokens
// on at D <= 128. At D 256 (8 tokens, one head) the walk did not pay (forward+backward 1.44 ->
// 1.45-1.49 ms at B = 262144, where its forward gained 0.06 ms); at D 512 it took 168 -> 254
// registers (3 -> 2 blocks).
constexpr bool bwd_lanes_persistent(int d, int nt) { return nt >= 8 && d <= 128; }

template <typename T, int D, int NT, int GH>
__global__ void __launch_bounds__(kLanesBlockThreads) small_seq_bwd_lanes_kernel(const Params p) {
  if constexpr (bwd_lanes_persistent(D, NT))
    lanes_walk<D>(p, [&](const LaneTask<D>& lt) { bwd_lanes_task<T, D, NT, GH>(p, lt); });
  else
    bwd_lanes_task<T, D, NT, GH>(p, LaneTask<D>(p));
}

}  // namespace jaxcp::cuda::small_seq
