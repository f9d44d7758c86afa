// Launchers of the CUDA small-sequence kernels (launchers.h): which kernel runs, its block shape
// and shared memory. Memory bound, one pass over Q, K, V. A task is a (row b, key/value head g)
// pair with the G = Hq/Hkv query rows of its group: the mma and cuda_core kernels give one warp
// one task and stage its rows into the warp's slice of shared memory (device.cuh); the lane-group
// kernels give it D/8 lanes (at most 32) that load its rows into registers (lanes.cuh).
//
// Kernel families (SmallSeqKernel, named by SmallSeqArgs::kernel; the Python layer picks them,
// src/jaxcp/_src/small_seq/dispatch.py):
// - lanes (fwd_lanes.cuh; bwd_lanes.cuh for groups of 1-2 heads, bwd_lanes_gqa.cuh for larger
//   groups): D/8 lanes per task, K/V in registers, float32 math;
// - mma (fwd_mma.cuh, bwd_mma.cuh): one warp per task, math on tensor cores (mma.sync);
// - cuda_core (fwd_cuda_core.cuh, bwd_cuda_core.cuh): one warp per task, float32 math; with
//   lanes, the backward for GQA groups of more than 16 heads (the tensor-core one keeps the dS of
//   at most 16 heads in registers).
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda/device_query.h"
#include "bwd_cuda_core.cuh"
#include "bwd_lanes.cuh"
#include "bwd_lanes_gqa.cuh"
#include "bwd_mma.cuh"
#include "fwd_cuda_core.cuh"
#include "fwd_lanes.cuh"
#include "fwd_mma.cuh"
#include "launchers.h"

namespace jaxcp::cuda {
namespace small_seq {
namespace {

size_t round16(size_t x) { return (x + 15) & ~size_t{15}; }

// The kernel whose shared-memory slice per warp warp_smem_bytes gives.
enum class Pass { kFwdCudaCore, kFwdMma, kBwdCudaCore, kBwdMma };

size_t row_bytes(const SmallSeqArgs& a) { return static_cast<size_t>(a.head_dim + 8) * 2; }

size_t warp_smem_bytes(const SmallSeqArgs& a, Pass pass) {
  const size_t row = row_bytes(a);  // padded 16-bit row
  const size_t g = static_cast<size_t>(a.q_heads / a.kv_heads);
  const size_t ml = static_cast<size_t>(a.max_len);
  const size_t probs = round16(g * ml * 4);
  size_t bytes = 2 * ml * row + g * row;  // K, V, Q
  if (pass == Pass::kFwdCudaCore) bytes += probs;
  if (pass == Pass::kBwdCudaCore) bytes += g * row + 2 * probs;  // dO, P, dS
  if (pass == Pass::kBwdMma) bytes += g * row + probs;         // dO, P
  return round16(bytes);
}

struct BlockShape {
  int warps;
  size_t smem;  // dynamic shared memory of a block
};

// As many warps as fit in the default 48 KB (at least one).
BlockShape default_shape(size_t per_warp) {
  const int warps = static_cast<int>(std::clamp<size_t>(kDefaultSmemBytes / per_warp, 1,
                                                        kMaxWarpsPerBlock));
  return {warps, per_warp * warps};
}

// The warps per block (each needing per_warp bytes, plus `shared` bytes per block) that keep the
// most warps resident per multiprocessor. Filling 48 KB per block can waste much of an SM's
// shared memory: 4 GQA slices of 10 KB make 5 blocks, 20 warps; 2 per block make 22.
cudaError_t occupancy_shape(size_t per_warp, size_t shared, BlockShape* shape) {
  int device = 0, sm = 0, reserved = 0, optin = 0, max_blocks = 0, max_threads = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  for (auto [value, attr] : {std::pair{&sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor},
                             std::pair{&reserved, cudaDevAttrReservedSharedMemoryPerBlock},
                             std::pair{&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin},
                             std::pair{&max_blocks, cudaDevAttrMaxBlocksPerMultiprocessor},
                             std::pair{&max_threads, cudaDevAttrMaxThreadsPerMultiProcessor}})
    if (cudaError_t e = cudaDeviceGetAttribute(value, attr, device); e != cudaSuccess) return e;
  *shape = {1, per_warp + shared};
  size_t best = 0;
  for (int w = 1; w <= kMaxWarpsPerBlock; ++w) {
    const size_t smem = per_warp * w + shared;
    if (smem > static_cast<size_t>(optin)) break;
    const size_t blocks = std::min<size_t>(sm / (smem + reserved), max_blocks);
    const size_t resident = std::min<size_t>(blocks * w, max_threads / 32);
    if (resident > best) {  // ties: the smaller block (less waiting for its slowest warp)
      best = resident;
      *shape = {w, smem};
    }
  }
  return cudaSuccess;
}

template <typename Kernel>
cudaError_t launch(Kernel kernel, const SmallSeqArgs& a, BlockShape shape, size_t per_warp,
                   Params p, cudaStream_t stream) {
  const int64_t tasks = a.batch * a.kv_heads;
  if (tasks == 0) return cudaSuccess;
  if (shape.smem > kDefaultSmemBytes) {  // large GQA groups at D = 512, some forward shapes
    int device = 0, optin = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    if (cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                               device);
        e != cudaSuccess)
      return e;
    if (shape.smem > static_cast<size_t>(optin)) return cudaErrorInvalidValue;
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(shape.smem));
        e != cudaSuccess)
      return e;
  }
  const int64_t blocks = (tasks + shape.warps - 1) / shape.warps;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  p.warp_smem = static_cast<int>(per_warp);
  kernel<<<static_cast<unsigned>(blocks), shape.warps * 32, shape.smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename Kernel>
cudaError_t launch_default(Kernel kernel, const SmallSeqArgs& a, Pass pass, const Params& p,
                           cudaStream_t stream) {
  const size_t per_warp = warp_smem_bytes(a, pass);
  return launch(kernel, a, default_shape(per_warp), per_warp, p, stream);
}

bool valid_args(const SmallSeqArgs& a) {
  return a.batch >= 0 && a.kv_heads > 0 && a.q_heads % a.kv_heads == 0 && a.tokens >= 0 &&
         a.max_len >= 0 && a.max_len <= kMaxLen && small_seq_head_dim_supported(a.head_dim);
}

Params make_params(const SmallSeqArgs& a) {
  Params p{};
  p.batch = a.batch;
  p.q_heads = a.q_heads;
  p.kv_heads = a.kv_heads;
  // task_at divides task indices below 2^31 by it when kv_heads is below 2^31 too.
  if (a.kv_heads < INT32_MAX) p.kv_heads_divmod = cutlass::FastDivmod(static_cast<int>(a.kv_heads));
  p.tokens = a.tokens;
  p.group = static_cast<int>(a.q_heads / a.kv_heads);
  p.max_len = static_cast<int>(a.max_len);
  p.scale = a.scale;
  return p;
}

// ---------------------------------------------------------------- lane-group kernels

// The register arrays of a lane-group kernel hold NT >= max_len tokens: 2, 4, 8, 12 or 16 (its
// time follows NT more than the tokens the rows attend).
int lanes_tokens(int64_t max_len) {
  return max_len <= 2 ? 2 : max_len <= 4 ? 4 : max_len <= 8 ? 8 : max_len <= 12 ? 12 : 16;
}

// Whether the lane-group kernels hold a task's K/V in registers: 2 x NT x D/8/L chunks of 16
// bytes per lane, at most 32 (D = 512 up to 8 tokens). The backward also holds, for groups of 1
// or 2 query heads, the group's P and dS; for larger groups (bwd_lanes_gqa.cuh) float32 dK/dV of
// every token: up to 4 tokens of one chunk per lane (D <= 256). dispatch.py has the same limits.
// The forward of one query head a task holds K, then V (fwd_lanes_one_head): any D.
bool lanes_hold_kv(const SmallSeqArgs& a) { return a.head_dim <= 256 || a.max_len <= 8; }
bool lanes_fwd_fits(const SmallSeqArgs& a, int group) { return group == 1 || lanes_hold_kv(a); }
bool lanes_bwd_fits(const SmallSeqArgs& a, int group) {
  return group <= 2 ? lanes_hold_kv(a) : a.head_dim <= 256 && a.max_len <= 4;
}

// Calls f(std::integral_constant<int, NT>) for the max_len's NT.
template <typename F>
cudaError_t with_tokens(int64_t max_len, F&& f) {
  switch (lanes_tokens(max_len)) {
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 12: return f(std::integral_constant<int, 12>{});
    default: return f(std::integral_constant<int, 16>{});
  }
}

// A lane-group kernel for D: a block per 128 / L tasks, or where its lane groups walk several
// tasks (kWalks: lanes_walk), at most the blocks resident at once (any grid size gives the same
// results).
template <int D, bool kWalks>
cudaError_t launch_lanes(void (*kernel)(Params), const SmallSeqArgs& a, const Params& p,
                         cudaStream_t stream) {
  const int64_t threads = a.batch * a.kv_heads * Lanes<D>::kL;
  if (threads == 0) return cudaSuccess;
  int64_t blocks = (threads + kLanesBlockThreads - 1) / kLanesBlockThreads;
  if constexpr (kWalks) {
    const void* k = reinterpret_cast<const void*>(kernel);
    blocks = std::min<int64_t>(blocks, static_cast<int64_t>(multiprocessor_count()) *
                                           resident_blocks_per_sm(k, kLanesBlockThreads));
  }
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  kernel<<<static_cast<unsigned>(blocks), kLanesBlockThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t fwd_lanes(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  if (!lanes_fwd_fits(a, p.group)) return cudaErrorInvalidValue;
  return with_tokens(a.max_len, [&](auto nt) -> cudaError_t {
    constexpr int NT = decltype(nt)::value;
    if constexpr (fwd_lanes_one_head(NT))
      if (p.group == 1) return launch_lanes<D, true>(small_seq_fwd_lanes_one_head_kernel<T, D, NT>, a, p, s);
    if constexpr (D == 512 && NT > 8) {
      return cudaErrorInvalidValue;
    } else {
      return launch_lanes<D, fwd_lanes_persistent(D, NT)>(small_seq_fwd_lanes_kernel<T, D, NT>, a,
                                                          p, s);
    }
  });
}

template <typename T, int D>
cudaError_t bwd_lanes(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  if (!lanes_bwd_fits(a, p.group)) return cudaErrorInvalidValue;
  return with_tokens(a.max_len, [&](auto nt) -> cudaError_t {
    constexpr int NT = decltype(nt)::value;
    if constexpr (D == 512 && NT > 8) {
      return cudaErrorInvalidValue;
    } else if (p.group == 1) {
      return launch_lanes<D, bwd_lanes_persistent(D, NT)>(
          small_seq_bwd_lanes_kernel<T, D, NT, 1>, a, p, s);
    } else if (p.group == 2) {
      return launch_lanes<D, bwd_lanes_persistent(D, NT)>(
          small_seq_bwd_lanes_kernel<T, D, NT, 2>, a, p, s);
    } else if constexpr (D <= 256 && NT <= 4) {
      return launch_lanes<D, false>(small_seq_bwd_lanes_gqa_kernel<T, D, NT>, a, p, s);
    } else {
      return cudaErrorInvalidValue;
    }
  });
}

// ---------------------------------------------------------------- per family

template <typename T, int D>
cudaError_t fwd_mma(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  const size_t per_warp = warp_smem_bytes(a, Pass::kFwdMma);
  BlockShape shape;
  if (cudaError_t e = occupancy_shape(per_warp, row_bytes(a), &shape); e != cudaSuccess) return e;
  if (a.max_len <= 8) return launch(small_seq_fwd_mma_kernel<T, D, 1>, a, shape, per_warp, p, s);
  return launch(small_seq_fwd_mma_kernel<T, D, 2>, a, shape, per_warp, p, s);
}

template <typename T, int D>
cudaError_t bwd_mma(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  if (p.group > 16) return cudaErrorInvalidValue;  // dS of at most 16 heads in registers
  const size_t per_warp = warp_smem_bytes(a, Pass::kBwdMma);
  BlockShape shape;
  if (cudaError_t e = occupancy_shape(per_warp, row_bytes(a), &shape); e != cudaSuccess) return e;
  const bool one_token_tile = a.max_len <= 8;
  if (p.group <= 8)
    return one_token_tile ? launch(small_seq_bwd_mma_kernel<T, D, 1, 1>, a, shape, per_warp, p, s)
                          : launch(small_seq_bwd_mma_kernel<T, D, 1, 2>, a, shape, per_warp, p, s);
  return one_token_tile ? launch(small_seq_bwd_mma_kernel<T, D, 2, 1>, a, shape, per_warp, p, s)
                        : launch(small_seq_bwd_mma_kernel<T, D, 2, 2>, a, shape, per_warp, p, s);
}

template <typename T, int D>
cudaError_t fwd_typed(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  switch (static_cast<SmallSeqKernel>(a.kernel.fwd)) {
    case SmallSeqKernel::kLanes: return fwd_lanes<T, D>(a, p, s);
    case SmallSeqKernel::kMma: return fwd_mma<T, D>(a, p, s);
    case SmallSeqKernel::kCudaCore:
      return launch_default(small_seq_fwd_kernel<T, D>, a, Pass::kFwdCudaCore, p, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int D>
cudaError_t bwd_typed(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  switch (static_cast<SmallSeqKernel>(a.kernel.bwd)) {
    case SmallSeqKernel::kLanes: return bwd_lanes<T, D>(a, p, s);
    case SmallSeqKernel::kMma: return bwd_mma<T, D>(a, p, s);
    case SmallSeqKernel::kCudaCore:
      return launch_default(small_seq_bwd_kernel<T, D>, a, Pass::kBwdCudaCore, p, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t dispatch_fwd(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  switch (a.head_dim) {
    case 64: return fwd_typed<T, 64>(a, p, s);
    case 128: return fwd_typed<T, 128>(a, p, s);
    case 256: return fwd_typed<T, 256>(a, p, s);
    case 512: return fwd_typed<T, 512>(a, p, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t dispatch_bwd(const SmallSeqArgs& a, const Params& p, cudaStream_t s) {
  switch (a.head_dim) {
    case 64: return bwd_typed<T, 64>(a, p, s);
    case 128: return bwd_typed<T, 128>(a, p, s);
    case 256: return bwd_typed<T, 256>(a, p, s);
    case 512: return bwd_typed<T, 512>(a, p, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace small_seq

bool small_seq_head_dim_supported(int64_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256 || head_dim == 512;
}

cudaError_t small_seq_fwd(const SmallSeqArgs& args, SmallSeqDType dtype, const void* q,
                          const void* k, const void* v, const int32_t* kv_start,
                          const int32_t* kv_len, const int32_t* kv_mask, void* out, float* probs,
                          cudaStream_t stream) {
  if (!small_seq::valid_args(args)) return cudaErrorInvalidValue;
  small_seq::Params p = small_seq::make_params(args);
  p.q = q;
  p.k = k;
  p.v = v;
  p.kv_start = kv_start;
  p.kv_len = kv_len;
  p.kv_mask = kv_mask;
  p.out = out;
  p.probs_out = probs;
  return dtype == SmallSeqDType::kBF16 ? small_seq::dispatch_fwd<__nv_bfloat16>(args, p, stream)
                                       : small_seq::dispatch_fwd<__half>(args, p, stream);
}

cudaError_t small_seq_bwd(const SmallSeqArgs& args, SmallSeqDType dtype, const void* q,
                          const void* k, const void* v, const float* probs, const void* dout,
                          const int32_t* kv_start, const int32_t* kv_len, const int32_t* kv_mask,
                          void* dq, void* dk, void* dv, cudaStream_t stream) {
  if (!small_seq::valid_args(args)) return cudaErrorInvalidValue;
  if (args.batch == 0 || args.max_len == 0) {  // nothing attends: every gradient is zero
    const size_t kv_bytes = static_cast<size_t>(args.tokens * args.kv_heads * args.head_dim) * 2;
    const size_t q_bytes = static_cast<size_t>(args.batch * args.q_heads * args.head_dim) * 2;
    cudaError_t e = cudaMemsetAsync(dk, 0, kv_bytes, stream);
    if (e == cudaSuccess) e = cudaMemsetAsync(dv, 0, kv_bytes, stream);
    if (e == cudaSuccess && q_bytes) e = cudaMemsetAsync(dq, 0, q_bytes, stream);
    return e;
  }
  small_seq::Params p = small_seq::make_params(args);
  p.q = q;
  p.k = k;
  p.v = v;
  p.probs = probs;
  p.dout = dout;
  p.kv_start = kv_start;
  p.kv_len = kv_len;
  p.kv_mask = kv_mask;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  return dtype == SmallSeqDType::kBF16 ? small_seq::dispatch_bwd<__nv_bfloat16>(args, p, stream)
                                       : small_seq::dispatch_bwd<__half>(args, p, stream);
}

}  // namespace jaxcp::cuda
