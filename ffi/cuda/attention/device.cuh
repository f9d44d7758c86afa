// Device-side building blocks shared by the attention kernels (private to ffi/cuda/attention/):
// tile configuration, CuTe GEMM helpers, per-element mask evaluation, workspace layout, and the
// declarations of the tile-plan launchers (plan.cu, doc_tiles.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "common/attention_shape.h"
#include "common/mask.h"
#include "cuda/device_query.h"
#include "cuda/math_constants.h"
#include "launchers.h"

namespace jaxcp::cuda {

// ---------------------------------------------------------------------------------------------
// Tile sizes (host and device agree through these).
// ---------------------------------------------------------------------------------------------
constexpr int kFwdBlockM = 128;  // query rows per forward block
constexpr int kFwdBlockN = 64;   // key rows per forward step
constexpr int kBwdBlockM = 64;   // query rows per backward step (sm_80 dK/dV kernel, dQ kernel)
// Query rows per step of the sm_90a dK/dV kernel: 128 at D 64, whose GEMMs are short in K (the
// fixed cost of a step, masks, barriers and the dQ hand-off, weighed more), else kBwdBlockM.
constexpr int bwd_sm90_block_m(int64_t d) { return d == 64 ? 128 : kBwdBlockM; }
constexpr int bwd_block_n(int64_t d) { return d > 128 ? 64 : 128; }  // keys per dK/dV block
constexpr int dq_block_n(int64_t d) { return d == 256 ? 32 : 64; }    // keys per dQ-kernel step
// Head dims with tiles: the sm_80 kernels' 64, 128, 256; the sm_90a kernels' (forward and
// backward) also 96 and 192.
constexpr bool sm80_head_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }
constexpr bool sm90_head_dim(int64_t d) { return sm80_head_dim(d) || d == 96 || d == 192; }
// A value head dim of its own next to head dim d: multi-head latent attention's 192 / 128
// (DeepSeek-V2/V3), in the sm_90a kernels only (forward, and the non-deterministic backward).
// Every other pair pads V to d.
constexpr bool sm90_value_head_dim(int64_t d, int64_t dv) { return d == 192 && dv == 128; }

inline int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bump allocator over the caller's workspace; every piece 256-byte aligned.
struct WorkspaceLayout {
  size_t bytes = 0;
  size_t take(size_t n) {
    const size_t off = bytes;
    bytes += (n + 255) / 256 * 256;
    return off;
  }
};

// Range [x, y) of partner tiles that are not skipped, per tile (x >= y: none).
using TileRange = int2;

// Tile plan launchers (plan.cu). All enqueue on `stream` only.
// The tokens behind one side's tile summaries: [B, len] segment ids / positions, tiles of `tile`.
struct TileTokens {
  const int32_t* seg;
  const int32_t* pos;
  int64_t len;
  int tile;
};
// Summaries of the tiles of two sides in one launch: out_a [B, ceil(a.len / a.tile)], and out_b
// likewise for b (out_b == nullptr: side a alone).
cudaError_t launch_tile_summaries(const TileTokens& a, TileSummary* out_a, const TileTokens& b,
                                  TileSummary* out_b, int64_t batch, cudaStream_t stream);
constexpr int kMaxTileTokens = 128;  // the largest key tile launch_tile_ranges accepts
// Runs of one segment id in a tile that the plans place one by one, each on its own summary (a
// short document riding in a tile of a long one; more runs: the tile's summary as one run).
constexpr int kMaxTileRuns = 4;
// For every "row" tile (out [B, n_rows]) the range of "col" tiles that classify_tiles does not
// skip, minus tiles at its ends that have no allowed pair (checked on the tokens). rows_are_q
// says which side of classify_tiles the row tiles are.
cudaError_t launch_tile_ranges(const TileSummary* rows, int64_t n_rows, const TileTokens& row_tokens,
                               const TileSummary* cols, int64_t n_cols, const TileTokens& col_tokens,
                               int64_t batch, const MaskParams& mask, bool rows_are_q, TileRange* out,
                               cudaStream_t stream);

// order[0..n) = indices of ranges[0..n) by decreasing range length (heaviest blocks first), or
// in increasing index when no range is longer than index_order_max_work (0: never).
cudaError_t launch_tile_schedule(const TileRange* ranges, int64_t n, int index_order_max_work, int* order,
                                 cudaStream_t stream);

// order[0..n) = indices of ranges[0..n) (per_row tiles a batch row) document by document,
// heaviest document first, each document's tiles in index order (doc_schedule.cu).
cudaError_t launch_document_schedule(const TileRange* ranges, int64_t n, int64_t per_row, int* order,
                                     cudaStream_t stream);

// Document-aligned query tiles of the sm_90a forward (doc_tiles.cu): rows
// [q0, q0 + rows) of batch row b (rows <= kFwdBlockM), their summary, and the keys
// [kv_lo, kv_hi) that any of them may attend (kv_lo == kv_hi: none).
struct alignas(16) DocTile {
  int b, q0, rows, kv_lo, kv_hi, pad[3];
  TileSummary sum;
};
// Tile slots per batch row: an upper bound on the tiles of a row of len tokens.
int doc_tile_capacity(int64_t len);
// Workspace of the plan: anchor_bits [B, ceil(Sq / 32)], starts [B, capacity], counts [B],
// offsets [B], total [1] (tiles of all rows), widest_keys [1] (the most keys a tile attends,
// kv_hi - kv_lo), tiles [B * capacity] (the first *total used, row by row, each row's in
// increasing q0), key_windows [B, Skv] (the summary of keys [x, x + block N) for every key x).
struct DocTileWorkspace {
  TileSummary* key_windows;
  uint32_t* anchor_bits;
  int* starts;
  int* counts;
  int* offsets;
  int* total;
  int* widest_keys;
  DocTile* tiles;
};
// Builds the plan for queries `q` against keys `kv` (kv.tile = the kernel's block N, n_kv_tiles
// of them). fixed_grid: tiles of kFwdBlockM rows from token 0 (AttentionKernelOptions::
// fwd_fixed_tiles, for measuring what document tiles gain).
cudaError_t launch_doc_tile_plan(const TileTokens& q, int64_t n_kv_tiles,
                                 const TileTokens& kv, int64_t batch, const MaskParams& mask, bool fixed_grid,
                                 const DocTileWorkspace& ws, cudaStream_t stream);

// Whether the current device is sm_90 and runs this build's sm_90a images (cached per device;
// fwd_sm90.cu).
bool sm90_kernels_available();

namespace detail {
using namespace cute;

template <DType> struct ElementOf;
template <> struct ElementOf<DType::kBF16> { using type = cutlass::bfloat16_t; };
template <> struct ElementOf<DType::kF16> { using type = cutlass::half_t; };

template <class T> struct MmaAtomOf;
template <> struct MmaAtomOf<cutlass::bfloat16_t> {
  using type = MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>;
};
template <> struct MmaAtomOf<cutlass::half_t> {
  using type = MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>;
};

// 8 x 64 element atom, 128-byte rows, XOR swizzle of the 16-byte chunks: conflict-free for
// cp.async writes and ldmatrix reads (both plain and transposed).
using SmemLayoutAtom64 =
    decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{}));

template <int kRows, int kCols>
using SmemLayoutRowMajor = decltype(tile_to_shape(SmemLayoutAtom64{}, Shape<Int<kRows>, Int<kCols>>{}));

// View (cols, rows) of a (rows, cols) smem layout: the transposed operand of ldmatrix.trans.
template <class L, int kRows, int kCols>
using SmemLayoutTransposed =
    decltype(composition(L{}, make_layout(Shape<Int<kCols>, Int<kRows>>{}, GenRowMajor{})));

// Global -> shared: 16-byte cp.async, 8 threads per 64-element row segment.
template <class Element, int kThreads>
using GmemTiledCopyAsync = decltype(make_tiled_copy(
    Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{},
    Layout<Shape<Int<kThreads / 8>, _8>, Stride<_8, _1>>{}, Layout<Shape<_1, _8>>{}));
template <class Element, int kThreads>
using GmemTiledCopyPlain = decltype(make_tiled_copy(
    Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{},
    Layout<Shape<Int<kThreads / 8>, _8>, Stride<_8, _1>>{}, Layout<Shape<_1, _8>>{}));

// Copies rows [0, valid_rows) of a (rows, cols) tile from global to shared and zero-fills the
// others (so garbage never reaches a tensor core: 0 * NaN would poison the sums).
template <class TiledCopy, class TS, class TD, class TC>
__forceinline__ __device__ void copy_rows_async(TiledCopy const& tiled_copy, TS const& src, TD&& dst,
                                                TC const& ident, int valid_rows) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(ident(0, m, 0)) < valid_rows) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(src); ++k) cute::copy(tiled_copy, src(_, m, k), dst(_, m, k));
    } else {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(src); ++k) cute::clear(dst(_, m, k));
    }
  }
}

template <int N>
__forceinline__ __device__ void cp_async_wait() {
#if defined(CUTE_ARCH_CP_ASYNC_SM80_ENABLED)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// acc (smem -> reg -> mma) over the K mode, software-pipelined by one k-slice.
template <class Acc, class TA, class TB, class TsA, class TsB, class TiledMma, class CopyA,
          class CopyB, class ThrCopyA, class ThrCopyB>
__forceinline__ __device__ void gemm_ss(Acc& acc, TA& rA, TB& rB, TsA const& sA, TsB const& sB,
                                        TiledMma const& mma, CopyA const& copy_a,
                                        CopyB const& copy_b, ThrCopyA const& thr_a,
                                        ThrCopyB const& thr_b) {
  Tensor rA_view = thr_a.retile_D(rA);
  Tensor rB_view = thr_b.retile_D(rB);
  cute::copy(copy_a, sA(_, _, _0{}), rA_view(_, _, _0{}));
  cute::copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(rA); ++i) {
    if (i < size<2>(rA) - 1) {
      cute::copy(copy_a, sA(_, _, i + 1), rA_view(_, _, i + 1));
      cute::copy(copy_b, sB(_, _, i + 1), rB_view(_, _, i + 1));
    }
    cute::gemm(mma, rA(_, _, i), rB(_, _, i), acc);
  }
}

// A from registers, B smem -> reg.
template <class Acc, class TA, class TB, class TsB, class TiledMma, class CopyB, class ThrCopyB>
__forceinline__ __device__ void gemm_rs(Acc& acc, TA const& rA, TB& rB, TsB const& sB,
                                        TiledMma const& mma, CopyB const& copy_b,
                                        ThrCopyB const& thr_b) {
  Tensor rB_view = thr_b.retile_D(rB);
  cute::copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(rA); ++i) {
    if (i < size<2>(rA) - 1) cute::copy(copy_b, sB(_, _, i + 1), rB_view(_, _, i + 1));
    cute::gemm(mma, rA(_, _, i), rB(_, _, i), acc);
  }
}

// Accumulator layout ((2,2), MMA_M, MMA_N) -> ((2, MMA_M), (2, MMA_N)) = (rows, cols).
template <class L>
__forceinline__ __device__ auto acc_rowcol(L const& acc_layout) {
  static_assert(decltype(size<0>(acc_layout))::value == 4);
  static_assert(decltype(rank(acc_layout))::value == 3);
  auto l = logical_divide(acc_layout, Shape<_2>{});
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// Accumulator layout ((2,2), MMA_M, MMA_N) -> ((2,2,2), MMA_M, MMA_N/2): the A operand of the
// next m16n8k16 MMA (two adjacent n8 accumulator blocks form one k16 slice).
template <class L>
__forceinline__ __device__ auto acc_as_A(L const& acc_layout) {
  static_assert(decltype(size<0>(acc_layout))::value == 4);
  static_assert(decltype(rank(acc_layout))::value == 3);
  auto l = logical_divide(acc_layout, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

template <class To, class Engine, class Layout>
__forceinline__ __device__ auto convert_type(Tensor<Engine, Layout> const& t) {
  using From = typename Engine::value_type;
  constexpr int n = decltype(size(t))::value;
  cutlass::NumericArrayConverter<To, From, n> op;
  auto frag = op(*reinterpret_cast<const cutlass::Array<From, n>*>(t.data()));
  return make_tensor(make_rmem_ptr<To>(&frag), t.layout());
}

// The backward's exponent offset: P = exp2(s * scale * log2(e) - lse_log2(lse)); an empty row
// (lse = -inf) gets +inf, so its P is 0 rather than NaN.
__forceinline__ __device__ float lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

// Reductions over the 4 threads of a quad (the threads that share an accumulator row).
__forceinline__ __device__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
}
__forceinline__ __device__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x + __shfl_xor_sync(0xffffffffu, x, 1);
}

// Online softmax over one tile of scores s (rows, cols), masked with -inf, in log2 units once
// multiplied by scale (> 0; a caller that scaled s already passes 1): updates the running row
// max (scaled) and sum over the quad that shares a row, replaces s by exp2(s scale - max) and
// leaves in corr[] the factor that rescales earlier partials. The scale is folded into the
// exponent's FFMA: the max of the raw scores times a positive scale is the max of the scaled.
//
// kLazy (FlashAttention-4's conditional rescaling): row_max is a reference, not the max. It moves
// only when a tile's max passes it by more than kLazyMaxSlack, so the exponents stay <= 2^8 (no
// overflow, even in fp16 P) and corr[] is exactly 1 for the rows it did not move. O, the sum
// and the LSE all use the same reference, so only the rounding changes. Returns whether any of
// this thread's references moved: when none did in a whole warp, O needs no rescaling.
constexpr float kLazyMaxSlack = 8.f;

template <bool kLazy = false, class S, int kRows>
__forceinline__ __device__ bool online_softmax(S& s, float scale, float (&row_max)[kRows], float (&row_sum)[kRows],
                                               float (&corr)[kRows]) {
  constexpr int kCols = decltype(size<1>(s))::value;
  bool moved = false;
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    float mx = -INFINITY;
    CUTE_UNROLL
    for (int ni = 0; ni < kCols; ++ni) mx = fmaxf(mx, s(mi, ni));
    if constexpr (kLazy) {
      mx = quad_max(mx) * scale;
      const bool up = mx > row_max[mi] + kLazyMaxSlack;  // a reference of -inf moves to any finite max
      moved |= up;
      mx = up ? mx : row_max[mi];
    } else {
      mx = fmaxf(row_max[mi], quad_max(mx) * scale);
    }
    const float m_use = mx == -INFINITY ? 0.f : mx;  // all masked so far: exp2(-inf - 0) = 0
    corr[mi] = exp2f(row_max[mi] - m_use);
    row_max[mi] = mx;
    float sum = 0.f;
    CUTE_UNROLL
    for (int ni = 0; ni < kCols; ++ni) {
      const float e = exp2f(fmaf(s(mi, ni), scale, -m_use));
      s(mi, ni) = e;
      sum += e;
    }
    row_sum[mi] = row_sum[mi] * corr[mi] + sum;
  }
  return moved;
}

// Per-element masks (RowMask, ColMask, make_row_mask, make_col_mask, allowed): ../common/mask.h,
// shared with the CPU kernels so that the CPU tests check the same interval rule.

// Tile class with the bounds folded in: a tile that runs past the end of its sequence is never
// "full" (its out-of-range tokens must be masked).
__forceinline__ __device__ int tile_class(const TileSummary& q, const TileSummary& kv,
                                          const MaskParams& m, bool ragged) {
  const int c = static_cast<int>(classify_tiles(q, kv, m));
  return (ragged && c == static_cast<int>(TileClass::kFull)) ? static_cast<int>(TileClass::kPartial) : c;
}

constexpr int kSkip = static_cast<int>(TileClass::kSkip);
constexpr int kPartial = static_cast<int>(TileClass::kPartial);
constexpr int kFull = static_cast<int>(TileClass::kFull);

// First tile index in [i, end) whose class_of(index) is not kSkip (end: none), its class in c.
// The 32 lanes of the warp classify 32 tiles per round, so a run of skipped tiles (a window's or
// a chunk's far side of the document; a plan range spans from a document's first tile) costs one
// summary load latency per 32 tiles instead of one per tile. Every lane of the warp must call it
// with the same arguments; it returns the same values to all.
template <class ClassOf>
__forceinline__ __device__ int warp_first_unskipped(int i, int end, ClassOf class_of, int& c) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (; i < end; i += 32) {
    const int mine = i + lane;
    const int cls = mine < end ? class_of(mine) : kSkip;
    const unsigned hit = __ballot_sync(0xffffffffu, cls != kSkip);
    if (hit != 0u) {
      const int src = __ffs(hit) - 1;
      c = __shfl_sync(0xffffffffu, cls, src);
      return i + src;
    }
  }
  return end;
}

// The mirror of warp_first_unskipped: the last tile index in [begin, i] whose class is not
// kSkip (begin - 1: none), 32 tiles per round. Every lane must call it with the same arguments.
template <class ClassOf>
__forceinline__ __device__ int warp_last_unskipped(int i, int begin, ClassOf class_of) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (; i >= begin; i -= 32) {
    const int mine = i - lane;
    const unsigned hit = __ballot_sync(0xffffffffu, mine >= begin && class_of(mine) != kSkip);
    if (hit != 0u) return i - (__ffs(hit) - 1);
  }
  return begin - 1;
}

}  // namespace detail
}  // namespace jaxcp::cuda
