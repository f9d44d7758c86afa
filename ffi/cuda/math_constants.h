// Constants shared by the attention and small-sequence kernels (their softmaxes run on exp2).
#pragma once

namespace jaxcp::cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace jaxcp::cuda
