// CUDA small-sequence attention (see small_seq_kernels.h): memory bound, one pass over Q, K, V.
//
// Work unit ("task"): one (row b, key/value head g) pair; it reads the row's K and V tokens of
// head g once and serves the G = Hq/Hkv query heads of the group from them.
//
// Why the kernel is built the way it is (everything here is about keeping bytes in flight):
// - Persistent warps. Each warp walks the tasks w, w + W, w + 2W, ... (W = warps in the grid,
//   sized to the resident warps), so there is no tail of partly-filled waves and no per-task
//   launch/setup latency.
// - A per-warp ring buffer in shared memory. Tasks are staged into it with 16-byte cp.async
//   copies (one commit group per task), up to kMaxInFlight tasks ahead of the one being
//   computed, packed by their actual length (a ragged row of 5 tokens takes 5 rows, not 16).
//   While the warp computes task i, the copies of tasks i+1.. are in flight, so the loads of a
//   warp never stop for its compute, and the in-flight bytes per SM are set by the ring size
//   (the host picks warps per SM and ring rows for about 80 KB in flight per SM).
// - Row metadata (start, length, mask) is loaded 32 tasks at a time, one task per lane, a
//   window ahead, and broadcast with shuffles: no dependent global load before a task's copies.
// - Masked tokens are zero-filled by the copy (src-size 0), so later phases need no mask test
//   and never touch garbage.
// - Compute amortises the bf16/f16 unpacking over the query heads of a group: the G query (and
//   dO) rows are converted once per task into float32 shared memory; each K/V chunk is unpacked
//   once and used for HB heads (HB = 4, 2 or 1, a compile-time head block dividing G).
//   All arithmetic is float32:
//   scores : lane = (d-split, token); dot products over the lane's chunks for HB heads, reduced
//            with shuffles, softmax over the token lanes; probabilities written once.
//   P @ V  : lane = (token split, 16-byte chunk of D); HB heads per pass; reduced over the split.
//   dK, dV : lane = (token, chunk); sums over the G heads of the group, written once.
// Shared-memory rows are padded by 16 bytes and float rows are stored as two halves
// ([h][half][chunk][4]) so lanes reading the same chunk of different rows, or consecutive
// chunks, hit different banks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "small_seq_kernels.h"

namespace jaxcp::cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxLen = 16;
constexpr int kMaxInFlight = 4;      // staged tasks per warp (cp.async groups), computing one included
constexpr int kWarpsPerBlock = 2;    // blocks are small so the host can size warps per SM finely
constexpr int kMaxWarpsPerSm = 16;
constexpr int kMinBlocksPerSm = 8;   // launch bounds: <= 128 registers per thread
constexpr size_t kTargetInFlightBytes = 80 * 1024;  // per SM

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
  int warp_smem;   // bytes of shared memory per warp
  int ring_rows;   // rows of (D + 8) elements in the warp's ring
  int work_offset; // byte offset of the float work area in the warp's slice
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
  *reinterpret_cast<uint4*>(p) = u;
}

// ---------------------------------------------------------------- cp.async (sm_80+)

// 16-byte copy; src_bytes = 0 zero-fills the destination without reading the source.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes = 16) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most `newer` of this thread's most recent commit groups are pending.
__device__ __forceinline__ void cp_async_wait_newer(int newer) {
  static_assert(kMaxInFlight == 4, "update the cases below");
  switch (newer) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
  }
}

__device__ __forceinline__ int pow2_ceil(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

__device__ __forceinline__ bool allowed(uint32_t mask, int j) { return (mask >> j) & 1u; }

// ---------------------------------------------------------------- geometry

template <int D>
struct Geometry {
  static constexpr int kChunks = D / 8;                         // 16-byte chunks per row
  static constexpr int kRow = D + 8;                            // padded smem row (elements)
  static constexpr int kChunkLanes = kChunks < 32 ? kChunks : 32;
  static constexpr int kChunksPerLane = kChunks / kChunkLanes;  // 2 for D = 512
  static constexpr int kSplits = 32 / kChunkLanes;              // lanes sharing a chunk
};

// Float rows [h][D] are stored as [h][half][chunk][4]: chunk c's elements 0-3 at c * 4,
// elements 4-7 at D / 2 + c * 4 (16-byte accesses of consecutive chunks are conflict-free).
template <int D>
__device__ __forceinline__ void load_f8(const float* rows, int h, int c, float* f) {
  const float4 lo = *reinterpret_cast<const float4*>(rows + h * D + c * 4);
  const float4 hi = *reinterpret_cast<const float4*>(rows + h * D + D / 2 + c * 4);
  f[0] = lo.x; f[1] = lo.y; f[2] = lo.z; f[3] = lo.w;
  f[4] = hi.x; f[5] = hi.y; f[6] = hi.z; f[7] = hi.w;
}

// Converts `n_rows` padded 16-bit smem rows into float rows (layout above).
template <typename T, int D>
__device__ __forceinline__ void to_float_rows(const T* src, float* dst, int n_rows, int lane) {
  using Geo = Geometry<D>;
  for (int i = lane; i < n_rows * Geo::kChunks; i += 32) {
    const int r = i / Geo::kChunks, c = i % Geo::kChunks;
    float f[8];
    Cvt<T>::unpack(lds16(src + r * Geo::kRow + c * 8), f);
    *reinterpret_cast<float4*>(dst + r * D + c * 4) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4*>(dst + r * D + D / 2 + c * 4) = make_float4(f[4], f[5], f[6], f[7]);
  }
}

// ---------------------------------------------------------------- task metadata

// Metadata of 32 consecutive tasks of a warp, one per lane (clamped as the header says).
struct Window {
  int64_t b, start, next;
  int g, len, mask;
};

__device__ __forceinline__ Window load_window(const Params& p, int64_t wid, int64_t nwarps,
                                              int64_t kbase, int lane, bool need_next) {
  Window m{0, 0, 0, 0, 0, 0};
  const int64_t task = wid + (kbase + lane) * nwarps;
  if (task < p.batch * p.kv_heads) {
    m.b = task / p.kv_heads;
    m.g = static_cast<int>(task - m.b * p.kv_heads);
    m.start = min(max(static_cast<int64_t>(p.kv_start[m.b]), int64_t{0}), p.tokens);
    const int len = min(max(p.kv_len[m.b], 0), p.max_len);
    m.len = static_cast<int>(min(static_cast<int64_t>(len), p.tokens - m.start));
    m.mask = p.kv_mask[m.b];
    if (need_next)
      m.next = m.b + 1 < p.batch
                   ? min(max(static_cast<int64_t>(p.kv_start[m.b + 1]), int64_t{0}), p.tokens)
                   : p.tokens;
  }
  return m;
}

// The metadata of task `off` (0..63) of the two windows [cur | nxt], on every lane.
__device__ __forceinline__ Window window_get(const Window& cur, const Window& nxt, int off) {
  const bool c = off < 32;
  const int src = off & 31;
  Window m;
  m.b = __shfl_sync(kFull, c ? cur.b : nxt.b, src);
  m.start = __shfl_sync(kFull, c ? cur.start : nxt.start, src);
  m.next = __shfl_sync(kFull, c ? cur.next : nxt.next, src);
  m.g = __shfl_sync(kFull, c ? cur.g : nxt.g, src);
  m.len = __shfl_sync(kFull, c ? cur.len : nxt.len, src);
  m.mask = __shfl_sync(kFull, c ? cur.mask : nxt.mask, src);
  return m;
}

// ---------------------------------------------------------------- staging

// Rows of a task in the ring, from its first row: K [len], V [len], Q [G]; backward also
// dO [G] and the saved probabilities (float [G * max_len], p_rows rows).
template <typename T, int D, bool kBwd>
__device__ __forceinline__ void stage_task(const Params& p, const Window& m, T* base, int lane) {
  using Geo = Geometry<D>;
  const int G = p.group;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int64_t tok_stride = p.kv_heads * D;
  const int64_t kv0 = (m.start * p.kv_heads + m.g) * D;
  T* Ks = base;
  T* Vs = Ks + m.len * Geo::kRow;
  T* Qs = Vs + m.len * Geo::kRow;
  const uint32_t mask = static_cast<uint32_t>(m.mask);
  for (int i = lane; i < m.len * Geo::kChunks; i += 32) {
    const int j = i / Geo::kChunks, c = i % Geo::kChunks;
    const int64_t off = kv0 + j * tok_stride + c * 8;
    const int bytes = allowed(mask, j) ? 16 : 0;  // masked token: zeros
    cp_async16(Ks + j * Geo::kRow + c * 8, k + off, bytes);
    cp_async16(Vs + j * Geo::kRow + c * 8, v + off, bytes);
  }
  const int64_t row0 = m.b * p.q_heads + static_cast<int64_t>(m.g) * G;
  const T* q = static_cast<const T*>(p.q) + row0 * D;
  for (int i = lane; i < G * Geo::kChunks; i += 32) {
    const int r = i / Geo::kChunks, c = i % Geo::kChunks;
    cp_async16(Qs + r * Geo::kRow + c * 8, q + static_cast<int64_t>(i) * 8);
  }
  if constexpr (kBwd) {
    T* DOs = Qs + G * Geo::kRow;
    float* Ps = reinterpret_cast<float*>(DOs + G * Geo::kRow);
    const T* dout = static_cast<const T*>(p.dout) + row0 * D;
    for (int i = lane; i < G * Geo::kChunks; i += 32) {
      const int r = i / Geo::kChunks, c = i % Geo::kChunks;
      cp_async16(DOs + r * Geo::kRow + c * 8, dout + static_cast<int64_t>(i) * 8);
    }
    const float* probs = p.probs + row0 * p.max_len;
    for (int i = lane; i < G * p.max_len; i += 32) cp_async4(Ps + i, probs + i);
  }
  cp_async_commit();
}

template <int D, bool kBwd>
__device__ __forceinline__ int task_rows(int len, int group, int max_len) {
  constexpr int row_bytes = (D + 8) * 2;
  int rows = 2 * len + group;
  if (kBwd) rows += group + (group * max_len * 4 + row_bytes - 1) / row_bytes;
  return rows;
}

// ---------------------------------------------------------------- compute phases

// Lane layout of the score phase: lane = (d-split, token), token fastest.
struct ScoreLanes {
  int tl, ds_count, j, ds;
  __device__ ScoreLanes(int lane, int max_len) {
    tl = pow2_ceil(max(max_len, 1));
    ds_count = 32 / tl;
    j = lane & (tl - 1);
    ds = lane / tl;
  }
};

// acc[hb] = dot(Af[h0 + hb], Bs[j]) over all of D, on every lane of token j (zero if !valid).
template <typename T, int D, int HB>
__device__ __forceinline__ void score_dots(const ScoreLanes& S, bool valid, const float* Af,
                                           int h0, const T* Bs, float* acc) {
  using Geo = Geometry<D>;
#pragma unroll
  for (int hb = 0; hb < HB; ++hb) acc[hb] = 0.f;
  if (valid) {
    const T* brow = Bs + S.j * Geo::kRow;
#pragma unroll 2
    for (int c = S.ds; c < Geo::kChunks; c += S.ds_count) {
      float bf[8];
      Cvt<T>::unpack(lds16(brow + c * 8), bf);
#pragma unroll
      for (int hb = 0; hb < HB; ++hb) {
        float af[8];
        load_f8<D>(Af, h0 + hb, c, af);
        float t0 = af[0] * bf[0], t1 = af[1] * bf[1];
#pragma unroll
        for (int e = 2; e < 8; e += 2) {
          t0 = fmaf(af[e], bf[e], t0);
          t1 = fmaf(af[e + 1], bf[e + 1], t1);
        }
        acc[hb] += t0 + t1;
      }
    }
  }
  for (int o = S.tl; o < 32; o <<= 1)
#pragma unroll
    for (int hb = 0; hb < HB; ++hb) acc[hb] += __shfl_xor_sync(kFull, acc[hb], o);
}

// dst[h] = scale * sum_{j < len} W[h][j] * Rs[j] for the G heads ([G, D] rows in global memory).
// Rows of masked tokens are zero in smem and their weights are zero.
template <typename T, int D, int HB>
__device__ __forceinline__ void weighted_rows(int lane, int G, int max_len, int len,
                                              const float* W, const T* Rs, T* dst, float scale) {
  using Geo = Geometry<D>;
  constexpr int CL = Geo::kChunkLanes, CPL = Geo::kChunksPerLane, TS = Geo::kSplits;
  const int c0 = lane % CL, ts = lane / CL;
  for (int h0 = 0; h0 < G; h0 += HB) {
    float acc[HB][CPL][8];
#pragma unroll
    for (int hb = 0; hb < HB; ++hb)
#pragma unroll
      for (int cc = 0; cc < CPL; ++cc)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[hb][cc][e] = 0.f;
#pragma unroll 2
    for (int j = ts; j < len; j += TS) {
      float w[HB];
#pragma unroll
      for (int hb = 0; hb < HB; ++hb) w[hb] = W[(h0 + hb) * max_len + j];
#pragma unroll
      for (int cc = 0; cc < CPL; ++cc) {
        float f[8];
        Cvt<T>::unpack(lds16(Rs + j * Geo::kRow + (c0 + cc * CL) * 8), f);
#pragma unroll
        for (int hb = 0; hb < HB; ++hb)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[hb][cc][e] = fmaf(w[hb], f[e], acc[hb][cc][e]);
      }
    }
#pragma unroll
    for (int o = CL; o < 32; o <<= 1)
#pragma unroll
      for (int hb = 0; hb < HB; ++hb)
#pragma unroll
        for (int cc = 0; cc < CPL; ++cc)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[hb][cc][e] += __shfl_xor_sync(kFull, acc[hb][cc][e], o);
    if (ts == 0) {
#pragma unroll
      for (int hb = 0; hb < HB; ++hb)
#pragma unroll
        for (int cc = 0; cc < CPL; ++cc)
          stg16(dst + static_cast<int64_t>(h0 + hb) * D + (c0 + cc * CL) * 8,
                pack8<T>(acc[hb][cc], scale));
    }
  }
}

template <typename T, int D, int HB>
__device__ __forceinline__ void fwd_task(const Params& p, const Window& m, const T* base,
                                         float* work, int lane) {
  using Geo = Geometry<D>;
  const int G = p.group, ML = p.max_len;
  const T* Ks = base;
  const T* Vs = Ks + m.len * Geo::kRow;
  const T* Qs = Vs + m.len * Geo::kRow;
  float* QF = work;               // [G][D] float
  float* Ps = work + G * D;       // [G][ML]
  const int64_t row0 = m.b * p.q_heads + static_cast<int64_t>(m.g) * G;

  to_float_rows<T, D>(Qs, QF, G, lane);
  __syncwarp();

  // Scores and softmax: probabilities to smem and (once) to global memory.
  const ScoreLanes S(lane, ML);
  const bool valid = S.j < m.len && allowed(static_cast<uint32_t>(m.mask), S.j);
  const float scale_log2 = p.scale * 1.4426950408889634f;
  for (int h0 = 0; h0 < G; h0 += HB) {
    float acc[HB];
    score_dots<T, D, HB>(S, valid, QF, h0, Ks, acc);
#pragma unroll
    for (int hb = 0; hb < HB; ++hb) {
      const float s = valid ? acc[hb] * scale_log2 : -INFINITY;
      float mx = s;
      for (int o = 1; o < S.tl; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
      const float e = valid ? exp2f(s - mx) : 0.f;
      float l = e;
      for (int o = 1; o < S.tl; o <<= 1) l += __shfl_xor_sync(kFull, l, o);
      const float prob = l > 0.f ? e / l : 0.f;
      if (S.ds == 0 && S.j < ML) {
        const int h = h0 + hb;
        Ps[h * ML + S.j] = prob;
        p.probs_out[(row0 + h) * ML + S.j] = prob;
      }
    }
  }
  __syncwarp();

  weighted_rows<T, D, HB>(lane, G, ML, m.len, Ps, Vs, static_cast<T*>(p.out) + row0 * D, 1.f);
}

template <typename T, int D, int HB>
__device__ __forceinline__ void bwd_task(const Params& p, const Window& m, T* base, float* work,
                                         int lane) {
  using Geo = Geometry<D>;
  const int G = p.group, ML = p.max_len;
  const T* Ks = base;
  const T* Vs = Ks + m.len * Geo::kRow;
  const T* Qs = Vs + m.len * Geo::kRow;
  const T* DOs = Qs + G * Geo::kRow;
  float* Ps = reinterpret_cast<float*>(base + (2 * m.len + 2 * G) * Geo::kRow);  // staged, in place
  float* QF = work;            // [G][D] float
  float* OF = QF + G * D;      // [G][D] float
  float* DSs = OF + G * D;     // [G][ML]
  const int64_t row0 = m.b * p.q_heads + static_cast<int64_t>(m.g) * G;

  to_float_rows<T, D>(Qs, QF, G, lane);
  to_float_rows<T, D>(DOs, OF, G, lane);
  __syncwarp();

  // dp = dO . V, delta = sum_j p dp, ds = p (dp - delta).
  const ScoreLanes S(lane, ML);
  const bool valid = S.j < m.len && allowed(static_cast<uint32_t>(m.mask), S.j);
  for (int h0 = 0; h0 < G; h0 += HB) {
    float dp[HB];
    score_dots<T, D, HB>(S, valid, OF, h0, Vs, dp);
    float pj[HB], dsv[HB];
#pragma unroll
    for (int hb = 0; hb < HB; ++hb) {
      pj[hb] = valid ? Ps[(h0 + hb) * ML + S.j] : 0.f;
      float delta = pj[hb] * dp[hb];
      for (int o = 1; o < S.tl; o <<= 1) delta += __shfl_xor_sync(kFull, delta, o);
      dsv[hb] = valid ? pj[hb] * (dp[hb] - delta) : 0.f;
    }
    __syncwarp();  // every lane has read Ps before it is rewritten
    if (S.ds == 0 && S.j < ML) {
#pragma unroll
      for (int hb = 0; hb < HB; ++hb) {
        Ps[(h0 + hb) * ML + S.j] = pj[hb];  // 0 outside the row: later phases need no mask test
        DSs[(h0 + hb) * ML + S.j] = dsv[hb];
      }
    }
  }
  __syncwarp();

  // dq_h = scale * sum_j ds_hj k_j.
  weighted_rows<T, D, HB>(lane, G, ML, m.len, DSs, Ks, static_cast<T*>(p.dq) + row0 * D,
                          p.scale);

  // dk_j = scale * sum_h ds_hj q_h, dv_j = sum_h p_hj dO_h: lane = (token, chunk).
  T* dk = static_cast<T*>(p.dk);
  T* dv = static_cast<T*>(p.dv);
  constexpr int CL = Geo::kChunkLanes, CPL = Geo::kChunksPerLane, TJ = Geo::kSplits;
  const int c0 = lane % CL, tj = lane / CL;
  const int64_t tok_stride = p.kv_heads * D;
  const int64_t kv0 = (m.start * p.kv_heads + m.g) * D;
  for (int j = tj; j < m.len; j += TJ) {
    float ak[CPL][8], av[CPL][8];
#pragma unroll
    for (int cc = 0; cc < CPL; ++cc)
#pragma unroll
      for (int e = 0; e < 8; ++e) ak[cc][e] = av[cc][e] = 0.f;
#pragma unroll 2
    for (int h = 0; h < G; ++h) {
      const float ds = DSs[h * ML + j], pv = Ps[h * ML + j];
#pragma unroll
      for (int cc = 0; cc < CPL; ++cc) {
        float qf[8], of[8];
        load_f8<D>(QF, h, c0 + cc * CL, qf);
        load_f8<D>(OF, h, c0 + cc * CL, of);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          ak[cc][e] = fmaf(ds, qf[e], ak[cc][e]);
          av[cc][e] = fmaf(pv, of[e], av[cc][e]);
        }
      }
    }
    const int64_t off = kv0 + j * tok_stride;
#pragma unroll
    for (int cc = 0; cc < CPL; ++cc) {
      const int c = (c0 + cc * CL) * 8;
      stg16(dk + off + c, pack8<T>(ak[cc], p.scale));
      stg16(dv + off + c, pack8<T>(av[cc], 1.f));
    }
  }

  // Zero the dk/dv tokens no row covers: from the end of this row to the next row's start
  // (the end of the buffer for the last row), and before the first row.
  const uint4 zero = make_uint4(0, 0, 0, 0);
  auto zero_tokens = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lane; i < (hi - lo) * Geo::kChunks; i += 32) {
      const int64_t tok = lo + i / Geo::kChunks;
      const int c = static_cast<int>(i % Geo::kChunks);
      const int64_t off = (tok * p.kv_heads + m.g) * D + c * 8;
      stg16(dk + off, zero);
      stg16(dv + off, zero);
    }
  };
  if (m.next > m.start + m.len) zero_tokens(m.start + m.len, m.next);
  if (m.b == 0 && m.start > 0) zero_tokens(0, m.start);
}

// ---------------------------------------------------------------- the persistent kernel

template <typename T, int D, int HB, bool kBwd>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, kMinBlocksPerSm)
    small_seq_kernel(const Params p) {
  using Geo = Geometry<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps_per_block = blockDim.x >> 5;
  const int64_t wid = static_cast<int64_t>(blockIdx.x) * warps_per_block + warp;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * warps_per_block;
  const int64_t total = p.batch * p.kv_heads;
  if (wid >= total) return;
  const int n_tasks = static_cast<int>((total - wid + nwarps - 1) / nwarps);

  unsigned char* slice = smem + static_cast<size_t>(warp) * p.warp_smem;
  T* ring = reinterpret_cast<T*>(slice);
  float* work = reinterpret_cast<float*>(slice + p.work_offset);
  const int R = p.ring_rows;

  Window cur = load_window(p, wid, nwarps, 0, lane, kBwd);
  Window nxt = load_window(p, wid, nwarps, 32, lane, kBwd);
  int kw0 = 0;  // task index of cur's lane 0

  // Ring state (identical on every lane): rows [head - used, head) modulo R are live.
  int head = 0, used = 0, issued = 0;
  int slot_pos = 0, slot_cost = 0;  // lane (task & 31) holds the ring position and cost of task

  for (int done = 0; done < n_tasks; ++done) {
    // Stage tasks ahead while the ring has room (at least the next task: the ring is empty
    // then, and the host sized it for the largest task).
    while (issued < n_tasks && issued - done < kMaxInFlight) {
      const Window m = window_get(cur, nxt, issued - kw0);
      const int n = task_rows<D, kBwd>(m.len, p.group, p.max_len);
      int pos = used == 0 ? 0 : head, waste = 0;
      if (pos + n > R) {
        waste = R - pos;
        pos = 0;
      }
      if (used + waste + n > R) break;
      stage_task<T, D, kBwd>(p, m, ring + pos * Geo::kRow, lane);
      if (lane == (issued & 31)) {
        slot_pos = pos;
        slot_cost = waste + n;
      }
      head = pos + n;
      used += waste + n;
      ++issued;
    }
    cp_async_wait_newer(issued - done - 1);
    __syncwarp();

    const Window m = window_get(cur, nxt, done - kw0);
    const int pos = __shfl_sync(kFull, slot_pos, done & 31);
    const int cost = __shfl_sync(kFull, slot_cost, done & 31);
    if constexpr (kBwd)
      bwd_task<T, D, HB>(p, m, ring + pos * Geo::kRow, work, lane);
    else
      fwd_task<T, D, HB>(p, m, ring + pos * Geo::kRow, work, lane);
    __syncwarp();  // every lane is done with the task's rows and the work area
    used -= cost;

    if (done + 1 - kw0 == 32) {
      cur = nxt;
      kw0 += 32;
      nxt = load_window(p, wid, nwarps, kw0 + 32, lane, kBwd);
    }
  }
}

// ---------------------------------------------------------------- host side

size_t round16(size_t x) { return (x + 15) & ~size_t{15}; }

struct Plan {
  int warps_per_block = 0, warp_smem = 0, ring_rows = 0, work_offset = 0;
};

struct DeviceInfo {
  int sms = 0, smem_per_sm = 0, smem_optin = 0, smem_reserved = 0;
};

cudaError_t device_info(DeviceInfo* info) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  static std::mutex mu;
  static std::vector<std::pair<int, DeviceInfo>> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [d, i] : cache)
    if (d == device) {
      *info = i;
      return cudaSuccess;
    }
  DeviceInfo i;
  cudaError_t e = cudaDeviceGetAttribute(&i.sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&i.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&i.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&i.smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock, device);
  if (e != cudaSuccess) return e;
  cache.emplace_back(device, i);
  *info = i;
  return cudaSuccess;
}

// Warps per SM and ring rows per warp: the most warps (<= 16) whose rings keep about
// kTargetInFlightBytes per SM in flight (tasks of the mean length staged ahead of the one being
// computed); if none does, the most in-flight bytes; the ring must hold the largest task.
bool make_plan(const SmallSeqArgs& a, bool backward, const DeviceInfo& dev, Plan* plan,
               int* blocks_per_sm) {
  const int64_t d = a.head_dim, g = a.q_heads / a.kv_heads, ml = a.max_len;
  const int64_t row_bytes = (d + 8) * 2;
  const int64_t p_rows = backward ? (g * ml * 4 + row_bytes - 1) / row_bytes : 0;
  const int64_t fixed_rows = g * (backward ? 2 : 1) + p_rows;
  const int64_t max_rows = 2 * ml + fixed_rows;
  const int64_t work = round16(g * d * 4) * (backward ? 2 : 1) + round16(g * ml * 4);
  const double mean_len =
      a.batch > 0 ? std::min<double>(ml, static_cast<double>(a.tokens) / a.batch) : ml;
  const double mean_rows = std::max(1.0, 2 * mean_len + fixed_rows);
  const double mean_bytes = (2 * mean_len + g * (backward ? 2 : 1)) * d * 2 +
                            (backward ? g * ml * 4 : 0);
  // Candidates from the most warps per SM down (two-warp blocks first at equal counts).
  double best_bytes = -1;
  for (int warps = kMaxWarpsPerSm; warps >= 1; --warps) {
    for (int wpb : {kWarpsPerBlock, 1}) {
      if (warps % wpb) continue;
      const int bps = warps / wpb;
      const int64_t block =
          std::min<int64_t>(dev.smem_optin, dev.smem_per_sm / bps - dev.smem_reserved) &
          ~int64_t{127};
      const int64_t per_warp = (block / wpb) & ~int64_t{15};
      if (per_warp <= work) continue;
      const int64_t rows = (per_warp - work) / row_bytes;
      if (rows < max_rows) continue;
      const int64_t fit = std::min<int64_t>(kMaxInFlight, static_cast<int64_t>(rows / mean_rows));
      const double bytes = static_cast<double>(warps) * static_cast<double>(fit - 1) * mean_bytes;
      if (bytes > best_bytes) {
        best_bytes = bytes;
        plan->warps_per_block = wpb;
        plan->ring_rows = static_cast<int>(rows);
        plan->work_offset = static_cast<int>(rows * row_bytes);
        plan->warp_smem = static_cast<int>(per_warp);
        *blocks_per_sm = bps;
      }
      if (bytes >= static_cast<double>(kTargetInFlightBytes)) return true;
    }
  }
  return best_bytes >= 0;
}

struct LaunchCacheEntry {
  const void* kernel;
  int device, smem, threads, occupancy;
};

// Opts the kernel into `smem` bytes of dynamic shared memory and returns its resident blocks
// per SM (cached: attribute setting and occupancy queries are host-only, no stream work).
cudaError_t prepare_kernel(const void* kernel, int smem, int threads, int* occupancy) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  static std::mutex mu;
  static std::vector<LaunchCacheEntry> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& c : cache)
    if (c.kernel == kernel && c.device == device && c.smem == smem && c.threads == threads) {
      *occupancy = c.occupancy;
      return cudaSuccess;
    }
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      e != cudaSuccess)
    return e;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared);
      e != cudaSuccess)
    return e;
  int occ = 0;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, smem);
      e != cudaSuccess)
    return e;
  if (occ < 1) return cudaErrorInvalidConfiguration;
  cache.push_back({kernel, device, smem, threads, occ});
  *occupancy = occ;
  return cudaSuccess;
}

template <typename Kernel>
cudaError_t launch(Kernel kernel, const SmallSeqArgs& a, bool backward, Params p,
                   cudaStream_t stream) {
  const int64_t tasks = a.batch * a.kv_heads;
  if (tasks == 0) return cudaSuccess;
  DeviceInfo dev;
  if (cudaError_t e = device_info(&dev); e != cudaSuccess) return e;
  Plan plan;
  int bps = 0;
  if (!make_plan(a, backward, dev, &plan, &bps)) return cudaErrorInvalidValue;
  const int threads = plan.warps_per_block * 32;
  const int smem = plan.warp_smem * plan.warps_per_block;
  int occ = 0;
  if (cudaError_t e = prepare_kernel(reinterpret_cast<const void*>(kernel), smem, threads, &occ);
      e != cudaSuccess)
    return e;
  const int64_t resident = static_cast<int64_t>(dev.sms) * occ;
  const int64_t blocks = std::min<int64_t>((tasks + plan.warps_per_block - 1) / plan.warps_per_block,
                                           resident);
  p.warp_smem = plan.warp_smem;
  p.ring_rows = plan.ring_rows;
  p.work_offset = plan.work_offset;
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(p);
  return cudaGetLastError();
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

// Head block: the largest of 4, 2, 1 dividing the group (2 at most for D = 512: registers).
template <typename T, int D, bool kBwd>
cudaError_t dispatch_hb(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  const int g = p.group;
  if constexpr (D < 512) {
    if (g % 4 == 0) return launch(small_seq_kernel<T, D, 4, kBwd>, a, kBwd, p, s);
  }
  if (g % 2 == 0) return launch(small_seq_kernel<T, D, 2, kBwd>, a, kBwd, p, s);
  return launch(small_seq_kernel<T, D, 1, kBwd>, a, kBwd, p, s);
}

template <typename T, bool kBwd>
cudaError_t dispatch(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  switch (a.head_dim) {
    case 64: return dispatch_hb<T, 64, kBwd>(a, p, s);
    case 128: return dispatch_hb<T, 128, kBwd>(a, p, s);
    case 256: return dispatch_hb<T, 256, kBwd>(a, p, s);
    case 512: return dispatch_hb<T, 512, kBwd>(a, p, s);
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
  return dtype == SmallSeqDType::kBF16 ? dispatch<__nv_bfloat16, false>(args, p, stream)
                                       : dispatch<__half, false>(args, p, stream);
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
  return dtype == SmallSeqDType::kBF16 ? dispatch<__nv_bfloat16, true>(args, p, stream)
                                       : dispatch<__half, true>(args, p, stream);
}

}  // namespace jaxcp::cuda
