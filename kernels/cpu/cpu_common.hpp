// Shared helpers of the CPU reference ops: float-type dispatch and BLAS matmuls in float or double.
#pragma once
#include <cblas.h>

#include <cmath>
#include <cstdint>

#include "moe/ops/common.hpp"

namespace moe::cpu {

// Calls fn.template operator()<T>() with T = float or double from the tensor's dtype.
template <class Fn>
void dispatch_float(DType t, const char* op, Fn&& fn) {
  if (t == DType::f32) return fn(float{});
  if (t == DType::f64) return fn(double{});
  throw InternalError(std::string(op) + ": the CPU backend computes in f32 or f64, got " +
                      dtype_name(t));
}

// C[M,N] = alpha * op(A) op(B) + beta * C, row-major; op = transpose when the flag is set.
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                 int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
                 const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
                 int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// Below this many scalar operations an OpenMP region costs more than it saves (thread wake-up,
// barrier; far worse when cores are shared). Use: #pragma omp parallel for if (parallel_worth(n))
constexpr int64_t kParallelMinWork = 1 << 16;
inline bool parallel_worth(int64_t work) { return work >= kParallelMinWork; }

template <class T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

}  // namespace moe::cpu
