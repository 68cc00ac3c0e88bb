// Tests of the router's fused gate matmul on the CPU (router_logits_forward / _backward): logits =
// x w^T with x in any float dtype and w, logits, dlogits, dw in acc_dtype(x).
// - Forward and backward against a naive double reference on random non-zero inputs in all four
//   dtypes, within the textbook error bound of a recursive sum of m terms in acc_dtype (about
//   m u sum|t|, u = 2^-24 for fp32, 2^-53 for f64) plus, for dx, one rounding to x's dtype (u_x
//   |dx|).
// - Accumulation: dx and dw start non-zero, so "+=" and dx's single rounding are both exercised.
// - f64 central finite differences of dot(r, logits) in x and w (the op is linear in each: rtol
//   1e-7), bitwise determinism across thread counts, and the argument checks' messages.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "common/float16.hpp"
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
