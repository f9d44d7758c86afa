// Device helpers shared by the tile-plan kernels (plan.cu, doc_tiles.cu); private to
// ffi/cuda/attention/.
#pragma once
#include <climits>

#include "device.cuh"

namespace jaxcp::cuda::detail {

// Which keys of a block of nk (<= kMaxTileTokens) keys some query row of a block of nq rows may
// attend, decided by the whole warp over every pair: lane l takes keys l, l + 32, l + 64,
// l + 96 and runs through the rows. The pointers address the blocks' first tokens. Returns the
// first and last such key (offsets into the key block), {INT_MAX, -1} when there is none.
// Summaries cannot tell this: they keep a block with no allowed pair, e.g. the block at a
// document's start (which also holds the end of the previous document) seen from a query
// block a window further on.
__device__ inline int2 allowed_key_span(const int32_t* q_seg, const int32_t* q_pos, int nq,
                                        const int32_t* k_seg, const int32_t* k_pos, int nk,
                                        const MaskParams& m) {
  constexpr int kPerLane = kMaxTileTokens / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  ColMask cm[kPerLane];
  bool any[kPerLane];
  CUTE_UNROLL
  for (int i = 0; i < kPerLane; ++i) {
    const int k = lane + 32 * i;
    const bool valid = k < nk;
    cm[i] = make_col_mask(valid, k_seg[valid ? k : 0], k_pos[valid ? k : 0]);
    any[i] = false;
  }
  // Lane l builds the masks of rows l, l + 32, ..., handed to the warp by shuffles, rather than
  // every lane building every row's (a 64-bit division per row with chunks).
  for (int r0 = 0; r0 < nq; r0 += 32) {
    const int mine = r0 + lane < nq ? r0 + lane : r0;
    const RowMask own = make_row_mask(true, q_seg[mine], q_pos[mine], m);
    const int rows = nq - r0 < 32 ? nq - r0 : 32;
    for (int j = 0; j < rows; ++j) {
      RowMask rm;
      rm.seg = __shfl_sync(0xffffffffu, own.seg, j);
      rm.lo = __shfl_sync(0xffffffffu, own.lo, j);
      rm.hi = __shfl_sync(0xffffffffu, own.hi, j);
      CUTE_UNROLL
      for (int i = 0; i < kPerLane; ++i) any[i] |= allowed(rm, cm[i]);
    }
  }
  int2 span = make_int2(INT_MAX, -1);
  CUTE_UNROLL
  for (int i = kPerLane - 1; i >= 0; --i) {
    const unsigned hit = __ballot_sync(0xffffffffu, any[i]);
    if (hit != 0u) span.x = 32 * i + __ffs(hit) - 1;
  }
  CUTE_UNROLL
  for (int i = 0; i < kPerLane; ++i) {
    const unsigned hit = __ballot_sync(0xffffffffu, any[i]);
    if (hit != 0u) span.y = 32 * i + 31 - __clz(hit);
  }
  return span;
}

// The summary of no token, of one token, and of two sets of tokens.
__device__ inline TileSummary empty_summary() { return TileSummary{INT_MAX, INT_MIN, INT_MAX, INT_MIN}; }
__device__ inline TileSummary token_summary(int32_t seg, int32_t pos) { return TileSummary{seg, seg, pos, pos}; }
__device__ inline TileSummary merge_summaries(const TileSummary& a, const TileSummary& b) {
  return TileSummary{min(a.seg_min, b.seg_min), max(a.seg_max, b.seg_max), min(a.pos_min, b.pos_min),
                     max(a.pos_max, b.pos_max)};
}

// Min / max of a TileSummary's four fields over the warp (every lane gets the result).
__device__ inline TileSummary warp_merge_summary(TileSummary s) {
  for (int o = 16; o > 0; o >>= 1) {
    s = merge_summaries(s, TileSummary{__shfl_xor_sync(0xffffffffu, s.seg_min, o),
                                       __shfl_xor_sync(0xffffffffu, s.seg_max, o),
                                       __shfl_xor_sync(0xffffffffu, s.pos_min, o),
                                       __shfl_xor_sync(0xffffffffu, s.pos_max, o)});
  }
  return s;
}

// Of the tiles begin + l + k * stride below n (lane l takes those of its l, k = 0, 1, ...), the
// first and last whose class_of(index) is not kSkip ({INT_MAX, -1}: none). Every lane gets the
// result.
template <class ClassOf>
__device__ int2 warp_unskipped_range(int64_t n, ClassOf class_of, int64_t begin, int64_t stride) {
  int first = INT_MAX, last = -1;
  for (int64_t c = begin + threadIdx.x % 32; c < n; c += stride) {
    if (class_of(static_cast<int>(c)) != kSkip) {
      first = min(first, static_cast<int>(c));
      last = max(last, static_cast<int>(c));
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
    last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
  }
  return make_int2(first, last);
}

// Inclusive scan by op (a sum, a max) of one int per thread over a block of 32 warps; every
// thread calls it. warp_tmp (32 ints of shared memory) then holds, for each warp, the scan up to
// its last thread: warp_tmp[31] is the whole block's.
template <class Op>
__device__ inline int block_inclusive_scan(int x, int* warp_tmp, Op op) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  auto warp_scan = [&](int v) {
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v = op(v, y);
    }
    return v;
  };
  x = warp_scan(x);
  if (lane == 31) warp_tmp[warp] = x;
  __syncthreads();
  if (warp == 0) warp_tmp[lane] = warp_scan(warp_tmp[lane]);
  __syncthreads();
  return warp > 0 ? op(x, warp_tmp[warp - 1]) : x;
}

}  // namespace jaxcp::cuda::detail
