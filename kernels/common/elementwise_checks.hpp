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

}  // namespace moe
