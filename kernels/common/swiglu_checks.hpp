// Argument checks of the swiglu ops, shared by the CPU (kernels/cpu/swiglu.cpp) and CUDA
// (kernels/cuda/swiglu.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device.
#pragma once
#include <initializer_list>
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

inline bool same_shape(const Tensor& a, const Tensor& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i]) return false;
  return true;
}

// Every tensor has the shape and dtype of `like`.
inline void check_like(const Tensor& like, std::initializer_list<const Tensor*> others,
                       std::initializer_list<const char*> names, const char* op) {
  auto name = names.begin();
  for (const Tensor* t : others) {
    const std::string what = std::string(op) + ": " + *name++;
    MOE_CHECK(same_shape(*t, like),
              what + " has shape " + t->shape_str() + ", expected " + like.shape_str());
    check_same_dtype(*t, like, what.c_str());
  }
}

}  // namespace moe
