// Tests of the router's fused gate matmul on the CPU (router_logits_forward / _backward): logits =
// x w^T with x in any float dtype and w, logits, dlogits, dw in acc_dtype(x).
// - Forward and backward against a naive double reference on random non-zero inputs in all four
//   dtypes, within the textbook error bound of a recursive sum of m terms in acc_dtype (about
//   m u sum|t|, u = 2^-24 for fp32, 2^-53 for f64) plus, for dx, one rounding to x's dtype (u_x
//   |dx|).
// - Accumulation: dx and dw start non-zero, so "+=" and dx's single rounding are both exercised.
// - f64 central finite differences of dot(r, logits) in x and w (the op is linear in each: rtol
//   1e-7), bitwise determinism across thread counts, and the argument checks' messages.
// - The bf16 split of the wider router matmuls (split_bf16, sum_column_blocks): exact parts, the
//   backward's cross-term algebra in double, the blocks' summation order, bad operands.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "common/float16.hpp"
#include "moe/ops/bf16_split.hpp"
#include "moe/ops/router.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

const DType kAllTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

// Uniform in [lo, hi) with |v| >= 1e-3 (seeded): never zero, also after rounding to 16 bits.
std::vector<double> nonzero_values(size_t n, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) {
    x = u(rng);
    if (std::fabs(x) < 1e-3) x = 0.5;
  }
  return v;
}

// Unit roundoff of a dtype's significand (the largest relative error of one rounding).
double unit_roundoff(DType t) {
  switch (t) {
    case DType::f64:
      return std::ldexp(1.0, -53);
    case DType::f32:
      return std::ldexp(1.0, -24);
    case DType::f16:
      return std::ldexp(1.0, -11);
    default:
      return std::ldexp(1.0, -8);  // bf16
  }
}

// A host tensor in any float dtype (16-bit as raw bits) built from doubles, each rounded once to
// the dtype; values() reads it back exactly.
struct Stored {
  std::vector<uint64_t> bytes;  // 8-byte aligned storage
  Tensor t;
  Stored(DType dt, std::initializer_list<int64_t> dims, const std::vector<double>& v) {
    t = Tensor(nullptr, dt, Device{}, dims);
    REQUIRE(static_cast<int64_t>(v.size()) == t.numel());
    bytes.assign((t.nbytes() + 7) / 8 + 1, 0);
    t.data = bytes.data();
    for (size_t i = 0; i < v.size(); ++i) set(i, v[i]);
  }
  Stored(const Stored&) = delete;
  operator Tensor() const { return t; }
  void set(size_t i, double x) {
    switch (t.dtype) {
      case DType::f64:
        static_cast<double*>(t.data)[i] = x;
        break;
      case DType::f32:
        static_cast<float*>(t.data)[i] = static_cast<float>(x);
        break;
      case DType::f16:
        static_cast<uint16_t*>(t.data)[i] = float16::double_to_f16(x);
        break;
      default:
        static_cast<uint16_t*>(t.data)[i] = float16::double_to_bf16(x);
    }
  }
  double get(size_t i) const {
    switch (t.dtype) {
      case DType::f64:
        return static_cast<const double*>(t.data)[i];
      case DType::f32:
        return static_cast<const float*>(t.data)[i];
      case DType::f16:
        return float16::f16_to_float(static_cast<const uint16_t*>(t.data)[i]);
      default:
        return float16::bf16_to_float(static_cast<const uint16_t*>(t.data)[i]);
    }
  }
  std::vector<double> values() const {
    std::vector<double> v(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = get(i);
    return v;
  }
  std::vector<unsigned char> raw() const {
    const auto* p = static_cast<const unsigned char*>(t.data);
    return std::vector<unsigned char>(p, p + t.nbytes());
  }
};

struct Shape {
  int64_t n, d, e;
};

// One call's inputs in dtype dt (x, dx in dt; w, dlogits, dw in acc_dtype(dt)), all non-zero.
struct Case {
  DType dt, acc;
  Shape s;
  Stored x, w, dl, dx, dw, logits;
  Case(DType t, Shape sh, uint64_t seed)
      : dt(t),
        acc(acc_dtype(t)),
        s(sh),
        x(t, {sh.n, sh.d}, nonzero_values(size_t(sh.n * sh.d), seed)),
        w(acc, {sh.e, sh.d}, nonzero_values(size_t(sh.e * sh.d), seed + 1, -0.5, 0.5)),
        dl(acc, {sh.n, sh.e}, nonzero_values(size_t(sh.n * sh.e), seed + 2)),
        dx(t, {sh.n, sh.d}, nonzero_values(size_t(sh.n * sh.d), seed + 3)),
        dw(acc, {sh.e, sh.d}, nonzero_values(size_t(sh.e * sh.d), seed + 4)),
        logits(acc, {sh.n, sh.e}, std::vector<double>(size_t(sh.n * sh.e), std::nan(""))) {}
};

const Shape kShapes[] = {{7, 13, 5}, {33, 64, 8}, {1, 1, 1}, {20, 300, 3}, {5, 9, 64}};

}  // namespace

TEST_CASE("router_logits_forward matches a double reference in every dtype", "[router_logits]") {
  Ctx ctx = cpu_ctx();
  for (DType dt : kAllTypes)
    for (const Shape& s : kShapes) {
      INFO(dtype_name(dt) << " N=" << s.n << " d=" << s.d << " E=" << s.e);
      Case c(dt, s, 11 + static_cast<uint64_t>(s.n * s.d));
      router_logits_forward(ctx, c.logits, c.x, c.w);
      const std::vector<double> x = c.x.values(), w = c.w.values(), got = c.logits.values();
      const double u = unit_roundoff(c.acc);
      double worst = 0;
      for (int64_t n = 0; n < s.n; ++n)
        for (int64_t e = 0; e < s.e; ++e) {
          double want = 0, mag = 0;
          for (int64_t k = 0; k < s.d; ++k) {
            want += x[n * s.d + k] * w[e * s.d + k];
            mag += std::fabs(x[n * s.d + k] * w[e * s.d + k]);
          }
          const double err = std::fabs(got[n * s.e + e] - want);
          worst = std::max(worst, err / ((s.d + 1) * u * mag));
        }
      INFO("worst error / bound = " << worst);
      CHECK(worst <= 1.0);
    }
}

TEST_CASE("router_logits_backward accumulates onto dx (one rounding) and dw in every dtype",
          "[router_logits]") {
  Ctx ctx = cpu_ctx();
  for (DType dt : kAllTypes)
    for (const Shape& s : kShapes) {
      INFO(dtype_name(dt) << " N=" << s.n << " d=" << s.d << " E=" << s.e);
      Case c(dt, s, 101 + static_cast<uint64_t>(s.e * s.d));
      const std::vector<double> x = c.x.values(), w = c.w.values(), dl = c.dl.values();
      const std::vector<double> dx0 = c.dx.values(), dw0 = c.dw.values();
      router_logits_backward(ctx, c.dx, c.dw, c.dl, c.x, c.w);
      const std::vector<double> dx = c.dx.values(), dw = c.dw.values();
      const double u = unit_roundoff(c.acc), ux = unit_roundoff(dt);
      double worst_dx = 0, worst_dw = 0;
      for (int64_t n = 0; n < s.n; ++n)
        for (int64_t k = 0; k < s.d; ++k) {
          const size_t i = size_t(n * s.d + k);
          double want = dx0[i], mag = std::fabs(dx0[i]);
          for (int64_t e = 0; e < s.e; ++e) {
            want += dl[n * s.e + e] * w[e * s.d + k];
            mag += std::fabs(dl[n * s.e + e] * w[e * s.d + k]);
          }
          // The sum in acc (E products, then dx0), then one rounding to x's dtype.
          const double bound = (s.e + 2) * u * mag * (1 + ux) + ux * std::fabs(want);
          worst_dx = std::max(worst_dx, std::fabs(dx[i] - want) / bound);
        }
      for (int64_t e = 0; e < s.e; ++e)
        for (int64_t k = 0; k < s.d; ++k) {
          const size_t i = size_t(e * s.d + k);
          double want = dw0[i], mag = std::fabs(dw0[i]);
          for (int64_t n = 0; n < s.n; ++n) {
            want += dl[n * s.e + e] * x[n * s.d + k];
            mag += std::fabs(dl[n * s.e + e] * x[n * s.d + k]);
          }
          worst_dw = std::max(worst_dw, std::fabs(dw[i] - want) / ((s.n + 2) * u * mag));
        }
      INFO("dx worst error / bound = " << worst_dx << ", dw " << worst_dw);
      CHECK(worst_dx <= 1.0);
      CHECK(worst_dw <= 1.0);
    }
}

TEST_CASE("router_logits_backward matches finite differences of the forward (f64)",
          "[router_logits]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 5, d = 7, e = 3;
  Buf<double> x = make<double>({n, d}, nonzero_values(n * d, 21));
  Buf<double> w = make<double>({e, d}, nonzero_values(e * d, 22));
  const std::vector<double> r = nonzero_values(n * e, 23);  // loss = dot(r, logits)
  auto loss = [&] {
    Buf<double> logits({n, e});
    router_logits_forward(ctx, logits, x, w);
    return dot(r, logits.v);
  };
  // Analytic gradients from dlogits = r, accumulated onto non-zero dx, dw.
  const std::vector<double> dx0 = nonzero_values(n * d, 24), dw0 = nonzero_values(e * d, 25);
  Buf<double> dx = make<double>({n, d}, dx0), dw = make<double>({e, d}, dw0);
  Buf<double> dl = make<double>({n, e}, r);
  router_logits_backward(ctx, dx, dw, dl, x, w);
  std::vector<double> gx(dx0.size()), gw(dw0.size());
  for (size_t i = 0; i < gx.size(); ++i) gx[i] = dx[i] - dx0[i];
  for (size_t i = 0; i < gw.size(); ++i) gw[i] = dw[i] - dw0[i];
  check_gradient(x.v, gx, loss, 1e-6, 1e-7, 1e-9, "dx");
  check_gradient(w.v, gw, loss, 1e-6, 1e-7, 1e-9, "dw");
}

TEST_CASE("router_logits ops are bitwise the same for 1, 2 and 3 threads", "[router_logits]") {
  Ctx ctx = cpu_ctx();
  const int saved = omp_get_max_threads();
  for (DType dt : {DType::f32, DType::bf16}) {
    INFO(dtype_name(dt));
    const Shape s{96, 200, 8};  // big enough for the ops' OpenMP regions
    std::vector<std::vector<unsigned char>> logits, dx, dw;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      Case c(dt, s, 7);
      router_logits_forward(ctx, c.logits, c.x, c.w);
      router_logits_backward(ctx, c.dx, c.dw, c.dl, c.x, c.w);
      logits.push_back(c.logits.raw());
      dx.push_back(c.dx.raw());
      dw.push_back(c.dw.raw());
    }
    omp_set_num_threads(saved);
    CHECK(logits[0] == logits[1]);
    CHECK(logits[0] == logits[2]);
    CHECK(dx[0] == dx[1]);
    CHECK(dx[0] == dx[2]);
    CHECK(dw[0] == dw[1]);
    CHECK(dw[0] == dw[2]);
  }
}

TEST_CASE("router_logits ops: an empty d gives zero logits and leaves dx, dw alone",
          "[router_logits]") {
  Ctx ctx = cpu_ctx();
  Stored x(DType::bf16, {3, 0}, {}), w(DType::f32, {2, 0}, {});
  Stored logits(DType::f32, {3, 2}, std::vector<double>(6, 7.0));
  router_logits_forward(ctx, logits, x, w);
  CHECK(logits.values() == std::vector<double>(6, 0.0));
  Stored dx(DType::bf16, {3, 0}, {}), dw(DType::f32, {2, 0}, {});
  Stored dl(DType::f32, {3, 2}, nonzero_values(6, 3));
  CHECK_NOTHROW(router_logits_backward(ctx, dx, dw, dl, x, w));
}

// No dx wanted (the MoD predictor's stop-gradient input): dw gets the same bits as with a dx.
// No experts: a real dx (with a -0) keeps every bit.
TEST_CASE("router_logits_backward: an empty dx updates dw alone; E = 0 leaves dx alone",
          "[router_logits]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 5, d = 7, e = 3;
  Stored x(DType::bf16, {n, d}, nonzero_values(n * d, 21));
  Stored w(DType::f32, {e, d}, nonzero_values(e * d, 22));
  Stored dl(DType::f32, {n, e}, nonzero_values(n * e, 23));
  Stored dx(DType::bf16, {n, d}, nonzero_values(n * d, 24));
  Stored dw_with(DType::f32, {e, d}, nonzero_values(e * d, 25));
  Stored dw_without(DType::f32, {e, d}, nonzero_values(e * d, 25));
  router_logits_backward(ctx, dx, dw_with, dl, x, w);
  router_logits_backward(ctx, Tensor(), dw_without, dl, x, w);
  CHECK(dw_without.values() == dw_with.values());
  CHECK(dw_without.values() != nonzero_values(e * d, 25));  // it did add

  std::vector<double> dx0 = nonzero_values(n * d, 26);
  dx0[3] = -0.0;
  Stored dx_keep(DType::bf16, {n, d}, dx0);
  const std::vector<uint64_t> before = dx_keep.bytes;
  Stored w0(DType::f32, {0, d}, {}), dw0(DType::f32, {0, d}, {}), dl0(DType::f32, {n, 0}, {});
  router_logits_backward(ctx, dx_keep, dw0, dl0, x, w0);
  CHECK(dx_keep.bytes == before);
}

TEST_CASE("router_logits ops reject bad shapes, dtypes and devices with the argument's name",
          "[router_logits]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 4, d = 6, e = 3;
  Stored x(DType::bf16, {n, d}, nonzero_values(n * d, 1));
  Stored w(DType::f32, {e, d}, nonzero_values(e * d, 2));
  Stored logits(DType::f32, {n, e}, nonzero_values(n * e, 3));
  auto forward_error = [&](Tensor lg, Tensor xx, Tensor ww) {
    try {
      router_logits_forward(ctx, lg, xx, ww);
    } catch (const InternalError& err) {
      return std::string(err.what());
    }
    FAIL("expected an InternalError");
    return std::string();
  };
  CHECK_NOTHROW(router_logits_forward(ctx, logits, x, w));
  Stored w_wide(DType::f32, {e, d + 1}, nonzero_values(e * (d + 1), 4));
  CHECK_THAT(forward_error(logits, x, w_wide), Catch::Contains("disagree on d"));
  CHECK_THAT(forward_error(logits, x.t.view({n, d, 1}), w),
             Catch::Contains("router_logits_forward: x must be [N, d]"));
  Stored logits_wide(DType::f32, {n, e + 1}, nonzero_values(n * (e + 1), 5));
  CHECK_THAT(forward_error(logits_wide, x, w),
             Catch::Contains("router_logits_forward: logits: shape [4, 4], expected [4, 3]"));
  Stored w16(DType::bf16, {e, d}, nonzero_values(e * d, 6));
  CHECK_THAT(forward_error(logits, x, w16),
             Catch::Contains("router_logits_forward: w: dtype bf16, expected f32"));
  Stored logits64(DType::f64, {n, e}, nonzero_values(n * e, 7));
  CHECK_THAT(forward_error(logits64, x, w),
             Catch::Contains("router_logits_forward: logits: dtype f64, expected f32"));
  Tensor x_int = x.t;
  x_int.dtype = DType::i32;
  x_int.shape = {n, d / 2};
  Stored w_half_d(DType::f32, {e, d / 2}, nonzero_values(e * d / 2, 8));
  CHECK_THAT(forward_error(logits, x_int, w_half_d),
             Catch::Contains("x must be f32, f64, f16 or bf16, got i32"));
  Tensor logits_gpu = logits.t;
  logits_gpu.device = Device{DeviceType::cuda, 0};
  CHECK_THAT(forward_error(logits_gpu, x, w),
             Catch::Contains("router_logits_forward: logits is on cuda:0, the op runs on cpu"));

  Stored dx(DType::bf16, {n, d}, nonzero_values(n * d, 9));
  Stored dw(DType::f32, {e, d}, nonzero_values(e * d, 10));
  Stored dl(DType::f32, {n, e}, nonzero_values(n * e, 11));
  auto backward_error = [&](Tensor gx, Tensor gw, Tensor gl, Tensor ww) {
    try {
      router_logits_backward(ctx, gx, gw, gl, x, ww);
    } catch (const InternalError& err) {
      return std::string(err.what());
    }
    FAIL("expected an InternalError");
    return std::string();
  };
  CHECK_NOTHROW(router_logits_backward(ctx, dx, dw, dl, x, w));
  Stored dx32(DType::f32, {n, d}, nonzero_values(n * d, 12));
  CHECK_THAT(backward_error(dx32, dw, dl, w),
             Catch::Contains("router_logits_backward: dx, x: dtype f32 vs bf16"));
  Stored dw_short(DType::f32, {e - 1, d}, nonzero_values((e - 1) * d, 13));
  CHECK_THAT(backward_error(dx, dw_short, dl, w),
             Catch::Contains("router_logits_backward: dw: shape [2, 6], expected [3, 6]"));
  Stored dl64(DType::f64, {n, e}, nonzero_values(n * e, 14));
  CHECK_THAT(backward_error(dx, dw, dl64, w),
             Catch::Contains("router_logits_backward: dlogits: dtype f64, expected f32"));
  Stored dl_t(DType::f32, {e, n}, nonzero_values(n * e, 15));
  CHECK_THAT(backward_error(dx, dw, dl_t, w),
             Catch::Contains("router_logits_backward: dlogits: shape [3, 4], expected [4, 3]"));
  CHECK_THAT(backward_error(dx, dw, dl, w_wide), Catch::Contains("disagree on d"));
  Tensor dw_gpu = dw.t;
  dw_gpu.device = Device{DeviceType::cuda, 0};
  CHECK_THAT(backward_error(dx, dw_gpu, dl, w),
             Catch::Contains("router_logits_backward: dw is on cuda:0, the op runs on cpu"));
}

// ---- the bf16 split of the wide router matmuls (moe/ops/bf16_split.hpp, router_matmul.cpp) ----

namespace {

float bf(uint16_t b) {
  return float16::bf16_to_float(b);
}

// fp32 values over many binades (|v| from 2^-100 to 2^100, both signs), with the awkward ones:
// zeros, bf16 ties and near-ties, values one bf16 ulp apart, a float near bf16's largest.
std::vector<float> split_inputs(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> mant(1.0, 2.0), expo(-100.0, 100.0);
  std::vector<float> v(n);
  for (float& x : v)
    x = static_cast<float>((rng() & 1 ? -1 : 1) *
                           std::ldexp(mant(rng), int(std::floor(expo(rng)))));
  const float special[] = {0.0f,
                           -0.0f,
                           1.0f + 0x1p-8f,
                           1.0f + 0x1p-8f + 0x1p-20f,
                           -1.0f - 0x1p-8f - 0x1p-23f,
                           1.0f + 0x1p-16f,
                           1.0f - 0x1p-24f,
                           3.3e38f,
                           -0x1p-100f,
                           1.0f / 3.0f};
  for (size_t i = 0; i < sizeof special / sizeof special[0] && i < n; ++i) v[i] = special[i];
  return v;
}

}  // namespace

TEST_CASE("split_bf16: three bf16 parts add up to the fp32 value exactly, in the order asked",
          "[bf16_split]") {
  Ctx ctx = cpu_ctx();
  const int64_t rows = 37, cols = 53;
  const std::vector<float> src = split_inputs(rows * cols, 7);
  const std::vector<int> parts = {1, 1, 2, 1, 2, 3};
  const int64_t p = static_cast<int64_t>(parts.size());
  std::vector<uint16_t> dst(rows * p * cols, 0xFFFF);
  split_bf16(ctx, Tensor(dst.data(), DType::bf16, Device{}, {rows, p * cols}),
             Tensor(const_cast<float*>(src.data()), DType::f32, Device{}, {rows, cols}), parts);
  size_t bad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = src[r * cols + c];
      auto at = [&](int64_t j) { return dst[(r * p + j) * cols + c]; };
      const uint16_t p1 = at(0), p2 = at(2), p3 = at(5);
      // p1 is v rounded to nearest even, p2 the rounded error, p3 the rest
      bad += p1 != float16::float_to_bf16(v);
      bad += p2 != float16::float_to_bf16(v - bf(p1));
      // exact: in double, where the three parts' sum cannot round
      bad += double(bf(p1)) + double(bf(p2)) + double(bf(p3)) != double(v);
      // the copies of a part are the same part
      bad += at(1) != p1 || at(3) != p1 || at(4) != p2;
    }
  CHECK(bad == 0);
}

TEST_CASE(
    "split_bf16 products: the six cross terms give dy w to fp32 accuracy, blocks 0 + 2 + 5 "
    "of A^T x give dy^T x exactly",
    "[bf16_split]") {
  // The router backward's algebra (router_matmul.cpp), in double from the CPU op's parts: A = [a1
  // a1 a2 a1 a2 a3] and B = [b1; b2; b1; b3; b2; b1].
  Ctx ctx = cpu_ctx();
  const int64_t n = 29, e = 11, d = 23;
  std::vector<float> dy = split_inputs(n * e, 3), w = split_inputs(e * d, 4);
  for (float& v : dy) v = std::ldexp(std::fmod(v, 1.0f), -3);  // gradient-sized, any sign
  for (float& v : w) v = std::fmod(v, 1.0f) * 0.05f;
  std::vector<uint16_t> a(n * 6 * e), b(6 * e * d);
  split_bf16(ctx, Tensor(a.data(), DType::bf16, Device{}, {n, 6 * e}),
             Tensor(dy.data(), DType::f32, Device{}, {n, e}), {1, 1, 2, 1, 2, 3});
  split_bf16(ctx, Tensor(b.data(), DType::bf16, Device{}, {1, 6 * e * d}),
             Tensor(w.data(), DType::f32, Device{}, {1, e * d}), {1, 2, 1, 3, 2, 1});
  std::vector<double> x(n * d);
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (double& v : x) v = bf(float16::float_to_bf16(static_cast<float>(u(rng))));  // bf16 x
  double worst_dx = 0, worst_dw = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) {
      double exact = 0, split = 0, scale = 0;
      for (int64_t i = 0; i < e; ++i) {
        exact += double(dy[r * e + i]) * w[i * d + c];
        scale += std::fabs(double(dy[r * e + i]) * w[i * d + c]);
      }
      for (int64_t k = 0; k < 6 * e; ++k) split += double(bf(a[r * 6 * e + k])) * bf(b[k * d + c]);
      worst_dx = std::max(worst_dx, std::fabs(split - exact) / scale);
    }
  for (int64_t i = 0; i < e; ++i)
    for (int64_t c = 0; c < d; ++c) {
      double exact = 0, split = 0;
      for (int64_t r = 0; r < n; ++r) {
        exact += double(dy[r * e + i]) * x[r * d + c];
        for (int blk : {0, 2, 5}) split += double(bf(a[r * 6 * e + blk * e + i])) * x[r * d + c];
      }
      worst_dw = std::max(worst_dw, std::fabs(split - exact));
    }
  INFO("worst dx error " << worst_dx << " of sum |dy w|, worst dw error " << worst_dw);
  CHECK(worst_dx <= 0x1p-22);  // the three terms left out: below 3 * 2^-24 of each product
  CHECK(worst_dw <= 1e-15);    // exact parts: only double's rounding of the sums
}

TEST_CASE("sum_column_blocks adds the blocks in the order given, then onto y", "[bf16_split]") {
  Ctx ctx = cpu_ctx();
  // block values 1e8, 1, -1e8: (1e8 + 1) - 1e8 = 0 in fp32 (1e8 + 1 rounds to 1e8), while
  // (1e8 - 1e8) + 1 = 1: the order shows in the result
  std::vector<float> t = {1e8f, 1.0f, -1e8f, 2e8f, 3.0f, -2e8f};  // [2, 3] blocks of C = 1
  std::vector<float> y = {10.0f, 20.0f};
  sum_column_blocks(ctx, Tensor(y.data(), DType::f32, Device{}, {2, 1}),
                    Tensor(t.data(), DType::f32, Device{}, {2, 3}), {0, 1, 2}, true);
  CHECK(y == std::vector<float>{10.0f, 20.0f});  // the sums are 0: y + 0
  sum_column_blocks(ctx, Tensor(y.data(), DType::f32, Device{}, {2, 1}),
                    Tensor(t.data(), DType::f32, Device{}, {2, 3}), {0, 2, 1}, false);
  CHECK(y == std::vector<float>{1.0f, 3.0f});
  sum_column_blocks(ctx, Tensor(y.data(), DType::f32, Device{}, {1, 2}),
                    Tensor(t.data(), DType::f32, Device{}, {1, 6}), {2, 0}, true);  // C = 2
  CHECK(y == std::vector<float>{1.0f + (3.0f + 1e8f), 3.0f + (-2e8f + 1.0f)});
}

TEST_CASE("split_bf16 and sum_column_blocks reject bad operands with the argument's name",
          "[bf16_split]") {
  Ctx ctx = cpu_ctx();
  std::vector<float> f(64);
  std::vector<uint16_t> h(64);
  const Tensor src(f.data(), DType::f32, Device{}, {2, 4}),
      dst(h.data(), DType::bf16, Device{}, {2, 8});
  CHECK_THROWS_WITH(split_bf16(ctx, dst, src, {1, 4}), Catch::Contains("a part is 1, 2 or 3"));
  CHECK_THROWS_WITH(split_bf16(ctx, dst, src, {1, 2, 3}), Catch::Contains("split_bf16: dst"));
  CHECK_THROWS_WITH(split_bf16(ctx, Tensor(f.data(), DType::f32, Device{}, {2, 8}), src, {1, 2}),
                    Catch::Contains("dst must be bf16"));
  CHECK_THROWS_WITH(split_bf16(ctx, dst, src, std::vector<int>(9, 1)),
                    Catch::Contains("1 to 8 parts"));
  const Tensor y(f.data(), DType::f32, Device{}, {2, 3});
  CHECK_THROWS_WITH(
      sum_column_blocks(ctx, y, Tensor(f.data() + 8, DType::f32, Device{}, {2, 8}), {0}, false),
      Catch::Contains("not whole column blocks"));
  CHECK_THROWS_WITH(
      sum_column_blocks(ctx, y, Tensor(f.data() + 8, DType::f32, Device{}, {2, 6}), {0, 2}, false),
      Catch::Contains("block 2 outside"));
}
