// Straightforward reference loops: online softmax per query row in float32. Work is
// parallelised over (batch, kv head) so that dK/dV of a group are owned by one thread.
#include "attention_cpu_kernels.h"

#include <cmath>
#include <limits>
#include <vector>

#include "../common/mask.h"
#include "parallel_for.h"

namespace jaxcp::cpu {
namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Element offsets of token rows and batch rows: q/dq and k/dk (head dim D), out/dout (o_*) and
// v/dv (v_*) (value head dim Dv).
struct Strides {
  int64_t q_row, q_batch, kv_row, kv_batch, o_row, o_batch, v_row, v_batch;
  explicit Strides(const AttentionShape& s)
      : q_row(s.q_heads * s.head_dim),
        q_batch(s.q_len * q_row),
        kv_row(s.kv_heads * s.head_dim),
        kv_batch(s.kv_len * kv_row),
        o_row(s.q_heads * s.v_dim()),
        o_batch(s.q_len * o_row),
        v_row(s.kv_heads * s.v_dim()),
        v_batch(s.kv_len * v_row) {}
};

}  // namespace

void attention_fwd(const AttentionArgs& a, const float* q, const float* k, const float* v,
                   const int32_t* q_seg, const int32_t* q_pos, const int32_t* kv_seg,
                   const int32_t* kv_pos, float* out, float* lse) {
  const AttentionShape& s = a.shape;
  const Strides st(s);
  const int64_t D = s.head_dim, Dv = s.v_dim(), G = s.group();
  parallel_for(s.batch * s.kv_heads, [&](int64_t task) {
    const int64_t b = task / s.kv_heads, hk = task % s.kv_heads;
    std::vector<float> acc(Dv);
    for (int64_t hq = hk * G; hq < (hk + 1) * G; ++hq) {
      for (int64_t i = 0; i < s.q_len; ++i) {
        const float* qi = q + b * st.q_batch + i * st.q_row + hq * D;
        const RowMask rm = make_row_mask(true, q_seg[b * s.q_len + i], q_pos[b * s.q_len + i], a.mask);
        float m = -std::numeric_limits<float>::infinity(), l = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < s.kv_len; ++j) {
          if (!allowed(rm, make_col_mask(true, kv_seg[b * s.kv_len + j], kv_pos[b * s.kv_len + j])))
            continue;
          const float* kj = k + b * st.kv_batch + j * st.kv_row + hk * D;
          const float* vj = v + b * st.v_batch + j * st.v_row + hk * Dv;
          const float sc = a.scale * dot(qi, kj, D);
          const float m_new = std::max(m, sc);
          const float corr = std::exp(m - m_new), p = std::exp(sc - m_new);
          l = l * corr + p;
          for (int64_t d = 0; d < Dv; ++d) acc[d] = acc[d] * corr + p * vj[d];
          m = m_new;
        }
        float* oi = out + b * st.o_batch + i * st.o_row + hq * Dv;
        const float inv = l > 0.f ? 1.f / l : 0.f;
        for (int64_t d = 0; d < Dv; ++d) oi[d] = acc[d] * inv;
        lse[(b * s.q_heads + hq) * s.q_len + i] =
            l > 0.f ? m + std::log(l) : -std::numeric_limits<float>::infinity();
      }
    }
  });
}

void attention_bwd(const AttentionArgs& a, const float* q, const float* k, const float* v,
                   const float* out, const float* lse, const float* dout, const float* dlse,
                   const int32_t* q_seg,
                   const int32_t* q_pos, const int32_t* kv_seg, const int32_t* kv_pos, float* dq,
                   float* dk, float* dv) {
  const AttentionShape& s = a.shape;
  const Strides st(s);
  const int64_t D = s.head_dim, Dv = s.v_dim(), G = s.group();
  parallel_for(s.batch * s.kv_heads, [&](int64_t task) {
    const int64_t b = task / s.kv_heads, hk = task % s.kv_heads;
    for (int64_t j = 0; j < s.kv_len; ++j) {
      std::fill_n(dk + b * st.kv_batch + j * st.kv_row + hk * D, D, 0.f);
      std::fill_n(dv + b * st.v_batch + j * st.v_row + hk * Dv, Dv, 0.f);
    }
    for (int64_t hq = hk * G; hq < (hk + 1) * G; ++hq) {
      for (int64_t i = 0; i < s.q_len; ++i) {
        const int64_t qoff = b * st.q_batch + i * st.q_row + hq * D;
        float* dqi = dq + qoff;
        std::fill_n(dqi, D, 0.f);
        const int64_t row = (b * s.q_heads + hq) * s.q_len + i;
        const float li = lse[row];
        if (!std::isfinite(li)) continue;  // no allowed key: zero gradients
        const int64_t ooff = b * st.o_batch + i * st.o_row + hq * Dv;
        const float *qi = q + qoff, *oi = out + ooff, *doi = dout + ooff;
        // d lse / d s_ij = p_ij, so the lse cotangent folds into delta.
        const float delta = dot(doi, oi, Dv) - dlse[row];
        const RowMask rm = make_row_mask(true, q_seg[b * s.q_len + i], q_pos[b * s.q_len + i], a.mask);
        for (int64_t j = 0; j < s.kv_len; ++j) {
          if (!allowed(rm, make_col_mask(true, kv_seg[b * s.kv_len + j], kv_pos[b * s.kv_len + j])))
            continue;
          const int64_t koff = b * st.kv_batch + j * st.kv_row + hk * D;
          const int64_t voff = b * st.v_batch + j * st.v_row + hk * Dv;
          const float p = std::exp(a.scale * dot(qi, k + koff, D) - li);
          const float ds = p * (dot(doi, v + voff, Dv) - delta);
          float *dkj = dk + koff, *dvj = dv + voff;
          for (int64_t d = 0; d < Dv; ++d) dvj[d] += p * doi[d];
          for (int64_t d = 0; d < D; ++d) {
            dqi[d] += a.scale * ds * k[koff + d];
            dkj[d] += a.scale * ds * qi[d];
          }
        }
      }
    }
  });
}

}  // namespace jaxcp::cpu
