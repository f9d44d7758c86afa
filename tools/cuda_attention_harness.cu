// Standalone GPU harness for the CUDA packed-document attention kernels.
//
//   attention_harness test      correctness against the float32 CPU reference (every mask form,
//                               D 64/128/256, bf16/f16, GQA 1/4/8, packed / permuted / cross rows)
//   attention_harness time      TFLOP/s (allowed pairs only: fwd 4*D*Hq*pairs, bwd 2.5x fwd)
//   attention_harness small     one tiny case (for compute-sanitizer)
//   attention_harness all       test + time
// Exits non-zero when a check fails.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/attention_shape.h"
#include "common/host_dtypes.h"
#include "common/mask.h"
#include "cpu/attention_cpu_kernels.h"
#include "cuda/attention/launchers.h"

using namespace jaxcp;
using jaxcp::cuda::DType;

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, \
                   __LINE__, cudaGetErrorString(e_));                                      \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

namespace {

// ------------------------------------------------------------------------------------------
// Device buffers and conversions
// ------------------------------------------------------------------------------------------
struct DevBuf {
  void* p = nullptr;
  size_t n = 0;
  DevBuf() = default;
  explicit DevBuf(size_t bytes) : n(bytes) {
    if (bytes) CK(cudaMalloc(&p, bytes));
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr; o.n = 0; }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  template <class T> T* as() const { return static_cast<T*>(p); }
};

uint16_t to_bits(float x, DType t) {
  return t == DType::kBF16 ? from_float<bf16_t>(x).bits : from_float<f16_t>(x).bits;
}
float from_bits(uint16_t b, DType t) {
  return t == DType::kBF16 ? to_float(bf16_t{b}) : to_float(f16_t{b});
}

// Rounds x in place to the dtype and returns the 16-bit copy.
std::vector<uint16_t> round_to(std::vector<float>& x, DType t) {
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    bits[i] = to_bits(x[i], t);
    x[i] = from_bits(bits[i], t);
  }
  return bits;
}

template <class T>
DevBuf upload(const std::vector<T>& v) {
  DevBuf d(v.size() * sizeof(T));
  if (!v.empty()) CK(cudaMemcpy(d.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
std::vector<float> download16(const DevBuf& d, size_t n, DType t) {
  std::vector<uint16_t> b(n);
  if (n) CK(cudaMemcpy(b.data(), d.p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = from_bits(b[i], t);
  return f;
}
std::vector<uint16_t> download_raw16(const DevBuf& d, size_t n) {
  std::vector<uint16_t> b(n);
  if (n) CK(cudaMemcpy(b.data(), d.p, n * 2, cudaMemcpyDeviceToHost));
  return b;
}
std::vector<float> download_f32(const DevBuf& d, size_t n) {
  std::vector<float> f(n);
  if (n) CK(cudaMemcpy(f.data(), d.p, n * 4, cudaMemcpyDeviceToHost));
  return f;
}

double rel_frob(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(got[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}
bool any_nan(const std::vector<float>& v) {
  for (float x : v)
    if (std::isnan(x)) return true;
  return false;
}

// ------------------------------------------------------------------------------------------
// Token layouts
// ------------------------------------------------------------------------------------------
struct Tokens {
  std::vector<int32_t> q_seg, q_pos, kv_seg, kv_pos;  // [B, Sq], [B, Skv]
};

enum class LayoutKind { kPacked, kPackedNoPad, kPermuted, kCross, kOneDoc, kAllPadRow };
const char* layout_name(LayoutKind k) {
  switch (k) {
    case LayoutKind::kPacked: return "packed";
    case LayoutKind::kPackedNoPad: return "packed-nopad";
    case LayoutKind::kPermuted: return "permuted";
    case LayoutKind::kCross: return "cross";
    case LayoutKind::kOneDoc: return "onedoc";
    case LayoutKind::kAllPadRow: return "padrow";
  }
  return "?";
}

// Random document lengths: ~20% length 1, ~30% short, rest up to 2*mean.
int doc_len(std::mt19937& rng, int mean) {
  const int r = rng() % 10;
  if (r < 2) return 1;
  if (r < 5) return 2 + rng() % 15;
  return 17 + rng() % std::max(1, 2 * mean - 17);
}

// Self-attention row: documents with shuffled (non-sorted) ids, positions restart per doc,
// padding tail (seg 0).
void packed_row(std::mt19937& rng, int S, int mean, bool pad, int32_t* seg, int32_t* pos) {
  const int n_pad = pad ? static_cast<int>(rng() % (S / 6 + 2)) : 0;
  const int body = std::max(0, S - n_pad);
  std::vector<std::pair<int, int>> docs;  // (start, len)
  for (int i = 0; i < body;) {
    const int L = std::min(doc_len(rng, mean), body - i);
    docs.push_back({i, L});
    i += L;
  }
  std::vector<int32_t> ids(docs.size());
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (size_t d = 0; d < docs.size(); ++d)
    for (int t = 0; t < docs[d].second; ++t) {
      seg[docs[d].first + t] = ids[d] * 7 + 3;  // arbitrary, non-contiguous ids
      pos[docs[d].first + t] = t;
    }
  for (int i = body; i < S; ++i) {
    seg[i] = 0;
    pos[i] = i - body;
  }
}

Tokens make_tokens(LayoutKind kind, int B, int Sq, int Skv, int mean, std::mt19937& rng) {
  Tokens t;
  t.q_seg.assign(size_t(B) * Sq, 0);
  t.q_pos.assign(size_t(B) * Sq, 0);
  t.kv_seg.assign(size_t(B) * Skv, 0);
  t.kv_pos.assign(size_t(B) * Skv, 0);
  for (int b = 0; b < B; ++b) {
    int32_t* qs = &t.q_seg[size_t(b) * Sq];
    int32_t* qp = &t.q_pos[size_t(b) * Sq];
    int32_t* ks = &t.kv_seg[size_t(b) * Skv];
    int32_t* kp = &t.kv_pos[size_t(b) * Skv];
    switch (kind) {
      case LayoutKind::kPacked:
      case LayoutKind::kPackedNoPad:
      case LayoutKind::kPermuted:
      case LayoutKind::kAllPadRow: {
        packed_row(rng, Sq, mean, kind != LayoutKind::kPackedNoPad, qs, qp);
        if (kind == LayoutKind::kAllPadRow && b == B - 1)
          for (int i = 0; i < Sq; ++i) qs[i] = 0;
        if (kind == LayoutKind::kPermuted) {
          std::vector<int> perm(Sq);
          std::iota(perm.begin(), perm.end(), 0);
          std::shuffle(perm.begin(), perm.end(), rng);
          std::vector<int32_t> s2(Sq), p2(Sq);
          for (int i = 0; i < Sq; ++i) {
            s2[i] = qs[perm[i]];
            p2[i] = qp[perm[i]];
          }
          std::copy(s2.begin(), s2.end(), qs);
          std::copy(p2.begin(), p2.end(), qp);
        }
        std::copy(qs, qs + Sq, ks);
        std::copy(qp, qp + Sq, kp);
        break;
      }
      case LayoutKind::kOneDoc: {  // one document, bottom-right aligned positions
        for (int i = 0; i < Sq; ++i) { qs[i] = 1; qp[i] = i + (Skv - Sq); }
        for (int j = 0; j < Skv; ++j) { ks[j] = 1; kp[j] = j; }
        break;
      }
      case LayoutKind::kCross: {
        // Same document ids on both sides with different lengths; q positions bottom-right
        // aligned (may be negative: such rows have no key under causal). One q-only document.
        int iq = 0, ik = 0, id = 5;
        while (iq < Sq && ik < Skv) {
          const int Lq = std::min(doc_len(rng, mean / 2 + 1), Sq - iq);
          const int Lk = std::min(doc_len(rng, mean), Skv - ik);
          const bool q_only = (id % 11) == 0;
          for (int i = 0; i < Lq; ++i) { qs[iq + i] = id; qp[iq + i] = i + (Lk - Lq); }
          for (int j = 0; j < Lk; ++j) { ks[ik + j] = q_only ? id + 1000000 : id; kp[ik + j] = j; }
          iq += Lq;
          ik += Lk;
          id += 1 + rng() % 3;
        }
        for (; iq < Sq; ++iq) { qs[iq] = 0; qp[iq] = 0; }
        for (; ik < Skv; ++ik) { ks[ik] = 0; kp[ik] = 0; }
        break;
      }
    }
  }
  return t;
}

// ------------------------------------------------------------------------------------------
// Correctness cases
// ------------------------------------------------------------------------------------------
struct MaskCase {
  const char* name;
  MaskParams m;
};
MaskParams mk(bool causal, int64_t wl, int64_t wr, int64_t chunk) {
  MaskParams m;
  m.causal = causal;
  m.window_left = wl;
  m.window_right = wr;
  m.chunk_size = chunk;
  return m;
}

struct TestCase {
  std::string mask_name;
  MaskParams mask;
  LayoutKind layout;
  int B, Sq, Skv, Hq, Hkv, D, mean_doc;
  DType dtype;
  float scale;
  uint32_t seed;
};

struct Errors {
  double out = 0, lse = 0, dq = 0, dk = 0, dv = 0, dq_d = 0, dk_d = 0, dv_d = 0;
  bool det_bitwise = true, empty_ok = true, nan_free = true, ran = true;
  int64_t empty_rows = 0;
};

struct GpuOut {
  std::vector<float> out, lse, dq, dk, dv;
  std::vector<uint16_t> dq_raw, dk_raw, dv_raw;
};

void run_gpu(const TestCase& c, const AttentionArgs& a, const DevBuf& q, const DevBuf& k,
             const DevBuf& v, const DevBuf& dout, const DevBuf& dlse, const DevBuf& qs, const DevBuf& qp,
             const DevBuf& ks, const DevBuf& kp, bool deterministic, GpuOut* r,
             const std::vector<float>* out_for_bwd, const std::vector<float>* lse_for_bwd) {
  const AttentionShape& s = a.shape;
  const size_t nq = size_t(s.batch) * s.q_len * s.q_heads * s.head_dim;
  const size_t nkv = size_t(s.batch) * s.kv_len * s.kv_heads * s.head_dim;
  const size_t nl = size_t(s.batch) * s.q_heads * s.q_len;
  DevBuf out(nq * 2), lse(nl * 4);
  AttentionArgs af = a;
  {
    const size_t wb = cuda::attention_fwd_workspace_bytes(af), pb = cuda::attention_fwd_plan_bytes(af);
    DevBuf ws(wb), plan(pb);
    CK(cudaMemset(out.p, 0xff, out.n));  // poison: the kernel must write everything
    CK(cudaMemset(lse.p, 0xff, lse.n));
    CK(cudaMemset(plan.p, 0xff, plan.n));  // plan content on entry must not matter
    CK(cuda::attention_fwd_plan(af, qs.as<int32_t>(), qp.as<int32_t>(), ks.as<int32_t>(), kp.as<int32_t>(), plan.p,
                                pb, 0));
    CK(cuda::attention_fwd(af, c.dtype, q.p, k.p, v.p, qs.as<int32_t>(), qp.as<int32_t>(),
                           ks.as<int32_t>(), kp.as<int32_t>(), plan.p, pb, out.p, lse.as<float>(), ws.p, wb, 0));
    CK(cudaDeviceSynchronize());
    r->out = download16(out, nq, c.dtype);
    r->lse = download_f32(lse, nl);
  }
  // Backward on the given (out, lse) when provided (so that CPU and GPU see the same inputs).
  if (out_for_bwd) {
    std::vector<uint16_t> ob(nq);
    for (size_t i = 0; i < nq; ++i) ob[i] = to_bits((*out_for_bwd)[i], c.dtype);
    CK(cudaMemcpy(out.p, ob.data(), nq * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(lse.p, lse_for_bwd->data(), nl * 4, cudaMemcpyHostToDevice));
  }
  AttentionArgs ab = a;
  ab.deterministic = deterministic;
  const size_t wb = cuda::attention_bwd_workspace_bytes(ab), pb = cuda::attention_bwd_plan_bytes(ab);
  DevBuf ws(wb), plan(pb), dq(nq * 2), dk(nkv * 2), dv(nkv * 2);
  CK(cudaMemset(dq.p, 0xff, dq.n));
  CK(cudaMemset(dk.p, 0xff, dk.n));
  CK(cudaMemset(dv.p, 0xff, dv.n));
  CK(cudaMemset(ws.p, 0xff, ws.n));  // workspace content on entry must not matter
  CK(cudaMemset(plan.p, 0xff, plan.n));
  CK(cuda::attention_bwd_plan(ab, qs.as<int32_t>(), qp.as<int32_t>(), ks.as<int32_t>(), kp.as<int32_t>(), plan.p,
                              pb, 0));
  CK(cuda::attention_bwd(ab, c.dtype, q.p, k.p, v.p, out.p, lse.as<float>(), dout.p,
                         dlse.as<float>(), qs.as<int32_t>(), qp.as<int32_t>(), ks.as<int32_t>(), kp.as<int32_t>(),
                         plan.p, pb, dq.p, dk.p, dv.p, ws.p, wb, 0));
  CK(cudaDeviceSynchronize());
  r->dq = download16(dq, nq, c.dtype);
  r->dk = download16(dk, nkv, c.dtype);
  r->dv = download16(dv, nkv, c.dtype);
  r->dq_raw = download_raw16(dq, nq);
  r->dk_raw = download_raw16(dk, nkv);
  r->dv_raw = download_raw16(dv, nkv);
}

Errors run_case(const TestCase& c) {
  std::mt19937 rng(c.seed);
  AttentionArgs a;
  a.shape = AttentionShape{c.B, c.Sq, c.Skv, c.Hq, c.Hkv, c.D};
  a.mask = c.mask;
  a.scale = c.scale;
  const AttentionShape& s = a.shape;
  const size_t nq = size_t(c.B) * c.Sq * c.Hq * c.D, nkv = size_t(c.B) * c.Skv * c.Hkv * c.D;
  const size_t nl = size_t(c.B) * c.Hq * c.Sq;
  Tokens t = make_tokens(c.layout, c.B, c.Sq, c.Skv, c.mean_doc, rng);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(nq), k(nkv), v(nkv), dout(nq);
  for (auto* vec : {&q, &k, &v, &dout})
    for (auto& x : *vec) x = nd(rng);
  auto qb = round_to(q, c.dtype), kb = round_to(k, c.dtype), vb = round_to(v, c.dtype),
       db = round_to(dout, c.dtype);
  // Cotangent of lse: nonzero in every other case.
  std::vector<float> dlse(nl, 0.f);
  if (c.seed % 2)
    for (auto& x : dlse) x = 0.5f * nd(rng);
  DevBuf ddl(upload(dlse));
  DevBuf dq_(upload(qb)), dk_(upload(kb)), dv_(upload(vb)), ddo(upload(db));
  DevBuf qs(upload(t.q_seg)), qp(upload(t.q_pos)), ks(upload(t.kv_seg)), kp(upload(t.kv_pos));

  // Reference forward.
  std::vector<float> ref_out(nq), ref_lse(nl);
  cpu::attention_fwd(a, q.data(), k.data(), v.data(), t.q_seg.data(), t.q_pos.data(),
                     t.kv_seg.data(), t.kv_pos.data(), ref_out.data(), ref_lse.data());

  Errors e;
  GpuOut g1, g2, g3;
  run_gpu(c, a, dq_, dk_, dv_, ddo, ddl, qs, qp, ks, kp, /*deterministic=*/false, &g1, nullptr, nullptr);
  e.out = rel_frob(g1.out, ref_out);
  {
    std::vector<float> a1, b1;
    for (size_t i = 0; i < nl; ++i) {
      const bool rf = std::isfinite(ref_lse[i]), gf = std::isfinite(g1.lse[i]);
      if (rf != gf || (!rf && !(g1.lse[i] < 0))) e.empty_ok = false;
      if (rf && gf) { a1.push_back(g1.lse[i]); b1.push_back(ref_lse[i]); }
    }
    e.lse = rel_frob(a1, b1);
  }
  // Reference backward on the GPU's (out, lse).
  std::vector<float> rdq(nq), rdk(nkv), rdv(nkv);
  cpu::attention_bwd(a, q.data(), k.data(), v.data(), g1.out.data(), g1.lse.data(), dout.data(),
                     dlse.data(), t.q_seg.data(), t.q_pos.data(), t.kv_seg.data(), t.kv_pos.data(), rdq.data(),
                     rdk.data(), rdv.data());
  // Recompute the non-deterministic backward against the same (out, lse) uploaded explicitly
  // (g1's backward used the device out/lse, identical values).
  e.dq = rel_frob(g1.dq, rdq);
  e.dk = rel_frob(g1.dk, rdk);
  e.dv = rel_frob(g1.dv, rdv);
  run_gpu(c, a, dq_, dk_, dv_, ddo, ddl, qs, qp, ks, kp, /*deterministic=*/true, &g2, &g1.out, &g1.lse);
  run_gpu(c, a, dq_, dk_, dv_, ddo, ddl, qs, qp, ks, kp, /*deterministic=*/true, &g3, &g1.out, &g1.lse);
  e.dq_d = rel_frob(g2.dq, rdq);
  e.dk_d = rel_frob(g2.dk, rdk);
  e.dv_d = rel_frob(g2.dv, rdv);
  e.det_bitwise = g2.dq_raw == g3.dq_raw && g2.dk_raw == g3.dk_raw && g2.dv_raw == g3.dv_raw;
  for (auto* vec : {&g1.out, &g1.dq, &g1.dk, &g1.dv, &g2.dq, &g2.dk, &g2.dv})
    if (any_nan(*vec)) e.nan_free = false;
  for (size_t i = 0; i < nl; ++i)
    if (std::isnan(g1.lse[i])) e.nan_free = false;

  // Rows with no allowed key: out 0, lse -inf, dq 0 (both modes) exactly. Key rows with no
  // allowed query: dk = dv = 0 exactly.
  for (int b = 0; b < c.B; ++b) {
    std::vector<char> kv_used(c.Skv, 0);
    for (int i = 0; i < c.Sq; ++i) {
      bool any = false;
      const int32_t qsg = t.q_seg[size_t(b) * c.Sq + i], qps = t.q_pos[size_t(b) * c.Sq + i];
      for (int j = 0; j < c.Skv; ++j)
        if (allowed(make_row_mask(true, qsg, qps, c.mask),
                    make_col_mask(true, t.kv_seg[size_t(b) * c.Skv + j], t.kv_pos[size_t(b) * c.Skv + j]))) {
          any = true;
          kv_used[j] = 1;
        }
      if (any) continue;
      ++e.empty_rows;
      for (int h = 0; h < c.Hq; ++h) {
        const size_t li = (size_t(b) * c.Hq + h) * c.Sq + i;
        if (!(std::isinf(g1.lse[li]) && g1.lse[li] < 0)) e.empty_ok = false;
        const size_t o = ((size_t(b) * c.Sq + i) * c.Hq + h) * c.D;
        for (int d = 0; d < c.D; ++d)
          if (g1.out[o + d] != 0.f || g1.dq[o + d] != 0.f || g2.dq[o + d] != 0.f) e.empty_ok = false;
      }
    }
    for (int j = 0; j < c.Skv; ++j) {
      if (kv_used[j]) continue;
      for (int h = 0; h < c.Hkv; ++h) {
        const size_t o = ((size_t(b) * c.Skv + j) * c.Hkv + h) * c.D;
        for (int d = 0; d < c.D; ++d)
          if (g1.dk[o + d] != 0.f || g1.dv[o + d] != 0.f || g2.dk[o + d] != 0.f || g2.dv[o + d] != 0.f)
            e.empty_ok = false;
      }
    }
  }
  (void)s;
  return e;
}

int run_tests(bool quick) {
  const MaskCase masks[] = {
      {"none", mk(false, -1, -1, 0)},        {"causal", mk(true, -1, -1, 0)},
      {"window(37,5)", mk(false, 37, 5, 0)}, {"chunk48", mk(false, -1, -1, 48)},
      {"causal+win50", mk(true, 50, -1, 0)}, {"causal+chunk40", mk(true, -1, -1, 40)},
  };
  const int dims[] = {64, 128, 256};
  const DType dtypes[] = {DType::kBF16, DType::kF16};
  const int ratios[] = {1, 4, 8};
  const LayoutKind layouts[] = {LayoutKind::kPacked, LayoutKind::kPermuted, LayoutKind::kCross,
                                LayoutKind::kPackedNoPad};
  std::vector<TestCase> cases;
  std::mt19937 rng(1234);
  int idx = 0;
  for (const auto& m : masks)
    for (int D : dims)
      for (DType dt : dtypes) {
        TestCase c;
        c.mask_name = m.name;
        c.mask = m.m;
        c.layout = layouts[idx % 4];
        c.D = D;
        c.dtype = dt;
        const int ratio = ratios[(idx / 2) % 3];
        c.Hq = 8;
        c.Hkv = 8 / ratio;
        c.B = 2;
        if (c.layout == LayoutKind::kCross) {
          c.Sq = 150 + rng() % 250;
          c.Skv = 300 + rng() % 300;
        } else {
          c.Sq = c.Skv = 200 + rng() % 450;
        }
        c.mean_doc = 40 + rng() % 200;
        c.scale = 1.f / std::sqrt(float(D));
        c.seed = 1000 + idx;
        cases.push_back(c);
        ++idx;
      }
  // Special cases.
  auto add = [&](const char* mname, MaskParams m, LayoutKind l, int B, int Sq, int Skv, int Hq,
                 int Hkv, int D, DType dt, int mean) {
    TestCase c;
    c.mask_name = mname;
    c.mask = m;
    c.layout = l;
    c.B = B; c.Sq = Sq; c.Skv = Skv; c.Hq = Hq; c.Hkv = Hkv; c.D = D; c.dtype = dt;
    c.mean_doc = mean;
    c.scale = 1.f / std::sqrt(float(D));
    c.seed = 5000 + static_cast<uint32_t>(cases.size());
    cases.push_back(c);
  };
  add("causal", mk(true, -1, -1, 0), LayoutKind::kOneDoc, 1, 37, 37, 4, 1, 128, DType::kBF16, 10);
  add("causal", mk(true, -1, -1, 0), LayoutKind::kOneDoc, 2, 200, 777, 4, 2, 64, DType::kF16, 10);
  add("none", mk(false, -1, -1, 0), LayoutKind::kOneDoc, 1, 5, 300, 8, 8, 128, DType::kBF16, 10);
  add("causal", mk(true, -1, -1, 0), LayoutKind::kAllPadRow, 3, 300, 300, 4, 4, 128, DType::kBF16, 60);
  add("causal+win2^40", mk(true, int64_t(1) << 40, int64_t(1) << 40, 0), LayoutKind::kPacked, 2, 333,
      333, 4, 2, 128, DType::kBF16, 100);
  add("window(0,0)", mk(false, 0, 0, 0), LayoutKind::kPacked, 2, 260, 260, 4, 4, 64, DType::kBF16, 50);
  add("causal", mk(true, -1, -1, 0), LayoutKind::kPacked, 1, 1100, 1100, 16, 2, 128, DType::kBF16, 400);
  add("causal+chunk64", mk(true, -1, -1, 64), LayoutKind::kCross, 2, 129, 513, 8, 1, 256, DType::kF16, 90);
  add("none", mk(false, -1, -1, 0), LayoutKind::kOneDoc, 1, 640, 640, 2, 2, 128, DType::kBF16, 10);
  if (quick) cases.resize(4);

  std::printf("\n%-16s %-12s %-5s %9s %4s %3s %5s | %8s %8s | %8s %8s %8s | %8s %8s %8s | %s\n", "mask",
              "layout", "dtype", "B,Sq,Skv", "Hq", "Hkv", "D", "out", "lse", "dq", "dk", "dv",
              "dq(det)", "dk(det)", "dv(det)", "checks");
  int failures = 0;
  double worst[2] = {0, 0};
  for (const auto& c : cases) {
    const auto t0 = std::chrono::steady_clock::now();
    const Errors e = run_case(c);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tol = c.dtype == DType::kBF16 ? 1.5e-2 : 4e-3;
    const double errs[] = {e.out, e.dq, e.dk, e.dv, e.dq_d, e.dk_d, e.dv_d};
    bool ok = e.det_bitwise && e.empty_ok && e.nan_free && e.lse < 1e-3;
    for (double x : errs) {
      ok = ok && x < tol;
      worst[c.dtype == DType::kBF16 ? 0 : 1] = std::max(worst[c.dtype == DType::kBF16 ? 0 : 1], x);
    }
    if (!ok) ++failures;
    char dims[64];
    std::snprintf(dims, sizeof dims, "%d,%d,%d", c.B, c.Sq, c.Skv);
    std::printf("%-16s %-12s %-5s %9s %4d %3d %5d | %8.2e %8.2e | %8.2e %8.2e %8.2e | %8.2e %8.2e %8.2e | %s%s%s%s empty=%lld %.1fs %s\n",
                c.mask_name.c_str(), layout_name(c.layout), c.dtype == DType::kBF16 ? "bf16" : "f16",
                dims, c.Hq, c.Hkv, c.D, e.out, e.lse, e.dq, e.dk, e.dv, e.dq_d, e.dk_d, e.dv_d,
                e.det_bitwise ? "" : "[DET-MISMATCH]", e.empty_ok ? "" : "[EMPTY-ROWS]",
                e.nan_free ? "" : "[NAN]", "", static_cast<long long>(e.empty_rows), secs,
                ok ? "PASS" : "FAIL");
    std::fflush(stdout);
  }
  std::printf("\n%zu cases, %d failed; worst rel. Frobenius error: bf16 %.2e, f16 %.2e\n", cases.size(),
              failures, worst[0], worst[1]);
  return failures;
}

// ------------------------------------------------------------------------------------------
// Timing
// ------------------------------------------------------------------------------------------
__global__ void fill_random(uint16_t* x, size_t n, uint32_t seed, int is_bf16) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ (seed * 0x9e3779b9u) ^ uint32_t(i >> 32);
    h ^= h >> 15; h *= 0x2c1b3c6du; h ^= h >> 12; h *= 0x297a2d39u; h ^= h >> 15;
    const float u = (h & 0xffffff) * (1.f / 16777216.f) * 2.f - 1.f;  // [-1, 1)
    const float f = u * 1.7f;
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if (is_bf16) {
      x[i] = uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    } else {
      x[i] = __half_as_ushort(__float2half_rn(f));
    }
  }
}

__global__ void count_diff(const uint16_t* a, const uint16_t* b, size_t n, unsigned long long* out) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    c += a[i] != b[i];
  atomicAdd(out, c);
}

__global__ void count_nan16(const uint16_t* a, size_t n, int is_bf16, unsigned long long* out) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint16_t v = a[i];
    c += is_bf16 ? ((v & 0x7f80) == 0x7f80 && (v & 0x7f)) : ((v & 0x7c00) == 0x7c00 && (v & 0x3ff));
  }
  atomicAdd(out, c);
}

unsigned long long device_count(const DevBuf& a, const DevBuf* b, size_t n, bool is_bf16) {
  DevBuf cnt(8);
  CK(cudaMemset(cnt.p, 0, 8));
  if (b)
    count_diff<<<1024, 256>>>(a.as<uint16_t>(), b->as<uint16_t>(), n, cnt.as<unsigned long long>());
  else
    count_nan16<<<1024, 256>>>(a.as<uint16_t>(), n, is_bf16, cnt.as<unsigned long long>());
  CK(cudaGetLastError());
  unsigned long long h = 0;
  CK(cudaMemcpy(&h, cnt.p, 8, cudaMemcpyDeviceToHost));
  return h;
}

// Contiguous documents with exponential lengths (mean `mean`), positions restart, no padding.
// Returns the number of allowed (q, kv) pairs per batch row summed over rows.
double packed_contiguous(std::mt19937_64& rng, int B, int64_t S, int mean, const MaskParams& m,
                         std::vector<int32_t>* seg, std::vector<int32_t>* pos) {
  seg->assign(size_t(B) * S, 0);
  pos->assign(size_t(B) * S, 0);
  std::exponential_distribution<double> ex(1.0 / mean);
  double pairs = 0;
  for (int b = 0; b < B; ++b) {
    int64_t i = 0;
    int32_t id = 1;
    while (i < S) {
      int64_t L = std::max<int64_t>(1, int64_t(std::llround(ex(rng))));
      L = std::min(L, S - i);
      for (int64_t t = 0; t < L; ++t) {
        (*seg)[size_t(b) * S + i + t] = id;
        (*pos)[size_t(b) * S + i + t] = int32_t(t);
        // allowed keys of this row: positions in [lo, hi] within the document (and chunk)
        int64_t lo = 0, hi = L - 1;
        if (m.causal) hi = std::min(hi, t);
        if (m.window_left >= 0) lo = std::max(lo, t - m.window_left);
        if (m.window_right >= 0) hi = std::min(hi, t + m.window_right);
        if (m.chunk_size > 0) {
          const int64_t c0 = (t / m.chunk_size) * m.chunk_size;
          lo = std::max(lo, c0);
          hi = std::min(hi, c0 + m.chunk_size - 1);
        }
        pairs += double(std::max<int64_t>(0, hi - lo + 1));
      }
      i += L;
      ++id;
    }
  }
  return pairs;
}

struct TimeCase {
  const char* name;
  int B;
  int64_t S;
  int Hq, Hkv, D, mean_doc;
  MaskParams mask;
  int iters;
};

bool time_case(const TimeCase& tc) {
  const DType dt = DType::kBF16;
  AttentionArgs a;
  a.shape = AttentionShape{tc.B, tc.S, tc.S, tc.Hq, tc.Hkv, tc.D};
  a.mask = tc.mask;
  a.scale = 1.f / std::sqrt(float(tc.D));
  std::mt19937_64 rng(42);
  std::vector<int32_t> seg, pos;
  const double pairs = packed_contiguous(rng, tc.B, tc.S, tc.mean_doc, tc.mask, &seg, &pos);
  const size_t nq = size_t(tc.B) * tc.S * tc.Hq * tc.D, nkv = size_t(tc.B) * tc.S * tc.Hkv * tc.D;
  const size_t nl = size_t(tc.B) * tc.Hq * tc.S;
  DevBuf q(nq * 2), k(nkv * 2), v(nkv * 2), dout(nq * 2), out(nq * 2), lse(nl * 4);
  DevBuf dq(nq * 2), dk(nkv * 2), dv(nkv * 2), dq2(nq * 2), dk2(nkv * 2), dv2(nkv * 2);
  DevBuf sg(upload(seg)), ps(upload(pos));
  fill_random<<<4096, 256>>>(q.as<uint16_t>(), nq, 1, 1);
  fill_random<<<4096, 256>>>(k.as<uint16_t>(), nkv, 2, 1);
  fill_random<<<4096, 256>>>(v.as<uint16_t>(), nkv, 3, 1);
  fill_random<<<4096, 256>>>(dout.as<uint16_t>(), nq, 4, 1);
  CK(cudaGetLastError());
  AttentionArgs ad = a;
  ad.deterministic = true;
  const size_t wf = cuda::attention_fwd_workspace_bytes(a), wb = cuda::attention_bwd_workspace_bytes(a),
               wd = cuda::attention_bwd_workspace_bytes(ad);
  const size_t pf = cuda::attention_fwd_plan_bytes(a), pb = cuda::attention_bwd_plan_bytes(a),
               pd = cuda::attention_bwd_plan_bytes(ad);
  DevBuf ws(std::max(wf, std::max(wb, wd))), plan(std::max(pf, std::max(pb, pd)));
  const int32_t* S_ = sg.as<int32_t>();
  const int32_t* P_ = ps.as<int32_t>();
  // Timed with their plans, as one attention call of a model runs them.
  auto fwd = [&]() {
    cudaError_t e = cuda::attention_fwd_plan(a, S_, P_, S_, P_, plan.p, plan.n, 0);
    if (e != cudaSuccess) return e;
    return cuda::attention_fwd(a, dt, q.p, k.p, v.p, S_, P_, S_, P_, plan.p, plan.n, out.p, lse.as<float>(), ws.p,
                               ws.n, 0);
  };
  auto bwd = [&](const AttentionArgs& aa, DevBuf& gq, DevBuf& gk, DevBuf& gv) {
    cudaError_t e = cuda::attention_bwd_plan(aa, S_, P_, S_, P_, plan.p, plan.n, 0);
    if (e != cudaSuccess) return e;
    return cuda::attention_bwd(aa, dt, q.p, k.p, v.p, out.p, lse.as<float>(), dout.p, nullptr, S_, P_, S_, P_,
                               plan.p, plan.n, gq.p, gk.p, gv.p, ws.p, ws.n, 0);
  };
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto timeit = [&](auto&& fn) {
    CK(fn());  // warm-up
    CK(cudaDeviceSynchronize());
    CK(cudaEventRecord(e0));
    for (int i = 0; i < tc.iters; ++i) CK(fn());
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms / tc.iters;
  };
  const double fwd_flops = 4.0 * tc.D * tc.Hq * pairs;
  const float t_fwd = timeit(fwd);
  const float t_bwd = timeit([&] { return bwd(a, dq, dk, dv); });
  const float t_det = timeit([&] { return bwd(ad, dq2, dk2, dv2); });
  // determinism and sanity on the real sizes
  CK(bwd(ad, dq, dk, dv));
  CK(cudaDeviceSynchronize());
  const unsigned long long diff = device_count(dq, &dq2, nq, true) + device_count(dk, &dk2, nkv, true) +
                                  device_count(dv, &dv2, nkv, true);
  const unsigned long long nans = device_count(out, nullptr, nq, true) + device_count(dq, nullptr, nq, true) +
                                  device_count(dk, nullptr, nkv, true) + device_count(dv, nullptr, nkv, true);
  std::printf("%-34s pairs %.3e (%.1f%% of S^2) | fwd %8.3f ms %6.1f TFLOP/s | bwd %8.3f ms %6.1f TFLOP/s | "
              "bwd(det) %8.3f ms %6.1f TFLOP/s | fwd+bwd %6.1f TFLOP/s | det-diff %llu nan %llu | ws fwd %.1f MB bwd %.1f MB\n",
              tc.name, pairs, 100.0 * pairs / (double(tc.B) * tc.S * tc.S), t_fwd,
              fwd_flops / t_fwd * 1e-9, t_bwd, 2.5 * fwd_flops / t_bwd * 1e-9, t_det,
              2.5 * fwd_flops / t_det * 1e-9, 3.5 * fwd_flops / (t_fwd + t_bwd) * 1e-9, diff, nans,
              wf / 1e6, wb / 1e6);
  std::fflush(stdout);
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return diff == 0 && nans == 0;
}

int run_timing(bool with_long) {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("\nTiming on %s (%d SMs), bf16, TFLOP/s over allowed pairs (fwd 4*D*Hq*pairs, bwd 2.5x)\n",
              prop.name, prop.multiProcessorCount);
  const MaskParams causal = mk(true, -1, -1, 0), none = mk(false, -1, -1, 0);
  std::vector<TimeCase> cases = {
      {"B2 S8k H16 D128 causal doc1.6k", 2, 8192, 16, 16, 128, 1600, causal, 20},
      {"B2 S8k H16 D128 full doc1.6k", 2, 8192, 16, 16, 128, 1600, none, 20},
      {"B2 S8k H16/2 D128 causal doc1.6k", 2, 8192, 16, 2, 128, 1600, causal, 20},
      {"B2 S8k H16 D64 causal doc1.6k", 2, 8192, 16, 16, 64, 1600, causal, 20},
      {"B2 S8k H16 D256 causal doc1.6k", 2, 8192, 16, 16, 256, 1600, causal, 10},
      {"B1 S8k H16 D128 causal 1doc", 1, 8192, 16, 16, 128, 1 << 30, causal, 20},
      {"B1 S128k H16 D128 causal doc8k", 1, 131072, 16, 16, 128, 8192, causal, 3},
  };
  if (with_long) cases.push_back({"B1 S256k H16 D128 causal doc32k", 1, 262144, 16, 16, 128, 32768, causal, 1});
  bool ok = true;
  for (const auto& c : cases) ok = time_case(c) && ok;
  return ok ? 0 : 1;
}

int run_small() {
  TestCase c;
  c.mask_name = "causal+win50";
  c.mask = mk(true, 50, -1, 0);
  c.layout = LayoutKind::kPacked;
  c.B = 2; c.Sq = 150; c.Skv = 150; c.Hq = 4; c.Hkv = 2; c.D = 64;
  c.dtype = DType::kBF16;
  c.mean_doc = 40;
  c.scale = 0.125f;
  c.seed = 7;
  Errors e = run_case(c);
  c.D = 128; c.layout = LayoutKind::kCross; c.Sq = 70; c.Skv = 190; c.mask = mk(false, -1, -1, 0);
  Errors e2 = run_case(c);
  c.D = 256; c.layout = LayoutKind::kPermuted; c.Sq = c.Skv = 100; c.mask = mk(true, -1, -1, 32);
  c.dtype = DType::kF16;
  Errors e3 = run_case(c);
  std::printf("small: D64 out %.2e dq %.2e dk %.2e dv %.2e | D128 out %.2e dq %.2e | D256 out %.2e dq %.2e dk %.2e\n",
              e.out, e.dq, e.dk, e.dv, e2.out, e2.dq, e3.out, e3.dq, e3.dk);
  const bool ok = e.out < 1.5e-2 && e.dq < 1.5e-2 && e2.out < 1.5e-2 && e3.out < 4e-3 &&
                  e.det_bitwise && e2.det_bitwise && e3.det_bitwise && e.empty_ok && e2.empty_ok && e3.empty_ok;
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "all";
  int rc = 0;
  if (mode == "test" || mode == "all") rc |= run_tests(false) ? 1 : 0;
  if (mode == "quick") rc |= run_tests(true) ? 1 : 0;
  if (mode == "time" || mode == "all") rc |= run_timing(mode == "all" || (argc > 2 && std::string(argv[2]) == "long"));
  if (mode == "small") rc |= run_small();
  std::printf("%s\n", rc ? "HARNESS: FAILED" : "HARNESS: OK");
  return rc;
}
