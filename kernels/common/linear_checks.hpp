// Argument checks of the linear ops, shared by the CPU (kernels/cpu/linear.cpp) and CUDA
// (kernels/cuda/linear.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device (the CPU op also checks the offsets' values; the CUDA op cannot read them)
// but for the device type in check_grouped_weight_grad_dtype (the CPU's bf16 gradient reference).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// The [N, in] / [N, out] / [out, in] shapes shared by linear_forward and linear_backward.
struct LinearDims {
  int64_t n, in, out;
};

inline LinearDims linear_dims(const Tensor& x, const Tensor& w, const char* op) {
  MOE_CHECK(x.ndim == 2, std::string(op) + ": x must be [N, in], got " + x.shape_str());
  MOE_CHECK(w.ndim == 2, std::string(op) + ": w must be [out, in], got " + w.shape_str());
  MOE_CHECK(w.size(1) == x.size(1), std::string(op) + ": x " + x.shape_str() + " and w " +
                                        w.shape_str() + " disagree on in_features");
  return {x.size(0), x.size(1), w.size(0)};
}

// y: [N, out] in x's dtype or acc_dtype(x), x: [N, in], w: [out, in]
inline LinearDims check_linear_forward_args(const Tensor& y, const Tensor& x, const Tensor& w) {
  const LinearDims s = linear_dims(x, w, "linear_forward");
  check_shape(y, {s.n, s.out}, "linear_forward: y");
  check_same_dtype(x, w, "linear_forward: x, w");
  if (y.dtype != x.dtype) check_acc_dtype(y, x, "linear_forward: y");
  return s;
}

// dx: [N, in] or empty, dw: [out, in] in acc_dtype(x), dy: [N, out]
inline LinearDims check_linear_backward_args(const Tensor& dx, const Tensor& dw, const Tensor& dy,
                                             const Tensor& x, const Tensor& w) {
  const LinearDims s = linear_dims(x, w, "linear_backward");
  check_shape(dy, {s.n, s.out}, "linear_backward: dy");
  check_shape(dw, {s.out, s.in}, "linear_backward: dw");
  if (!dx.empty()) check_shape(dx, {s.n, s.in}, "linear_backward: dx");
  check_same_dtype(dy, x, "linear_backward: dy, x");
  check_same_dtype(w, x, "linear_backward: w, x");
  check_acc_dtype(dw, x, "linear_backward: dw");
  if (!dx.empty()) check_same_dtype(dx, x, "linear_backward: dx, x");
  return s;
}

// The batched linears (one x against B weights): w [B, out, in] and y / dy [B, N, out] with the
// same B >= 1; batch_item(t, b) is batch b as the plain op's 2-d view.
inline int64_t linear_batch(const Tensor& y, const Tensor& w, const char* op) {
  MOE_CHECK(w.ndim == 3, std::string(op) + ": w must be [B, out, in], got " + w.shape_str());
  MOE_CHECK(y.ndim == 3 && y.size(0) == w.size(0) && w.size(0) >= 1,
            std::string(op) + ": w " + w.shape_str() + " and the outputs " + y.shape_str() +
                " must be [B, out, in] and [B, N, out] with the same B >= 1");
  return w.size(0);
}

inline Tensor batch_item(const Tensor& t, int64_t b) {
  return t.rows(b, b + 1).view({t.size(1), t.size(2)});
}

// The [E, out, in] weight and [R, in] rows of a grouped linear.
struct GroupedDims {
  int64_t rows, in, out, experts;
};

inline GroupedDims linear_grouped_dims(const Tensor& x, const Tensor& w, const char* op) {
  MOE_CHECK(x.ndim == 2, std::string(op) + ": x must be [R, in], got " + x.shape_str());
  MOE_CHECK(w.ndim == 3, std::string(op) + ": w must be [E, out, in], got " + w.shape_str());
  MOE_CHECK(w.size(2) == x.size(1), std::string(op) + ": x " + x.shape_str() + " and w " +
                                        w.shape_str() + " disagree on in_features");
  return {x.size(0), x.size(1), w.size(1), w.size(0)};
}

// offsets: [E+1] i32 (the shape and dtype; not the values).
inline void check_grouped_offsets_args(const Tensor& offsets, int64_t experts, const char* op) {
  MOE_CHECK(offsets.dtype == DType::i32,
            std::string(op) + ": offsets must be i32, got " + dtype_name(offsets.dtype));
  check_shape(offsets, {experts + 1}, (std::string(op) + ": offsets").c_str());
}

// y: [R, out] of x's dtype; s from linear_grouped_dims(x, w, ...).
inline void check_grouped_linear_forward_args(const GroupedDims& s, const Tensor& y,
                                              const Tensor& x, const Tensor& w) {
  check_shape(y, {s.rows, s.out}, "grouped_linear_forward: y");
  check_same_dtype(x, w, "grouped_linear_forward: x, w");
  check_same_dtype(y, x, "grouped_linear_forward: y, x");
}

// gate, up, h: [R, F] of x's dtype; w3 the shape and dtype of w1 ([E, F, in]); row_w: [R] in
// acc_dtype(x).
inline void check_grouped_swiglu_forward_args(const GroupedDims& s, const Tensor& gate,
                                              const Tensor& up, const Tensor& h, const Tensor& x,
                                              const Tensor& w1, const Tensor& w3,
                                              const Tensor& row_w) {
  check_grouped_linear_forward_args(s, gate, x, w1);
  MOE_CHECK(w3.ndim == 3 && w3.size(0) == w1.size(0) && w3.size(1) == w1.size(1) &&
                w3.size(2) == w1.size(2),
            "grouped_swiglu_forward: w3 must have w1's shape " + w1.shape_str() + ", got " +
                w3.shape_str());
  check_same_dtype(w3, w1, "grouped_swiglu_forward: w3, w1");
  check_shape(up, {s.rows, s.out}, "grouped_swiglu_forward: up");
  check_shape(h, {s.rows, s.out}, "grouped_swiglu_forward: h");
  check_same_dtype(up, x, "grouped_swiglu_forward: up, x");
  check_same_dtype(h, x, "grouped_swiglu_forward: h, x");
  check_row_stat(row_w, s.rows, x, "grouped_swiglu_forward: row_w");
}

// A gathered op's row_token: [R] i32.
inline void check_row_token(const Tensor& row_token, const char* op) {
  MOE_CHECK(row_token.ndim == 1 && row_token.dtype == DType::i32,
            std::string(op) + ": row_token must be [R] i32, got " + row_token.shape_str() + " " +
                dtype_name(row_token.dtype));
}

// grouped_swiglu_forward_gathered: x [N, in], row_token [R] i32, the rest as
// check_grouped_swiglu_forward_args over R rows; returns the dimensions (rows = R).
inline GroupedDims check_grouped_swiglu_forward_gathered_args(const Tensor& gate, const Tensor& up,
                                                              const Tensor& h, const Tensor& x,
                                                              const Tensor& row_token,
                                                              const Tensor& w1, const Tensor& w3,
                                                              const Tensor& row_w) {
  constexpr const char* op = "grouped_swiglu_forward_gathered";
  check_row_token(row_token, op);
  GroupedDims s = linear_grouped_dims(x, w1, op);
  s.rows = row_token.size(0);
  check_shape(gate, {s.rows, s.out},
              "grouped_swiglu_forward_gathered: gate (R = row_token's rows)");
  check_grouped_swiglu_forward_args(s, gate, up, h, x, w1, w3, row_w);
  return s;
}

// A grouped op's weight gradient: acc_dtype(x), or bf16 beside bf16 x (the bf16 gradient form,
// linear.hpp). The CPU backend, which computes in f32 / f64 only, also takes bf16 beside f32 x: its
// reference of that form (the f32 sums rounded once per element).
inline void check_grouped_weight_grad_dtype(const Tensor& dw, const Tensor& x, const char* what) {
  if (dw.dtype != DType::bf16) return check_acc_dtype(dw, x, what);
  const bool cpu_reference = x.device.type == DeviceType::cpu && x.dtype == DType::f32;
  MOE_CHECK(x.dtype == DType::bf16 || cpu_reference,
            std::string(what) + ": dtype bf16 needs bf16 inputs, got " + dtype_name(x.dtype) +
                " (an f32 gradient for 16-bit or f32 inputs, f64 for f64)");
}

// dx: [R, in], dy: [R, out] of x's dtype (w's too), dw: [E, out, in] in acc_dtype(x) or bf16
// (check_grouped_weight_grad_dtype).
inline void check_grouped_linear_backward_args(const GroupedDims& s, const Tensor& dx,
                                               const Tensor& dw, const Tensor& dy, const Tensor& x,
                                               const Tensor& w) {
  check_shape(dx, {s.rows, s.in}, "grouped_linear_backward: dx");
  check_shape(dy, {s.rows, s.out}, "grouped_linear_backward: dy");
  check_shape(dw, {s.experts, s.out, s.in}, "grouped_linear_backward: dw");
  check_same_dtype(dx, x, "grouped_linear_backward: dx, x");
  check_same_dtype(dy, x, "grouped_linear_backward: dy, x");
  check_same_dtype(w, x, "grouped_linear_backward: w, x");
  check_grouped_weight_grad_dtype(dw, x, "grouped_linear_backward: dw");
}

// grouped_linear_backward_pair: both halves as grouped_linear_backward's, w3 shaped as w1, dw3
// typed as dw1, dx2 as dx and apart from it, or empty (the backend then throws where it needs it).
inline void check_grouped_linear_backward_pair_args(const GroupedDims& s, const Tensor& dx,
                                                    const Tensor& dx2, const Tensor& dw1,
                                                    const Tensor& dw3, const Tensor& dy1,
                                                    const Tensor& dy3, const Tensor& x,
                                                    const Tensor& w1, const Tensor& w3) {
  check_grouped_linear_backward_args(s, dx, dw1, dy1, x, w1);
  check_shape(w3, {s.experts, s.out, s.in}, "grouped_linear_backward_pair: w3 (as w1)");
  check_same_dtype(dw3, dw1, "grouped_linear_backward_pair: dw3, dw1");
  if (dx2.empty()) {  // no workspace (grouped_linear_backward_pair_needs_dx2): dx's shape in its
                      // place
    check_grouped_linear_backward_args(s, dx, dw3, dy3, x, w3);
    return;
  }
  check_grouped_linear_backward_args(s, dx2, dw3, dy3, x, w3);
  MOE_CHECK(!memory_overlaps(dx, dx2), "grouped_linear_backward_pair: dx2 overlaps dx");
}

// grouped_linear_backward_gathered: x [N, in], row_token [R] i32, the rest as
// check_grouped_linear_backward_args over R rows; returns the dimensions (rows = R).
inline GroupedDims check_grouped_linear_backward_gathered_args(const Tensor& dx, const Tensor& dw,
                                                               const Tensor& dy, const Tensor& x,
                                                               const Tensor& row_token,
                                                               const Tensor& w) {
  constexpr const char* op = "grouped_linear_backward_gathered";
  check_row_token(row_token, op);
  GroupedDims s = linear_grouped_dims(x, w, op);
  s.rows = row_token.size(0);
  check_shape(dx, {s.rows, s.in}, "grouped_linear_backward_gathered: dx (R = row_token's rows)");
  check_grouped_linear_backward_args(s, dx, dw, dy, x, w);
  return s;
}

// grouped_linear_backward_pair_gathered: x [N, in], row_token [R] i32, the rest as
// check_grouped_linear_backward_pair_args over R rows; returns the dimensions (rows = R).
inline GroupedDims check_grouped_linear_backward_pair_gathered_args(
    const Tensor& dx, const Tensor& dx2, const Tensor& dw1, const Tensor& dw3, const Tensor& dy1,
    const Tensor& dy3, const Tensor& x, const Tensor& row_token, const Tensor& w1,
    const Tensor& w3) {
  GroupedDims s = check_grouped_linear_backward_gathered_args(dx, dw1, dy1, x, row_token, w1);
  check_grouped_linear_backward_pair_args(s, dx, dx2, dw1, dw3, dy1, dy3, x, w1, w3);
  return s;
}

// s from linear_grouped_dims(h, w2, ...): dgate, dup, gate, up: [R, F] and dy: [R, out] of h's
// dtype, dw2: [E, out, F] in acc_dtype(h) or bf16 (check_grouped_weight_grad_dtype), row_w,
// drow_w: [R] in acc_dtype(h).
inline void check_grouped_swiglu_down_backward_args(const GroupedDims& s, const Tensor& dgate,
                                                    const Tensor& dup, const Tensor& drow_w,
                                                    const Tensor& dw2, const Tensor& dy,
                                                    const Tensor& h, const Tensor& w2,
                                                    const Tensor& gate, const Tensor& up,
                                                    const Tensor& row_w) {
  constexpr const char* op = "grouped_swiglu_down_backward";
  check_shape(dy, {s.rows, s.out}, "grouped_swiglu_down_backward: dy");
  check_shape(dw2, {s.experts, s.out, s.in}, "grouped_swiglu_down_backward: dw2");
  check_same_dtype(dy, h, "grouped_swiglu_down_backward: dy, h");
  check_same_dtype(w2, h, "grouped_swiglu_down_backward: w2, h");
  check_grouped_weight_grad_dtype(dw2, h, "grouped_swiglu_down_backward: dw2");
  const Tensor* feature_rows[] = {&dgate, &dup, &gate, &up};
  const char* names[] = {"dgate", "dup", "gate", "up"};
  for (int i = 0; i < 4; ++i) {
    const std::string what = std::string(op) + ": " + names[i];
    check_shape(*feature_rows[i], {s.rows, s.in}, what.c_str());
    check_same_dtype(*feature_rows[i], h, (what + ", h").c_str());
  }
  check_row_stat(row_w, s.rows, h, "grouped_swiglu_down_backward: row_w");
  check_row_stat(drow_w, s.rows, h, "grouped_swiglu_down_backward: drow_w");
}

// grouped_swiglu_down_backward_gathered: dy [N, d], row_token [R] i32, the rest as
// check_grouped_swiglu_down_backward_args; returns its dimensions (from h and w2).
inline GroupedDims check_grouped_swiglu_down_backward_gathered_args(
    const Tensor& dgate, const Tensor& dup, const Tensor& drow_w, const Tensor& dw2,
    const Tensor& dy, const Tensor& row_token, const Tensor& h, const Tensor& w2,
    const Tensor& gate, const Tensor& up, const Tensor& row_w) {
  constexpr const char* op = "grouped_swiglu_down_backward_gathered";
  check_row_token(row_token, op);
  const GroupedDims s = linear_grouped_dims(h, w2, op);
  MOE_CHECK(row_token.size(0) == s.rows, std::string(op) + ": row_token must have h's " +
                                             std::to_string(s.rows) + " rows, got " +
                                             row_token.shape_str());
  MOE_CHECK(
      dy.ndim == 2 && dy.size(1) == s.out,
      std::string(op) + ": dy must be [N, " + std::to_string(s.out) + "], got " + dy.shape_str());
  // the rest against a dy of R rows (shape and dtype only)
  check_grouped_swiglu_down_backward_args(s, dgate, dup, drow_w, dw2,
                                          Tensor(nullptr, dy.dtype, dy.device, {s.rows, s.out}), h,
                                          w2, gate, up, row_w);
  return s;
}

// grouped_linear_forward_adamw: the update's slab must not overlap the product's operands (the
// CUDA backend updates it while the product runs).
inline void check_update_apart(std::initializer_list<const Tensor*> slab,
                               std::initializer_list<const Tensor*> product, const char* op) {
  for (const Tensor* a : slab)
    for (const Tensor* b : product)
      MOE_CHECK(!memory_overlaps(*a, *b),
                std::string(op) + ": the updated parameters overlap the product's operands");
}

}  // namespace moe
