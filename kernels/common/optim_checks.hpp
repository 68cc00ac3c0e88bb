// Argument checks of the optim ops, shared by the CPU (kernels/cpu/optim.cpp) and CUDA
// (kernels/cuda/optim.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device.
#pragma once
#include <initializer_list>
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"
#include "moe/ops/optim.hpp"

namespace moe {

// g, m, v: as many elements as p, of p's dtype; a.step >= 1; a.norm_sq empty or a 1-element f64
// tensor on p's device; a.grad_sq_out likewise, and only without norm_sq; a.compute_out empty or as
// many elements as p, bf16 / f16 / f32, on p's device.
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
  if (!a.grad_sq_out.empty()) {
    MOE_CHECK(a.grad_sq_out.dtype == DType::f64 && a.grad_sq_out.numel() == 1,
              "adamw_step: grad_sq_out must be a 1-element f64 tensor, got " +
                  std::string(dtype_name(a.grad_sq_out.dtype)) + " " + a.grad_sq_out.shape_str());
    MOE_CHECK(
        a.grad_sq_out.device == p.device,
        "adamw_step: grad_sq_out is on " + a.grad_sq_out.device.str() + ", p on " + p.device.str());
    MOE_CHECK(a.norm_sq.empty(),
              "adamw_step: grad_sq_out with norm_sq (the norm is known before the update then)");
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

// hi bf16 and lo u16 of one element count n, on one device, and (when given) f32 tensors of n
// elements there too (the adamw_step_split and split_master_decode operands).
inline void check_split_master_args(const Tensor& hi, const Tensor& lo,
                                    std::initializer_list<const Tensor*> f32s, const char* op) {
  const int64_t n = hi.numel();
  MOE_CHECK(hi.dtype == DType::bf16 && lo.dtype == DType::u16,
            std::string(op) + ": hi must be bf16 and lo u16, got " + dtype_name(hi.dtype) + ", " +
                dtype_name(lo.dtype));
  MOE_CHECK(lo.numel() == n && lo.device == hi.device,
            std::string(op) + ": hi " + hi.shape_str() + " on " + hi.device.str() + ", lo " +
                lo.shape_str() + " on " + lo.device.str());
  for (const Tensor* t : f32s)
    MOE_CHECK(t->dtype == DType::f32 && t->numel() == n && t->device == hi.device,
              std::string(op) + ": expected f32 " + hi.shape_str() + " on " + hi.device.str() +
                  ", got " + dtype_name(t->dtype) + " " + t->shape_str() + " on " +
                  t->device.str());
}

// adamw_step_split: the split operands, f32 m, v, an f32 or bf16 g of their size (bf16: the
// experts' gradients under train.bf16_expert_grads) and adamw_step's own checks on m, v.
inline void check_adamw_step_split_args(const Tensor& hi, const Tensor& lo, const Tensor& g,
                                        const Tensor& m, const Tensor& v, const AdamWArgs& a) {
  check_split_master_args(hi, lo, {&m, &v}, "adamw_step_split");
  MOE_CHECK((g.dtype == DType::f32 || g.dtype == DType::bf16) && g.numel() == hi.numel() &&
                g.device == hi.device,
            "adamw_step_split: g must be f32 or bf16 " + hi.shape_str() + " on " + hi.device.str() +
                ", got " + dtype_name(g.dtype) + " " + g.shape_str() + " on " + g.device.str());
  MOE_CHECK(a.compute_out.empty(),
            "adamw_step_split: compute_out must be empty (hi is the compute copy)");
  check_adamw_step_args(m, m, m, v, a);  // (g's dtype may differ from the moments': above)
}

}  // namespace moe
