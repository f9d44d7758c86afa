// The CUDA extension module: exposes its FFI handlers as capsules for jax.ffi registration.
#include <nanobind/nanobind.h>

#include "cuda_handlers.h"

namespace nb = nanobind;

NB_MODULE(_jaxcp_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jaxcp_attention_fwd"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_attention_fwd));
    d["jaxcp_attention_bwd"] = nb::capsule(reinterpret_cast<void*>(jaxcp_cuda_attention_bwd));
    return d;
  });
}
