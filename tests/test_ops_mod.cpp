// Tests of the Mixture-of-Depths CPU ops: per-sequence top-C selection and its mask, the gather of
// the kept rows and its accumulating backward, the gated scatter and its backward, and the causal
// predictor's head (silu, fc2) with its backward through the BCE.
// Forwards against hand-computed numbers; backwards against central finite differences in f64
// (loss = dot(random w, outputs), selection held fixed); f32 against f64 on random inputs.
// Gradient-check tolerances: gather is linear (rtol 1e-7); the scatter goes through a sigmoid,
// rtol 1e-6 and atol 1e-9, well above the ~1e-10 error of h = 1e-6 central differences.
#include <algorithm>
#include <cmath>
#include <vector>

#include "catch.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/loss.hpp"
#include "moe/ops/mod.hpp"
#include "moe/ops/swiglu.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

}  // namespace

// ---- selection ----------------------------------------------------------------------------------

TEST_CASE("mod_select: top-C per sequence, ties to the lower position, output ascending") {
  // Row 0: best is position 1 (0.9), then 0.5 ties at 0, 2, 4 -> 0 and 2.     sel = 0 1 2
  // Row 1: best 3 (5), then 0 (3), then 2 ties at 2, 4, 5 -> 2.               sel = 0 2 3
  //        (selection order 3, 0, 2; listed ascending)
  auto scores = make<double>({2, 6}, {0.5, 0.9, 0.5, 0.1, 0.5, 0.2,  //
                                      3, -1, 2, 5, 2, 2});
  Buf<int32_t> sel({2, 3});
  Buf<double> mask({2, 6});
  for (auto& m : mask.v) m = 7;  // overwritten
  Ctx ctx = cpu_ctx();
  mod_select(ctx, sel, mask, scores);
  CHECK(sel.v == std::vector<int32_t>{0, 1, 2, 0, 2, 3});
  CHECK(mask.v == std::vector<double>{1, 1, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0});
}

TEST_CASE("mod_select: C = T keeps everything, C = 1 keeps the argmax") {
  auto scores = make<double>({1, 4}, {0.3, -2, 0.3, 1.5});
  Ctx ctx = cpu_ctx();
  Buf<int32_t> all({1, 4}), one({1, 1});
  Buf<double> mask({1, 4});
  mod_select(ctx, all, mask, scores);
  CHECK(all.v == std::vector<int32_t>{0, 1, 2, 3});
  CHECK(mask.v == std::vector<double>{1, 1, 1, 1});
  mod_select(ctx, one, mask, scores);
  CHECK(one.v == std::vector<int32_t>{3});
  CHECK(mask.v == std::vector<double>{0, 0, 0, 1});
}

TEST_CASE("mod_select: random scores agree with a naive rank count, f32 with f64") {
  const int64_t b = 3, t = 50, c = 13;
  auto scores = random_buf({b, t}, 81);
  for (int64_t i = 0; i < b * t; i += 7) scores[i] = 0.25;  // plenty of ties
  for (auto& s : scores.v) s = static_cast<float>(s);       // same values in both dtypes
  Buf<int32_t> sel({b, c}), sel32({b, c});
  Buf<double> mask({b, t});
  Buf<float> mask32({b, t});
  Ctx ctx = cpu_ctx();
  mod_select(ctx, sel, mask, scores);
  mod_select(ctx, sel32, mask32, to_f32(scores));
  CHECK(sel32.v == sel.v);
  CHECK(max_rel_diff(mask32.v, mask.v) == 0);
  // Naive: i is kept iff fewer than C positions rank before it.
  std::vector<int32_t> want;
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t i = 0; i < t; ++i) {
      int64_t rank = 0;
      for (int64_t j = 0; j < t; ++j) {
        const double sj = scores[bi * t + j], si = scores[bi * t + i];
        rank += sj > si || (sj == si && j < i);
      }
      if (rank < c) want.push_back(static_cast<int32_t>(i));
    }
  CHECK(sel.v == want);
}

// ---- gather -------------------------------------------------------------------------------------

TEST_CASE("mod_gather_forward copies the kept rows, mod_gather_backward accumulates") {
  // B = 2, T = 3, C = 2, d = 2: sel = (0, 2), (1, 2) -> rows 0, 2, 4, 5 of x.
  auto sel = make<int32_t>({2, 2}, {0, 2, 1, 2});
  auto x = make<double>({6, 2}, {0, 1, 10, 11, 20, 21, 30, 31, 40, 41, 50, 51});
  Buf<double> xs({4, 2});
  Ctx ctx = cpu_ctx();
  mod_gather_forward(ctx, xs, x, sel);
  CHECK(xs.v == std::vector<double>{0, 1, 20, 21, 40, 41, 50, 51});
  Buf<double> dx({6, 2});
  for (auto& v : dx.v) v = 1;  // accumulated into
  auto dxs = make<double>({4, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  mod_gather_backward(ctx, dx, dxs, sel);
  CHECK(dx.v == std::vector<double>{2, 3, 1, 1, 4, 5, 1, 1, 6, 7, 8, 9});
}

TEST_CASE("mod_gather_backward matches finite differences") {
  const int64_t b = 2, t = 5, c = 3, d = 3;
  auto sel = make<int32_t>({b, c}, {0, 3, 4, 1, 2, 4});
  auto x = random_buf({b * t, d}, 91);
  auto w = random_buf({b * c, d}, 92);
  Buf<double> xs({b * c, d}), dx({b * t, d});
  Ctx ctx = cpu_ctx();
  mod_gather_backward(ctx, dx, w, sel);
  check_gradient(
      x.v, dx.v,
      [&] {
        mod_gather_forward(ctx, xs, x, sel);
        return dot(w.v, xs.v);
      },
      1e-6, 1e-7, 1e-10, "dx");
}

// ---- gated scatter ------------------------------------------------------------------------------

TEST_CASE("mod_scatter_forward: gated update on kept rows, the rest equal to x") {
  // B = 1, T = 4, C = 2, d = 2; kept positions 1 and 3 with scores 0 (g = 1/2) and ln 3 (g = 3/4).
  auto sel = make<int32_t>({1, 2}, {1, 3});
  auto scores = make<double>({1, 4}, {5.0, 0.0, -5.0, std::log(3.0)});
  auto x = make<double>({4, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  auto ys = make<double>({2, 2}, {13, -4, 11, 0});
  Buf<double> out({4, 2});
  Ctx ctx = cpu_ctx();
  mod_scatter_forward(ctx, out, x, ys, scores, sel);
  CHECK(out[0] == 1);  // skipped rows: bitwise x
  CHECK(out[1] == 2);
  CHECK(out[4] == 5);
  CHECK(out[5] == 6);
  CHECK(out[2] == Approx(3 + 0.5 * (13 - 3)).epsilon(1e-15));
  CHECK(out[3] == Approx(4 + 0.5 * (-4 - 4)).epsilon(1e-15));
  CHECK(out[6] == Approx(7 + 0.75 * (11 - 7)).epsilon(1e-15));
  CHECK(out[7] == Approx(8 + 0.75 * (0 - 8)).epsilon(1e-15));
}

TEST_CASE("mod_scatter_backward matches finite differences in x, ys and scores") {
  const int64_t b = 2, t = 5, c = 2, d = 3;
  auto scores = random_buf({b, t}, 101);
  for (auto& s : scores.v) s *= 2;
  Buf<int32_t> sel({b, c});
  Buf<double> mask({b, t});
  Ctx ctx = cpu_ctx();
  mod_select(ctx, sel, mask, scores);  // the selection is then held fixed
  auto x = random_buf({b * t, d}, 102);
  auto ys = random_buf({b * c, d}, 103);
  auto w = random_buf({b * t, d}, 104);
  Buf<double> out({b * t, d}), dx({b * t, d}), dys({b * c, d}), dscores({b, t});
  for (auto& v : dscores.v) v = 5;  // overwritten, including the skipped positions
  mod_scatter_backward(ctx, dx, dys, dscores, w, x, ys, scores, sel);
  auto loss = [&] {
    mod_scatter_forward(ctx, out, x, ys, scores, sel);
    return dot(w.v, out.v);
  };
  check_gradient(x.v, dx.v, loss, 1e-6, 1e-6, 1e-9, "dx");
  check_gradient(ys.v, dys.v, loss, 1e-6, 1e-6, 1e-9, "dys");
  check_gradient(scores.v, dscores.v, loss, 1e-6, 1e-6, 1e-9, "dscores");
  for (int64_t i = 0; i < b * t; ++i)
    if (mask[i] == 0) CHECK(dscores[i] == 0);
}

TEST_CASE("mod_scatter_backward: dx may alias dout") {
  const int64_t b = 1, t = 4, c = 2, d = 3;
  auto sel = make<int32_t>({b, c}, {0, 2});
  auto scores = random_buf({b, t}, 111);
  auto x = random_buf({b * t, d}, 112), ys = random_buf({b * c, d}, 113);
  auto dout = random_buf({b * t, d}, 114);
  Buf<double> dx({b * t, d}), dys({b * c, d}), dsc({b, t}), dys2({b * c, d}), dsc2({b, t});
  Ctx ctx = cpu_ctx();
  mod_scatter_backward(ctx, dx, dys, dsc, dout, x, ys, scores, sel);
  mod_scatter_backward(ctx, dout, dys2, dsc2, dout, x, ys, scores, sel);
  CHECK(dout.v == dx.v);
  CHECK(dys2.v == dys.v);
  CHECK(dsc2.v == dsc.v);
}

TEST_CASE("mod gather and scatter: f32 agrees with f64") {
  const int64_t b = 2, t = 7, c = 3, d = 4;
  auto scores = random_buf({b, t}, 121);
  for (auto& s : scores.v) s = static_cast<float>(s);
  Buf<int32_t> sel({b, c});
  Buf<double> mask({b, t});
  Ctx ctx = cpu_ctx();
  mod_select(ctx, sel, mask, scores);
  auto x = random_buf({b * t, d}, 122), ys = random_buf({b * c, d}, 123);
  auto dout = random_buf({b * t, d}, 124);
  auto sc32 = to_f32(scores), x32 = to_f32(x), ys32 = to_f32(ys), dout32 = to_f32(dout);
  Buf<double> xs({b * c, d}), out({b * t, d}), dx({b * t, d}), dys({b * c, d}), dsc({b, t});
  Buf<float> xs32({b * c, d}), out32({b * t, d}), dx32({b * t, d}), dys32({b * c, d}),
      dsc32({b, t});
  mod_gather_forward(ctx, xs, x, sel);
  mod_gather_forward(ctx, xs32, x32, sel);
  mod_scatter_forward(ctx, out, x, ys, scores, sel);
  mod_scatter_forward(ctx, out32, x32, ys32, sc32, sel);
  mod_scatter_backward(ctx, dx, dys, dsc, dout, x, ys, scores, sel);
  mod_scatter_backward(ctx, dx32, dys32, dsc32, dout32, x32, ys32, sc32, sel);
  CHECK(max_rel_diff(xs32.v, xs.v) < 1e-7);
  CHECK(max_rel_diff(out32.v, out.v) < 1e-6);
  CHECK(max_rel_diff(dx32.v, dx.v) < 1e-6);
  CHECK(max_rel_diff(dys32.v, dys.v) < 1e-6);
  CHECK(max_rel_diff(dsc32.v, dsc.v) < 1e-6);
  // a kept row by hand: out = x + sigmoid(r) (ys - x)
  const int64_t row = sel[0];
  CHECK(out[row * d] == Approx(x[row * d] + sigmoid(scores[row]) * (ys[0] - x[row * d])));
}

TEST_CASE("mod ops reject a selection that is out of range or not ascending") {
  Ctx ctx = cpu_ctx();
  Buf<double> x({6, 2}), xs({4, 2});
  auto unsorted = make<int32_t>({2, 2}, {2, 0, 0, 1});
  auto outside = make<int32_t>({2, 2}, {0, 3, 0, 1});
  CHECK_THROWS_AS(mod_gather_forward(ctx, xs, x, unsorted), InternalError);
  CHECK_THROWS_AS(mod_gather_forward(ctx, xs, x, outside), InternalError);
  Buf<double> scores({2, 3}), mask({2, 3});
  Buf<int32_t> too_many({2, 4});
  CHECK_THROWS_AS(mod_select(ctx, too_many, mask, scores), InternalError);
}

// ---- the causal predictor's head ----------------------------------------------------------------

TEST_CASE("mod_predictor_head_forward: silu(h) . w2 per row, as silu_forward and linear_forward") {
  const int64_t n = 7, p = 5;
  auto h = random_buf({n, p}, 131, -4, 4), w2 = random_buf({1, p}, 132);
  Buf<double> logit({n}), a({n, p}), want({n, 1});
  Ctx ctx = cpu_ctx();
  mod_predictor_head_forward(ctx, logit, h, w2);
  silu_forward(ctx, a, h);
  linear_forward(ctx, want, a, w2, false);
  for (int64_t i = 0; i < n; ++i) CHECK(logit[i] == Approx(want[i]).epsilon(1e-14));
}

TEST_CASE("mod_predictor_head_backward matches finite differences of the scaled BCE") {
  const int64_t n = 6, p = 4;
  const double grad_scale = 0.75;
  auto h = random_buf({n, p}, 141, -3, 3), w2 = random_buf({1, p}, 142, -2, 2);
  auto targets = make<double>({n}, {1, 0, 0, 1, 1, 0});
  Buf<double> logit({n}), loss({1}), dh({n, p}), dw2({1, p});
  Ctx ctx = cpu_ctx();
  mod_predictor_head_forward(ctx, logit, h, w2);
  for (auto& v : dh.v) v = 9;  // overwritten
  mod_predictor_head_backward(ctx, dh, dw2, h, w2, logit, targets, grad_scale);
  auto objective = [&] {
    mod_predictor_head_forward(ctx, logit, h, w2);
    bce_with_logits_forward(ctx, loss, logit, targets);
    return grad_scale * loss[0];
  };
  check_gradient(h.v, dh.v, objective, 1e-6, 1e-6, 1e-10, "dh");
  check_gradient(w2.v, dw2.v, objective, 1e-6, 1e-6, 1e-10, "dw2");

  // dw2 accumulates; dl as bce_with_logits_backward writes it
  const std::vector<double> once = dw2.v;
  mod_predictor_head_forward(ctx, logit, h, w2);
  mod_predictor_head_backward(ctx, dh, dw2, h, w2, logit, targets, grad_scale);
  for (int64_t j = 0; j < p; ++j) CHECK(dw2[j] == Approx(2 * once[j]).epsilon(1e-14));
  Buf<double> dl({n});
  bce_with_logits_backward(ctx, dl, logit, targets, grad_scale);
  Buf<double> s({n, p});
  silu_forward(ctx, s, h);
  double want = 0;
  for (int64_t i = 0; i < n; ++i) want += dl[i] * s[i * p + 2];
  CHECK(once[2] == Approx(want).epsilon(1e-13));
}

TEST_CASE("mod_predictor_head ops: f32 agrees with f64") {
  // The f32 instance the CPU trainer runs, on the same values as f64: logit and dh within f32
  // rounding, dw2 (a sum over N rows of either sign) relative to its column's sum of |terms|.
  const int64_t n = 40, p = 12;
  const double grad_scale = 0.75;
  auto h = random_buf({n, p}, 151, -4, 4), w2 = random_buf({1, p}, 152);
  auto dw0 = random_buf({1, p}, 153, -0.1, 0.1);
  for (auto& x : h.v) x = static_cast<float>(x);
  for (auto& x : w2.v) x = static_cast<float>(x);
  for (auto& x : dw0.v) x = static_cast<float>(x);
  Buf<double> targets({n});
  for (int64_t i = 0; i < n; ++i) targets[i] = (i * 7) % 3 == 0 ? 1.0 : 0.0;
  auto h32 = to_f32(h), w232 = to_f32(w2), t32 = to_f32(targets);
  Buf<double> logit({n}), dh({n, p}), dw2 = dw0;
  Buf<float> logit32({n}), dh32({n, p}), dw232 = to_f32(dw0);
  Ctx ctx = cpu_ctx();
  mod_predictor_head_forward(ctx, logit, h, w2);
  mod_predictor_head_forward(ctx, logit32, h32, w232);
  CHECK(max_rel_diff(logit32.v, logit.v) < 1e-6);
  // both backwards from the f64 logits (rounded to f32: the same values on both sides)
  for (auto& x : logit.v) x = static_cast<float>(x);
  auto logit_in32 = to_f32(logit);
  mod_predictor_head_backward(ctx, dh, dw2, h, w2, logit, targets, grad_scale);
  mod_predictor_head_backward(ctx, dh32, dw232, h32, w232, logit_in32, t32, grad_scale);
  CHECK(max_rel_diff(dh32.v, dh.v) < 1e-6);
  Buf<double> s({n, p});
  silu_forward(ctx, s, h);
  for (int64_t j = 0; j < p; ++j) {
    double terms = std::fabs(dw0[j]);
    for (int64_t i = 0; i < n; ++i) terms += grad_scale / n * std::fabs(s[i * p + j]);
    INFO("dw2[" << j << "] f32 " << dw232[j] << " f64 " << dw2[j]);
    CHECK(std::fabs(dw232[j] - dw2[j]) <= 1e-6 * terms);
  }
}

TEST_CASE("mod_predictor_head ops reject mismatched shapes") {
  Ctx ctx = cpu_ctx();
  Buf<double> h({4, 3}), w2({1, 2}), logit({4}), bad_logit({5}), good_w2({1, 3});
  CHECK_THROWS_AS(mod_predictor_head_forward(ctx, logit, h, w2), InternalError);
  CHECK_THROWS_AS(mod_predictor_head_forward(ctx, bad_logit, h, good_w2), InternalError);
  Buf<double> dh({4, 3}), dw2({1, 3}), targets({3});
  CHECK_THROWS_AS(mod_predictor_head_backward(ctx, dh, dw2, h, good_w2, logit, targets, 1.0),
                  InternalError);
}
