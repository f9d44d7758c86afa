// Small-seq forward on lane groups (lanes.cuh): float32 math on the CUDA cores, K/V in registers.
// NT (2, 4, 8, 12 or 16, >= max_len) sizes the register arrays; tokens the row does not attend are
// neither loaded nor counted. Per query head of the group (its Q row prefetched during the
// previous head): scores, a softmax every lane of the group computes redundantly, the
// probabilities written by lane j mod L, then O = P V.
// From 8 tokens on at D <= 256, each lane group walks several tasks (fwd_lanes_persistent).
// Rows of one query head from 12 tokens on (fwd_lanes_one_head) load V into K's registers once
// the scores are summed: a lane holds half the tokens' rows at a time (a quarter at D 512), and
// more blocks fit.
#pragma once
#include "lanes.cuh"

namespace jaxcp::cuda::small_seq {

// Dot products -> the softmax's probabilities (of the scores s * scale, taken as 2^(s * scale_log2))
// over the tokens the row attends (ok), zeros elsewhere; all zeros where it attends none.
template <int NT>
__device__ __forceinline__ void softmax_in_place(float (&s)[NT], const bool (&ok)[NT], float scale_log2) {
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
#pragma unroll
  for (int j = 0; j < NT; ++j) s[j] *= inv;
}

// Query row `row`'s probabilities (token j by lane j mod L) and output.
template <typename T, int D, int NT>
__device__ __forceinline__ void store_head(const Params& p, const LaneTask<D>& lt, int64_t row,
                                           const float (&s)[NT], float (&o)[Lanes<D>::kC][8]) {
  float* prow = p.probs_out + row * p.max_len;
#pragma unroll
  for (int j = 0; j < NT; ++j)
    if (j % Lanes<D>::kL == lt.lane && j < p.max_len) prow[j] = s[j];
  store_row<T, D>(static_cast<T*>(p.out) + row * D + lt.lane * 8, o, 1.f);
}

template <typename T, int D, int NT>
__device__ __forceinline__ void fwd_lanes_task(const Params& p, const LaneTask<D>& lt) {
  constexpr int L = Lanes<D>::kL, C = Lanes<D>::kC;
  const Task& t = lt.t;
  const int G = p.group;
  const int64_t row0 = t.b * p.q_heads + static_cast<int64_t>(t.g) * G;
  const T* q = static_cast<const T*>(p.q) + row0 * D + lt.lane * 8;

  uint4 qr[C], kr[NT][C], vr[NT][C];
  bool ok[NT];
  load_row<T, D>(q, lt.has, qr);
  load_kv<T, D, NT>(p, lt, ok, kr, vr);
  const float scale_log2 = exp2_scale(p);

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
    softmax_in_place(s, ok, scale_log2);
    float o[C][8] = {};
#pragma unroll
    for (int j = 0; j < NT; ++j) lane_axpy<T, D>(s[j], vr[j], o);
    if (lt.has) store_head<T, D>(p, lt, row0 + h, s, o);
  }
}

// Rows of one query head: V is loaded into K's registers once the scores are summed, so a lane
// holds one of them at a time; at D 512 (two chunks a lane) half the tokens at a time. At 12-16
// tokens the kernel keeps to 128 registers at D <= 256 (8 bytes spilled at 16; 4 blocks of 4 warps
// an SM, against 3 at 12 tokens and 2 at 16 holding both), and the warps of the extra blocks load
// while others compute; at D 512 164-168 (76 bytes spilled at 16), 3 blocks.
template <typename T, int D, int NT>
__device__ __forceinline__ void fwd_lanes_one_head_task(const Params& p, const LaneTask<D>& lt) {
  constexpr int L = Lanes<D>::kL, C = Lanes<D>::kC;
  constexpr int N = NT / C;  // tokens a register set holds
  static_assert(NT % C == 0, "a register set holds a whole share of the tokens");
  const int64_t row = lt.t.b * p.q_heads + lt.t.g;
  uint4 qr[C], r[N][C];
  bool ok[NT], okn[N];
  load_row<T, D>(static_cast<const T*>(p.q) + row * D + lt.lane * 8, lt.has, qr);
  float qf[C][8], s[NT];
#pragma unroll
  for (int j0 = 0; j0 < NT; j0 += N) {
    load_tokens<T, D, N>(p, lt, p.k, okn, r, j0);
    if (j0 == 0) unpack_row<T, D>(qr, qf);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      ok[j0 + j] = okn[j];
      s[j0 + j] = lane_dot<T, D>(qf, r[j]);
    }
  }
  group_sum<L>(s);
  softmax_in_place(s, ok, exp2_scale(p));
  float o[C][8] = {};
#pragma unroll
  for (int j0 = 0; j0 < NT; j0 += N) {
    load_tokens<T, D, N>(p, lt, p.v, okn, r, j0);
#pragma unroll
    for (int j = 0; j < N; ++j) lane_axpy<T, D>(s[j0 + j], r[j], o);
  }
  if (lt.has) store_head<T, D>(p, lt, row, s, o);
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

// Whether rows of one query head take fwd_lanes_one_head_task (walking): from 12 tokens on, where
// holding K and V together takes over 128 registers (at D 512 more than a lane has).
constexpr bool fwd_lanes_one_head(int nt) { return nt >= 12; }

template <typename T, int D, int NT>
__global__ void __launch_bounds__(kLanesBlockThreads, D == 512 ? 3 : 4)
    small_seq_fwd_lanes_one_head_kernel(const Params p) {
  lanes_walk<D>(p, [&](const LaneTask<D>& lt) { fwd_lanes_one_head_task<T, D, NT>(p, lt); });
}

}  // namespace jaxcp::cuda::small_seq
