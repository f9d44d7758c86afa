// Parameters and launchers shared by the backward kernels (private to ffi/cuda/attention/).
#pragma once
#include "device.cuh"

namespace jaxcp::cuda::detail {

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const float* lse;    // [B, Hq, Sq]
  const float* delta;  // rowsum(dO * O) - dlse: [B, Hq, Sq], or [B, Hq, sq_pad] for the sm_90a kernel
  const int32_t* q_seg;
  const int32_t* q_pos;
  const int32_t* kv_seg;
  const int32_t* kv_pos;
  float* dq_accum;  // float32, unscaled (atomic dQ mode): [B, Sq, Hq, D], or per query tile (sm_90a)
  void* dq;         // [B, Sq, Hq, D] (dQ kernel output)
  void* dk;         // [B, Skv, Hkv, D]
  void* dv;         // [B, Skv, Hkv, Dv]: Dv = D but in the sm_90a kernel (sm90_value_head_dim)
  // When splits > 1, float32 partial sums: [splits, B, Skv, Hkv, D] (sm_80 kernel, reduced by
  // split_reduce_kernel), or tiles [splits, B, nkv, Hkv, BN * D] (sm_90a kernel: summed by the
  // last split of each key tile, counted in split_count [B, nkv, Hkv], zeroed per call).
  float* dk_part;
  float* dv_part;
  int* split_count;
  int64_t B, Sq, Skv;
  int Hq, Hkv, group, splits;
  int64_t q_row, kv_row, v_row;  // elements per token: Hq * D, Hkv * D, Hkv * Dv
  float scale, scale_log2;
  MaskParams mask;
  // dK/dV kernel plan: query tiles of kBwdBlockM (sm_90a: bwd_sm90_block_m(D)), key tiles of
  // bwd_block_n(D).
  const TileSummary* q_sum;   // [B, nq]
  const TileSummary* kv_sum;  // [B, nkv]
  const TileRange* kv_range;  // [B, nkv]: query tiles per key tile
  const int* kv_order;        // [B * nkv]: (b * nkv + n) key tiles, heaviest first (or in index order)
  int head_chunk;             // (kv head, split) pairs per scheduling chunk, divides Hkv*splits
  int nq, nkv;
  // dQ kernel plan: query tiles of kBwdBlockM, key tiles of dq_block_n(D).
  const TileSummary* kv_sum_dq;  // [B, nkv_dq]
  const TileRange* q_range_dq;   // [B, nq]: key tiles per query tile
  const int* q_order_dq;         // [B * nq]: (b * nq + m) query tiles, heaviest first
  int nkv_dq;
  // sm_90a dK/dV kernel only: lse * log2(e) (+inf for empty rows) and delta in rows of sq_pad
  // (a multiple of its query tile; padding rows hold +inf / 0), so a query tile's values are one
  // aligned block (256 bytes or more) for a bulk copy.
  const float* lse2;
  const ColMask* q_ids;  // (segment, position) of each query, in rows of sq_pad (padding: zeros)
  int64_t sq_pad;
  // Deterministic sm_90a backward: each dQ tile's adds go in key tile order, decreasing or, where
  // *dq_ascending (set by bwd_turn_order_kernel), increasing. dq_ticket[(b * nkv + n) * nq + m] =
  // how many key tiles before n in that order add to query tile m (valid where key tile n's walk
  // visits m); dq_sem[(b * Hq + h) * nq + m] = adds done so far (zeroed per call;
  // the sm_90a kernel at D <= 128 counts a GQA block's heads as one add, on its first head's).
  // All null otherwise.
  const int* dq_ascending;
  const int* dq_ticket;
  int* dq_sem;
};

// The work of one dK/dV block: one key tile of one kv head (or a split of its GQA group). The
// (head, split) pairs are cut into chunks of head_chunk; chunks run one after the other, inside a
// chunk key tiles go in kv_order (heaviest first, or in index order when every tile is light;
// the sm_90a default kernel's blocks of several query heads, or at D 96-128: document by
// document, heaviest first, see kBwdIndexOrderMaxQueries; for the deterministic sm_90a kernel in
// its turn order: bwd_turn_order_kernel) with the pairs of a tile on consecutive blocks. Small
// chunks keep the blocks running together on few heads (their Q / dO stay in L2); chunks of >= ~4
// waves keep the longest-first order (the sm_90a kernel's hold no more heads than L2 holds the Q,
// dO and dQ rows of: bwd_plan).
struct BwdBlock {
  int b, n_block, hk, split, h_begin, h_end, kv_rows;
  int64_t k0;
  TileRange range;  // query tiles
  TileSummary kvsum;
  bool kv_ragged;
};

template <int BN>
__forceinline__ __device__ BwdBlock bwd_block(const BwdParams& p, int64_t block) {
  BwdBlock w;
  const int64_t per_chunk = p.B * p.nkv * p.head_chunk;
  const int chunk = static_cast<int>(block / per_chunk);
  const int64_t r = block % per_chunk;
  const int tile = p.kv_order[r / p.head_chunk];
  const int y = chunk * p.head_chunk + static_cast<int>(r % p.head_chunk);
  w.hk = y / p.splits;
  w.split = y % p.splits;
  w.b = tile / p.nkv;
  w.n_block = tile % p.nkv;
  w.h_begin = w.hk * p.group + w.split * p.group / p.splits;
  w.h_end = w.hk * p.group + (w.split + 1) * p.group / p.splits;
  w.k0 = static_cast<int64_t>(w.n_block) * BN;
  w.kv_rows = static_cast<int>(p.Skv - w.k0 < BN ? p.Skv - w.k0 : BN);
  w.range = p.kv_range[w.b * p.nkv + w.n_block];
  w.kvsum = p.kv_sum[w.b * p.nkv + w.n_block];
  w.kv_ragged = w.k0 + BN > p.Skv;
  return w;
}

// Class of query tile i (summary qs) against block w's key tile.
template <int BM>
__forceinline__ __device__ int bwd_q_class(const BwdParams& p, const BwdBlock& w, const TileSummary& qs, int i) {
  return tile_class(qs, w.kvsum, p.mask, w.kv_ragged || static_cast<int64_t>(i + 1) * BM > p.Sq);
}

// First query tile at or after i that block w does not skip (w.range.y: none); its class in c.
// Called by whole warps (warp_first_unskipped).
template <int BM>
__forceinline__ __device__ int bwd_next_q(const BwdParams& p, const BwdBlock& w, int i, int& c) {
  const TileSummary* q_sum = p.q_sum + static_cast<int64_t>(w.b) * p.nq;
  return warp_first_unskipped(i, w.range.y, [&](int t) { return bwd_q_class<BM>(p, w, q_sum[t], t); }, c);
}

// The same, one tile at a time, for a thread on its own: the sm_90a backward (its producer is
// one thread, and the warp-wide search anywhere in that kernel raised the consumers' spills from
// 84 to 236 bytes). In either direction: the first query tile from i on, stepping by di (1 or
// -1), that block w does not skip, end (w.range.y or w.range.x - 1) if none; its class in c. (The
// deterministic kernel's direction is chosen at run time, by this arithmetic: a branch between
// two walks in every step cost it 3-5% on packed documents, this 0.5-2%; H200.)
template <int BM>
__forceinline__ __device__ int bwd_step_q_serial(const BwdParams& p, const BwdBlock& w, int i, int di, int end,
                                                 int& c) {
  const TileSummary* q_sum = p.q_sum + static_cast<int64_t>(w.b) * p.nq;
  for (; i != end; i += di) {
    c = bwd_q_class<BM>(p, w, q_sum[i], i);
    if (c != kSkip) break;
  }
  return i;
}
// Forward only, for the default kernel (the `<` compiles to other code than bwd_step_q_serial's
// `!=`, and that kernel's code stays as measured).
template <int BM>
__forceinline__ __device__ int bwd_next_q_serial(const BwdParams& p, const BwdBlock& w, int i, int& c) {
  const TileSummary* q_sum = p.q_sum + static_cast<int64_t>(w.b) * p.nq;
  for (; i < w.range.y; ++i) {
    c = bwd_q_class<BM>(p, w, q_sum[i], i);
    if (c != kSkip) break;
  }
  return i;
}

// bwd_sm80.cu: the sm_80 dK/dV kernel (dQ by float32 atomics into p.dq_accum when atomic_dq).
template <class Element, int D>
cudaError_t launch_bwd_dkdv(const BwdParams& p, bool atomic_dq, cudaStream_t stream);
// bwd_sm80_dq.cu: the sm_80 deterministic dQ kernel.
template <class Element, int D>
cudaError_t launch_bwd_dq(const BwdParams& p, cudaStream_t stream);

// The backward's pre-pass, one launch, bandwidth-bound: for each row (b, h, i) of delta,
//   delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] - dlse[b, h, i] (float32, d < Dv): the lse
//     cotangent folds into delta since d lse / d s_ij = p_ij;
//   with dq_accum, zeros D floats of the float32 dQ accumulator (rows * D floats in all, whatever
//     its layout), instead of a memset of its own;
//   with lse2 (sm_90a), lse2 = lse_log2(lse), and for the padding i in [Sq, stride), lse2 = +inf
//     and delta = 0 (padding queries then give P = 0 and dS = 0, never NaN);
//   with q_ids (sm_90a, blocks of h = 0), q_ids[b, i] = (segment, position) of query i, zeros past
//     Sq: rows of sq_pad, so that the sm_90a producer loads a query tile's with one bulk copy.
// Rows of delta are `stride` long (Sq, or sq_pad for the sm_90a kernel); each block holds rows of
// one (b, h), max(D, Dv)/8 threads per row rounded up to a power of two (the shuffle tree; D 96:
// 16, of which 12 load and zero; q/k 192 with v 128: 32, of which 16 load and 24 zero). Lane 0
// issues its small loads before the row's, so that every thread has one round trip to memory.
constexpr int bwd_prep_threads_per_row(int d, int dv) {
  int t = 1;
  while (t < d / 8 || t < dv / 8) t *= 2;
  return t;
}

struct BwdPrepArgs {
  const void* out;
  const void* dout;
  const float* dlse;   // [B, Hq, Sq] or null
  const float* lse;    // [B, Hq, Sq]
  float* lse2;         // [B, Hq, stride] or null
  float* delta;        // [B, Hq, stride]
  float* dq_accum;     // B * Hq * stride * D floats, or null
  const int32_t* q_seg;
  const int32_t* q_pos;
  ColMask* q_ids;      // [B, stride] or null
  int64_t Sq, stride;
  int Hq, blocks_per_bh;
};

// bwd_prep.cu: the pre-pass (a.blocks_per_bh is set here), the deterministic sm_90a backward's dQ
// tickets (p.dq_ticket), p.dq = Element(scale * p.dq_accum) for the sm_80 kernels' atomic dQ, and
// p.dk / p.dv = sums of the sm_80 kernel's split GQA groups' p.dk_part / p.dv_part.
template <class Element, int D, int Dv>
cudaError_t launch_bwd_prep(BwdPrepArgs a, int64_t batch, cudaStream_t stream);
cudaError_t launch_dq_tickets(const BwdParams& p, cudaStream_t stream);
// Deterministic sm_90a backward: kv_order (batch * nkv key tiles) in the dQ turns' order, and
// *ascending whether it is increasing (only where may_ascend: the kernel at D 128).
cudaError_t launch_turn_order(const TileRange* kv_range, int64_t batch, int64_t nkv, bool may_ascend, int* kv_order,
                              int* ascending, cudaStream_t stream);
template <class Element>
cudaError_t launch_dq_convert(const BwdParams& p, cudaStream_t stream);
template <class Element>
cudaError_t launch_split_reduce(const BwdParams& p, cudaStream_t stream);
}  // namespace jaxcp::cuda::detail

namespace jaxcp::cuda {
// bwd_launch.cu: whether the sm_90a dK/dV kernel runs these arguments (the device is sm_90 with
// this build's sm_90a image, a head dim it has: sm90_head_dim; when deterministic, rows not too
// long for their heads).
bool bwd_use_sm90(const AttentionArgs& args);
// bwd_sm90.cu: the sm_90a kernel's launcher for head dim d and value head dim dv (dK, dV, and dQ
// through p.dq_accum, converted into p.dq unless convert_dq is false: a first call of two that
// share the accumulator, BwdPhase::kBegin).
cudaError_t launch_bwd_sm90(const detail::BwdParams& p, DType dtype, int64_t d, int64_t dv, bool convert_dq,
                            cudaStream_t stream);
}  // namespace jaxcp::cuda

namespace jaxcp::cuda::detail {

// 2 adjacent float32 -> 2 adjacent 16-bit values, one 32-bit store.
template <class Element>
__forceinline__ __device__ void store_pair(Element* ptr, float a, float b) {
  const Element ea = static_cast<Element>(a), eb = static_cast<Element>(b);
  const uint32_t w = static_cast<uint32_t>(ea.raw()) | (static_cast<uint32_t>(eb.raw()) << 16);
  *reinterpret_cast<uint32_t*>(ptr) = w;
}

}  // namespace jaxcp::cuda::detail
