// Building blocks of the lane-group small-seq kernels (fwd_lanes.cuh, bwd_lanes.cuh).
//
// A task (row b, key/value head g) belongs to a group of L = min(32, D/8) lanes, not to a warp:
// lane i of the group holds 16-byte chunks i, i + L, ... of every row it reads, straight from
// global memory into registers. A row of D = 64 is one 128-byte line over 8 lanes, so a warp
// serves 4 tasks and issues all their loads at once: few heads times a small D is a small task,
// and with one task per warp (the tensor-core kernels) too few bytes were in flight to reach the
// memory bandwidth. Dot products are reduced over the group with xor shuffles (offsets < L stay
// inside the group); every lane then holds every score of its task.
#pragma once
#include "device.cuh"

namespace jaxcp::cuda::small_seq {

// Small blocks: the kernels with 16 tokens use up to 255 registers (8 warps per SM), and blocks
// of 4 warps let an SM overlap one block's loads with another's math and stores.
constexpr int kLanesBlockThreads = 128;

template <int D>
struct Lanes {
  static constexpr int kL = Geometry<D>::kChunkLanes;     // lanes per task
  static constexpr int kC = Geometry<D>::kChunksPerLane;  // chunks of a row per lane
};

// The group's task, this lane's index in the group, and whether the task exists (lanes past the
// last task keep running with an empty task: the shuffles need every lane of the warp).
template <int D>
struct LaneTask {
  Task t;
  int lane;
  bool has;
  __device__ explicit LaneTask(const Params& p) {
    const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    lane = static_cast<int>(thread % Lanes<D>::kL);
    has = task_at(p, thread / Lanes<D>::kL, &t);
  }
  __device__ LaneTask(const Task& task, int lane_in_group, bool exists)
      : t(task), lane(lane_in_group), has(exists) {}
  // Whether the row attends to token j.
  __device__ bool attends(int j) const { return j < t.len && allowed(t.mask, j); }
  // Element offset of this lane's first chunk of token j's row (head g) in K/V [T, Hkv, D].
  __device__ int64_t kv_offset(const Params& p, int j) const {
    return ((t.start + j) * p.kv_heads + t.g) * D + lane * 8;
  }
};

// Runs task(lane task) for this thread's lane group's tasks w, w + stride, ... on a grid of the
// blocks resident at once (launch.cu: launch_lanes<D, true>), loading the next task's index
// entries (row start, length, mask) while the current one runs: only a group's first task waits
// for them before its loads.
// The walk's state takes 16-24 registers: the kernels walk where that leaves their resident
// blocks the same (fwd_lanes_persistent, bwd_lanes_persistent).
template <int D, typename F>
__device__ __forceinline__ void lanes_walk(const Params& p, F&& task) {
  constexpr int L = Lanes<D>::kL;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x / L;  // tasks per sweep
  const int lane = static_cast<int>(thread % L);
  const int64_t tasks = p.batch * p.kv_heads;
  // Every lane of a warp takes the same steps (the shuffles need all of them): while the warp's
  // first task exists; lanes past the last task run empty tasks.
  int64_t w = thread / L, first = (thread - (threadIdx.x & 31)) / L;
  Task t;
  bool has = task_at(p, w, &t);
  for (; first < tasks; first += stride, w += stride) {
    Task next;
    const bool next_has = task_at(p, w + stride, &next);
    task(LaneTask<D>(t, lane, has));
    t = next;
    has = next_has;
  }
}

__device__ __forceinline__ uint4 ldg16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// Hides x's value from the compiler at this point (no instruction): math on x after it cannot be
// hoisted above it. The forward's head loop would otherwise keep all K/V unpacked to float32
// (twice the registers, spilled at 16 tokens).
__device__ __forceinline__ void opaque(uint4& x) {
  asm volatile("" : "+r"(x.x), "+r"(x.y), "+r"(x.z), "+r"(x.w));
}

// This lane's chunks of one [D] row (chunk lane + cc * L at element offset cc * L * 8).
template <typename T, int D>
__device__ __forceinline__ void load_row(const T* row, bool ok, uint4 (&r)[Lanes<D>::kC]) {
#pragma unroll
  for (int cc = 0; cc < Lanes<D>::kC; ++cc)
    r[cc] = ok ? ldg16(row + cc * Lanes<D>::kL * 8) : make_uint4(0, 0, 0, 0);
}

template <typename T, int D>
__device__ __forceinline__ void store_row(T* row, float (&f)[Lanes<D>::kC][8], float scale) {
#pragma unroll
  for (int cc = 0; cc < Lanes<D>::kC; ++cc) stg16(row + cc * Lanes<D>::kL * 8, pack8<T>(f[cc], scale));
}

template <typename T, int D>
__device__ __forceinline__ void unpack_row(const uint4 (&r)[Lanes<D>::kC], float (&f)[Lanes<D>::kC][8]) {
#pragma unroll
  for (int cc = 0; cc < Lanes<D>::kC; ++cc) Cvt<T>::unpack(r[cc], f[cc]);
}

// This lane's share of dot(a, row r).
template <typename T, int D>
__device__ __forceinline__ float lane_dot(const float (&a)[Lanes<D>::kC][8], const uint4 (&r)[Lanes<D>::kC]) {
  float acc = 0.f;
#pragma unroll
  for (int cc = 0; cc < Lanes<D>::kC; ++cc) {
    float f[8];
    Cvt<T>::unpack(r[cc], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(a[cc][e], f[e], acc);
  }
  return acc;
}

// acc += w * row r.
template <typename T, int D>
__device__ __forceinline__ void lane_axpy(float w, const uint4 (&r)[Lanes<D>::kC], float (&acc)[Lanes<D>::kC][8]) {
#pragma unroll
  for (int cc = 0; cc < Lanes<D>::kC; ++cc) {
    float f[8];
    Cvt<T>::unpack(r[cc], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[cc][e] = fmaf(w, f[e], acc[cc][e]);
  }
}

// This lane's chunks of the task's tokens j0 + j (j < N) of `rows` (K or V) that the row attends
// (ok[j]; zeros elsewhere), all loads issued together.
template <typename T, int D, int N>
__device__ __forceinline__ void load_tokens(const Params& p, const LaneTask<D>& lt, const void* rows,
                                            bool (&ok)[N], uint4 (&r)[N][Lanes<D>::kC], int j0 = 0) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    ok[j] = lt.attends(j0 + j);
    load_row<T, D>(static_cast<const T*>(rows) + (ok[j] ? lt.kv_offset(p, j0 + j) : 0), ok[j], r[j]);
  }
}

// K and V both (load_tokens), all loads issued together.
template <typename T, int D, int NT>
__device__ __forceinline__ void load_kv(const Params& p, const LaneTask<D>& lt, bool (&ok)[NT],
                                        uint4 (&kr)[NT][Lanes<D>::kC], uint4 (&vr)[NT][Lanes<D>::kC]) {
  load_tokens<T, D, NT>(p, lt, p.k, ok, kr);
  load_tokens<T, D, NT>(p, lt, p.v, ok, vr);
}

// Sums each of x[0..N) over the task's L lanes (every lane gets the sums).
template <int L, int N>
__device__ __forceinline__ void group_sum(float (&x)[N]) {
#pragma unroll
  for (int o = 1; o < L; o <<= 1)
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] += __shfl_xor_sync(kFull, x[i], o);
}

}  // namespace jaxcp::cuda::small_seq
