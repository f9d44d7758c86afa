// Document-aligned query tiles for the sm_90a forward. Fixed 128-row tiles cut through
// documents: a tile that starts inside a document shares its first key tiles with the previous
// document's end and crosses the causal diagonal of two key tiles, so short documents cost up
// to 1.6x their allowed area (tools/doc_alignment_probe.py). Here a query tile starts at every
// start of a run of one segment id that is at least kAnchorRun tokens long ("anchor"), and
// every 128 rows after it until the next anchor; shorter runs ride along in the tiles of the
// run before them. For each such tile the plan gives its summary and the exact span
// [kv_lo, kv_hi) of keys that any of its rows may attend: the kernel walks key tiles of its
// block N from kv_lo, so a tile of a document's rows meets key tiles that start where the
// document starts, as with per-document (cu_seqlens) tiling.
//
// Kernels, in stream order: key windows (the summary of the block N keys from every key, so
// that the kernel classifies a key tile starting anywhere with one load; at a key tile's start,
// its summary) and, in the same launch, anchor bits (one bit per token), tile starts (one block
// per batch row, block-wide scans over the bit words), row offsets (one block; only for more
// than kInlineOffsetRows rows, otherwise summed by the plan's blocks), per-tile plan (one block
// per tile slot). On a 0.6 ms forward these took 48 us, 29 of them the plan's (H100).
#include <cub/block/block_scan.cuh>

#include <climits>

#include "plan.cuh"

namespace jaxcp::cuda {
namespace {

constexpr int kAnchorRun = 64;  // shortest run of one segment id that starts tiles of its own
constexpr int kStartThreads = 512;
constexpr int kOffsetThreads = 1024;
constexpr int kPlanThreads = kFwdBlockM;  // one thread per row of a tile, then per key of a key tile
constexpr int kInlineOffsetRows = 8 * kPlanThreads;  // up to this many rows, plan blocks sum the counts
constexpr int kMaxProbed = 4;  // key tiles probed key by key from each end of a tile's range

struct MergeSummaries {  // merge_summaries as a scan operator
  __device__ TileSummary operator()(const TileSummary& a, const TileSummary& b) const {
    return detail::merge_summaries(a, b);
  }
};

// One launch for the two passes over the tokens that the tile starts and the plan need.
// Key windows: windows[b][x] = summary of keys [x, min(x + window, len)), for every x: block c
// (window threads) takes keys [c w, (c + 1) w) and the next w; each window is a suffix of the
// first part (a reverse scan) merged with a prefix of the second (a forward scan; thread t's
// own). Anchor bits (when bits is set): bits[b][w] bit i says that query token 32 w + i starts
// a run of kAnchorRun tokens of one segment id; block c takes query tokens [c w, (c + 1) w).
// (Checking the run's last token is enough for packed documents, which never reuse a segment id
// inside kAnchorRun tokens; any other input only gets different tiles, never wrong results.)
template <int kWindow>
__global__ void __launch_bounds__(kWindow) key_window_anchor_bits_kernel(TileTokens kv, int64_t n_kv_tiles,
                                                                         TileSummary* __restrict__ windows,
                                                                         const int32_t* __restrict__ q_seg,
                                                                         int64_t q_len, int64_t words,
                                                                         uint32_t* __restrict__ bits) {
  static_assert(kWindow % 32 == 0, "anchor bits are written a warp's word at a time");
  using Scan = cub::BlockScan<TileSummary, kWindow>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ TileSummary suffixes[kWindow];
  const int t = threadIdx.x;
  const int64_t b = blockIdx.y, c = blockIdx.x;
  if (c < n_kv_tiles) {  // the same for the whole block
    const int64_t x = c * kWindow + t, len = kv.len;
    auto token = [&](int64_t i) {
      return i < len ? detail::token_summary(kv.seg[b * len + i], kv.pos[b * len + i]) : detail::empty_summary();
    };
    // Suffixes of this block's keys: thread t scans key (block end - 1 - t), so its inclusive scan
    // is the suffix from that key.
    TileSummary suffix;
    Scan(scan_tmp).InclusiveScan(token(c * kWindow + kWindow - 1 - t), suffix, MergeSummaries{});
    __syncthreads();
    suffixes[kWindow - 1 - t] = suffix;  // keys [c w + (w - 1 - t), (c + 1) w)
    TileSummary prefix;                  // keys [(c + 1) w, (c + 1) w + t)
    Scan(scan_tmp).ExclusiveScan(token((c + 1) * kWindow + t), prefix, detail::empty_summary(), MergeSummaries{});
    __syncthreads();
    if (x < len) windows[b * len + x] = detail::merge_summaries(suffixes[t], prefix);
  }
  const int64_t i = c * kWindow + t;
  if (bits != nullptr && c * kWindow < words * 32) {  // the same for the whole block
    const int32_t* s = q_seg + b * q_len;
    bool anchor = false;
    if (i < q_len) {
      anchor = i == 0 || (s[i] != s[i - 1] && i + kAnchorRun - 1 < q_len && s[i + kAnchorRun - 1] == s[i]);
    }
    const unsigned word = __ballot_sync(0xffffffffu, anchor);
    if (t % 32 == 0 && i / 32 < words) bits[b * words + i / 32] = word;  // i: the warp's first token
  }
}

// Calls emit(x) for the tile starts among tokens [lo, hi) of a stretch whose last anchor is cur
// (< lo): the tokens cur + kFwdBlockM k.
template <class Emit>
__device__ void stretch_starts(int64_t lo, int64_t hi, int64_t cur, Emit&& emit) {
  for (int64_t x = cur + ((lo - cur + kFwdBlockM - 1) / kFwdBlockM) * kFwdBlockM; x < hi; x += kFwdBlockM) emit(x);
}

// The tile starts of one batch row in increasing order: starts[b][0, counts[b]). A token
// starts a tile iff it is an anchor or lies a multiple of kFwdBlockM after the last anchor
// before it, so each thread needs only that anchor (a max-scan over the words) and its output
// index (a sum-scan). Rows whose starts would not fit `capacity` (only inputs that reuse segment
// ids inside kAnchorRun tokens), and every row when fixed_grid, get the fixed grid.
__global__ void __launch_bounds__(kStartThreads) doc_tile_starts_kernel(const uint32_t* __restrict__ bits,
                                                                        int64_t len, int64_t words, int capacity,
                                                                        bool fixed_grid, int* __restrict__ starts,
                                                                        int* __restrict__ counts,
                                                                        int* __restrict__ widest_keys) {
  using Scan = cub::BlockScan<int64_t, kStartThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int64_t b = blockIdx.x;
  int* out = starts + b * capacity;
  int64_t total = 0;
  if (!fixed_grid) {
    int64_t anchor_carry = 0;
    for (int64_t w0 = 0; w0 < words; w0 += kStartThreads) {
      const int64_t w = w0 + threadIdx.x, base = 32 * w, end = min(base + 32, len);
      const uint32_t m = w < words ? bits[b * words + w] : 0u;
      int64_t cur = 0, last = m ? base + 31 - __clz(static_cast<int>(m)) : -1, agg = 0;
      Scan(scan_tmp).ExclusiveScan(last, cur, anchor_carry, [](int64_t x, int64_t y) { return max(x, y); }, agg);
      __syncthreads();
      anchor_carry = max(anchor_carry, agg);
      // The word's starts: stretches between its anchors. Walked twice: count, then write.
      auto walk = [&](auto&& emit) {
        int64_t lo = base, a = cur;
        for (uint32_t rest = m; rest != 0u; rest &= rest - 1u) {
          const int64_t x = base + __ffs(static_cast<int>(rest)) - 1;
          stretch_starts(lo, x, a, emit);
          emit(x);
          a = x;
          lo = x + 1;
        }
        stretch_starts(lo, end, a, emit);
      };
      int64_t n = 0, idx = 0;
      walk([&](int64_t) { ++n; });
      Scan(scan_tmp).ExclusiveSum(n, idx, agg);
      __syncthreads();
      idx += total;
      total += agg;
      walk([&](int64_t x) {
        if (idx < capacity) out[idx] = static_cast<int>(x);
        ++idx;
      });
    }
  }
  if (fixed_grid || total > capacity) {
    __syncthreads();  // the walks' writes come first
    total = (len + kFwdBlockM - 1) / kFwdBlockM;  // <= capacity
    for (int64_t i = threadIdx.x; i < total; i += kStartThreads) out[i] = static_cast<int>(i * kFwdBlockM);
  }
  if (threadIdx.x == 0) counts[b] = static_cast<int>(total);
  if (b == 0 && threadIdx.x == 0) *widest_keys = 0;  // raised by the plan kernel, which runs next
}

// offsets[b] = tiles of the rows before b; *total = tiles of all rows.
__global__ void __launch_bounds__(kOffsetThreads) doc_tile_offsets_kernel(const int* __restrict__ counts,
                                                                          int64_t batch, int* __restrict__ offsets,
                                                                          int* __restrict__ total) {
  using Scan = cub::BlockScan<int, kOffsetThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  int carry = 0;
  for (int64_t b0 = 0; b0 < batch; b0 += kOffsetThreads) {
    const int64_t b = b0 + threadIdx.x;
    int excl = 0, agg = 0;
    Scan(scan_tmp).ExclusiveSum(b < batch ? counts[b] : 0, excl, agg);
    __syncthreads();
    if (b < batch) offsets[b] = carry + excl;
    carry += agg;
  }
  if (threadIdx.x == 0) *total = carry;
}

// Min and max over the plan block's threads (every thread gets both).
__device__ int2 block_min_max(int mn, int mx) {
  __shared__ int2 part[kPlanThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    mn = min(mn, __shfl_xor_sync(0xffffffffu, mn, o));
    mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  }
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = make_int2(mn, mx);
  __syncthreads();
  int2 r = part[0];
  CUTE_UNROLL
  for (int w = 1; w < kPlanThreads / 32; ++w) r = make_int2(min(r.x, part[w].x), max(r.y, part[w].y));
  __syncthreads();  // part may be reused
  return r;
}

// One block per tile slot (b, i): the tile's rows, summary and key span. Thread t holds row t,
// then key t of a probed key tile. The span starts from the range of key tiles (of block_n keys)
// that the summaries do not skip and is then narrowed on the keys to the first and last one that
// the rows may attend (at most kMaxProbed tiles from each end; beyond that the span keeps the
// tile's edge, never wrong).
// The key tiles' summaries are the key windows at their starts.
__global__ void __launch_bounds__(kPlanThreads) doc_tile_plan_kernel(
    const int* __restrict__ starts, const int* __restrict__ counts, const int* __restrict__ offsets, int capacity,
    TileTokens q, const TileSummary* __restrict__ windows, int64_t n_kv_tiles, TileTokens kv, MaskParams mask,
    int64_t batch, DocTile* __restrict__ tiles, int* __restrict__ total, int* __restrict__ widest_keys) {
  __shared__ int32_t row_seg[kFwdBlockM];
  __shared__ TileSummary sum_part[kPlanThreads / 32];
  __shared__ int offset_part[kPlanThreads / 32];
  __shared__ int run_at[kMaxTileRuns + 1];  // the runs' first rows, then the tile's row count
  const int t = threadIdx.x;
  const int64_t i = blockIdx.x, b = blockIdx.y;
  const int count = counts[b];
  if (i >= count) return;  // the whole block
  // Tiles of the rows before b (and of all rows, written once): summed here up to
  // kInlineOffsetRows rows, which spares a launch; beyond, doc_tile_offsets_kernel ran first.
  int offset = 0;
  if (offsets != nullptr) {
    offset = offsets[b];
  } else {
    int part = 0;
    for (int64_t r = t; r < b; r += kPlanThreads) part += counts[r];
    part = __reduce_add_sync(0xffffffffu, part);
    if (t % 32 == 0) offset_part[t / 32] = part;
    __syncthreads();
    for (int w = 0; w < kPlanThreads / 32; ++w) offset += offset_part[w];
    if (b == batch - 1 && i == 0 && t == 0) *total = offset + count;
  }
  const int* row_starts = starts + b * capacity;
  const int q0 = row_starts[i];
  const int q1 = i + 1 < count ? row_starts[i + 1] : static_cast<int>(q.len);
  const int rows = q1 - q0;
  int32_t seg = 0, pos = 0;
  if (t < rows) {
    const int64_t at = b * q.len + q0 + t;
    seg = q.seg[at];
    pos = q.pos[at];
    row_seg[t] = seg;
  }
  __syncthreads();  // row_seg written; offset_part read
  // The summary of rows [lo, hi) (all threads get it).
  auto rows_summary = [&](int lo, int hi) {
    TileSummary mine = t >= lo && t < hi ? detail::token_summary(seg, pos) : detail::empty_summary();
    mine = detail::warp_merge_summary(mine);
    if (t % 32 == 0) sum_part[t / 32] = mine;
    __syncthreads();
    TileSummary sum = sum_part[0];
    CUTE_UNROLL
    for (int w = 1; w < kPlanThreads / 32; ++w) sum = detail::merge_summaries(sum, sum_part[w]);
    __syncthreads();  // sum_part may be reused
    return sum;
  };
  // Runs of one segment id among the rows (a document under kAnchorRun tokens rides in the tile
  // of the one before it). Each run's keys are found on its own summary: on the tile's, a rider's
  // positions from 0 kept every key tile of the long document before it unskipped, the probes
  // gave up, and the tile walked that whole document (on 4 x 16k, window 1024: 16 such tiles
  // made the forward 19% slower, H100). More than kMaxTileRuns runs: the tile's summary as one run.
  const bool run_start = t < rows && (t == 0 || row_seg[t - 1] != seg);
  const unsigned starts_mask = __ballot_sync(0xffffffffu, run_start);
  if (t % 32 == 0) offset_part[t / 32] = __popc(starts_mask);
  __syncthreads();
  int runs = 0, before = 0;
  for (int w = 0; w < kPlanThreads / 32; ++w) {
    before += w < t / 32 ? offset_part[w] : 0;
    runs += offset_part[w];
  }
  const int run_index = before + __popc(starts_mask & ((1u << (t % 32)) - 1u));
  if (runs > kMaxTileRuns) {
    if (t == 0) {
      run_at[0] = 0;
      run_at[1] = rows;
    }
    runs = 1;
  } else {
    if (run_start) run_at[run_index] = t;
    if (t == 0) run_at[runs] = rows;
  }
  __syncthreads();

  const TileSummary* row_windows = windows + b * kv.len;
  TileSummary sum;  // of the run being placed
  auto unskipped = [&](int64_t c) {
    return classify_tiles(sum, row_windows[c * kv.tile], mask) != TileClass::kSkip;
  };
  // First and last unskipped key tile in [lo, hi] (first > last: none).
  auto unskipped_range = [&](int64_t lo, int64_t hi) {
    int first = INT_MAX, last = -1;
    for (int64_t c = lo + t; c <= hi; c += kPlanThreads) {
      if (unskipped(c)) {
        first = min(first, static_cast<int>(c));
        last = max(last, static_cast<int>(c));
      }
    }
    return block_min_max(first, last);
  };
  // The first and last key of key tile c that some row of the run may attend (INT_MAX / -1: none),
  // each key tested against the run's summary: exact for a run of one document whose positions
  // leave no gap wider than a window (e.g. consecutive, or striped over context-parallel ranks),
  // a superset otherwise (never wrong). Testing every row (128 per key) took most of this kernel.
  auto span_of = [&](int64_t c) {
    const int64_t k0 = c * kv.tile;
    bool any = false;
    if (t < min(static_cast<int64_t>(kv.tile), kv.len - k0)) {
      const int64_t at = b * kv.len + k0 + t;
      any = classify_tiles(sum, detail::token_summary(kv.seg[at], kv.pos[at]), mask) != TileClass::kSkip;
    }
    return block_min_max(any ? t : INT_MAX, any ? t : -1);
  };
  int64_t kv_lo = INT_MAX, kv_hi = 0;
  for (int run = 0; run < runs; ++run) {
    const int lo = run_at[run], hi = run_at[run + 1];
    sum = rows_summary(lo, hi);
    const int2 range = unskipped_range(0, n_kv_tiles - 1);
    int c = range.x, e = range.y;
    if (c > e) continue;
    // The first key: probe from the front; c ends on the first tile not known to have none.
    bool found = false;
    int64_t run_lo = 0, run_hi = 0;
    for (int p = 0; p < kMaxProbed && c <= e && !found; ++p) {
      const int2 s = span_of(c);
      found = s.x != INT_MAX;
      if (found) run_lo = static_cast<int64_t>(c) * kv.tile + s.x;
      else c = unskipped_range(c + 1, e).x;  // INT_MAX: none left
    }
    if (c > e) continue;
    if (!found) run_lo = static_cast<int64_t>(c) * kv.tile;
    // The last key: probe from the back, down to c at most.
    found = false;
    for (int p = 0; p < kMaxProbed && e >= c && !found; ++p) {
      const int2 s = span_of(e);
      found = s.y >= 0;
      if (found) run_hi = static_cast<int64_t>(e) * kv.tile + s.y + 1;
      else e = unskipped_range(c, e - 1).y;  // -1: none left
    }
    if (!found) run_hi = e >= c ? min(static_cast<int64_t>(e + 1) * kv.tile, kv.len) : 0;
    if (run_lo < run_hi) {
      kv_lo = min(kv_lo, run_lo);
      kv_hi = max(kv_hi, run_hi);
    }
  }
  if (kv_lo >= kv_hi) kv_lo = kv_hi = 0;
  const TileSummary qsum = runs == 1 ? sum : rows_summary(0, rows);
  if (t == 0) {
    tiles[offset + i] = DocTile{static_cast<int>(b), q0, rows, static_cast<int>(kv_lo),
                                static_cast<int>(kv_hi), {0, 0, 0}, qsum};
    atomicMax(widest_keys, static_cast<int>(kv_hi - kv_lo));
  }
}

}  // namespace

int doc_tile_capacity(int64_t len) {
  return static_cast<int>(ceil_div64(len, kFwdBlockM) + ceil_div64(len, kAnchorRun) + 1);
}

cudaError_t launch_doc_tile_plan(const TileTokens& q, int64_t n_kv_tiles, const TileTokens& kv, int64_t batch,
                                 const MaskParams& mask, bool fixed_grid, const DocTileWorkspace& ws,
                                 cudaStream_t stream) {
  if (batch == 0 || q.len == 0) return cudaSuccess;
  if (batch > 65535 || q.len > INT_MAX - 2 * kFwdBlockM || kv.len > INT_MAX - 2 * kMaxTileTokens ||
      (kv.tile != 64 && kv.tile != 128))
    return cudaErrorInvalidValue;
  const int64_t words = ceil_div64(q.len, 32);
  const int capacity = doc_tile_capacity(q.len);
  cudaError_t err;
  const int64_t kv_blocks = kv.len > 0 ? n_kv_tiles : 0;
  const int64_t bit_blocks = fixed_grid ? 0 : ceil_div64(q.len, kv.tile);
  const int64_t blocks = kv_blocks > bit_blocks ? kv_blocks : bit_blocks;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  if (blocks > 0) {
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(batch));
    uint32_t* bits = fixed_grid ? nullptr : ws.anchor_bits;
    if (kv.tile == 128)
      key_window_anchor_bits_kernel<128><<<grid, 128, 0, stream>>>(kv, kv_blocks, ws.key_windows, q.seg, q.len, words, bits);
    else
      key_window_anchor_bits_kernel<64><<<grid, 64, 0, stream>>>(kv, kv_blocks, ws.key_windows, q.seg, q.len, words, bits);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  doc_tile_starts_kernel<<<static_cast<unsigned>(batch), kStartThreads, 0, stream>>>(
      ws.anchor_bits, q.len, words, capacity, fixed_grid, ws.starts, ws.counts, ws.widest_keys);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  const bool inline_offsets = batch <= kInlineOffsetRows;
  if (!inline_offsets) {
    doc_tile_offsets_kernel<<<1, kOffsetThreads, 0, stream>>>(ws.counts, batch, ws.offsets, ws.total);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  doc_tile_plan_kernel<<<dim3(static_cast<unsigned>(capacity), static_cast<unsigned>(batch)), kPlanThreads, 0,
                         stream>>>(ws.starts, ws.counts, inline_offsets ? nullptr : ws.offsets, capacity, q,
                                   ws.key_windows, n_kv_tiles, kv, mask, batch, ws.tiles, ws.total,
                                   ws.widest_keys);
  return cudaGetLastError();
}

}  // namespace jaxcp::cuda
