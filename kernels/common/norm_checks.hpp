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
                                        const Tensor& x, const Tensor& w, const Tensor& rstd,
                                        const std::string& op = "rmsnorm_backward") {
  MOE_CHECK(x.ndim == 2, op + ": x must be [N, d], got " + x.shape_str());
  const int64_t n = x.size(0), d = x.size(1);
  check_shape(dx, {n, d}, (op + ": dx").c_str());
  check_shape(dy, {n, d}, (op + ": dy").c_str());
  check_shape(dw, {d}, (op + ": dw").c_str());
  check_shape(w, {d}, (op + ": w").c_str());
  check_shape(rstd, {n}, (op + ": rstd").c_str());
  check_same_dtype(dx, x, (op + ": dx, x").c_str());
  check_same_dtype(dy, x, (op + ": dy, x").c_str());
  check_same_dtype(w, x, (op + ": w, x").c_str());
  check_acc_dtype(dw, x, (op + ": dw").c_str());
  check_acc_dtype(rstd, x, (op + ": rstd").c_str());
}

// h, y, x, r: [N, d], w: [d] of one dtype, rstd: [N] in acc_dtype(x)
inline void check_add_rmsnorm_forward_args(const Tensor& h, const Tensor& y, const Tensor& rstd,
                                           const Tensor& x, const Tensor& r, const Tensor& w) {
  MOE_CHECK(x.ndim == 2, "add_rmsnorm_forward: x must be [N, d], got " + x.shape_str());
  const int64_t n = x.size(0), d = x.size(1);
  check_shape(h, {n, d}, "add_rmsnorm_forward: h");
  check_shape(y, {n, d}, "add_rmsnorm_forward: y");
  check_shape(r, {n, d}, "add_rmsnorm_forward: r");
  check_shape(rstd, {n}, "add_rmsnorm_forward: rstd");
  check_shape(w, {d}, "add_rmsnorm_forward: w");
  check_same_dtype(h, x, "add_rmsnorm_forward: h, x");
  check_same_dtype(y, x, "add_rmsnorm_forward: y, x");
  check_same_dtype(r, x, "add_rmsnorm_forward: r, x");
  check_acc_dtype(rstd, x, "add_rmsnorm_forward: rstd");
  check_same_dtype(w, x, "add_rmsnorm_forward: w, x");
  MOE_CHECK(y.numel() == 0 || (y.data != h.data && y.data != x.data && y.data != r.data),
            "add_rmsnorm_forward: y must not alias h, x or r");
}

// rmsnorm_backward's arguments plus residual: [N, d] of x's dtype; dx must not alias x.
inline void check_rmsnorm_backward_add_args(const Tensor& dx, const Tensor& dw, const Tensor& dy,
                                            const Tensor& x, const Tensor& w, const Tensor& rstd,
                                            const Tensor& residual) {
  check_rmsnorm_backward_args(dx, dw, dy, x, w, rstd, "rmsnorm_backward_add");
  check_shape(residual, {x.size(0), x.size(1)}, "rmsnorm_backward_add: residual");
  check_same_dtype(residual, x, "rmsnorm_backward_add: residual, x");
  MOE_CHECK(dx.data != x.data || x.numel() == 0, "rmsnorm_backward_add: dx must not alias x");
}

}  // namespace moe
