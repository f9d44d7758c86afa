// Forward launchers and heuristics: which kernel runs (fwd_use_sm90), the tile plan both kernels
// read (its layout in the plan buffer, and the launches that build it), and attention_fwd, which
// hands the plan to the sm_80 kernel (fwd_sm80.cu) or the sm_90a kernel (fwd_sm90.cu).
#include <climits>

#include "fwd.cuh"

namespace jaxcp::cuda {
namespace detail {

// Both kernels' plans: the sm_80 kernel's fixed query tiles (q_sum, q_range, order) and the
// sm_90a kernel's document tiles (doc_*); key summaries sized for the narrower key tiles.
struct FwdPlanLayout {
  size_t q_sum, kv_sum, q_range, order, bytes;
  size_t doc_windows, doc_bits, doc_starts, doc_counts, doc_offsets, doc_total, doc_widest_keys, doc_tiles;
};

FwdPlanLayout fwd_plan_layout(const AttentionShape& s) {
  const int64_t nq = ceil_div64(s.q_len, kFwdBlockM), nkv = ceil_div64(s.kv_len, kFwdBlockN);
  const int64_t slots = s.batch * static_cast<int64_t>(doc_tile_capacity(s.q_len));
  WorkspaceLayout w;
  FwdPlanLayout r;
  r.q_sum = w.take(sizeof(TileSummary) * s.batch * nq);
  r.kv_sum = w.take(sizeof(TileSummary) * s.batch * nkv);
  r.q_range = w.take(sizeof(TileRange) * s.batch * nq);
  r.order = w.take(sizeof(int) * s.batch * nq);
  r.doc_windows = w.take(sizeof(TileSummary) * s.batch * s.kv_len);
  r.doc_bits = w.take(sizeof(uint32_t) * s.batch * ceil_div64(s.q_len, 32));
  r.doc_starts = w.take(sizeof(int) * slots);
  r.doc_counts = w.take(sizeof(int) * s.batch);
  r.doc_offsets = w.take(sizeof(int) * s.batch);
  r.doc_total = w.take(sizeof(int));
  r.doc_widest_keys = w.take(sizeof(int));
  r.doc_tiles = w.take(sizeof(DocTile) * slots);
  r.bytes = w.bytes;
  return r;
}

// The plan's pieces in a buffer laid out by fwd_plan_layout.
struct FwdPlanPointers {
  TileSummary *q_sum, *kv_sum;
  TileRange* q_range;
  int* order;
  DocTileWorkspace doc;
};

FwdPlanPointers fwd_plan_pointers(const FwdPlanLayout& l, void* plan) {
  char* base = static_cast<char*>(plan);
  return {reinterpret_cast<TileSummary*>(base + l.q_sum), reinterpret_cast<TileSummary*>(base + l.kv_sum),
          reinterpret_cast<TileRange*>(base + l.q_range), reinterpret_cast<int*>(base + l.order),
          DocTileWorkspace{reinterpret_cast<TileSummary*>(base + l.doc_windows),
                           reinterpret_cast<uint32_t*>(base + l.doc_bits), reinterpret_cast<int*>(base + l.doc_starts),
                           reinterpret_cast<int*>(base + l.doc_counts), reinterpret_cast<int*>(base + l.doc_offsets),
                           reinterpret_cast<int*>(base + l.doc_total), reinterpret_cast<int*>(base + l.doc_widest_keys),
                           reinterpret_cast<DocTile*>(base + l.doc_tiles)}};
}

// The kernels' tiling for these arguments; false for arguments no kernel takes (the launchers
// then return cudaErrorInvalidValue).
struct FwdTiling {
  bool sm90;
  int block_n;
  int64_t nq, nkv;
};

bool fwd_tiling(const AttentionArgs& a, FwdTiling* t) {
  const AttentionShape& s = a.shape;
  if (!attention_fwd_head_dim_supported(a)) return false;
  if (s.batch < 0 || s.q_len < 0 || s.kv_len < 0 || s.q_heads < 0 || s.kv_heads <= 0 ||
      s.q_heads % s.kv_heads != 0)
    return false;
  // The sm_90a kernel steps over wider key tiles; the plan (sized for kFwdBlockN) fits both.
  t->sm90 = fwd_use_sm90(a);
  t->block_n = t->sm90 ? fwd_sm90_block_n(s.head_dim, s.v_dim()) : kFwdBlockN;
  t->nq = ceil_div64(s.q_len, kFwdBlockM);
  t->nkv = ceil_div64(s.kv_len, t->block_n);
  return !(s.batch > 65535 || s.q_heads > 65535 || t->nq > INT_MAX || t->nkv > INT_MAX || s.q_len > INT_MAX ||
           s.kv_len > INT_MAX);
}

// Both launchers' start: the tiling and the plan's pieces in `plan`. cudaErrorInvalidValue for
// arguments no kernel takes or a plan buffer too small; *empty for calls with nothing to compute.
cudaError_t fwd_plan_for(const AttentionArgs& a, void* plan, size_t plan_bytes, FwdTiling* t, FwdPlanPointers* pl,
                         bool* empty) {
  const AttentionShape& s = a.shape;
  if (!fwd_tiling(a, t)) return cudaErrorInvalidValue;
  *empty = s.batch == 0 || s.q_len == 0 || s.q_heads == 0;
  if (*empty) return cudaSuccess;
  const FwdPlanLayout layout = fwd_plan_layout(s);
  if (plan_bytes < layout.bytes || (layout.bytes > 0 && plan == nullptr)) return cudaErrorInvalidValue;
  *pl = fwd_plan_pointers(layout, plan);
  return cudaSuccess;
}

}  // namespace detail

// Every shape with a positive scale, short windows included: forward, sm_80 time / sm_90a time on
// an H200 / H100, 2 x 8k with documents of 1k, D 128: window 256 1.45-1.46x / 1.47-1.48x, window
// 128 1.37x (H200), window 64 1.17x / 1.15-1.18x; window 256 at D 64 1.33-1.34x / 1.26-1.34x, at
// D 256 1.96x / 1.87-1.88x, at D 96 / 192 2.7-3.9x (padded by the sm_80 kernel); 4 x 16k with
// documents of 4k, window 256: 1.46x / 1.46-1.51x. The kernel options may ask for the sm_80 kernel.
bool fwd_use_sm90(const AttentionArgs& a) {
  if (a.kernel.sm80_only) return false;
  if (!(a.scale > 0.f)) return false;  // the kernel folds the scale into exp2 (online_softmax)
  return sm90_kernels_available();
}

bool attention_fwd_head_dim_supported(const AttentionArgs& a) {
  const int64_t d = a.shape.head_dim, dv = a.shape.v_dim();
  if (dv != d) return sm90_value_head_dim(d, dv) && fwd_use_sm90(a);
  return sm80_head_dim(d) || (sm90_head_dim(d) && fwd_use_sm90(a));
}

size_t attention_fwd_plan_bytes(const AttentionArgs& a) { return detail::fwd_plan_layout(a.shape).bytes; }

size_t attention_fwd_workspace_bytes(const AttentionArgs&) { return sizeof(int); }  // the tile counter

cudaError_t attention_fwd_plan(const AttentionArgs& a, const int32_t* q_seg, const int32_t* q_pos,
                               const int32_t* kv_seg, const int32_t* kv_pos, void* plan, size_t plan_bytes,
                               cudaStream_t stream) {
  const AttentionShape& s = a.shape;
  detail::FwdTiling t;
  detail::FwdPlanPointers pl;
  bool empty;
  if (cudaError_t err = detail::fwd_plan_for(a, plan, plan_bytes, &t, &pl, &empty); err || empty) return err;
  const TileTokens q_tok{q_seg, q_pos, s.q_len, kFwdBlockM}, kv_tok{kv_seg, kv_pos, s.kv_len, t.block_n};
  if (t.sm90)  // key tile summaries: the plan's key windows at the tiles' starts
    return launch_doc_tile_plan(q_tok, t.nkv, kv_tok, s.batch, a.mask, a.kernel.fwd_fixed_tiles, pl.doc,
                                stream);
  cudaError_t err;
  if ((err = launch_tile_summaries(q_tok, pl.q_sum, kv_tok, pl.kv_sum, s.batch, stream))) return err;
  if ((err = launch_tile_ranges(pl.q_sum, t.nq, q_tok, pl.kv_sum, t.nkv, kv_tok, s.batch, a.mask,
                                /*rows_are_q=*/true, pl.q_range, stream)))
    return err;
  return launch_tile_schedule(pl.q_range, s.batch * t.nq, /*index_order_max_work=*/0, pl.order, stream);
}

cudaError_t attention_fwd(const AttentionArgs& a, DType dtype, const void* q, const void* k,
                          const void* v, const int32_t* q_seg, const int32_t* q_pos,
                          const int32_t* kv_seg, const int32_t* kv_pos, const void* plan,
                          size_t plan_bytes, void* out, float* lse, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  const AttentionShape& s = a.shape;
  detail::FwdTiling t;
  detail::FwdPlanPointers pl;
  bool empty;
  // The kernels only read the plan (it may be shared with other calls).
  if (cudaError_t err = detail::fwd_plan_for(a, const_cast<void*>(plan), plan_bytes, &t, &pl, &empty); err || empty)
    return err;
  if (workspace_bytes < attention_fwd_workspace_bytes(a) || workspace == nullptr) return cudaErrorInvalidValue;
  auto* tile_counter = static_cast<int*>(workspace);
  if (t.sm90) {  // zeroed per call: the plan may be another call's
    if (cudaError_t err = cudaMemsetAsync(tile_counter, 0, sizeof(int), stream)) return err;
  }

  detail::FwdParams p;
  p.q = q; p.k = k; p.v = v;
  p.q_seg = q_seg; p.q_pos = q_pos; p.kv_seg = kv_seg; p.kv_pos = kv_pos;
  p.out = out; p.lse = lse;
  p.Sq = s.q_len; p.Skv = s.kv_len;
  p.Hq = static_cast<int>(s.q_heads);
  p.group = static_cast<int>(s.group());
  p.q_row = s.q_heads * s.head_dim;
  p.kv_row = s.kv_heads * s.head_dim;
  p.o_row = s.q_heads * s.v_dim();
  p.scale_log2 = a.scale * kLog2e;
  p.mask = a.mask;
  p.q_sum = pl.q_sum; p.kv_sum = pl.kv_sum; p.q_range = pl.q_range; p.order = pl.order;
  p.tile_counter = tile_counter;
  p.doc_tiles = pl.doc.tiles;
  p.doc_total = pl.doc.total;
  p.doc_widest_keys = pl.doc.widest_keys;
  p.key_windows = pl.doc.key_windows;
  p.nq = t.sm90 ? doc_tile_capacity(s.q_len) : static_cast<int>(t.nq);  // sm_90a: tile slots per row
  p.nkv = static_cast<int>(t.nkv);
  if (t.sm90) return launch_fwd_sm90(p, s.batch, dtype, s.head_dim, s.v_dim(), stream);
  return launch_fwd_sm80(p, s.batch, dtype, s.head_dim, stream);
}

}  // namespace jaxcp::cuda
