// The error bounds of the GPU op tests against the CPU reference ops (test_gpu_dense.cpp,
// test_gpu_grouped.cpp): every storage dtype's ulp, the fp32 arithmetic's error, and the checks
// that compare a GPU output with the CPU op's f64 result under them. The bounds themselves are
// derived at the top of test_gpu_dense.cpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "test_util.hpp"

namespace moe::test {

inline const DType kDtypes[] = {DType::f32, DType::bf16, DType::f16, DType::f64};

inline double ulp(DType dt) {
  switch (dt) {
    case DType::bf16:
      return std::ldexp(1.0, -7);
    case DType::f16:
      return std::ldexp(1.0, -10);
    case DType::f32:
      return std::ldexp(1.0, -23);
    default:
      return std::ldexp(1.0, -52);
  }
}
inline double acc_eps(DType dt) {
  return dt == DType::f64 ? 1e-13 : 1e-6;
}

struct Tol {
  double rtol, atol;
};
inline Tol elementwise_tol(DType dt) {
  return {2 * ulp(dt), 2 * ulp(dt)};
}
inline Tol pointwise_tol(DType dt) {
  return {2 * ulp(dt) + 4 * acc_eps(dt), 4 * acc_eps(dt)};
}
inline Tol sum_tol(DType dt, int64_t k) {
  const double s = std::sqrt(static_cast<double>(std::max<int64_t>(k, 1)));
  return {2 * ulp(dt) + acc_eps(dt) * s, 4 * acc_eps(dt) * s};
}

inline DeviceTensor ids_on_device(const std::vector<int32_t>& v) {
  DeviceTensor t(DType::i32, {static_cast<int64_t>(v.size())});
  upload_i32(t, v);
  return t;
}

inline void check_close(const std::string& what, DType dt, const std::vector<double>& got,
                        const std::vector<double>& want, Tol tol) {
  const double r = worst_ratio(got, want, tol.rtol, tol.atol);
  INFO(what << " [" << dtype_name(dt) << "]: worst |got - want| / (atol + rtol |want|) = " << r
            << " (rtol " << tol.rtol << ", atol " << tol.atol << ", " << got.size() << " vs "
            << want.size() << " elements)");
  CHECK(r <= 1.0);
}

// For cuBLAS outputs that accumulate (beta = 1) in a 16-bit dtype: cuBLAS may round the product
// to the output dtype before adding the old value, a second rounding of size ulp * |product|,
// which the single-rounding bound above cannot absorb when product and old value cancel.
inline void check_close_accumulated(const std::string& what, DType dt,
                                    const std::vector<double>& got, const std::vector<double>& want,
                                    const std::vector<double>& before, Tol tol) {
  double worst = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double product = std::fabs(want[i] - before[i]);
    const double bound = tol.atol + tol.rtol * std::fabs(want[i]) + ulp(dt) * product;
    worst = std::max(worst, std::isnan(got[i]) ? 1e300 : std::fabs(got[i] - want[i]) / bound);
  }
  INFO(what << " [" << dtype_name(dt) << "]: worst error / bound = " << worst);
  CHECK(got.size() == want.size());
  CHECK(worst <= 1.0);
}

// A sum of two parts, each rounded to dt before they are added: the single-rounding bound plus
// ulp(dt) of each part's size (the parts may cancel).
inline void check_close_rounded_parts(const std::string& what, DType dt,
                                      const std::vector<double>& got,
                                      const std::vector<double>& want,
                                      const std::vector<double>& part1,
                                      const std::vector<double>& part2, Tol tol) {
  double worst = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double bound = tol.atol + tol.rtol * std::fabs(want[i]) +
                         ulp(dt) * (std::fabs(part1[i]) + std::fabs(part2[i]));
    worst = std::max(worst, std::isnan(got[i]) ? 1e300 : std::fabs(got[i] - want[i]) / bound);
  }
  INFO(what << " [" << dtype_name(dt) << "]: worst error / bound = " << worst);
  CHECK(got.size() == want.size());
  CHECK(worst <= 1.0);
}

inline void check_exact(const std::string& what, DType dt, const std::vector<double>& got,
                        const std::vector<double>& want) {
  INFO(what << " [" << dtype_name(dt) << "]");
  CHECK(got == want);
}

// Bound for a row's dot product accumulated in acc_dtype from inputs both sides hold alike:
// rel * sum_j |term_j| (the terms' own rounding and the summation's), per row.
inline void check_row_dots(const std::string& what, DType dt, const std::vector<double>& got,
                           const std::vector<double>& want, const std::vector<double>& abs_sum,
                           double rel) {
  double worst = 0;
  for (size_t r = 0; r < want.size(); ++r) {
    const double bound = rel * abs_sum[r] + 1e-30;
    worst = std::max(worst, std::isnan(got[r]) ? 1e300 : std::fabs(got[r] - want[r]) / bound);
  }
  INFO(what << " [" << dtype_name(dt) << "]: worst error / bound = " << worst);
  CHECK(got.size() == want.size());
  CHECK(worst <= 1.0);
}

// sum_j |dh silu(gate) up| of each row: the scale of the routing weight's gradient.
inline std::vector<double> row_abs_dots(const Buf<double>& dh, const Buf<double>& gate,
                                        const Buf<double>& up, int64_t r, int64_t f) {
  std::vector<double> s(static_cast<size_t>(r), 0.0);
  for (int64_t i = 0; i < r * f; ++i) {
    const double g = gate.v[i];
    s[i / f] += std::fabs(dh.v[i] * g / (1 + std::exp(-g)) * up.v[i]);
  }
  return s;
}

}  // namespace moe::test
