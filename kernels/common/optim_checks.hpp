// Argument checks of the optim ops, shared by the CPU (kernels/cpu/optim.cpp) and CUDA
// (kernels/cuda/optim.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device.
#pragma once
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"
#include "moe/ops/optim.hpp"

namespace moe {

// g, m, v: as many elements as p, of p's dtype; a.step >= 1; a.norm_sq empty or a 1-element f64
// tensor on p's device; a.compute_out empty or as many elements as p, bf16 / f16 / f32, on p's
// device.
inline void check_adamw_step_args(const Tensor& p, const Tensor& g, const Tensor& m,
                                  const Tensor& v, const AdamWArgs& a) {
  const int64_t n = p.numel();
  MOE_CHECK(g.numel() == n && m.numel() == n && v.numel() == n,
            "adamw_step: p " + p.shape_str() + ", g " + g.shape_str() + ", m " + m.shape_str() +
                ", v " + v.shape_str() + " differ in size");
  check_same_dtype(g, p, "adamw_step: g, p");
  check_same_dtype(m, p, "adamw_step: m, p");
  check_same_dtype(v, p, "adamw_step: v, p");
  MOE_CHECK(a.step >= 1, "adamw_step: step is 1-based, got " + std::to_string(a.step));
  if (!a.norm_sq.empty()) {
    MOE_CHECK(a.norm_sq.dtype == DType::f64 && a.norm_sq.numel() == 1,
              "adamw_step: norm_sq must be a 1-element f64 tensor, got " +
                  std::string(dtype_name(a.norm_sq.dtype)) + " " + a.norm_sq.shape_str());
    MOE_CHECK(a.norm_sq.device == p.device,
              "adamw_step: norm_sq is on " + a.norm_sq.device.str() + ", p on " + p.device.str());
  }
  if (!a.compute_out.empty()) {
    const Tensor& c = a.compute_out;
    MOE_CHECK(c.numel() == n, "adamw_step: compute_out " + c.shape_str() + " and p " +
                                  p.shape_str() + " differ in size");
    MOE_CHECK(c.dtype == DType::bf16 || c.dtype == DType::f16 || c.dtype == DType::f32,
              std::string("adamw_step: compute_out must be bf16, f16 or f32, got ") +
                  dtype_name(c.dtype));
    MOE_CHECK(c.device == p.device,
              "adamw_step: compute_out is on " + c.device.str() + ", p on " + p.device.str());
  }
}

}  // namespace moe
