// The CPU backend's matmul: BLAS gemm, single-threaded, with large products cut into blocks that
// run on OpenMP threads.
//
// Why not let OpenBLAS thread itself: its pthread pool and OpenMP's threads then both spin on the
// same cores (the tiny config trained ~3x slower on 2 threads than on 1). So BLAS is set to one
// thread and gemm() splits the work:
// - by rows of C (rows of op(A)) or columns of C (columns of op(B)), whichever side is longer,
//   when that side is long enough: each block re-packs the other operand, so blocks are at least
//   kGemmMinSide wide;
// - else by the inner dimension K (the dw = dy^T x products: small M, N, long K): block 0 adds into
//   C with the caller's beta, the others write scratch products that are then added in block order.
// The cut depends only on (M, N, K), never on the thread count, and every block is one BLAS call
// with fixed arguments, so results are bitwise the same for any thread count. (That needs the fixed
// cut: OpenBLAS picks kernels by shape - small-matrix and "direct" paths - so a split that followed
// the thread count changed the rounding in about half of the shapes tried.)
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/cpu_common.hpp"

namespace moe::cpu {
namespace {

constexpr int64_t kGemmBlockWork = 1 << 21;  // multiply-adds per block, at least
constexpr int64_t kGemmMinSide = 128;        // rows, columns or K per block, at least
constexpr int64_t kGemmMaxBlocks = 64;       // rows / columns cuts
constexpr int64_t kGemmMaxInnerBlocks = 16;  // K cuts (each but the first needs an M x N scratch)
constexpr int64_t kGemmAlign = 16;           // block lengths round up to this (the kernels' tile)
static_assert(2 * kGemmBlockWork >= kParallelMinWork, "a cut gemm must be worth a region");

void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, float alpha,
               const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
               int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k,
               double alpha, const double* a, int64_t lda, const double* b, int64_t ldb,
               double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// Scratch of the K cut, one per calling thread, kept between calls (no page faults per call).
template <class T>
std::vector<T>& inner_scratch() {
  static thread_local std::vector<T> s;
  return s;
}

template <class T>
void gemm_impl(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
               int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  init_blas_threads();
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  const GemmBlocks g = gemm_blocks(m, n, k);
  if (g.axis == GemmBlocks::whole) {
    blas_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const bool threads = !omp_in_parallel();  // count > 1: at least 2 * kGemmBlockWork, worth it
  if (g.axis != GemmBlocks::inner) {
    const bool rows = g.axis == GemmBlocks::rows;
#pragma omp parallel for schedule(static) if (threads)
    for (int64_t i = 0; i < g.count; ++i) {
      const int64_t lo = i * g.step, len = std::min(g.step, (rows ? m : n) - lo);
      if (rows)  // rows lo.. of C are rows lo.. of op(A)
        blas_gemm(ta, tb, len, n, k, alpha, trans_a ? a + lo : a + lo * lda, lda, b, ldb, beta,
                  c + lo * ldc, ldc);
      else  // columns lo.. of C are columns lo.. of op(B)
        blas_gemm(ta, tb, m, len, k, alpha, a, lda, trans_b ? b + lo * ldb : b + lo, ldb, beta,
                  c + lo, ldc);
    }
    return;
  }
  // K cut: C = (alpha op(A)_0 op(B)_0 + beta C) + S_1 + S_2 + ..., S_i = alpha op(A)_i op(B)_i.
  std::vector<T>& scratch = inner_scratch<T>();
  const int64_t mn = m * n;
  if (scratch.size() < static_cast<size_t>((g.count - 1) * mn))
    scratch.resize(static_cast<size_t>((g.count - 1) * mn));
  T* s = scratch.data();
#pragma omp parallel for schedule(static) if (threads)
  for (int64_t i = 0; i < g.count; ++i) {
    const int64_t lo = i * g.step, len = std::min(g.step, k - lo);
    const T* ai = trans_a ? a + lo * lda : a + lo;  // columns lo.. of op(A)
    const T* bi = trans_b ? b + lo : b + lo * ldb;  // rows lo.. of op(B)
    if (i == 0)
      blas_gemm(ta, tb, m, n, len, alpha, ai, lda, bi, ldb, beta, c, ldc);
    else
      blas_gemm(ta, tb, m, n, len, alpha, ai, lda, bi, ldb, T(0), s + (i - 1) * mn, n);
  }
#pragma omp parallel for schedule(static) if (threads && parallel_worth(mn * (g.count - 1)))
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 1; i < g.count; ++i) {  // in block order
      const T* si = s + (i - 1) * mn + r * n;
      T* cr = c + r * ldc;
      for (int64_t j = 0; j < n; ++j) cr[j] += si[j];
    }
}

}  // namespace

void init_blas_threads() {
  static const bool done = [] {
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(1);
#endif
    return true;
  }();
  (void)done;
}

GemmBlocks gemm_blocks(int64_t m, int64_t n, int64_t k) {
  const int64_t want = m * n * k / kGemmBlockWork;  // blocks the work is worth
  if (want < 2) return {GemmBlocks::whole, 0, 1};
  // Cuts `len` into at most `most` blocks of at least kGemmMinSide, or reports it cannot.
  auto cut = [](int64_t len, int64_t most) -> std::pair<int64_t, int64_t> {
    const int64_t count = std::min(most, len / kGemmMinSide);
    if (count < 2) return {0, 1};
    const int64_t step = ((len + count - 1) / count + kGemmAlign - 1) / kGemmAlign * kGemmAlign;
    return {step, (len + step - 1) / step};
  };
  const GemmBlocks::Axis side = m >= n ? GemmBlocks::rows : GemmBlocks::cols;
  auto [step, count] = cut(std::max(m, n), std::min(want, kGemmMaxBlocks));
  if (count > 1) return {side, step, count};
  std::tie(step, count) = cut(k, std::min(want, kGemmMaxInnerBlocks));
  if (count > 1) return {GemmBlocks::inner, step, count};
  return {GemmBlocks::whole, 0, 1};
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm_impl<float>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc) {
  gemm_impl<double>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace moe::cpu
