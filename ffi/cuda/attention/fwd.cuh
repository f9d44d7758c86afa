// Parameters and launchers shared by the forward kernels (private to ffi/cuda/attention/): the
// sm_80 kernel (fwd_sm80.cu) and the sm_90a kernel (fwd_sm90.cu) read the same tile plan, built
// and handed to them by fwd_launch.cu.
#pragma once
#include "device.cuh"

namespace jaxcp::cuda {
namespace detail {

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  const int32_t* q_seg;
  const int32_t* q_pos;
  const int32_t* kv_seg;
  const int32_t* kv_pos;
  void* out;
  float* lse;
  int64_t Sq, Skv;
  int Hq, group;
  int64_t q_row, kv_row;  // elements between consecutive tokens: Hq*D, Hkv*D
  int64_t o_row;          // of out: Hq*Dv (Hq*D but for the sm_90a kernel's value head dims)
  float scale_log2;
  MaskParams mask;
  const TileSummary* q_sum;   // [B, nq]: query tiles of kFwdBlockM (sm_80 kernel)
  const TileSummary* kv_sum;  // [B, nkv]: key tiles of the kernel's block N
  const TileRange* q_range;   // [B, nq] (sm_80 kernel)
  const int* order;           // [B * nq]: (b * nq + m) tiles, heaviest first (sm_80 kernel)
  int* tile_counter;          // the sm_90a kernel's next-tile counter (zeroed per call)
  const DocTile* doc_tiles;   // the sm_90a kernel's query tiles (launch_doc_tile_plan)
  const int* doc_total;       // how many of them
  const int* doc_widest_keys; // the most keys any of them attends (kv_hi - kv_lo)
  const TileSummary* key_windows;  // [B, Skv]: keys [x, x + block N) (launch_doc_tile_plan)
  int nq, nkv;                // nq: query tiles per row (sm_90a kernel: tile slots per row)
};

// Keys per step of the sm_90a kernel (its query tile is kFwdBlockM = 128; dv: the value head dim):
// 128 where Q and two stages of 128-key K and V tiles (16-bit) fit in 208 KB of shared memory, else
// 64. That is D 64, 96, 128, and q/k 192 with v 128 (208 KB, O staged through sQ; 10-12% faster than
// 64-key tiles, H200); D 192 and 256 take 64.
constexpr int fwd_sm90_block_n(int64_t d, int64_t dv) {
  return 2 * (kFwdBlockM * d + 2 * 128 * (d + dv)) <= 208 * 1024 ? 128 : 64;
}

}  // namespace detail

// True when the sm_90a forward kernel should run these arguments: the current device is sm_90,
// this build carries the sm_90a image, the shape is one where it beats the sm_80 kernel, and the
// kernel options do not ask for the sm_80 kernel (fwd_launch.cu).
bool fwd_use_sm90(const AttentionArgs& args);

// The kernels' launchers: fwd_sm80.cu (head dims 64, 128, 256) and fwd_sm90.cu (sm90_head_dim, and
// the value head dims of sm90_value_head_dim). p comes from attention_fwd (fwd_launch.cu).
cudaError_t launch_fwd_sm80(const detail::FwdParams& p, int64_t batch, DType dtype, int64_t d, cudaStream_t stream);
cudaError_t launch_fwd_sm90(const detail::FwdParams& p, int64_t batch, DType dtype, int64_t d, int64_t dv,
                            cudaStream_t stream);

}  // namespace jaxcp::cuda
