// Tile shapes, shared-memory layouts and storage of the sm_90a backward kernel
// (bwd_sm90.cu), one traits struct per design:
//   BwdSm90Traits (D 64, 96, 128): 128-key tiles, one 64-key slab per consumer warpgroup; P and dS
//     stay in registers as the A operand of dV / dK; dQ through a shared buffer and a writer warp.
//     Query tiles of 64, or 128 at D 64 (bwd_sm90_block_m: 8-10% faster there, H100).
//   BwdSm90SplitDTraits (D 192, 256; q/k 192 with v 128): dK and dV of 128 keys would not fit in
//     the registers, so key tiles are 64 keys and the warpgroups split the head dim of dK, dV and
//     dQ (and the queries of S^T and dP^T). P^T and dS^T go through shared memory to both; dQ is
//     reduce-added from the registers (no room for a float32 dQ buffer next to the D 256 tiles).
// Both compute S^T and dP^T with keys as rows. kDv, the value head dim, sizes V, dO, dV and the
// dP^T / dV GEMMs (multi-head latent attention: sm90_value_head_dim); Q, K, dK, dQ take kD.
#pragma once
#include <initializer_list>

#include "bwd.cuh"

#include "sm90.cuh"

namespace jaxcp::cuda::detail {

// What a consumer step needs to know (written by the producer next to the stage's Q, published
// by its arrive on the dO stage): the query tile, its class, the head, whether another follows.
struct BwdSm90StepInfo {
  int i, c, h, more;
};

// Layouts and TMA types both designs share, from the tile sizes and pipeline depths. kSplit: how
// many slices of the head dim the warpgroups' GEMMs take (1, or 2 where they split it): the
// shared-memory swizzle must divide a slice, as a slice's MN-major operand must start on a swizzle
// atom (D 192 split in two: 64-byte swizzle, 96 = 3 x 32 columns; its V, 128 wide: 128-byte).
template <class Element_, int kD_, int kDv_, int kBN_, int kStagesQ_, int kStagesDO_, int kSplit>
struct BwdSm90Common {
  using Element = Element_;
  static constexpr int kD = kD_, kDv = kDv_, kBM = bwd_sm90_block_m(kD_), kBN = kBN_;
  static constexpr int kStagesQ = kStagesQ_, kStagesDO = kStagesDO_;
  static_assert(kBN == bwd_block_n(kD), "the host plan's key tiles");
  static constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
  static constexpr int kConsumerThreads = 256;

  using SmemAtomK = SmemAtomKMajor<Element, kD / kSplit>;
  using SmemAtomV = SmemAtomKMajor<Element, kDv / kSplit>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBM>, Int<kD>, Int<kStagesQ>>{}));
  using SmemLayoutdO = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBM>, Int<kDv>, Int<kStagesDO>>{}));
  // Q and dO read as the (D, queries) B operand of dK / dV: the same bytes, MN-major.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kD>, Int<kBM>, Int<kStagesQ>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_ordered_layout(Shape<Int<kDv>, Int<kBM>, Int<kStagesDO>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBN>, Int<kD>>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBN>, Int<kDv>>{}));
  using SmemLayoutKt = decltype(composition(SmemLayoutK{}, make_ordered_layout(Shape<Int<kD>, Int<kBN>>{},
                                                                                Step<_2, _1>{})));
  using ShapeG = cute::Shape<int32_t, int32_t, int32_t, int32_t>;  // (token, d, head, batch)
  using StrideG = cute::Stride<int64_t, _1, int64_t, int64_t>;
  using GTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeG{}, StrideG{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{}, take<0, 2>(SmemLayoutQ{}),
                                     Shape<Int<kBM>, Int<kD>>{}, _1{}));
  using TmadO = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{}, take<0, 2>(SmemLayoutdO{}),
                                      Shape<Int<kBM>, Int<kDv>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{}, SmemLayoutK{}, Shape<Int<kBN>, Int<kD>>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{}, SmemLayoutV{}, Shape<Int<kBN>, Int<kDv>>{}, _1{}));
  // dK and dV leave from the K and V tiles' shared memory, in their layout.
  using GTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeG{}, StrideG{}));
  using TmaStoreK = decltype(make_tma_copy(SM90_TMA_STORE{}, GTensorOut{}, SmemLayoutK{},
                                          Shape<Int<kBN>, Int<kD>>{}, _1{}));
  using TmaStoreV = decltype(make_tma_copy(SM90_TMA_STORE{}, GTensorOut{}, SmemLayoutV{},
                                          Shape<Int<kBN>, Int<kDv>>{}, _1{}));
  // Named barriers: user ids 0-7 (cutlass::arch::NamedBarrier adds its 8 reserved ids: hardware
  // barriers 8-15; 0-7 are __syncthreads' and CUTLASS's). 7: the consumers' epilogue.
  static constexpr int kBarEpilogue = 7;
  static constexpr bool user_barriers(std::initializer_list<int> ids) {
    for (int id : ids)
      if (id < 0 || id > 7) return false;
    return true;
  }

  using PipelineQ = cutlass::PipelineTmaAsync<kStagesQ>;
  using PipelineDO = cutlass::PipelineTmaAsync<kStagesDO>;
  static constexpr uint32_t kRowBytes = kBM * sizeof(float);  // lse2 or delta of one query tile
  static constexpr uint32_t kIdBytes = kBM * sizeof(ColMask);  // (segment, position) of its queries
  static constexpr uint32_t kQStageBytes = kBM * kD * sizeof(Element) + kRowBytes + kIdBytes;
  static constexpr uint32_t kDOStageBytes = kBM * kDv * sizeof(Element) + kRowBytes;
  static constexpr uint32_t kKVBytes = kBN * (kD + kDv) * sizeof(Element);

  // Everything but the P / dS and dQ buffers, which the designs size differently.
  struct CommonStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutdO>, 1024> dout;
    cute::array_aligned<float, kBM * kStagesQ, 128> lse2;
    cute::array_aligned<float, kBM * kStagesDO, 128> delta;
    cute::array_aligned<ColMask, kBM * kStagesQ, 128> q_ids;  // with the Q stage
    RowMask q_masks[2][2][kBM];  // [consumer warpgroup][parity of the partial tile][query]
    BwdSm90StepInfo step_info[kStagesQ];  // the step whose Q a stage holds
    typename PipelineQ::SharedStorage pipe_q;
    typename PipelineDO::SharedStorage pipe_do;
    alignas(8) uint64_t kv_full;
    int last_split;  // split GQA groups: this block is its key tile's last split (epilogue)
  };
};

template <class Element_, int kHeadDim, int kStages>
struct BwdSm90Traits : BwdSm90Common<Element_, kHeadDim, kHeadDim, 128, kStages, kStages, 1> {
  using Base = BwdSm90Common<Element_, kHeadDim, kHeadDim, 128, kStages, kStages, 1>;
  using Element = Element_;
  static constexpr bool kSplitD = false;
  static constexpr int kD = kHeadDim, kDv = kHeadDim, kBM = Base::kBM, kBN = Base::kBN;
  // Named barriers (user ids): 0 both consumer warpgroups' dS are in shared memory; 1, 2 a
  // warpgroup's half of the dQ buffer is empty, 3, 4 full (the warpgroup + the writer warp); 5, 6
  // a warpgroup's query masks.
  static constexpr int kBarDS = 0, kBarDQEmpty = 1, kBarDQFull = 3, kBarQMasks = 5;
  static_assert(Base::user_barriers({kBarDS, kBarDQEmpty + 1, kBarDQFull + 1, kBarQMasks + 1}));
  static constexpr int kDQSyncThreads = 128 + 32;

  // dS as dQ's A operand K-major (keys contiguous), as FlashAttention-3 keeps it: the key-row
  // fragments of dS^T go to shared memory by transposing stmatrix.
  using SmemLayoutdS = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                              Shape<Int<kBM>, Int<kBN>, _2>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kBN>, Int<kBM>, _2>{}, Step<_2, _1, _3>{})));
  using CopyAtomPdS = Copy_Atom<SM90_U16x8_STSM_T, Element>;

  // Keys as rows: one 64-key slab per consumer warpgroup.
  using AtomRows = Layout<Shape<_2, _1, _1>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBN>, Int<kBM>, Int<kD>>>(), AtomRows{}));
  using TiledMmadK = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBN>, Int<kD>, Int<kBM>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AtomRows{}));
  using TiledMmadV = TiledMmadK;
  // dQ (queries x D): the warpgroups split the queries when there are 128 (wider wgmma), else D.
  static constexpr int kDQSplitM = kBM >= 128 ? 2 : 1;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBM / kDQSplitM>, Int<kD * kDQSplitM / 2>, Int<kBN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kDQSplitM>, Int<2 / kDQSplitM>, _1>>{}));

  // A handoff of turns from one thread to another through two slots (mbarriers): the k-th turn
  // goes through slot k % 2. The sender waits for a free slot (wait_free), then fills it; the
  // receiver waits until it is filled and frees it (receive).
  struct TurnHandoff {
    uint64_t full[2], empty[2];
    __device__ void init() {
      for (int slot = 0; slot < 2; ++slot) {
        cutlass::arch::ClusterBarrier::init(&full[slot], 1);
        cutlass::arch::ClusterBarrier::init(&empty[slot], 1);
      }
    }
    __device__ void wait_free(int k) { mbar_wait(&empty[k % 2], ((k / 2) % 2) ^ 1); }
    __device__ void fill(int k) { mbar_arrive(&full[k % 2]); }
    __device__ void receive(int k) {
      mbar_wait(&full[k % 2], (k / 2) % 2);
      mbar_arrive(&empty[k % 2]);
    }
  };
  // The deterministic kernel's dQ turns: those the turn-taking warp holds for the writer warp
  // (taken), and those whose adds the writer has completed, for the turn-passing warp (done).
  struct TurnSlots {
    TurnHandoff taken, done;
  };

  struct SharedStorage : Base::CommonStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> ds;
    cute::array_aligned<float, kBM * kD, 128> dq;  // [warpgroup][float4 chunk][thread][4]: one tile, two halves
    alignas(8) TurnSlots turns;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 232448, "227 KB of shared memory per block on sm_90");
};

// dO stages of the split-D design (Q has two; three were slower at D 192 and no faster at q/k 192
// with v 128, H200). D 256: one; two, with single P / dS buffers (the shared memory allows one or
// the other), ran at the same speed (H100, 2 x 8k, documents of 1k). D 192: two, 1.07x faster
// forward+backward than one (H200, 2 x 8k doc1k). q/k 192 with v 128: one; two were 0.5-1% slower
// (same A/B).
constexpr int bwd_sm90_split_do_stages(int d, int dv) { return d == 192 && dv == 192 ? 2 : 1; }

template <class Element_, int kHeadDim, int kHeadDimV = kHeadDim>
struct BwdSm90SplitDTraits
    : BwdSm90Common<Element_, kHeadDim, kHeadDimV, 64, 2, bwd_sm90_split_do_stages(kHeadDim, kHeadDimV), 2> {
  using Base = BwdSm90Common<Element_, kHeadDim, kHeadDimV, 64, 2, bwd_sm90_split_do_stages(kHeadDim, kHeadDimV), 2>;
  using Element = Element_;
  static constexpr bool kSplitD = true;
  static constexpr int kD = kHeadDim, kDv = kHeadDimV, kBM = Base::kBM, kBN = Base::kBN;
  // Named barriers (user ids): 1 / 2 both warpgroups' P^T / dS^T are in shared memory; 3 the
  // deterministic dQ turn taken / done; 4, 5 a warpgroup's query masks.
  static constexpr int kBarP = 1, kBarDS = 2, kBarTurn = 3, kBarQMasks = 4;
  static_assert(Base::user_barriers({kBarP, kBarDS, kBarTurn, kBarQMasks + 1}));

  // P and dS as dQ's (queries, keys) A operand, queries contiguous; their transposes (keys,
  // queries) are the same bytes read K-major by dK / dV, as the fragments store them (stmatrix
  // without transposing). Two buffers, so that one warpgroup can write the next step's while the
  // other still reads this one.
  using SmemLayoutdS = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                              Shape<Int<kBM>, Int<kBN>, _2>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kBN>, Int<kBM>, _2>{}, Step<_2, _1, _3>{})));
  using CopyAtomPdS = Copy_Atom<SM90_U32x4_STSM_N, Element>;

  using AtomCols = Layout<Shape<_1, _2, _1>>;
  // S^T, dP^T (keys x queries): the warpgroups split the queries. (The selector's K, D here,
  // picks only the atom's k of 16, so dP^T = V dO^T runs on it over Dv as well.)
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBN>, Int<kBM / 2>, Int<kD>>>(), AtomCols{}));
  // dK, dV (keys x D, Dv) += dS^T / P^T (keys x queries, shared) x Q / dO: the warpgroups split D, Dv.
  template <int kCols>
  using TiledMmaKeysBy = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBN>, Int<kCols / 2>, Int<kBM>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AtomCols{}));
  using TiledMmadK = TiledMmaKeysBy<kD>;
  using TiledMmadV = TiledMmaKeysBy<kDv>;
  // dQ (queries x D): the warpgroups split D.
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBM>, Int<kD / 2>, Int<kBN>>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      AtomCols{}));

  struct SharedStorage : Base::CommonStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> p;
    cute::array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> ds;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 232448, "227 KB of shared memory per block on sm_90");
};

}  // namespace jaxcp::cuda::detail
