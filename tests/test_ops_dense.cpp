// Tests of the dense CPU ops: elementwise helpers, embedding, RMSNorm, linear / grouped linear and
// SwiGLU / SiLU. Forwards are checked against hand-computed numbers or naive loops, every backward
// against central finite differences in f64 (loss = dot(random w, outputs)), and f32 against f64 on
// random inputs. Gradient-check tolerances: linear maps (embedding, linear, grouped linear) are
// exact up to rounding, so rtol 1e-7; the nonlinear ops (RMSNorm, SwiGLU, SiLU) use rtol 1e-6, well
// above the ~1e-10 truncation + rounding error of h = 1e-6 central differences on O(1) losses.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/embedding.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/norm.hpp"
#include "moe/ops/swiglu.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

std::vector<double> minus(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}

}  // namespace

// ---- elementwise --------------------------------------------------------------------------------

TEST_CASE("elementwise ops compute fill, copy, add, axpy and scale", "[elementwise]") {
  Ctx ctx = cpu_ctx();
  Buf<double> a({2, 3}), b({6}), out({3, 2});
  for (int i = 0; i < 6; ++i) {
    a[i] = i + 1;       // 1..6
    b[i] = 10 * i - 7;  // -7, 3, 13, ...
  }
  add(ctx, out, a, b);
  for (int i = 0; i < 6; ++i) CHECK(out[i] == (i + 1) + (10 * i - 7));
  add(ctx, a, a, b);  // out aliases a
  for (int i = 0; i < 6; ++i) CHECK(a[i] == (i + 1) + (10 * i - 7));
  axpy(ctx, out, b, -0.5);
  for (int i = 0; i < 6; ++i) CHECK(out[i] == (i + 1) + 0.5 * (10 * i - 7));
  scale(ctx, b, 3.0);
  for (int i = 0; i < 6; ++i) CHECK(b[i] == 3.0 * (10 * i - 7));
  copy(ctx, out, b);
  CHECK(out.v == b.v);
  fill(ctx, out, 2.5);
  for (int i = 0; i < 6; ++i) CHECK(out[i] == 2.5);

  Buf<float> f({4});
  fill(ctx, f, -1.25);
  for (int i = 0; i < 4; ++i) CHECK(f[i] == -1.25f);
  Buf<double> wrong({5});
  CHECK_THROWS_AS(add(ctx, out, a, wrong), InternalError);
  CHECK_THROWS_AS(copy(ctx, f, Buf<double>({4})), InternalError);  // dtypes differ
}

TEST_CASE("sum_squares accumulates the sum of squares deterministically", "[elementwise]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 100003;  // several reduction chunks, not a multiple of the chunk
  Buf<float> x({n});
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(-1, 1);
  double want = 0;
  for (auto& v : x.v) {
    v = static_cast<float>(u(rng));
    want += static_cast<double>(v) * v;
  }
  Buf<double> out({1});
  out[0] = 5.0;  // accumulates onto the running total
  sum_squares(ctx, out, x);
  CHECK(out[0] == Approx(5.0 + want).epsilon(1e-12));

  const int saved = omp_get_max_threads();
  Buf<double> one({1}), two({1});
  omp_set_num_threads(1);
  sum_squares(ctx, one, x);
  omp_set_num_threads(2);
  sum_squares(ctx, two, x);
  omp_set_num_threads(saved);
  CHECK(one[0] == two[0]);  // bitwise: the reduction order does not depend on threads

  Buf<float> bad({1});
  CHECK_THROWS_AS(sum_squares(ctx, bad, x), InternalError);  // out must be f64
}

// ---- embedding ----------------------------------------------------------------------------------

TEST_CASE("embedding_forward gathers rows; backward accumulates repeated ids", "[embedding]") {
  Ctx ctx = cpu_ctx();
  const int64_t vocab = 5, d = 3, n = 4;
  Buf<double> table = random_buf({vocab, d}, 1);
  Buf<int32_t> ids({n});
  ids.v = {3, 0, 3, 4};
  Buf<double> out({n, d});
  embedding_forward(ctx, out, ids, table);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < d; ++c) CHECK(out[i * d + c] == table[ids[i] * d + c]);

  Buf<double> dout = random_buf({n, d}, 2);
  Buf<double> dtable = random_buf({vocab, d}, 3);  // nonzero: the op must add, not overwrite
  const Buf<double> before = dtable;
  embedding_backward(ctx, dtable, dout, ids);
  for (int64_t c = 0; c < d; ++c) {
    CHECK(dtable[3 * d + c] == Approx(before[3 * d + c] + dout[0 * d + c] + dout[2 * d + c]));
    CHECK(dtable[0 * d + c] == Approx(before[0 * d + c] + dout[1 * d + c]));
    CHECK(dtable[4 * d + c] == Approx(before[4 * d + c] + dout[3 * d + c]));
    CHECK(dtable[1 * d + c] == before[1 * d + c]);  // unused rows untouched
    CHECK(dtable[2 * d + c] == before[2 * d + c]);
  }
}

TEST_CASE("embedding_backward matches finite differences", "[embedding][grad]") {
  Ctx ctx = cpu_ctx();
  const int64_t vocab = 6, d = 4, n = 7;
  Buf<double> table = random_buf({vocab, d}, 11);
  Buf<int32_t> ids({n});
  ids.v = {1, 5, 1, 0, 2, 5, 1};
  Buf<double> w = random_buf({n, d}, 12);
  Buf<double> out({n, d});
  auto loss = [&] {
    embedding_forward(ctx, out, ids, table);
    return dot(w.v, out.v);
  };
  Buf<double> dtable({vocab, d});
  embedding_backward(ctx, dtable, w, ids);
  check_gradient(table.v, dtable.v, loss, 1e-6, 1e-7, 1e-9, "dtable");  // linear: tight
}

TEST_CASE("embedding_backward is the same for 1 and 2 threads", "[embedding]") {
  Ctx ctx = cpu_ctx();
  const int64_t vocab = 8, d = 300, n = 200;  // large enough to take the parallel path
  Buf<float> dout({n, d});
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& v : dout.v) v = u(rng);
  Buf<int32_t> ids({n});
  for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * 7) % vocab);
  Buf<float> one({vocab, d}), two({vocab, d});
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  embedding_backward(ctx, one, dout, ids);
  omp_set_num_threads(2);
  embedding_backward(ctx, two, dout, ids);
  omp_set_num_threads(saved);
  CHECK(one.v == two.v);
}

TEST_CASE("embedding rejects out-of-range ids with InputError", "[embedding]") {
  Ctx ctx = cpu_ctx();
  Buf<double> table = random_buf({5, 2}, 1), out({3, 2}), dout = random_buf({3, 2}, 2);
  Buf<int32_t> ids({3});
  ids.v = {0, 5, 1};
  CHECK_THROWS_AS(embedding_forward(ctx, out, ids, table), InputError);
  CHECK_THROWS_WITH(embedding_forward(ctx, out, ids, table),
                    Catch::Contains("token id 5") && Catch::Contains("[0, 5)"));
  CHECK_THROWS_AS(embedding_backward(ctx, table, dout, ids), InputError);
  ids.v = {0, -1, 1};
  CHECK_THROWS_WITH(embedding_forward(ctx, out, ids, table), Catch::Contains("token id -1"));
  ids.v = {0, 4, 1};
  CHECK_NOTHROW(embedding_forward(ctx, out, ids, table));
}

// ---- RMSNorm ------------------------------------------------------------------------------------

TEST_CASE("rmsnorm_forward on a known row", "[norm]") {
  Ctx ctx = cpu_ctx();
  // x = [1, 2, 3, 4]: mean(x^2) = 7.5, + eps 0.5 = 8, rstd = 1/sqrt(8).
  Buf<double> x({1, 4}), w({4}), y({1, 4}), rstd({1});
  x.v = {1, 2, 3, 4};
  w.v = {1, 0.5, 2, -1};
  rmsnorm_forward(ctx, y, rstd, x, w, 0.5);
  CHECK(rstd[0] == Approx(0.35355339059327373).epsilon(1e-14));
  CHECK(y[0] == Approx(0.35355339059327373).epsilon(1e-14));
  CHECK(y[1] == Approx(0.35355339059327373).epsilon(1e-14));
  CHECK(y[2] == Approx(2.1213203435596424).epsilon(1e-14));
  CHECK(y[3] == Approx(-1.414213562373095).epsilon(1e-14));
}

TEST_CASE("rmsnorm_backward matches finite differences", "[norm][grad]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 3, d = 5;
  const double eps = 1e-5;
  Buf<double> x = random_buf({n, d}, 21), w = random_buf({d}, 22), gy = random_buf({n, d}, 23);
  Buf<double> y({n, d}), rstd({n});
  auto loss = [&] {
    rmsnorm_forward(ctx, y, rstd, x, w, eps);
    return dot(gy.v, y.v);
  };
  loss();
  Buf<double> dx = random_buf({n, d}, 24);  // garbage: must be overwritten
  Buf<double> dw0 = random_buf({d}, 25), dw = dw0;
  rmsnorm_backward(ctx, dx, dw, gy, x, w, rstd);
  check_gradient(x.v, dx.v, loss, 1e-6, 1e-6, 1e-9, "dx");
  check_gradient(w.v, minus(dw.v, dw0.v), loss, 1e-6, 1e-6, 1e-9, "dw (+= onto dw0)");
}

TEST_CASE("rmsnorm f32 agrees with f64 and is thread-count independent", "[norm][f32]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 70, d = 257;  // big enough for the parallel paths
  Buf<double> x = random_buf({n, d}, 31), w = random_buf({d}, 32), gy = random_buf({n, d}, 33);
  Buf<double> y({n, d}), rstd({n}), dx({n, d}), dw({d});
  rmsnorm_forward(ctx, y, rstd, x, w, 1e-6);
  rmsnorm_backward(ctx, dx, dw, gy, x, w, rstd);

  Buf<float> xf = to_f32(x), wf = to_f32(w), gyf = to_f32(gy);
  Buf<float> yf({n, d}), rstdf({n}), dxf({n, d}), dwf({d});
  rmsnorm_forward(ctx, yf, rstdf, xf, wf, 1e-6);
  rmsnorm_backward(ctx, dxf, dwf, gyf, xf, wf, rstdf);
  CHECK(max_rel_diff(yf.v, y.v) < 1e-5);
  CHECK(max_rel_diff(rstdf.v, rstd.v) < 1e-5);
  CHECK(max_rel_diff(dxf.v, dx.v) < 1e-5);
  CHECK(max_rel_diff(dwf.v, dw.v) < 1e-5);

  Buf<float> dx1({n, d}), dw1({d});
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  rmsnorm_backward(ctx, dx1, dw1, gyf, xf, wf, rstdf);
  omp_set_num_threads(saved);
  CHECK(dx1.v == dxf.v);
  CHECK(dw1.v == dwf.v);
}

// ---- RMSNorm with the residual add fused in
// -------------------------------------------------------

namespace {

// Bitwise equality of two float buffers (NaN-free data, so == on values is bitwise).
template <class T>
bool same_bits(const Buf<T>& a, const Buf<T>& b) {
  return a.v == b.v;
}

// add_rmsnorm_forward against add + rmsnorm_forward, and rmsnorm_backward_add against
// rmsnorm_backward + add, in T (f32 or f64), out of place and in place.
template <class T>
void check_fused_norm_against_composition(int64_t n, int64_t d, uint64_t seed) {
  Ctx ctx = cpu_ctx();
  auto rnd = [&](std::initializer_list<int64_t> dims, uint64_t s) {
    Buf<double> b = random_buf(dims, seed + s);
    Buf<T> t(dims);
    std::copy(b.v.begin(), b.v.end(), t.v.begin());
    return t;
  };
  const Buf<T> x = rnd({n, d}, 1), r = rnd({n, d}, 2), w = rnd({d}, 3), dy = rnd({n, d}, 4),
               res = rnd({n, d}, 5), dw0 = rnd({d}, 6);
  const double eps = 1e-5;

  // forward: bitwise add + norm, also with h written over x (the residual stream in place)
  Buf<T> h_ref({n, d}), y_ref({n, d}), rstd_ref({n});
  add(ctx, h_ref, x, r);
  rmsnorm_forward(ctx, y_ref, rstd_ref, h_ref, w, eps);
  Buf<T> h = rnd({n, d}, 7), y = rnd({n, d}, 8), rstd = rnd({n}, 9);  // garbage: overwritten
  add_rmsnorm_forward(ctx, h, y, rstd, x, r, w, eps);
  CHECK(same_bits(h, h_ref));
  CHECK(same_bits(y, y_ref));
  CHECK(same_bits(rstd, rstd_ref));
  Buf<T> x_in_place = x;
  add_rmsnorm_forward(ctx, x_in_place, y, rstd, x_in_place, r, w, eps);
  CHECK(same_bits(x_in_place, h_ref));
  CHECK(same_bits(y, y_ref));

  // backward: the composition rounds the norm's gradient into T before the add; the fused op
  // rounds once. Bitwise in f64 (double arithmetic either way), an f32 ulp or so apart in f32.
  Buf<T> g({n, d}), dx_ref({n, d}), dw_ref = dw0;
  rmsnorm_backward(ctx, g, dw_ref, dy, h_ref, w, rstd_ref);
  add(ctx, dx_ref, res, g);
  Buf<T> dx = rnd({n, d}, 10), dw = dw0;
  rmsnorm_backward_add(ctx, dx, dw, dy, h_ref, w, rstd_ref, res);
  CHECK(same_bits(dw, dw_ref));
  if (std::is_same<T, double>::value) {
    CHECK(same_bits(dx, dx_ref));
  } else {
    double worst = 0;
    for (size_t i = 0; i < dx.size(); ++i) {
      const double scale = std::max(std::fabs(double(res[i])), std::fabs(double(g[i])));
      worst = std::max(worst, std::fabs(double(dx[i]) - double(dx_ref[i])) / scale);
    }
    CHECK(worst <= std::ldexp(1.0, -22));  // the composition's extra rounding: <= 1 ulp of the sum
  }
  // in place: dx aliases residual, or dy; bitwise the out-of-place result, dw included
  Buf<T> res_in_place = res, dw_a = dw0;
  rmsnorm_backward_add(ctx, res_in_place, dw_a, dy, h_ref, w, rstd_ref, res_in_place);
  CHECK(same_bits(res_in_place, dx));
  CHECK(same_bits(dw_a, dw));
  Buf<T> dy_in_place = dy, dw_b = dw0;
  rmsnorm_backward_add(ctx, dy_in_place, dw_b, dy_in_place, h_ref, w, rstd_ref, res);
  CHECK(same_bits(dy_in_place, dx));
  CHECK(same_bits(dw_b, dw));
  // the plain backward with dx aliasing dy (dw is taken before dx overwrites dy)
  Buf<T> dy_plain = dy, dw_c = dw0;
  rmsnorm_backward(ctx, dy_plain, dw_c, dy_plain, h_ref, w, rstd_ref);
  CHECK(same_bits(dy_plain, g));
  CHECK(same_bits(dw_c, dw_ref));
}

}  // namespace

TEST_CASE("add_rmsnorm_forward and rmsnorm_backward_add match the unfused ops", "[norm]") {
  for (int64_t d : {int64_t{5}, int64_t{64}, int64_t{257}}) {
    INFO("d = " << d);
    check_fused_norm_against_composition<double>(70, d, 40 + d);
    check_fused_norm_against_composition<float>(70, d, 50 + d);
  }
}

TEST_CASE("add_rmsnorm_forward + rmsnorm_backward_add match finite differences", "[norm][grad]") {
  // loss = dot(gy, RMSNorm(x + r)) + dot(gh, x + r): dL/dx = dL/dr = gh + norm'(gy), which is
  // rmsnorm_backward_add with residual gh.
  Ctx ctx = cpu_ctx();
  const int64_t n = 3, d = 7;
  const double eps = 1e-5;
  Buf<double> x = random_buf({n, d}, 61), r = random_buf({n, d}, 62), w = random_buf({d}, 63);
  Buf<double> gy = random_buf({n, d}, 64), gh = random_buf({n, d}, 65);
  Buf<double> h({n, d}), y({n, d}), rstd({n});
  auto loss = [&] {
    add_rmsnorm_forward(ctx, h, y, rstd, x, r, w, eps);
    return dot(gy.v, y.v) + dot(gh.v, h.v);
  };
  loss();
  Buf<double> dx = random_buf({n, d}, 66);  // garbage: must be overwritten
  Buf<double> dw0 = random_buf({d}, 67), dw = dw0;
  rmsnorm_backward_add(ctx, dx, dw, gy, h, w, rstd, gh);
  check_gradient(x.v, dx.v, loss, 1e-6, 1e-6, 1e-9, "dx");
  check_gradient(r.v, dx.v, loss, 1e-6, 1e-6, 1e-9, "dr");
  check_gradient(w.v, minus(dw.v, dw0.v), loss, 1e-6, 1e-6, 1e-9, "dw (+= onto dw0)");
  // in place into the residual: the same gradient
  Buf<double> gh_in_place = gh, dw2 = dw0;
  rmsnorm_backward_add(ctx, gh_in_place, dw2, gy, h, w, rstd, gh_in_place);
  CHECK(gh_in_place.v == dx.v);
  CHECK(dw2.v == dw.v);
}

TEST_CASE("fused rmsnorm ops are thread-count independent and check their arguments", "[norm]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 70, d = 257;
  Buf<float> x = to_f32(random_buf({n, d}, 71)), r = to_f32(random_buf({n, d}, 72)),
             w = to_f32(random_buf({d}, 73)), dy = to_f32(random_buf({n, d}, 74)),
             res = to_f32(random_buf({n, d}, 75));
  auto run = [&](Buf<float>& h, Buf<float>& y, Buf<float>& rstd, Buf<float>& dx, Buf<float>& dw) {
    add_rmsnorm_forward(ctx, h, y, rstd, x, r, w, 1e-6);
    rmsnorm_backward_add(ctx, dx, dw, dy, h, w, rstd, res);
  };
  Buf<float> h({n, d}), y({n, d}), rstd({n}), dx({n, d}), dw({d});
  run(h, y, rstd, dx, dw);
  Buf<float> h1({n, d}), y1({n, d}), rstd1({n}), dx1({n, d}), dw1({d});
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  run(h1, y1, rstd1, dx1, dw1);
  omp_set_num_threads(saved);
  CHECK(h1.v == h.v);
  CHECK(y1.v == y.v);
  CHECK(rstd1.v == rstd.v);
  CHECK(dx1.v == dx.v);
  CHECK(dw1.v == dw.v);

  // y over an input, dx over x, a residual of the wrong shape: rejected with the op's name
  CHECK_THROWS_AS(add_rmsnorm_forward(ctx, h, x, rstd, x, r, w, 1e-6), InternalError);
  CHECK_THROWS_AS(add_rmsnorm_forward(ctx, h, h, rstd, x, r, w, 1e-6), InternalError);
  CHECK_THROWS_AS(rmsnorm_backward_add(ctx, h, dw, dy, h, w, rstd, res), InternalError);
  Buf<float> wrong({n, d + 1});
  CHECK_THROWS_AS(rmsnorm_backward_add(ctx, dx, dw, dy, h, w, rstd, wrong), InternalError);
  CHECK_THROWS_AS(add_rmsnorm_forward(ctx, h, y, rstd, x, wrong, w, 1e-6), InternalError);
}

// ---- linear -------------------------------------------------------------------------------------

namespace {

// y[n, o] = sum_i x[n, i] w[o, i], the naive triple loop.
std::vector<double> naive_linear(const std::vector<double>& x, const std::vector<double>& w,
                                 int64_t n, int64_t in, int64_t out, int64_t x_row0 = 0,
                                 int64_t w_offset = 0) {
  std::vector<double> y(static_cast<size_t>(n * out), 0.0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i)
        y[r * out + o] += x[(x_row0 + r) * in + i] * w[w_offset + o * in + i];
  return y;
}

}  // namespace

TEST_CASE("linear_forward matches a naive loop, with and without accumulate", "[linear]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 4, in = 5, out = 3;
  Buf<double> x = random_buf({n, in}, 41), w = random_buf({out, in}, 42);
  Buf<double> y0 = random_buf({n, out}, 43), y = y0;
  const std::vector<double> want = naive_linear(x.v, w.v, n, in, out);
  linear_forward(ctx, y, x, w, false);
  for (size_t i = 0; i < want.size(); ++i) CHECK(y[i] == Approx(want[i]).epsilon(1e-13));
  y = y0;
  linear_forward(ctx, y, x, w, true);
  for (size_t i = 0; i < want.size(); ++i) CHECK(y[i] == Approx(y0[i] + want[i]).epsilon(1e-13));
  Buf<double> bad({n, out + 1});
  CHECK_THROWS_AS(linear_forward(ctx, bad, x, w, false), InternalError);
}

TEST_CASE("linear_backward matches finite differences and honours its flags", "[linear][grad]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 4, in = 5, out = 3;
  Buf<double> x = random_buf({n, in}, 51), w = random_buf({out, in}, 52);
  Buf<double> gy = random_buf({n, out}, 53), y({n, out});
  auto loss = [&] {
    linear_forward(ctx, y, x, w, false);
    return dot(gy.v, y.v);
  };
  Buf<double> dx0 = random_buf({n, in}, 54), dx = dx0;
  Buf<double> dw0 = random_buf({out, in}, 55), dw = dw0;
  linear_backward(ctx, dx, dw, gy, x, w, false);
  check_gradient(x.v, dx.v, loss, 1e-6, 1e-7, 1e-9, "dx (overwritten)");
  check_gradient(w.v, minus(dw.v, dw0.v), loss, 1e-6, 1e-7, 1e-9, "dw (+= onto dw0)");

  // accumulate_dx adds onto dx; dw accumulates again.
  Buf<double> dx_acc = dx0, dw2 = dw;
  linear_backward(ctx, dx_acc, dw2, gy, x, w, true);
  for (size_t i = 0; i < dx.size(); ++i) CHECK(dx_acc[i] == Approx(dx0[i] + dx[i]).epsilon(1e-13));
  for (size_t i = 0; i < dw.size(); ++i)
    CHECK(dw2[i] == Approx(dw[i] + (dw[i] - dw0[i])).epsilon(1e-12));

  // An empty dx skips the input gradient but still accumulates dw.
  Buf<double> dw3 = dw0;
  linear_backward(ctx, Tensor{}, dw3, gy, x, w, false);
  for (size_t i = 0; i < dw.size(); ++i) CHECK(dw3[i] == Approx(dw[i]).epsilon(1e-13));
}

TEST_CASE("linear_*_batched are the plain ops per weight, dx summed", "[linear]") {
  // Three weights against one x (the attention's q, k, v): y[b] bitwise linear_forward's, dx the
  // plain backward's in turn (the first = or +=, then +=), dw[b] += each, all three also against
  // naive loops; bad shapes throw.
  Ctx ctx = cpu_ctx();
  const int64_t n = 6, in = 5, out = 4, nb = 3;
  Buf<double> x = random_buf({n, in}, 61), w = random_buf({nb, out, in}, 62);
  Buf<double> dy = random_buf({nb, n, out}, 63), dx0 = random_buf({n, in}, 64);
  Buf<double> dw0 = random_buf({nb, out, in}, 65);
  Buf<double> y({nb, n, out});
  linear_forward_batched(ctx, y, x, w);
  for (int64_t b = 0; b < nb; ++b) {  // y[b] = x w[b]^T by the naive loop
    const std::vector<double> want = naive_linear(x.v, w.v, n, in, out, 0, b * out * in);
    for (size_t i = 0; i < want.size(); ++i)
      CHECK(y[b * n * out + static_cast<int64_t>(i)] == Approx(want[i]).epsilon(1e-13));
  }
  for (bool acc : {false, true}) {
    Buf<double> dx = dx0, dw = dw0, want_dx = dx0, want_dw = dw0;
    linear_backward_batched(ctx, dx, dw, dy, x, w, acc);
    for (int64_t b = 0; b < nb; ++b) {
      Buf<double> yb({n, out});
      linear_forward(ctx, yb, x, w.t.rows(b, b + 1).view({out, in}), false);
      CHECK(std::vector<double>(y.v.begin() + b * n * out, y.v.begin() + (b + 1) * n * out) ==
            yb.v);
      linear_backward(ctx, want_dx, want_dw.t.rows(b, b + 1).view({out, in}),
                      dy.t.rows(b, b + 1).view({n, out}), x, w.t.rows(b, b + 1).view({out, in}),
                      acc || b > 0);
    }
    CHECK(dx.v == want_dx.v);
    CHECK(dw.v == want_dw.v);
    // and by loops: dx (+)= sum_b dy[b] w[b], dw[b] += dy[b]^T x
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < in; ++i) {
        double want = acc ? dx0[r * in + i] : 0.0;
        for (int64_t b = 0; b < nb; ++b)
          for (int64_t o = 0; o < out; ++o)
            want += dy[(b * n + r) * out + o] * w[(b * out + o) * in + i];
        CHECK(dx[r * in + i] == Approx(want).epsilon(1e-12));
      }
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          double want = dw0[(b * out + o) * in + i];
          for (int64_t r = 0; r < n; ++r) want += dy[(b * n + r) * out + o] * x[r * in + i];
          CHECK(dw[(b * out + o) * in + i] == Approx(want).epsilon(1e-12));
        }
  }
  Buf<double> bad_y({nb - 1, n, out}), bad_w({out, in});
  CHECK_THROWS_AS(linear_forward_batched(ctx, bad_y, x, w), InternalError);
  CHECK_THROWS_AS(linear_forward_batched(ctx, y, x, bad_w), InternalError);
  Buf<double> bad_dw({nb, out, in + 1});
  CHECK_THROWS_AS(linear_backward_batched(ctx, Tensor{}, bad_dw, dy, x, w, false), InternalError);
}

TEST_CASE("linear f32 agrees with f64", "[linear][f32]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 33, in = 65, out = 17;
  Buf<double> x = random_buf({n, in}, 61), w = random_buf({out, in}, 62),
              gy = random_buf({n, out}, 63);
  Buf<double> y({n, out}), dx({n, in}), dw({out, in});
  linear_forward(ctx, y, x, w, false);
  linear_backward(ctx, dx, dw, gy, x, w, false);
  Buf<float> xf = to_f32(x), wf = to_f32(w), gyf = to_f32(gy);
  Buf<float> yf({n, out}), dxf({n, in}), dwf({out, in});
  linear_forward(ctx, yf, xf, wf, false);
  linear_backward(ctx, dxf, dwf, gyf, xf, wf, false);
  // Sums of up to 65 products of O(1) terms: f32 rounding ~ 1e-6 relative to the sum's scale.
  CHECK(max_rel_diff(yf.v, y.v) < 1e-5);
  CHECK(max_rel_diff(dxf.v, dx.v) < 1e-5);
  CHECK(max_rel_diff(dwf.v, dw.v) < 1e-5);
}

// ---- grouped linear -----------------------------------------------------------------------------

namespace {

struct GroupedCase {
  static constexpr int64_t kExperts = 4, kRows = 5, kIn = 3, kOut = 2;
  Buf<int32_t> offsets{kExperts + 1};
  Buf<double> x = random_buf({kRows, kIn}, 71);
  Buf<double> w = random_buf({kExperts, kOut, kIn}, 72);
  GroupedCase() { offsets.v = {0, 0, 2, 2, 5}; }  // experts 0 and 2 have no rows
  // y rows of expert e by the naive loop.
  std::vector<double> expert_rows(int64_t e) const {
    const int64_t r0 = offsets[e], m = offsets[e + 1] - offsets[e];
    return naive_linear(x.v, w.v, m, kIn, kOut, r0, e * kOut * kIn);
  }
};

}  // namespace

TEST_CASE("grouped_linear_forward matches per-expert naive loops", "[linear][grouped]") {
  Ctx ctx = cpu_ctx();
  GroupedCase c;
  Buf<double> y = random_buf({c.kRows, c.kOut}, 73);  // every row must be written
  grouped_linear_forward(ctx, y, c.x, c.w, c.offsets);
  for (int64_t e = 0; e < c.kExperts; ++e) {
    const std::vector<double> want = c.expert_rows(e);
    for (size_t i = 0; i < want.size(); ++i)
      CHECK(y[c.offsets[e] * c.kOut + i] == Approx(want[i]).epsilon(1e-13));
  }
  Buf<int32_t> bad({c.kExperts + 1});
  bad.v = {0, 3, 2, 4, 5};  // decreasing
  CHECK_THROWS_AS(grouped_linear_forward(ctx, y, c.x, c.w, bad), InternalError);
  bad.v = {0, 1, 2, 3, 4};  // does not end at R
  CHECK_THROWS_AS(grouped_linear_forward(ctx, y, c.x, c.w, bad), InternalError);
}

TEST_CASE("grouped_linear_backward: empty experts get zero dw, others match", "[linear][grouped]") {
  Ctx ctx = cpu_ctx();
  GroupedCase c;
  Buf<double> gy = random_buf({c.kRows, c.kOut}, 74);
  Buf<double> dx = random_buf({c.kRows, c.kIn}, 75);  // garbage: must be overwritten
  Buf<double> dw({c.kExperts, c.kOut, c.kIn});
  grouped_linear_backward(ctx, dx, dw, gy, c.x, c.w, c.offsets);
  const int64_t wsz = c.kOut * c.kIn;
  for (int64_t i = 0; i < wsz; ++i) {
    CHECK(dw[0 * wsz + i] == 0.0);
    CHECK(dw[2 * wsz + i] == 0.0);
  }
  // dw[e][o][i] = sum_r dy[r][o] x[r][i] and dx[r][i] = sum_o dy[r][o] w[e][o][i], by loops.
  for (int64_t e : {1, 3}) {
    for (int64_t o = 0; o < c.kOut; ++o)
      for (int64_t i = 0; i < c.kIn; ++i) {
        double want = 0;
        for (int64_t r = c.offsets[e]; r < c.offsets[e + 1]; ++r)
          want += gy[r * c.kOut + o] * c.x[r * c.kIn + i];
        CHECK(dw[e * wsz + o * c.kIn + i] == Approx(want).epsilon(1e-13));
      }
    for (int64_t r = c.offsets[e]; r < c.offsets[e + 1]; ++r)
      for (int64_t i = 0; i < c.kIn; ++i) {
        double want = 0;
        for (int64_t o = 0; o < c.kOut; ++o)
          want += gy[r * c.kOut + o] * c.w[e * wsz + o * c.kIn + i];
        CHECK(dx[r * c.kIn + i] == Approx(want).epsilon(1e-13));
      }
  }
}

TEST_CASE("grouped_linear_backward with dw_overwrite: dw = dy^T x whatever dw held",
          "[linear][grouped]") {
  Ctx ctx = cpu_ctx();
  GroupedCase c;
  Buf<double> gy = random_buf({c.kRows, c.kOut}, 78);
  Buf<double> dx({c.kRows, c.kIn}), dx2({c.kRows, c.kIn});
  Buf<double> from_zero({c.kExperts, c.kOut, c.kIn});
  grouped_linear_backward(ctx, dx, from_zero, gy, c.x, c.w, c.offsets);
  Buf<double> garbage = random_buf({c.kExperts, c.kOut, c.kIn}, 79);
  garbage.v[0] = std::nan("");  // an empty expert's element: NaN must not survive
  grouped_linear_backward(ctx, dx2, garbage, gy, c.x, c.w, c.offsets, true);
  CHECK(garbage.v == from_zero.v);  // empty experts (0 and 2) zero, the others written
  CHECK(dx2.v == dx.v);
}

TEST_CASE("grouped_linear_backward matches finite differences and accumulates dw",
          "[linear][grouped][grad]") {
  Ctx ctx = cpu_ctx();
  GroupedCase c;
  Buf<double> gy = random_buf({c.kRows, c.kOut}, 76), y({c.kRows, c.kOut});
  auto loss = [&] {
    grouped_linear_forward(ctx, y, c.x, c.w, c.offsets);
    return dot(gy.v, y.v);
  };
  Buf<double> dx({c.kRows, c.kIn});
  Buf<double> dw0 = random_buf({c.kExperts, c.kOut, c.kIn}, 77), dw = dw0;
  grouped_linear_backward(ctx, dx, dw, gy, c.x, c.w, c.offsets);
  check_gradient(c.x.v, dx.v, loss, 1e-6, 1e-7, 1e-9, "dx");
  check_gradient(c.w.v, minus(dw.v, dw0.v), loss, 1e-6, 1e-7, 1e-9, "dw (+= onto dw0)");
  const int64_t wsz = c.kOut * c.kIn;
  for (int64_t i = 0; i < wsz; ++i) CHECK(dw[2 * wsz + i] == dw0[2 * wsz + i]);  // += 0 exactly
}

// The gate and up projections' backward together: dx is the gradient of <g1, x w1^T> +
// <g3, x w3^T> (finite differences), dw1 and dw3 each projection's, overwritten with
// dw_overwrite (they start as garbage).
TEST_CASE("grouped_linear_backward_pair: the two projections' gradients, dx summed",
          "[linear][grouped][grad]") {
  Ctx ctx = cpu_ctx();
  GroupedCase c;
  Buf<double> w3 = random_buf({c.kExperts, c.kOut, c.kIn}, 90);
  Buf<double> g1 = random_buf({c.kRows, c.kOut}, 91), g3 = random_buf({c.kRows, c.kOut}, 92);
  Buf<double> y1({c.kRows, c.kOut}), y3({c.kRows, c.kOut});
  auto loss = [&] {
    grouped_linear_forward(ctx, y1, c.x, c.w, c.offsets);
    grouped_linear_forward(ctx, y3, c.x, w3, c.offsets);
    return dot(g1.v, y1.v) + dot(g3.v, y3.v);
  };
  Buf<double> dx = random_buf({c.kRows, c.kIn}, 93), dx2({c.kRows, c.kIn});
  Buf<double> dw1 = random_buf({c.kExperts, c.kOut, c.kIn}, 94), dw3 = dw1;
  grouped_linear_backward_pair(ctx, dx, dx2, dw1, dw3, g1, g3, c.x, c.w, w3, c.offsets, true);
  check_gradient(c.x.v, dx.v, loss, 1e-6, 1e-7, 1e-9, "dx");
  check_gradient(c.w.v, dw1.v, loss, 1e-6, 1e-7, 1e-9, "dw1");
  check_gradient(w3.v, dw3.v, loss, 1e-6, 1e-7, 1e-9, "dw3");
  // mismatched shapes are refused
  Buf<double> w3_bad({c.kExperts, c.kOut + 1, c.kIn});
  CHECK_THROWS_AS(grouped_linear_backward_pair(ctx, dx, dx2, dw1, dw3, g1, g3, c.x, c.w, w3_bad,
                                               c.offsets, true),
                  InternalError);
  CHECK_THROWS_AS(
      grouped_linear_backward_pair(ctx, dx, dx, dw1, dw3, g1, g3, c.x, c.w, w3, c.offsets, true),
      InternalError);
  // the CPU op sums the two products apart: it needs the workspace, and says so
  CHECK(
      grouped_linear_backward_pair_needs_dx2(ctx, DType::f64, c.kRows, c.kExperts, c.kIn, c.kOut));
  CHECK_THROWS_WITH(grouped_linear_backward_pair(ctx, dx, Tensor(), dw1, dw3, g1, g3, c.x, c.w, w3,
                                                 c.offsets, true),
                    Catch::Contains("needs dx2"));
}

TEST_CASE("grouped_linear f32 agrees with f64", "[linear][grouped][f32]") {
  Ctx ctx = cpu_ctx();
  const int64_t experts = 3, rows = 40, in = 24, out = 16;
  Buf<int32_t> offsets({experts + 1});
  offsets.v = {0, 13, 13, 40};
  Buf<double> x = random_buf({rows, in}, 81), w = random_buf({experts, out, in}, 82);
  Buf<double> gy = random_buf({rows, out}, 83);
  Buf<double> y({rows, out}), dx({rows, in}), dw({experts, out, in});
  grouped_linear_forward(ctx, y, x, w, offsets);
  grouped_linear_backward(ctx, dx, dw, gy, x, w, offsets);
  Buf<float> xf = to_f32(x), wf = to_f32(w), gyf = to_f32(gy);
  Buf<float> yf({rows, out}), dxf({rows, in}), dwf({experts, out, in});
  grouped_linear_forward(ctx, yf, xf, wf, offsets);
  grouped_linear_backward(ctx, dxf, dwf, gyf, xf, wf, offsets);
  CHECK(max_rel_diff(yf.v, y.v) < 1e-5);
  CHECK(max_rel_diff(dxf.v, dx.v) < 1e-5);
  CHECK(max_rel_diff(dwf.v, dw.v) < 1e-5);
}

TEST_CASE("grouped_swiglu_forward is the two projections and weighted SwiGLU, checks its shapes",
          "[linear][grouped]") {
  Ctx ctx = cpu_ctx();
  GroupedCase c;
  Buf<double> w3 = random_buf({c.kExperts, c.kOut, c.kIn}, 78);
  Buf<double> row_w = random_buf({c.kRows}, 77);
  for (auto& w : row_w.v) w = 0.5 + 0.5 * w;  // routing weights in (0, 1]
  Buf<double> gate = random_buf({c.kRows, c.kOut}, 79), up = random_buf({c.kRows, c.kOut}, 80),
              h = random_buf({c.kRows, c.kOut}, 81);  // garbage: every element is written
  grouped_swiglu_forward(ctx, gate, up, h, c.x, c.w, w3, row_w, c.offsets);
  Buf<double> want_gate({c.kRows, c.kOut}), want_up({c.kRows, c.kOut}), want_h({c.kRows, c.kOut});
  grouped_linear_forward(ctx, want_gate, c.x, c.w, c.offsets);
  grouped_linear_forward(ctx, want_up, c.x, w3, c.offsets);
  swiglu_weighted_forward(ctx, want_h, want_gate, want_up, row_w);
  CHECK(gate.v == want_gate.v);
  CHECK(up.v == want_up.v);
  CHECK(h.v == want_h.v);
  for (size_t i = 0; i < h.v.size(); ++i) {  // and h is w * silu(gate) * up
    const double g = gate.v[i], w = row_w.v[i / c.kOut];
    CHECK(h.v[i] == Approx(w * g / (1 + std::exp(-g)) * up.v[i]).epsilon(1e-12));
  }
  Buf<double> w3_bad = random_buf({c.kExperts, c.kOut + 1, c.kIn}, 82);
  CHECK_THROWS_AS(grouped_swiglu_forward(ctx, gate, up, h, c.x, c.w, w3_bad, row_w, c.offsets),
                  InternalError);
  Buf<double> h_bad({c.kRows, c.kOut + 1});
  CHECK_THROWS_AS(grouped_swiglu_forward(ctx, gate, up, h_bad, c.x, c.w, w3, row_w, c.offsets),
                  InternalError);
  Buf<float> up_f32({c.kRows, c.kOut});
  CHECK_THROWS_AS(grouped_swiglu_forward(ctx, gate, up_f32, h, c.x, c.w, w3, row_w, c.offsets),
                  InternalError);
  Buf<double> row_w_bad({c.kRows + 1});
  CHECK_THROWS_WITH(grouped_swiglu_forward(ctx, gate, up, h, c.x, c.w, w3, row_w_bad, c.offsets),
                    Catch::Contains("grouped_swiglu_forward: row_w"));
}

TEST_CASE("grouped_linear_backward_gathered is the permute and grouped_linear_backward",
          "[linear][grouped]") {
  Ctx ctx = cpu_ctx();
  GroupedCase c;
  Buf<double> x = random_buf({3, c.kIn}, 89);  // 3 tokens for 5 rows, as below
  Buf<int32_t> row_token({c.kRows});
  row_token.v = {1, 2, 0, 2, 1};
  Buf<double> dy = random_buf({c.kRows, c.kOut}, 90);
  Buf<double> xp({c.kRows, c.kIn});
  for (int64_t r = 0; r < c.kRows; ++r)
    for (int64_t j = 0; j < c.kIn; ++j) xp[r * c.kIn + j] = x[row_token[r] * c.kIn + j];
  for (bool overwrite : {false, true}) {
    INFO("dw_overwrite " << overwrite);
    Buf<double> dx = random_buf({c.kRows, c.kIn}, 91), want_dx({c.kRows, c.kIn});
    Buf<double> dw = random_buf({c.kExperts, c.kOut, c.kIn}, 92), want_dw = dw;
    grouped_linear_backward_gathered(ctx, dx, dw, dy, x, row_token, c.w, c.offsets, overwrite);
    grouped_linear_backward(ctx, want_dx, want_dw, dy, xp, c.w, c.offsets, overwrite);
    CHECK(dx.v == want_dx.v);
    CHECK(dw.v == want_dw.v);
  }
  Buf<double> dx({c.kRows, c.kIn}), dw({c.kExperts, c.kOut, c.kIn});
  Buf<int32_t> short_tokens({c.kRows - 1});
  CHECK_THROWS_WITH(
      grouped_linear_backward_gathered(ctx, dx, dw, dy, x, short_tokens, c.w, c.offsets),
      Catch::Contains("grouped_linear_backward_gathered: dx"));
}

TEST_CASE("grouped_linear_backward_pair_gathered is the permute and grouped_linear_backward_pair",
          "[linear][grouped]") {
  Ctx ctx = cpu_ctx();
  GroupedCase c;
  Buf<double> x = random_buf({3, c.kIn}, 95);  // 3 tokens for 5 rows
  Buf<int32_t> row_token({c.kRows});
  row_token.v = {2, 2, 0, 1, 0};
  Buf<double> w3 = random_buf({c.kExperts, c.kOut, c.kIn}, 96);
  Buf<double> dy1 = random_buf({c.kRows, c.kOut}, 97), dy3 = random_buf({c.kRows, c.kOut}, 98);
  Buf<double> xp({c.kRows, c.kIn});
  for (int64_t r = 0; r < c.kRows; ++r)
    for (int64_t j = 0; j < c.kIn; ++j) xp[r * c.kIn + j] = x[row_token[r] * c.kIn + j];
  for (bool overwrite : {false, true}) {
    INFO("dw_overwrite " << overwrite);
    Buf<double> dx({c.kRows, c.kIn}), dx2({c.kRows, c.kIn}), want_dx({c.kRows, c.kIn});
    Buf<double> dw1 = random_buf({c.kExperts, c.kOut, c.kIn}, 99), dw3 = dw1;
    Buf<double> want_dw1 = dw1, want_dw3 = dw3;
    grouped_linear_backward_pair_gathered(ctx, dx, dx2, dw1, dw3, dy1, dy3, x, row_token, c.w, w3,
                                          c.offsets, overwrite);
    grouped_linear_backward_pair(ctx, want_dx, dx2, want_dw1, want_dw3, dy1, dy3, xp, c.w, w3,
                                 c.offsets, overwrite);
    CHECK(dx.v == want_dx.v);
    CHECK(dw1.v == want_dw1.v);
    CHECK(dw3.v == want_dw3.v);
  }
  Buf<double> dx({c.kRows, c.kIn}), dx2({c.kRows, c.kIn}), dw({c.kExperts, c.kOut, c.kIn});
  Buf<int32_t> short_tokens({c.kRows - 1});
  CHECK_THROWS_WITH(grouped_linear_backward_pair_gathered(ctx, dx, dx2, dw, dw, dy1, dy3, x,
                                                          short_tokens, c.w, w3, c.offsets),
                    Catch::Contains("grouped_linear_backward_gathered: dx"));
}

TEST_CASE("grouped_swiglu_forward_gathered is the permute and grouped_swiglu_forward",
          "[linear][grouped]") {
  Ctx ctx = cpu_ctx();
  GroupedCase c;
  // 3 tokens, 5 rows: tokens used twice, once and not at all, in no order
  Buf<double> x = random_buf({3, c.kIn}, 83);
  Buf<int32_t> row_token({c.kRows});
  row_token.v = {2, 0, 2, 0, 1};
  Buf<double> w3 = random_buf({c.kExperts, c.kOut, c.kIn}, 84);
  Buf<double> row_w = random_buf({c.kRows}, 85);
  for (auto& w : row_w.v) w = 0.5 + 0.5 * w;
  Buf<double> gate = random_buf({c.kRows, c.kOut}, 86), up = random_buf({c.kRows, c.kOut}, 87),
              h = random_buf({c.kRows, c.kOut}, 88);  // garbage: every element is written
  grouped_swiglu_forward_gathered(ctx, gate, up, h, x, row_token, c.w, w3, row_w, c.offsets);
  Buf<double> xp({c.kRows, c.kIn});
  for (int64_t r = 0; r < c.kRows; ++r)
    for (int64_t j = 0; j < c.kIn; ++j) xp[r * c.kIn + j] = x[row_token[r] * c.kIn + j];
  Buf<double> want_gate({c.kRows, c.kOut}), want_up({c.kRows, c.kOut}), want_h({c.kRows, c.kOut});
  grouped_swiglu_forward(ctx, want_gate, want_up, want_h, xp, c.w, w3, row_w, c.offsets);
  CHECK(gate.v == want_gate.v);
  CHECK(up.v == want_up.v);
  CHECK(h.v == want_h.v);
  Buf<int32_t> short_tokens({c.kRows - 1});
  CHECK_THROWS_WITH(
      grouped_swiglu_forward_gathered(ctx, gate, up, h, x, short_tokens, c.w, w3, row_w, c.offsets),
      Catch::Contains("grouped_swiglu_forward"));
  Buf<double> float_tokens({c.kRows});
  CHECK_THROWS_WITH(
      grouped_swiglu_forward_gathered(ctx, gate, up, h, x, float_tokens, c.w, w3, row_w, c.offsets),
      Catch::Contains("row_token must be [R] i32"));
}

TEST_CASE("grouped_swiglu_down_backward_gathered is the permute and the down backward",
          "[linear][grouped]") {
  Ctx ctx = cpu_ctx();
  GroupedCase c;                                 // h = c.x [R, F = kIn], w2 = c.w [E, D = kOut, F]
  Buf<double> dy = random_buf({3, c.kOut}, 93);  // 3 tokens' gradients for 5 rows
  Buf<int32_t> row_token({c.kRows});
  row_token.v = {0, 2, 2, 1, 0};
  Buf<double> gate = random_buf({c.kRows, c.kIn}, 94), up = random_buf({c.kRows, c.kIn}, 95);
  Buf<double> row_w = random_buf({c.kRows}, 96);
  for (auto& w : row_w.v) w = 0.5 + 0.5 * w;
  Buf<double> dyp({c.kRows, c.kOut});
  for (int64_t r = 0; r < c.kRows; ++r)
    for (int64_t j = 0; j < c.kOut; ++j) dyp[r * c.kOut + j] = dy[row_token[r] * c.kOut + j];
  for (bool overwrite : {false, true}) {
    INFO("dw_overwrite " << overwrite);
    Buf<double> dgate({c.kRows, c.kIn}), dup({c.kRows, c.kIn}), drow_w({c.kRows});
    Buf<double> dw2 = random_buf({c.kExperts, c.kOut, c.kIn}, 97), want_dw2 = dw2;
    Buf<double> want_dgate({c.kRows, c.kIn}), want_dup({c.kRows, c.kIn}), want_drow_w({c.kRows});
    grouped_swiglu_down_backward_gathered(ctx, dgate, dup, drow_w, dw2, dy, row_token, c.x, c.w,
                                          gate, up, row_w, c.offsets, overwrite);
    grouped_swiglu_down_backward(ctx, want_dgate, want_dup, want_drow_w, want_dw2, dyp, c.x, c.w,
                                 gate, up, row_w, c.offsets, overwrite);
    CHECK(dgate.v == want_dgate.v);
    CHECK(dup.v == want_dup.v);
    CHECK(drow_w.v == want_drow_w.v);
    CHECK(dw2.v == want_dw2.v);
  }
  Buf<double> dgate({c.kRows, c.kIn}), dup({c.kRows, c.kIn}), drow_w({c.kRows});
  Buf<double> dw2({c.kExperts, c.kOut, c.kIn}), dy_bad({3, c.kOut + 1});
  CHECK_THROWS_WITH(
      grouped_swiglu_down_backward_gathered(ctx, dgate, dup, drow_w, dw2, dy_bad, row_token, c.x,
                                            c.w, gate, up, row_w, c.offsets),
      Catch::Contains("grouped_swiglu_down_backward_gathered: dy must be"));
}

TEST_CASE("grouped_swiglu_down_backward is the down projection's backward and SwiGLU's",
          "[linear][grouped]") {
  Ctx ctx = cpu_ctx();
  GroupedCase c;  // h = c.x [R, F = kIn], w2 = c.w [E, D = kOut, F]
  Buf<double> dy = random_buf({c.kRows, c.kOut}, 84), gate = random_buf({c.kRows, c.kIn}, 85),
              up = random_buf({c.kRows, c.kIn}, 86),
              dw0 = random_buf({c.kExperts, c.kOut, c.kIn}, 87);
  Buf<double> row_w = random_buf({c.kRows}, 83), drow_w = random_buf({c.kRows}, 90);
  for (auto& w : row_w.v) w = 0.5 + 0.5 * w;
  Buf<double> dgate = random_buf({c.kRows, c.kIn}, 88), dup = random_buf({c.kRows, c.kIn}, 89);
  Buf<double> dw2 = dw0;  // accumulated into
  grouped_swiglu_down_backward(ctx, dgate, dup, drow_w, dw2, dy, c.x, c.w, gate, up, row_w,
                               c.offsets);
  Buf<double> dh({c.kRows, c.kIn}), want_dgate({c.kRows, c.kIn}), want_dup({c.kRows, c.kIn});
  Buf<double> want_dw2 = dw0, want_drow_w({c.kRows});
  grouped_linear_backward(ctx, dh, want_dw2, dy, c.x, c.w, c.offsets);
  swiglu_weighted_backward(ctx, want_dgate, want_dup, want_drow_w, dh, gate, up, row_w);
  CHECK(dgate.v == want_dgate.v);
  CHECK(dup.v == want_dup.v);
  CHECK(dw2.v == want_dw2.v);
  CHECK(drow_w.v == want_drow_w.v);
  for (size_t i = 0; i < dup.v.size(); ++i) {  // and dup is w dh silu(gate)
    const double g = gate.v[i], w = row_w.v[i / c.kIn];
    CHECK(dup.v[i] == Approx(w * dh.v[i] * g / (1 + std::exp(-g))).epsilon(1e-12));
  }
  // dw_overwrite: dw2 written whatever it held, the rest as before.
  Buf<double> dw2_over = random_buf({c.kExperts, c.kOut, c.kIn}, 91),
              want_over({c.kExperts, c.kOut, c.kIn});
  grouped_swiglu_down_backward(ctx, dgate, dup, drow_w, dw2_over, dy, c.x, c.w, gate, up, row_w,
                               c.offsets, true);
  grouped_linear_backward(ctx, dh, want_over, dy, c.x, c.w, c.offsets);
  CHECK(dw2_over.v == want_over.v);
  CHECK(dgate.v == want_dgate.v);
  CHECK(drow_w.v == want_drow_w.v);
  Buf<double> up_bad({c.kRows, c.kIn + 1});
  CHECK_THROWS_AS(grouped_swiglu_down_backward(ctx, dgate, dup, drow_w, dw2, dy, c.x, c.w, gate,
                                               up_bad, row_w, c.offsets),
                  InternalError);
  Buf<double> dy_bad({c.kRows, c.kOut + 1});
  CHECK_THROWS_AS(grouped_swiglu_down_backward(ctx, dgate, dup, drow_w, dw2, dy_bad, c.x, c.w, gate,
                                               up, row_w, c.offsets),
                  InternalError);
  Buf<float> drow_w_f32({c.kRows});
  CHECK_THROWS_WITH(grouped_swiglu_down_backward(ctx, dgate, dup, drow_w_f32, dw2, dy, c.x, c.w,
                                                 gate, up, row_w, c.offsets),
                    Catch::Contains("grouped_swiglu_down_backward: drow_w"));
}

// ---- gemm: the blocked matmul under every linear op ---------------------------------------------

namespace {

// C = alpha op(A) op(B) + beta C by naive loops in double (beta = 0 does not read C).
std::vector<double> naive_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha,
                               const std::vector<float>& a, int64_t lda,
                               const std::vector<float>& b, int64_t ldb, double beta,
                               const std::vector<float>& c, int64_t ldc) {
  std::vector<double> out(static_cast<size_t>(m * ldc), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t l = 0; l < k; ++l)
        s += static_cast<double>(ta ? a[l * lda + i] : a[i * lda + l]) *
             static_cast<double>(tb ? b[j * ldb + l] : b[l * ldb + j]);
      out[i * ldc + j] = alpha * s + (beta == 0 ? 0.0 : beta * c[i * ldc + j]);
    }
  return out;
}

std::vector<float> random_floats(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = u(rng);
  return v;
}

}  // namespace

TEST_CASE("gemm cuts by rows, columns or K, matches naive loops, same for 1 and 2 threads",
          "[linear][gemm]") {
  using Axis = cpu::GemmBlocks::Axis;
  struct Shape {
    int64_t m, n, k;
    Axis axis;
  };
  const Shape shapes[] = {{1000, 80, 96, Axis::rows},
                          {40, 900, 300, Axis::cols},
                          {80, 96, 1000, Axis::inner},
                          {20, 30, 40, Axis::whole}};
  const int saved = omp_get_max_threads();
  for (const Shape& s : shapes) {
    REQUIRE(cpu::gemm_blocks(s.m, s.n, s.k).axis == s.axis);
    for (int t = 0; t < 8; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const float beta = (t & 4) ? 0.5f : 0.0f;
      INFO("m " << s.m << " n " << s.n << " k " << s.k << " ta " << ta << " tb " << tb << " beta "
                << beta);
      const int64_t lda = (ta ? s.m : s.k) + 3, ldb = (tb ? s.k : s.n) + 5, ldc = s.n + 2;
      const std::vector<float> a = random_floats((ta ? s.k : s.m) * lda, 101 + t);
      const std::vector<float> b = random_floats((tb ? s.n : s.k) * ldb, 201 + t);
      std::vector<float> c0 = random_floats(s.m * ldc, 301 + t);
      if (beta == 0) c0.assign(c0.size(), std::nanf(""));  // beta = 0 must not read C
      std::vector<float> c1 = c0, c2 = c0;
      omp_set_num_threads(1);
      cpu::gemm(ta, tb, s.m, s.n, s.k, 1.5f, a.data(), lda, b.data(), ldb, beta, c1.data(), ldc);
      omp_set_num_threads(2);
      cpu::gemm(ta, tb, s.m, s.n, s.k, 1.5f, a.data(), lda, b.data(), ldb, beta, c2.data(), ldc);
      omp_set_num_threads(saved);
      CHECK(std::memcmp(c1.data(), c2.data(), c1.size() * sizeof(float)) == 0);
      const std::vector<double> want =
          naive_gemm(ta, tb, s.m, s.n, s.k, 1.5, a, lda, b, ldb, beta, c0, ldc);
      double worst = 0;  // over the n columns of each row; the ldc padding must stay untouched
      bool padding_kept = true;
      for (int64_t i = 0; i < s.m; ++i) {
        for (int64_t j = 0; j < s.n; ++j)
          worst = std::max(worst, std::fabs(c1[i * ldc + j] - want[i * ldc + j]) /
                                      (1.0 + std::fabs(want[i * ldc + j])));
        for (int64_t j = s.n; j < ldc; ++j)
          padding_kept = padding_kept && std::memcmp(&c1[i * ldc + j], &c0[i * ldc + j], 4) == 0;
      }
      CHECK(worst < 1e-4);  // f32 sums of up to 1000 O(1) products: ~1e-5 relative
      CHECK(padding_kept);
    }
  }
}

TEST_CASE("linear and grouped linear are bitwise the same for 1 and 2 threads", "[linear][gemm]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 1000, in = 96, out = 80, experts = 3;  // every gemm here is cut in blocks
  Buf<float> x = to_f32(random_buf({n, in}, 91)), w = to_f32(random_buf({out, in}, 92));
  Buf<float> gy = to_f32(random_buf({n, out}, 93));
  Buf<float> wg = to_f32(random_buf({experts, out, in}, 94));
  Buf<int32_t> offsets({experts + 1});
  offsets.v = {0, 600, 600, static_cast<int32_t>(n)};
  struct Out {
    Buf<float> y{n, out}, dx{n, in}, dw{out, in}, yg{n, out}, dxg{n, in}, dwg{experts, out, in};
  };
  auto run = [&](int threads, Out& o) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    linear_forward(ctx, o.y, x, w, false);
    linear_backward(ctx, o.dx, o.dw, gy, x, w, false);
    grouped_linear_forward(ctx, o.yg, x, wg, offsets);
    grouped_linear_backward(ctx, o.dxg, o.dwg, gy, x, wg, offsets);
    omp_set_num_threads(saved);
  };
  Out one, two;
  run(1, one);
  run(2, two);
  CHECK(one.y.v == two.y.v);
  CHECK(one.dx.v == two.dx.v);
  CHECK(one.dw.v == two.dw.v);
  CHECK(one.yg.v == two.yg.v);
  CHECK(one.dxg.v == two.dxg.v);
  CHECK(one.dwg.v == two.dwg.v);
}

// ---- SwiGLU / SiLU ------------------------------------------------------------------------------

TEST_CASE("swiglu_forward and silu_forward on known values", "[swiglu]") {
  Ctx ctx = cpu_ctx();
  Buf<double> gate({1, 2}), up({1, 2}), h({1, 2}), y({1, 2});
  gate.v = {1, -2};
  up.v = {2, 3};
  swiglu_forward(ctx, h, gate, up);
  CHECK(h[0] == Approx(1.4621171572600098).epsilon(1e-14));   // silu(1) * 2
  CHECK(h[1] == Approx(-0.7152175321327052).epsilon(1e-14));  // silu(-2) * 3
  silu_forward(ctx, y, gate);
  CHECK(y[0] == Approx(0.7310585786300049).epsilon(1e-14));
  CHECK(y[1] == Approx(-0.2384058440442351).epsilon(1e-14));
  // Saturation: no NaN at large |x|.
  Buf<float> big({2}), bigy({2});
  big.v = {-200.f, 200.f};
  silu_forward(ctx, bigy, big);
  CHECK(bigy[0] == 0.0f);  // -200 * sigmoid(-200) underflows to -0
  CHECK(bigy[1] == 200.0f);
}

TEST_CASE("swiglu_backward and silu_backward match finite differences", "[swiglu][grad]") {
  Ctx ctx = cpu_ctx();
  const int64_t r = 3, f = 4;
  Buf<double> gate = random_buf({r, f}, 91), up = random_buf({r, f}, 92);
  for (auto& g : gate.v) g *= 4;  // cover the curved part of silu
  Buf<double> gh = random_buf({r, f}, 93), h({r, f});
  auto loss = [&] {
    swiglu_forward(ctx, h, gate, up);
    return dot(gh.v, h.v);
  };
  Buf<double> dgate = random_buf({r, f}, 94), dup = random_buf({r, f}, 95);  // overwritten
  swiglu_backward(ctx, dgate, dup, gh, gate, up);
  check_gradient(gate.v, dgate.v, loss, 1e-6, 1e-6, 1e-9, "dgate");
  check_gradient(up.v, dup.v, loss, 1e-6, 1e-6, 1e-9, "dup");

  Buf<double> y({r, f}), dx = random_buf({r, f}, 96);
  auto silu_loss = [&] {
    silu_forward(ctx, y, gate);
    return dot(gh.v, y.v);
  };
  silu_backward(ctx, dx, gh, gate);
  check_gradient(gate.v, dx.v, silu_loss, 1e-6, 1e-6, 1e-9, "silu dx");
}

TEST_CASE("swiglu_weighted_forward scales each row by its weight", "[swiglu]") {
  Ctx ctx = cpu_ctx();
  Buf<double> gate({2, 2}), up({2, 2}), w({2}), h({2, 2}), plain({2, 2});
  gate.v = {1, -2, 0.5, 3};
  up.v = {2, 3, -1, 0.25};
  w.v = {0.25, 0.75};
  swiglu_weighted_forward(ctx, h, gate, up, w);
  swiglu_forward(ctx, plain, gate, up);
  CHECK(h[0] == Approx(0.25 * 1.4621171572600098).epsilon(1e-14));   // w0 silu(1) * 2
  CHECK(h[1] == Approx(0.25 * -0.7152175321327052).epsilon(1e-14));  // w0 silu(-2) * 3
  for (int i = 2; i < 4; ++i) CHECK(h[i] == Approx(0.75 * plain[i]).epsilon(1e-14));
  Buf<float> w_f32({2});
  CHECK_THROWS_WITH(swiglu_weighted_forward(ctx, h, gate, up, w_f32),
                    Catch::Contains("swiglu_weighted_forward: row_w"));
  Buf<double> w_bad({3});
  CHECK_THROWS_WITH(swiglu_weighted_forward(ctx, h, gate, up, w_bad),
                    Catch::Contains("swiglu_weighted_forward: row_w"));
}

TEST_CASE("swiglu_weighted_backward matches finite differences, also in place over dh",
          "[swiglu][grad]") {
  Ctx ctx = cpu_ctx();
  const int64_t r = 3, f = 5;
  Buf<double> gate = random_buf({r, f}, 111), up = random_buf({r, f}, 112);
  Buf<double> w = random_buf({r}, 113);
  for (auto& g : gate.v) g *= 4;
  for (auto& x : w.v) x = 0.5 + 0.5 * x;
  Buf<double> gh = random_buf({r, f}, 114), h({r, f});
  auto loss = [&] {
    swiglu_weighted_forward(ctx, h, gate, up, w);
    return dot(gh.v, h.v);
  };
  Buf<double> dgate = random_buf({r, f}, 115), dup = random_buf({r, f}, 116);  // overwritten
  Buf<double> dw = random_buf({r}, 117);
  swiglu_weighted_backward(ctx, dgate, dup, dw, gh, gate, up, w);
  check_gradient(gate.v, dgate.v, loss, 1e-6, 1e-6, 1e-9, "dgate");
  check_gradient(up.v, dup.v, loss, 1e-6, 1e-6, 1e-9, "dup");
  check_gradient(w.v, dw.v, loss, 1e-6, 1e-6, 1e-9, "drow_w");
  // dgate over dh: the grouped op's in-place use
  Buf<double> in_place = gh, dup2({r, f}), dw2({r});
  swiglu_weighted_backward(ctx, in_place, dup2, dw2, in_place, gate, up, w);
  CHECK(in_place.v == dgate.v);
  CHECK(dup2.v == dup.v);
  CHECK(dw2.v == dw.v);
}

TEST_CASE("swiglu f32 agrees with f64", "[swiglu][f32]") {
  Ctx ctx = cpu_ctx();
  const int64_t r = 50, f = 40;
  Buf<double> gate = random_buf({r, f}, 101), up = random_buf({r, f}, 102);
  for (auto& g : gate.v) g *= 6;
  Buf<double> gh = random_buf({r, f}, 103), h({r, f}), dgate({r, f}), dup({r, f});
  swiglu_forward(ctx, h, gate, up);
  swiglu_backward(ctx, dgate, dup, gh, gate, up);
  Buf<float> gatef = to_f32(gate), upf = to_f32(up), ghf = to_f32(gh);
  Buf<float> hf({r, f}), dgatef({r, f}), dupf({r, f});
  swiglu_forward(ctx, hf, gatef, upf);
  swiglu_backward(ctx, dgatef, dupf, ghf, gatef, upf);
  CHECK(max_rel_diff(hf.v, h.v) < 1e-6);
  CHECK(max_rel_diff(dgatef.v, dgate.v) < 1e-6);
  CHECK(max_rel_diff(dupf.v, dup.v) < 1e-6);
  Buf<double> bad({r, f + 1});
  CHECK_THROWS_AS(swiglu_forward(ctx, bad, gate, up), InternalError);
}

TEST_CASE("swiglu_weighted and silu f32 agree with f64", "[swiglu][f32]") {
  // The f32 instances the CPU trainer runs (the experts' weighted SwiGLU, the MoD predictor's
  // SiLU), on the same values as f64: every output within f32 rounding.
  Ctx ctx = cpu_ctx();
  const int64_t r = 50, f = 40;
  Buf<double> gate = random_buf({r, f}, 104), up = random_buf({r, f}, 105);
  Buf<double> dh = random_buf({r, f}, 106), w = random_buf({r}, 107);
  for (auto& g : gate.v) g = static_cast<float>(6 * g);
  for (auto& x : w.v) x = static_cast<float>(0.5 + 0.5 * x);
  Buf<float> gatef = to_f32(gate), upf = to_f32(up), dhf = to_f32(dh), wf = to_f32(w);

  Buf<double> h({r, f}), dgate({r, f}), dup({r, f}), dw({r}), y({r, f}), dx({r, f});
  Buf<float> hf({r, f}), dgatef({r, f}), dupf({r, f}), dwf({r}), yf({r, f}), dxf({r, f});
  swiglu_weighted_forward(ctx, h, gate, up, w);
  swiglu_weighted_forward(ctx, hf, gatef, upf, wf);
  swiglu_weighted_backward(ctx, dgate, dup, dw, dh, gate, up, w);
  swiglu_weighted_backward(ctx, dgatef, dupf, dwf, dhf, gatef, upf, wf);
  silu_forward(ctx, y, gate);
  silu_forward(ctx, yf, gatef);
  silu_backward(ctx, dx, dh, gate);
  silu_backward(ctx, dxf, dhf, gatef);
  CHECK(max_rel_diff(hf.v, h.v) < 1e-6);
  CHECK(max_rel_diff(dgatef.v, dgate.v) < 1e-6);
  CHECK(max_rel_diff(dupf.v, dup.v) < 1e-6);
  // drow_w sums F terms of either sign: relative to the row's sum of |terms|
  for (int64_t i = 0; i < r; ++i) {
    double terms = 0;
    for (int64_t j = 0; j < f; ++j)
      terms += std::fabs(dh[i * f + j] * cpu::silu(gate[i * f + j]) * up[i * f + j]);
    CHECK(std::fabs(dwf[i] - dw[i]) <= 1e-6 * terms);
  }
  CHECK(max_rel_diff(yf.v, y.v) < 1e-6);
  CHECK(max_rel_diff(dxf.v, dx.v) < 1e-6);
}
