// Test helpers: owning host buffers behind Tensor views, seeded random fills (never zeros),
// and the central finite-difference gradient check used by every op's backward test.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "catch.hpp"
#include "moe/ops/common.hpp"

namespace moe::test {

inline Ctx cpu_ctx() { return Ctx{}; }

// An owning host buffer of T with a Tensor view of the given shape.
template <class T>
struct Buf {
  std::vector<T> v;
  Tensor t;
  Buf() = default;
  explicit Buf(std::initializer_list<int64_t> dims) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    v.assign(static_cast<size_t>(n), T(0));
    t = Tensor(v.data(), dtype_of<T>(), Device{}, dims);
  }
  Buf(const Buf& o) : v(o.v), t(o.t) { t.data = v.data(); }
  Buf& operator=(const Buf& o) {
    v = o.v;
    t = o.t;
    t.data = v.data();
    return *this;
  }
  operator Tensor() const { return t; }
  T& operator[](size_t i) { return v[i]; }
  const T& operator[](size_t i) const { return v[i]; }
  size_t size() const { return v.size(); }
};

// Uniform in [lo, hi), seeded.
template <class T>
void fill_uniform(Buf<T>& b, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  for (auto& x : b.v) x = static_cast<T>(u(rng));
}

// Checks analytic[i] == d loss / d x[i] by central differences, perturbing x in place.
// Compares |a - n| <= atol + rtol * max(|a|, |n|) for every element; reports the worst.
inline void check_gradient(std::vector<double>& x, const std::vector<double>& analytic,
                           const std::function<double()>& loss, double h = 1e-6,
                           double rtol = 1e-5, double atol = 1e-8, const char* what = "") {
  REQUIRE(x.size() == analytic.size());
  double worst = 0;
  size_t worst_i = 0;
  double worst_a = 0, worst_n = 0;
  bool ok = true;
  for (size_t i = 0; i < x.size(); ++i) {
    double x0 = x[i];
    x[i] = x0 + h;
    double lp = loss();
    x[i] = x0 - h;
    double lm = loss();
    x[i] = x0;
    double num = (lp - lm) / (2 * h);
    double err = std::fabs(num - analytic[i]);
    double bound = atol + rtol * std::max(std::fabs(num), std::fabs(analytic[i]));
    if (err > bound) ok = false;
    double rel = err / bound;
    if (rel > worst) {
      worst = rel;
      worst_i = i;
      worst_a = analytic[i];
      worst_n = num;
    }
  }
  INFO(what << ": worst element " << worst_i << " analytic " << worst_a << " numeric " << worst_n
            << " (error / bound = " << worst << ")");
  CHECK(ok);
}

// sum_i w[i] * y[i]: the scalar a backward test differentiates (w random, so every output counts).
inline double dot(const std::vector<double>& w, const std::vector<double>& y) {
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += w[i] * y[i];
  return s;
}

}  // namespace moe::test
