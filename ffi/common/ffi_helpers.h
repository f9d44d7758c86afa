// FFI aliases and error helpers shared by the CPU and CUDA handlers.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>

#include "attention_shape.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcp {

namespace ffi = xla::ffi;

inline ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxcp: " + msg);
}
inline ffi::Error internal_error(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInternal, "jaxcp: " + msg);
}

// Reads the [B, S, H, D] shapes of q and k into an AttentionShape and checks consistency
// (the Python layer already validated; this guards against a mis-wired lowering).
inline ffi::Error attention_shape_from(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                       AttentionShape* out) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) return invalid("q and k must have rank 4");
  out->batch = qd[0];
  out->q_len = qd[1];
  out->q_heads = qd[2];
  out->head_dim = qd[3];
  out->kv_len = kd[1];
  out->kv_heads = kd[2];
  if (kd[0] != qd[0] || kd[3] != qd[3]) return invalid("q and k disagree on batch or head_dim");
  if (out->kv_heads <= 0 || out->q_heads % out->kv_heads != 0)
    return invalid("q heads must be a multiple of kv heads");
  return ffi::Error::Success();
}

template <class Buf>
bool dims_are(const Buf& b, std::initializer_list<int64_t> dims) {
  auto d = b.dimensions();
  if (d.size() != dims.size()) return false;
  size_t i = 0;
  for (int64_t x : dims)
    if (d[i++] != x) return false;
  return true;
}

// Reads v's head dim into the shape (Dv: it may differ from D, multi-head latent attention) and
// checks v's other dims against k's.
inline ffi::Error value_dim_from(const ffi::AnyBuffer& v, AttentionShape* s) {
  auto vd = v.dimensions();
  if (vd.size() != 4 || vd[0] != s->batch || vd[1] != s->kv_len || vd[2] != s->kv_heads || vd[3] <= 0)
    return invalid("v must have shape [B, Skv, Hkv, Dv], those of k but for its head dim");
  s->value_dim = vd[3];
  return ffi::Error::Success();
}

// out and dout: [B, Sq, Hq, Dv].
template <class Buf>
bool has_out_shape(const Buf& b, const AttentionShape& s) {
  return dims_are(b, {s.batch, s.q_len, s.q_heads, s.v_dim()});
}

// Segment ids and positions: [B, Sq] for the queries, [B, Skv] for the keys.
template <class Buf>
ffi::Error check_token_arrays(const AttentionShape& s, const Buf& q_seg, const Buf& q_pos, const Buf& kv_seg,
                              const Buf& kv_pos) {
  if (!dims_are(q_seg, {s.batch, s.q_len}) || !dims_are(q_pos, {s.batch, s.q_len}))
    return invalid("query segment ids / positions must have shape [B, Sq]");
  if (!dims_are(kv_seg, {s.batch, s.kv_len}) || !dims_are(kv_pos, {s.batch, s.kv_len}))
    return invalid("key segment ids / positions must have shape [B, Skv]");
  return ffi::Error::Success();
}

// The forward's out [B, Sq, Hq, Dv] and lse [B, Hq, Sq], and the token arrays (both handlers).
template <class Out, class Lse, class Tok>
ffi::Error check_fwd_operands(const AttentionShape& s, const Out& out, const Lse& lse, const Tok& q_seg,
                              const Tok& q_pos, const Tok& kv_seg, const Tok& kv_pos) {
  if (!has_out_shape(out, s)) return invalid("out must have shape [B, Sq, Hq, Dv], those of q but for v's head dim");
  if (!dims_are(lse, {s.batch, s.q_heads, s.q_len})) return invalid("lse must have shape [B, Hq, Sq]");
  return check_token_arrays(s, q_seg, q_pos, kv_seg, kv_pos);
}

// The backward's out / dout, lse / dlse, gradients dq / dk / dv (the shapes of q, k, v; the kernels
// write them by these shapes) and token arrays (both handlers).
template <class Buf, class Lse, class Grad, class Tok>
ffi::Error check_bwd_operands(const AttentionShape& s, const Buf& out, const Buf& dout, const Lse& lse,
                              const Lse& dlse, const Grad& dq, const Grad& dk, const Grad& dv, const Tok& q_seg,
                              const Tok& q_pos, const Tok& kv_seg, const Tok& kv_pos) {
  if (!has_out_shape(out, s) || !has_out_shape(dout, s))
    return invalid("out and dout must have shape [B, Sq, Hq, Dv], those of q but for v's head dim");
  if (!dims_are(lse, {s.batch, s.q_heads, s.q_len}) || !dims_are(dlse, {s.batch, s.q_heads, s.q_len}))
    return invalid("lse and dlse must have shape [B, Hq, Sq]");
  if (!dims_are(dq, {s.batch, s.q_len, s.q_heads, s.head_dim})) return invalid("dq must have the shape of q");
  if (!dims_are(dk, {s.batch, s.kv_len, s.kv_heads, s.head_dim}) ||
      !dims_are(dv, {s.batch, s.kv_len, s.kv_heads, s.v_dim()}))
    return invalid("dk and dv must have the shapes of k and v");
  return check_token_arrays(s, q_seg, q_pos, kv_seg, kv_pos);
}

}  // namespace jaxcp
