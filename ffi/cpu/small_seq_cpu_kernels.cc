// CPU reference kernels for small-sequence attention (see small_seq_cpu_kernels.h).
#include "small_seq_cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "parallel_for.h"

namespace jaxcp::cpu {
namespace {

struct Range {
  int64_t start, len;
};

// The clamped token range of row b.
Range row_range(const SmallSeqShape& s, const int32_t* kv_start, const int32_t* kv_len,
                int64_t b) {
  // A missing (null) index array is its default: b * max_len, max_len, every token.
  const int64_t start = std::clamp<int64_t>(kv_start != nullptr ? kv_start[b] : b * s.max_len, 0, s.tokens);
  int64_t len = kv_len != nullptr ? std::clamp<int64_t>(kv_len[b], 0, s.max_len) : s.max_len;
  len = std::min(len, s.tokens - start);
  return {start, len};
}

inline bool allowed(const int32_t* kv_mask, int64_t b, int64_t j) {
  return kv_mask == nullptr || ((static_cast<uint32_t>(kv_mask[b]) >> j) & 1u) != 0;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

}  // namespace

void small_seq_fwd(const SmallSeqShape& s, const float* q, const float* k, const float* v,
                   const int32_t* kv_start, const int32_t* kv_len, const int32_t* kv_mask,
                   float* out, float* probs) {
  const int64_t D = s.head_dim, Hq = s.q_heads, Hkv = s.kv_heads, M = s.max_len;
  const int64_t G = Hq / Hkv;
  parallel_for(s.batch, [&](int64_t b) {
    const Range r = row_range(s, kv_start, kv_len, b);
    std::vector<float> sc(std::max<int64_t>(M, 1));
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / G;
      const float* qh = q + (b * Hq + h) * D;
      float* oh = out + (b * Hq + h) * D;
      float* ph = probs + (b * Hq + h) * M;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < M; ++j) {
        sc[j] = -std::numeric_limits<float>::infinity();
        if (j < r.len && allowed(kv_mask, b, j)) {
          sc[j] = s.scale * dot(qh, k + ((r.start + j) * Hkv + g) * D, D);
          m = std::max(m, sc[j]);
        }
      }
      float l = 0.f;
      for (int64_t j = 0; j < M; ++j) {
        sc[j] = std::isinf(sc[j]) && sc[j] < 0 ? 0.f : std::exp(sc[j] - m);
        l += sc[j];
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      std::fill(oh, oh + D, 0.f);
      for (int64_t j = 0; j < M; ++j) {
        ph[j] = sc[j] * inv;
        if (ph[j] == 0.f) continue;
        const float* vj = v + ((r.start + j) * Hkv + g) * D;
        for (int64_t d = 0; d < D; ++d) oh[d] += ph[j] * vj[d];
      }
    }
  });
}

void small_seq_bwd(const SmallSeqShape& s, const float* q, const float* k, const float* v,
                   const float* probs, const float* dout, const int32_t* kv_start,
                   const int32_t* kv_len, const int32_t* kv_mask, float* dq, float* dk,
                   float* dv) {
  const int64_t D = s.head_dim, Hq = s.q_heads, Hkv = s.kv_heads, M = s.max_len;
  const int64_t G = Hq / Hkv;
  // Every dk/dv row not covered by a sequence stays zero.
  std::fill(dk, dk + s.tokens * Hkv * D, 0.f);
  std::fill(dv, dv + s.tokens * Hkv * D, 0.f);
  parallel_for(s.batch, [&](int64_t b) {
    const Range r = row_range(s, kv_start, kv_len, b);
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / G;
      const float* qh = q + (b * Hq + h) * D;
      const float* doh = dout + (b * Hq + h) * D;
      const float* ph = probs + (b * Hq + h) * M;
      float* dqh = dq + (b * Hq + h) * D;
      std::fill(dqh, dqh + D, 0.f);
      float dp[16];  // max_len <= 16 is enforced by the handler
      float delta = 0.f;
      for (int64_t j = 0; j < r.len; ++j) {
        const bool ok = allowed(kv_mask, b, j);
        dp[j] = ok ? dot(doh, v + ((r.start + j) * Hkv + g) * D, D) : 0.f;
        if (ok) delta += ph[j] * dp[j];
      }
      for (int64_t j = 0; j < r.len; ++j) {
        if (!allowed(kv_mask, b, j)) continue;
        const float p = ph[j];
        const float ds = p * (dp[j] - delta);
        const int64_t off = ((r.start + j) * Hkv + g) * D;
        const float* kj = k + off;
        float* dkj = dk + off;
        float* dvj = dv + off;
        for (int64_t d = 0; d < D; ++d) {
          dqh[d] += s.scale * ds * kj[d];
          dkj[d] += s.scale * ds * qh[d];
          dvj[d] += p * doh[d];
        }
      }
    }
  });
}

}  // namespace jaxcp::cpu
