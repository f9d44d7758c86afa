// Device building blocks of the small-sequence kernels (private to ffi/cuda/small_seq/): the
// launch parameters, 16-bit conversions, cp.async / ldmatrix / mma.sync wrappers, the per-warp
// task, staging of its K/V tokens and rows into shared memory, and the writes of dK/dV.
//
// One warp per (row b, key/value head g). The warp stages the row's K and V tokens for head g,
// the G = Hq/Hkv query rows of the group (and, in the backward, dO and the saved probabilities)
// into its own slice of shared memory with 16-byte cp.async copies: every byte is read from
// global memory exactly once, all of a task's loads are in flight together, and the K/V tile is
// shared by all query heads of the GQA group. Shared-memory rows are padded by 16 bytes so lanes
// reading the same chunk of different rows (and the 8 row addresses of an ldmatrix) hit
// different banks.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/math_constants.h"
#include "cuda/vector_store.cuh"
#include "cutlass/fast_math.h"

namespace jaxcp::cuda::small_seq {

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
  cutlass::FastDivmod kv_heads_divmod;  // kv_heads, for task indices below 2^31
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

// The softmax's scale for exp2: scores * scale * log2(e).
__device__ __forceinline__ float exp2_scale(const Params& p) { return p.scale * kLog2e; }

// Row b's first token, clamped into [0, tokens]; without kv_start (the padded layout's default)
// b * max_len.
__device__ __forceinline__ int64_t row_start(const Params& p, int64_t b) {
  const int64_t start = p.kv_start != nullptr ? static_cast<int64_t>(p.kv_start[b]) : b * p.max_len;
  return min(max(start, int64_t{0}), p.tokens);
}

// Task w = (row b, key/value head g) with its clamped token range (a missing index array is its
// default: kv_len max_len, kv_mask every token); false (and an empty task) past the last one.
__device__ __forceinline__ bool task_at(const Params& p, int64_t w, Task* t) {
  if (w >= p.batch * p.kv_heads) {
    *t = Task{0, 0, 0, 0, 0u};
    return false;
  }
  if (w < 0x7fffffff && p.kv_heads < 0x7fffffff) {  // a multiply-high and a shift, not a division
    int b, g;
    p.kv_heads_divmod(b, g, static_cast<int>(w));
    t->b = b;
    t->g = g;
  } else {
    t->b = w / p.kv_heads;
    t->g = static_cast<int>(w - t->b * p.kv_heads);
  }
  t->start = row_start(p, t->b);
  const int len = p.kv_len != nullptr ? min(max(p.kv_len[t->b], 0), p.max_len) : p.max_len;
  t->len = static_cast<int>(min(static_cast<int64_t>(len), p.tokens - t->start));
  t->mask = p.kv_mask != nullptr ? static_cast<uint32_t>(p.kv_mask[t->b]) : 0xffffffffu;
  return true;
}

// The warp's task (one warp per task).
__device__ __forceinline__ bool task_of(const Params& p, Task* t) {
  return task_at(p, static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5), t);
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
  return t.b + 1 < p.batch ? row_start(p, t.b + 1) : p.tokens;
}

// Zeroes the dk/dv tokens no row covers: from the end of this row to `next` (next_start), and
// before the first row. `lane` of the `lanes` (a power of two, <= 32) that share the task.
template <typename T, int D>
__device__ __forceinline__ void zero_uncovered(const Params& p, const Task& t, int lane,
                                               int64_t next, int lanes = 32) {
  using Geo = Geometry<D>;
  T* dk = static_cast<T*>(p.dk);
  T* dv = static_cast<T*>(p.dv);
  const uint4 zero = make_uint4(0, 0, 0, 0);
  auto zero_tokens = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lane; i < (hi - lo) * Geo::kChunks; i += lanes) {
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

}  // namespace jaxcp::cuda::small_seq
