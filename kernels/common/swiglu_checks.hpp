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

// The weighted SwiGLU ops: every tensor in `others` is like `like` ([R, F]); each of `row_stats`
// (row_w, and drow_w in the backward) is [R] in acc_dtype(like). Returns F.
inline int64_t check_swiglu_weighted_args(const Tensor& like,
                                          std::initializer_list<const Tensor*> others,
                                          std::initializer_list<const char*> names,
                                          std::initializer_list<const Tensor*> row_stats,
                                          std::initializer_list<const char*> row_names,
                                          const char* op) {
  MOE_CHECK(like.ndim == 2, std::string(op) + ": gate must be [R, F], got " + like.shape_str());
  check_like(like, others, names, op);
  auto name = row_names.begin();
  for (const Tensor* t : row_stats) {
    const std::string what = std::string(op) + ": " + *name++;
    check_row_stat(*t, like.size(0), like, what.c_str());
  }
  return like.size(1);
}

}  // namespace moe
