// Argument checks of the permute ops, shared by the CPU (kernels/cpu/permute.cpp) and CUDA
// (kernels/cuda/permute.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device (the CPU ops also check the index values).
#pragma once
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

inline void check_index_i32(const Tensor& t, const char* what) {
  MOE_CHECK(t.dtype == DType::i32, std::string(what) + " must be i32, got " + dtype_name(t.dtype));
}

// Slots per token: the permuted row count over the token count (both checked).
inline int64_t permute_slots_per_token(int64_t slots, int64_t n_tok, const char* op) {
  MOE_CHECK(n_tok > 0 ? slots % n_tok == 0 : slots == 0,
            std::string(op) + ": " + std::to_string(slots) + " routed slots is not a multiple of " +
                std::to_string(n_tok) + " tokens");
  return n_tok > 0 ? slots / n_tok : 0;
}

// offsets: [E+1], row_token, slot_row: [N*K], topk_idx: [N, K], all i32.
inline void check_moe_permute_plan_args(const Tensor& offsets, const Tensor& row_token,
                                        const Tensor& slot_row, const Tensor& topk_idx) {
  MOE_CHECK(topk_idx.ndim == 2 && offsets.ndim == 1,
            "moe_permute_plan: topk_idx must be [N, K] and offsets [E+1], got " +
                topk_idx.shape_str() + " and " + offsets.shape_str());
  const int64_t n_tok = topk_idx.size(0), k = topk_idx.size(1), slots = n_tok * k;
  const int64_t n_exp = offsets.size(0) - 1;
  MOE_CHECK(n_exp >= 1, "moe_permute_plan: offsets must have E+1 >= 2 entries");
  check_shape(row_token, {slots}, "moe_permute_plan: row_token");
  check_shape(slot_row, {slots}, "moe_permute_plan: slot_row");
  check_index_i32(offsets, "moe_permute_plan: offsets");
  check_index_i32(row_token, "moe_permute_plan: row_token");
  check_index_i32(slot_row, "moe_permute_plan: slot_row");
  check_index_i32(topk_idx, "moe_permute_plan: topk_idx");
}

// xp: [N*K, d], x: [N, d], row_token: [N*K] i32
inline void check_permute_forward_args(const Tensor& xp, const Tensor& x, const Tensor& row_token) {
  MOE_CHECK(x.ndim == 2 && row_token.ndim == 1,
            "permute_forward: x must be [N, d] and row_token [N*K], got " + x.shape_str() +
                " and " + row_token.shape_str());
  const int64_t rows = row_token.size(0), d = x.size(1);
  check_shape(xp, {rows, d}, "permute_forward: xp");
  check_same_dtype(xp, x, "permute_forward: xp, x");
  check_index_i32(row_token, "permute_forward: row_token");
}

// dx: [N, d], dxp and dxp2 (unless empty): [N*K, d], slot_row: [N*K] i32; returns K.
inline int64_t check_permute_backward_args(const Tensor& dx, const Tensor& dxp, const Tensor& dxp2,
                                           const Tensor& slot_row) {
  MOE_CHECK(dx.ndim == 2 && slot_row.ndim == 1,
            "permute_backward: dx must be [N, d] and slot_row [N*K], got " + dx.shape_str() +
                " and " + slot_row.shape_str());
  const int64_t n_tok = dx.size(0), d = dx.size(1), slots = slot_row.size(0);
  const int64_t k = permute_slots_per_token(slots, n_tok, "permute_backward");
  check_shape(dxp, {slots, d}, "permute_backward: dxp");
  check_same_dtype(dxp, dx, "permute_backward: dxp, dx");
  if (!dxp2.empty()) {
    check_shape(dxp2, {slots, d}, "permute_backward: dxp2");
    check_same_dtype(dxp2, dx, "permute_backward: dxp2, dx");
    MOE_CHECK(dxp2.device == dx.device, "permute_backward: dxp2 must be on " + dx.device.str() +
                                            ", got " + dxp2.device.str());
  }
  check_index_i32(slot_row, "permute_backward: slot_row");
  return k;
}

// permute_backward_add: permute_backward's (y, yp, slot_row), base y's shape and dtype on its
// device, and not y's memory. Returns K.
inline int64_t check_permute_backward_add_args(const Tensor& y, const Tensor& base,
                                               const Tensor& yp, const Tensor& slot_row) {
  const int64_t k = check_permute_backward_args(y, yp, Tensor(), slot_row);
  check_shape(base, {y.size(0), y.size(1)}, "permute_backward_add: base");
  check_same_dtype(base, y, "permute_backward_add: base, y");
  MOE_CHECK(base.device == y.device, "permute_backward_add: base must be on " + y.device.str() +
                                         ", got " + base.device.str());
  MOE_CHECK(base.data != y.data || y.numel() == 0,
            "permute_backward_add: base must not be y's memory");
  return k;
}

// row_w: [N*K] and topk_w: [N, K] of one float dtype (f32 / f64: the router's accumulation
// dtype), slot_row: [N*K] i32. `op` names the op, `row` / `slot` the two weight tensors.
inline void check_permute_weights_args(const Tensor& row_w, const Tensor& topk_w,
                                       const Tensor& slot_row, const char* op, const char* row,
                                       const char* slot) {
  const std::string o(op);
  MOE_CHECK(topk_w.ndim == 2, o + ": " + slot + " must be [N, K], got " + topk_w.shape_str());
  const int64_t slots = topk_w.size(0) * topk_w.size(1);
  check_shape(row_w, {slots}, (o + ": " + row).c_str());
  check_shape(slot_row, {slots}, (o + ": slot_row").c_str());
  MOE_CHECK(topk_w.dtype == DType::f32 || topk_w.dtype == DType::f64,
            o + ": " + slot + " must be f32 or f64, got " + dtype_name(topk_w.dtype));
  check_same_dtype(row_w, topk_w, (o + ": " + row + ", " + slot).c_str());
  check_index_i32(slot_row, (o + ": slot_row").c_str());
}

}  // namespace moe
