// The CPU extension module: exposes its FFI handlers as capsules for jax.ffi registration.
#include <nanobind/nanobind.h>

#include "cpu_handlers.h"

namespace nb = nanobind;

namespace {
template <typename F>
nb::capsule encapsulate(F* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_jaxcp_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jaxcp_attention_fwd"] = encapsulate(jaxcp_cpu_attention_fwd);
    d["jaxcp_attention_bwd"] = encapsulate(jaxcp_cpu_attention_bwd);
    d["jaxcp_small_seq_fwd"] = encapsulate(jaxcp_cpu_small_seq_fwd);
    d["jaxcp_small_seq_bwd"] = encapsulate(jaxcp_cpu_small_seq_bwd);
    return d;
  });
}
