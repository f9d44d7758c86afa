// Host-side conversions between float32 and the 16-bit float formats (bit manipulation, so it
// builds with any C++17 compiler), and a dispatcher over the element types jaxcp accepts.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace jaxcp {

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(f16_t x) {
  const uint32_t h = x.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) { mant <<= 1; --exp; }
      u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> inline T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline bf16_t from_float<bf16_t>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16_t{static_cast<uint16_t>(u >> 16)};
}
template <> inline f16_t from_float<f16_t>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return f16_t{static_cast<uint16_t>(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0))};
  if (a >= 0x477ff000u) return f16_t{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow -> inf
  if (a < 0x38800000u) {  // subnormal or zero in half precision
    if (a < 0x33000000u) return f16_t{sign};
    const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(e);  // 113 - e + 13
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return f16_t{static_cast<uint16_t>(sign | r)};
  }
  uint32_t r = ((a - 0x38000000u) >> 13);
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return f16_t{static_cast<uint16_t>(sign | r)};
}

}  // namespace jaxcp
