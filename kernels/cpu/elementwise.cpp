// Elementwise CPU ops over whole tensors: fill, copy, add, axpy, scale, the sum of squares used by
// global gradient-norm clipping, the scaled sum that keeps loss sums on the device, and the dtype
// conversion of mixed precision. They see tensors as flat arrays of numel() elements, so any shape
// works as long as the element counts agree. Loops are OpenMP-parallel above a size threshold
// (below it the thread start-up costs more than the work). sum_squares and accumulate_sum reduce in
// fixed-size chunks whose partial sums are added in chunk order, so their results are bitwise the
// same for any thread count.
//
// convert is the one CPU op that reads and writes f16 / bf16 (as raw 16-bit patterns, through
// common/float16.hpp): it is the oracle of the CUDA convert, and it lets a CPU test build exactly
// the 16-bit tensors a GPU run sees. It computes in float, or in double when either side is f64,
// exactly as the CUDA kernel does, and rounds once into dst's dtype.
#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "common/elementwise_checks.hpp"
#include "cpu/convert_element.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/elementwise.hpp"

namespace moe::cpu {
namespace {

constexpr int64_t kReduceChunk = 1 << 14;  // fixed chunk of the deterministic reduction

// sum(x^2) over x[begin, end), accumulated in double (16-bit storage widened exactly).
template <class T>
double sum_squares_range(const T* x, int64_t begin, int64_t end) {
  double s = 0;
  for (int64_t i = begin; i < end; ++i) {
    const double v = widen<double>(x[i]);
    s += v * v;
  }
  return s;
}

// sum(x) over x[begin, end), accumulated in double.
template <class T>
double sum_range(const T* x, int64_t begin, int64_t end) {
  double s = 0;
  for (int64_t i = begin; i < end; ++i) s += static_cast<double>(x[i]);
  return s;
}

// sum over [0, n) of range_sum(begin, end) in chunks of kReduceChunk, the chunk partials added in
// chunk order: the same bits for any thread count.
template <class F>
double chunked_sum(int64_t n, F&& range_sum) {
  const int64_t chunks = (n + kReduceChunk - 1) / kReduceChunk;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
#pragma omp parallel for if (parallel_worth(n))
  for (int64_t c = 0; c < chunks; ++c)
    partial[c] = range_sum(c * kReduceChunk, std::min(n, (c + 1) * kReduceChunk));
  double total = 0;
  for (double s : partial) total += s;  // in chunk order: thread-count independent
  return total;
}

// ---- convert (the element conversion itself: cpu/convert_element.hpp) ---------------------------

template <class D, class S>
void convert_impl(D* dst, const S* src, int64_t n, bool accumulate) {
  using W = convert_math_t<D, S>;
  if (accumulate) {
#pragma omp parallel for if (parallel_worth(n))
    for (int64_t i = 0; i < n; ++i) dst[i] = narrow<D>(widen<W>(dst[i]) + widen<W>(src[i]));
  } else {
#pragma omp parallel for if (parallel_worth(n))
    for (int64_t i = 0; i < n; ++i) dst[i] = convert_element<D>(src[i]);
  }
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
  // (any float storage, as the CUDA op: bf16 expert gradients, train.bf16_expert_grads)
  dispatch_any_float(x.dtype, "sum_squares", [&](auto zero) {
    using T = decltype(zero);
    const T* p = static_cast<const T*>(x.data);  // (ptr<T> knows no Half / BFloat16)
    out.ptr<double>()[0] += chunked_sum(
        x.numel(), [&](int64_t begin, int64_t end) { return sum_squares_range(p, begin, end); });
  });
}

// out: [1] f64 (+= scale * sum), x: an f32 or f64 tensor.
void accumulate_sum(Ctx& ctx, Tensor out, Tensor x, double scale) {
  check_accumulate_sum_args(out, x);
  dispatch_float(x.dtype, "accumulate_sum", [&](auto zero) {
    using T = decltype(zero);
    const T* p = x.ptr<T>();
    const double total = chunked_sum(
        x.numel(), [&](int64_t begin, int64_t end) { return sum_range(p, begin, end); });
    out.ptr<double>()[0] += scale * total;
  });
}

// dst (= or +=) src converted; any float dtypes, f16 / bf16 included.
void convert(Ctx& ctx, Tensor dst, Tensor src, bool accumulate) {
  check_convert_args(dst, src);
  const int64_t n = dst.numel();
  if (n == 0 || (!accumulate && dst.data == src.data && dst.dtype == src.dtype)) return;
  dispatch_any_float(dst.dtype, "convert", [&](auto dst_zero) {
    using D = decltype(dst_zero);
    dispatch_any_float(src.dtype, "convert", [&](auto src_zero) {
      using S = decltype(src_zero);
      convert_impl(static_cast<D*>(dst.data), static_cast<const S*>(src.data), n, accumulate);
    });
  });
}

}  // namespace moe::cpu
