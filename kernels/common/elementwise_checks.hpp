// Argument checks of the elementwise ops, shared by the CPU (kernels/cpu/elementwise.cpp) and CUDA
// (kernels/cuda/elementwise.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device.
#pragma once
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// a and b hold as many elements, of one dtype.
inline void check_numel(const Tensor& a, const Tensor& b, const char* what) {
  MOE_CHECK(a.numel() == b.numel(), std::string(what) + ": " + a.shape_str() + " vs " +
                                        b.shape_str() + " (element counts differ)");
  check_same_dtype(a, b, what);
}

// out: a 1-element f64 tensor.
inline void check_sum_squares_args(const Tensor& out) {
  MOE_CHECK(out.dtype == DType::f64 && out.numel() == 1,
            "sum_squares: out must be a 1-element f64 tensor, got " +
                std::string(dtype_name(out.dtype)) + " " + out.shape_str());
}

inline bool is_float_dtype(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16;
}

// out: a 1-element f64 tensor on x's device; x: any float dtype.
inline void check_accumulate_sum_args(const Tensor& out, const Tensor& x) {
  MOE_CHECK(out.dtype == DType::f64 && out.numel() == 1,
            "accumulate_sum: out must be a 1-element f64 tensor, got " +
                std::string(dtype_name(out.dtype)) + " " + out.shape_str());
  MOE_CHECK(out.device == x.device,
            "accumulate_sum: out is on " + out.device.str() + ", x on " + x.device.str());
  MOE_CHECK(is_float_dtype(x.dtype),
            std::string("accumulate_sum: x must be a float tensor, got ") + dtype_name(x.dtype));
}

// dst, src: as many elements, each of any float dtype (the dtypes may differ).
inline void check_convert_args(const Tensor& dst, const Tensor& src) {
  MOE_CHECK(dst.numel() == src.numel(), "convert: dst " + dst.shape_str() + " vs src " +
                                            src.shape_str() + " (element counts differ)");
  MOE_CHECK(is_float_dtype(dst.dtype) && is_float_dtype(src.dtype),
            std::string("convert: dst and src must be float tensors, got ") +
                dtype_name(dst.dtype) + " and " + dtype_name(src.dtype));
}

}  // namespace moe
