// Elementwise CPU ops over whole tensors: fill, copy, add, axpy, scale and the sum of squares used
// by global gradient-norm clipping. They see tensors as flat arrays of numel() elements, so any
// shape works as long as the element counts agree. Loops are OpenMP-parallel above a size threshold
// (below it the thread start-up costs more than the work). sum_squares reduces in fixed-size chunks
// whose partial sums are added in chunk order, so its result is bitwise the same for any thread
// count.
#include <algorithm>
#include <string>
#include <vector>

#include "common/elementwise_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/elementwise.hpp"

namespace moe::cpu {
namespace {

constexpr int64_t kReduceChunk = 1 << 14;  // fixed chunk of the deterministic reduction

// sum(x^2) over x[begin, end), accumulated in double.
template <class T>
double sum_squares_range(const T* x, int64_t begin, int64_t end) {
  double s = 0;
  for (int64_t i = begin; i < end; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return s;
}

}  // namespace

void fill(Ctx& ctx, Tensor x, double value) {
  dispatch_float(x.dtype, "fill", [&](auto zero) {
    using T = decltype(zero);
    T* p = x.ptr<T>();
    const int64_t n = x.numel();
    const T v = static_cast<T>(value);
#pragma omp parallel for if (parallel_worth(n))
    for (int64_t i = 0; i < n; ++i) p[i] = v;
  });
}

void copy(Ctx& ctx, Tensor dst, Tensor src) {
  check_numel(dst, src, "copy: dst, src");
  if (dst.data == src.data || dst.numel() == 0) return;
  std::copy_n(static_cast<const char*>(src.data), src.nbytes(), static_cast<char*>(dst.data));
}

// out = a + b; out may alias a or b (each element is read before it is written).
void add(Ctx& ctx, Tensor out, Tensor a, Tensor b) {
  check_numel(out, a, "add: out, a");
  check_numel(out, b, "add: out, b");
  dispatch_float(out.dtype, "add", [&](auto zero) {
    using T = decltype(zero);
    T* po = out.ptr<T>();
    const T* pa = a.ptr<T>();
    const T* pb = b.ptr<T>();
    const int64_t n = out.numel();
#pragma omp parallel for if (parallel_worth(n))
    for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
  });
}

void axpy(Ctx& ctx, Tensor y, Tensor x, double alpha) {
  check_numel(y, x, "axpy: y, x");
  dispatch_float(y.dtype, "axpy", [&](auto zero) {
    using T = decltype(zero);
    T* py = y.ptr<T>();
    const T* px = x.ptr<T>();
    const int64_t n = y.numel();
    const T a = static_cast<T>(alpha);
#pragma omp parallel for if (parallel_worth(n))
    for (int64_t i = 0; i < n; ++i) py[i] += a * px[i];
  });
}

void scale(Ctx& ctx, Tensor x, double alpha) {
  dispatch_float(x.dtype, "scale", [&](auto zero) {
    using T = decltype(zero);
    T* p = x.ptr<T>();
    const int64_t n = x.numel();
    const T a = static_cast<T>(alpha);
#pragma omp parallel for if (parallel_worth(n))
    for (int64_t i = 0; i < n; ++i) p[i] *= a;
  });
}

// out: [1] f64 (+=), x: any float tensor.
void sum_squares(Ctx& ctx, Tensor out, Tensor x) {
  check_sum_squares_args(out);
  dispatch_float(x.dtype, "sum_squares", [&](auto zero) {
    using T = decltype(zero);
    const T* p = x.ptr<T>();
    const int64_t n = x.numel();
    const int64_t chunks = (n + kReduceChunk - 1) / kReduceChunk;
    std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
#pragma omp parallel for if (parallel_worth(n))
    for (int64_t c = 0; c < chunks; ++c)
      partial[c] = sum_squares_range(p, c * kReduceChunk, std::min(n, (c + 1) * kReduceChunk));
    double total = 0;
    for (double s : partial) total += s;  // in chunk order: thread-count independent
    out.ptr<double>()[0] += total;
  });
}

}  // namespace moe::cpu
