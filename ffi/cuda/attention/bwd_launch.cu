// Backward launchers and heuristics: which kernels run (bwd_use_sm90: the sm_90a or the sm_80
// dK/dV kernel; the deterministic dQ by the sm_80 dQ kernel or by the sm_90a kernel's turns), how
// the work is cut (GQA splits, head chunks, key tile order), the layout of the plan and the
// workspace, and attention_bwd_plan / attention_bwd, which launch the kernels in order.
#include <algorithm>
#include <climits>

#include "bwd.cuh"

namespace jaxcp::cuda {
namespace detail {
namespace {

// The sm_90a dK/dV kernel's key tiles run in index order when none walks the query tiles of more
// than this many queries (e.g. chunks of 2048, windows of 1024), else heaviest first. Sorted by
// work, the blocks running together lie far apart in the row and the Q / dO / dQ tiles they share
// fall out of L2 (H100, 4 x 16k, mean document 4k, chunks of 2048: L2 hit rate 67%, against 84%
// with windows of 1024, whose tiles all weigh about the same); index order was 6% faster there.
// With long documents heaviest first beats index order (causal, 4k documents: index order 1-2%
// slower), but sorted by work the blocks running together (one key tile of every document) visit
// the Q / dO / dQ tiles of every document, more than L2 holds when a block walks a GQA group's
// heads (H200, 1 x 128k, documents of 8k, 32/8: L2 hit rate 83%; 97% in index order,
// FlashAttention-3's 98%). The default kernel's blocks run document by document instead,
// heaviest document first (bwd_plan's by_document: launch_document_schedule), so that the last
// blocks to start are short ones: for GQA, and at head dims 96 and 128 for one head a block too
// (H200, forward+backward against heaviest first: 1 x 64k with 1k documents 3% faster, 2 x 8k
// single documents and 4 x 16k with 4k documents 1%, 1 x 128k with 8k documents level). At head
// dim 64 (query tiles of 128) it was 1% slower on 2 x 8k with 1k documents; the split-D designs
// (192, 256) keep heaviest first, unmeasured.
constexpr int kBwdIndexOrderMaxQueries = 4096;

// L2 bytes the blocks running together may fill with the Q, dO and dQ tiles they share (of the
// H100's and H200's 50 MB).
constexpr int64_t kBwdL2Bytes = 40ll << 20;

}  // namespace

struct BwdPlan {
  int64_t nq = 0, nkv = 0, nkv_dq = 0, sq_pad = 0;
  int bm = kBwdBlockM;  // query tile of the dK/dV plan: bwd_sm90_block_m for the sm_90a kernel
  int splits = 1, head_chunk = 1;
  bool sm90 = false;
  // Offsets into the plan buffer (attention_bwd_plan's: token metadata only) ...
  size_t q_sum = 0, kv_sum = 0, kv_range = 0, kv_order = 0, kv_sum_dq = 0, q_range_dq = 0, q_order_dq = 0,
         dq_ascending = 0, plan_bytes = 0;
  // ... and into the per-call workspace.
  size_t delta = 0, lse2 = 0, q_ids = 0, dq_accum = 0, dq_ticket = 0, dq_sem = 0, dk_part = 0, dv_part = 0,
         split_count = 0, bytes = 0;
  // Deterministic dQ: by the sm_80 dQ kernel (its own plan), or by the sm_90a kernel taking turns.
  bool sm80_dq = false, ordered_dq = false;
  // The turns may go in increasing key tile order (bwd_turn_order_kernel decides): the sm_90a
  // kernel at D 128 (96 is padded to it), whose blocks can walk their query tiles from the last.
  // At D 64 (query tiles of 128) increasing was 4% slower on 2 x 8k single documents (H200); the
  // split-D designs walk from the first, in decreasing order.
  bool may_ascend = false;
  bool by_document = false;  // sm_90a default kernel (GQA blocks, or head dims 96-128): documents heaviest first
};

BwdPlan bwd_plan(const AttentionArgs& a) {
  const AttentionShape& s = a.shape;
  BwdPlan r;
  const int bn = bwd_block_n(s.head_dim), bn_dq = dq_block_n(s.head_dim);
  r.sm90 = bwd_use_sm90(a);
  r.bm = r.sm90 ? bwd_sm90_block_m(s.head_dim) : kBwdBlockM;
  r.nq = ceil_div64(s.q_len, r.bm);
  r.nkv = ceil_div64(s.kv_len, bn);
  r.nkv_dq = ceil_div64(s.kv_len, bn_dq);
  r.sq_pad = r.nq * r.bm;
  // Split the query heads of a GQA group over several blocks when there are too few key tiles
  // to fill the GPU (partial dK/dV sums in float32, reduced in a fixed order).
  const int64_t G = s.kv_heads > 0 ? s.q_heads / s.kv_heads : 1;
  const int64_t base = r.nkv * s.kv_heads * s.batch;
  // The deterministic kernel at D <= 128 gets one query head a block. Blocks of several heads
  // were slower forward+backward on 4x16k doc4k and 1x128k doc8k, 32/8 (H200): two heads walked
  // inside each query tile (one turn a tile for both) 2.5-6.7% at D 128 (D 64: 3.3% faster on
  // the first, 1.5% slower on the second); the whole group head after head, a turn per (head,
  // query tile), 14-19%. The dK / dV partials of one head a block take about twice the dQ
  // accumulator's memory (keys no longer than the queries).
  const bool one_head_a_block = a.deterministic && r.sm90 && s.head_dim <= 128 && s.v_dim() == s.head_dim &&
                                s.kv_len <= r.sq_pad;
  if (G > 1 && base > 0) {
    // Aim at >= 4 waves of one-block-per-SM work (causal work per key tile is very uneven);
    // use a divisor of G so that every split gets the same number of heads.
    const int64_t want =
        one_head_a_block ? G : ceil_div64(4 * static_cast<int64_t>(multiprocessor_count()), base);
    int64_t sp = 1;
    while (sp < G && (sp < want || G % sp != 0)) ++sp;
    while (sp > 1 && (s.kv_heads * sp > 65535 || G % sp != 0)) --sp;
    r.splits = static_cast<int>(sp);
  }
  {
    // Smallest divisor of Hkv*splits giving >= 4 waves of blocks per scheduling chunk. (Rounded up
    // to a multiple of splits, so that the sm_90a kernel's last split of a key tile always finds
    // the others' partial sums in L2, the deterministic 1x128k doc8k 32/8 forward+backward was 17%
    // slower and 4x16k doc4k 32/8 1.7% slower than with this rule, H200.)
    const int64_t pairs = s.kv_heads * r.splits, tiles = s.batch * r.nkv;
    const int64_t want = 4 * static_cast<int64_t>(multiprocessor_count());
    int64_t hc = 1;
    while (hc < pairs && (tiles * hc < want || pairs % hc != 0)) ++hc;
    // The sm_90a kernel: at most as many heads a chunk as 40 MB of L2 holds a row of Q, dO and
    // float32 dQ for (FlashAttention-3's rule for its backward). A chunk's blocks run its heads
    // of a key tile together, so under a causal mask the blocks of a long document walk the
    // queries of every head of the chunk at once: on 2 x 8k single documents, 16 heads, chunks of
    // 8 heads made the kernel read 1.7x the DRAM bytes of FlashAttention-3's (which runs 4), and
    // forward+backward was 0.6-1.1% slower than with chunks of 4 (H200). Never below 2 pairs:
    // with one head a chunk, the last chunk's heaviest block (the first key tile of the longest
    // document) can outlast the chunk's share of each SM (1 x 32k, exponential documents of mean
    // 2k: 256 blocks, the heaviest 194 steps, 106 a SM); 2 made forward+backward 1.6% faster
    // there, 0.4-0.8% on 1x64k doc1k, 0.2-0.3% slower on single documents of 32k and 64k (H200).
    // Reduced to a divisor of the pairs that is a multiple of splits.
    if (r.sm90) {
      const int64_t pair_bytes = s.q_len * (G / r.splits) * (s.head_dim * 6 + s.v_dim() * 2);
      const int64_t fit = std::max<int64_t>(kBwdL2Bytes / std::max<int64_t>(pair_bytes, 1),
                                            std::max<int64_t>(2, r.splits));
      if (hc > fit)
        while (hc > r.splits && (hc > fit || pairs % hc != 0 || hc % r.splits != 0)) --hc;
    }
    r.head_chunk = static_cast<int>(hc);
  }
  r.sm80_dq = a.deterministic && !r.sm90;
  r.ordered_dq = a.deterministic && r.sm90;
  r.may_ascend = r.ordered_dq && s.head_dim == 128 && s.v_dim() == s.head_dim;
  r.by_document = r.sm90 && !r.ordered_dq && (G / r.splits > 1 || (s.head_dim > 64 && s.head_dim <= 128));
  WorkspaceLayout pl;
  r.q_sum = pl.take(sizeof(TileSummary) * s.batch * r.nq);
  r.kv_sum = pl.take(sizeof(TileSummary) * s.batch * r.nkv);
  r.kv_range = pl.take(sizeof(TileRange) * s.batch * r.nkv);
  r.kv_order = pl.take(sizeof(int) * s.batch * r.nkv);
  if (r.sm80_dq) {
    r.kv_sum_dq = pl.take(sizeof(TileSummary) * s.batch * r.nkv_dq);
    r.q_range_dq = pl.take(sizeof(TileRange) * s.batch * r.nq);
    r.q_order_dq = pl.take(sizeof(int) * s.batch * r.nq);
  }
  if (r.ordered_dq) r.dq_ascending = pl.take(sizeof(int));
  r.plan_bytes = pl.bytes;
  WorkspaceLayout w;
  r.delta = w.take(sizeof(float) * s.batch * s.q_heads * (r.sm90 ? r.sq_pad : s.q_len));
  if (r.sm90) {
    r.lse2 = w.take(sizeof(float) * s.batch * s.q_heads * r.sq_pad);
    r.q_ids = w.take(sizeof(ColMask) * s.batch * r.sq_pad);
  }
  if (!r.sm80_dq) {
    // sm_90a: per query tile, padded to whole tiles (see bwd_sm90.cu).
    r.dq_accum = w.take(sizeof(float) * s.batch * (r.sm90 ? r.sq_pad : s.q_len) * s.q_heads * s.head_dim);
    if (r.ordered_dq) {
      r.dq_ticket = w.take(sizeof(int) * s.batch * r.nkv * r.nq);
      r.dq_sem = w.take(sizeof(int) * s.batch * s.q_heads * r.nq);
    }
  }
  if (r.splits > 1) {
    // sm_90a: whole key tiles (BwdParams::dk_part)
    const size_t keys = r.sm90 ? static_cast<size_t>(r.nkv) * bn : static_cast<size_t>(s.kv_len);
    const size_t part = sizeof(float) * r.splits * s.batch * keys * s.kv_heads;
    r.dk_part = w.take(part * s.head_dim);
    r.dv_part = w.take(part * s.v_dim());
    if (r.sm90) r.split_count = w.take(sizeof(int) * s.batch * r.nkv * s.kv_heads);
  }
  r.bytes = w.bytes;
  return r;
}

template <class Element, int D, int Dv = D>
cudaError_t run_bwd(const AttentionArgs& a, const BwdPlan& plan, BwdParams p, const void* out,
                    const float* dlse, BwdPhase phase, cudaStream_t stream) {
  const AttentionShape& s = a.shape;
  cudaError_t err;
  // delta = rowsum(dO * O) - dlse, the dQ accumulator's zeros, and for the sm_90a kernel lse2 and
  // q_ids: one pass (a kEnd call finds them in its workspace, the kBegin call's)
  const BwdPrepArgs prep{out, p.dout, dlse, p.lse, plan.sm90 ? const_cast<float*>(p.lse2) : nullptr,
                         const_cast<float*>(p.delta), plan.sm80_dq ? nullptr : p.dq_accum, p.q_seg, p.q_pos,
                         plan.sm90 ? const_cast<ColMask*>(p.q_ids) : nullptr, s.q_len,
                         plan.sm90 ? plan.sq_pad : s.q_len, p.Hq, 0};
  if (phase != BwdPhase::kEnd && (err = launch_bwd_prep<Element, D, Dv>(prep, s.batch, stream))) return err;
  if (plan.ordered_dq) {  // the turns of this call's key tiles
    if ((err = cudaMemsetAsync(p.dq_sem, 0, sizeof(int) * s.batch * s.q_heads * plan.nq, stream))) return err;
    if ((err = launch_dq_tickets(p, stream))) return err;
  }
  if (p.split_count && (err = cudaMemsetAsync(p.split_count, 0, sizeof(int) * s.batch * plan.nkv * s.kv_heads, stream)))
    return err;
  if constexpr (!sm80_head_dim(D) || Dv != D) {  // sm_90a only (attention_bwd_head_dim_supported)
    if (!plan.sm90) return cudaErrorInvalidValue;
  }
  if (p.nkv > 0) {
    if (plan.sm90) {
      err = launch_bwd_sm90(p, std::is_same_v<Element, cutlass::bfloat16_t> ? DType::kBF16 : DType::kF16, D, Dv,
                            phase != BwdPhase::kBegin, stream);
    } else if constexpr (sm80_head_dim(D) && Dv == D) {
      err = launch_bwd_dkdv<Element, D>(p, !plan.sm80_dq, stream);
    }
    if (err) return err;
  }
  if (plan.sm80_dq) {
    if constexpr (sm80_head_dim(D) && Dv == D) {
      if ((err = launch_bwd_dq<Element, D>(p, stream))) return err;
    }
  } else if (!plan.sm90 && phase != BwdPhase::kBegin) {  // the sm_90a launcher converts its own dQ layout
    if ((err = launch_dq_convert<Element>(p, stream))) return err;
  }
  if (plan.splits > 1 && !plan.sm90) return launch_split_reduce<Element>(p, stream);
  return cudaSuccess;
}

template <class Element>
cudaError_t dispatch_bwd(const AttentionArgs& a, const BwdPlan& plan, const BwdParams& p,
                         const void* out, const float* dlse, BwdPhase phase, cudaStream_t stream) {
  if (a.shape.v_dim() != a.shape.head_dim) {
    static_assert(sm90_value_head_dim(192, 128));
    if (sm90_value_head_dim(a.shape.head_dim, a.shape.v_dim()))
      return run_bwd<Element, 192, 128>(a, plan, p, out, dlse, phase, stream);
    return cudaErrorInvalidValue;
  }
  switch (a.shape.head_dim) {
    case 64: return run_bwd<Element, 64>(a, plan, p, out, dlse, phase, stream);
    case 96: return run_bwd<Element, 96>(a, plan, p, out, dlse, phase, stream);
    case 128: return run_bwd<Element, 128>(a, plan, p, out, dlse, phase, stream);
    case 192: return run_bwd<Element, 192>(a, plan, p, out, dlse, phase, stream);
    case 256: return run_bwd<Element, 256>(a, plan, p, out, dlse, phase, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace detail

bool bwd_use_sm90(const AttentionArgs& a) {
  if (a.kernel.sm80_only) return false;
  const AttentionShape& s = a.shape;
  if (!sm90_head_dim(s.head_dim)) return false;
  if (a.deterministic) {
    // Its tickets take an int per (key tile, query tile): kept under a quarter of the float32 dQ
    // accumulator, so that memory stays O(B H S). Longer rows with few heads (e.g. S > 4M at 16
    // heads of 128, S > 256k with one head) take the sm_80 deterministic kernels.
    const int64_t bm = bwd_sm90_block_m(s.head_dim), nq = ceil_div64(s.q_len, bm);
    if (nq * ceil_div64(s.kv_len, bwd_block_n(s.head_dim)) > nq * bm * s.q_heads * s.head_dim / 4) return false;
  }
  return sm90_kernels_available();
}

size_t attention_bwd_workspace_bytes(const AttentionArgs& a) { return detail::bwd_plan(a).bytes; }

bool attention_bwd_chains(const AttentionArgs& a) { return bwd_use_sm90(a); }

size_t attention_bwd_plan_bytes(const AttentionArgs& a) { return detail::bwd_plan(a).plan_bytes; }

bool attention_bwd_head_dim_supported(const AttentionArgs& a) {
  const int64_t d = a.shape.head_dim, dv = a.shape.v_dim();
  // The deterministic D 96 / 192 backward may take the sm_80 kernels (bwd_use_sm90), which have
  // neither tile: always padded, so that the widths do not hang on the row length.
  const bool sm90_only = !a.deterministic && bwd_use_sm90(a);
  if (dv != d) return sm90_value_head_dim(d, dv) && sm90_only;
  return sm80_head_dim(d) || (sm90_head_dim(d) && sm90_only);
}

namespace detail {

// Whether the kernels take these arguments (the launchers return cudaErrorInvalidValue if not).
bool bwd_args_ok(const AttentionArgs& a, const BwdPlan& plan) {
  const AttentionShape& s = a.shape;
  if (!attention_bwd_head_dim_supported(a)) return false;
  if (s.batch < 0 || s.q_len < 0 || s.kv_len < 0 || s.q_heads < 0 || s.kv_heads <= 0 ||
      s.q_heads % s.kv_heads != 0)
    return false;
  return !(s.batch > 65535 || s.q_heads > 65535 || s.batch * plan.nq * s.q_heads > INT_MAX ||
           s.batch * plan.nkv * s.q_heads > INT_MAX || plan.nq > INT_MAX || plan.nkv > INT_MAX ||
           plan.nkv_dq > INT_MAX || s.q_len > INT_MAX || s.kv_len > INT_MAX);
}

// Calls with nothing to plan: no query, key or head (the gradients are then zeros or empty).
bool bwd_nothing_to_plan(const AttentionShape& s) {
  return s.batch == 0 || s.q_heads == 0 || s.q_len == 0 || s.kv_len == 0;
}

}  // namespace detail

cudaError_t attention_bwd_plan(const AttentionArgs& a, const int32_t* q_seg, const int32_t* q_pos,
                               const int32_t* kv_seg, const int32_t* kv_pos, void* plan_buffer, size_t plan_bytes,
                               cudaStream_t stream) {
  const AttentionShape& s = a.shape;
  const detail::BwdPlan plan = detail::bwd_plan(a);
  if (!detail::bwd_args_ok(a, plan)) return cudaErrorInvalidValue;
  if (detail::bwd_nothing_to_plan(s)) return cudaSuccess;
  if (plan_bytes < plan.plan_bytes || plan_buffer == nullptr) return cudaErrorInvalidValue;
  char* base = static_cast<char*>(plan_buffer);
  auto* q_sum = reinterpret_cast<TileSummary*>(base + plan.q_sum);
  auto* kv_sum = reinterpret_cast<TileSummary*>(base + plan.kv_sum);
  auto* kv_range = reinterpret_cast<TileRange*>(base + plan.kv_range);
  const int bn = bwd_block_n(s.head_dim), bn_dq = dq_block_n(s.head_dim);
  cudaError_t err;
  const TileTokens q_tok{q_seg, q_pos, s.q_len, plan.bm}, kv_tok{kv_seg, kv_pos, s.kv_len, bn};
  if ((err = launch_tile_summaries(q_tok, q_sum, kv_tok, kv_sum, s.batch, stream))) return err;
  if ((err = launch_tile_ranges(kv_sum, plan.nkv, kv_tok, q_sum, plan.nq, q_tok, s.batch, a.mask,
                                /*rows_are_q=*/false, kv_range, stream)))
    return err;
  auto* kv_order = reinterpret_cast<int*>(base + plan.kv_order);
  if (plan.ordered_dq) {  // the turns need blocks to start in their key tiles' turn order
    if ((err = detail::launch_turn_order(kv_range, s.batch, plan.nkv, plan.may_ascend, kv_order,
                                         reinterpret_cast<int*>(base + plan.dq_ascending), stream)))
      return err;
  } else if ((err = plan.by_document
                        ? launch_document_schedule(kv_range, s.batch * plan.nkv, plan.nkv, kv_order, stream)
                        : launch_tile_schedule(kv_range, s.batch * plan.nkv,
                                               plan.sm90 ? detail::kBwdIndexOrderMaxQueries / plan.bm : 0,
                                               kv_order, stream))) {
    return err;
  }
  if (plan.sm80_dq) {
    auto* kv_sum_dq = reinterpret_cast<TileSummary*>(base + plan.kv_sum_dq);
    auto* q_range_dq = reinterpret_cast<TileRange*>(base + plan.q_range_dq);
    const TileTokens kv_tok_dq{kv_seg, kv_pos, s.kv_len, bn_dq};
    if ((err = launch_tile_summaries(kv_tok_dq, kv_sum_dq, kv_tok_dq, nullptr, s.batch, stream))) return err;
    if ((err = launch_tile_ranges(q_sum, plan.nq, q_tok, kv_sum_dq, plan.nkv_dq, kv_tok_dq, s.batch, a.mask,
                                  /*rows_are_q=*/true, q_range_dq, stream)))
      return err;
    if ((err = launch_tile_schedule(q_range_dq, s.batch * plan.nq, /*index_order_max_work=*/0,
                                    reinterpret_cast<int*>(base + plan.q_order_dq), stream)))
      return err;
  }
  return cudaSuccess;
}

cudaError_t attention_bwd(const AttentionArgs& a, DType dtype, const void* q, const void* k,
                          const void* v, const void* out, const float* lse, const void* dout,
                          const float* dlse, const int32_t* q_seg, const int32_t* q_pos, const int32_t* kv_seg,
                          const int32_t* kv_pos, const void* plan_buffer, size_t plan_bytes, void* dq, void* dk,
                          void* dv, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                          BwdPhase phase) {
  const AttentionShape& s = a.shape;
  const detail::BwdPlan plan = detail::bwd_plan(a);
  if (!detail::bwd_args_ok(a, plan)) return cudaErrorInvalidValue;
  // attention_bwd_chains; a chained call has keys (kv_len > 0: one without could not pass the
  // accumulator on, below)
  if (phase != BwdPhase::kWhole && (!plan.sm90 || s.kv_len == 0)) return cudaErrorInvalidValue;
  const size_t elem = 2;
  const size_t q_bytes = elem * s.batch * s.q_len * s.q_heads * s.head_dim;
  const size_t k_bytes = elem * s.batch * s.kv_len * s.kv_heads * s.head_dim;
  const size_t v_bytes = elem * s.batch * s.kv_len * s.kv_heads * s.v_dim();
  if (s.batch == 0 || s.q_heads == 0) return cudaSuccess;
  if (s.q_len == 0 || s.kv_len == 0) {  // nothing interacts: all gradients are zero
    cudaError_t err;
    if (q_bytes && (err = cudaMemsetAsync(dq, 0, q_bytes, stream))) return err;
    if (k_bytes && (err = cudaMemsetAsync(dk, 0, k_bytes, stream))) return err;
    if (v_bytes && (err = cudaMemsetAsync(dv, 0, v_bytes, stream))) return err;
    return cudaSuccess;
  }
  if (plan_bytes < plan.plan_bytes || plan_buffer == nullptr) return cudaErrorInvalidValue;
  if (workspace_bytes < plan.bytes || workspace == nullptr) return cudaErrorInvalidValue;
  char* base = static_cast<char*>(workspace);
  // The kernels only read the plan (it may be shared with other calls).
  const char* plan_base = static_cast<const char*>(plan_buffer);

  detail::BwdParams p{};
  p.q = q; p.k = k; p.v = v; p.dout = dout; p.lse = lse;
  p.lse2 = plan.sm90 ? reinterpret_cast<float*>(base + plan.lse2) : nullptr;
  p.q_ids = plan.sm90 ? reinterpret_cast<ColMask*>(base + plan.q_ids) : nullptr;
  p.sq_pad = plan.sq_pad;
  p.delta = reinterpret_cast<float*>(base + plan.delta);
  p.q_seg = q_seg; p.q_pos = q_pos; p.kv_seg = kv_seg; p.kv_pos = kv_pos;
  p.dq_accum = plan.sm80_dq ? nullptr : reinterpret_cast<float*>(base + plan.dq_accum);
  p.dq_ascending = plan.ordered_dq ? reinterpret_cast<const int*>(plan_base + plan.dq_ascending) : nullptr;
  p.dq_ticket = plan.ordered_dq ? reinterpret_cast<int*>(base + plan.dq_ticket) : nullptr;
  p.dq_sem = plan.ordered_dq ? reinterpret_cast<int*>(base + plan.dq_sem) : nullptr;
  p.dq = dq; p.dk = dk; p.dv = dv;
  p.dk_part = plan.splits > 1 ? reinterpret_cast<float*>(base + plan.dk_part) : nullptr;
  p.dv_part = plan.splits > 1 ? reinterpret_cast<float*>(base + plan.dv_part) : nullptr;
  p.split_count = plan.splits > 1 && plan.sm90 ? reinterpret_cast<int*>(base + plan.split_count) : nullptr;
  p.B = s.batch; p.Sq = s.q_len; p.Skv = s.kv_len;
  p.Hq = static_cast<int>(s.q_heads);
  p.Hkv = static_cast<int>(s.kv_heads);
  p.group = static_cast<int>(s.group());
  p.splits = plan.splits;
  p.head_chunk = plan.head_chunk;
  p.q_row = s.q_heads * s.head_dim;
  p.kv_row = s.kv_heads * s.head_dim;
  p.v_row = s.kv_heads * s.v_dim();
  p.scale = a.scale;
  p.scale_log2 = a.scale * kLog2e;
  p.mask = a.mask;
  p.q_sum = reinterpret_cast<const TileSummary*>(plan_base + plan.q_sum);
  p.kv_sum = reinterpret_cast<const TileSummary*>(plan_base + plan.kv_sum);
  p.kv_range = reinterpret_cast<const TileRange*>(plan_base + plan.kv_range);
  p.kv_order = reinterpret_cast<const int*>(plan_base + plan.kv_order);
  p.nq = static_cast<int>(plan.nq);
  p.nkv = static_cast<int>(plan.nkv);
  p.kv_sum_dq = plan.sm80_dq ? reinterpret_cast<const TileSummary*>(plan_base + plan.kv_sum_dq) : nullptr;
  p.q_range_dq = plan.sm80_dq ? reinterpret_cast<const TileRange*>(plan_base + plan.q_range_dq) : nullptr;
  p.q_order_dq = plan.sm80_dq ? reinterpret_cast<const int*>(plan_base + plan.q_order_dq) : nullptr;
  p.nkv_dq = static_cast<int>(plan.nkv_dq);
  return dtype == DType::kBF16
             ? detail::dispatch_bwd<cutlass::bfloat16_t>(a, plan, p, out, dlse, phase, stream)
             : detail::dispatch_bwd<cutlass::half_t>(a, plan, p, out, dlse, phase, stream);
}

}  // namespace jaxcp::cuda
