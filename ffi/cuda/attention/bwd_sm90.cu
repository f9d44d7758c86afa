// Backward kernel for Hopper (sm_90a): dK, dV and dQ on wgmma and TMA.
//
// One CTA owns one key tile of 128 keys of one kv head (or a split of its GQA group), the same
// blocks and tile plan as the sm_80 dK/dV kernel (bwd_block). A producer warpgroup loads K and V
// once and streams the query tiles (Q + lse + the queries' segments and positions, dO + delta; 64
// queries each, 128 at D 64) that the plan does not skip through two TMA pipelines. Two consumer
// warpgroups own 64 keys each and compute everything transposed, keys as rows, so that P and dS
// come out of the tensor cores already in the register layout of the next GEMM's A operand:
//   S^T = K Q^T, dP^T = V dO^T                       (shared-memory wgmma)
//   P^T = exp2(S^T scale log2e - lse2), dS^T = P^T (dP^T - delta)
//   dV += P^T dO, dK += dS^T Q                        (register-A wgmma, accumulators in registers)
//   dQ_tile = dS K                                    (dS^T through shared memory; the warpgroups
//                                                      split D, or at D 64 the 128 queries)
// dQ_tile goes through shared memory into a float32 accumulator in global memory by bulk
// reduce-adds (cp.reduce.async.bulk: no per-element atomics), one per warpgroup's half, issued by
// a writer warp of the producer warpgroup so that the consumers only store and go on. A step
// (FlashAttention-3's order): S^T and dP^T issued; P^T once S^T is done; dS^T from the float32
// P^T once dP^T is done; dS^T stored; dV issued; the barrier that both halves of dS^T are in
// shared memory; dQ issued; dK issued once dV is done (dO released), and running while dQ is
// stored. (Against dV issued before dS^T, dS^T from the 16-bit P^T and dK in two halves around
// dQ, this order's kernel is 1.5-2.7% faster at D 64 and 128 on an H200.) The accumulator
// keeps each tile in the warpgroups' register-fragment order (contiguous, conflict-free
// shared-memory writes); bwd_sm90_dq_convert_kernel maps it back to [B, Sq, Hq, D], scaled.
// At the end dK and dV go through the K and V tiles' shared memory and leave by TMA stores.
//
// deterministic=True keeps all of this and fixes the order of the float32 adds
// into each dQ tile: the key tiles that visit it add in a fixed order, each waiting for its
// turn on a per-tile semaphore (its ticket: how many key tiles before it visit the tile, from
// bwd_dq_ticket_kernel) and passing it on once its bulk add has completed. Blocks start in that
// key-tile order (bwd_turn_order_kernel), so no turn waits on a block that has not started. The
// order is decreasing, each block walking its query tiles from the first: under causal masks
// (windows, chunks) the higher key tiles then reach a query tile first (FlashAttention-3's
// deterministic backward orders its dQ adds the same way). At D 128 with one document a row it
// is increasing, each block walking from the last: the heaviest blocks start first, as in the
// default kernel's schedule. dK and dV need no turns: one block
// writes each key tile's (split GQA groups' partial sums are added in split order by the block of
// the last split to finish: bwd_sm90_epilogue).
// bwd_plan gives each query head its own block where it can (keys no longer than the queries).
// A block of several heads runs them innermost (every head of a query tile, then the next tile)
// and takes one turn per query tile for all of them (on the semaphore of its first head): a turn
// costs a wait on the semaphore, the adds' completion and a GPU-scope fence. At D 192 and 256 the
// consumers take turns per head.
//
// Multi-head latent attention (q/k 192, v 128: KT::kDv) runs V, dO, dP^T = V dO^T and dV at the
// value head dim, Q, K, S^T, dK and dQ at the head dim.
// D 192 and 256 (BwdSm90SplitDTraits, kSplitD) keep the producer and the masks but not the
// register budget of 128 keys x D for both dK and dV: their key tiles are 64 keys, the warpgroups
// split the queries of S^T / dP^T and the head dim of dK / dV / dQ, so P^T and dS^T go through shared
// memory to both (shared-memory wgmma), and each warpgroup reduce-adds its half of dQ from the
// registers (red.global.add.v4.f32, in the same fragment order; there is no room for a float32
// dQ tile in shared memory next to the D 256 tiles). On 2 x 8k with documents of 1k (H100) it is
// bound by L2 (89% of its throughput: Q and dO loads and those reductions, 64 KB each per step).
// Deterministic, both warpgroups add inside the block's turn: one thread waits for it and a
// barrier lets them in; after each thread's adds and a fence, a second barrier, and one thread
// passes the turn on.
#include <climits>

#include "bwd_sm90_traits.cuh"

namespace jaxcp::cuda {
namespace detail {

// dQ tile of (b, h, query tile m) in the float32 accumulator: kBM * kD floats, fragment order.
__forceinline__ __device__ int64_t dq_tile_offset(const BwdParams& p, int b, int h, int m, int tile_elems) {
  return ((static_cast<int64_t>(b) * p.Hq + h) * p.nq + m) * tile_elems;
}

// Q, dO and the dQ accumulator are read (added to) again by every key tile of their documents:
// they are kept in L2 ahead of the K/V tiles, which each block reads once.
__forceinline__ __host__ __device__ constexpr cute::TMA::CacheHintSm90 reused_in_l2() {
  return cute::TMA::CacheHintSm90::EVICT_LAST;
}

__forceinline__ __device__ void bulk_reduce_add_f32(float* gmem, const float* smem, uint32_t bytes) {
#if JAXCP_SM90_DEVICE
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [%0], [%1], %2, %3;\n"
               ::"l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes),
               "l"(static_cast<uint64_t>(reused_in_l2()))
               : "memory");
#endif
}

// The deterministic kernels' turns: a dQ tile's semaphore read with acquire semantics until it
// shows this block's ticket, and set to the next ticket with release semantics once this
// block's adds to the tile are complete. The sm_90a kernel's bulk adds (async proxy) are ordered
// with these generic accesses by proxy fences on either side.
__forceinline__ __device__ void take_turn(const int* sem, int ticket) {
#if JAXCP_SM90_DEVICE
  int v;
  for (;;) {
    asm volatile("ld.global.acquire.gpu.b32 %0, [%1];\n" : "=r"(v) : "l"(sem) : "memory");
    if (v == ticket) break;
    __nanosleep(32);
  }
#endif
}

__forceinline__ __device__ void fence_proxy_async_global() {
#if JAXCP_SM90_DEVICE
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}

// Block (b, key tile n)'s turn on dQ tile (b, h, m): the tile's semaphore and the block's ticket.
struct DqTurn {
  int* sem;
  int ticket;
};
__forceinline__ __device__ DqTurn dq_turn(const BwdParams& p, int b, int h, int n, int m) {
  return DqTurn{p.dq_sem + (static_cast<int64_t>(b) * p.Hq + h) * p.nq + m,
                p.dq_ticket[(static_cast<int64_t>(b) * p.nkv + n) * p.nq + m]};
}

__forceinline__ __device__ void release_turn(int* sem, int next) {
#if JAXCP_SM90_DEVICE
  asm volatile("st.global.release.gpu.b32 [%0], %1;\n" ::"l"(sem), "r"(next) : "memory");
#endif
}

// 4 floats added to global memory (sm_90: one vector reduction, no return value).
__forceinline__ __device__ void red_add_v4(float* gmem, float a, float b, float c, float d) {
#if JAXCP_SM90_DEVICE
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(gmem), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#endif
}

// Stores 16-bit fragment elements pairwise: elements 2e and 2e + 1 of an accumulator fragment
// are adjacent columns, adjacent in a column-contiguous shared tile: one 32-bit store per pair.
template <class TD, class TS>
__forceinline__ __device__ void store_fragment_pairs(TD&& dst, TS const& src) {
  CUTE_UNROLL
  for (int e = 0; e < size(src) / 2; ++e)
    *reinterpret_cast<uint32_t*>(&dst(2 * e)) = reinterpret_cast<const uint32_t*>(src.data())[e];
}

// The TMA partitions (global, shared) of block w's key tile of a [B, Skv, Hkv, D] tensor (D: the
// head dim or, for V and dV, the value head dim): K or V to load, dK or dV to store.
template <int BN, int D, class Tma, class SmemTensor>
__forceinline__ __device__ auto key_tile_tma(const Tma& tma, const BwdParams& p, const BwdBlock& w, SmemTensor& s) {
  Tensor m = tma.get_tma_tensor(make_shape(static_cast<int>(p.Skv), D, p.Hkv, static_cast<int>(p.B)));
  Tensor g = local_tile(m(_, _, w.hk, w.b), Shape<Int<BN>, Int<D>>{}, make_coord(w.n_block, _0{}));
  return tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
}

// Split GQA groups' float32 partial sums of dK or dV: one tile per (split, b, key tile, kv head)
// in the consumers' register-fragment order ([float4 chunk][consumer thread][4]: each warp stores
// and loads 512 contiguous bytes), dK tiles and dV tiles apart (BwdParams::dk_part, dv_part).
// kThreads: the consumer warpgroups' threads.
template <int BN, int W>
__forceinline__ __device__ float* part_tile(float* part, const BwdParams& p, const BwdBlock& w, int split) {
  const int64_t tile = ((static_cast<int64_t>(split) * p.B + w.b) * p.nkv + w.n_block) * p.Hkv + w.hk;
  return part + tile * (BN * W);
}

template <int kThreads, class Acc>
__forceinline__ __device__ void store_part(float* tile, int tidx, const Acc& acc) {
  CUTE_UNROLL
  for (int c = 0; c < size(acc) / 4; ++c)
    reinterpret_cast<float4*>(tile)[c * kThreads + tidx] =
        make_float4(acc(4 * c), acc(4 * c + 1), acc(4 * c + 2), acc(4 * c + 3));
}

// acc = (add ? acc : 0) + tile, read from L2 (written by other blocks).
template <int kThreads, class Acc>
__forceinline__ __device__ void load_part(const float* tile, int tidx, Acc& acc, bool add) {
  CUTE_UNROLL
  for (int c = 0; c < size(acc) / 4; ++c) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(tile) + c * kThreads + tidx);
    acc(4 * c) = add ? acc(4 * c) + v.x : v.x;
    acc(4 * c + 1) = add ? acc(4 * c + 1) + v.y : v.y;
    acc(4 * c + 2) = add ? acc(4 * c + 2) + v.z : v.z;
    acc(4 * c + 3) = add ? acc(4 * c + 3) + v.w : v.w;
  }
}

// The partial tiles are read once: their L2 lines are dropped without being written to memory.
template <int kThreads>
__forceinline__ __device__ void discard_l2(const float* tile, int bytes, int tidx) {
#if JAXCP_SM90_DEVICE
  for (int off = tidx * 128; off < bytes; off += kThreads * 128)
    asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(reinterpret_cast<const char*>(tile) + off) : "memory");
#endif
}

template <class KT>
struct BwdSm90Params {
  BwdParams p;
  typename KT::TmaQ tma_q;
  typename KT::TmadO tma_do;
  typename KT::TmaK tma_k;
  typename KT::TmaV tma_v;
  typename KT::TmaStoreK tma_dk;
  typename KT::TmaStoreV tma_dv;
};

// ---------------- dQ writer warp: a bulk reduce-add per warpgroup and step ----------------
// Each warpgroup's half of the tile (its fragments) leaves as soon as it is in shared
// memory, and its buffer is free again once read, whatever the other warpgroup does.
// Deterministic (kOrdered): a query tile's adds take turns in key tile order (blocks
// start in that order, so a turn never waits on a block that has not started); the group's
// turn is taken at its first head and passed on after its last head's adds are complete,
// both by warps of their own (below), so that the writer never waits on global memory.
template <class KT, bool kOrdered, class NextStep>
__forceinline__ __device__ void bwd_sm90_dq_writer(typename KT::SharedStorage& ss, const BwdParams& p, const BwdBlock& w,
                                                   int i_first, int cls_first, NextStep&& next_step) {
  constexpr int BM = KT::kBM, D = KT::kD;
  constexpr int kHalf = BM * D / 2;  // floats
  int h = w.h_begin, i = i_first, c = cls_first;
  bool more = true;
  for (int half = 0; half < 2; ++half)  // both halves start empty
    cutlass::arch::NamedBarrier::arrive(KT::kDQSyncThreads, KT::kBarDQEmpty + half);
  int taken = 0, done = 0;  // deterministic: turns received from / handed to the turn warps
  do {
    const int hs = h, is = i;
    more = next_step(h, i, c);
    float* gdq = p.dq_accum + dq_tile_offset(p, w.b, hs, is, BM * D);
    for (int half = 0; half < 2; ++half) {
      cutlass::arch::NamedBarrier::sync(KT::kDQSyncThreads, KT::kBarDQFull + half);
      if (threadIdx.x == 32) {
        if constexpr (kOrdered) {
          if (half == 0 && hs == w.h_begin) {
            ss.turns.taken.receive(taken++);
            fence_proxy_async_global();  // the turn (generic proxy) before the adds (async)
          }
        }
        bulk_reduce_add_f32(gdq + half * kHalf, ss.dq.data() + half * kHalf, kHalf * 4);
        tma_store_arrive();
      }
    }
    if (threadIdx.x == 32) tma_store_wait<1>();  // the first half has been read
    __syncwarp();
    if (more) cutlass::arch::NamedBarrier::arrive(KT::kDQSyncThreads, KT::kBarDQEmpty);
    if (threadIdx.x == 32) tma_store_wait<0>();
    __syncwarp();
    if (more) cutlass::arch::NamedBarrier::arrive(KT::kDQSyncThreads, KT::kBarDQEmpty + 1);
    if constexpr (kOrdered) {
      if (threadIdx.x == 32 && hs == w.h_end - 1) {
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // the adds are done, not just read
        fence_proxy_async_global();
        ss.turns.done.wait_free(done);
        ss.turns.done.fill(done++);
      }
    }
    __syncwarp();
  } while (more);
  if (threadIdx.x == 32) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// ---------------- turn warps: take the group's turns ahead, pass them on ----------------
// Each walks the writer's steps. The taker (warp 2) waits on a query tile's semaphore
// for this block's ticket, up to two tiles ahead of the writer; the passer (warp 3)
// sets the next ticket once the writer's adds to the tile are complete. (A release at
// GPU scope stalls its thread on a memory barrier: in the writer, the consumers would
// wait for the dQ buffer meanwhile.)
template <class KT, class NextStep>
__forceinline__ __device__ void bwd_sm90_turn_warps(typename KT::SharedStorage& ss, const BwdParams& p, const BwdBlock& w,
                                                    int i_first, int cls_first, NextStep&& next_step) {
  const bool taker = threadIdx.x == 64;
  int h = w.h_begin, i = i_first, c = cls_first, k = 0;
  bool more = true;
  do {
    const int hs = h, is = i;
    more = next_step(h, i, c);
    if (hs != (taker ? w.h_begin : w.h_end - 1)) continue;
    const DqTurn turn = dq_turn(p, w.b, w.h_begin, w.n_block, is);
    if (taker) {
      ss.turns.taken.wait_free(k);
      take_turn(turn.sem, turn.ticket);
      ss.turns.taken.fill(k++);
    } else {
      ss.turns.done.receive(k++);
      release_turn(turn.sem, turn.ticket + 1);
    }
  } while (more);
}

// Q, dO, K and V in shared memory (Q's and dO's stages last), as the producer and consumers see them.
template <class KT>
__forceinline__ __device__ auto smem_tiles(typename KT::SharedStorage& ss) {
  return cute::make_tuple(make_tensor(make_smem_ptr(ss.q.data()), typename KT::SmemLayoutQ{}),
                          make_tensor(make_smem_ptr(ss.dout.data()), typename KT::SmemLayoutdO{}),
                          make_tensor(make_smem_ptr(ss.k.data()), typename KT::SmemLayoutK{}),
                          make_tensor(make_smem_ptr(ss.v.data()), typename KT::SmemLayoutV{}));
}

// The producer: one thread issues every load (K and V once, then each step's Q, dO and their
// rows) and writes each step's record.
template <class KT, class NextStep>
__forceinline__ __device__ void bwd_sm90_producer(const BwdSm90Params<KT>& P, typename KT::SharedStorage& ss,
                                                  const BwdBlock& w, int i_first, int cls_first, NextStep&& next_step,
                                                  typename KT::PipelineQ& pipe_q, typename KT::PipelineDO& pipe_do) {
  constexpr int BM = KT::kBM, BN = KT::kBN, D = KT::kD, Dv = KT::kDv;
  using PipelineQ = typename KT::PipelineQ;
  using PipelineDO = typename KT::PipelineDO;
  using StepInfo = BwdSm90StepInfo;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  const BwdParams& p = P.p;
  auto [sQ, sdO, sK, sV] = smem_tiles<KT>(ss);
  const int Sq = static_cast<int>(p.Sq), B = static_cast<int>(p.B);
  Tensor mQ = P.tma_q.get_tma_tensor(make_shape(Sq, D, p.Hq, B));
  Tensor mdO = P.tma_do.get_tma_tensor(make_shape(Sq, Dv, p.Hq, B));
  {
    auto [tKg, tKs] = key_tile_tma<BN, D>(P.tma_k, p, w, sK);
    auto [tVg, tVs] = key_tile_tma<BN, Dv>(P.tma_v, p, w, sV);
    TxBarrier::arrive_and_expect_tx(&ss.kv_full, KT::kKVBytes);
    copy(P.tma_k.with(ss.kv_full, 0), tKg, tKs);
    copy(P.tma_v.with(ss.kv_full, 0), tVg, tVs);
  }
  // One state for both pipelines when they have the same depth (fewer live registers). Picked
  // by pointer: a lambda returning the captured variable by reference made nvcc warn
  // "returning reference to local variable".
  auto write_q = cutlass::make_producer_start_state<PipelineQ>();
  auto write_do_own = cutlass::make_producer_start_state<PipelineDO>();
  auto& write_do = *[&] {
    if constexpr (KT::kStagesQ == KT::kStagesDO) return &write_q; else return &write_do_own;
  }();
  int h = w.h_begin, i = i_first, c = cls_first;
  bool more = true;
  do {
    const int st = write_q.index(), st_do = write_do.index();
    const int64_t rows = (static_cast<int64_t>(w.b) * p.Hq + h) * p.sq_pad + static_cast<int64_t>(i) * BM;
    Tensor gQ = local_tile(mQ(_, _, h, w.b), Shape<Int<BM>, Int<D>>{}, make_coord(i, _0{}));
    Tensor gdO = local_tile(mdO(_, _, h, w.b), Shape<Int<BM>, Int<Dv>>{}, make_coord(i, _0{}));
    auto [tQg, tQs] = tma_partition(P.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ(_, _, st)), group_modes<0, 2>(gQ));
    auto [tdOg, tdOs] = tma_partition(P.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO(_, _, st_do)), group_modes<0, 2>(gdO));
    // The step after this one, found before the waits for the stages: its tile-summary loads
    // overlap them, and dO is issued as soon as its stage is free (D 256 has one dO stage:
    // 0.8% faster forward+backward at 2 x 8k doc1k, H200).
    int h_next = h, i_next = i, c_next = c;
    more = next_step(h_next, i_next, c_next);
    pipe_q.producer_acquire(write_q);
    uint64_t* bar_q = pipe_q.producer_get_barrier(write_q);
    copy(P.tma_q.with(*bar_q, 0, reused_in_l2()), tQg, tQs);
    SM90_BULK_COPY_G2S::copy(p.lse2 + rows, bar_q, ss.lse2.data() + st * BM, KT::kRowBytes);
    SM90_BULK_COPY_G2S::copy(p.q_ids + w.b * p.sq_pad + static_cast<int64_t>(i) * BM, bar_q,
                             ss.q_ids.data() + st * BM, KT::kIdBytes);
    // The Q stage's step info: free (the consumers read it before releasing this stage's Q, which
    // producer_acquire waited for); published by the dO barrier's arrive (release semantics).
    ss.step_info[st] = StepInfo{i, c, h, more};
    compiler_memory_fence();  // before producer_acquire's arrive on the dO barrier
    pipe_do.producer_acquire(write_do);
    uint64_t* bar_do = pipe_do.producer_get_barrier(write_do);
    copy(P.tma_do.with(*bar_do, 0, reused_in_l2()), tdOg, tdOs);
    SM90_BULK_COPY_G2S::copy(p.delta + rows, bar_do, ss.delta.data() + st_do * BM, KT::kRowBytes);
    ++write_q;
    if constexpr (KT::kStagesQ != KT::kStagesDO) ++write_do;
    h = h_next;
    i = i_next;
    c = c_next;
  } while (more);
}

// dK and dV (already scaled) of block w's key tile out through the K and V tiles' shared memory,
// which no GEMM reads any more once both warpgroups are here, by one TMA store each. Stored from
// the fragments straight to global memory (4 bytes a thread, 8 rows of 16 bytes a warp), they
// took 6 us per block, 8% of a block's time at 2 x 8k doc1k (H200, clock64 probe).
template <class KT, class MmadK, class MmadV, class AccK, class AccV>
__forceinline__ __device__ void store_key_tiles(const BwdSm90Params<KT>& P, typename KT::SharedStorage& ss,
                                                const BwdBlock& w, int tidx, const MmadK& mma_dk,
                                                const MmadV& mma_dv, const AccK& acc_dk, const AccV& acc_dv) {
  using Element = typename KT::Element;
  constexpr int BN = KT::kBN, D = KT::kD, Dv = KT::kDv;
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename KT::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename KT::SmemLayoutV{});
  cutlass::arch::NamedBarrier::sync(KT::kConsumerThreads, KT::kBarEpilogue);
  Tensor rdK = make_fragment_like<Element>(acc_dk);
  Tensor rdV = make_fragment_like<Element>(acc_dv);
  convert_into(rdK, acc_dk);
  convert_into(rdV, acc_dv);
  store_fragment_pairs(mma_dk.get_thread_slice(tidx).partition_C(as_position_independent_swizzle_tensor(sK)), rdK);
  store_fragment_pairs(mma_dv.get_thread_slice(tidx).partition_C(as_position_independent_swizzle_tensor(sV)), rdV);
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(KT::kConsumerThreads, KT::kBarEpilogue);
  if (tidx == 0) {
    auto [tdKg, tdKs] = key_tile_tma<BN, D>(P.tma_dk, P.p, w, sK);
    auto [tdVg, tdVs] = key_tile_tma<BN, Dv>(P.tma_dv, P.p, w, sV);
    copy(P.tma_dk, tdKs, tdKg);  // rows past Skv are not written (the tensor's bounds)
    copy(P.tma_dv, tdVs, tdVg);
    tma_store_arrive();
    tma_store_wait<0>();  // shared memory read: the block may exit
  }
}

// The epilogue: dK = scale * sum dS^T Q, dV = sum P^T dO (zeros when the block had no work).
// Split GQA groups: every split's block stores its float32 partial sums and counts itself on its
// key tile; the last to count adds all splits' sums in split order (from L2 where the splits ran
// close together: consecutive blocks within a scheduling chunk), drops them from L2 unwritten and
// stores dK and dV. The sum is the same whichever block comes last. Against a reduce kernel after
// this one, the deterministic 32/8 forward+backward is 2.8% faster on 4x16k doc4k, 0.5% on
// 1x128k doc8k (2.1% and 0.4% at D 64; H200).
template <class KT, class MmadK, class MmadV, class AccK, class AccV>
__forceinline__ __device__ void bwd_sm90_epilogue(const BwdSm90Params<KT>& P, typename KT::SharedStorage& ss,
                                                  const BwdBlock& w, int tidx, const MmadK& mma_dk, const MmadV& mma_dv,
                                                  AccK& acc_dk, AccV& acc_dv) {
  constexpr int BN = KT::kBN, D = KT::kD, Dv = KT::kDv, kThreads = KT::kConsumerThreads;
  const BwdParams& p = P.p;
  CUTE_UNROLL
  for (int e = 0; e < size(acc_dk); ++e) acc_dk(e) *= p.scale;
  if (p.splits == 1) {
    store_key_tiles(P, ss, w, tidx, mma_dk, mma_dv, acc_dk, acc_dv);
    return;
  }
  store_part<kThreads>(part_tile<BN, D>(p.dk_part, p, w, w.split), tidx, acc_dk);
  store_part<kThreads>(part_tile<BN, Dv>(p.dv_part, p, w, w.split), tidx, acc_dv);
  __threadfence();  // this thread's partial sums, before the block counts itself
  cutlass::arch::NamedBarrier::sync(KT::kConsumerThreads, KT::kBarEpilogue);
  if (tidx == 0) {
    const int count = atomicAdd(p.split_count + (static_cast<int64_t>(w.b) * p.nkv + w.n_block) * p.Hkv + w.hk, 1);
    ss.last_split = count == p.splits - 1;
  }
  cutlass::arch::NamedBarrier::sync(KT::kConsumerThreads, KT::kBarEpilogue);
  if (!ss.last_split) return;
  __threadfence();  // the other splits' sums, after their count
  // part[0] + part[1] + ... in split order (this block's own too, back from L2)
  for (int s = 0; s < p.splits; ++s) load_part<kThreads>(part_tile<BN, D>(p.dk_part, p, w, s), tidx, acc_dk, s > 0);
  for (int s = 0; s < p.splits; ++s) load_part<kThreads>(part_tile<BN, Dv>(p.dv_part, p, w, s), tidx, acc_dv, s > 0);
  cutlass::arch::NamedBarrier::sync(KT::kConsumerThreads, KT::kBarEpilogue);  // every thread's loads
  for (int s = 0; s < p.splits; ++s) {
    discard_l2<kThreads>(part_tile<BN, D>(p.dk_part, p, w, s), BN * D * 4, tidx);
    discard_l2<kThreads>(part_tile<BN, Dv>(p.dv_part, p, w, s), BN * Dv * 4, tidx);
  }
  store_key_tiles(P, ss, w, tidx, mma_dk, mma_dv, acc_dk, acc_dv);
}

// The key side of this thread's S^T elements (its rows): segment and position of each key, or
// invalid past the key tile's end.
template <int kRows, class Coords>
__forceinline__ __device__ void key_masks(const BwdParams& p, const BwdBlock& w, const Coords& rc, ColMask (&cm)[kRows]) {
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    const int r = get<0>(rc(mi, 0));
    const bool valid = r < w.kv_rows;
    const int64_t idx = static_cast<int64_t>(w.b) * p.Skv + w.k0 + (valid ? r : 0);
    cm[mi] = make_col_mask(valid, p.kv_seg[idx], p.kv_pos[idx]);
  }
}

// P^T = exp2(S^T scale - lse2) in place of S^T (rows: keys, columns: queries), masked on partial
// tiles (rows past the sequence ends are masked there too, and their lse2 is +inf). Branch-free:
// exp2 of every score, then a select.
template <int kRows, int kCols, class SRowCol, class Coords>
__forceinline__ __device__ void probabilities_t(SRowCol& s_rc, const Coords& rc, const float* lse2, float scale_log2,
                                                bool partial, const RowMask* q_masks, const ColMask (&cm)[kRows]) {
  if (partial) {
    CUTE_UNROLL
    for (int ni = 0; ni < kCols; ++ni) {
      const int col = get<1>(rc(0, ni));
      const float l = lse2[col];
      const RowMask rm = q_masks[col];
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        const float e = exp2f(fmaf(s_rc(mi, ni), scale_log2, -l));
        s_rc(mi, ni) = allowed(rm, cm[mi]) ? e : 0.f;
      }
    }
  } else {
    CUTE_UNROLL
    for (int ni = 0; ni < kCols; ++ni) {
      const float l = lse2[get<1>(rc(0, ni))];
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) s_rc(mi, ni) = exp2f(fmaf(s_rc(mi, ni), scale_log2, -l));
    }
  }
}

// dQ += dS K of one step, this warpgroup's half, reduce-added from the registers in the fragment
// order of the dQ tiles (the split-D designs, which have no room for a float32 dQ tile in shared
// memory). Deterministic (dq_sem set): both warpgroups add within this block's turn on the tile.
template <class KT, class AccDq>
__forceinline__ __device__ void add_dq_from_registers(const BwdParams& p, const BwdBlock& w, int h, int i, int tidx,
                                                      const AccDq& acc_dq) {
  constexpr int kChunks = decltype(size(acc_dq))::value / 4;
  const int wg = tidx / 128, t_wg = tidx % 128;
  float* gdq = p.dq_accum + dq_tile_offset(p, w.b, h, i, KT::kBM * KT::kD) + (wg * kChunks * 128 + t_wg) * 4;
  const bool ordered = p.dq_sem != nullptr;
  DqTurn turn{nullptr, 0};
  if (ordered) {
    if (tidx == 0) {
      turn = dq_turn(p, w.b, h, w.n_block, i);
      take_turn(turn.sem, turn.ticket);
    }
    cutlass::arch::NamedBarrier::sync(KT::kConsumerThreads, KT::kBarTurn);
  }
  CUTE_UNROLL
  for (int ch = 0; ch < kChunks; ++ch)
    red_add_v4(gdq + ch * 512, acc_dq(4 * ch), acc_dq(4 * ch + 1), acc_dq(4 * ch + 2), acc_dq(4 * ch + 3));
  if (ordered) {
    __threadfence();  // every thread's adds, before the turn passes on
    cutlass::arch::NamedBarrier::sync(KT::kConsumerThreads, KT::kBarTurn);
    if (tidx == 0) release_turn(turn.sem, turn.ticket + 1);
  }
}

// dQ += dS K of one step (unscaled), handed to the writer warp: this warpgroup's fragments into
// its half of the shared dQ tile once the writer has emptied it; the writer issues the bulk
// reduce-add.
template <class KT, class AccDq>
__forceinline__ __device__ void hand_dq_to_writer(typename KT::SharedStorage& ss, int wg, int t_wg, const AccDq& acc_dq) {
  constexpr int kChunks = decltype(size(acc_dq))::value / 4;
  float4* sdq = reinterpret_cast<float4*>(ss.dq.data()) + wg * kChunks * 128;
  cutlass::arch::NamedBarrier::sync(KT::kDQSyncThreads, KT::kBarDQEmpty + wg);
  CUTE_UNROLL
  for (int ch = 0; ch < kChunks; ++ch)
    sdq[ch * 128 + t_wg] = make_float4(acc_dq(4 * ch), acc_dq(4 * ch + 1), acc_dq(4 * ch + 2), acc_dq(4 * ch + 3));
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::arrive(KT::kDQSyncThreads, KT::kBarDQFull + wg);
}

// The two consumer warpgroups: every step's GEMMs, P^T and dS^T, dQ handed to the writer warp (or
// added by the consumers themselves at D 192 and 256), then the epilogue.
template <class KT>
__forceinline__ __device__ void bwd_sm90_consumers(const BwdSm90Params<KT>& P, typename KT::SharedStorage& ss,
                                                   const BwdBlock& w, bool any_work, typename KT::PipelineQ& pipe_q,
                                                   typename KT::PipelineDO& pipe_do) {
  using Element = typename KT::Element;
  constexpr int BM = KT::kBM, BN = KT::kBN, D = KT::kD, Dv = KT::kDv;
  using PipelineQ = typename KT::PipelineQ;
  using PipelineDO = typename KT::PipelineDO;
  using StepInfo = BwdSm90StepInfo;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  const BwdParams& p = P.p;
  auto [sQ, sdO, sK, sV] = smem_tiles<KT>(ss);
  const int tidx = threadIdx.x - 128, wg = tidx / 128, t_wg = tidx % 128;
  typename KT::TiledMmaSdP mma_sdp;
  typename KT::TiledMmadK mma_dk;
  typename KT::TiledMmadV mma_dv;
  typename KT::TiledMmadQ mma_dq;
  Tensor acc_dk = partition_fragment_C(mma_dk, Shape<Int<BN>, Int<D>>{});
  Tensor acc_dv = partition_fragment_C(mma_dv, Shape<Int<BN>, Int<Dv>>{});
  Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<BN>, Int<BM>>{});
  Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<BN>, Int<BM>>{});
  Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol_sm90(acc_s.layout()));
  Tensor rP = make_fragment_like<Element>(acc_s);
  Tensor rdS = make_fragment_like<Element>(acc_dp);

  Tensor cS = make_identity_tensor(Shape<Int<BN>, Int<BM>>{});
  auto coords = [&](int thread) {  // (key, query) of each of this thread's S^T elements, (rows, cols)
    Tensor t = mma_sdp.get_thread_slice(thread).partition_C(cS);
    return make_tensor(t.data(), acc_rowcol_sm90(t.layout()));
  };
  using Coords = decltype(coords(0));
  constexpr int kRows = decltype(size<0>(Coords{}))::value;  // keys of this thread
  constexpr int kCols = decltype(size<1>(Coords{}))::value;  // queries of this thread
  clear(acc_dk);
  clear(acc_dv);

  if (any_work) {
    ColMask cm[kRows];
    key_masks(p, w, coords(tidx), cm);
    TxBarrier::wait(&ss.kv_full, 0);
    typename PipelineQ::PipelineState read_q;
    typename PipelineDO::PipelineState read_do_own;
    auto& read_do = *[&] {
      if constexpr (KT::kStagesQ == KT::kStagesDO) return &read_q; else return &read_do_own;
    }();
    int ds_stage = 0, n_partial = 0;
    bool more = true;
    // Shared-memory operands (wgmma descriptors) depend only on the warpgroup: sliced by its first
    // thread, an index the compiler knows is warp-uniform, they live in uniform registers and are
    // built once for the whole loop.
    const int wg_first = __shfl_sync(0xffffffffu, wg, 0) * 128;
    auto wg_sdp = mma_sdp.get_slice(wg_first);
    auto wg_dk = mma_dk.get_slice(wg_first);
    auto wg_dv = mma_dv.get_slice(wg_first);
    auto wg_dq = mma_dq.get_slice(wg_first);
    Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename KT::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename KT::SmemLayoutdOt{});
    Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename KT::SmemLayoutKt{});
    Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data()), typename KT::SmemLayoutdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data()), typename KT::SmemLayoutdSt{});
    Tensor tSrK = wg_sdp.partition_fragment_A(sK);
    Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);     // (MMA, MMA_N, MMA_K, stages)
    Tensor tdPrV = wg_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = wg_sdp.partition_fragment_B(sdO);  // (MMA, MMA_N, MMA_K, stages)
    Tensor tdVrdO = wg_dv.partition_fragment_B(sdOt);
    Tensor tdKrQ = wg_dk.partition_fragment_B(sQt);
    Tensor tdQrdS = wg_dq.partition_fragment_A(sdS);   // (MMA, MMA_M, MMA_K, buffers)
    Tensor tdQrK = wg_dq.partition_fragment_B(sKt);
    do {
      // Per-thread coordinates and shared-memory addresses, rebuilt for every step from
      // opaque_thread_index (built once, they would be held across the loop, and spill).
      const int tix = opaque_thread_index() - 128;
      auto thr_sdp = mma_sdp.get_thread_slice(tix);
      // P^T / dS^T (keys x queries) fragments -> shared memory by stmatrix (KT::CopyAtomPdS), four
      // 8 x 8 blocks an instruction, not 16 pair stores: transposing where the tile keeps keys
      // contiguous (BwdSm90Traits), plain where it keeps queries contiguous (split-D: each 8 x 8
      // block one 16-byte row a key).
      // The swizzle is applied to offsets from a shared-memory pointer (a swizzled pointer is
      // rebuilt from an integer: generic stores, 64-bit addresses held in registers).
      auto copy_pds = make_tiled_copy_C(typename KT::CopyAtomPdS{}, mma_sdp);
      auto thr_copy_pds = copy_pds.get_thread_slice(tix);
      Tensor tdSsdS = thr_copy_pds.partition_D(as_position_independent_swizzle_tensor(sdSt));  // (CPY, M, N, 2)
      const auto tScS_rc = coords(tix);
      const auto tScS = thr_sdp.partition_C(cS);  // the same, in fragment order
      const int st = read_q.index(), st_do = read_do.index();
      pipe_q.consumer_wait(read_q);
      wgmma_issue<true>(mma_sdp, tSrK, tSrQ(_, _, _, st), acc_s);
      pipe_do.consumer_wait(read_do);
      wgmma_issue<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, st_do), acc_dp);
      compiler_memory_fence();  // the info is read after the wait
      const StepInfo step = ss.step_info[st];
      const int i = step.i, c = step.c;
      more = step.more != 0;
      const int64_t q0 = static_cast<int64_t>(i) * BM;
      const int q_rows = static_cast<int>(p.Sq - q0 < BM ? p.Sq - q0 : BM);
      const float* lse2 = ss.lse2.data() + st * BM;
      const float* delta = ss.delta.data() + st_do * BM;
      // dS^T = P^T (dP^T - delta) into acc_dp; p_pair(e): P^T's fragment elements 2e and 2e + 1
      // (adjacent queries of one key).
      auto ds_from = [&](auto p_pair) {
        CUTE_UNROLL
        for (int e = 0; e < size(acc_dp); e += 2) {
          const float2 pt = p_pair(e);
          const float2 dl = *reinterpret_cast<const float2*>(delta + get<1>(tScS(e)));
          acc_dp(e) = pt.x * (acc_dp(e) - dl.x);
          acc_dp(e + 1) = pt.y * (acc_dp(e + 1) - dl.y);
        }
      };
      // Query masks of a partial tile: thread k of the warpgroup builds query k's into shared
      // memory, double-buffered by the parity of the partial tile, from the (segment, position)
      // the producer loaded with Q (no global loads here: behind the dQ reductions, they waited).
      const RowMask* q_masks = ss.q_masks[wg][n_partial & 1];
      if (c == kPartial) {
        if (t_wg < BM) {
          const ColMask id = ss.q_ids[st * BM + t_wg];
          ss.q_masks[wg][n_partial & 1][t_wg] = make_row_mask(t_wg < q_rows, id.seg, id.pos, p.mask);
        }
        cutlass::arch::NamedBarrier::sync(128, KT::kBarQMasks + wg);
        ++n_partial;
      }
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc_s);
      probabilities_t<kRows, kCols>(s_rc, tScS_rc, lse2, p.scale_log2, c == kPartial, q_masks, cm);
      if constexpr (!KT::kSplitD) {
        // dS^T = P^T (dP^T - delta) from the float32 P^T, then both to 16 bits; dS^T goes to shared
        // memory for dQ before dV += P^T dO is issued. (At D 64, 128 queries a tile, holding both
        // float32 tiles spills 7 more registers in the loop; the order is still faster there.)
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dp);
        ds_from([&](int e) { return make_float2(acc_s(e), acc_s(e + 1)); });
        convert_into(rP, acc_s);
        convert_into(rdS, acc_dp);
        copy(copy_pds, thr_copy_pds.retile_S(rdS), tdSsdS(_, _, _, ds_stage));
        Tensor tdVrP = make_tensor(rP.data(), acc_as_A_sm90(rP.layout()));
        wgmma_issue<false>(mma_dv, tdVrP, tdVrdO(_, _, _, st_do), acc_dv);
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(KT::kConsumerThreads, KT::kBarDS);
        Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<BM>, Int<D>>{});
        wgmma_issue<true>(mma_dq, tdQrdS(_, _, _, ds_stage), tdQrK, acc_dq);
        warpgroup_wait<1>();  // dV done: dO is free
        pipe_do.consumer_release(read_do);
        Tensor tdKrdS = make_tensor(rdS.data(), acc_as_A_sm90(rdS.layout()));
        wgmma_issue<false>(mma_dk, tdKrdS, tdKrQ(_, _, _, st), acc_dk);
        warpgroup_wait<1>();  // dQ done, dK still running
        warpgroup_fence_operand(acc_dq);
        hand_dq_to_writer<KT>(ss, wg, t_wg, acc_dq);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dv);
        warpgroup_fence_operand(acc_dk);
        pipe_q.consumer_release(read_q);
      } else {
        convert_into(rP, acc_s);
        // P^T of both warpgroups' queries -> shared memory.
        Tensor sPt = make_tensor(make_smem_ptr(ss.p.data()), typename KT::SmemLayoutdSt{});
        copy(copy_pds, thr_copy_pds.retile_S(rP),
             thr_copy_pds.partition_D(as_position_independent_swizzle_tensor(sPt))(_, _, _, ds_stage));
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(KT::kConsumerThreads, KT::kBarP);
        wgmma_issue<false>(mma_dv, wg_dv.partition_fragment_A(sPt)(_, _, _, ds_stage), tdVrdO(_, _, _, st_do), acc_dv);
        warpgroup_wait<1>();
        warpgroup_fence_operand(acc_dp);
        // dS^T from the 16-bit P^T: each pair of elements is one 32-bit word, unpacked whole.
        ds_from([&](int e) { return unpack_pair<Element>(reinterpret_cast<const uint32_t*>(rP.data())[e / 2]); });
        convert_into(rdS, acc_dp);
        // dS^T of both warpgroups' queries -> shared memory; then dQ = dS K and dK += dS^T Q.
        copy(copy_pds, thr_copy_pds.retile_S(rdS), tdSsdS(_, _, _, ds_stage));
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(KT::kConsumerThreads, KT::kBarDS);
        Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<BM>, Int<D>>{});
        wgmma_issue<true>(mma_dq, tdQrdS(_, _, _, ds_stage), tdQrK, acc_dq);
        wgmma_issue<false>(mma_dk, wg_dk.partition_fragment_A(sdSt)(_, _, _, ds_stage), tdKrQ(_, _, _, st), acc_dk);
        warpgroup_wait<1>();  // dV and dQ done (dO is free), dK still running
        warpgroup_fence_operand(acc_dq);
        pipe_do.consumer_release(read_do);
        add_dq_from_registers<KT>(p, w, step.h, i, tidx, acc_dq);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dv);
        warpgroup_fence_operand(acc_dk);
        pipe_q.consumer_release(read_q);
      }
      ++read_q;
      if constexpr (KT::kStagesQ != KT::kStagesDO) ++read_do;
      ds_stage ^= 1;
    } while (more);
  }
  bwd_sm90_epilogue<KT>(P, ss, w, tidx, mma_dk, mma_dv, acc_dk, acc_dv);
}

// kOrdered: the deterministic kernel at D 64 and 128 (p.dq_sem set): heads innermost, dQ adds in
// turns. A template flag, so that the default kernel carries none of it (the split-D designs
// check p.dq_sem at run time; their consumers add dQ themselves).
template <class KT, bool kOrdered>
__global__ void __launch_bounds__(KT::kThreads, 1)
    attention_bwd_sm90_kernel(const __grid_constant__ BwdSm90Params<KT> P) {
#if JAXCP_SM90_DEVICE
  using SharedStorage = typename KT::SharedStorage;
  using PipelineQ = typename KT::PipelineQ;
  using PipelineDO = typename KT::PipelineDO;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = shared_storage_at<SharedStorage>(smem_raw);
  const BwdParams& p = P.p;

  const int warp_group = threadIdx.x / 128;
  PipelineQ pipe_q(ss.pipe_q, tma_pipeline_params<PipelineQ>(KT::kQStageBytes, KT::kConsumerThreads),
                   Shape<_1, _1, _1>{});
  PipelineDO pipe_do(ss.pipe_do, tma_pipeline_params<PipelineDO>(KT::kDOStageBytes, KT::kConsumerThreads),
                     Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    TxBarrier::init(&ss.kv_full, 1);
    if constexpr (kOrdered) {
      ss.turns.taken.init();
      ss.turns.done.init();
    }
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  constexpr int BM = KT::kBM;
  const BwdBlock w = bwd_block<KT::kBN>(p, blockIdx.x);
  // The deterministic kernel walks its query tiles from the last when its turns go in increasing
  // key tile order (the plan's flag): a lower key tile then reaches a query tile no later than the
  // next one (from the first, the next key tile would get there two steps earlier, and wait).
  int di = 1;  // 1: from the first query tile, -1: from the last
  if constexpr (kOrdered) di = *p.dq_ascending != 0 ? -1 : 1;
  const int i_end = di > 0 ? w.range.y : w.range.x - 1;
  int cls_first = kSkip;
  const int i_first =  // the same for every head (an empty range is (0, 0): i_end in either direction)
      kOrdered ? bwd_step_q_serial<BM>(p, w, di > 0 ? w.range.x : w.range.y - 1, di, i_end, cls_first)
               : bwd_next_q_serial<BM>(p, w, w.range.x, cls_first);
  const bool any_work = w.h_begin < w.h_end && i_first != i_end;
  // Steps run over (head, query tile): the query tiles of each head of the block's group, or in
  // the deterministic kernel (one turn per query tile for the group) the heads of each query tile.
  // The producer, the dQ writer and the turn warps each walk them.
  auto next_step = [&](int& h, int& i, int& c) {
    if constexpr (kOrdered) {  // heads inner: the group takes one turn per query tile
      if (++h < w.h_end) return true;
      h = w.h_begin;
      i = bwd_step_q_serial<BM>(p, w, i + di, di, i_end, c);
      return i != i_end;
    }
    i = bwd_next_q_serial<BM>(p, w, i + 1, c);
    if (i >= w.range.y) {
      ++h;
      i = i_first;
      c = cls_first;
    }
    return h < w.h_end;
  };

  if (warp_group == 0) {
    // 40 x 128 + 232 x 256 = the 168 x 384 registers the block launched with: the consumers'
    // setmaxnreg waits for registers this warpgroup frees, and never gets more (a deadlock).
    // At D 128 (release build) 24 left the producer's loop spilling (about 60 local loads and
    // stores); 40 leaves about 8, and the consumers' loop spills 10 stores and 10 loads at 232
    // (2 and 2 at 240). The 40 / 232 split measured slightly faster (H200).
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (!any_work) return;
    if constexpr (!KT::kSplitD) {
      if (threadIdx.x / 32 == 1) return bwd_sm90_dq_writer<KT, kOrdered>(ss, p, w, i_first, cls_first, next_step);
      if constexpr (kOrdered) {
        if (threadIdx.x == 64 || threadIdx.x == 96) return bwd_sm90_turn_warps<KT>(ss, p, w, i_first, cls_first, next_step);
      }
    }
    if (threadIdx.x == 0) bwd_sm90_producer<KT>(P, ss, w, i_first, cls_first, next_step, pipe_q, pipe_do);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<232>();
  bwd_sm90_consumers<KT>(P, ss, w, any_work, pipe_q, pipe_do);
#endif
}

// dq[b, q0 + r, h, :] = Element(scale * accumulator), from the fragment-ordered float32 tiles
// (tiles the dK/dV blocks never touched hold the pre-pass's zeros). One block per query tile, the
// heads of a tile in consecutive blocks, so that blocks running together write whole rows of dq
// (H200, 2 x 8k: 48.4 us against 50 us with heads outermost). The fragment order puts a warp's
// pairs on 8 rows x 16 bytes, so storing them straight to dq wrote half sectors (3x the time of
// its bytes); the tile goes through shared memory row by row, and leaves in 16-byte stores, a row
// of D columns from consecutive threads.
template <class KT>
__global__ void __launch_bounds__(256) bwd_sm90_dq_convert_kernel(const BwdParams p) {
#if JAXCP_SM90_DEVICE
  using Element = typename KT::Element;
  constexpr int BM = KT::kBM, D = KT::kD;
  constexpr int kPitch = D + 8;  // row pitch (elements): rows 4 banks apart, pair stores conflict-free
  __shared__ alignas(16) Element tile[BM * kPitch];
  const int h = static_cast<int>(blockIdx.x % p.Hq);
  const int m = static_cast<int>(blockIdx.x / p.Hq % p.nq);
  const int b = static_cast<int>(blockIdx.x / p.Hq / p.nq);
  const int tidx = threadIdx.x, wg = tidx / 128, t_wg = tidx % 128;
  typename KT::TiledMmadQ mma_dq;
  Tensor tc = mma_dq.get_thread_slice(tidx).partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
  constexpr int kChunks = decltype(size(tc))::value / 4;
  const float4* src = reinterpret_cast<const float4*>(p.dq_accum + dq_tile_offset(p, b, h, m, BM * D)) +
                      wg * kChunks * 128 + t_wg;
  CUTE_UNROLL
  for (int ch = 0; ch < kChunks; ++ch) {
    const float4 v = src[ch * 128];
    const auto c0 = tc(4 * ch), c2 = tc(4 * ch + 2);  // (row, col) and (row + 8, col); +1: next col
    store_pair(tile + get<0>(c0) * kPitch + get<1>(c0), v.x * p.scale, v.y * p.scale);
    store_pair(tile + get<0>(c2) * kPitch + get<1>(c2), v.z * p.scale, v.w * p.scale);
  }
  __syncthreads();
  const int64_t q0 = static_cast<int64_t>(m) * BM;
  const int q_rows = static_cast<int>(p.Sq - q0 < BM ? p.Sq - q0 : BM);
  Element* dq = static_cast<Element*>(p.dq) + (static_cast<int64_t>(b) * p.Sq + q0) * p.q_row +
                static_cast<int64_t>(h) * D;
  constexpr int kVecs = D / 8;  // 16-byte vectors per row
  for (int idx = tidx; idx < q_rows * kVecs; idx += 256) {
    const int r = idx / kVecs, col = (idx % kVecs) * 8;
    *reinterpret_cast<uint4*>(dq + r * p.q_row + col) = *reinterpret_cast<const uint4*>(tile + r * kPitch + col);
  }
#endif
}

template <class KT>
cudaError_t launch_bwd_sm90_impl(const BwdParams& p, bool convert_dq, cudaStream_t stream) {
  using Element = typename KT::Element;
  constexpr int BM = KT::kBM, BN = KT::kBN, D = KT::kD, Dv = KT::kDv;
  // An input (const void*) to load or an output (void*) to store, W wide.
  auto g = [&](auto width, auto* ptr, int64_t len, int heads) {
    return tma_global_view<Element, decltype(width)::value>(ptr, len, heads, p.B);
  };
  BwdSm90Params<KT> P;
  P.p = p;
  P.tma_q = make_tma_copy(SM90_TMA_LOAD{}, g(Int<D>{}, p.q, p.Sq, p.Hq), take<0, 2>(typename KT::SmemLayoutQ{}),
                          Shape<Int<BM>, Int<D>>{}, _1{});
  P.tma_do = make_tma_copy(SM90_TMA_LOAD{}, g(Int<Dv>{}, p.dout, p.Sq, p.Hq), take<0, 2>(typename KT::SmemLayoutdO{}),
                           Shape<Int<BM>, Int<Dv>>{}, _1{});
  P.tma_k = make_tma_copy(SM90_TMA_LOAD{}, g(Int<D>{}, p.k, p.Skv, p.Hkv), typename KT::SmemLayoutK{},
                          Shape<Int<BN>, Int<D>>{}, _1{});
  P.tma_v = make_tma_copy(SM90_TMA_LOAD{}, g(Int<Dv>{}, p.v, p.Skv, p.Hkv), typename KT::SmemLayoutV{},
                          Shape<Int<BN>, Int<Dv>>{}, _1{});
  P.tma_dk = make_tma_copy(SM90_TMA_STORE{}, g(Int<D>{}, p.dk, p.Skv, p.Hkv), typename KT::SmemLayoutK{},
                           Shape<Int<BN>, Int<D>>{}, _1{});
  P.tma_dv = make_tma_copy(SM90_TMA_STORE{}, g(Int<Dv>{}, p.dv, p.Skv, p.Hkv), typename KT::SmemLayoutV{},
                           Shape<Int<BN>, Int<Dv>>{}, _1{});
  auto kernel = attention_bwd_sm90_kernel<KT, false>;
  if constexpr (!KT::kSplitD) {
    if (p.dq_sem != nullptr) {
      // The deterministic backward pads D 96 to 128 (attention_bwd_head_dim_supported).
      if constexpr (!sm80_head_dim(KT::kD)) return cudaErrorInvalidValue;
      else kernel = attention_bwd_sm90_kernel<KT, true>;
    }
  }
  static unsigned smem_done[2] = {0, 0};
  cudaError_t err = set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), KT::kSmemBytes,
                                         &smem_done[p.dq_sem != nullptr]);
  if (err != cudaSuccess) return err;
  const int64_t blocks = p.B * p.nkv * p.Hkv * p.splits;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  kernel<<<static_cast<unsigned>(blocks), KT::kThreads, KT::kSmemBytes, stream>>>(P);
  if ((err = cudaGetLastError())) return err;
  if (!convert_dq) return cudaSuccess;
  const int64_t q_tiles = p.B * p.Hq * p.nq;
  if (q_tiles > INT_MAX) return cudaErrorInvalidValue;
  bwd_sm90_dq_convert_kernel<KT><<<static_cast<unsigned>(q_tiles), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

template <class Element>
cudaError_t dispatch_bwd_sm90(const BwdParams& p, int64_t d, int64_t dv, bool convert_dq, cudaStream_t stream) {
  if (dv != d) {
    static_assert(sm90_value_head_dim(192, 128));
    if (sm90_value_head_dim(d, dv))
      return launch_bwd_sm90_impl<BwdSm90SplitDTraits<Element, 192, 128>>(p, convert_dq, stream);
    return cudaErrorInvalidValue;
  }
  switch (d) {
    case 64: return launch_bwd_sm90_impl<BwdSm90Traits<Element, 64, 2>>(p, convert_dq, stream);
    case 96: return launch_bwd_sm90_impl<BwdSm90Traits<Element, 96, 2>>(p, convert_dq, stream);
    case 128: return launch_bwd_sm90_impl<BwdSm90Traits<Element, 128, 2>>(p, convert_dq, stream);
    case 192: return launch_bwd_sm90_impl<BwdSm90SplitDTraits<Element, 192>>(p, convert_dq, stream);
    case 256: return launch_bwd_sm90_impl<BwdSm90SplitDTraits<Element, 256>>(p, convert_dq, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace detail

cudaError_t launch_bwd_sm90(const detail::BwdParams& p, DType dtype, int64_t d, int64_t dv, bool convert_dq,
                            cudaStream_t stream) {
  return dtype == DType::kBF16 ? detail::dispatch_bwd_sm90<cutlass::bfloat16_t>(p, d, dv, convert_dq, stream)
                               : detail::dispatch_bwd_sm90<cutlass::half_t>(p, d, dv, convert_dq, stream);
}

}  // namespace jaxcp::cuda
