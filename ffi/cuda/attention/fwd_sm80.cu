// Forward packed-document attention: FA2-style tiles (128 query rows x 64 keys), online softmax
// in float32 (log2 domain), LSE saved. Each block owns one (query tile, head, batch) and walks only
// the key tiles its tile plan does not skip; "full" tiles run without any per-element mask.
#include <climits>

#include "fwd.cuh"

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

}  // namespace detail

cudaError_t launch_fwd_sm80(const detail::FwdParams& p, int64_t batch, DType dtype, int64_t d, cudaStream_t stream) {
  return dtype == DType::kBF16 ? detail::dispatch_fwd<cutlass::bfloat16_t>(p, batch, d, stream)
                               : detail::dispatch_fwd<cutlass::half_t>(p, batch, d, stream);
}

}  // namespace jaxcp::cuda
