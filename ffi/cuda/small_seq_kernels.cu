// CUDA small-sequence attention (see small_seq_kernels.h): memory bound, one pass over Q, K, V.
//
// One warp per (row b, key/value head g). The warp stages the row's K and V tokens for head g,
// the G = Hq/Hkv query rows of the group (and, in the backward, dO and the saved probabilities)
// into its own slice of shared memory with 16-byte cp.async copies: every byte is read from
// global memory exactly once, all of a task's loads are in flight together, and the K/V tile is
// shared by all query heads of the GQA group.
//
// Forward and backward (default): tensor cores (mma.sync) from shared memory, see
// small_seq_fwd_mma_kernel and small_seq_bwd_mma_kernel.
// Forward v1 (JAXCP_SMALL_SEQ_FWD_V1=1), backward v1 (JAXCP_SMALL_SEQ_BWD_V1=1, and groups of
// more than 16 heads): float32 math on the CUDA cores:
//   scores : lane = (d-split, head, token); partial dot products reduced with shuffles, then a
//            softmax over the token lanes; probabilities written once (to global and smem).
//   P @ V  : lane = (token-split, head, 16-byte chunk of D); reduced over the token split.
//   dK, dV : lane = (token, chunk); sums over the G heads of the group, written once.
// Shared-memory rows are padded by 16 bytes so lanes reading the same chunk of different rows
// (and the 8 row addresses of an ldmatrix) hit different banks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../common/env_flag.h"
#include "small_seq_kernels.h"
#include "vector_store.cuh"

namespace jaxcp::cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxLen = 16;
constexpr int kMaxWarpsPerBlock = 8;
constexpr size_t kDefaultSmemBytes = 48 * 1024;

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const float* probs;  // bwd input
  const void* dout;    // bwd input
  const int32_t* kv_start;
  const int32_t* kv_len;
  const int32_t* kv_mask;
  void* out;           // fwd output
  float* probs_out;    // fwd output
  void* dq;
  void* dk;
  void* dv;
  int64_t batch, q_heads, kv_heads, tokens;
  int group, max_len;
  int warp_smem;  // bytes of shared memory per warp
  float scale;
};

// ---------------------------------------------------------------- element conversions

template <typename T>
struct Cvt;

template <>
struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ void unpack(const uint4& u, float* f) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  static __device__ __forceinline__ uint32_t pack2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ float2 unpack2(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
};

template <>
struct Cvt<__half> {
  static __device__ __forceinline__ void unpack(const uint4& u, float* f) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
  static __device__ __forceinline__ uint32_t pack2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ float2 unpack2(uint32_t w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
};

template <typename T>
__device__ __forceinline__ uint4 pack8(const float* f, float s) {
  uint4 u;
  u.x = Cvt<T>::pack2(f[0] * s, f[1] * s);
  u.y = Cvt<T>::pack2(f[2] * s, f[3] * s);
  u.z = Cvt<T>::pack2(f[4] * s, f[5] * s);
  u.w = Cvt<T>::pack2(f[6] * s, f[7] * s);
  return u;
}

template <typename T>
__device__ __forceinline__ uint4 lds16(const T* p) {
  return *reinterpret_cast<const uint4*>(p);
}

template <typename T>
__device__ __forceinline__ void stg16(T* p, const uint4& u) {
  stg_128(p, u);  // through a uint4 pointer, pack8's results left as four 4-byte stores
}

// ---------------------------------------------------------------- cp.async (sm_80+)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// ---------------------------------------------------------------- ldmatrix / mma.sync (sm_80+)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a b: m16n8k16, A row-major 16x16, B col-major 16x8, float32 accumulators.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc[n] += A B_n^T over the D columns of shared-memory rows: A is 16 rows at a_addr, B is NB
// tiles of 8 rows at b_addr (ldmatrix.x4 addresses per lane: A = 2 row halves x 2 chunks of a
// 16-column step, B = NB tiles x 4 / NB chunks).
template <typename T, int D, int NB>
__device__ __forceinline__ void mma_rows_over_d(float (&acc)[NB][4], uint32_t a_addr, uint32_t b_addr) {
#pragma unroll 4
  for (int ks = 0; ks < D / 16; ks += 2 / NB) {
    uint32_t b[4], a[4];
    ldsm_x4(b, b_addr + ks * 32);
    ldsm_x4(a, a_addr + ks * 32);
    mma16816<T>(acc[0], a, b[0], b[1]);
    if constexpr (NB == 2) {
      mma16816<T>(acc[1], a, b[2], b[3]);
    } else {
      ldsm_x4(a, a_addr + (ks + 1) * 32);
      mma16816<T>(acc[0], a, b[2], b[3]);
    }
  }
}

// c += a b: m16n8k8.
template <typename T>
__device__ __forceinline__ void mma1688(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
  else
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

// The transpose of an 8x8 16-bit matrix held in the accumulator / A-fragment layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// (a, b) as packed 16-bit hi + lo with hi + lo = (a, b) to about 16 significant bits.
template <typename T>
__device__ __forceinline__ void split2(float a, float b, uint32_t* hi, uint32_t* lo) {
  *hi = Cvt<T>::pack2(a, b);
  const float2 h = Cvt<T>::unpack2(*hi);
  *lo = Cvt<T>::pack2(a - h.x, b - h.y);
}

__device__ __forceinline__ int pow2_ceil(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

// ---------------------------------------------------------------- per-warp task setup

template <int D>
struct Geometry {
  static constexpr int kChunks = D / 8;                        // 16-byte chunks per row
  static constexpr int kRow = D + 8;                           // padded smem row (elements)
  static constexpr int kChunkLanes = kChunks < 32 ? kChunks : 32;
  static constexpr int kChunksPerLane = kChunks / kChunkLanes;  // 2 for D = 512
};

struct Task {
  int64_t b, start;
  int g, len;
  uint32_t mask;
};

__device__ __forceinline__ bool task_of(const Params& p, Task* t) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (w >= p.batch * p.kv_heads) return false;
  t->b = w / p.kv_heads;
  t->g = static_cast<int>(w - t->b * p.kv_heads);
  t->start = min(max(static_cast<int64_t>(p.kv_start[t->b]), int64_t{0}), p.tokens);
  const int len = min(max(p.kv_len[t->b], 0), p.max_len);
  t->len = static_cast<int>(min(static_cast<int64_t>(len), p.tokens - t->start));
  t->mask = static_cast<uint32_t>(p.kv_mask[t->b]);
  return true;
}

__device__ __forceinline__ bool allowed(uint32_t mask, int j) { return (mask >> j) & 1u; }

// Stages the allowed K/V tokens of the task and `n_rows` contiguous [D] rows of `rows_a`
// (and of `rows_b` when given) into padded smem rows.
template <typename T, int D>
__device__ __forceinline__ void stage(const Params& p, const Task& t, int lane, T* Ks, T* Vs,
                                      const T* rows_a, T* As, const T* rows_b, T* Bs,
                                      int n_rows) {
  using Geo = Geometry<D>;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  for (int i = lane; i < t.len * Geo::kChunks; i += 32) {
    const int j = i / Geo::kChunks, c = i % Geo::kChunks;
    if (!allowed(t.mask, j)) continue;
    const int64_t off = ((t.start + j) * p.kv_heads + t.g) * D + c * 8;
    cp_async16(Ks + j * Geo::kRow + c * 8, k + off);
    cp_async16(Vs + j * Geo::kRow + c * 8, v + off);
  }
  for (int i = lane; i < n_rows * Geo::kChunks; i += 32) {
    const int r = i / Geo::kChunks, c = i % Geo::kChunks;
    cp_async16(As + r * Geo::kRow + c * 8, rows_a + static_cast<int64_t>(i) * 8);
    if (rows_b != nullptr) cp_async16(Bs + r * Geo::kRow + c * 8, rows_b + static_cast<int64_t>(i) * 8);
  }
}

// Staging for the tensor-core kernels: the task's allowed K/V tokens and `n_rows` contiguous [D]
// rows of `rows_a` (and of `rows_b` when given). A lane keeps one chunk column and steps its
// pointers from token to token: with the math on tensor cores, the per-chunk index arithmetic of
// stage() (~35 instructions per K/V chunk pair) was most of a task's work.
template <typename T, int D>
__device__ __forceinline__ void stage_lean(const Params& p, const Task& t, int lane, T* Ks, T* Vs,
                                           int n_rows, const T* rows_a, T* As,
                                           const T* rows_b = nullptr, T* Bs = nullptr) {
  using Geo = Geometry<D>;
  constexpr int kLanes = Geo::kChunkLanes, kTokensPerPass = 32 / kLanes;
  const int j0 = lane / kLanes, col = (lane % kLanes) * 8;
  const int64_t step = static_cast<int64_t>(kTokensPerPass) * p.kv_heads * D;
  const int64_t off = ((t.start + j0) * p.kv_heads + t.g) * D + col;
  const T* kp = static_cast<const T*>(p.k) + off;
  const T* vp = static_cast<const T*>(p.v) + off;
  for (int j = j0; j < t.len; j += kTokensPerPass, kp += step, vp += step) {
    if (!allowed(t.mask, j)) continue;
#pragma unroll
    for (int cc = 0; cc < Geo::kChunksPerLane; ++cc) {
      const int e = j * Geo::kRow + col + cc * kLanes * 8;
      cp_async16(Ks + e, kp + cc * kLanes * 8);
      cp_async16(Vs + e, vp + cc * kLanes * 8);
    }
  }
  for (int i = lane; i < n_rows * Geo::kChunks; i += 32) {
    const int e = (i / Geo::kChunks) * Geo::kRow + (i % Geo::kChunks) * 8;
    cp_async16(As + e, rows_a + static_cast<int64_t>(i) * 8);
    if (rows_b != nullptr) cp_async16(Bs + e, rows_b + static_cast<int64_t>(i) * 8);
  }
}

// Writes the task's dK/dV tokens j < len from smem rows (the lane layout of stage_lean).
template <typename T, int D>
__device__ __forceinline__ void store_kv_grads(const Params& p, const Task& t, int lane,
                                               const T* dKs, const T* dVs) {
  using Geo = Geometry<D>;
  constexpr int kLanes = Geo::kChunkLanes, kTokensPerPass = 32 / kLanes;
  const int j0 = lane / kLanes, col = (lane % kLanes) * 8;
  const int64_t step = static_cast<int64_t>(kTokensPerPass) * p.kv_heads * D;
  const int64_t off = ((t.start + j0) * p.kv_heads + t.g) * D + col;
  T* kp = static_cast<T*>(p.dk) + off;
  T* vp = static_cast<T*>(p.dv) + off;
  for (int j = j0; j < t.len; j += kTokensPerPass, kp += step, vp += step) {
#pragma unroll
    for (int cc = 0; cc < Geo::kChunksPerLane; ++cc) {
      const int e = j * Geo::kRow + col + cc * kLanes * 8;
      stg16(kp + cc * kLanes * 8, lds16(dKs + e));
      stg16(vp + cc * kLanes * 8, lds16(dVs + e));
    }
  }
}

// The next row's clamped start (the end of the buffer for the last row).
__device__ __forceinline__ int64_t next_start(const Params& p, const Task& t) {
  return t.b + 1 < p.batch
             ? min(max(static_cast<int64_t>(p.kv_start[t.b + 1]), int64_t{0}), p.tokens)
             : p.tokens;
}

// Zeroes the dk/dv tokens no row covers: from the end of this row to `next` (next_start), and
// before the first row.
template <typename T, int D>
__device__ __forceinline__ void zero_uncovered(const Params& p, const Task& t, int lane,
                                               int64_t next) {
  using Geo = Geometry<D>;
  T* dk = static_cast<T*>(p.dk);
  T* dv = static_cast<T*>(p.dv);
  const uint4 zero = make_uint4(0, 0, 0, 0);
  auto zero_tokens = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lane; i < (hi - lo) * Geo::kChunks; i += 32) {
      const int64_t tok = lo + i / Geo::kChunks;
      const int c = static_cast<int>(i % Geo::kChunks);
      const int64_t off = (tok * p.kv_heads + t.g) * D + c * 8;
      stg16(dk + off, zero);
      stg16(dv + off, zero);
    }
  };
  if (next > t.start + t.len) zero_tokens(t.start + t.len, next);
  if (t.b == 0 && t.start > 0) zero_tokens(0, t.start);
}

// dot(a_row, b_row) over this lane's share of the chunks (chunk c = split + n * splits).
template <typename T, int D>
__device__ __forceinline__ float partial_dot(const T* a, const T* b, int split, int splits) {
  float acc = 0.f;
#pragma unroll 4
  for (int c = split; c < Geometry<D>::kChunks; c += splits) {
    float af[8], bf[8];
    Cvt<T>::unpack(lds16(a + c * 8), af);
    Cvt<T>::unpack(lds16(b + c * 8), bf);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(af[e], bf[e], acc);
  }
  return acc;
}

// Lane layout of the score phase: lane = (d-split, head, token), token fastest.
struct ScoreLanes {
  int tl, hpp, ds_count, j, hs, ds;
  __device__ ScoreLanes(int lane, int max_len, int group) {
    tl = pow2_ceil(max(max_len, 1));
    hpp = min(pow2_ceil(group), 32 / tl);
    ds_count = 32 / (tl * hpp);
    j = lane & (tl - 1);
    hs = (lane / tl) & (hpp - 1);
    ds = lane / (tl * hpp);
  }
};

// Lane layout of the "sum over tokens of weight * row" phases: lane = (token split, head, chunk).
template <int D>
struct RowLanes {
  int hpv, ts_count, c0, hv, ts;
  __device__ RowLanes(int lane, int group) {
    constexpr int cl = Geometry<D>::kChunkLanes;
    hpv = min(pow2_ceil(group), 32 / cl);
    ts_count = 32 / (cl * hpv);
    c0 = lane % cl;
    hv = (lane / cl) & (hpv - 1);
    ts = lane / (cl * hpv);
  }
};

// out_h = scale * sum_j w[h][j] * rows[j] for the group's heads, written to dst [G, D] rows.
template <typename T, int D>
__device__ __forceinline__ void weighted_rows(const Task& t, int lane, int group, int max_len,
                                              const float* W, const T* Rs, T* dst, float scale) {
  using Geo = Geometry<D>;
  const RowLanes<D> L(lane, group);
  for (int h0 = 0; h0 < group; h0 += L.hpv) {
    const int h = h0 + L.hv;
    float acc[Geo::kChunksPerLane][8];
#pragma unroll
    for (int cc = 0; cc < Geo::kChunksPerLane; ++cc)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[cc][e] = 0.f;
    if (h < group) {
      for (int j = L.ts; j < t.len; j += L.ts_count) {
        if (!allowed(t.mask, j)) continue;
        const float w = W[h * max_len + j];
#pragma unroll
        for (int cc = 0; cc < Geo::kChunksPerLane; ++cc) {
          float f[8];
          Cvt<T>::unpack(lds16(Rs + j * Geo::kRow + (L.c0 + cc * Geo::kChunkLanes) * 8), f);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[cc][e] = fmaf(w, f[e], acc[cc][e]);
        }
      }
    }
    for (int o = Geo::kChunkLanes * L.hpv; o < 32; o <<= 1)
#pragma unroll
      for (int cc = 0; cc < Geo::kChunksPerLane; ++cc)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[cc][e] += __shfl_xor_sync(kFull, acc[cc][e], o);
    if (L.ts == 0 && h < group) {
#pragma unroll
      for (int cc = 0; cc < Geo::kChunksPerLane; ++cc)
        stg16(dst + static_cast<int64_t>(h) * D + (L.c0 + cc * Geo::kChunkLanes) * 8,
              pack8<T>(acc[cc], scale));
    }
  }
}

// ---------------------------------------------------------------- forward

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
  const float scale_log2 = p.scale * 1.4426950408889634f;
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
  const float scale_log2 = p.scale * 1.4426950408889634f;
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
#pragma unroll 2
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

// ---------------------------------------------------------------- backward

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

// ---------------------------------------------------------------- host side

size_t round16(size_t x) { return (x + 15) & ~size_t{15}; }

enum class Pass { kFwdV1, kFwd, kBwdV1, kBwd };

size_t row_bytes(const SmallSeqArgs& a) { return static_cast<size_t>(a.head_dim + 8) * 2; }

size_t warp_smem_bytes(const SmallSeqArgs& a, Pass pass) {
  const size_t row = row_bytes(a);  // padded 16-bit row
  const size_t g = static_cast<size_t>(a.q_heads / a.kv_heads);
  const size_t ml = static_cast<size_t>(a.max_len);
  const size_t probs = round16(g * ml * 4);
  size_t bytes = 2 * ml * row + g * row;  // K, V, Q
  if (pass == Pass::kFwdV1) bytes += probs;
  if (pass == Pass::kBwdV1) bytes += g * row + 2 * probs;  // dO, P, dS
  if (pass == Pass::kBwd) bytes += g * row + probs;         // dO, P
  return round16(bytes);
}

struct BlockShape {
  int warps;
  size_t smem;  // dynamic shared memory of a block
};

// As many warps as fit in the default 48 KB (at least one).
BlockShape default_shape(size_t per_warp) {
  const int warps = static_cast<int>(std::clamp<size_t>(kDefaultSmemBytes / per_warp, 1,
                                                        kMaxWarpsPerBlock));
  return {warps, per_warp * warps};
}

// The warps per block (each needing per_warp bytes, plus `shared` bytes per block) that keep the
// most warps resident per multiprocessor. Filling 48 KB per block can waste much of an SM's
// shared memory: 4 GQA slices of 10 KB make 5 blocks, 20 warps; 2 per block make 22.
cudaError_t occupancy_shape(size_t per_warp, size_t shared, BlockShape* shape) {
  int device = 0, sm = 0, reserved = 0, optin = 0, max_blocks = 0, max_threads = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  for (auto [value, attr] : {std::pair{&sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor},
                             std::pair{&reserved, cudaDevAttrReservedSharedMemoryPerBlock},
                             std::pair{&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin},
                             std::pair{&max_blocks, cudaDevAttrMaxBlocksPerMultiprocessor},
                             std::pair{&max_threads, cudaDevAttrMaxThreadsPerMultiProcessor}})
    if (cudaError_t e = cudaDeviceGetAttribute(value, attr, device); e != cudaSuccess) return e;
  *shape = {1, per_warp + shared};
  size_t best = 0;
  for (int w = 1; w <= kMaxWarpsPerBlock; ++w) {
    const size_t smem = per_warp * w + shared;
    if (smem > static_cast<size_t>(optin)) break;
    const size_t blocks = std::min<size_t>(sm / (smem + reserved), max_blocks);
    const size_t resident = std::min<size_t>(blocks * w, max_threads / 32);
    if (resident > best) {  // ties: the smaller block (less waiting for its slowest warp)
      best = resident;
      *shape = {w, smem};
    }
  }
  return cudaSuccess;
}

template <typename Kernel>
cudaError_t launch(Kernel kernel, const SmallSeqArgs& a, BlockShape shape, size_t per_warp,
                   Params p, cudaStream_t stream) {
  const int64_t tasks = a.batch * a.kv_heads;
  if (tasks == 0) return cudaSuccess;
  if (shape.smem > kDefaultSmemBytes) {  // large GQA groups at D = 512, some forward shapes
    int device = 0, optin = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    if (cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                               device);
        e != cudaSuccess)
      return e;
    if (shape.smem > static_cast<size_t>(optin)) return cudaErrorInvalidValue;
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(shape.smem));
        e != cudaSuccess)
      return e;
  }
  const int64_t blocks = (tasks + shape.warps - 1) / shape.warps;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  p.warp_smem = static_cast<int>(per_warp);
  kernel<<<static_cast<unsigned>(blocks), shape.warps * 32, shape.smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename Kernel>
cudaError_t launch_default(Kernel kernel, const SmallSeqArgs& a, Pass pass, const Params& p,
                           cudaStream_t stream) {
  const size_t per_warp = warp_smem_bytes(a, pass);
  return launch(kernel, a, default_shape(per_warp), per_warp, p, stream);
}

bool valid_args(const SmallSeqArgs& a) {
  return a.batch >= 0 && a.kv_heads > 0 && a.q_heads % a.kv_heads == 0 && a.tokens >= 0 &&
         a.max_len >= 0 && a.max_len <= kMaxLen && small_seq_head_dim_supported(a.head_dim);
}

Params make_params(const SmallSeqArgs& a) {
  Params p{};
  p.batch = a.batch;
  p.q_heads = a.q_heads;
  p.kv_heads = a.kv_heads;
  p.tokens = a.tokens;
  p.group = static_cast<int>(a.q_heads / a.kv_heads);
  p.max_len = static_cast<int>(a.max_len);
  p.scale = a.scale;
  return p;
}

// JAXCP_SMALL_SEQ_FWD_V1 / JAXCP_SMALL_SEQ_BWD_V1 (env_flag) select the CUDA-core forward /
// backward, for A/B runs.
template <typename T, int D>
cudaError_t fwd_typed(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  if (env_flag("JAXCP_SMALL_SEQ_FWD_V1"))
    return launch_default(small_seq_fwd_kernel<T, D>, a, Pass::kFwdV1, p, s);
  const size_t per_warp = warp_smem_bytes(a, Pass::kFwd);
  BlockShape shape;
  if (cudaError_t e = occupancy_shape(per_warp, row_bytes(a), &shape); e != cudaSuccess) return e;
  if (a.max_len <= 8) return launch(small_seq_fwd_mma_kernel<T, D, 1>, a, shape, per_warp, p, s);
  return launch(small_seq_fwd_mma_kernel<T, D, 2>, a, shape, per_warp, p, s);
}

template <typename T, int D>
cudaError_t bwd_typed(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  // The tensor-core backward keeps the dS of at most 16 heads in registers.
  if (env_flag("JAXCP_SMALL_SEQ_BWD_V1") || p.group > 16)
    return launch_default(small_seq_bwd_kernel<T, D>, a, Pass::kBwdV1, p, s);
  const size_t per_warp = warp_smem_bytes(a, Pass::kBwd);
  BlockShape shape;
  if (cudaError_t e = occupancy_shape(per_warp, row_bytes(a), &shape); e != cudaSuccess) return e;
  const bool one_token_tile = a.max_len <= 8;
  if (p.group <= 8)
    return one_token_tile ? launch(small_seq_bwd_mma_kernel<T, D, 1, 1>, a, shape, per_warp, p, s)
                          : launch(small_seq_bwd_mma_kernel<T, D, 1, 2>, a, shape, per_warp, p, s);
  return one_token_tile ? launch(small_seq_bwd_mma_kernel<T, D, 2, 1>, a, shape, per_warp, p, s)
                        : launch(small_seq_bwd_mma_kernel<T, D, 2, 2>, a, shape, per_warp, p, s);
}

template <typename T>
cudaError_t dispatch_fwd(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  switch (a.head_dim) {
    case 64: return fwd_typed<T, 64>(a, p, s);
    case 128: return fwd_typed<T, 128>(a, p, s);
    case 256: return fwd_typed<T, 256>(a, p, s);
    case 512: return fwd_typed<T, 512>(a, p, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t dispatch_bwd(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  switch (a.head_dim) {
    case 64: return bwd_typed<T, 64>(a, p, s);
    case 128: return bwd_typed<T, 128>(a, p, s);
    case 256: return bwd_typed<T, 256>(a, p, s);
    case 512: return bwd_typed<T, 512>(a, p, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool small_seq_head_dim_supported(int64_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256 || head_dim == 512;
}

cudaError_t small_seq_fwd(const SmallSeqArgs& args, SmallSeqDType dtype, const void* q,
                          const void* k, const void* v, const int32_t* kv_start,
                          const int32_t* kv_len, const int32_t* kv_mask, void* out, float* probs,
                          cudaStream_t stream) {
  if (!valid_args(args)) return cudaErrorInvalidValue;
  Params p = make_params(args);
  p.q = q;
  p.k = k;
  p.v = v;
  p.kv_start = kv_start;
  p.kv_len = kv_len;
  p.kv_mask = kv_mask;
  p.out = out;
  p.probs_out = probs;
  return dtype == SmallSeqDType::kBF16 ? dispatch_fwd<__nv_bfloat16>(args, p, stream)
                                       : dispatch_fwd<__half>(args, p, stream);
}

cudaError_t small_seq_bwd(const SmallSeqArgs& args, SmallSeqDType dtype, const void* q,
                          const void* k, const void* v, const float* probs, const void* dout,
                          const int32_t* kv_start, const int32_t* kv_len, const int32_t* kv_mask,
                          void* dq, void* dk, void* dv, cudaStream_t stream) {
  if (!valid_args(args)) return cudaErrorInvalidValue;
  if (args.batch == 0 || args.max_len == 0) {  // nothing attends: every gradient is zero
    const size_t kv_bytes = static_cast<size_t>(args.tokens * args.kv_heads * args.head_dim) * 2;
    const size_t q_bytes = static_cast<size_t>(args.batch * args.q_heads * args.head_dim) * 2;
    cudaError_t e = cudaMemsetAsync(dk, 0, kv_bytes, stream);
    if (e == cudaSuccess) e = cudaMemsetAsync(dv, 0, kv_bytes, stream);
    if (e == cudaSuccess && q_bytes) e = cudaMemsetAsync(dq, 0, q_bytes, stream);
    return e;
  }
  Params p = make_params(args);
  p.q = q;
  p.k = k;
  p.v = v;
  p.probs = probs;
  p.dout = dout;
  p.kv_start = kv_start;
  p.kv_len = kv_len;
  p.kv_mask = kv_mask;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  return dtype == SmallSeqDType::kBF16 ? dispatch_bwd<__nv_bfloat16>(args, p, stream)
                                       : dispatch_bwd<__half>(args, p, stream);
}

}  // namespace jaxcp::cuda
