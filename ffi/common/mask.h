// The mask model (README, "The mask model"), shared by host and device code. A (query, key) pair
// may interact iff all of: the same segment id, not 0 (padding); causal: kv_pos <= q_pos;
// window: q_pos - window_left <= kv_pos <= q_pos + window_right (each side when >= 0); chunk:
// floor(q_pos / C) == floor(kv_pos / C). The mask depends only on per-token (segment id,
// position), never on memory order.
#pragma once
#include <cstdint>
#include <climits>

#if defined(__CUDACC__)
#define JAXCP_HD __host__ __device__ __forceinline__
#else
#define JAXCP_HD inline
#endif

namespace jaxcp {

// Mask parameters as passed through FFI attributes. Negative window bounds mean unbounded,
// chunk_size <= 0 means no chunking.
struct MaskParams {
  bool causal = false;
  int64_t window_left = -1;
  int64_t window_right = -1;
  int64_t chunk_size = 0;
};

// Floor division (positions may be negative with bottom-right alignment).
JAXCP_HD int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// Per-element mask, those rules in the form the kernels test them: a query row becomes its
// segment and an interval [lo, hi] of allowed key positions (causal, window and chunk folded in,
// int32-clamped; keys share the row's chunk exactly when their position lies in the chunk's
// interval), a key its (segment, position). Padding rows (segment 0), rows marked invalid and
// rows whose interval is empty get an empty [lo, hi].
struct alignas(16) RowMask {
  int32_t seg, lo, hi;
};
struct alignas(8) ColMask {
  int32_t seg, pos;
};

JAXCP_HD RowMask make_row_mask(bool valid, int32_t seg, int32_t pos, const MaskParams& m) {
  int64_t lo = INT32_MIN, hi = INT32_MAX;
  if (m.causal) hi = hi < pos ? hi : pos;
  if (m.window_left >= 0) {
    const int64_t l = static_cast<int64_t>(pos) - m.window_left;
    lo = lo > l ? lo : l;
  }
  if (m.window_right >= 0) {
    const int64_t h = static_cast<int64_t>(pos) + m.window_right;
    hi = hi < h ? hi : h;
  }
  if (m.chunk_size > 0) {
    const int64_t c0 = floor_div(pos, m.chunk_size) * m.chunk_size;
    lo = lo > c0 ? lo : c0;
    hi = hi < c0 + m.chunk_size - 1 ? hi : c0 + m.chunk_size - 1;
  }
  RowMask r;
  r.seg = seg;
  if (!valid || seg == 0 || lo > hi) {
    r.lo = INT32_MAX;
    r.hi = INT32_MIN;
  } else {
    r.lo = static_cast<int32_t>(lo < INT32_MIN ? INT32_MIN : lo);
    r.hi = static_cast<int32_t>(hi > INT32_MAX ? INT32_MAX : hi);
  }
  return r;
}

JAXCP_HD ColMask make_col_mask(bool valid, int32_t seg, int32_t pos) {
  ColMask c;
  c.seg = valid ? seg : 0;  // seg 0 never matches a live row (live rows have seg != 0)
  c.pos = pos;
  return c;
}

JAXCP_HD bool allowed(const RowMask& r, const ColMask& c) {
  return (c.seg == r.seg) & (c.pos >= r.lo) & (c.pos <= r.hi);
}

// Summary of a tile of tokens: ranges of segment ids and positions. Used to classify a
// (query tile, key tile) pair without looking at every pair.
struct TileSummary {
  int32_t seg_min, seg_max, pos_min, pos_max;
};

enum class TileClass : int { kSkip = 0, kPartial = 1, kFull = 2 };

JAXCP_HD TileClass classify_tiles(const TileSummary& q, const TileSummary& kv,
                                  const MaskParams& m) {
  // Segments: disjoint ranges or an all-padding side means nothing interacts.
  if (q.seg_max < kv.seg_min || kv.seg_max < q.seg_min) return TileClass::kSkip;
  if (q.seg_max == 0 || kv.seg_max == 0) return TileClass::kSkip;
  // d = q_pos - kv_pos ranges over [dmin, dmax] (a superset across documents).
  const int64_t dmin = static_cast<int64_t>(q.pos_min) - kv.pos_max;
  const int64_t dmax = static_cast<int64_t>(q.pos_max) - kv.pos_min;
  if (m.causal && dmax < 0) return TileClass::kSkip;
  if (m.window_left >= 0 && dmin > m.window_left) return TileClass::kSkip;
  if (m.window_right >= 0 && -dmax > m.window_right) return TileClass::kSkip;
  bool chunk_full = true;
  if (m.chunk_size > 0) {
    const int64_t qc0 = floor_div(q.pos_min, m.chunk_size), qc1 = floor_div(q.pos_max, m.chunk_size);
    const int64_t kc0 = floor_div(kv.pos_min, m.chunk_size), kc1 = floor_div(kv.pos_max, m.chunk_size);
    if (qc1 < kc0 || kc1 < qc0) return TileClass::kSkip;
    chunk_full = (qc0 == qc1 && kc0 == kc1 && qc0 == kc0);
  }
  // Full: one real document on both sides and every position rule holds for every pair.
  const bool one_doc = q.seg_min == q.seg_max && kv.seg_min == kv.seg_max && q.seg_min == kv.seg_min;
  if (!one_doc || !chunk_full) return TileClass::kPartial;
  if (m.causal && dmin < 0) return TileClass::kPartial;
  if (m.window_left >= 0 && dmax > m.window_left) return TileClass::kPartial;
  if (m.window_right >= 0 && -dmin > m.window_right) return TileClass::kPartial;
  return TileClass::kFull;
}

}  // namespace jaxcp
