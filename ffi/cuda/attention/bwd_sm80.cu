// Backward, dK/dV kernel (FA2-style): each block owns one key tile of one kv head (or a split of
// its GQA group) and walks the query tiles of every query head of the group that the tile plan
// does not skip. Per step: S = Q K^T, dP = dO V^T, P = exp(S*scale - LSE) (masked),
// dS = P * (dP - delta); dV += P^T dO, dK += dS^T Q (registers, float32); optionally
// dQ += dS K by float32 atomics into a workspace (non-deterministic mode).
#include <climits>

#include "bwd.cuh"

namespace jaxcp::cuda::detail {

template <class Element_, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kAtomMSdP,
          int kAtomNdKV, int kAtomMdQ, int kStages_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kD = kHeadDim, kBM = kBlockM, kBN = kBlockN, kThreads = kNWarps * 32;
  static constexpr int kStages = kStages_;
  using Atom = typename MmaAtomOf<Element>::type;
  using TiledMmaSdP = TiledMMA<Atom, Layout<Shape<Int<kAtomMSdP>, Int<kNWarps / kAtomMSdP>, _1>>,
                               Tile<Int<16 * kAtomMSdP>, Int<16 * kNWarps / kAtomMSdP>, _16>>;
  using TiledMmadKV = TiledMMA<Atom, Layout<Shape<Int<kAtomNdKV>, Int<kNWarps / kAtomNdKV>, _1>>,
                               Tile<Int<16 * kAtomNdKV>, Int<16 * kNWarps / kAtomNdKV>, _16>>;
  using TiledMmadQ = TiledMMA<Atom, Layout<Shape<Int<kAtomMdQ>, Int<kNWarps / kAtomMdQ>, _1>>,
                              Tile<Int<16 * kAtomMdQ>, Int<16 * kNWarps / kAtomMdQ>, _16>>;
  using SmemLayoutQdO = SmemLayoutRowMajor<kBM, kD>;
  using SmemLayoutQdOt = SmemLayoutTransposed<SmemLayoutQdO, kBM, kD>;  // (D, BM)
  using SmemLayoutQdOtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutQdOt{}));
  using SmemLayoutKV = SmemLayoutRowMajor<kBN, kD>;
  using SmemLayoutKt = SmemLayoutTransposed<SmemLayoutKV, kBN, kD>;  // (D, BN)
  using SmemLayoutKtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutKt{}));
  using SmemLayoutPdS = SmemLayoutRowMajor<kBM, kBN>;
  using SmemLayoutPdSt = SmemLayoutTransposed<SmemLayoutPdS, kBM, kBN>;  // (BN, BM)
  using SmemLayoutPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomPdS = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;
  using GmemCopy = GmemTiledCopyAsync<Element, kThreads>;
  static constexpr int kQdOElems = kBM * kD, kKVElems = kBN * kD, kPdSElems = kBM * kBN;
  static constexpr int kSmemMatBytes =
      (2 * kStages * kQdOElems + 2 * kKVElems + 2 * kPdSElems) * int(sizeof(Element));
  static constexpr int kSmemBytes = kSmemMatBytes + kBN * int(sizeof(ColMask));
};

template <class Element, int D> struct BwdConfig;
template <class Element> struct BwdConfig<Element, 64> {
  using type = BwdTraits<Element, 64, kBwdBlockM, bwd_block_n(64), 8, 2, 4, 4, 2>;
};
template <class Element> struct BwdConfig<Element, 128> {
  using type = BwdTraits<Element, 128, kBwdBlockM, bwd_block_n(128), 8, 2, 4, 2, 2>;
};
template <class Element> struct BwdConfig<Element, 256> {
  using type = BwdTraits<Element, 256, kBwdBlockM, bwd_block_n(256), 8, 4, 2, 2, 1>;
};

__forceinline__ __device__ void atomic_add_pair(float* ptr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(ptr), make_float2(a, b));
#else
  atomicAdd(ptr, a);
  atomicAdd(ptr + 1, b);
#endif
}

// Same tensor at another pipeline stage (stages are laid out back to back).
template <int kStride, class T>
__forceinline__ __device__ auto at_stage(T const& t, int stage) {
  return make_tensor(t.data() + stage * kStride, t.layout());
}

template <class KT, bool kAtomicDq>
__global__ void __launch_bounds__(KT::kThreads, 1) attention_bwd_dkdv_kernel(const BwdParams p) {
  using Element = typename KT::Element;
  constexpr int BM = KT::kBM, BN = KT::kBN, D = KT::kD, kThreads = KT::kThreads;
  constexpr int kQS = KT::kQdOElems;  // stage stride of Q / dO
  extern __shared__ __align__(1024) char smem_raw[];

  const int tidx = threadIdx.x;
  const BwdBlock w = bwd_block<BN>(p, blockIdx.x);
  const int hk = w.hk, split = w.split, b = w.b, kv_rows = w.kv_rows;
  const int h_begin = w.h_begin, h_end = w.h_end;
  const int64_t k0 = w.k0;
  const TileRange range = w.range;
  auto next_q = [&](int i, int& c) { return bwd_next_q<BM>(p, w, i, c); };

  Element* smem_e = reinterpret_cast<Element*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(smem_e), typename KT::SmemLayoutQdO{});
  Tensor sdO = make_tensor(sQ.data() + KT::kStages * kQS, typename KT::SmemLayoutQdO{});
  Tensor sK = make_tensor(sdO.data() + KT::kStages * kQS, typename KT::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename KT::SmemLayoutKV{});
  Tensor sP = make_tensor(sV.data() + size(sV), typename KT::SmemLayoutPdS{});
  Tensor sdS = make_tensor(sP.data() + size(sP), typename KT::SmemLayoutPdS{});
  Tensor sQt = make_tensor(sQ.data(), typename KT::SmemLayoutQdOt{});
  Tensor sQtNoSwizzle = make_tensor(sQ.data().get(), typename KT::SmemLayoutQdOtNoSwizzle{});
  Tensor sdOt = make_tensor(sdO.data(), typename KT::SmemLayoutQdOt{});
  Tensor sdOtNoSwizzle = make_tensor(sdO.data().get(), typename KT::SmemLayoutQdOtNoSwizzle{});
  Tensor sKt = make_tensor(sK.data(), typename KT::SmemLayoutKt{});
  Tensor sKtNoSwizzle = make_tensor(sK.data().get(), typename KT::SmemLayoutKtNoSwizzle{});
  Tensor sPt = make_tensor(sP.data(), typename KT::SmemLayoutPdSt{});
  Tensor sPtNoSwizzle = make_tensor(sP.data().get(), typename KT::SmemLayoutPdStNoSwizzle{});
  Tensor sdSt = make_tensor(sdS.data(), typename KT::SmemLayoutPdSt{});
  Tensor sdStNoSwizzle = make_tensor(sdS.data().get(), typename KT::SmemLayoutPdStNoSwizzle{});
  ColMask* s_col = reinterpret_cast<ColMask*>(smem_raw + KT::kSmemMatBytes);

  // Global -> shared copies.
  typename KT::GmemCopy gmem_copy;
  auto gthr = gmem_copy.get_thread_slice(tidx);
  Tensor cQ = make_identity_tensor(Shape<Int<BM>, Int<D>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<BN>, Int<D>>{});
  Tensor tQcQ = gthr.partition_S(cQ);
  Tensor tKVcKV = gthr.partition_S(cKV);
  Tensor tQsQ = gthr.partition_D(sQ);
  Tensor tdOsdO = gthr.partition_D(sdO);

  auto load_qdo = [&](int hh, int ii, int st) {
    const int64_t r0 = static_cast<int64_t>(ii) * BM;
    const int rows = static_cast<int>(p.Sq - r0 < BM ? p.Sq - r0 : BM);
    const int64_t off = (b * p.Sq + r0) * p.q_row + static_cast<int64_t>(hh) * D;
    Tensor gQ = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.q) + off),
                            Shape<Int<BM>, Int<D>>{}, make_stride(p.q_row, _1{}));
    Tensor gdO = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.dout) + off),
                             Shape<Int<BM>, Int<D>>{}, make_stride(p.q_row, _1{}));
    copy_rows_async(gmem_copy, gthr.partition_S(gQ), at_stage<kQS>(tQsQ, st), tQcQ, rows);
    copy_rows_async(gmem_copy, gthr.partition_S(gdO), at_stage<kQS>(tdOsdO, st), tQcQ, rows);
  };

  // MMAs and their shared -> register copies.
  typename KT::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  typename KT::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tidx);
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdStNoSwizzle);
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQtNoSwizzle);
  Tensor tdVrPt = thr_dkv.partition_fragment_A(sPtNoSwizzle);
  Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOtNoSwizzle);
  typename KT::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKtNoSwizzle);

  auto copy_QdO = make_tiled_copy_A(typename KT::SmemCopyAtom{}, mma_sdp);
  auto thr_copy_QdO = copy_QdO.get_thread_slice(tidx);
  Tensor tSsQ = thr_copy_QdO.partition_S(sQ);
  Tensor tdPsdO = thr_copy_QdO.partition_S(sdO);
  auto copy_KV = make_tiled_copy_B(typename KT::SmemCopyAtom{}, mma_sdp);
  auto thr_copy_KV = copy_KV.get_thread_slice(tidx);
  Tensor tSsK = thr_copy_KV.partition_S(sK);
  Tensor tdPsV = thr_copy_KV.partition_S(sV);
  auto copy_PdS = make_tiled_copy_C(typename KT::SmemCopyAtomPdS{}, mma_sdp);
  auto thr_copy_PdS = copy_PdS.get_thread_slice(tidx);
  Tensor tPsP = thr_copy_PdS.partition_D(sP);
  Tensor tdSsdS = thr_copy_PdS.partition_D(sdS);
  auto copy_PdSt = make_tiled_copy_A(typename KT::SmemCopyAtomT{}, mma_dkv);
  auto thr_copy_PdSt = copy_PdSt.get_thread_slice(tidx);
  Tensor tdVsPt = thr_copy_PdSt.partition_S(sPt);
  Tensor tdKsdSt = thr_copy_PdSt.partition_S(sdSt);
  auto copy_QdOt = make_tiled_copy_B(typename KT::SmemCopyAtomT{}, mma_dkv);
  auto thr_copy_QdOt = copy_QdOt.get_thread_slice(tidx);
  Tensor tdVsdOt = thr_copy_QdOt.partition_S(sdOt);
  Tensor tdKsQt = thr_copy_QdOt.partition_S(sQt);
  auto copy_dS = make_tiled_copy_A(typename KT::SmemCopyAtom{}, mma_dq);
  auto thr_copy_dS = copy_dS.get_thread_slice(tidx);
  Tensor tdQsdS = thr_copy_dS.partition_S(sdS);
  auto copy_Kt = make_tiled_copy_B(typename KT::SmemCopyAtomT{}, mma_dq);
  auto thr_copy_Kt = copy_Kt.get_thread_slice(tidx);
  Tensor tdQsKt = thr_copy_Kt.partition_S(sKt);

  Tensor cS = make_identity_tensor(Shape<Int<BM>, Int<BN>>{});
  Tensor tScS = thr_sdp.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  constexpr int kCols = decltype(size<1>(tScS_rc))::value;

  // Prologue: K, V (resident), key masks, first Q / dO.
  {
    const int64_t off = (b * p.Skv + k0) * p.kv_row + static_cast<int64_t>(hk) * D;
    Tensor gK = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.k) + off),
                            Shape<Int<BN>, Int<D>>{}, make_stride(p.kv_row, _1{}));
    Tensor gV = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.v) + off),
                            Shape<Int<BN>, Int<D>>{}, make_stride(p.kv_row, _1{}));
    copy_rows_async(gmem_copy, gthr.partition_S(gK), gthr.partition_D(sK), tKVcKV, kv_rows);
    copy_rows_async(gmem_copy, gthr.partition_S(gV), gthr.partition_D(sV), tKVcKV, kv_rows);
  }
  for (int c = tidx; c < BN; c += kThreads) {
    const bool valid = c < kv_rows;
    const int64_t idx = b * p.Skv + k0 + (valid ? c : 0);
    s_col[c] = make_col_mask(valid, p.kv_seg[idx], p.kv_pos[idx]);
  }
  int cls_first = kSkip;
  const int i_first = next_q(range.x, cls_first);  // the same for every head
  int h = h_begin, i = i_first, cls = cls_first;
  bool has = h < h_end && i < range.y;
  if (has) load_qdo(h, i, 0);
  cute::cp_async_fence();

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<BN>, Int<D>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<BN>, Int<D>>{});
  clear(acc_dk);
  clear(acc_dv);
  int stage = 0;

  while (has) {
    int cls_next = kSkip;
    int hn = h, in = next_q(i + 1, cls_next);
    if (in >= range.y) {
      ++hn;
      in = i_first;
      cls_next = cls_first;
    }
    const bool has_next = hn < h_end && in < range.y;
    const int64_t r0 = static_cast<int64_t>(i) * BM;
    const int q_rows = static_cast<int>(p.Sq - r0 < BM ? p.Sq - r0 : BM);

    cp_async_wait<0>();
    __syncthreads();  // Q/dO(step) visible; previous step fully done with sP/sdS/other stage
    if constexpr (KT::kStages == 2) {
      if (has_next) {
        load_qdo(hn, in, stage ^ 1);
        cute::cp_async_fence();
      }
    }

    // Per-row data of this step (loads overlap the first GEMM).
    float lse2[kRows], dlt[kRows];
    RowMask rm[kRows];
    const int64_t lrow = (b * p.Hq + h) * p.Sq + r0;
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const int r = get<0>(tScS_rc(mi, 0));
      const bool valid = r < q_rows;
      const float l = valid ? p.lse[lrow + r] : INFINITY;
      lse2[mi] = lse_log2(l);
      dlt[mi] = valid ? p.delta[lrow + r] : 0.f;
      if (cls == kPartial) {
        const int64_t idx = b * p.Sq + r0 + (valid ? r : 0);
        rm[mi] = make_row_mask(valid, p.q_seg[idx], p.q_pos[idx], p.mask);
      } else {
        rm[mi] = RowMask{0, 0, 0};
      }
    }

    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<BM>, Int<BN>>{});
    clear(acc_s);
    gemm_ss(acc_s, tSrQ, tSrK, at_stage<kQS>(tSsQ, stage), tSsK, mma_sdp, copy_QdO, copy_KV,
            thr_copy_QdO, thr_copy_KV);
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<BM>, Int<BN>>{});
    clear(acc_dp);
    gemm_ss(acc_dp, tdPrdO, tdPrV, at_stage<kQS>(tdPsdO, stage), tdPsV, mma_sdp, copy_QdO,
            copy_KV, thr_copy_QdO, thr_copy_KV);

    Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    Tensor dp = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
    CUTE_UNROLL
    for (int ni = 0; ni < kCols; ++ni) {
      ColMask cm{0, 0};
      if (cls == kPartial) cm = s_col[get<1>(tScS_rc(0, ni))];
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        const bool ok = cls != kPartial || allowed(rm[mi], cm);
        const float pv = ok ? exp2f(s(mi, ni) * p.scale_log2 - lse2[mi]) : 0.f;
        s(mi, ni) = pv;
        dp(mi, ni) = pv * (dp(mi, ni) - dlt[mi]);
      }
    }
    Tensor rP = convert_type<Element>(acc_s);
    Tensor rdS = convert_type<Element>(acc_dp);
    cute::copy(copy_PdS, thr_copy_PdS.retile_S(rP), tPsP);
    cute::copy(copy_PdS, thr_copy_PdS.retile_S(rdS), tdSsdS);
    __syncthreads();  // P and dS visible

    gemm_ss(acc_dv, tdVrPt, tdVrdO, tdVsPt, at_stage<kQS>(tdVsdOt, stage), mma_dkv, copy_PdSt,
            copy_QdOt, thr_copy_PdSt, thr_copy_QdOt);
    gemm_ss(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, at_stage<kQS>(tdKsQt, stage), mma_dkv, copy_PdSt,
            copy_QdOt, thr_copy_PdSt, thr_copy_QdOt);

    if constexpr (kAtomicDq) {
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<BM>, Int<D>>{});
      clear(acc_dq);
      gemm_ss(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, mma_dq, copy_dS, copy_Kt, thr_copy_dS,
              thr_copy_Kt);
      Tensor cdQ = make_identity_tensor(Shape<Int<BM>, Int<D>>{});
      Tensor tdQc = thr_dq.partition_C(cdQ);
      float* dq_ptr = p.dq_accum + (b * p.Sq + r0) * p.q_row + static_cast<int64_t>(h) * D;
      CUTE_UNROLL
      for (int m = 0; m < size<1>(acc_dq); ++m) {
        CUTE_UNROLL
        for (int n = 0; n < size<2>(acc_dq); ++n) {
          CUTE_UNROLL
          for (int v = 0; v < 4; v += 2) {
            const auto c = tdQc(v, m, n);
            const int r = get<0>(c);
            if (r < q_rows)
              atomic_add_pair(dq_ptr + r * p.q_row + get<1>(c), acc_dq(v, m, n), acc_dq(v + 1, m, n));
          }
        }
      }
    }

    if constexpr (KT::kStages == 1) {
      __syncthreads();  // everyone done with sQ / sdO
      if (has_next) {
        load_qdo(hn, in, 0);
        cute::cp_async_fence();
      }
    } else {
      stage ^= 1;
    }
    h = hn;
    i = in;
    cls = cls_next;
    has = has_next;
  }
  cp_async_wait<0>();

  // Epilogue: dK = scale * dS^T Q, dV = P^T dO.
  Tensor cacc = make_identity_tensor(Shape<Int<BN>, Int<D>>{});
  Tensor tc = thr_dkv.partition_C(cacc);
  const int64_t out_off = (b * p.Skv + k0) * p.kv_row + static_cast<int64_t>(hk) * D;
  if (p.splits == 1) {
    Element* dk_ptr = static_cast<Element*>(p.dk) + out_off;
    Element* dv_ptr = static_cast<Element*>(p.dv) + out_off;
    CUTE_UNROLL
    for (int m = 0; m < size<1>(acc_dk); ++m) {
      CUTE_UNROLL
      for (int n = 0; n < size<2>(acc_dk); ++n) {
        CUTE_UNROLL
        for (int v = 0; v < 4; v += 2) {
          const auto c = tc(v, m, n);
          const int r = get<0>(c);
          if (r < kv_rows) {
            const int64_t o = r * p.kv_row + get<1>(c);
            store_pair(dk_ptr + o, acc_dk(v, m, n) * p.scale, acc_dk(v + 1, m, n) * p.scale);
            store_pair(dv_ptr + o, acc_dv(v, m, n), acc_dv(v + 1, m, n));
          }
        }
      }
    }
  } else {
    const int64_t part = static_cast<int64_t>(split) * p.B * p.Skv * p.kv_row;
    float* dk_ptr = p.dk_part + part + out_off;
    float* dv_ptr = p.dv_part + part + out_off;
    CUTE_UNROLL
    for (int m = 0; m < size<1>(acc_dk); ++m) {
      CUTE_UNROLL
      for (int n = 0; n < size<2>(acc_dk); ++n) {
        CUTE_UNROLL
        for (int v = 0; v < 4; v += 2) {
          const auto c = tc(v, m, n);
          const int r = get<0>(c);
          if (r < kv_rows) {
            const int64_t o = r * p.kv_row + get<1>(c);
            *reinterpret_cast<float2*>(dk_ptr + o) =
                make_float2(acc_dk(v, m, n) * p.scale, acc_dk(v + 1, m, n) * p.scale);
            *reinterpret_cast<float2*>(dv_ptr + o) = make_float2(acc_dv(v, m, n), acc_dv(v + 1, m, n));
          }
        }
      }
    }
  }
}

template <class Element, int D>
cudaError_t launch_bwd_dkdv(const BwdParams& p, bool atomic_dq, cudaStream_t stream) {
  using KT = typename BwdConfig<Element, D>::type;
  static unsigned smem_done[2] = {0, 0};
  auto kernel = atomic_dq ? attention_bwd_dkdv_kernel<KT, true> : attention_bwd_dkdv_kernel<KT, false>;
  cudaError_t err = set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), KT::kSmemBytes,
                                         &smem_done[atomic_dq ? 1 : 0]);
  if (err != cudaSuccess) return err;
  const int64_t blocks = p.B * p.nkv * p.Hkv * p.splits;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  kernel<<<static_cast<unsigned>(blocks), KT::kThreads, KT::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template cudaError_t launch_bwd_dkdv<cutlass::bfloat16_t, 64>(const BwdParams&, bool, cudaStream_t);
template cudaError_t launch_bwd_dkdv<cutlass::bfloat16_t, 128>(const BwdParams&, bool, cudaStream_t);
template cudaError_t launch_bwd_dkdv<cutlass::bfloat16_t, 256>(const BwdParams&, bool, cudaStream_t);
template cudaError_t launch_bwd_dkdv<cutlass::half_t, 64>(const BwdParams&, bool, cudaStream_t);
template cudaError_t launch_bwd_dkdv<cutlass::half_t, 128>(const BwdParams&, bool, cudaStream_t);
template cudaError_t launch_bwd_dkdv<cutlass::half_t, 256>(const BwdParams&, bool, cudaStream_t);

}  // namespace jaxcp::cuda::detail
