// RMSNorm on the CPU: y = w * x * rstd with rstd = 1/sqrt(mean(x^2) + eps) saved per row for the
// backward. Row statistics accumulate in double whatever the storage dtype, so f32 training gets
// statistics at least as good as the fp32 the spec asks for. Rows are independent (parallel over
// rows); the weight gradient sums over rows, so it is parallel over column blocks instead and adds
// the rows in order, which keeps it race-free and bitwise the same for any thread count.
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

// dx = rstd * (w*dy - x * rstd^2 * mean(w*dy*x)) for one row.
template <class T>
void row_dx(T* dx, const T* dy, const T* x, const T* w, double rstd, int64_t d) {
  double m = 0;
  for (int64_t j = 0; j < d; ++j)
    m += static_cast<double>(w[j]) * static_cast<double>(dy[j]) * static_cast<double>(x[j]);
  m /= static_cast<double>(d);
  const double c = rstd * rstd * m;
  for (int64_t j = 0; j < d; ++j)
    dx[j] =
        static_cast<T>(rstd * (static_cast<double>(w[j]) * dy[j] - static_cast<double>(x[j]) * c));
}

}  // namespace

// y: [N, d], rstd: [N], x: [N, d], w: [d]
void rmsnorm_forward(Ctx& ctx, Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) {
  check_rmsnorm_forward_args(y, rstd, x, w);
  const int64_t n = x.size(0), d = x.size(1);
  dispatch_float(x.dtype, "rmsnorm_forward", [&](auto zero) {
    using T = decltype(zero);
    const T* px = x.ptr<T>();
    const T* pw = w.ptr<T>();
    T* py = y.ptr<T>();
    T* pr = rstd.ptr<T>();
#pragma omp parallel for if (parallel_worth(n * d))
    for (int64_t i = 0; i < n; ++i) {
      const T* xi = px + i * d;
      T* yi = py + i * d;
      const double r = row_rstd(xi, d, eps);
      pr[i] = static_cast<T>(r);
      for (int64_t j = 0; j < d; ++j) yi[j] = static_cast<T>(pw[j] * (xi[j] * r));
    }
  });
}

// dx: [N, d] (overwritten), dw: [d] (+=), dy, x: [N, d], w: [d], rstd: [N]
void rmsnorm_backward(Ctx& ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd) {
  check_rmsnorm_backward_args(dx, dw, dy, x, w, rstd);
  const int64_t n = x.size(0), d = x.size(1);
  dispatch_float(x.dtype, "rmsnorm_backward", [&](auto zero) {
    using T = decltype(zero);
    const T* px = x.ptr<T>();
    const T* pw = w.ptr<T>();
    const T* pdy = dy.ptr<T>();
    const T* pr = rstd.ptr<T>();
    T* pdx = dx.ptr<T>();
    T* pdw = dw.ptr<T>();
#pragma omp parallel for if (parallel_worth(n * d))
    for (int64_t i = 0; i < n; ++i)
      row_dx(pdx + i * d, pdy + i * d, px + i * d, pw, static_cast<double>(pr[i]), d);

    // dw += sum_n dy * x * rstd, rows in order within each column block.
    const int64_t blocks = (d + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for if (parallel_worth(n * d))
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c0 = b * kColumnBlock, c1 = std::min(d, c0 + kColumnBlock);
      double acc[kColumnBlock] = {};
      for (int64_t i = 0; i < n; ++i) {
        const double r = pr[i];
        for (int64_t c = c0; c < c1; ++c)
          acc[c - c0] +=
              static_cast<double>(pdy[i * d + c]) * static_cast<double>(px[i * d + c]) * r;
      }
      for (int64_t c = c0; c < c1; ++c) pdw[c] += static_cast<T>(acc[c - c0]);
    }
  });
}

}  // namespace moe::cpu
