// RMSNorm on the CPU: y = w * x * rstd with rstd = 1/sqrt(mean(x^2) + eps) saved per row for the
// backward. Row statistics accumulate in double whatever the storage dtype, so f32 training gets
// statistics at least as good as the fp32 the spec asks for. Rows are independent (parallel over
// rows); the weight gradient sums over rows, so it is parallel over column blocks instead and adds
// the rows in order, which keeps it race-free and bitwise the same for any thread count.
// The fused residual variants (add_rmsnorm_forward, rmsnorm_backward_add) run the same row code
// with the add folded in, so they are the references of the CUDA fusions.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/norm_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/norm.hpp"

namespace moe::cpu {
namespace {

constexpr int64_t kColumnBlock = 64;  // columns per dw task

// 1 / sqrt(mean(x^2) + eps) of one row x: [d].
template <class T>
double row_rstd(const T* x, int64_t d, double eps) {
  double ss = 0;
  for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(x[j]) * static_cast<double>(x[j]);
  return 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
}

// dx = [residual +] rstd * (w*dy - x * rstd^2 * mean(w*dy*x)) for one row; residual may be null.
// With a residual the sum is formed in double and rounded once. dx may alias dy or residual: the
// row's mean is taken before any element is written, and each element is read before it is.
template <class T>
void row_dx(T* dx, const T* dy, const T* x, const T* w, const T* residual, double rstd, int64_t d) {
  double m = 0;
  for (int64_t j = 0; j < d; ++j)
    m += static_cast<double>(w[j]) * static_cast<double>(dy[j]) * static_cast<double>(x[j]);
  m /= static_cast<double>(d);
  const double c = rstd * rstd * m;
  for (int64_t j = 0; j < d; ++j) {
    const double g = rstd * (static_cast<double>(w[j]) * dy[j] - static_cast<double>(x[j]) * c);
    dx[j] = static_cast<T>(residual ? static_cast<double>(residual[j]) + g : g);
  }
}

// y, rstd = RMSNorm(x) for rows [0, n), h = x + r stored first when r is not null (rounded into T
// as add rounds it; the norm then reads the stored h, so the result is bitwise add + norm).
template <class T>
void norm_rows(T* py, T* pr, T* ph, const T* px, const T* prr, const T* pw, int64_t n, int64_t d,
               double eps) {
#pragma omp parallel for if (parallel_worth(n * d))
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = px + i * d;
    if (prr) {
      T* hi = ph + i * d;
      const T* ri = prr + i * d;
      for (int64_t j = 0; j < d; ++j) hi[j] = xi[j] + ri[j];
      xi = hi;
    }
    T* yi = py + i * d;
    const double r = row_rstd(xi, d, eps);
    pr[i] = static_cast<T>(r);
    for (int64_t j = 0; j < d; ++j) yi[j] = static_cast<T>(pw[j] * (xi[j] * r));
  }
}

// dw += sum_n dy * x * rstd, then dx for every row (residual may be null). dw goes first: it reads
// dy, which dx may alias.
template <class T>
void backward_rows(T* pdx, T* pdw, const T* pdy, const T* px, const T* pw, const T* pr,
                   const T* pres, int64_t n, int64_t d) {
  // Rows in order within each column block.
  const int64_t blocks = (d + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for if (parallel_worth(n * d))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t c0 = b * kColumnBlock, c1 = std::min(d, c0 + kColumnBlock);
    double acc[kColumnBlock] = {};
    for (int64_t i = 0; i < n; ++i) {
      const double r = pr[i];
      for (int64_t c = c0; c < c1; ++c)
        acc[c - c0] += static_cast<double>(pdy[i * d + c]) * static_cast<double>(px[i * d + c]) * r;
    }
    for (int64_t c = c0; c < c1; ++c) pdw[c] += static_cast<T>(acc[c - c0]);
  }
#pragma omp parallel for if (parallel_worth(n * d))
  for (int64_t i = 0; i < n; ++i)
    row_dx(pdx + i * d, pdy + i * d, px + i * d, pw, pres ? pres + i * d : nullptr,
           static_cast<double>(pr[i]), d);
}

}  // namespace

// y: [N, d], rstd: [N], x: [N, d], w: [d]
void rmsnorm_forward(Ctx& ctx, Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) {
  check_rmsnorm_forward_args(y, rstd, x, w);
  dispatch_float(x.dtype, "rmsnorm_forward", [&](auto zero) {
    using T = decltype(zero);
    norm_rows<T>(y.ptr<T>(), rstd.ptr<T>(), nullptr, x.ptr<T>(), nullptr, w.ptr<T>(), x.size(0),
                 x.size(1), eps);
  });
}

// h = x + r; y, rstd = RMSNorm(h). h, y, x, r: [N, d], rstd: [N], w: [d]
void add_rmsnorm_forward(Ctx& ctx, Tensor h, Tensor y, Tensor rstd, Tensor x, Tensor r, Tensor w,
                         double eps) {
  check_add_rmsnorm_forward_args(h, y, rstd, x, r, w);
  dispatch_float(x.dtype, "add_rmsnorm_forward", [&](auto zero) {
    using T = decltype(zero);
    norm_rows<T>(y.ptr<T>(), rstd.ptr<T>(), h.ptr<T>(), x.ptr<T>(), r.ptr<T>(), w.ptr<T>(),
                 x.size(0), x.size(1), eps);
  });
}

// dx: [N, d] (overwritten), dw: [d] (+=), dy, x: [N, d], w: [d], rstd: [N]
void rmsnorm_backward(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd) {
  check_rmsnorm_backward_args(dx, dw, dy, x, w, rstd);
  dispatch_float(x.dtype, "rmsnorm_backward", [&](auto zero) {
    using T = decltype(zero);
    backward_rows<T>(dx.ptr<T>(), dw.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), w.ptr<T>(), rstd.ptr<T>(),
                     nullptr, x.size(0), x.size(1));
  });
}

// dx = residual + (rmsnorm_backward's dx), dw += as rmsnorm_backward. dx may alias residual or dy.
void rmsnorm_backward_add(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                          Tensor rstd, Tensor residual) {
  check_rmsnorm_backward_add_args(dx, dw, dy, x, w, rstd, residual);
  dispatch_float(x.dtype, "rmsnorm_backward_add", [&](auto zero) {
    using T = decltype(zero);
    backward_rows<T>(dx.ptr<T>(), dw.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), w.ptr<T>(), rstd.ptr<T>(),
                     residual.ptr<T>(), x.size(0), x.size(1));
  });
}

}  // namespace moe::cpu
