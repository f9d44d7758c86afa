// Building blocks shared by the sm_90a (Hopper) kernels, private to ffi/cuda/attention/: warpgroup
// GEMM issue, accumulator layout views and register conversions. Include after
// device.cuh (cute/tensor.hpp must come first).
#pragma once
#include "device.cuh"
#include "cuda/vector_store.cuh"

#include <type_traits>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAXCP_SM90_DEVICE 1
#else
#define JAXCP_SM90_DEVICE 0
#endif

namespace jaxcp::cuda::detail {

// K-major shared-memory atom for rows of kCols 16-bit elements: the widest swizzle whose span
// divides the row (128 bytes for D 64, 128, 192, 256; 64 bytes for D 96).
template <class Element, int kCols>
using SmemAtomKMajor = std::conditional_t<
    kCols % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
    std::conditional_t<kCols % 32 == 0, GMMA::Layout_K_SW64_Atom<Element>, GMMA::Layout_K_SW32_Atom<Element>>>;

// wgmma accumulator ((2, 2, N/8), MMA_M, MMA_N) -> ((2, MMA_M), (2, N/8, MMA_N)) = (rows, cols).
template <class L>
__forceinline__ __device__ auto acc_rowcol_sm90(L const& l) {
  static_assert(decltype(rank<0>(l))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// wgmma accumulator of S (64 x N per warpgroup) -> register A operand of the P V wgmma
// ((2, 2, 2), MMA_M, N/16): two adjacent 8-column blocks form one k16 slice.
template <class L>
__forceinline__ __device__ auto acc_as_A_sm90(L const& l) {
  static_assert(decltype(rank<0>(l))::value == 3);
  auto n = logical_divide(get<0, 2>(l), Tile<_2>{});
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(n)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(n), get<2>(l))));
}

// Issues one warpgroup GEMM on the tensor cores (k-slices kK0 .. kK1 - 1; all by default) and
// commits it as one batch; the caller waits with warpgroup_wait<N>() and then fences the
// accumulator.
template <bool kZeroInit, int kK0 = 0, int kK1 = -1, class TiledMma, class TA, class TB, class TC>
__forceinline__ __device__ void wgmma_issue(TiledMma& mma, TA const& tA, TB const& tB, TC& tC) {
  constexpr bool kRegA = !cute::is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  constexpr int kEnd = kK1 < 0 ? int(decltype(size<2>(tA))::value) : kK1;
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(tA));
  warpgroup_fence_operand(tC);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = kK0; k < kEnd; ++k) {
    cute::gemm(mma, tA(_, _, k), tB(_, _, k), tC);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// dst (16-bit registers) = src (float registers), same layout.
template <class TD, class TS>
__forceinline__ __device__ void convert_into(TD& dst, TS const& src) {
  using To = typename TD::value_type;
  constexpr int n = decltype(size(src))::value;
  cutlass::NumericArrayConverter<To, float, n> op;
  *reinterpret_cast<cutlass::Array<To, n>*>(dst.data()) =
      op(*reinterpret_cast<const cutlass::Array<float, n>*>(src.data()));
}

// The two 16-bit elements of a packed pair as floats (low half first). bfloat16: a shift and a
// mask, one instruction each (converting the elements one by one costs two, plus a repack).
template <class Element>
__forceinline__ __device__ float2 unpack_pair(uint32_t pair) {
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
  } else {
    static_assert(std::is_same_v<Element, cutlass::half_t>);
    return __half22float2(*reinterpret_cast<const __half2*>(&pair));
  }
}

// Copies one int32 from global to shared memory asynchronously (zeros when !valid: nothing read).
__forceinline__ __device__ void cp_async_i32(int32_t* dst, const int32_t* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

// Arrives on the mbarrier once this thread's earlier cp.async copies have landed (counts as one
// of the barrier's expected arrivals).
__forceinline__ __device__ void cp_async_arrive(uint64_t* bar) {
  const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(b) : "memory");
}

// Keeps the compiler from moving plain memory accesses across this point. cutlass's barrier and
// pipeline asm (ClusterBarrier, PipelineTmaAsync) has no "memory" clobber, so a load of data a
// barrier guards could move above its wait, or a store below its arrive: put one after each
// such wait and before each such arrive that publishes plain shared-memory data.
__forceinline__ __device__ void compiler_memory_fence() { asm volatile("" ::: "memory"); }

// mbarrier wait and arrive with that fence.
__forceinline__ __device__ void mbar_wait(uint64_t* bar, int phase) {
  cutlass::arch::ClusterBarrier::wait(bar, phase);
  compiler_memory_fence();
}
__forceinline__ __device__ void mbar_arrive(uint64_t* bar) {
  compiler_memory_fence();
  cutlass::arch::ClusterBarrier::arrive(bar);
}

// 16 bytes from shared memory by an explicit shared-space load (a pointer into a CuTe smem
// tensor may otherwise compile to a generic load).
__forceinline__ __device__ uint4 lds_128(const void* smem) {
  uint4 v;
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a)
               : "memory");
  return v;
}

// threadIdx.x read through an asm the compiler cannot see into. In a persistent kernel's loop
// over tiles, values derived from it (fragment coordinates, shared-memory addresses) are then
// recomputed for each tile instead of being hoisted out of the loop and kept live, or spilled,
// across all of it.
__forceinline__ __device__ int opaque_thread_index() {
  int x;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(x));
  return x;
}

// Waits until this thread's cp.async copies have landed.
__forceinline__ __device__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// The kernel's shared storage at the start of dynamic shared memory (declared
// `extern __shared__ __align__(1024) char smem_raw[]`; the sm_90a kernels have no static shared
// memory, so it starts 1 KB aligned, as 128-byte-swizzled TMA tiles need). Addressed from the
// symbol itself, every member's shared address is a link-time constant: LDS/STS offsets and wgmma
// descriptors fold into immediates and uniform registers (a pad computed at run time would make
// every address a register value, and each wgmma's descriptors a register-to-uniform copy).
template <class SharedStorage>
__forceinline__ __device__ SharedStorage& shared_storage_at(char* smem_raw) {
  if (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) % 1024u != 0) __trap();
  return *reinterpret_cast<SharedStorage*>(smem_raw);
}

// Parameters of a TMA pipeline whose producer is warpgroup 0 (thread 0 issues the loads) and
// whose consumers are `consumers` threads of the other warpgroups.
template <class Pipeline>
__forceinline__ __device__ typename Pipeline::Params tma_pipeline_params(uint32_t transaction_bytes,
                                                                         int consumers) {
  typename Pipeline::Params pp;
  pp.transaction_bytes = transaction_bytes;
  pp.role = threadIdx.x < 128 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = consumers;
  return pp;
}

// (token, d, head, batch) view of a [batch, len, heads, D] tensor: the global side of a TMA copy
// (Void = const void: an input to load; void: an output to store).
template <class Element, int D, class Void>
auto tma_global_view(Void* ptr, int64_t len, int64_t heads, int64_t batch) {
  using E = std::conditional_t<std::is_const_v<Void>, Element const, Element>;
  return make_tensor(make_gmem_ptr(static_cast<E*>(ptr)),
                     make_shape(static_cast<int32_t>(len), int32_t(D), static_cast<int32_t>(heads),
                                static_cast<int32_t>(batch)),
                     make_stride(heads * D, _1{}, int64_t(D), heads * D * len));
}

}  // namespace jaxcp::cuda::detail
