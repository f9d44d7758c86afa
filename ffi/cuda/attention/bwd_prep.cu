// The backward's helper kernels around the dK/dV kernels (bwd_sm80.cu, bwd_sm90.cu), and their
// launchers: the pre-pass (delta = dot(dO, O) - dlse and what else it fills, see BwdPrepArgs),
// the deterministic sm_90a backward's dQ tickets, the sm_80 dQ accumulator's conversion to the
// output dtype, and the reduction of split dK/dV partial sums.
#include <climits>

#include "bwd.cuh"

namespace jaxcp::cuda::detail {
namespace {

template <class Element, int D, int Dv>
__global__ void __launch_bounds__(256) bwd_prep_kernel(const BwdPrepArgs a) {
  constexpr int kTpr = bwd_prep_threads_per_row(D, Dv);
  constexpr int kRows = 256 / kTpr;
  const int bh = static_cast<int>(blockIdx.x) / a.blocks_per_bh;
  const int b = bh / a.Hq, h = bh % a.Hq;
  const int64_t i = static_cast<int64_t>(static_cast<int>(blockIdx.x) % a.blocks_per_bh) * kRows +
                    static_cast<int>(threadIdx.x) / kTpr;
  const int lane = static_cast<int>(threadIdx.x) % kTpr;
  const bool row_in = i < a.stride, row_real = i < a.Sq;
  const int64_t row = static_cast<int64_t>(bh) * a.stride + i;
  const int64_t o = static_cast<int64_t>(bh) * a.Sq + i;  // [B, Hq, Sq]
  float row_lse = 0.f, row_dlse = 0.f;
  ColMask id{0, 0};
  if (row_real && lane == 0) {
    if (a.lse2) row_lse = a.lse[o];
    if (a.dlse) row_dlse = a.dlse[o];
    if (a.q_ids && h == 0) id = ColMask{a.q_seg[b * a.Sq + i], a.q_pos[b * a.Sq + i]};
  }
  float acc = 0.f;
  if (row_real && lane < Dv / 8) {
    const int64_t at = ((b * a.Sq + i) * a.Hq + h) * Dv;
    const uint4 x = reinterpret_cast<const uint4*>(static_cast<const Element*>(a.out) + at)[lane];
    const uint4 g = reinterpret_cast<const uint4*>(static_cast<const Element*>(a.dout) + at)[lane];
    const Element* ex = reinterpret_cast<const Element*>(&x);
    const Element* eg = reinterpret_cast<const Element*>(&g);
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) acc += static_cast<float>(ex[e]) * static_cast<float>(eg[e]);
  }
  if (row_in && lane < D / 8 && a.dq_accum) {
    float4* zero = reinterpret_cast<float4*>(a.dq_accum + row * D) + 2 * lane;
    zero[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    zero[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  CUTE_UNROLL
  for (int s = kTpr / 2; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (row_in && lane == 0) {
    a.delta[row] = row_real ? acc - row_dlse : 0.f;
    if (a.lse2) a.lse2[row] = row_real ? lse_log2(row_lse) : INFINITY;
    if (a.q_ids && h == 0) a.q_ids[b * a.stride + i] = id;
  }
}

// Deterministic sm_90a backward, the order of the dQ turns and so of the blocks (kv_order[i] =
// b * nkv + n): increasing key tiles where may_ascend and every row is one document (its key
// tiles' walks all end at the same query tile), else decreasing. One block. Measured on an H200
// (deterministic backward kernel at D 128, 16/16 heads), increasing over decreasing: 2 x 8k and
// 1 x 64k single documents 12% and 13% faster; packed documents 5-24% slower (1 x 128k with 8k
// documents 15%, 4 x 16k with 4k documents 24%).
constexpr int kTurnOrderThreads = 512;
__global__ void __launch_bounds__(kTurnOrderThreads) bwd_turn_order_kernel(const TileRange* __restrict__ kv_range,
                                                                          int64_t n, int64_t nkv, bool may_ascend,
                                                                          int* __restrict__ order,
                                                                          int* __restrict__ ascending) {
  bool one_doc = may_ascend;
  for (int64_t i = threadIdx.x; may_ascend && i + 1 < n; i += kTurnOrderThreads) {
    const TileRange r = kv_range[i], next = kv_range[i + 1];
    if ((i + 1) % nkv != 0 && r.y > r.x && next.y > next.x && r.y != next.y) one_doc = false;
  }
  const bool up = __syncthreads_and(one_doc) != 0;
  for (int64_t i = threadIdx.x; i < n; i += kTurnOrderThreads) order[i] = static_cast<int>(up ? i : n - 1 - i);
  if (threadIdx.x == 0) *ascending = up;
}

// Deterministic sm_90a backward: dq_ticket[(b * nkv + n) * nq + m] = the number of key tiles
// before n in the turn order (n' < n when *p.dq_ascending, else n' > n) whose walk visits query
// tile m, for every (n, m) that key tile n's walk visits (the others are left as they are). A
// walk visits the tiles of its range that it does not skip. One thread per (b, m).
__global__ void __launch_bounds__(256) bwd_dq_ticket_kernel(const TileRange* __restrict__ kv_range,
                                                            const TileSummary* __restrict__ q_sum,
                                                            const TileSummary* __restrict__ kv_sum, MaskParams mask,
                                                            int nq, int nkv, const int* __restrict__ ascending,
                                                            int* __restrict__ ticket) {
  const int m = static_cast<int>(blockIdx.x) * 256 + static_cast<int>(threadIdx.x);
  const int64_t b = blockIdx.y;
  if (m >= nq) return;
  const TileSummary qs = q_sum[b * nq + m];
  const bool up = *ascending != 0;
  int count = 0;
  for (int k = 0; k < nkv; ++k) {
    const int n = up ? k : nkv - 1 - k;
    const TileRange r = kv_range[b * nkv + n];
    if (r.x <= m && m < r.y && classify_tiles(qs, kv_sum[b * nkv + n], mask) != TileClass::kSkip)
      ticket[(b * nkv + n) * nq + m] = count++;
  }
}

// dst[i] = Element(scale * src[i]), 8 elements per thread.
template <class Element>
__global__ void __launch_bounds__(256) scale_convert_kernel(const float* __restrict__ src,
                                                            Element* __restrict__ dst, int64_t n8,
                                                            float scale) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * 256) {
    const float4 a = reinterpret_cast<const float4*>(src)[2 * i];
    const float4 c = reinterpret_cast<const float4*>(src)[2 * i + 1];
    cutlass::Array<Element, 8> o;
    o[0] = Element(a.x * scale); o[1] = Element(a.y * scale);
    o[2] = Element(a.z * scale); o[3] = Element(a.w * scale);
    o[4] = Element(c.x * scale); o[5] = Element(c.y * scale);
    o[6] = Element(c.z * scale); o[7] = Element(c.w * scale);
    reinterpret_cast<cutlass::Array<Element, 8>*>(dst)[i] = o;
  }
}

// dst[i] = Element(sum_s part[s][i]) for dK (n4 float4s per split) and dV (n4v: fewer where V is
// narrower), fixed summation order (deterministic).
template <class Element>
__global__ void __launch_bounds__(256) split_reduce_kernel(const float* __restrict__ dk_part,
                                                           const float* __restrict__ dv_part,
                                                           Element* __restrict__ dk,
                                                           Element* __restrict__ dv, int64_t n4, int64_t n4v,
                                                           int splits) {
  auto reduce = [splits](const float* part, int64_t stride, int64_t i) {
    float4 x = reinterpret_cast<const float4*>(part)[i];
    for (int s = 1; s < splits; ++s) {
      const float4 y = reinterpret_cast<const float4*>(part + s * stride)[i];
      x.x += y.x; x.y += y.y; x.z += y.z; x.w += y.w;
    }
    cutlass::Array<Element, 4> o;
    o[0] = Element(x.x); o[1] = Element(x.y); o[2] = Element(x.z); o[3] = Element(x.w);
    return o;
  };
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x; i < (n4 > n4v ? n4 : n4v);
       i += static_cast<int64_t>(gridDim.x) * 256) {
    if (i < n4) reinterpret_cast<cutlass::Array<Element, 4>*>(dk)[i] = reduce(dk_part, n4 * 4, i);
    if (i < n4v) reinterpret_cast<cutlass::Array<Element, 4>*>(dv)[i] = reduce(dv_part, n4v * 4, i);
  }
}


int grid_for(int64_t n, int64_t per_block) {
  const int64_t blocks = ceil_div64(n, per_block);
  return static_cast<int>(blocks < 65536 * 16 ? blocks : 65536 * 16);
}

}  // namespace

template <class Element, int D, int Dv>
cudaError_t launch_bwd_prep(BwdPrepArgs a, int64_t batch, cudaStream_t stream) {
  constexpr int kRowsPerBlock = 256 / bwd_prep_threads_per_row(D, Dv);
  a.blocks_per_bh = static_cast<int>(ceil_div64(a.stride, kRowsPerBlock));
  const int64_t blocks = batch * a.Hq * a.blocks_per_bh;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  bwd_prep_kernel<Element, D, Dv><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_dq_tickets(const BwdParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div64(p.nq, 256)), static_cast<unsigned>(p.B));
  bwd_dq_ticket_kernel<<<grid, 256, 0, stream>>>(p.kv_range, p.q_sum, p.kv_sum, p.mask, p.nq, p.nkv,
                                                 p.dq_ascending, const_cast<int*>(p.dq_ticket));
  return cudaGetLastError();
}

cudaError_t launch_turn_order(const TileRange* kv_range, int64_t batch, int64_t nkv, bool may_ascend, int* kv_order,
                              int* ascending, cudaStream_t stream) {
  if (batch * nkv > INT_MAX) return cudaErrorInvalidValue;
  bwd_turn_order_kernel<<<1, kTurnOrderThreads, 0, stream>>>(kv_range, batch * nkv, nkv, may_ascend, kv_order,
                                                             ascending);
  return cudaGetLastError();
}

template <class Element>
cudaError_t launch_dq_convert(const BwdParams& p, cudaStream_t stream) {
  const int64_t n8 = p.B * p.Sq * p.q_row / 8;
  scale_convert_kernel<Element><<<grid_for(n8, 256), 256, 0, stream>>>(p.dq_accum, static_cast<Element*>(p.dq), n8,
                                                                       p.scale);
  return cudaGetLastError();
}

template <class Element>
cudaError_t launch_split_reduce(const BwdParams& p, cudaStream_t stream) {
  const int64_t n4 = p.B * p.Skv * p.kv_row / 4, n4v = p.B * p.Skv * p.v_row / 4;
  split_reduce_kernel<Element><<<grid_for(n4 > n4v ? n4 : n4v, 256), 256, 0, stream>>>(
      p.dk_part, p.dv_part, static_cast<Element*>(p.dk), static_cast<Element*>(p.dv), n4, n4v, p.splits);
  return cudaGetLastError();
}

// The head dims of attention_bwd's dispatch (bwd_launch.cu), both 16-bit types.
#define JAXCP_BWD_PREP(Element)                                                         \
  template cudaError_t launch_bwd_prep<Element, 64, 64>(BwdPrepArgs, int64_t, cudaStream_t);   \
  template cudaError_t launch_bwd_prep<Element, 96, 96>(BwdPrepArgs, int64_t, cudaStream_t);   \
  template cudaError_t launch_bwd_prep<Element, 128, 128>(BwdPrepArgs, int64_t, cudaStream_t); \
  template cudaError_t launch_bwd_prep<Element, 192, 192>(BwdPrepArgs, int64_t, cudaStream_t); \
  template cudaError_t launch_bwd_prep<Element, 256, 256>(BwdPrepArgs, int64_t, cudaStream_t); \
  template cudaError_t launch_bwd_prep<Element, 192, 128>(BwdPrepArgs, int64_t, cudaStream_t); \
  template cudaError_t launch_dq_convert<Element>(const BwdParams&, cudaStream_t);              \
  template cudaError_t launch_split_reduce<Element>(const BwdParams&, cudaStream_t);
JAXCP_BWD_PREP(cutlass::bfloat16_t)
JAXCP_BWD_PREP(cutlass::half_t)
#undef JAXCP_BWD_PREP

}  // namespace jaxcp::cuda::detail
