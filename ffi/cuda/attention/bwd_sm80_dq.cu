// Backward, deterministic dQ kernel: each block owns one query tile of one query head and walks
// the key tiles its plan does not skip, recomputing S and dP: dQ = scale * sum_j dS_j K_j in
// registers (float32), written once in the output dtype. No atomics: bitwise reproducible.
#include <climits>

#include "bwd.cuh"

namespace jaxcp::cuda::detail {

template <class Element_, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages_>
struct DqTraits {
  using Element = Element_;
  static constexpr int kD = kHeadDim, kBM = kBlockM, kBN = kBlockN, kThreads = kNWarps * 32;
  static constexpr int kStages = kStages_;
  static_assert(kBM == 16 * kNWarps);
  using TiledMma = TiledMMA<typename MmaAtomOf<Element>::type, Layout<Shape<Int<kNWarps>, _1, _1>>,
                            Tile<Int<16 * kNWarps>, _16, _16>>;
  using SmemLayoutQ = SmemLayoutRowMajor<kBM, kD>;
  using SmemLayoutKV = SmemLayoutRowMajor<kBN, kD>;
  using SmemLayoutKt = SmemLayoutTransposed<SmemLayoutKV, kBN, kD>;  // (D, BN)
  using SmemLayoutKtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutKt{}));
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using GmemCopy = GmemTiledCopyAsync<Element, kThreads>;
  static constexpr int kStageElems = 2 * kBN * kD;  // K and V of one stage
  static constexpr int kSmemMatBytes = (2 * kBM * kD + kStages * kStageElems) * int(sizeof(Element));
  static constexpr int kSmemBytes = kSmemMatBytes + kStages * kBN * int(sizeof(ColMask));
};

template <class Element, int D> struct DqConfig;
template <class Element> struct DqConfig<Element, 64> {
  using type = DqTraits<Element, 64, kBwdBlockM, dq_block_n(64), 4, 2>;
};
template <class Element> struct DqConfig<Element, 128> {
  using type = DqTraits<Element, 128, kBwdBlockM, dq_block_n(128), 4, 2>;
};
template <class Element> struct DqConfig<Element, 256> {
  using type = DqTraits<Element, 256, kBwdBlockM, dq_block_n(256), 4, 2>;
};

template <int kStride, class T>
__forceinline__ __device__ auto at_stage_dq(T const& t, int stage) {
  return make_tensor(t.data() + stage * kStride, t.layout());
}

template <class KT>
__global__ void __launch_bounds__(KT::kThreads, 1) attention_bwd_dq_kernel(const BwdParams p) {
  using Element = typename KT::Element;
  constexpr int BM = KT::kBM, BN = KT::kBN, D = KT::kD, kThreads = KT::kThreads;
  constexpr int kSS = KT::kStageElems;
  extern __shared__ __align__(1024) char smem_raw[];

  const int tidx = threadIdx.x;
  const int tile = p.q_order_dq[blockIdx.x / p.Hq];
  const int h = blockIdx.x % p.Hq, b = tile / p.nq, m_block = tile % p.nq, hk = h / p.group;
  const int64_t r0 = static_cast<int64_t>(m_block) * BM;
  const int q_rows = static_cast<int>(p.Sq - r0 < BM ? p.Sq - r0 : BM);
  const TileRange range = p.q_range_dq[b * p.nq + m_block];
  const TileSummary qsum = p.q_sum[b * p.nq + m_block];
  const TileSummary* kv_sum = p.kv_sum_dq + b * p.nkv_dq;
  const bool q_ragged = r0 + BM > p.Sq;
  auto kv_class = [&](int j) {
    return tile_class(qsum, kv_sum[j], p.mask, q_ragged || static_cast<int64_t>(j + 1) * BN > p.Skv);
  };
  auto next_tile = [&](int j, int& c) { return warp_first_unskipped(j, range.y, kv_class, c); };
  Element* dq_ptr = static_cast<Element*>(p.dq) + (b * p.Sq + r0) * p.q_row + static_cast<int64_t>(h) * D;

  int cls = kSkip;
  int j = next_tile(range.x, cls);
  if (j >= range.y) {
    for (int idx = tidx; idx < q_rows * (D / 8); idx += kThreads) {
      const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
      *reinterpret_cast<uint4*>(dq_ptr + r * p.q_row + c) = make_uint4(0, 0, 0, 0);
    }
    return;
  }

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem_raw)), typename KT::SmemLayoutQ{});
  Tensor sdO = make_tensor(sQ.data() + size(sQ), typename KT::SmemLayoutQ{});
  Tensor sK = make_tensor(sdO.data() + size(sdO), typename KT::SmemLayoutKV{});  // stage s: + s*kSS
  Tensor sV = make_tensor(sK.data() + size(sK), typename KT::SmemLayoutKV{});
  Tensor sKt = make_tensor(sK.data(), typename KT::SmemLayoutKt{});
  Tensor sKtNoSwizzle = make_tensor(sK.data().get(), typename KT::SmemLayoutKtNoSwizzle{});
  ColMask* s_col = reinterpret_cast<ColMask*>(smem_raw + KT::kSmemMatBytes);  // [stages][BN]

  typename KT::GmemCopy gmem_copy;
  auto gthr = gmem_copy.get_thread_slice(tidx);
  Tensor cQ = make_identity_tensor(Shape<Int<BM>, Int<D>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<BN>, Int<D>>{});
  Tensor tQcQ = gthr.partition_S(cQ);
  Tensor tKVcKV = gthr.partition_S(cKV);
  Tensor tKsK = gthr.partition_D(sK);
  Tensor tVsV = gthr.partition_D(sV);

  const int64_t kv_off = b * p.Skv * p.kv_row + static_cast<int64_t>(hk) * D;
  auto load_kv = [&](int jt, int st) {
    const int64_t k0 = static_cast<int64_t>(jt) * BN;
    const int rows = static_cast<int>(p.Skv - k0 < BN ? p.Skv - k0 : BN);
    Tensor gK = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.k) + kv_off + k0 * p.kv_row),
                            Shape<Int<BN>, Int<D>>{}, make_stride(p.kv_row, _1{}));
    Tensor gV = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.v) + kv_off + k0 * p.kv_row),
                            Shape<Int<BN>, Int<D>>{}, make_stride(p.kv_row, _1{}));
    copy_rows_async(gmem_copy, gthr.partition_S(gK), at_stage_dq<kSS>(tKsK, st), tKVcKV, rows);
    copy_rows_async(gmem_copy, gthr.partition_S(gV), at_stage_dq<kSS>(tVsV, st), tKVcKV, rows);
  };
  auto load_col = [&](int jt, int c) {
    const int64_t t = static_cast<int64_t>(jt) * BN + c;
    const bool valid = t < p.Skv;
    const int64_t idx = b * p.Skv + (valid ? t : 0);
    return make_col_mask(valid, p.kv_seg[idx], p.kv_pos[idx]);
  };

  typename KT::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tdPrdO = thr_mma.partition_fragment_A(sdO);
  Tensor tdPrV = thr_mma.partition_fragment_B(sV);
  Tensor tdQrKt = thr_mma.partition_fragment_B(sKtNoSwizzle);
  auto copy_A = make_tiled_copy_A(typename KT::SmemCopyAtom{}, mma);
  auto thr_copy_A = copy_A.get_thread_slice(tidx);
  Tensor tSsQ = thr_copy_A.partition_S(sQ);
  Tensor tdPsdO = thr_copy_A.partition_S(sdO);
  auto copy_B = make_tiled_copy_B(typename KT::SmemCopyAtom{}, mma);
  auto thr_copy_B = copy_B.get_thread_slice(tidx);
  Tensor tSsK = thr_copy_B.partition_S(sK);
  Tensor tdPsV = thr_copy_B.partition_S(sV);
  auto copy_BT = make_tiled_copy_B(typename KT::SmemCopyAtomT{}, mma);
  auto thr_copy_BT = copy_BT.get_thread_slice(tidx);
  Tensor tdQsKt = thr_copy_BT.partition_S(sKt);

  Tensor cS = make_identity_tensor(Shape<Int<BM>, Int<BN>>{});
  Tensor tScS = thr_mma.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  constexpr int kCols = decltype(size<1>(tScS_rc))::value;

  // Prologue.
  {
    Tensor gQ = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.q) + (b * p.Sq + r0) * p.q_row +
                                          static_cast<int64_t>(h) * D),
                            Shape<Int<BM>, Int<D>>{}, make_stride(p.q_row, _1{}));
    Tensor gdO = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.dout) + (b * p.Sq + r0) * p.q_row +
                                           static_cast<int64_t>(h) * D),
                             Shape<Int<BM>, Int<D>>{}, make_stride(p.q_row, _1{}));
    copy_rows_async(gmem_copy, gthr.partition_S(gQ), gthr.partition_D(sQ), tQcQ, q_rows);
    copy_rows_async(gmem_copy, gthr.partition_S(gdO), gthr.partition_D(sdO), tQcQ, q_rows);
  }
  load_kv(j, 0);
  cute::cp_async_fence();
  for (int c = tidx; c < BN; c += kThreads) s_col[c] = load_col(j, c);

  float lse2[kRows], dlt[kRows];
  RowMask rm[kRows];
  {
    const int64_t lrow = (b * p.Hq + h) * p.Sq + r0;
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const int r = get<0>(tScS_rc(mi, 0));
      const bool valid = r < q_rows;
      const float l = valid ? p.lse[lrow + r] : INFINITY;
      lse2[mi] = lse_log2(l);
      dlt[mi] = valid ? p.delta[lrow + r] : 0.f;
      const int64_t idx = b * p.Sq + r0 + (valid ? r : 0);
      rm[mi] = make_row_mask(valid, p.q_seg[idx], p.q_pos[idx], p.mask);
    }
  }

  Tensor acc_dq = partition_fragment_C(mma, Shape<Int<BM>, Int<D>>{});
  clear(acc_dq);
  int stage = 0;

  while (true) {
    int cls_next = kSkip;
    const int jn = next_tile(j + 1, cls_next);
    const bool has_next = jn < range.y;
    ColMask cm_next{0, 0};
    if (has_next && tidx < BN) cm_next = load_col(jn, tidx);

    cp_async_wait<0>();
    __syncthreads();  // K/V(j) and column masks visible; previous step done with the other stage
    if constexpr (KT::kStages == 2) {
      if (has_next) {
        load_kv(jn, stage ^ 1);
        cute::cp_async_fence();
      }
    }

    Tensor acc_s = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
    clear(acc_s);
    gemm_ss(acc_s, tSrQ, tSrK, tSsQ, at_stage_dq<kSS>(tSsK, stage), mma, copy_A, copy_B, thr_copy_A,
            thr_copy_B);
    Tensor acc_dp = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
    clear(acc_dp);
    gemm_ss(acc_dp, tdPrdO, tdPrV, tdPsdO, at_stage_dq<kSS>(tdPsV, stage), mma, copy_A, copy_B,
            thr_copy_A, thr_copy_B);

    Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    Tensor dp = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
    const ColMask* col = s_col + stage * BN;
    CUTE_UNROLL
    for (int ni = 0; ni < kCols; ++ni) {
      ColMask cm{0, 0};
      if (cls == kPartial) cm = col[get<1>(tScS_rc(0, ni))];
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        const bool ok = cls != kPartial || allowed(rm[mi], cm);
        const float pv = ok ? exp2f(s(mi, ni) * p.scale_log2 - lse2[mi]) : 0.f;
        dp(mi, ni) = pv * (dp(mi, ni) - dlt[mi]);
      }
    }
    Tensor rdS = convert_type<Element>(acc_dp);
    Tensor tdQrdS = make_tensor(rdS.data(), acc_as_A(rdS.layout()));
    gemm_rs(acc_dq, tdQrdS, tdQrKt, at_stage_dq<kSS>(tdQsKt, stage), mma, copy_BT, thr_copy_BT);

    if constexpr (KT::kStages == 2) {
      if (has_next && tidx < BN) s_col[(stage ^ 1) * BN + tidx] = cm_next;
      stage ^= 1;
    } else {
      __syncthreads();  // everyone done with K/V(j) and its masks
      if (has_next) {
        load_kv(jn, 0);
        cute::cp_async_fence();
        if (tidx < BN) s_col[tidx] = cm_next;
      }
    }
    if (!has_next) break;
    j = jn;
    cls = cls_next;
  }

  // Epilogue: dQ = scale * acc, straight from registers.
  Tensor cdQ = make_identity_tensor(Shape<Int<BM>, Int<D>>{});
  Tensor tc = thr_mma.partition_C(cdQ);
  CUTE_UNROLL
  for (int m = 0; m < size<1>(acc_dq); ++m) {
    CUTE_UNROLL
    for (int n = 0; n < size<2>(acc_dq); ++n) {
      CUTE_UNROLL
      for (int v = 0; v < 4; v += 2) {
        const auto c = tc(v, m, n);
        const int r = get<0>(c);
        if (r < q_rows)
          store_pair(dq_ptr + r * p.q_row + get<1>(c), acc_dq(v, m, n) * p.scale,
                     acc_dq(v + 1, m, n) * p.scale);
      }
    }
  }
}

template <class Element, int D>
cudaError_t launch_bwd_dq(const BwdParams& p, cudaStream_t stream) {
  using KT = typename DqConfig<Element, D>::type;
  static unsigned smem_done = 0;
  auto kernel = attention_bwd_dq_kernel<KT>;
  cudaError_t err = set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), KT::kSmemBytes, &smem_done);
  if (err != cudaSuccess) return err;
  const int64_t blocks = p.B * p.nq * p.Hq;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  kernel<<<static_cast<unsigned>(blocks), KT::kThreads, KT::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template cudaError_t launch_bwd_dq<cutlass::bfloat16_t, 64>(const BwdParams&, cudaStream_t);
template cudaError_t launch_bwd_dq<cutlass::bfloat16_t, 128>(const BwdParams&, cudaStream_t);
template cudaError_t launch_bwd_dq<cutlass::bfloat16_t, 256>(const BwdParams&, cudaStream_t);
template cudaError_t launch_bwd_dq<cutlass::half_t, 64>(const BwdParams&, cudaStream_t);
template cudaError_t launch_bwd_dq<cutlass::half_t, 128>(const BwdParams&, cudaStream_t);
template cudaError_t launch_bwd_dq<cutlass::half_t, 256>(const BwdParams&, cudaStream_t);

}  // namespace jaxcp::cuda::detail
