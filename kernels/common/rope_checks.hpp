// Argument checks of the rope ops, shared by the CPU (kernels/cpu/rope.cpp) and CUDA
// (kernels/cuda/rope.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device (the CPU op also checks the positions' values).
#pragma once
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// cos_t, sin_t: [P, hd/2] of one dtype, f32 or f64 (an accumulation dtype: the rotations read the
// table in acc_dtype(x)); theta > 0.
inline void check_rope_table_args(const Tensor& cos_t, const Tensor& sin_t, double theta) {
  MOE_CHECK(cos_t.ndim == 2, "rope_table: cos must be [P, hd/2], got " + cos_t.shape_str());
  const int64_t max_pos = cos_t.size(0), half = cos_t.size(1);
  check_shape(sin_t, {max_pos, half}, "rope_table: sin");
  check_same_dtype(cos_t, sin_t, "rope_table: cos, sin");
  MOE_CHECK(cos_t.dtype == DType::f32 || cos_t.dtype == DType::f64,
            std::string("rope_table: the table must be f32 or f64 (rotations read it in the ") +
                "accumulation dtype of x), got " + dtype_name(cos_t.dtype));
  MOE_CHECK(theta > 0, "rope_table: theta must be positive, got " + std::to_string(theta));
}

// Checks x: [N, H, hd], pos: [N] i32, cos/sin: [P, hd/2] in acc_dtype(x) (shapes and dtypes,
// not the positions' values).
inline void check_rope_rotate_args(const Tensor& x, const Tensor& pos, const Tensor& cos_t,
                                   const Tensor& sin_t, const char* op) {
  const std::string name(op);
  MOE_CHECK(x.ndim == 3, name + ": x must be [N, H, hd], got " + x.shape_str());
  MOE_CHECK(x.size(2) % 2 == 0, name + ": head_dim must be even, got " + x.shape_str());
  MOE_CHECK(cos_t.ndim == 2, name + ": cos must be [P, hd/2], got " + cos_t.shape_str());
  const int64_t n = x.size(0), half = x.size(2) / 2, max_pos = cos_t.size(0);
  check_shape(cos_t, {max_pos, half}, (name + ": cos").c_str());
  check_shape(sin_t, {max_pos, half}, (name + ": sin").c_str());
  check_acc_dtype(cos_t, x, (name + ": cos").c_str());
  check_acc_dtype(sin_t, x, (name + ": sin").c_str());
  MOE_CHECK(pos.dtype == DType::i32, name + ": pos must be i32, got " + dtype_name(pos.dtype));
  check_shape(pos, {n}, (name + ": pos").c_str());
}

}  // namespace moe
