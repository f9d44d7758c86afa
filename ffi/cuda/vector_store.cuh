// One 16-byte global store, written as PTX so that it stays one instruction.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace jaxcp::cuda {

// A uint4 assembled from separate 32-bit values (packed pairs, or an asm's outputs) and stored
// through a uint4 pointer compiled to four 4-byte stores (PTX st.global.u32 x 4): 4x the store
// instructions, each warp's spread over 32 separate 16-byte pieces. gmem: 16-byte aligned.
__forceinline__ __device__ void stg_128(void* gmem, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(gmem), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

}  // namespace jaxcp::cuda
