// Small-seq backward on lane groups (lanes.cuh) for GQA groups of any size: the task's K and V
// stay in registers with float32 dK/dV accumulators for each token, and the group's query heads
// stream through one at a time (head h + 1's Q, dO and P are loaded while head h is computed):
//   dP_j = dO_h . V_j (reduced over the lane group), delta = sum_j P_hj dP_j,
//   dS_j = P_hj (dP_j - delta), dQ_h = scale sum_j dS_j K_j (written at once),
//   dK_j += dS_j Q_h, dV_j += P_hj dO_h.
// The registers grow with the tokens (NT = 2 or 4, one 16-byte chunk per lane: D <= 256), not
// with the group, unlike bwd_lanes.cuh's, which holds all of the group's P and dS. The
// tensor-core and CUDA-core backwards give a task a warp; here a warp serves 32 / L tasks (four
// at D 64).
#pragma once
#include "lanes.cuh"

namespace jaxcp::cuda::small_seq {

template <typename T, int D, int NT>
__global__ void __launch_bounds__(kLanesBlockThreads) small_seq_bwd_lanes_gqa_kernel(const Params p) {
  constexpr int L = Lanes<D>::kL, C = Lanes<D>::kC;
  static_assert(C == 1, "one chunk per lane: dK/dV accumulators of NT tokens in registers");
  const LaneTask<D> lt(p);
  const Task& t = lt.t;
  const int G = p.group, ML = p.max_len;
  const int64_t row0 = t.b * p.q_heads + static_cast<int64_t>(t.g) * G;
  const int64_t next = lt.has ? next_start(p, t) : 0;
  const int64_t lane_row = row0 * D + lt.lane * 8;
  const T* q = static_cast<const T*>(p.q) + lane_row;
  const T* dout = static_cast<const T*>(p.dout) + lane_row;
  T* dq = static_cast<T*>(p.dq) + lane_row;
  const float* probs = p.probs + row0 * ML;

  uint4 kr[NT][C], vr[NT][C], qr[C], dor[C];
  bool ok[NT];
  float pr[NT];
  load_row<T, D>(q, lt.has, qr);
  load_row<T, D>(dout, lt.has, dor);
  load_kv<T, D, NT>(p, lt, ok, kr, vr);
#pragma unroll
  for (int j = 0; j < NT; ++j) pr[j] = ok[j] ? __ldg(probs + j) : 0.f;

  float dk[NT][C][8] = {}, dv[NT][C][8] = {};
  for (int h = 0; h < G; ++h) {
#pragma unroll
    for (int j = 0; j < NT; ++j)  // K/V stay 16-bit between heads (float32 copies: 194 registers)
#pragma unroll
      for (int cc = 0; cc < C; ++cc) {
        opaque(kr[j][cc]);
        opaque(vr[j][cc]);
      }
    float qf[C][8], dof[C][8], ph[NT];
    unpack_row<T, D>(qr, qf);
    unpack_row<T, D>(dor, dof);
#pragma unroll
    for (int j = 0; j < NT; ++j) ph[j] = pr[j];
    if (h + 1 < G) {  // the next head's rows, in flight during this head's math
      load_row<T, D>(q + (h + 1) * D, lt.has, qr);
      load_row<T, D>(dout + (h + 1) * D, lt.has, dor);
#pragma unroll
      for (int j = 0; j < NT; ++j) pr[j] = ok[j] ? __ldg(probs + (h + 1) * ML + j) : 0.f;
    }

    float ds[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) ds[j] = lane_dot<T, D>(dof, vr[j]);
    group_sum<L>(ds);
    float delta = 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j) delta = fmaf(ph[j], ds[j], delta);
    float dqh[C][8] = {};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      ds[j] = ph[j] * (ds[j] - delta);
      lane_axpy<T, D>(ds[j], kr[j], dqh);
#pragma unroll
      for (int cc = 0; cc < C; ++cc)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          dk[j][cc][e] = fmaf(ds[j], qf[cc][e], dk[j][cc][e]);
          dv[j][cc][e] = fmaf(ph[j], dof[cc][e], dv[j][cc][e]);
        }
    }
    if (lt.has) store_row<T, D>(dq + h * D, dqh, p.scale);
  }
  if (!lt.has) return;

#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (j >= t.len) break;
    const int64_t off = lt.kv_offset(p, j);
    store_row<T, D>(static_cast<T*>(p.dk) + off, dk[j], p.scale);
    store_row<T, D>(static_cast<T*>(p.dv) + off, dv[j], 1.f);
  }
  zero_uncovered<T, D>(p, t, lt.lane, next, L);
}

}  // namespace jaxcp::cuda::small_seq
