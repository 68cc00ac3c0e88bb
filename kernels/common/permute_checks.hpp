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

// y: [N, d], yp: [N*K, d] of one dtype, topk_w: [N, K] in acc_dtype(y), slot_row: [N*K] i32
inline void check_combine_forward_args(const Tensor& y, const Tensor& yp, const Tensor& topk_w,
                                       const Tensor& slot_row) {
  MOE_CHECK(y.ndim == 2 && topk_w.ndim == 2,
            "combine_forward: y must be [N, d] and topk_w [N, K], got " + y.shape_str() + " and " +
                topk_w.shape_str());
  const int64_t n_tok = y.size(0), d = y.size(1), k = topk_w.size(1);
  check_shape(topk_w, {n_tok, k}, "combine_forward: topk_w");
  check_shape(yp, {n_tok * k, d}, "combine_forward: yp");
  check_shape(slot_row, {n_tok * k}, "combine_forward: slot_row");
  check_same_dtype(yp, y, "combine_forward: yp, y");
  check_acc_dtype(topk_w, y, "combine_forward: topk_w");
  check_index_i32(slot_row, "combine_forward: slot_row");
}

// dyp, yp: [N*K, d], dy: [N, d] of one dtype, dtopk_w, topk_w: [N, K] in acc_dtype(dy),
// slot_row: [N*K] i32
inline void check_combine_backward_args(const Tensor& dyp, const Tensor& dtopk_w, const Tensor& dy,
                                        const Tensor& yp, const Tensor& topk_w,
                                        const Tensor& slot_row) {
  MOE_CHECK(dy.ndim == 2 && topk_w.ndim == 2,
            "combine_backward: dy must be [N, d] and topk_w [N, K], got " + dy.shape_str() +
                " and " + topk_w.shape_str());
  const int64_t n_tok = dy.size(0), d = dy.size(1), k = topk_w.size(1);
  check_shape(topk_w, {n_tok, k}, "combine_backward: topk_w");
  check_shape(dtopk_w, {n_tok, k}, "combine_backward: dtopk_w");
  check_shape(yp, {n_tok * k, d}, "combine_backward: yp");
  check_shape(dyp, {n_tok * k, d}, "combine_backward: dyp");
  check_shape(slot_row, {n_tok * k}, "combine_backward: slot_row");
  check_same_dtype(dyp, dy, "combine_backward: dyp, dy");
  check_acc_dtype(dtopk_w, dy, "combine_backward: dtopk_w");
  check_same_dtype(yp, dy, "combine_backward: yp, dy");
  check_acc_dtype(topk_w, dy, "combine_backward: topk_w");
  check_index_i32(slot_row, "combine_backward: slot_row");
}

}  // namespace moe
