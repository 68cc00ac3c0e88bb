// Argument checks of the norm ops, shared by the CPU (kernels/cpu/norm.cpp) and CUDA
// (kernels/cuda/norm.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device.
#pragma once
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// y: [N, d], x: [N, d], w: [d] of one dtype, rstd: [N] in acc_dtype(x)
inline void check_rmsnorm_forward_args(const Tensor& y, const Tensor& rstd, const Tensor& x,
                                       const Tensor& w) {
  MOE_CHECK(x.ndim == 2, "rmsnorm_forward: x must be [N, d], got " + x.shape_str());
  const int64_t n = x.size(0), d = x.size(1);
  check_shape(y, {n, d}, "rmsnorm_forward: y");
  check_shape(rstd, {n}, "rmsnorm_forward: rstd");
  check_shape(w, {d}, "rmsnorm_forward: w");
  check_same_dtype(y, x, "rmsnorm_forward: y, x");
  check_acc_dtype(rstd, x, "rmsnorm_forward: rstd");
  check_same_dtype(w, x, "rmsnorm_forward: w, x");
}

// dx, dy, x: [N, d], w: [d] of one dtype; dw: [d], rstd: [N] in acc_dtype(x)
inline void check_rmsnorm_backward_args(const Tensor& dx, const Tensor& dw, const Tensor& dy,
                                        const Tensor& x, const Tensor& w, const Tensor& rstd) {
  MOE_CHECK(x.ndim == 2, "rmsnorm_backward: x must be [N, d], got " + x.shape_str());
  const int64_t n = x.size(0), d = x.size(1);
  check_shape(dx, {n, d}, "rmsnorm_backward: dx");
  check_shape(dy, {n, d}, "rmsnorm_backward: dy");
  check_shape(dw, {d}, "rmsnorm_backward: dw");
  check_shape(w, {d}, "rmsnorm_backward: w");
  check_shape(rstd, {n}, "rmsnorm_backward: rstd");
  check_same_dtype(dx, x, "rmsnorm_backward: dx, x");
  check_same_dtype(dy, x, "rmsnorm_backward: dy, x");
  check_same_dtype(w, x, "rmsnorm_backward: w, x");
  check_acc_dtype(dw, x, "rmsnorm_backward: dw");
  check_acc_dtype(rstd, x, "rmsnorm_backward: rstd");
}

}  // namespace moe
