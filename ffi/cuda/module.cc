// The CUDA extension module: exposes its FFI handlers as capsules for jax.ffi registration,
// and the workspace sizes the attention handlers expect as their last result buffer.
#include <nanobind/nanobind.h>

#include <utility>

#include "common/attention_shape.h"
#include "attention/launchers.h"
#include "call_counts.h"
#include "cuda_handlers.h"

namespace nb = nanobind;

namespace {

jaxcp::AttentionArgs args_of(int64_t b, int64_t sq, int64_t skv, int64_t hq, int64_t hkv,
                             int64_t d, bool causal, int64_t window_left, int64_t window_right,
                             int64_t chunk, bool deterministic) {
  jaxcp::AttentionArgs a;
  a.shape = {b, sq, skv, hq, hkv, d};
  a.mask.causal = causal;
  a.mask.window_left = window_left;
  a.mask.window_right = window_right;
  a.mask.chunk_size = chunk;
  a.deterministic = deterministic;
  return a;
}

}  // namespace

NB_MODULE(_jaxcp_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jaxcp_attention_fwd"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_attention_fwd));
    d["jaxcp_attention_bwd"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_attention_bwd));
    d["jaxcp_attention_fwd_plan"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_attention_fwd_plan));
    d["jaxcp_attention_bwd_plan"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_attention_bwd_plan));
    d["jaxcp_small_seq_fwd"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_small_seq_fwd));
    d["jaxcp_small_seq_bwd"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_small_seq_bwd));
    return d;
  });
  // Whether the forward (fwd=True) or backward kernels run head dim d and value head dim dv with
  // this scale and deterministic flag on the current device (no other argument decides it);
  // jaxcp.attention pads any others to ones that they run.
  m.def("attention_head_dim_supported", [](bool fwd, int64_t d, int64_t dv, float scale, bool deterministic) {
    jaxcp::AttentionArgs a = args_of(1, 1, 1, 1, 1, d, false, -1, -1, 0, deterministic);
    a.shape.value_dim = dv;
    a.scale = scale;
    return fwd ? jaxcp::cuda::attention_fwd_head_dim_supported(a) : jaxcp::cuda::attention_bwd_head_dim_supported(a);
  });
  // {handler: (calls, calls while its stream was captured into a CUDA graph)}, counted in a
  // process started with JAXCP_COUNT_CAPTURES set (tests of command buffers).
  m.def("handler_call_counts", []() {
    using jaxcp::cuda::Handler;
    nb::dict d;
    const std::pair<const char*, Handler> handlers[] = {{"jaxcp_attention_fwd", Handler::kAttentionFwd},
                                                        {"jaxcp_attention_bwd", Handler::kAttentionBwd},
                                                        {"jaxcp_attention_fwd_plan", Handler::kAttentionFwdPlan},
                                                        {"jaxcp_attention_bwd_plan", Handler::kAttentionBwdPlan},
                                                        {"jaxcp_small_seq_fwd", Handler::kSmallSeqFwd},
                                                        {"jaxcp_small_seq_bwd", Handler::kSmallSeqBwd}};
    for (const auto& [name, h] : handlers) {
      const jaxcp::cuda::CallCounts c = jaxcp::cuda::call_counts(h);
      d[name] = nb::make_tuple(c.calls, c.captured);
    }
    return d;
  });
  // Sizes for the current device (the backward's workspace depends on its multiprocessor count).
  // The plans' sizes take the same arguments as the workspaces' (the forward's holds the pieces of
  // either forward kernel, so neither the value head dim nor the scale changes it).
  m.def("attention_fwd_plan_bytes",
        [](int64_t b, int64_t sq, int64_t skv, int64_t hq, int64_t hkv, int64_t d, bool causal,
           int64_t wl, int64_t wr, int64_t chunk) {
          return jaxcp::cuda::attention_fwd_plan_bytes(args_of(b, sq, skv, hq, hkv, d, causal, wl, wr, chunk, true));
        });
  m.def("attention_bwd_plan_bytes",
        [](int64_t b, int64_t sq, int64_t skv, int64_t hq, int64_t hkv, int64_t d, bool causal,
           int64_t wl, int64_t wr, int64_t chunk, bool deterministic) {
          return jaxcp::cuda::attention_bwd_plan_bytes(
              args_of(b, sq, skv, hq, hkv, d, causal, wl, wr, chunk, deterministic));
        });
  m.def("attention_fwd_workspace_bytes",
        [](int64_t b, int64_t sq, int64_t skv, int64_t hq, int64_t hkv, int64_t d, bool causal,
           int64_t wl, int64_t wr, int64_t chunk) {
          return jaxcp::cuda::attention_fwd_workspace_bytes(
              args_of(b, sq, skv, hq, hkv, d, causal, wl, wr, chunk, true));
        });
  m.def("attention_bwd_workspace_bytes",
        [](int64_t b, int64_t sq, int64_t skv, int64_t hq, int64_t hkv, int64_t d, bool causal,
           int64_t wl, int64_t wr, int64_t chunk, bool deterministic) {
          return jaxcp::cuda::attention_bwd_workspace_bytes(
              args_of(b, sq, skv, hq, hkv, d, causal, wl, wr, chunk, deterministic));
        });
}
