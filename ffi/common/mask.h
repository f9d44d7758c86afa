// The mask model of DESIGN.md section 1, shared by host and device code.
// A (query token, key token) pair may interact iff every rule below holds;
// the mask depends only on per-token (segment id, position), never on memory order.
#pragma once
#include <cstdint>

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

JAXCP_HD bool pair_allowed(int32_t q_seg, int32_t q_pos, int32_t kv_seg, int32_t kv_pos,
                           const MaskParams& m) {
  if (q_seg != kv_seg || q_seg == 0) return false;
  const int64_t d = static_cast<int64_t>(q_pos) - kv_pos;
  if (m.causal && d < 0) return false;
  if (m.window_left >= 0 && d > m.window_left) return false;
  if (m.window_right >= 0 && -d > m.window_right) return false;
  if (m.chunk_size > 0 && floor_div(q_pos, m.chunk_size) != floor_div(kv_pos, m.chunk_size))
    return false;
  return true;
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
