// Shared helpers of the CPU reference ops: float-type dispatch, the OpenMP work threshold, BLAS
// matmuls in float or double (split over OpenMP threads with BLAS itself single-threaded), the
// double-accumulated dot product, the thread-count independent sum and the max-shifted
// log-sum-exp of a row.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "moe/ops/common.hpp"

namespace moe::cpu {

// Calls fn.template operator()<T>() with T = float or double from the tensor's dtype. Since
// acc_dtype(T) == T for both, the statistics and parameter gradients that ops keep in acc_dtype
// (rstd, lse, dw, ...; checked by kernels/common) are read and written as T on the CPU.
template <class Fn>
void dispatch_float(DType t, const char* op, Fn&& fn) {
  if (t == DType::f32) return fn(float{});
  if (t == DType::f64) return fn(double{});
  throw InternalError(std::string(op) + ": the CPU backend computes in f32 or f64, got " +
                      dtype_name(t));
}

// Below this many scalar operations an OpenMP region costs more than it saves (thread wake-up,
// barrier; far worse when cores are shared). Use: #pragma omp parallel for if (parallel_worth(n))
// Measured on 2 idle cores with hot threads, a region breaks even near 4K elementwise adds; the
// threshold is 16x that because a thread that has gone to sleep, or whose core is busy with another
// process, costs far more.
constexpr int64_t kParallelMinWork = 1 << 16;
inline bool parallel_worth(int64_t work) {
  return work >= kParallelMinWork;
}
// What one exp, log or sqrt-class call counts for in such a work estimate (a sigmoid measured ~7
// elementwise adds).
constexpr int64_t kExpWork = 8;

// Makes BLAS single-threaded, once (the first call; cheap after). gemm() calls it: it splits big
// matmuls over OpenMP threads itself, so OpenBLAS's own thread pool never competes with OpenMP's.
void init_blas_threads();

// How gemm() cuts a matmul into blocks, from its shape alone (never the thread count).
struct GemmBlocks {
  enum Axis { whole, rows, cols, inner } axis;  // cut C's rows, C's columns, or the sum over K
  int64_t step, count;                          // rows / columns / K per block, number of blocks
};
GemmBlocks gemm_blocks(int64_t m, int64_t n, int64_t k);

// C[M,N] = alpha * op(A) op(B) + beta * C, row-major; op = transpose when the flag is set.
// Large products are cut into blocks by gemm_blocks and the blocks run on OpenMP threads (unless
// already inside a parallel region), each one single-threaded BLAS call. The cut depends only on
// the shape, so results are bitwise the same for any thread count.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc);

template <class T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// silu(a) = a sigmoid(a) and its derivative sigmoid(a) (1 + a (1 - sigmoid(a))), in T (the SwiGLU
// ops, the MoD predictor's head).
template <class T>
inline T silu(T a) {
  return a * sigmoid(a);
}
template <class T>
inline T silu_grad(T a) {
  const T s = sigmoid(a);
  return s * (T(1) + a * (T(1) - s));
}

// sum_i a[i] * b[i] over n elements, accumulated in double (attention and decode share it so that
// decode reproduces the training forward term for term).
template <class T>
double dot_acc(const T* a, const T* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return s;
}

constexpr int kSumBlocks = 64;  // fixed blocking of the deterministic sums

// sum_{i < n} f(i) in double, in a blocking that does not depend on the thread count (partials are
// added in block order), so the result is bitwise the same for any thread count; f(i) costs about
// item_work scalar operations.
template <class F>
double deterministic_sum(int64_t n, int64_t item_work, F&& f) {
  double partial[kSumBlocks];
#pragma omp parallel for schedule(static) if (parallel_worth(n * item_work))
  for (int b = 0; b < kSumBlocks; ++b) {
    const int64_t begin = n * b / kSumBlocks, end = n * (b + 1) / kSumBlocks;
    double s = 0;
    for (int64_t i = begin; i < end; ++i) s += f(i);
    partial[b] = s;
  }
  double total = 0;
  for (double s : partial) total += s;
  return total;
}

// log(sum_j exp(l_j)), max-shifted, in double.  l: [n]
template <class T>
double logsumexp_row(const T* l, int64_t n) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, static_cast<double>(l[j]));
  double s = 0;
  for (int64_t j = 0; j < n; ++j) s += std::exp(static_cast<double>(l[j]) - mx);
  return mx + std::log(s);
}

}  // namespace moe::cpu
