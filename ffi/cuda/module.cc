// The CUDA extension module: exposes its FFI handlers as capsules for jax.ffi registration, what
// the attention kernels support and the buffer sizes they expect (asked at trace time), and the
// handlers' call counters (test instrumentation).
#include <nanobind/nanobind.h>

#include <utility>

#include "common/attention_shape.h"
#include "attention/launchers.h"
#include "call_counts.h"
#include "cuda_handlers.h"

namespace nb = nanobind;

namespace {

jaxcp::AttentionArgs args_of(int64_t b, int64_t sq, int64_t skv, int64_t hq, int64_t hkv, int64_t d, bool causal,
                             int64_t window_left, int64_t window_right, int64_t chunk, bool deterministic,
                             bool sm80_only, bool fwd_fixed_tiles) {
  jaxcp::AttentionArgs a;
  a.shape = {b, sq, skv, hq, hkv, d};
  a.mask.causal = causal;
  a.mask.window_left = window_left;
  a.mask.window_right = window_right;
  a.mask.chunk_size = chunk;
  a.deterministic = deterministic;
  a.kernel.sm80_only = sm80_only;
  a.kernel.fwd_fixed_tiles = fwd_fixed_tiles;
  return a;
}

}  // namespace

NB_MODULE(_jaxcp_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jaxcp_attention_fwd"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_attention_fwd));
    d["jaxcp_attention_bwd"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_attention_bwd));
    d["jaxcp_attention_bwd_begin"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_attention_bwd_begin));
    d["jaxcp_attention_bwd_end"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_attention_bwd_end));
    d["jaxcp_attention_fwd_plan"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_attention_fwd_plan));
    d["jaxcp_attention_bwd_plan"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_attention_bwd_plan));
    d["jaxcp_small_seq_fwd"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_small_seq_fwd));
    d["jaxcp_small_seq_bwd"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_small_seq_bwd));
    return d;
  });
  // Whether the forward (fwd=True) or backward kernels run head dim d and value head dim dv with
  // this scale, deterministic flag and kernel options on the current device (no other argument
  // decides it); jaxcp.attention pads any others to ones that they run.
  m.def(
      "attention_head_dim_supported",
      [](bool fwd, int64_t d, int64_t dv, float scale, bool deterministic, bool sm80_only, bool fwd_fixed_tiles) {
        jaxcp::AttentionArgs a = args_of(1, 1, 1, 1, 1, d, false, -1, -1, 0, deterministic, sm80_only, fwd_fixed_tiles);
        a.shape.value_dim = dv;
        a.scale = scale;
        return fwd ? jaxcp::cuda::attention_fwd_head_dim_supported(a) : jaxcp::cuda::attention_bwd_head_dim_supported(a);
      },
      nb::arg("fwd"), nb::arg("d"), nb::arg("dv"), nb::arg("scale"), nb::arg("deterministic"), nb::arg("sm80_only"),
      nb::arg("fwd_fixed_tiles"));
  // Test instrumentation (call_counts.h): set_call_counting(True) starts counting from zero;
  // handler_call_counts() gives {handler: (calls, calls while its stream was captured into a CUDA
  // graph)}.
  m.def("set_call_counting", &jaxcp::cuda::set_call_counting, nb::arg("on"));
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
  // Sizes for the current device (the backward's workspace depends on its multiprocessor count) and
  // the kernel options (which kernels run). The plans' sizes take the same arguments as the
  // workspaces' (the forward's holds the pieces of either forward kernel, so neither the value head
  // dim nor the scale changes it).
  m.def(
      "attention_fwd_plan_bytes",
      [](int64_t b, int64_t sq, int64_t skv, int64_t hq, int64_t hkv, int64_t d, bool causal, int64_t wl, int64_t wr,
         int64_t chunk, bool sm80_only, bool fwd_fixed_tiles) {
        return jaxcp::cuda::attention_fwd_plan_bytes(
            args_of(b, sq, skv, hq, hkv, d, causal, wl, wr, chunk, true, sm80_only, fwd_fixed_tiles));
      },
      nb::arg("b"), nb::arg("sq"), nb::arg("skv"), nb::arg("hq"), nb::arg("hkv"), nb::arg("d"), nb::arg("causal"),
      nb::arg("window_left"), nb::arg("window_right"), nb::arg("chunk_size"), nb::arg("sm80_only"),
      nb::arg("fwd_fixed_tiles"));
  m.def(
      "attention_bwd_plan_bytes",
      [](int64_t b, int64_t sq, int64_t skv, int64_t hq, int64_t hkv, int64_t d, bool causal, int64_t wl, int64_t wr,
         int64_t chunk, bool deterministic, bool sm80_only, bool fwd_fixed_tiles) {
        return jaxcp::cuda::attention_bwd_plan_bytes(
            args_of(b, sq, skv, hq, hkv, d, causal, wl, wr, chunk, deterministic, sm80_only, fwd_fixed_tiles));
      },
      nb::arg("b"), nb::arg("sq"), nb::arg("skv"), nb::arg("hq"), nb::arg("hkv"), nb::arg("d"), nb::arg("causal"),
      nb::arg("window_left"), nb::arg("window_right"), nb::arg("chunk_size"), nb::arg("deterministic"),
      nb::arg("sm80_only"), nb::arg("fwd_fixed_tiles"));
  m.def(
      "attention_fwd_workspace_bytes",
      [](int64_t b, int64_t sq, int64_t skv, int64_t hq, int64_t hkv, int64_t d, bool causal, int64_t wl, int64_t wr,
         int64_t chunk, bool sm80_only, bool fwd_fixed_tiles) {
        return jaxcp::cuda::attention_fwd_workspace_bytes(
            args_of(b, sq, skv, hq, hkv, d, causal, wl, wr, chunk, true, sm80_only, fwd_fixed_tiles));
      },
      nb::arg("b"), nb::arg("sq"), nb::arg("skv"), nb::arg("hq"), nb::arg("hkv"), nb::arg("d"), nb::arg("causal"),
      nb::arg("window_left"), nb::arg("window_right"), nb::arg("chunk_size"), nb::arg("sm80_only"),
      nb::arg("fwd_fixed_tiles"));
  // Whether the backward can run as two chained calls (launchers.h, BwdPhase) for these arguments.
  m.def(
      "attention_bwd_chains",
      [](int64_t b, int64_t sq, int64_t skv, int64_t hq, int64_t hkv, int64_t d, bool causal, int64_t wl, int64_t wr,
         int64_t chunk, bool deterministic, bool sm80_only, bool fwd_fixed_tiles) {
        return skv > 0 && jaxcp::cuda::attention_bwd_chains(
            args_of(b, sq, skv, hq, hkv, d, causal, wl, wr, chunk, deterministic, sm80_only, fwd_fixed_tiles));
      },
      nb::arg("b"), nb::arg("sq"), nb::arg("skv"), nb::arg("hq"), nb::arg("hkv"), nb::arg("d"), nb::arg("causal"),
      nb::arg("window_left"), nb::arg("window_right"), nb::arg("chunk_size"), nb::arg("deterministic"),
      nb::arg("sm80_only"), nb::arg("fwd_fixed_tiles"));
  m.def(
      "attention_bwd_workspace_bytes",
      [](int64_t b, int64_t sq, int64_t skv, int64_t hq, int64_t hkv, int64_t d, bool causal, int64_t wl, int64_t wr,
         int64_t chunk, bool deterministic, bool sm80_only, bool fwd_fixed_tiles) {
        return jaxcp::cuda::attention_bwd_workspace_bytes(
            args_of(b, sq, skv, hq, hkv, d, causal, wl, wr, chunk, deterministic, sm80_only, fwd_fixed_tiles));
      },
      nb::arg("b"), nb::arg("sq"), nb::arg("skv"), nb::arg("hq"), nb::arg("hkv"), nb::arg("d"), nb::arg("causal"),
      nb::arg("window_left"), nb::arg("window_right"), nb::arg("chunk_size"), nb::arg("deterministic"),
      nb::arg("sm80_only"), nb::arg("fwd_fixed_tiles"));
}
