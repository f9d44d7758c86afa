// Forward packed-document attention for Hopper (sm_90a), FlashAttention-3 style:
// one producer warp streams K/V tiles with TMA into a shared-memory ring guarded by mbarriers
// (cutlass::PipelineTmaAsync); two consumer warpgroups own 64 query rows each and run
// S = Q K^T and O += P V on wgmma, with the online softmax in registers (P never leaves them).
// Query tiles start where documents start (doc_tiles.cu), and each walks key
// tiles from the first key any of its rows may attend, classified skip / full / partial as it
// goes on the summary of exactly each tile's keys: a document's rows meet key tiles aligned to
// its start, and work follows the allowed area.
//
// Persistent: one CTA per multiprocessor takes query tiles from a global counter until none are
// left. The producer runs a tile ahead: it classifies the next tile's first key tile, copies its
// query rows' (segment, position) and its Q into shared memory and starts its K/V while the
// consumers finish the current tile (last P V, epilogue), so a short tile (short documents,
// windows, chunks) no longer pays a CTA start, its plan lookups and its first loads. Built only
// for sm_90a; elsewhere the body is empty and the host never launches it (fwd_use_sm90).
#include <climits>

#include "fwd.cuh"
#include "plan.cuh"

#include "sm90.cuh"

namespace jaxcp::cuda {
namespace detail {

// kHeadDimV: the value head dim, kHeadDim but for multi-head latent attention (192 / 128): V, O
// and the P V GEMM take it, Q, K and the S GEMM the head dim.
template <class Element_, int kHeadDim, int kHeadDimV, int kBlockN, int kStages>
struct FwdSm90Traits {
  using Element = Element_;
  static constexpr int kD = kHeadDim, kDv = kHeadDimV, kBM = 128, kBN = kBlockN, kNStages = kStages;
  static constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
  static constexpr int kConsumerThreads = 256;

  using AtomLayout = Layout<Shape<_2, _1, _1>>;  // one 64-row wgmma slab per consumer warpgroup
  using TiledMmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBM>, Int<kBN>, Int<kD>>>(), AtomLayout{}));
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBM>, Int<kDv>, Int<kBN>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AtomLayout{}));

  using SmemAtom = SmemAtomKMajor<Element, kD>;
  using SmemAtomV = SmemAtomKMajor<Element, kDv>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBM>, Int<kD>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBN>, Int<kD>, Int<kStages>>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBN>, Int<kDv>, Int<kStages>>{}));
  // V read as the (Dv, keys) B operand of P V: the same bytes, MN-major.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<Int<kDv>, Int<kBN>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutO = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBM>, Int<kDv>>{}));
  // One consumer warpgroup's 64 rows of sO, the source of its TMA store: the layout's first 64
  // rows. The second warpgroup's rows are the same layout kOHalf elements on (8 row atoms, a
  // whole number of swizzle periods), as a host-side check of every (row, column) found for each
  // value head dim and the GPU tests' outputs confirm.
  using SmemLayoutOHalf = decltype(composition(SmemLayoutO{}, Layout<Shape<_64, Int<kDv>>, Stride<_1, Int<kBM>>>{}));
  static constexpr int kOHalf = 64 * int(size<1>(SmemAtomV{}));  // 8 atoms of 8 rows

  // Global views (token, d, head, batch); TMA fills rows past the sequence end with zeros.
  using ShapeG = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideG = cute::Stride<int64_t, _1, int64_t, int64_t>;
  using GTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeG{}, StrideG{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{}, SmemLayoutQ{},
                                     Shape<Int<kBM>, Int<kD>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{}, take<0, 2>(SmemLayoutK{}),
                                     Shape<Int<kBN>, Int<kD>>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{}, take<0, 2>(SmemLayoutV{}),
                                     Shape<Int<kBN>, Int<kDv>>{}, _1{}));
  using GTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeG{}, StrideG{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GTensorOut{}, SmemLayoutOHalf{},
                                     Shape<_64, Int<kDv>>{}, _1{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kKTileBytes = kBN * kD * sizeof(Element);
  static constexpr uint32_t kVTileBytes = kBN * kDv * sizeof(Element);
  static constexpr uint32_t kQBytes = kBM * kD * sizeof(Element);

  // O is staged on its way to global memory in a buffer of its own where shared memory allows
  // (D <= 192: 192 KB of tiles at most), so the next tile's Q can land during this tile's
  // epilogue; with D 256, and q/k 192 with v 128 on 128-key tiles, it goes through sQ (Dv <= D) and
  // the next Q waits for the epilogue.
  static constexpr bool kSeparateO =
      (kBM * (kD + kDv) + kStages * kBN * (kD + kDv)) * int(sizeof(Element)) <= 192 * 1024;
  static_assert(kDv <= kD, "O through sQ");

  // What the producer tells the consumers about their next tile (b < 0: no tiles left; work 0:
  // no key to visit) and about each key tile it loads (its class, and whether
  // another key tile of the same query tile follows): the consumers walk no plan of their own.
  struct TileInfo {
    int b, h, q0, rows, work;
  };
  struct KeyTileInfo {
    int c, more;
  };
  // Key tile m's info and masks go with its K, into slot m % kMaskSlots. Writing key tile m's K
  // needs the stage of K_{m-2} released, i.e. S_{m-2} done, so the softmax of m - 4 (the slot's
  // last reader) is done too.
  static constexpr int kMaskSlots = 2 * kStages;

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, kSeparateO ? cosize_v<SmemLayoutO> : 8, 128> o;
    ColMask cols[kMaskSlots][kBN];  // key masks of a partial key tile, in its mask slot
    ColMask rows[kBM];           // (segment, position) of the tile's query rows
    TileInfo info;
    KeyTileInfo key_info[kMaskSlots];
    typename Pipeline::SharedStorage pipe_k, pipe_v;
    alignas(8) uint64_t q_full;     // Q landed (TMA transaction bytes)
    alignas(8) uint64_t info_full;  // info and rows written: 32 cp.async lanes + lane 0's store
    alignas(8) uint64_t q_empty;    // every consumer thread is done with sQ, info and rows
    alignas(8) uint64_t cols_full[kMaskSlots];  // a slot's info and masks: 32 cp.async lanes + lane 0
  };
  static constexpr int kInfoArrivals = 33;
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 232448, "227 KB of shared memory per block on sm_90");
};

template <class KT>
struct FwdSm90Params {
  FwdParams p;
  int batch, kv_heads;
  typename KT::TmaQ tma_q;
  typename KT::TmaK tma_k;
  typename KT::TmaV tma_v;
  typename KT::TmaO tma_o;
};

// Work items run in sections of heads (whole GQA groups), one section after the other; inside
// a section, item t is (document tile, head), document tiles last to first and the section's
// heads of one tile neighbours (a group's share K/V). A causal document's last tile is its
// heaviest, so each document starts its heaviest items first, and the last items of the launch
// are first tiles of a row, which are short: with one head a section, the last head's tiles
// (about one wave on 2 x 8k rows) started their heaviest in the last wave. A section holds as
// many heads as kSectionL2Bytes holds K/V of the widest tile's keys for (FlashAttention-3 sizes
// its sections on a row's keys): the tiles running together then read K/V from L2, which the
// 16 heads of a 49k-token document do not (5.8% more forward time in one section, H200).
constexpr int64_t kSectionL2Bytes = 32ll << 20;

struct FwdItem {
  int g, h, hk;  // document tile, q head, kv head
};

// Query heads a section (a multiple of the group): sections as even as the kv heads allow.
__forceinline__ __device__ int fwd_section_heads(const FwdParams& p, int widest_keys, int key_bytes) {
  const int kv_heads = p.Hq / p.group;
  const int64_t per_head = static_cast<int64_t>(widest_keys) * key_bytes;
  const int64_t fit64 = per_head > 0 ? kSectionL2Bytes / per_head : kv_heads;
  const int fit = fit64 < 1 ? 1 : fit64 > kv_heads ? kv_heads : static_cast<int>(fit64);
  const int sections = (kv_heads + fit - 1) / fit;
  return (kv_heads + sections - 1) / sections * p.group;
}

__forceinline__ __device__ FwdItem fwd_item(const FwdParams& p, int n_doc_tiles, int section_heads, int t) {
  const int per_section = n_doc_tiles * section_heads;
  const int h0 = t / per_section * section_heads, r = t % per_section;
  const int heads = min(section_heads, p.Hq - h0);  // the last section's may be fewer
  FwdItem it;
  it.h = h0 + r % heads;
  it.hk = it.h / p.group;
  it.g = n_doc_tiles - 1 - r / heads;
  return it;
}

// The walk over a query tile's key tiles: tile i holds keys [kv_lo + i BN, kv_lo + (i + 1) BN),
// i < n. Lane l keeps the class of tile i0 + l, classified on the summary of exactly its keys
// (key_windows): one load per lane classifies 32 tiles.
struct KeyWalk {
  int i0, cls;
};

// The first tile at or after i that is not skipped (n: none), its class in c. Called by whole
// warps; returns the same values to all lanes.
template <int BN>
__forceinline__ __device__ int fwd_next_key_tile(const FwdParams& p, const DocTile& dt, const TileSummary* windows,
                                                 int n, KeyWalk& w, int i, int& c) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  while (i < n) {
    if (i < w.i0 || i >= w.i0 + 32) {
      w.i0 = i;
      const int tile = i + lane;
      w.cls = kSkip;
      if (tile < n) {
        const int k0 = dt.kv_lo + tile * BN;
        w.cls = tile_class(dt.sum, windows[k0], p.mask, k0 + BN > p.Skv);
      }
    }
    const unsigned hit = __ballot_sync(0xffffffffu, w.cls != kSkip) & (0xffffffffu << (i - w.i0));
    if (hit != 0u) {
      const int src = __ffs(hit) - 1;
      c = __shfl_sync(0xffffffffu, w.cls, src);
      return w.i0 + src;
    }
    i = w.i0 + 32;
  }
  return n;
}

template <class KT>
__global__ void __launch_bounds__(KT::kThreads, 1)
    attention_fwd_sm90_kernel(const __grid_constant__ FwdSm90Params<KT> P) {
#if JAXCP_SM90_DEVICE
  using Element = typename KT::Element;
  constexpr int BM = KT::kBM, BN = KT::kBN, D = KT::kD, Dv = KT::kDv;
  using SharedStorage = typename KT::SharedStorage;
  using Pipeline = typename KT::Pipeline;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = shared_storage_at<SharedStorage>(smem_raw);
  const FwdParams& p = P.p;

  const int warp_group = threadIdx.x / 128;
  Pipeline pipe_k(ss.pipe_k, tma_pipeline_params<Pipeline>(KT::kKTileBytes, KT::kConsumerThreads),
                  Shape<_1, _1, _1>{});
  Pipeline pipe_v(ss.pipe_v, tma_pipeline_params<Pipeline>(KT::kVTileBytes, KT::kConsumerThreads),
                  Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    TxBarrier::init(&ss.q_full, 1);
    cutlass::arch::ClusterBarrier::init(&ss.info_full, KT::kInfoArrivals);
    cutlass::arch::ClusterBarrier::init(&ss.q_empty, KT::kConsumerThreads);
    for (int st = 0; st < KT::kMaskSlots; ++st) cutlass::arch::ClusterBarrier::init(&ss.cols_full[st], KT::kInfoArrivals);
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename KT::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename KT::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename KT::SmemLayoutV{});

  if (warp_group == 0) {
    // ---------------- producer: warp 0; lane 0 issues every TMA load ----------------
    // Per tile: wait until the consumers are done with the previous tile's Q, info and rows,
    // publish the tile (info, rows: info_full), load Q (q_full), then stream its K/V tiles.
    // With each K the 32 lanes copy the key tile's masks, if it is partial, into its mask slot
    // (cp.async, landing on cols_full), so the consumers read them from shared memory with no
    // global load of their own and no barrier beyond that one.
    // 88 x 128 + 208 x 256 = 168 x 384, the launch's registers. At 40 (232 for the consumers)
    // the producer spilled ~230 bytes (H100, forward: window 1024 ~6%, D 256 ~3% slower than at
    // 72), and at 72 it spills 16 bytes with D 64 since it classifies key tiles two ahead; the
    // consumers need no more than 208 for any head dim (ptxas: no spills).
    cutlass::arch::warpgroup_reg_dealloc<88>();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    const int Sq = static_cast<int>(p.Sq), Skv = static_cast<int>(p.Skv);
    Tensor mQ = P.tma_q.get_tma_tensor(make_shape(Sq, D, p.Hq, P.batch));
    Tensor mK = P.tma_k.get_tma_tensor(make_shape(Skv, D, P.kv_heads, P.batch));
    Tensor mV = P.tma_v.get_tma_tensor(make_shape(Skv, Dv, P.kv_heads, P.batch));
    auto write_k = cutlass::make_producer_start_state<Pipeline>();
    auto write_v = write_k;
    const int n_doc_tiles = *p.doc_total;
    const int n_items = n_doc_tiles * p.Hq;
    const int section_heads = fwd_section_heads(p, *p.doc_widest_keys, (D + Dv) * static_cast<int>(sizeof(Element)));
    int t = blockIdx.x;
    for (int n = 0;; ++n) {
      const bool live = t < n_items;
      int t_next = 0;  // taken now, used after this tile: the atomic's latency stays hidden
      if (live && lane == 0) t_next = atomicAdd(p.tile_counter, 1) + static_cast<int>(gridDim.x);
      FwdItem it{};
      DocTile dt{};
      // The key tile to load (i, class c) and the one after it (i_next, c_next), of n_keys.
      int n_keys = 0, i = 0, c = kSkip, i_next = 0, c_next = kSkip;
      KeyWalk walk{-64, kSkip};
      const int32_t *kv_seg = p.kv_seg, *kv_pos = p.kv_pos;
      const TileSummary* windows = p.key_windows;
      if (live) {
        it = fwd_item(p, n_doc_tiles, section_heads, t);
        dt = p.doc_tiles[it.g];
        kv_seg += static_cast<int64_t>(dt.b) * p.Skv;
        kv_pos += static_cast<int64_t>(dt.b) * p.Skv;
        windows += static_cast<int64_t>(dt.b) * p.Skv;
        n_keys = (dt.kv_hi - dt.kv_lo + BN - 1) / BN;
        i = fwd_next_key_tile<BN>(p, dt, windows, n_keys, walk, 0, c);
        if (i < n_keys) i_next = fwd_next_key_tile<BN>(p, dt, windows, n_keys, walk, i + 1, c_next);
      }
      if (n > 0) mbar_wait(&ss.q_empty, (n - 1) & 1);
      const bool work = live && i < n_keys;
      if (work) {
        const int64_t row0 = static_cast<int64_t>(dt.b) * p.Sq + dt.q0;
        CUTE_UNROLL
        for (int r = lane; r < BM; r += 32) {
          const bool valid = r < dt.rows;
          cp_async_i32(&ss.rows[r].seg, p.q_seg + row0 + (valid ? r : 0), valid);
          cp_async_i32(&ss.rows[r].pos, p.q_pos + row0 + (valid ? r : 0), valid);
        }
      }
      cp_async_arrive(&ss.info_full);
      if (lane == 0) {
        ss.info = typename KT::TileInfo{live ? dt.b : -1, it.h, dt.q0, dt.rows, work ? 1 : 0};
        mbar_arrive(&ss.info_full);
      }
      if (!live) break;
      if (work) {
        // Q from row q0 and K/V tiles from key kv_lo: TMA reads at any row and fills rows past
        // the sequence end with zeros.
        Tensor gQ = local_tile(domain_offset(make_coord(dt.q0, _0{}), mQ(_, _, it.h, dt.b)), Shape<Int<BM>, Int<D>>{},
                               make_coord(_0{}, _0{}));
        auto [tQg, tQs] = tma_partition(P.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        Tensor gK = local_tile(domain_offset(make_coord(dt.kv_lo, _0{}), mK(_, _, it.hk, dt.b)),
                               Shape<Int<BN>, Int<D>>{}, make_coord(_, _0{}));
        // Plain references, not a structured binding: load_k captures them (C++17 lambdas may not).
        auto k_part = tma_partition(P.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        auto& tKg = get<0>(k_part);
        auto& tKs = get<1>(k_part);
        Tensor gV = local_tile(domain_offset(make_coord(dt.kv_lo, _0{}), mV(_, _, it.hk, dt.b)),
                               Shape<Int<BN>, Int<Dv>>{}, make_coord(_, _0{}));
        auto [tVg, tVs] = tma_partition(P.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
        if (lane == 0) {
          TxBarrier::arrive_and_expect_tx(&ss.q_full, KT::kQBytes);
          copy(P.tma_q.with(ss.q_full, 0), tQg, tQs);
        }
        // K runs a key tile ahead of V (K_{i+1} before V_i, FlashAttention-3's order). A stage's
        // K is free once its S GEMM is done, its V only after the P V a step later, and K is
        // needed a step before V: loaded in the order K_i V_i, each K waited behind the V before it.
        // The key tile's class, whether another follows and its masks go with its K, as the
        // softmax right after its S GEMM reads them.
        auto load_k = [&](int key_tile, int cls, bool more) {
          const int slot = static_cast<int>(write_k.count() % KT::kMaskSlots);  // key tiles so far
          // A free K stage means a free mask slot (kMaskSlots). Every lane waits for it itself
          // before copying into the slot: when lanes 1-31 followed lane 0's wait through a
          // __syncwarp, racecheck reports their copies as hazards. Only thread 0,
          // the pipeline's leader, arms the stage's transaction bytes; lane 0 issues the load.
          pipe_k.producer_acquire(write_k);
          if (lane == 0) copy(P.tma_k.with(*pipe_k.producer_get_barrier(write_k), 0), tKg(_, key_tile), tKs(_, write_k.index()));
          ++write_k;
          __syncwarp();  // the warp together again after lane 0's load
          if (cls == kPartial) {
            ColMask* cols = ss.cols[slot];
#pragma unroll 1  // two call sites: unrolled, the producer's registers ran out
            for (int col = lane; col < BN; col += 32) {
              const int tok = dt.kv_lo + key_tile * BN + col;
              const bool valid = tok < p.Skv;  // past the end: seg 0, which no live row matches
              cp_async_i32(&cols[col].seg, kv_seg + (valid ? tok : 0), valid);
              cp_async_i32(&cols[col].pos, kv_pos + (valid ? tok : 0), valid);
            }
          }
          cp_async_arrive(&ss.cols_full[slot]);  // every key tile, so the phases follow the slots
          if (lane == 0) {
            ss.key_info[slot] = typename KT::KeyTileInfo{cls, more ? 1 : 0};
            mbar_arrive(&ss.cols_full[slot]);
          }
        };
        // Key tiles i (its V next), i_next (its K next) and i_after, classified two ahead so that
        // each K can say whether another key tile follows.
        int c_after = kSkip;
        int i_after = i_next < n_keys ? fwd_next_key_tile<BN>(p, dt, windows, n_keys, walk, i_next + 1, c_after) : n_keys;
        load_k(i, c, i_next < n_keys);
        while (i < n_keys) {
          if (i_next < n_keys) load_k(i_next, c_next, i_after < n_keys);
          if (lane == 0) {
            pipe_v.producer_acquire(write_v);
            copy(P.tma_v.with(*pipe_v.producer_get_barrier(write_v), 0), tVg(_, i), tVs(_, write_v.index()));
          }
          ++write_v;
          i = i_next;
          i_next = i_after;
          c_next = c_after;
          if (i_next < n_keys) i_after = fwd_next_key_tile<BN>(p, dt, windows, n_keys, walk, i_next + 1, c_after);
        }
      }
      t = __shfl_sync(0xffffffffu, t_next, 0);
    }
    cp_async_wait_all();
    return;
  }

  // ---------------- consumers: 2 warpgroups x 64 query rows ----------------
  // Per key tile j: S_j = Q K_j^T is issued together with O += P_{j-1} V_{j-1}, and the softmax
  // of S_j runs while the P V product is still on the tensor cores. The two warpgroups take turns
  // issuing (named barriers), so one's softmax overlaps the other's GEMMs.
  cutlass::arch::warpgroup_reg_alloc<208>();
  const int wg = (threadIdx.x - 128) / 128;
  typename KT::TiledMmaS mma_s;
  typename KT::TiledMmaO mma_o;
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename KT::SmemLayoutVt{});
  Element* const o_smem = KT::kSeparateO ? ss.o.data() : ss.q.data();
  Tensor sO = make_tensor(make_smem_ptr(o_smem), typename KT::SmemLayoutO{});

  // Turn-taking between the two consumer warpgroups (named barriers 1 and 2; 3, 4: epilogue).
  auto sched_wait = [&]() { cutlass::arch::NamedBarrier::sync(KT::kConsumerThreads, 1 + wg); };
  auto sched_pass = [&]() { cutlass::arch::NamedBarrier::arrive(KT::kConsumerThreads, 2 - wg); };
  if (wg == 1) sched_pass();  // warpgroup 0 goes first

  typename Pipeline::PipelineState read_k, read_v;
  int q_loads = 0;  // Q tiles loaded so far: the phase of q_full
  for (int n = 0;; ++n) {
    mbar_wait(&ss.info_full, n & 1);
    const typename KT::TileInfo ti = ss.info;
    if (ti.b < 0) break;
    const bool empty = ti.work == 0;
    // Per-thread fragments and coordinates, rebuilt for every tile (see opaque_thread_index).
    const int tidx = opaque_thread_index() - 128, t_wg = tidx % 128;
    auto thr_s = mma_s.get_thread_slice(tidx);
    auto thr_o = mma_o.get_thread_slice(tidx);
    Tensor tSrQ = thr_s.partition_fragment_A(sQ);
    Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
    Tensor tOrV = thr_o.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stages)
    Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<BM>, Int<Dv>>{});
    Tensor acc_o_rc = make_tensor(acc_o.data(), acc_rowcol_sm90(acc_o.layout()));
    Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<BM>, Int<BN>>{});
    Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol_sm90(acc_s.layout()));
    Tensor rP = make_fragment_like<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_as_A_sm90(rP.layout()));
    Tensor cS = make_identity_tensor(Shape<Int<BM>, Int<BN>>{});
    Tensor tScS = thr_s.partition_C(cS);
    Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol_sm90(tScS.layout()));
    constexpr int kRows = decltype(size<0>(tScS_rc))::value;
    constexpr int kCols = decltype(size<1>(tScS_rc))::value;

    const int q_rows = ti.rows;
    Element* out_ptr = static_cast<Element*>(p.out) +
                       (static_cast<int64_t>(ti.b) * p.Sq + ti.q0) * p.o_row + static_cast<int64_t>(ti.h) * Dv;
    float* lse_ptr = p.lse + (static_cast<int64_t>(ti.b) * p.Hq + ti.h) * p.Sq + ti.q0;
    if (empty) {  // no allowed key for any row of this tile: out 0, lse -inf
      mbar_arrive(&ss.q_empty);
      for (int idx = tidx; idx < q_rows * (Dv / 8); idx += KT::kConsumerThreads) {
        const int r = idx / (Dv / 8), col = (idx % (Dv / 8)) * 8;
        *reinterpret_cast<uint4*>(out_ptr + r * p.o_row + col) = make_uint4(0, 0, 0, 0);
      }
      for (int r = tidx; r < q_rows; r += KT::kConsumerThreads) lse_ptr[r] = -INFINITY;
      continue;
    }
    RowMask rm[kRows];
    float row_max[kRows], row_sum[kRows], corr[kRows];
    bool rescale = false;
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const int r = get<0>(tScS_rc(mi, 0));
      const ColMask id = ss.rows[r];
      rm[mi] = make_row_mask(r < q_rows, id.seg, id.pos, p.mask);
      row_max[mi] = -INFINITY;
      row_sum[mi] = 0.f;
    }
    clear(acc_o);

    // The key tile's info (written by the producer with its K and key masks): its class and
    // whether another follows. Then mask (partial tiles only) and the online softmax of S_j,
    // scaled in its exponent; corr[] rescales O.
    auto softmax = [&](uint32_t key_tiles) {  // key tiles before this one: its slot and phase
      const int slot = static_cast<int>(key_tiles % KT::kMaskSlots);
      mbar_wait(&ss.cols_full[slot], (key_tiles / KT::kMaskSlots) & 1);
      const typename KT::KeyTileInfo si = ss.key_info[slot];
      if (si.c == kPartial) {
        const ColMask* cols = ss.cols[slot];
        CUTE_UNROLL
        for (int ni = 0; ni < kCols; ++ni) {
          const ColMask cm = cols[get<1>(tScS_rc(0, ni))];
          CUTE_UNROLL
          for (int mi = 0; mi < kRows; ++mi)
            if (!allowed(rm[mi], cm)) s_rc(mi, ni) = -INFINITY;
        }
      }
      // scale_log2 > 0: fwd_use_sm90. A warp rescales O only when one of its rows' reference moved.
      rescale = __any_sync(0xffffffffu, online_softmax<true>(s_rc, p.scale_log2, row_max, row_sum, corr));
      return si.more != 0;
    };
    auto rescale_o = [&]() {
      if (!rescale) return;
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int di = 0; di < size<1>(acc_o_rc); ++di) acc_o_rc(mi, di) *= corr[mi];
      }
    };

    TxBarrier::wait(&ss.q_full, q_loads & 1);
    ++q_loads;
    // First key tile: S only.
    pipe_k.consumer_wait(read_k);
    sched_wait();
    wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, read_k.index()), acc_s);
    sched_pass();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
    pipe_k.consumer_release(read_k);
    uint32_t key_tiles = read_k.count();
    ++read_k;
    bool more = softmax(key_tiles);
    rescale = false;  // O is still zero
    convert_into(rP, acc_s);
    while (more) {
      pipe_k.consumer_wait(read_k);
      sched_wait();
      // Q's descriptors rebuilt for each key tile: held across the loop, D 256's 16 spilled.
      wgmma_issue<true>(mma_s, mma_s.get_thread_slice(opaque_thread_index() - 128).partition_fragment_A(sQ),
                        tSrK(_, _, _, read_k.index()), acc_s);
      rescale_o();
      pipe_v.consumer_wait(read_v);
      wgmma_issue<false>(mma_o, tOrP, tOrV(_, _, _, read_v.index()), acc_o);
      sched_pass();
      warpgroup_wait<1>();  // S_j is ready; P V still running
      warpgroup_fence_operand(acc_s);
      pipe_k.consumer_release(read_k);
      key_tiles = read_k.count();
      ++read_k;
      more = softmax(key_tiles);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(rP);
      pipe_v.consumer_release(read_v);
      ++read_v;
      convert_into(rP, acc_s);
    }
    // Every S GEMM has completed: with O staged elsewhere, sQ may take the next tile's Q.
    if constexpr (KT::kSeparateO) mbar_arrive(&ss.q_empty);
    // Last P V.
    rescale_o();
    pipe_v.consumer_wait(read_v);
    wgmma_issue<false>(mma_o, tOrP, tOrV(_, _, _, read_v.index()), acc_o);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_o);
    pipe_v.consumer_release(read_v);
    ++read_v;
    // Epilogue: normalise, LSE (natural log), O through this warpgroup's rows of sO.
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const float sum = quad_sum(row_sum[mi]);
      const bool any = sum > 0.f;
      const float inv = any ? 1.f / sum : 0.f;
      const int r = get<0>(tScS_rc(mi, 0));
      if (get<1>(tScS_rc(0, 0)) == 0 && r < q_rows)
        lse_ptr[r] = any ? (row_max[mi] + __log2f(sum)) * kLn2 : -INFINITY;
      CUTE_UNROLL
      for (int di = 0; di < size<1>(acc_o_rc); ++di) acc_o_rc(mi, di) *= inv;
    }
    Tensor rO = convert_type<Element>(acc_o);
    auto smem_copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_o);
    auto thr_copy_o = smem_copy_o.get_thread_slice(tidx);
    // The previous tile's O has left this warpgroup's rows of sO: its TMA store has read them,
    // and each thread has read the other rows it stored itself.
    if constexpr (KT::kSeparateO) {
      if (t_wg == 0) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(128, 3 + wg);
    }
    cute::copy(smem_copy_o, thr_copy_o.retile_S(rO), thr_copy_o.partition_D(sO));
    // A warpgroup whose 64 rows all belong to the tile stores them by one TMA store, so its
    // threads go on to the next tile at once; otherwise the rows past the tile (the next
    // document's tile) must stay untouched, and the threads store the tile's rows themselves.
    const bool tma_rows = q_rows >= (wg + 1) * 64;
    if (tma_rows) cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, 3 + wg);  // this warpgroup's rows of O are in sO
    if (tma_rows) {
      if (t_wg == 0) {
        Tensor mO = P.tma_o.get_tma_tensor(make_shape(static_cast<int>(p.Sq), Dv, p.Hq, P.batch));
        Tensor gO = local_tile(domain_offset(make_coord(ti.q0 + wg * 64, _0{}), mO(_, _, ti.h, ti.b)),
                               Shape<_64, Int<Dv>>{}, make_coord(_0{}, _0{}));
        Tensor sOh = make_tensor(make_smem_ptr(o_smem + wg * KT::kOHalf), typename KT::SmemLayoutOHalf{});
        auto [tOg, tOs] = tma_partition(P.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sOh), group_modes<0, 2>(gO));
        copy(P.tma_o, tOs, tOg);
        tma_store_arrive();
      }
    } else {
      for (int idx = t_wg; idx < 64 * (Dv / 8); idx += 128) {
        const int r = wg * 64 + idx / (Dv / 8), col = (idx % (Dv / 8)) * 8;
        if (r < q_rows) stg_128(out_ptr + r * p.o_row + col, lds_128(&sO(r, col)));
      }
    }
    if constexpr (!KT::kSeparateO) {
      if (t_wg == 0) tma_store_wait<0>();  // sO is sQ: read before the next Q may land
      mbar_arrive(&ss.q_empty);
    }
  }
  if (threadIdx.x % 128 == 0) tma_store_wait<0>();  // shared memory read: the block may exit
#endif
}

template <class KT>
cudaError_t launch_fwd_sm90_impl(const FwdParams& p, int64_t batch, cudaStream_t stream) {
  using Element = typename KT::Element;
  constexpr int D = KT::kD, Dv = KT::kDv;
  const int hkv = p.Hq / p.group;
  auto g = [&](const void* ptr, int64_t len, int heads) { return tma_global_view<Element, D>(ptr, len, heads, batch); };
  FwdSm90Params<KT> P;
  P.p = p;
  P.batch = static_cast<int>(batch);
  P.kv_heads = hkv;
  P.tma_q = make_tma_copy(SM90_TMA_LOAD{}, g(p.q, p.Sq, p.Hq), typename KT::SmemLayoutQ{},
                          Shape<Int<KT::kBM>, Int<D>>{}, _1{});
  P.tma_k = make_tma_copy(SM90_TMA_LOAD{}, g(p.k, p.Skv, hkv), take<0, 2>(typename KT::SmemLayoutK{}),
                          Shape<Int<KT::kBN>, Int<D>>{}, _1{});
  P.tma_v = make_tma_copy(SM90_TMA_LOAD{}, tma_global_view<Element, Dv>(p.v, p.Skv, hkv, batch),
                          take<0, 2>(typename KT::SmemLayoutV{}), Shape<Int<KT::kBN>, Int<Dv>>{}, _1{});
  P.tma_o = make_tma_copy(SM90_TMA_STORE{}, tma_global_view<Element, Dv>(p.out, p.Sq, p.Hq, batch),
                          typename KT::SmemLayoutOHalf{}, Shape<_64, Int<Dv>>{}, _1{});
  auto kernel = attention_fwd_sm90_kernel<KT>;
  static unsigned smem_done = 0;
  cudaError_t err = set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), KT::kSmemBytes, &smem_done);
  if (err != cudaSuccess) return err;
  // At most this many work items (p.nq: tile slots per row); the kernel reads the real count.
  const int64_t tiles = batch * p.nq * p.Hq;
  if (tiles > INT_MAX - (1 << 20)) return cudaErrorInvalidValue;  // the counter runs past the last tile
  const int64_t sms = multiprocessor_count();
  const int64_t ctas = tiles < sms ? tiles : sms;
  kernel<<<static_cast<unsigned>(ctas), KT::kThreads, KT::kSmemBytes, stream>>>(P);
  return cudaGetLastError();
}

template <class Element, int D, int Dv = D>
using FwdSm90TraitsFor = FwdSm90Traits<Element, D, Dv, fwd_sm90_block_n(D, Dv), 2>;

template <class Element>
cudaError_t dispatch_fwd_sm90(const FwdParams& p, int64_t batch, int64_t d, int64_t dv, cudaStream_t stream) {
  if (dv != d) {
    static_assert(sm90_value_head_dim(192, 128));
    if (sm90_value_head_dim(d, dv)) return launch_fwd_sm90_impl<FwdSm90TraitsFor<Element, 192, 128>>(p, batch, stream);
    return cudaErrorInvalidValue;
  }
  switch (d) {
    case 64: return launch_fwd_sm90_impl<FwdSm90TraitsFor<Element, 64>>(p, batch, stream);
    case 96: return launch_fwd_sm90_impl<FwdSm90TraitsFor<Element, 96>>(p, batch, stream);
    case 128: return launch_fwd_sm90_impl<FwdSm90TraitsFor<Element, 128>>(p, batch, stream);
    case 192: return launch_fwd_sm90_impl<FwdSm90TraitsFor<Element, 192>>(p, batch, stream);
    case 256: return launch_fwd_sm90_impl<FwdSm90TraitsFor<Element, 256>>(p, batch, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace detail

bool sm90_kernels_available() {
  static int cache[64] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  int* slot = dev >= 0 && dev < 64 ? &cache[dev] : nullptr;
  if (slot != nullptr && __atomic_load_n(slot, __ATOMIC_ACQUIRE) != 0) return *slot == 1;
  int major = 0;
  bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major == 9;
  if (ok) {
    cudaFuncAttributes attr;
    const void* k = reinterpret_cast<const void*>(
        detail::attention_fwd_sm90_kernel<detail::FwdSm90TraitsFor<cutlass::bfloat16_t, 128>>);
    ok = cudaFuncGetAttributes(&attr, k) == cudaSuccess && attr.binaryVersion == 90;
    if (!ok) (void)cudaGetLastError();
  }
  if (slot != nullptr) __atomic_store_n(slot, ok ? 1 : 2, __ATOMIC_RELEASE);
  return ok;
}

cudaError_t launch_fwd_sm90(const detail::FwdParams& p, int64_t batch, DType dtype, int64_t d, int64_t dv,
                            cudaStream_t stream) {
  return dtype == DType::kBF16 ? detail::dispatch_fwd_sm90<cutlass::bfloat16_t>(p, batch, d, dv, stream)
                               : detail::dispatch_fwd_sm90<cutlass::half_t>(p, batch, d, dv, stream);
}

}  // namespace jaxcp::cuda
