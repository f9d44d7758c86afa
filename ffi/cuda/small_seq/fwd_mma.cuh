// Small-seq forward on tensor cores (mma.sync), the default for more keys or larger groups than
// the lane-group forward takes (small_seq/dispatch.py).
#pragma once
#include "device.cuh"

namespace jaxcp::cuda::small_seq {

// ---------------------------------------------------------------- forward on tensor cores
//
// Same tasks and shared-memory slices as small_seq_fwd_kernel, but the math runs on mma.sync.
// The CUDA-core kernel's instructions per task grow ~G-fold while its bytes barely do (each lane
// unpacks and multiplies its own Q/K/V chunks), which made GQA groups (and, with the per-task
// overheads, short ragged rows) issue-bound; here the math is a few dozen ldmatrix + mma per
// task. Per tile of 16 query heads of the group:
//   S = Q K^T : m16n8k16, M = heads, N = NT tiles of 8 tokens, K = D;
//   softmax on the accumulators (a head's row lives in the 4 lanes of a quad), probabilities
//     written from there;
//   O = P V   : the score accumulators are P's A fragments as they stand (m16n8k16 for NT = 2,
//     m16n8k8 for NT = 1); P is split into 16-bit hi + lo parts, two mma each, so that the
//     weights keep ~16 significant bits (a bf16 P alone would keep 8);
//   O is staged in the tile's (consumed) Q rows so that global stores are 16 bytes per lane.
// Tokens a row does not attend (past its length, masked off, past max_len) and heads past the
// group read the block's zero row instead of a smem row: nothing unstaged is read, and the P V
// product cannot turn 0 * garbage into NaN.
template <typename T, int D, int NT>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * 32)
    small_seq_fwd_mma_kernel(const Params p) {
  using Geo = Geometry<D>;
  constexpr int kCpx = 4 / NT;  // chunks of a token row in one ldmatrix.x4 of K or V
  extern __shared__ __align__(16) unsigned char smem[];
  T* Zs = reinterpret_cast<T*>(smem);  // the block's zero row, then one slice per warp
  Task t;
  const bool has_task = task_of(p, &t);
  for (int c = threadIdx.x; c < Geo::kChunks; c += blockDim.x)
    *reinterpret_cast<uint4*>(Zs + c * 8) = make_uint4(0, 0, 0, 0);
  __syncthreads();
  if (!has_task) return;
  const int lane = threadIdx.x & 31;
  const int G = p.group, ML = p.max_len;
  T* Ks = Zs + Geo::kRow + (threadIdx.x >> 5) * (p.warp_smem / 2);
  T* Vs = Ks + ML * Geo::kRow;
  T* Qs = Vs + ML * Geo::kRow;  // Q rows; a head tile's rows then stage its O rows
  const int64_t row0 = t.b * p.q_heads + static_cast<int64_t>(t.g) * G;

  stage_lean<T, D>(p, t, lane, Ks, Vs, G, static_cast<const T*>(p.q) + row0 * D, Qs);
  cp_async_wait_all();
  __syncwarp();

  auto attends = [&](int j) { return j < t.len && allowed(t.mask, j); };
  // ldmatrix row addresses: lane supplies row lane % 8 of matrix mi = lane / 8.
  //   K (B of S): matrix mi = token tile mi / kCpx, chunk mi % kCpx (two k-steps when NT = 1).
  //   V (B of P V, transposed): matrix mi = token tile mi % NT, chunk mi / NT.
  const int mi = lane >> 3, r8 = lane & 7;
  const int jk = r8 + 8 * (mi / kCpx), jv = r8 + 8 * (mi % NT);
  const uint32_t k_addr = smem_u32(attends(jk) ? Ks + jk * Geo::kRow : Zs) + (mi % kCpx) * 16;
  const uint32_t v_addr = smem_u32(attends(jv) ? Vs + jv * Geo::kRow : Zs) + (mi / NT) * 16;
  // Accumulator layout: lane holds rows qr and qr + 8, columns qc and qc + 1 of each 8-wide tile.
  const int qr = lane >> 2, qc = 2 * (lane & 3);
  bool ok[NT][2];
#pragma unroll
  for (int tt = 0; tt < NT; ++tt)
#pragma unroll
    for (int e = 0; e < 2; ++e) ok[tt][e] = attends(8 * tt + qc + e);
  const float scale_log2 = exp2_scale(p);
  const bool pair_store = ML % 2 == 0 && (reinterpret_cast<uintptr_t>(p.probs_out) & 7) == 0;
  T* out = static_cast<T*>(p.out);

  for (int h0 = 0; h0 < G; h0 += 16) {
    // Q (A of S): matrix mi = rows 8 * (mi & 1) of the tile, chunk mi >> 1.
    const int hq = h0 + r8 + 8 * (mi & 1);
    const uint32_t q_addr = smem_u32(hq < G ? Qs + hq * Geo::kRow : Zs) + (mi >> 1) * 16;
    float s[NT][4] = {};
    mma_rows_over_d<T, D, NT>(s, q_addr, k_addr);

    // Softmax over the tokens of rows qr (values s[.][0..1]) and qr + 8 (s[.][2..3]).
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int tt = 0; tt < NT; ++tt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[tt][i] = ok[tt][i & 1] ? s[tt][i] * scale_log2 : -INFINITY;
        m[i >> 1] = fmaxf(m[i >> 1], s[tt][i]);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r)
      for (int o = 1; o < 4; o <<= 1) m[r] = fmaxf(m[r], __shfl_xor_sync(kFull, m[r], o));
#pragma unroll
    for (int tt = 0; tt < NT; ++tt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[tt][i] = ok[tt][i & 1] ? exp2f(s[tt][i] - m[i >> 1]) : 0.f;
        l[i >> 1] += s[tt][i];
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      for (int o = 1; o < 4; o <<= 1) l[r] += __shfl_xor_sync(kFull, l[r], o);
      l[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
    }
    uint32_t ph[2 * NT], pl[2 * NT];  // A fragments of P: index 2 * tile + (row qr + 8)
#pragma unroll
    for (int tt = 0; tt < NT; ++tt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float a = s[tt][2 * r] * l[r], b = s[tt][2 * r + 1] * l[r];
        split2<T>(a, b, &ph[2 * tt + r], &pl[2 * tt + r]);
        const int h = h0 + qr + 8 * r, j = 8 * tt + qc;
        if (h >= G) continue;
        float* prow = p.probs_out + (row0 + h) * ML;
        if (pair_store) {
          if (j < ML) *reinterpret_cast<float2*>(prow + j) = make_float2(a, b);
        } else {
          if (j < ML) prow[j] = a;
          if (j + 1 < ML) prow[j + 1] = b;
        }
      }
    __syncwarp();  // the tile's Q rows are consumed: they take its O rows now

    T* o_rows = Qs + h0 * Geo::kRow;
    // Not unrolled where it would be whole: D 64 over one token tile (two passes) unrolled took 62
    // registers (32 warps a multiprocessor), rolled 40.
    constexpr int kUnroll = Geo::kChunks / kCpx > 2 ? 2 : 1;
#pragma unroll kUnroll
    for (int c0 = 0; c0 < Geo::kChunks; c0 += kCpx) {
      uint32_t vb[4];
      ldsm_x4_trans(vb, v_addr + c0 * 16);
#pragma unroll
      for (int c = 0; c < kCpx; ++c) {
        float o[4] = {};
        if constexpr (NT == 2) {
          mma16816<T>(o, ph, vb[2 * c], vb[2 * c + 1]);
          mma16816<T>(o, pl, vb[2 * c], vb[2 * c + 1]);
        } else {
          mma1688<T>(o, ph[0], ph[1], vb[c]);
          mma1688<T>(o, pl[0], pl[1], vb[c]);
        }
        const int col = (c0 + c) * 8 + qc;
        if (h0 + qr < G)
          *reinterpret_cast<uint32_t*>(o_rows + qr * Geo::kRow + col) = Cvt<T>::pack2(o[0], o[1]);
        if (h0 + qr + 8 < G)
          *reinterpret_cast<uint32_t*>(o_rows + (qr + 8) * Geo::kRow + col) =
              Cvt<T>::pack2(o[2], o[3]);
      }
    }
    __syncwarp();
    const int rows = min(16, G - h0);
    T* dst = out + (row0 + h0) * D;
    for (int i = lane; i < rows * Geo::kChunks; i += 32) {
      const int r = i / Geo::kChunks, c = i % Geo::kChunks;
      stg16(dst + static_cast<int64_t>(i) * 8, lds16(o_rows + r * Geo::kRow + c * 8));
    }
  }
}

}  // namespace jaxcp::cuda::small_seq
