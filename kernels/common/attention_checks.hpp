// Argument checks of the attention ops, shared by the CPU (kernels/cpu/attention.cpp) and CUDA
// (kernels/cuda/attention.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device.
#pragma once
#include <initializer_list>
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// q: [B, T, nh, hd], k, v: [B, T, nkv, hd] with nkv dividing nh (shapes only).
inline void check_attention_qkv_shapes(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const char* op) {
  const std::string name(op);
  MOE_CHECK(q.ndim == 4, name + ": q must be [B, T, nh, hd], got " + q.shape_str());
  MOE_CHECK(k.ndim == 4, name + ": k must be [B, T, nkv, hd], got " + k.shape_str());
  const struct {
    int64_t batch, seq, heads, kv_heads, hd;
  } s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  check_shape(k, {s.batch, s.seq, s.kv_heads, s.hd}, (name + ": k").c_str());
  check_shape(v, {s.batch, s.seq, s.kv_heads, s.hd}, (name + ": v").c_str());
  MOE_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0,
            name + ": num_key_value_heads " + std::to_string(s.kv_heads) +
                " must divide num_attention_heads " + std::to_string(s.heads));
}

// k, v: of q's dtype.
inline void check_attention_qkv_dtypes(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const char* op) {
  const std::string name(op);
  check_same_dtype(k, q, (name + ": k, q").c_str());
  check_same_dtype(v, q, (name + ": v, q").c_str());
}

// out: [B, T, nh, hd] of q's dtype, lse: [B, nh, T] in acc_dtype(q) (q checked by
// check_attention_qkv_*).
inline void check_attention_forward_outputs(const Tensor& out, const Tensor& lse, const Tensor& q) {
  const struct { int64_t batch, seq, heads, hd; } s{q.size(0), q.size(1), q.size(2), q.size(3)};
  check_shape(out, {s.batch, s.seq, s.heads, s.hd}, "attention_forward: out");
  check_shape(lse, {s.batch, s.heads, s.seq}, "attention_forward: lse");
  check_same_dtype(out, q, "attention_forward: out, q");
  check_acc_dtype(lse, q, "attention_forward: lse");
}

// The gradients and saved tensors of attention_backward against q, k (checked by
// check_attention_qkv_*): all of q's dtype but lse, in acc_dtype(q).
inline void check_attention_backward_args(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                          const Tensor& dout, const Tensor& q, const Tensor& k,
                                          const Tensor& out, const Tensor& lse,
                                          const Tensor& dq_acc) {
  const struct {
    int64_t batch, seq, heads, kv_heads, hd;
  } s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  check_shape(dq, {s.batch, s.seq, s.heads, s.hd}, "attention_backward: dq");
  check_shape(dk, {s.batch, s.seq, s.kv_heads, s.hd}, "attention_backward: dk");
  check_shape(dv, {s.batch, s.seq, s.kv_heads, s.hd}, "attention_backward: dv");
  check_shape(dout, {s.batch, s.seq, s.heads, s.hd}, "attention_backward: dout");
  check_shape(out, {s.batch, s.seq, s.heads, s.hd}, "attention_backward: out");
  check_shape(lse, {s.batch, s.heads, s.seq}, "attention_backward: lse");
  check_same_dtype(dq, q, "attention_backward: dq, q");
  check_same_dtype(dk, q, "attention_backward: dk, q");
  check_same_dtype(dv, q, "attention_backward: dv, q");
  check_same_dtype(dout, q, "attention_backward: dout, q");
  check_same_dtype(out, q, "attention_backward: out, q");
  check_acc_dtype(lse, q, "attention_backward: lse");
  if (!dq_acc.empty()) {
    check_shape(dq_acc, {s.batch, s.heads, s.seq, s.hd}, "attention_backward: dq_acc");
    MOE_CHECK(
        dq_acc.dtype == DType::f32,
        std::string("attention_backward: dq_acc must be f32, got ") + dtype_name(dq_acc.dtype));
    MOE_CHECK(dq_acc.device == q.device, "attention_backward: dq_acc is on " + dq_acc.device.str() +
                                             ", q on " + q.device.str());
  }
}

}  // namespace moe
