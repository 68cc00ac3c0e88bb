// GPU tests of the mixed-precision helpers against the CPU ops: convert for every pair of float
// dtypes (f32, f64, f16, bf16), overwriting (into a poisoned dst) and accumulating, and
// accumulate_sum (the on-device loss sum). convert rounds once on both backends with the same
// arithmetic (float, or double when a side is f64), so the GPU must equal the CPU bit for bit,
// on random values and on chosen ones: 16-bit ties, values just off a tie by less than an f32 ulp
// (where rounding twice through f32 would differ), f16 overflow and subnormals.
// accumulate_sum: |gpu - cpu| <= 1e-12 (|out0| + |scale| sum|x|) (both sum in double, in different
// orders) and bitwise repeatable.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "moe/ops/elementwise.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

const DType kDtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

double p2(int e) {
  return std::ldexp(1.0, e);
}

// Random values of src's dtype over several binades, then chosen ones (rounded to src's dtype):
// ties and near-ties of both 16-bit formats, f16 overflow and subnormals, bf16-only range.
std::vector<double> convert_inputs(DType src, uint64_t seed) {
  std::vector<double> v = rounded_random_values(src, 3000, seed, -4.0, 4.0);
  // small magnitudes (down to f16 subnormals): random values scaled by 2^-14, re-rounded
  // (rounded_random_values itself keeps |x| >= 1e-3)
  std::vector<double> small = rounded_random_values(src, 1000, seed + 1, -4.0, 4.0);
  for (double& x : small) x *= p2(-14);
  small = round_to(src, small);
  v.insert(v.end(), small.begin(), small.end());
  const std::vector<double> chosen = {1 + p2(-8),
                                      1 + 3 * p2(-8),
                                      1 + p2(-8) + p2(-40),
                                      1 + p2(-8) - p2(-40),  // bf16 ties
                                      1 + p2(-11),
                                      1 + 3 * p2(-11),
                                      1 + p2(-11) + p2(-40),
                                      -(1 + p2(-11) - p2(-40)),  // f16 ties
                                      65504,
                                      65519,
                                      65520,
                                      65520 - p2(-30),
                                      70000,
                                      -1e5,  // overflow
                                      p2(-24),
                                      p2(-25),
                                      3 * p2(-25),
                                      1e-7,
                                      -3e-8,
                                      1e-30,  // subnormal
                                      3e38,
                                      -1e-38,
                                      1.0 / 3,
                                      -2.0 / 3};
  const auto c = round_to(src, chosen);
  v.insert(v.end(), c.begin(), c.end());
  return v;
}

}  // namespace

TEST_CASE("gpu convert: every dtype pair, = and +=, bitwise equal to the CPU", "[gpu][convert]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  uint64_t seed = 1;
  for (DType src_dt : kDtypes) {
    for (DType dst_dt : kDtypes) {
      for (bool accumulate : {false, true}) {
        INFO("convert " << dtype_name(src_dt) << " -> " << dtype_name(dst_dt)
                        << (accumulate ? " (+=)" : " (=)"));
        const std::vector<double> src = convert_inputs(src_dt, seed++);
        const int64_t n = static_cast<int64_t>(src.size());
        const std::vector<double> dst0 = rounded_random_values(dst_dt, src.size(), seed++);

        HostAny hsrc(src_dt, src),
            hdst(dst_dt, accumulate ? dst0 : std::vector<double>(src.size()));
        cpu::convert(cpu, hdst.t, hsrc.t, accumulate);
        const std::vector<double> want = hdst.values();

        DeviceTensor gsrc = on_device(src_dt, {n}, src);
        DeviceTensor gdst = accumulate ? on_device(dst_dt, {n}, dst0) : poisoned(dst_dt, {n});
        convert(gpu, gdst, gsrc, accumulate);
        const std::vector<double> got = download(gdst);
        REQUIRE(got.size() == want.size());
        size_t mismatches = 0, first = 0;
        for (size_t i = 0; i < got.size(); ++i)
          if (!(got[i] == want[i])) {
            if (mismatches++ == 0) first = i;
          }
        INFO(mismatches << " mismatches; first at " << first << ": src " << src[first] << " got "
                        << got[first] << " want " << want[first]);
        CHECK(mismatches == 0);
      }
    }
  }
}

// The kernel's 16-byte path takes groups of 8 elements when both pointers are 16-byte aligned,
// the scalar loop the rest: a tail of 1-7 elements, and whole tensors whose view starts one
// element into a buffer (so one side or both are misaligned). Every case bitwise the CPU op.
TEST_CASE("gpu convert: 16-byte groups, tails and misaligned views, bitwise equal to the CPU",
          "[gpu][convert]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  uint64_t seed = 100;
  const std::pair<int64_t, int64_t> views[] = {{0, 0}, {1, 0}, {0, 1}, {1, 1}};  // src, dst at
  for (DType src_dt : kDtypes)
    for (DType dst_dt : kDtypes)
      for (bool accumulate : {false, true})
        for (int64_t n : {int64_t{4021}, int64_t{4024}, int64_t{5}})
          for (auto [src_at, dst_at] : views) {
            INFO("convert " << dtype_name(src_dt) << " -> " << dtype_name(dst_dt)
                            << (accumulate ? " (+=)" : " (=)") << ", n " << n << ", src at "
                            << src_at << ", dst at " << dst_at);
            std::vector<double> src = convert_inputs(src_dt, seed++);
            src.resize(static_cast<size_t>(n));
            const std::vector<double> dst0 = rounded_random_values(dst_dt, src.size(), seed++);
            HostAny hsrc(src_dt, src),
                hdst(dst_dt, accumulate ? dst0 : std::vector<double>(src.size()));
            cpu::convert(cpu, hdst.t, hsrc.t, accumulate);
            const std::vector<double> want = hdst.values();

            // buffers one element longer, viewed from element src_at / dst_at
            std::vector<double> src_buf(src.size() + 1, 0.5), dst_buf(src.size() + 1, 0.25);
            std::copy(src.begin(), src.end(), src_buf.begin() + src_at);
            std::copy(dst0.begin(), dst0.end(), dst_buf.begin() + dst_at);
            DeviceTensor gsrc = on_device(src_dt, {n + 1}, src_buf);
            DeviceTensor gdst =
                accumulate ? on_device(dst_dt, {n + 1}, dst_buf) : poisoned(dst_dt, {n + 1});
            convert(gpu, gdst.t.rows(dst_at, dst_at + n), gsrc.t.rows(src_at, src_at + n),
                    accumulate);
            const std::vector<double> all = download(gdst);
            const std::vector<double> got(all.begin() + dst_at, all.begin() + dst_at + n);
            size_t mismatches = 0;
            for (size_t i = 0; i < got.size(); ++i) mismatches += !(got[i] == want[i]);
            CHECK(mismatches == 0);
            // the element outside the view is left alone (the poison's NaN or dst_buf's 0.25)
            const double outside = all[dst_at == 0 ? static_cast<size_t>(n) : 0];
            if (accumulate)
              CHECK(outside == round_to(dst_dt, {0.25})[0]);
            else
              CHECK(std::isnan(outside));
          }
}

TEST_CASE("gpu convert: the 16-bit rounding of chosen f64 values", "[gpu][convert]") {
  // Just above / below a tie by 2^-40 (under half an f32 ulp): one rounding, not two.
  Ctx gpu = gpu_ctx();
  const std::vector<double> v = {1 + p2(-8) + p2(-40), 1 + p2(-8) - p2(-40), 1 + p2(-8)};
  DeviceTensor src = on_device(DType::f64, {3}, v), dst = poisoned(DType::bf16, {3});
  convert(gpu, dst, src, false);
  CHECK(download(dst) == std::vector<double>{1 + p2(-7), 1.0, 1.0});
  const std::vector<double> h = {1 + p2(-11) + p2(-40), 1 + p2(-11) - p2(-40), 70000};
  DeviceTensor hsrc = on_device(DType::f64, {3}, h), hdst = poisoned(DType::f16, {3});
  convert(gpu, hdst, hsrc, false);
  const auto got = download(hdst);
  CHECK(got[0] == 1 + p2(-10));
  CHECK(got[1] == 1.0);
  CHECK(std::isinf(got[2]));
}

TEST_CASE("gpu convert: mismatched sizes and index tensors throw", "[gpu][convert]") {
  Ctx gpu = gpu_ctx();
  DeviceTensor a(DType::f32, {4}), b(DType::bf16, {5}), i(DType::i32, {4});
  CHECK_THROWS_WITH(convert(gpu, a, b, false), Catch::Contains("element counts differ"));
  CHECK_THROWS_WITH(convert(gpu, a, i, true), Catch::Contains("float tensors"));
}

TEST_CASE("gpu accumulate_sum: out[0] += scale * sum(x), in double, deterministically",
          "[gpu][elementwise]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  for (DType dt : kDtypes) {
    for (int64_t n : {int64_t{1}, int64_t{77 * 40}, int64_t{300001}}) {
      INFO("accumulate_sum [" << dtype_name(dt) << "] n = " << n);
      const auto v = rounded_random_values(dt, static_cast<size_t>(n), 50 + n, 0.0, 3.0);
      const double scale = -0.37;
      Buf<double> hx = host({n}, v), hout = host({1}, {2.5});
      cpu::accumulate_sum(cpu, hout, hx, scale);
      double abs_sum = 0;
      for (double x : v) abs_sum += std::fabs(x);
      const double tol = 1e-12 * (2.5 + std::fabs(scale) * abs_sum);

      DeviceTensor x = on_device(dt, {n}, v), out = on_device(DType::f64, {1}, {2.5});
      accumulate_sum(gpu, out, x, scale);
      const double got = download(out)[0];
      CHECK(std::fabs(got - hout[0]) <= tol);
      upload(out, {2.5});
      accumulate_sum(gpu, out, x, scale);
      CHECK(download(out)[0] == got);    // bitwise repeatable
      accumulate_sum(gpu, out, x, 1.0);  // accumulates, any scale
      CHECK(std::fabs(download(out)[0] - (got + (got - 2.5) / scale)) <=
            2 * tol / std::fabs(scale));
    }
  }
  DeviceTensor x(DType::f32, {4}), out32(DType::f32, {1});
  CHECK_THROWS_WITH(accumulate_sum(gpu, out32, x, 1.0),
                    Catch::Contains("accumulate_sum: out must be a 1-element f64 tensor"));
  double host_out = 0;
  CHECK_THROWS_WITH(accumulate_sum(gpu, Tensor(&host_out, DType::f64, Device{}, {1}), x, 1.0),
                    Catch::Contains("accumulate_sum: out is on cpu"));
}
