// Key-tile order of the sm_90a default backward when its blocks walk several query heads (GQA),
// or at head dims 96-128 (bwd_plan's by_document): documents heaviest first, each document's key
// tiles in index order. A document's tiles run together, so the blocks running at once share few
// documents' Q / dO / dQ tiles in L2 (which heaviest-first order over all tiles breaks: one key
// tile of every document at once), and the heaviest documents start first, so the last blocks to
// start are short ones (in index order a long document at the end of the row starts its heaviest
// tile last).
#include <climits>

#include "plan.cuh"

namespace jaxcp::cuda {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32;
// A run's weight is bucketed on a log scale below the heaviest run's, kPerOctave buckets an
// octave (runs within 9% of each other keep their index order); the last bucket holds the
// empty tiles.
constexpr int kBuckets = 64, kPerOctave = 8;

__device__ __forceinline__ int work_of(const TileRange r) { return r.y > r.x ? r.y - r.x : 0; }

__device__ __forceinline__ int bucket_of(int weight, int max_weight) {
  if (weight <= 0) return kBuckets - 1;
  const float octaves = log2f(static_cast<float>(max_weight) / static_cast<float>(weight));
  const int b = static_cast<int>(octaves * kPerOctave);
  return b < kBuckets - 2 ? b : kBuckets - 2;
}

// A run is what the plan can tell of a document: consecutive key tiles of one batch row whose
// query ranges end at the same tile (causal: the document's last query tile; bidirectional: the
// same range; a window or chunk: the tiles that share it). Its first tile has the longest range.
__device__ __forceinline__ bool starts_run(const TileRange* ranges, int i, int per_row) {
  return i % per_row == 0 || ranges[i].y != ranges[i - 1].y;
}

// The first tile of tile i's run, for one chunk of kThreads tiles (every thread calls it): an
// inclusive max-scan of the run starts, continuing from the previous chunk's last (carry).
__device__ int run_start(int start_or_minus1, int* warp_max, int& carry) {
  const auto larger = [](int a, int b) { return a > b ? a : b; };
  const int start = larger(detail::block_inclusive_scan(start_or_minus1, warp_max, larger), carry);
  const int next_carry = larger(carry, warp_max[kWarps - 1]);
  __syncthreads();  // warp_max is rewritten by the next chunk
  carry = next_carry;
  return start;
}

// A stable counting sort of the tiles by their run's weight bucket: runs heaviest first, a run's
// tiles (and runs of one bucket) in index order. One block: a plan has at most a few thousand
// key tiles.
__global__ void __launch_bounds__(kThreads) document_schedule_kernel(const TileRange* __restrict__ ranges, int n,
                                                                     int per_row, int* __restrict__ order) {
  __shared__ int warp_max[kWarps];
  __shared__ int counts[kWarps][kBuckets];
  __shared__ int base[kBuckets];
  __shared__ int max_weight;
  const int t = static_cast<int>(threadIdx.x), lane = t % 32, warp = t / 32;
  if (t == 0) max_weight = 0;
  if (t < kBuckets) base[t] = 0;
  __syncthreads();
  int own_max = 0;
  for (int i = t; i < n; i += kThreads) own_max = max(own_max, work_of(ranges[i]));
  atomicMax(&max_weight, own_max);
  __syncthreads();
  const int top = max_weight;
  auto bucket_at = [&](int i, int& carry) {  // every thread calls it; -1 past the end
    const bool valid = i < n;
    const int start = run_start(valid && starts_run(ranges, i, per_row) ? i : -1, warp_max, carry);
    return valid ? bucket_of(work_of(ranges[start]), top) : -1;
  };
  int carry = -1;
  for (int c = 0; c < n; c += kThreads) {
    const int b = bucket_at(c + t, carry);
    if (b >= 0) atomicAdd(&base[b], 1);
  }
  __syncthreads();
  if (t == 0) {  // exclusive scan of the bucket sizes
    int sum = 0;
    for (int b = 0; b < kBuckets; ++b) {
      const int size = base[b];
      base[b] = sum;
      sum += size;
    }
  }
  __syncthreads();
  carry = -1;
  for (int c = 0; c < n; c += kThreads) {
    const int b = bucket_at(c + t, carry);
    for (int k = t; k < kWarps * kBuckets; k += kThreads) (&counts[0][0])[k] = 0;
    __syncthreads();
    const unsigned same = __match_any_sync(0xffffffffu, b);
    const int rank = __popc(same & ((1u << lane) - 1u));  // earlier lanes of this warp in bucket b
    if (b >= 0 && rank == 0) counts[warp][b] = __popc(same);
    __syncthreads();
    if (t < kBuckets) {  // each warp's first place in bucket t, then the bucket's next chunk
      int next = base[t];
      for (int w = 0; w < kWarps; ++w) {
        const int size = counts[w][t];
        counts[w][t] = next;
        next += size;
      }
      base[t] = next;
    }
    __syncthreads();
    if (b >= 0) order[counts[warp][b] + rank] = c + t;
    __syncthreads();  // counts are cleared for the next chunk
  }
}

}  // namespace

cudaError_t launch_document_schedule(const TileRange* ranges, int64_t n, int64_t per_row, int* order,
                                     cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (n > INT_MAX - kThreads || per_row <= 0 || n % per_row != 0) return cudaErrorInvalidValue;
  document_schedule_kernel<<<1, kThreads, 0, stream>>>(ranges, static_cast<int>(n), static_cast<int>(per_row), order);
  return cudaGetLastError();
}

}  // namespace jaxcp::cuda
