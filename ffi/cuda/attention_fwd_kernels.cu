// Forward packed-document attention: FA2-style tiles (128 query rows x 64 keys), online softmax
// in float32 (log2 domain), LSE saved. Each block owns one (query tile, head, batch) and walks only
// the key tiles its tile plan does not skip; "full" tiles run without any per-element mask.
#include <climits>

#include "attention_fwd.cuh"
#include "../common/env_flag.h"

namespace jaxcp::cuda {
namespace detail {

template <class Element_, int kHeadDim, int kBlockM, int kBlockN, int kNWarps>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kD = kHeadDim, kBM = kBlockM, kBN = kBlockN, kThreads = kNWarps * 32;
  static_assert(kBM == 16 * kNWarps || kBM == 32 * kNWarps);
  using TiledMma = TiledMMA<typename MmaAtomOf<Element>::type, Layout<Shape<Int<kNWarps>, _1, _1>>,
                            Tile<Int<16 * kNWarps>, _16, _16>>;
  using SmemLayoutQ = SmemLayoutRowMajor<kBM, kD>;
  using SmemLayoutKV = SmemLayoutRowMajor<kBN, kD>;
  using SmemLayoutVt = SmemLayoutTransposed<SmemLayoutKV, kBN, kD>;
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;
  using GmemCopy = GmemTiledCopyAsync<Element, kThreads>;
  using GmemCopyO = GmemTiledCopyPlain<Element, kThreads>;
  static constexpr int kSmemMatBytes = (kBM + 2 * kBN) * kD * int(sizeof(Element));
  static constexpr int kSmemBytes =
      kSmemMatBytes + kBM * int(sizeof(RowMask)) + kBN * int(sizeof(ColMask));
};

template <class KT>
__global__ void __launch_bounds__(KT::kThreads, 1) attention_fwd_kernel(const FwdParams p) {
  using Element = typename KT::Element;
  constexpr int BM = KT::kBM, BN = KT::kBN, D = KT::kD, kThreads = KT::kThreads;
  extern __shared__ __align__(1024) char smem_raw[];

  const int tidx = threadIdx.x;
  // Block -> (tile, head): tiles heaviest first, the heads of a tile on consecutive blocks.
  const int tile = p.order[blockIdx.x / p.Hq];
  const int h = blockIdx.x % p.Hq, b = tile / p.nq, m_block = tile % p.nq, hk = h / p.group;
  const int64_t q0 = static_cast<int64_t>(m_block) * BM;
  const int q_rows = static_cast<int>(p.Sq - q0 < BM ? p.Sq - q0 : BM);
  const TileRange range = p.q_range[static_cast<int64_t>(b) * p.nq + m_block];
  const TileSummary qsum = p.q_sum[static_cast<int64_t>(b) * p.nq + m_block];
  const TileSummary* kv_sum = p.kv_sum + static_cast<int64_t>(b) * p.nkv;

  Element* out_ptr = static_cast<Element*>(p.out) + (static_cast<int64_t>(b) * p.Sq + q0) * p.o_row +
                     static_cast<int64_t>(h) * D;
  float* lse_ptr = p.lse + (static_cast<int64_t>(b) * p.Hq + h) * p.Sq + q0;

  auto kv_class = [&](int j) {
    return tile_class(qsum, kv_sum[j], p.mask, static_cast<int64_t>(j + 1) * BN > p.Skv);
  };
  // First non-skipped tile at or after j, its class in c (every thread calls it).
  auto next_tile = [&](int j, int& c) { return warp_first_unskipped(j, range.y, kv_class, c); };

  int cls = kSkip;
  int j = next_tile(range.x, cls);
  if (j >= range.y) {  // no allowed key for any row of this tile: out 0, lse -inf
    for (int idx = tidx; idx < q_rows * (D / 8); idx += kThreads) {
      const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
      *reinterpret_cast<uint4*>(out_ptr + r * p.o_row + c) = make_uint4(0, 0, 0, 0);
    }
    for (int r = tidx; r < q_rows; r += kThreads) lse_ptr[r] = -INFINITY;
    return;
  }

  // Shared memory: Q | K | V | row masks | column masks.
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem_raw)), typename KT::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename KT::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename KT::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename KT::SmemLayoutVt{});
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename KT::SmemLayoutVtNoSwizzle{});
  RowMask* s_row = reinterpret_cast<RowMask*>(smem_raw + KT::kSmemMatBytes);
  ColMask* s_col = reinterpret_cast<ColMask*>(smem_raw + KT::kSmemMatBytes + BM * sizeof(RowMask));

  const Element* q_ptr = static_cast<const Element*>(p.q) +
                         (static_cast<int64_t>(b) * p.Sq + q0) * p.q_row + static_cast<int64_t>(h) * D;
  const int64_t kv_off = static_cast<int64_t>(b) * p.Skv * p.kv_row + static_cast<int64_t>(hk) * D;
  const Element* k_base = static_cast<const Element*>(p.k) + kv_off;
  const Element* v_base = static_cast<const Element*>(p.v) + kv_off;
  Tensor gQ = make_tensor(make_gmem_ptr(q_ptr), Shape<Int<BM>, Int<D>>{}, make_stride(p.q_row, _1{}));

  typename KT::GmemCopy gmem_copy;
  auto gthr = gmem_copy.get_thread_slice(tidx);
  Tensor tQgQ = gthr.partition_S(gQ);
  Tensor tQsQ = gthr.partition_D(sQ);
  Tensor tKsK = gthr.partition_D(sK);
  Tensor tVsV = gthr.partition_D(sV);
  Tensor cQ = make_identity_tensor(Shape<Int<BM>, Int<D>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<BN>, Int<D>>{});
  Tensor tQcQ = gthr.partition_S(cQ);
  Tensor tKVcKV = gthr.partition_S(cKV);

  auto load_tile = [&](const Element* base, int jt, auto& dst) {
    const int64_t r0 = static_cast<int64_t>(jt) * BN;
    Tensor g = make_tensor(make_gmem_ptr(base + r0 * p.kv_row), Shape<Int<BN>, Int<D>>{},
                           make_stride(p.kv_row, _1{}));
    const int rows = static_cast<int>(p.Skv - r0 < BN ? p.Skv - r0 : BN);
    copy_rows_async(gmem_copy, gthr.partition_S(g), dst, tKVcKV, rows);
  };
  auto load_col = [&](int jt, int c) {
    const int64_t t = static_cast<int64_t>(jt) * BN + c;
    const bool valid = t < p.Skv;
    const int64_t idx = static_cast<int64_t>(b) * p.Skv + (valid ? t : 0);
    return make_col_mask(valid, p.kv_seg[idx], p.kv_pos[idx]);
  };

  typename KT::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<D>>{});

  auto smem_tiled_copy_Q = make_tiled_copy_A(typename KT::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_Q.partition_S(sQ);
  auto smem_tiled_copy_K = make_tiled_copy_B(typename KT::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_K.partition_S(sK);
  auto smem_tiled_copy_V = make_tiled_copy_B(typename KT::SmemCopyAtomT{}, tiled_mma);
  auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_copy_V.partition_S(sVt);

  // Coordinates of this thread's accumulator elements (rows, cols).
  Tensor cS = make_identity_tensor(Shape<Int<BM>, Int<BN>>{});
  Tensor tScS = thr_mma.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  constexpr int kCols = decltype(size<1>(tScS_rc))::value;

  // Prologue: Q, first K tile, masks.
  copy_rows_async(gmem_copy, tQgQ, tQsQ, tQcQ, q_rows);
  load_tile(k_base, j, tKsK);
  cute::cp_async_fence();
  for (int r = tidx; r < BM; r += kThreads) {
    const bool valid = r < q_rows;
    const int64_t idx = static_cast<int64_t>(b) * p.Sq + q0 + (valid ? r : 0);
    s_row[r] = make_row_mask(valid, p.q_seg[idx], p.q_pos[idx], p.mask);
  }
  if (tidx < BN) s_col[tidx] = load_col(j, tidx);

  clear(acc_o);
  Tensor acc_o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
  float row_max[kRows], row_sum[kRows];
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    row_max[mi] = -INFINITY;
    row_sum[mi] = 0.f;
  }

  while (true) {
    int cls_next = kSkip;
    const int jn = next_tile(j + 1, cls_next);
    const bool has_next = jn < range.y;

    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<BN>>{});
    clear(acc_s);
    cp_async_wait<0>();
    __syncthreads();  // K(j) and masks visible; everyone done with V(j-1)
    load_tile(v_base, j, tVsV);
    cute::cp_async_fence();

    gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_tiled_copy_Q, smem_tiled_copy_K,
            smem_thr_copy_Q, smem_thr_copy_K);

    Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) acc_s(i) *= p.scale_log2;
    if (cls == kPartial) {
      RowMask rm[kRows];
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) rm[mi] = s_row[get<0>(tScS_rc(mi, 0))];
      CUTE_UNROLL
      for (int ni = 0; ni < kCols; ++ni) {
        const ColMask cm = s_col[get<1>(tScS_rc(0, ni))];
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi)
          if (!allowed(rm[mi], cm)) s(mi, ni) = -INFINITY;
      }
    }

    // Online softmax (log2 domain; scores scaled above, so any sign of scale works here);
    // rescale O by each row's correction.
    float corr[kRows];
    online_softmax(s, 1.f, row_max, row_sum, corr);
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      CUTE_UNROLL
      for (int di = 0; di < size<1>(acc_o_rc); ++di) acc_o_rc(mi, di) *= corr[mi];
    }

    Tensor rP = convert_type<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_as_A(rP.layout()));
    ColMask cm_next;
    if (has_next && tidx < BN) cm_next = load_col(jn, tidx);

    cp_async_wait<0>();
    __syncthreads();  // V(j) visible; everyone done with K(j) and the masks of j
    if (has_next) {
      load_tile(k_base, jn, tKsK);
      cute::cp_async_fence();
    }
    gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_tiled_copy_V, smem_thr_copy_V);
    if (has_next && tidx < BN) s_col[tidx] = cm_next;
    if (!has_next) break;
    j = jn;
    cls = cls_next;
  }

  // Epilogue: normalise, LSE (natural log), O through shared memory (reusing sQ).
  float lse_r[kRows];
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    const float sum = quad_sum(row_sum[mi]);
    const bool any = sum > 0.f;
    const float inv = any ? 1.f / sum : 0.f;
    lse_r[mi] = any ? (row_max[mi] + __log2f(sum)) * kLn2 : -INFINITY;
    CUTE_UNROLL
    for (int di = 0; di < size<1>(acc_o_rc); ++di) acc_o_rc(mi, di) *= inv;
  }
  if (get<1>(tScS_rc(0, 0)) == 0) {
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const int r = get<0>(tScS_rc(mi, 0));
      if (r < q_rows) lse_ptr[r] = lse_r[mi];
    }
  }

  Tensor rO = convert_type<Element>(acc_o);
  Tensor sO = make_tensor(sQ.data(), typename KT::SmemLayoutQ{});
  auto smem_tiled_copy_O = make_tiled_copy_C(typename KT::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_copy_O = smem_tiled_copy_O.get_thread_slice(tidx);
  Tensor taccOrO = smem_thr_copy_O.retile_S(rO);
  Tensor taccOsO = smem_thr_copy_O.partition_D(sO);
  __syncthreads();  // everyone done reading sQ
  cute::copy(smem_tiled_copy_O, taccOrO, taccOsO);
  __syncthreads();

  Tensor gO = make_tensor(make_gmem_ptr(out_ptr), Shape<Int<BM>, Int<D>>{}, make_stride(p.o_row, _1{}));
  typename KT::GmemCopyO gmem_copy_O;
  auto gthr_o = gmem_copy_O.get_thread_slice(tidx);
  Tensor tOsO = gthr_o.partition_S(sO);
  Tensor tOgO = gthr_o.partition_D(gO);
  Tensor tOrO = make_tensor<Element>(shape(tOgO));
  cute::copy(gmem_copy_O, tOsO, tOrO);
  Tensor tOcO = gthr_o.partition_D(cQ);
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tOgO); ++m) {
    if (get<0>(tOcO(0, m, 0)) < q_rows) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tOgO); ++k) cute::copy(gmem_copy_O, tOrO(_, m, k), tOgO(_, m, k));
    }
  }
}

template <class Element, int D>
cudaError_t launch_fwd(const FwdParams& p, int64_t batch, cudaStream_t stream) {
  constexpr int kWarps = D == 256 ? 8 : 4;
  using KT = FwdTraits<Element, D, kFwdBlockM, kFwdBlockN, kWarps>;
  auto kernel = attention_fwd_kernel<KT>;
  static unsigned smem_done = 0;
  cudaError_t err = set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), KT::kSmemBytes, &smem_done);
  if (err != cudaSuccess) return err;
  const int64_t blocks = batch * p.nq * p.Hq;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  kernel<<<static_cast<unsigned>(blocks), KT::kThreads, KT::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <class Element>
cudaError_t dispatch_fwd(const FwdParams& p, int64_t batch, int64_t d, cudaStream_t stream) {
  switch (d) {
    case 64: return launch_fwd<Element, 64>(p, batch, stream);
    case 128: return launch_fwd<Element, 128>(p, batch, stream);
    case 256: return launch_fwd<Element, 256>(p, batch, stream);
    default: return cudaErrorInvalidValue;
  }
}

// Both kernels' plans: the sm_80 kernel's fixed query tiles (q_sum, q_range, order) and the
// sm_90a kernel's document tiles (doc_*); key summaries sized for the narrower key tiles.
struct FwdPlanLayout {
  size_t q_sum, kv_sum, q_range, order, bytes;
  size_t doc_windows, doc_bits, doc_starts, doc_counts, doc_offsets, doc_total, doc_tiles;
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
                           reinterpret_cast<int*>(base + l.doc_total), reinterpret_cast<DocTile*>(base + l.doc_tiles)}};
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

// JAXCP_FWD_FIXED_TILES=1 (a development aid, for measuring document tiles) gives the sm_90a
// kernel query tiles of 128 rows from token 0.
bool fwd_fixed_tiles_by_env() { return env_flag("JAXCP_FWD_FIXED_TILES"); }

}  // namespace detail

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
    return launch_doc_tile_plan(q_tok, t.nkv, kv_tok, s.batch, a.mask, detail::fwd_fixed_tiles_by_env(), pl.doc,
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
  p.key_windows = pl.doc.key_windows;
  p.nq = t.sm90 ? doc_tile_capacity(s.q_len) : static_cast<int>(t.nq);  // sm_90a: tile slots per row
  p.nkv = static_cast<int>(t.nkv);
  if (t.sm90) return launch_fwd_sm90(p, s.batch, dtype, s.head_dim, s.v_dim(), stream);
  return dtype == DType::kBF16 ? detail::dispatch_fwd<cutlass::bfloat16_t>(p, s.batch, s.head_dim, stream)
                               : detail::dispatch_fwd<cutlass::half_t>(p, s.batch, s.head_dim, stream);
}

}  // namespace jaxcp::cuda
