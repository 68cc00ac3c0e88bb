// Argument checks of the mod ops, shared by the CPU (kernels/cpu/mod.cpp) and CUDA
// (kernels/cuda/mod.cu) backends: shapes and dtypes only, nothing that reads tensor data or depends
// on the device (the CPU ops also check that sel is ascending inside [0, T)).
#pragma once
#include <initializer_list>
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// The sequence length T of x: [B*T, d] for sel: [B, C], checked.
inline int64_t mod_seq_len(const Tensor& x, const Tensor& sel, const char* op) {
  MOE_CHECK(x.ndim == 2 && sel.ndim == 2, std::string(op) +
                                              ": x must be [B*T, d] and sel [B, C], "
                                              "got " +
                                              x.shape_str() + " and " + sel.shape_str());
  const int64_t b = sel.size(0);
  MOE_CHECK(b > 0 && x.size(0) % b == 0, std::string(op) + ": " + std::to_string(x.size(0)) +
                                             " rows is not B*T for B = " + std::to_string(b));
  return x.size(0) / b;
}

// sel: i32 with C <= T (its values are not read).
inline void check_mod_sel_args(const Tensor& sel, int64_t t, const char* op) {
  MOE_CHECK(sel.dtype == DType::i32, std::string(op) + ": sel must be i32");
  MOE_CHECK(sel.size(1) <= t, std::string(op) + ": C = " + std::to_string(sel.size(1)) +
                                  " exceeds T = " + std::to_string(t));
}

// sel: [B, C] i32, mask, scores: [B, T] of one dtype, C <= T.
inline void check_mod_select_args(const Tensor& sel, const Tensor& mask, const Tensor& scores) {
  MOE_CHECK(scores.ndim == 2 && sel.ndim == 2,
            "mod_select: scores must be [B, T] and sel [B, C], got " + scores.shape_str() +
                " and " + sel.shape_str());
  const int64_t b = scores.size(0), t = scores.size(1), c = sel.size(1);
  MOE_CHECK(c <= t, "mod_select: C = " + std::to_string(c) + " exceeds T = " + std::to_string(t));
  check_shape(sel, {b, c}, "mod_select: sel");
  check_shape(mask, {b, t}, "mod_select: mask");
  check_same_dtype(mask, scores, "mod_select: mask, scores");
  MOE_CHECK(sel.dtype == DType::i32, "mod_select: sel must be i32");
}

// out, x: [B*T, d], ys: [B*C, d] of one dtype, scores: [B, T] in acc_dtype(x); sel checked apart.
inline void check_mod_scatter_forward_args(const Tensor& out, const Tensor& x, const Tensor& ys,
                                           const Tensor& scores, const Tensor& sel, int64_t t) {
  const int64_t b = sel.size(0), c = sel.size(1), d = x.size(1);
  check_shape(out, {b * t, d}, "mod_scatter_forward: out");
  check_shape(ys, {b * c, d}, "mod_scatter_forward: ys");
  check_shape(scores, {b, t}, "mod_scatter_forward: scores");
  check_same_dtype(out, x, "mod_scatter_forward: out, x");
  check_same_dtype(ys, x, "mod_scatter_forward: ys, x");
  check_acc_dtype(scores, x, "mod_scatter_forward: scores");
}

// dx, dout, x: [B*T, d], dys, ys: [B*C, d] of one dtype, dscores, scores: [B, T] in acc_dtype(x);
// sel checked apart.
inline void check_mod_scatter_backward_args(const Tensor& dx, const Tensor& dys,
                                            const Tensor& dscores, const Tensor& dout,
                                            const Tensor& x, const Tensor& ys, const Tensor& scores,
                                            const Tensor& sel, int64_t t) {
  const int64_t b = sel.size(0), c = sel.size(1), d = x.size(1);
  check_shape(dx, {b * t, d}, "mod_scatter_backward: dx");
  check_shape(dout, {b * t, d}, "mod_scatter_backward: dout");
  check_shape(ys, {b * c, d}, "mod_scatter_backward: ys");
  check_shape(dys, {b * c, d}, "mod_scatter_backward: dys");
  check_shape(scores, {b, t}, "mod_scatter_backward: scores");
  check_shape(dscores, {b, t}, "mod_scatter_backward: dscores");
  check_same_dtype(dx, x, "mod_scatter_backward: dx, x");
  check_same_dtype(dys, x, "mod_scatter_backward: dys, x");
  check_same_dtype(dout, x, "mod_scatter_backward: dout, x");
  check_same_dtype(ys, x, "mod_scatter_backward: ys, x");
  check_acc_dtype(scores, x, "mod_scatter_backward: scores");
  check_acc_dtype(dscores, x, "mod_scatter_backward: dscores");
}

// The predictor head's tensors: h, dh [N, P], w2, dw2 [1, P], logit, targets [N], one dtype
// (dh, dw2, targets only for the backward: pass nullptr for the forward).
inline void check_mod_predictor_head_args(const Tensor& h, const Tensor& w2, const Tensor& logit,
                                          const Tensor* dh, const Tensor* dw2,
                                          const Tensor* targets, const char* op) {
  const auto what = [op](const char* t) { return std::string(op) + ": " + t; };
  MOE_CHECK(h.ndim == 2, what("h must be [N, P], got ") + h.shape_str());
  const int64_t n = h.size(0), p = h.size(1);
  auto holds_n = [&](const Tensor& t, const char* name) {
    MOE_CHECK(t.numel() == n,
              what(name) + " must hold N = " + std::to_string(n) + " values, got " + t.shape_str());
    check_same_dtype(t, h, (what(name) + ", h").c_str());
  };
  auto shaped = [&](const Tensor& t, std::initializer_list<int64_t> dims, const char* name) {
    check_shape(t, dims, what(name).c_str());
    check_same_dtype(t, h, (what(name) + ", h").c_str());
  };
  shaped(w2, {1, p}, "w2");
  holds_n(logit, "logit");
  if (dh != nullptr) shaped(*dh, {n, p}, "dh");
  if (dw2 != nullptr) shaped(*dw2, {1, p}, "dw2");
  if (targets != nullptr) holds_n(*targets, "targets");
}

}  // namespace moe
