// Small-seq backward on tensor cores (mma.sync), for GQA groups of up to 16 heads (the default
// above 8 keys or 2 heads a group: small_seq/dispatch.py).
#pragma once
#include "device.cuh"

namespace jaxcp::cuda::small_seq {

// ---------------------------------------------------------------- backward on tensor cores
//
// Same tasks as small_seq_bwd_kernel; K, V, Q, dO and P are staged as in the forward on tensor
// cores (P with cp.async too: plain loads issued before the wait were scheduled after it by
// ptxas, one more round trip per task). The CUDA-core backward issues ~G unpack + FMA passes over
// every K/V byte (dP, dK, dV) and over every Q/dO byte (dQ); here the math is ~100 ldmatrix + mma
// per task. Tokens are the M dimension (16; rows past the length, masked off or past max_len read
// the zero row), HT tiles of 8 heads, NT tiles of 8 tokens:
//   dP^T = V dO^T   : m16n8k16, N = heads, K = D. Its accumulators are laid out as the A
//                     fragments of the dK/dV products below, so P^T is read in that layout and
//                     dS^T = P^T (dP^T - delta) is formed in place (delta: sums over 8 lanes);
//   dV = P^T dO, dK = scale dS^T Q : N = D, K = heads (m16n8k8 for HT = 1, m16n8k16 for 2);
//   dQ = scale dS K : M = heads, K = tokens; its A fragments are dS^T's, transposed by movmatrix.
// P and dS enter the mma as 16-bit hi + lo parts (~16 significant bits, as P in the forward).
// dS is first scaled by the power of two that brings the task's largest |dS| into [1, 2), undone
// exactly on dQ and dK: in f16 a large dS would overflow and a small one lose its low bits.
// Outputs are staged in consumed smem rows (dV in V's, dQ in dO's, dK in K's) and written with
// 16-byte stores.
template <typename T, int D, int HT, int NT>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * 32)
    small_seq_bwd_mma_kernel(const Params p) {
  using Geo = Geometry<D>;
  constexpr int kCpxH = 4 / HT;  // chunks of a head row in one ldmatrix.x4 of dO or Q
  constexpr int kCpxT = 4 / NT;  // chunks of a token row in one ldmatrix.x4 of K (for dQ)
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
  T* Ks = Zs + Geo::kRow + (threadIdx.x >> 5) * (p.warp_smem / 2);  // then dK
  T* Vs = Ks + ML * Geo::kRow;                                      // then dV
  T* Qs = Vs + ML * Geo::kRow;
  T* DOs = Qs + G * Geo::kRow;                                      // then dQ
  float* Ps = reinterpret_cast<float*>(DOs + G * Geo::kRow);
  const int64_t row0 = t.b * p.q_heads + static_cast<int64_t>(t.g) * G;
  const int64_t next = next_start(p, t);  // loaded now: not one more round trip at the end

  stage_lean<T, D>(p, t, lane, Ks, Vs, G, static_cast<const T*>(p.q) + row0 * D, Qs,
                   static_cast<const T*>(p.dout) + row0 * D, DOs);
  for (int i = lane; i < G * ML; i += 32) cp_async4(Ps + i, p.probs + row0 * ML + i);
  cp_async_wait_all();
  __syncwarp();

  auto attends = [&](int j) { return j < t.len && allowed(t.mask, j); };
  // Accumulator layout: lane holds rows qr and qr + 8, columns qc and qc + 1 of each 8-wide tile.
  const int qr = lane >> 2, qc = 2 * (lane & 3);
  // P^T: [tile][2 * (token row qr + 8) + head column qc + 1]; 0 where not attended.
  float pt[HT][4];
#pragma unroll
  for (int ht = 0; ht < HT; ++ht)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = 8 * ht + qc + (i & 1), j = qr + 8 * (i >> 1);
      pt[ht][i] = h < G && attends(j) ? Ps[h * ML + j] : 0.f;
    }

  // ldmatrix row addresses: lane supplies row r8 of matrix mi = lane / 8.
  const int mi = lane >> 3, r8 = lane & 7;
  auto row_addr = [&](const T* rows, int r, bool ok, int chunk) {
    return smem_u32(ok ? rows + r * Geo::kRow : Zs) + chunk * 16;
  };
  //   V (A of dP^T): matrix mi = tokens 8 (mi & 1), chunk mi >> 1.
  const int jv = r8 + 8 * (mi & 1);
  const uint32_t v_addr = row_addr(Vs, jv, attends(jv), mi >> 1);
  //   dO (B of dP^T): matrix mi = head tile mi / kCpxH, chunk mi % kCpxH.
  const int hb = r8 + 8 * (mi / kCpxH);
  const uint32_t dob_addr = row_addr(DOs, hb, hb < G, mi % kCpxH);
  //   dO, Q (B of dV, dK; transposed): matrix mi = head tile mi % HT, chunk mi / HT.
  const int ht8 = r8 + 8 * (mi % HT);
  const uint32_t dot_addr = row_addr(DOs, ht8, ht8 < G, mi / HT);
  const uint32_t qt_addr = row_addr(Qs, ht8, ht8 < G, mi / HT);
  //   K (B of dQ; transposed): matrix mi = token tile mi % NT, chunk mi / NT.
  const int jk = r8 + 8 * (mi % NT);
  const uint32_t kt_addr = row_addr(Ks, jk, attends(jk), mi / NT);

  float ds[HT][4] = {};  // dP^T, then dS^T
  mma_rows_over_d<T, D, HT>(ds, v_addr, dob_addr);

  // delta_h = sum_j P_hj dP_hj (a column of dP^T: 2 rows per lane, 8 lanes), dS = P (dP - delta).
  float amax = 0.f;
#pragma unroll
  for (int ht = 0; ht < HT; ++ht)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float delta = pt[ht][e] * ds[ht][e] + pt[ht][2 + e] * ds[ht][2 + e];
      for (int o = 4; o < 32; o <<= 1) delta += __shfl_xor_sync(kFull, delta, o);
#pragma unroll
      for (int i = e; i < 4; i += 2) {
        ds[ht][i] = pt[ht][i] * (ds[ht][i] - delta);
        amax = fmaxf(amax, fabsf(ds[ht][i]));
      }
    }
  for (int o = 1; o < 32; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
  // 2^(127 - ex) and its inverse, both normal: ex is amax's biased exponent, clamped.
  const uint32_t ex = min(max((__float_as_uint(amax) >> 23) & 0xffu, 1u), 253u);
  const float ds_scale = __uint_as_float((254u - ex) << 23);
  const float out_scale = p.scale * __uint_as_float(ex << 23);

  // A fragments of P^T and dS^T (tokens x heads): [head tile][token half], hi and lo parts.
  uint32_t ph[HT][2], pl[HT][2], sh[HT][2], sl[HT][2];
#pragma unroll
  for (int ht = 0; ht < HT; ++ht)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      split2<T>(pt[ht][2 * r], pt[ht][2 * r + 1], &ph[ht][r], &pl[ht][r]);
      split2<T>(ds[ht][2 * r] * ds_scale, ds[ht][2 * r + 1] * ds_scale, &sh[ht][r], &sl[ht][r]);
    }
  // c += a b over the heads (b: this n-tile's HT B registers).
  auto mma_heads = [](float (&c)[4], const uint32_t (&a)[HT][2], const uint32_t* b) {
    if constexpr (HT == 2) {
      const uint32_t a4[4] = {a[0][0], a[0][1], a[1][0], a[1][1]};
      mma16816<T>(c, a4, b[0], b[1]);
    } else {
      mma1688<T>(c, a[0][0], a[0][1], b[0]);
    }
  };
  // Accumulator rows qr, qr + 8 (those below n_rows) to smem rows, column col.
  auto put = [&](T* rows, int n_rows, int col, const float (&c)[4], float s) {
    if (qr < n_rows)
      *reinterpret_cast<uint32_t*>(rows + qr * Geo::kRow + col) = Cvt<T>::pack2(c[0] * s, c[1] * s);
    if (qr + 8 < n_rows)
      *reinterpret_cast<uint32_t*>(rows + (qr + 8) * Geo::kRow + col) =
          Cvt<T>::pack2(c[2] * s, c[3] * s);
  };
  // dV = P^T dO, dK = dS^T Q: one ldmatrix.x4 (transposed) gives the B of kCpxH n-tiles.
  auto kv_grad = [&](uint32_t b_addr, const uint32_t (&hi)[HT][2], const uint32_t (&lo)[HT][2],
                     T* rows, float s) {
#pragma unroll 2
    for (int c0 = 0; c0 < Geo::kChunks; c0 += kCpxH) {
      uint32_t b[4];
      ldsm_x4_trans(b, b_addr + c0 * 16);
#pragma unroll
      for (int c = 0; c < kCpxH; ++c) {
        float acc[4] = {};
        mma_heads(acc, hi, b + HT * c);
        mma_heads(acc, lo, b + HT * c);
        put(rows, t.len, (c0 + c) * 8 + qc, acc, s);
      }
    }
  };

  __syncwarp();  // V is consumed: its rows take dV
  kv_grad(dot_addr, ph, pl, Vs, 1.f);
  __syncwarp();  // dO is consumed: its rows take dQ

  // dQ = dS K: A fragments (heads x tokens) [hi/lo][a-register], transposed 8x8 blocks of dS^T
  // (rows 8..15 are 0 for HT = 1; registers 2, 3 are unused for NT = 1).
  uint32_t qa[2][4] = {};
  auto transpose = [](const uint32_t (&x)[HT][2], uint32_t (&a)[4]) {
    a[0] = movmatrix_trans(x[0][0]);
    if constexpr (NT == 2) a[2] = movmatrix_trans(x[0][1]);
    if constexpr (HT == 2) {
      a[1] = movmatrix_trans(x[1][0]);
      if constexpr (NT == 2) a[3] = movmatrix_trans(x[1][1]);
    }
  };
  transpose(sh, qa[0]);
  transpose(sl, qa[1]);
#pragma unroll 2
  for (int c0 = 0; c0 < Geo::kChunks; c0 += kCpxT) {
    uint32_t b[4];
    ldsm_x4_trans(b, kt_addr + c0 * 16);
#pragma unroll
    for (int c = 0; c < kCpxT; ++c) {
      float acc[4] = {};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if constexpr (NT == 2)
          mma16816<T>(acc, qa[r], b[2 * c], b[2 * c + 1]);
        else
          mma1688<T>(acc, qa[r][0], qa[r][1], b[c]);
      }
      put(DOs, G, (c0 + c) * 8 + qc, acc, out_scale);
    }
  }
  __syncwarp();  // K is consumed: its rows take dK
  kv_grad(qt_addr, sh, sl, Ks, out_scale);
  __syncwarp();

  T* dq = static_cast<T*>(p.dq) + row0 * D;
  for (int i = lane; i < G * Geo::kChunks; i += 32)
    stg16(dq + static_cast<int64_t>(i) * 8,
          lds16(DOs + (i / Geo::kChunks) * Geo::kRow + (i % Geo::kChunks) * 8));
  store_kv_grads<T, D>(p, t, lane, Ks, Vs);
  zero_uncovered<T, D>(p, t, lane, next);
}

}  // namespace jaxcp::cuda::small_seq
