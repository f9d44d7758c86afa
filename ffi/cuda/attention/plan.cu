// Tile plan: per-tile summaries of segment ids / positions, and for every tile the range of
// partner tiles that classify_tiles does not skip. These make the attention kernels follow the
// allowed area (work ~ allowed pairs, not S^2) for any document mix and token order.
#include <climits>

#include "plan.cuh"

namespace jaxcp::cuda {
namespace {

constexpr int kSummaryThreads = 128;

// Tile summaries of two sides in one launch (the plans need both, and a launch costs a few
// microseconds of a short call): blocks [0, n_a) take side a's tiles, the rest side b's.
__global__ void __launch_bounds__(kSummaryThreads) tile_summary_kernel(TileTokens tok_a, int64_t n_a,
                                                                       TileSummary* __restrict__ out_a,
                                                                       TileTokens tok_b, int64_t n_b,
                                                                       TileSummary* __restrict__ out_b) {
  const bool side_a = blockIdx.x < n_a;
  const TileTokens tok = side_a ? tok_a : tok_b;
  const int64_t n_tiles = side_a ? n_a : n_b;
  TileSummary* out = side_a ? out_a : out_b;
  const int64_t t = side_a ? blockIdx.x : blockIdx.x - n_a, b = blockIdx.y;
  const int64_t start = t * tok.tile, len = tok.len;
  const int64_t end = start + tok.tile < len ? start + tok.tile : len;
  TileSummary sum = detail::empty_summary();
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x)
    sum = detail::merge_summaries(sum, detail::token_summary(tok.seg[b * len + i], tok.pos[b * len + i]));
  sum = detail::warp_merge_summary(sum);
  __shared__ TileSummary red[kSummaryThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) red[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kSummaryThreads / 32; ++w) sum = detail::merge_summaries(sum, red[w]);
    out[b * n_tiles + t] = sum;
  }
}

constexpr int kRangeWarps = 4;
constexpr int kMaxTrimmed = 4;  // tiles with no allowed pair dropped from each end of a range, at most

// Whether any pair of queries [q0, q0 + nq) and keys [k0, k0 + nk) (token indices in batch row
// b, nk <= kMaxTileTokens) is allowed (allowed_key_span).
__device__ bool tokens_interact(const TileTokens& q, int64_t q0, int nq, const TileTokens& kv, int64_t k0, int nk,
                                int64_t b, const MaskParams& m) {
  const int64_t qa = b * q.len + q0, ka = b * kv.len + k0;
  return detail::allowed_key_span(q.seg + qa, q.pos + qa, nq, kv.seg + ka, kv.pos + ka, nk, m).x != INT_MAX;
}

// Whether the run of n tokens with summary a (the warp's) is one document whose positions are
// consecutive (each one more than the last). For such a run, one token of the other side
// interacts with some token of the run exactly when classify_tiles does not skip the pair of
// summaries: a row's allowed keys, and a key's allowed rows, form one interval of positions.
__device__ bool run_is_consecutive(const TileSummary& a, const int32_t* pos, int n) {
  if (a.seg_min != a.seg_max || static_cast<int64_t>(a.pos_max) - a.pos_min != n - 1) return false;
  bool rising = true;
  for (int i = 1 + static_cast<int>(threadIdx.x % 32); i < n; i += 32) rising &= pos[i] > pos[i - 1];
  return __all_sync(0xffffffffu, rising);
}

// One block per row tile: its warps scan the column tiles 32 at a time in turn (the scan is bound
// by the latency of its summary loads: more warps, more loads in flight) and warp 0 joins their
// ranges. It then checks the ends of the range pair by pair and drops tiles with no allowed pair
// (with the skipped run behind them): otherwise the kernels would compute such a tile, and walk the
// run of skipped tiles between it and the rest one summary load at a time. Such tiles: with a
// window or chunks, a document's start tile seen from a window away; under any mask, the tile that
// ends the last document and starts the padding. Its summary has segments [0, n] and positions from
// 0 (the padding's), so a causal key tile of any document could skip it only past the last
// document's positions in that tile: the walks of nearly all key tiles of a padded row ran to the
// row's end.
// A row tile that holds the end of one document and the start of the next is ranged run by run
// (each run of one segment id on its own summary) and the ranges joined: on the tile's summary
// the next document's positions from 0 made every tile of the first document look causal-
// reachable, so the backward's key tile at each document boundary walked all query tiles of
// the document before it (4-9% of the backward's steps on the benchmark's rows).
__global__ void __launch_bounds__(kRangeWarps * 32) tile_range_kernel(
    const TileSummary* __restrict__ rows, int64_t n_rows, TileTokens row_tokens,
    const TileSummary* __restrict__ cols, int64_t n_cols, TileTokens col_tokens, MaskParams mask,
    bool rows_are_q, TileRange* __restrict__ out) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t r = blockIdx.x, b = blockIdx.y;
  // The warps' ranges by run parity: warp 0 reads run k's while the others write run k + 1's.
  __shared__ int2 warp_ranges[2][kRangeWarps];
  const int64_t tok0 = r * row_tokens.tile;
  const int n_tok = static_cast<int>(min(static_cast<int64_t>(row_tokens.tile), row_tokens.len - tok0));
  const int32_t* row_seg = row_tokens.seg + b * row_tokens.len + tok0;
  const int32_t* row_pos = row_tokens.pos + b * row_tokens.len + tok0;
  int run_at[kMaxTileRuns + 1];
  int runs = 0;
  for (int i0 = 0; i0 < n_tok; i0 += 32) {
    const int i = i0 + lane;
    unsigned starts = __ballot_sync(0xffffffffu, i < n_tok && (i == 0 || row_seg[i] != row_seg[i - 1]));
    for (; starts != 0u; starts &= starts - 1u, ++runs)
      if (runs < kMaxTileRuns) run_at[runs] = i0 + __ffs(static_cast<int>(starts)) - 1;
  }
  if (runs > kMaxTileRuns || runs == 0) {  // more: the tile as one run
    runs = 1;
    run_at[0] = 0;
  }
  run_at[runs] = n_tok;

  int first = INT_MAX, last = -1;
  for (int run = 0; run < runs; ++run) {
    const int lo = run_at[run], hi = run_at[run + 1];
    TileSummary a = rows[b * n_rows + r];
    if (runs > 1) {
      a = detail::empty_summary();
      for (int i = lo + lane; i < hi; i += 32)
        a = detail::merge_summaries(a, detail::token_summary(row_seg[i], row_pos[i]));
      a = detail::warp_merge_summary(a);
    }
    auto class_of = [&](int c) {
      const TileSummary s = cols[b * n_cols + c];
      return static_cast<int>(rows_are_q ? classify_tiles(a, s, mask) : classify_tiles(s, a, mask));
    };
    const int2 part = detail::warp_unskipped_range(n_cols, class_of, 32 * warp, 32 * kRangeWarps);
    if (lane == 0) warp_ranges[run & 1][warp] = part;
    __syncthreads();  // every warp takes the same runs
    if (warp != 0) continue;
    int f = INT_MAX, l = -1;
    for (int w = 0; w < kRangeWarps; ++w) {
      f = min(f, warp_ranges[run & 1][w].x);
      l = max(l, warp_ranges[run & 1][w].y);
    }
    if (f <= l) {
      const bool consecutive = run_is_consecutive(a, row_pos + lo, hi - lo);
      auto interacts = [&](int c) {
        const int64_t c0 = static_cast<int64_t>(c) * col_tokens.tile;
        const int nc = static_cast<int>(min(static_cast<int64_t>(col_tokens.tile), col_tokens.len - c0));
        // Each token of tile c against the run's summary: never misses an allowed pair, and
        // exact when the run is one document with consecutive positions (the usual case), so
        // the pair-by-pair check (a serial walk over 64-128 rows) runs only for other runs.
        const int64_t ca = b * col_tokens.len + c0;
        bool any = false;
        for (int i = lane; i < nc; i += 32) {
          const TileSummary t = detail::token_summary(col_tokens.seg[ca + i], col_tokens.pos[ca + i]);
          any |= (rows_are_q ? classify_tiles(a, t, mask) : classify_tiles(t, a, mask)) != TileClass::kSkip;
        }
        any = __any_sync(0xffffffffu, any);
        if (!any || consecutive) return any;
        return rows_are_q ? tokens_interact(row_tokens, tok0 + lo, hi - lo, col_tokens, c0, nc, b, mask)
                          : tokens_interact(col_tokens, c0, nc, row_tokens, tok0 + lo, hi - lo, b, mask);
      };
      for (int t = 0; t < kMaxTrimmed && f <= l && !interacts(l); ++t)
        l = detail::warp_last_unskipped(l - 1, f, class_of);
      int unused;
      for (int t = 0; t < kMaxTrimmed && f <= l && !interacts(f); ++t)
        f = detail::warp_first_unskipped(f + 1, l + 1, class_of, unused);
    }
    if (f <= l) {
      first = min(first, f);
      last = max(last, l);
    }
  }
  if (warp == 0 && lane == 0) out[b * n_rows + r] = first <= last ? make_int2(first, last + 1) : make_int2(0, 0);
}

constexpr int kSchedThreads = 1024, kSchedBuckets = 2 * kSchedThreads;

// order = tile indices sorted by decreasing work (number of partner tiles in range, bucketed),
// so that the heaviest blocks start first (longest-processing-time-first: a shorter tail).
// Counting sort in one block; the order inside a bucket is arbitrary (results never depend on
// it: every output tile is owned by exactly one block). When no tile has more than
// index_order_max_work partners, the tail is short anyway and order is the identity: neighbouring
// tiles then run together and share their partners' data in L2.
__global__ void __launch_bounds__(kSchedThreads) tile_schedule_kernel(
    const TileRange* __restrict__ ranges, int64_t n, int index_order_max_work, int* __restrict__ order) {
  __shared__ int hist[kSchedBuckets];
  __shared__ int warp_sum[kSchedThreads / 32];
  __shared__ int max_work;
  const int t = threadIdx.x;
  auto work_of = [&](int64_t i) {
    const TileRange r = ranges[i];
    return r.y > r.x ? r.y - r.x : 0;
  };
  auto bucket_of = [&](int w) { return kSchedBuckets - 1 - (w < kSchedBuckets - 1 ? w : kSchedBuckets - 1); };
  for (int i = t; i < kSchedBuckets; i += kSchedThreads) hist[i] = 0;
  if (t == 0) max_work = 0;
  __syncthreads();
  int own_max = 0;
  for (int64_t i = t; i < n; i += kSchedThreads) {
    const int w = work_of(i);
    atomicAdd(&hist[bucket_of(w)], 1);
    own_max = max(own_max, w);
  }
  atomicMax(&max_work, own_max);
  __syncthreads();
  if (max_work <= index_order_max_work) {
    for (int64_t i = t; i < n; i += kSchedThreads) order[i] = static_cast<int>(i);
    return;
  }
  // Exclusive scan of the histogram: 2 buckets per thread.
  const int a0 = hist[2 * t], a1 = hist[2 * t + 1], sum = a0 + a1;
  const int excl = detail::block_inclusive_scan(sum, warp_sum, [](int a, int b) { return a + b; }) - sum;
  hist[2 * t] = excl;
  hist[2 * t + 1] = excl + a0;
  __syncthreads();
  for (int64_t i = t; i < n; i += kSchedThreads)
    order[atomicAdd(&hist[bucket_of(work_of(i))], 1)] = static_cast<int>(i);
}

}  // namespace

cudaError_t launch_tile_schedule(const TileRange* ranges, int64_t n, int index_order_max_work, int* order,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (n > INT_MAX) return cudaErrorInvalidValue;
  tile_schedule_kernel<<<1, kSchedThreads, 0, stream>>>(ranges, n, index_order_max_work, order);
  return cudaGetLastError();
}

cudaError_t launch_tile_summaries(const TileTokens& a, TileSummary* out_a, const TileTokens& b,
                                  TileSummary* out_b, int64_t batch, cudaStream_t stream) {
  const int64_t n_a = ceil_div64(a.len, a.tile), n_b = out_b != nullptr ? ceil_div64(b.len, b.tile) : 0;
  if (batch == 0 || n_a + n_b == 0) return cudaSuccess;
  if (batch > 65535 || n_a + n_b > INT_MAX) return cudaErrorInvalidValue;
  tile_summary_kernel<<<dim3(static_cast<unsigned>(n_a + n_b), static_cast<unsigned>(batch)), kSummaryThreads,
                        0, stream>>>(a, n_a, out_a, b, n_b, out_b);
  return cudaGetLastError();
}

cudaError_t launch_tile_ranges(const TileSummary* rows, int64_t n_rows, const TileTokens& row_tokens,
                               const TileSummary* cols, int64_t n_cols, const TileTokens& col_tokens,
                               int64_t batch, const MaskParams& mask, bool rows_are_q, TileRange* out,
                               cudaStream_t stream) {
  if (batch == 0 || n_rows == 0) return cudaSuccess;
  if (batch > 65535) return cudaErrorInvalidValue;
  // tokens_interact gives a lane at most 4 tokens of the key side
  if ((rows_are_q ? col_tokens.tile : row_tokens.tile) > kMaxTileTokens) return cudaErrorInvalidValue;
  if (n_rows > INT_MAX) return cudaErrorInvalidValue;
  tile_range_kernel<<<dim3(static_cast<unsigned>(n_rows), static_cast<unsigned>(batch)),
                      kRangeWarps * 32, 0, stream>>>(rows, n_rows, row_tokens, cols, n_cols, col_tokens,
                                                     mask, rows_are_q, out);
  return cudaGetLastError();
}

}  // namespace jaxcp::cuda
