// Tests of the MoE routing ops on the CPU: router top-K (softmax, selection, renormalisation,
// counts), the aux and z losses, the bias update, the permutation plan, permute / unpermute (also
// the combine), the routing weights in row order, and the combine with the weights applied in the
// experts' SwiGLU against the weighted sum of expert outputs. Forwards are checked against
// hand-computed numbers, every backward against central finite differences in f64 (loss =
// dot(random w, outputs)), f32 against f64 on random inputs, and the reductions for bitwise
// determinism across thread counts. Gradient-check tolerances: the permute/combine maps are linear
// (or bilinear) in what is perturbed, so FD is exact up to rounding: rtol 1e-7. The router paths go
// through softmax/exp: rtol 1e-6, atol 1e-9, far above the ~1e-10 truncation + rounding error of h
// = 1e-6 central differences on O(1) losses, far below any real formula error.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "catch.hpp"
#include "common/float16.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/permute.hpp"
#include "moe/ops/router.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

// Logits whose row entries are a random permutation of {0, 0.7, 1.4, ...} plus noise in
// [-0.05, 0.05): every pair of scores differs by >= 0.6, so a 1e-6 perturbation cannot change the
// top-K set or its order.
Buf<double> separated_logits(int64_t n, int64_t e, uint64_t seed) {
  Buf<double> l({n, e});
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> noise(-0.05, 0.05);
  std::vector<int> perm(static_cast<size_t>(e));
  for (int64_t i = 0; i < n; ++i) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < e; ++j) l[i * e + j] = 0.7 * perm[j] + noise(rng);
  }
  return l;
}

// The outputs of router_topk_forward in type T.
template <class T>
struct Routing {
  Buf<T> probs, w;
  Buf<int32_t> idx, counts;
  Routing(int64_t n, int64_t e, int64_t k) : probs({n, e}), w({n, k}), idx({n, k}), counts({e}) {}
  void run(const Tensor& logits, const Tensor& bias, bool norm) {
    Ctx ctx = cpu_ctx();
    router_topk_forward(ctx, probs, idx, w, counts, logits, bias, norm);
  }
};

}  // namespace

// ---- router top-K forward -----------------------------------------------------------------------

TEST_CASE("router_topk_forward: ties go to the lower expert index and are listed first") {
  // K = 2. Row 0: experts 1, 2, 4 tie at 3 -> 1, 2 (4 loses the tie).
  // Row 1: experts 0, 2, 3 tie at 2 -> 0, 2.   Row 2: distinct, by descending score: 3, 1.
  // Row 3: unique best 0, then 1..4 tie -> 0, 1.   Row 4: 1 and 4 tie for best -> 1 listed first.
  auto logits = make<double>({5, 5}, {1,   3,   3,   0,   3,   //
                                      2,   1,   2,   2,   0,   //
                                      0.1, 0.5, 0.3, 0.9, -1,  //
                                      5,   0,   0,   0,   0,   //
                                      0,   4,   0,   0,   4});
  Routing<double> r(5, 5, 2);
  r.run(logits, Tensor(), true);
  CHECK(r.idx.v == std::vector<int32_t>{1, 2, 0, 2, 3, 1, 0, 1, 1, 4});
  CHECK(r.counts.v == std::vector<int32_t>{2, 4, 2, 1, 1});
  // Row 0: equal probabilities of the two picks -> weights 1/2 each after renormalisation.
  CHECK(r.w[0] == Approx(0.5).epsilon(1e-14));
  CHECK(r.w[1] == Approx(0.5).epsilon(1e-14));
  // Row 2: w = p_3 / (p_3 + p_1) = e^0.9 / (e^0.9 + e^0.5).
  CHECK(r.w[4] == Approx(std::exp(0.9) / (std::exp(0.9) + std::exp(0.5))).epsilon(1e-14));
  // probs = softmax by hand.
  const double z0 = std::exp(1.0) + 3 * std::exp(3.0) + 1.0;
  CHECK(r.probs[0] == Approx(std::exp(1.0) / z0).epsilon(1e-14));
  CHECK(r.probs[1] == Approx(std::exp(3.0) / z0).epsilon(1e-14));
  CHECK(r.probs[3] == Approx(1.0 / z0).epsilon(1e-14));
}

TEST_CASE("router_topk_forward: renormalised and raw weights") {
  // logits = log(1, 2, 3, 4) -> p = (0.1, 0.2, 0.3, 0.4); K = 2 picks experts 3, 2.
  auto logits = make<double>({1, 4}, {0.0, std::log(2.0), std::log(3.0), std::log(4.0)});
  Routing<double> r(1, 4, 2);
  r.run(logits, Tensor(), true);
  CHECK(r.idx.v == std::vector<int32_t>{3, 2});
  for (int e = 0; e < 4; ++e) CHECK(r.probs[e] == Approx(0.1 * (e + 1)).epsilon(1e-14));
  CHECK(r.w[0] == Approx(4.0 / 7).epsilon(1e-14));
  CHECK(r.w[1] == Approx(3.0 / 7).epsilon(1e-14));
  r.run(logits, Tensor(), false);
  CHECK(r.w[0] == Approx(0.4).epsilon(1e-14));
  CHECK(r.w[1] == Approx(0.3).epsilon(1e-14));
}

TEST_CASE("router_topk_forward: bias steers selection, weights use unbiased probabilities") {
  // logits = log(1, 2, 3, 4), bias = (+1, 0, 0, -1): scores (1, 0.69, 1.10, 0.39) -> experts 2, 0;
  // without the bias it would be 3, 2. The weights renormalise p = (0.3, 0.1): 0.75, 0.25.
  auto logits = make<double>({2, 4}, {0.0, std::log(2.0), std::log(3.0), std::log(4.0),  //
                                      0.0, std::log(2.0), std::log(3.0), std::log(4.0)});
  auto bias = make<double>({4}, {1.0, 0.0, 0.0, -1.0});
  Routing<double> r(2, 4, 2);
  r.run(logits, bias, true);
  CHECK(r.idx.v == std::vector<int32_t>{2, 0, 2, 0});
  CHECK(r.counts.v == std::vector<int32_t>{2, 0, 2, 0});
  CHECK(r.w[0] == Approx(0.75).epsilon(1e-14));
  CHECK(r.w[1] == Approx(0.25).epsilon(1e-14));
  for (int e = 0; e < 4; ++e) CHECK(r.probs[e] == Approx(0.1 * (e + 1)).epsilon(1e-14));
  r.run(logits, bias, false);
  CHECK(r.w[0] == Approx(0.3).epsilon(1e-14));
  CHECK(r.w[1] == Approx(0.1).epsilon(1e-14));
}

// ---- router top-K backward ----------------------------------------------------------------------

TEST_CASE("router_topk_backward matches finite differences (top-K set fixed)") {
  const int64_t n = 4, e = 6, k = 2;
  Ctx ctx = cpu_ctx();
  for (bool norm : {true, false}) {
    for (bool with_bias : {false, true}) {
      INFO("norm_topk_prob " << norm << ", bias " << with_bias);
      auto logits = separated_logits(n, e, 11 + norm + 2 * with_bias);
      auto bias = random_buf({e}, 5);
      for (auto& b : bias.v) b *= 0.2;  // steers, but keeps the scores >= 0.2 apart
      const Tensor bias_t = with_bias ? Tensor(bias) : Tensor();
      auto wout = random_buf({n, k}, 7);
      Routing<double> r(n, e, k);
      r.run(logits, bias_t, norm);
      const auto idx0 = r.idx.v;
      Buf<double> dlogits({n, e});
      router_topk_backward(ctx, dlogits, wout, r.probs, r.idx, norm);
      bool set_changed = false;
      Routing<double> rp(n, e, k);
      check_gradient(
          logits.v, dlogits.v,
          [&] {
            rp.run(logits, bias_t, norm);
            set_changed = set_changed || rp.idx.v != idx0;
            return dot(wout.v, rp.w.v);
          },
          1e-6, 1e-6, 1e-9, "dlogits");
      CHECK_FALSE(set_changed);
      // Without renormalisation the softmax spreads gradient onto every expert; with it, the
      // weights are invariant to the unselected logits.
      double unselected = 0;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t x = 0; x < e; ++x)
          if (std::find(idx0.begin() + i * k, idx0.begin() + (i + 1) * k, x) ==
              idx0.begin() + (i + 1) * k)
            unselected = std::max(unselected, std::fabs(dlogits[i * e + x]));
      if (norm)
        CHECK(unselected < 1e-15);
      else
        CHECK(unselected > 1e-3);
    }
  }
}

// ---- aux and z losses ---------------------------------------------------------------------------

TEST_CASE("router_aux_loss_forward: hand-computed aux and z loss") {
  // logits = log(1, 2, 1) and log(1, 1, 2): p = (.25, .5, .25), (.25, .25, .5); both lse = log 4.
  // K = 2: row 0 picks 1 then 0 (tie with 2), row 1 picks 2 then 0 -> counts (2, 1, 1).
  // f = counts / 4 = (.5, .25, .25), P = (.25, .375, .375), sum f P = 0.3125,
  // aux = coef * 3 * 0.3125, z = z_coef * (log 4)^2.
  const double l2 = std::log(2.0);
  auto logits = make<double>({2, 3}, {0, l2, 0, 0, 0, l2});
  Routing<double> r(2, 3, 2);
  r.run(logits, Tensor(), true);
  REQUIRE(r.counts.v == std::vector<int32_t>{2, 1, 1});
  Buf<double> losses({2});
  Ctx ctx = cpu_ctx();
  router_aux_loss_forward(ctx, losses, logits, r.probs, r.counts, 2, 0.01, 0.001);
  CHECK(losses[0] == Approx(0.01 * 3 * 0.3125).epsilon(1e-13));
  CHECK(losses[1] == Approx(0.001 * std::pow(std::log(4.0), 2)).epsilon(1e-13));
}

TEST_CASE("router_aux_loss_backward matches finite differences (counts held fixed)") {
  const int64_t n = 5, e = 4;
  const int k = 2;
  const double grad_scale = 0.7;
  Ctx ctx = cpu_ctx();
  const double coefs[3][2] = {{0.3, 0.0}, {0.0, 0.2}, {0.3, 0.2}};
  for (const auto& c : coefs) {
    INFO("aux_coef " << c[0] << ", z_coef " << c[1]);
    auto logits = random_buf({n, e}, 21);
    for (auto& x : logits.v) x *= 2;
    Routing<double> r(n, e, k);
    r.run(logits, Tensor(), true);
    const auto counts = r.counts;  // f_e is a constant of the loss
    // dlogits accumulates: start from random values and compare the increment.
    auto dlogits = random_buf({n, e}, 22);
    const auto before = dlogits.v;
    router_aux_loss_backward(ctx, dlogits, logits, r.probs, counts, k, c[0], c[1], grad_scale);
    std::vector<double> grad(dlogits.size());
    for (size_t i = 0; i < grad.size(); ++i) grad[i] = dlogits[i] - before[i];
    Routing<double> rp(n, e, k);
    Buf<double> losses({2});
    check_gradient(
        logits.v, grad,
        [&] {
          rp.run(logits, Tensor(), true);
          router_aux_loss_forward(ctx, losses, logits, rp.probs, counts, k, c[0], c[1]);
          return grad_scale * (losses[0] + losses[1]);
        },
        1e-6, 1e-6, 1e-9, "dlogits");
  }
}

TEST_CASE("router_aux_loss_forward is bitwise the same for 1, 2 and 3 threads") {
  const int64_t n = 301, e = 8;
  const int k = 2;
  auto logits = random_buf({n, e}, 31);
  Routing<double> r(n, e, k);
  r.run(logits, Tensor(), true);
  Ctx ctx = cpu_ctx();
  const int saved = omp_get_max_threads();
  std::vector<std::vector<double>> results;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    Buf<double> losses({2});
    router_aux_loss_forward(ctx, losses, logits, r.probs, r.counts, k, 0.01, 0.001);
    results.push_back(losses.v);
  }
  omp_set_num_threads(saved);
  CHECK(results[0] == results[1]);
  CHECK(results[0] == results[2]);
}

// ---- bias update --------------------------------------------------------------------------------

TEST_CASE("router_bias_update: sign of the load error, sign(0) = 0") {
  // mean load 2: overloaded expert 0 goes down, idle expert 3 goes up, balanced 1 and 2 stay.
  auto bias = make<double>({4}, {0.1, 0.2, 0.3, 0.4});
  auto load = make<double>({4}, {4, 2, 2, 0});
  Ctx ctx = cpu_ctx();
  router_bias_update(ctx, bias, load, 0.01);
  CHECK(bias[0] == Approx(0.09).epsilon(1e-14));
  CHECK(bias[1] == 0.2);
  CHECK(bias[2] == 0.3);
  CHECK(bias[3] == Approx(0.41).epsilon(1e-14));
}

// ---- router f32 vs f64 --------------------------------------------------------------------------

TEST_CASE("router ops: f32 agrees with f64") {
  const int64_t n = 40, e = 8, k = 2;
  auto logits = random_buf({n, e}, 41);
  for (auto& x : logits.v) x = static_cast<float>(3 * x);  // same values in both dtypes
  auto bias = random_buf({e}, 42);
  for (auto& x : bias.v) x = static_cast<float>(0.1 * x);
  auto dw = random_buf({n, k}, 43);
  auto logits32 = to_f32(logits), bias32 = to_f32(bias), dw32 = to_f32(dw);
  Ctx ctx = cpu_ctx();
  for (bool norm : {true, false}) {
    Routing<double> r64(n, e, k);
    Routing<float> r32(n, e, k);
    r64.run(logits, bias, norm);
    r32.run(logits32, bias32, norm);
    CHECK(r32.idx.v == r64.idx.v);
    CHECK(r32.counts.v == r64.counts.v);
    CHECK(max_rel_diff(r32.probs.v, r64.probs.v) < 1e-6);
    CHECK(max_rel_diff(r32.w.v, r64.w.v) < 1e-6);
    Buf<double> dl64({n, e});
    Buf<float> dl32({n, e});
    router_topk_backward(ctx, dl64, dw, r64.probs, r64.idx, norm);
    router_topk_backward(ctx, dl32, dw32, r32.probs, r32.idx, norm);
    CHECK(max_rel_diff(dl32.v, dl64.v) < 1e-6);
    Buf<double> l64({2});
    Buf<float> l32({2});
    router_aux_loss_forward(ctx, l64, logits, r64.probs, r64.counts, k, 0.01, 0.001);
    router_aux_loss_forward(ctx, l32, logits32, r32.probs, r32.counts, k, 0.01, 0.001);
    CHECK(max_rel_diff(l32.v, l64.v) < 1e-6);
    router_aux_loss_backward(ctx, dl64, logits, r64.probs, r64.counts, k, 0.01, 0.001, 1.0);
    router_aux_loss_backward(ctx, dl32, logits32, r32.probs, r32.counts, k, 0.01, 0.001, 1.0);
    CHECK(max_rel_diff(dl32.v, dl64.v) < 1e-6);
  }
}

// ---- permutation plan ---------------------------------------------------------------------------

TEST_CASE("moe_permute_plan: hand case with an empty expert and a dominant one") {
  // N = 4, K = 2, E = 4. Slots s = n*K + k route to experts 2 0 | 2 3 | 2 0 | 0 2:
  // expert 0 gets slots 1, 5, 6; expert 1 none; expert 2 slots 0, 2, 4, 7; expert 3 slot 3.
  auto topk = make<int32_t>({4, 2}, {2, 0, 2, 3, 2, 0, 0, 2});
  Buf<int32_t> offsets({5}), row_token({8}), slot_row({8});
  Ctx ctx = cpu_ctx();
  moe_permute_plan(ctx, offsets, row_token, slot_row, topk);
  CHECK(offsets.v == std::vector<int32_t>{0, 3, 3, 7, 8});
  CHECK(slot_row.v == std::vector<int32_t>{3, 0, 4, 7, 5, 1, 2, 6});
  CHECK(row_token.v == std::vector<int32_t>{0, 2, 3, 0, 1, 2, 3, 1});
}

TEST_CASE("moe_permute_plan: random routing is a stable counting sort") {
  const int64_t n = 37, k = 3, e = 7;
  Buf<int32_t> topk({n, k});
  std::mt19937 rng(5);
  for (int64_t i = 0; i < n; ++i) {  // K distinct experts per token, skewed towards expert 0
    std::vector<int32_t> ex(e);
    std::iota(ex.begin(), ex.end(), 0);
    std::shuffle(ex.begin() + 1, ex.end(), rng);
    if (i % 3 == 0) std::swap(ex[0], ex[e - 1]);
    for (int64_t j = 0; j < k; ++j) topk[i * k + j] = ex[j];
  }
  Buf<int32_t> offsets({e + 1}), row_token({n * k}), slot_row({n * k});
  Ctx ctx = cpu_ctx();
  moe_permute_plan(ctx, offsets, row_token, slot_row, topk);
  CHECK(offsets[0] == 0);
  CHECK(offsets[e] == n * k);
  std::vector<int> seen(n * k, 0);
  for (int64_t s = 0; s < n * k; ++s) {
    const int32_t r = slot_row[s], ex = topk[s];
    REQUIRE((0 <= r && r < n * k));
    ++seen[r];
    CHECK((offsets[ex] <= r && r < offsets[ex + 1]));  // inside its expert's range
    CHECK(row_token[r] == s / k);
    if (s > 0)  // stable: later slots of the same expert sit in later rows
      for (int64_t q = 0; q < s; ++q)
        if (topk[q] == ex) CHECK(slot_row[q] < r);
  }
  CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
}

// ---- permute / unpermute ------------------------------------------------------------------------

TEST_CASE("permute_forward gathers rows, permute_backward sums a token's K copies") {
  auto topk = make<int32_t>({4, 2}, {2, 0, 2, 3, 2, 0, 0, 2});  // the hand plan above
  Buf<int32_t> offsets({5}), row_token({8}), slot_row({8});
  Ctx ctx = cpu_ctx();
  moe_permute_plan(ctx, offsets, row_token, slot_row, topk);
  auto x = make<double>({4, 2}, {1, 10, 2, 20, 3, 30, 4, 40});
  Buf<double> xp({8, 2});
  permute_forward(ctx, xp, x, row_token);  // row r holds token row_token[r] = 0 2 3 0 1 2 3 1
  CHECK(xp.v == std::vector<double>{1, 10, 3, 30, 4, 40, 1, 10, 2, 20, 3, 30, 4, 40, 2, 20});
  // dxp row r = (r, 10 r): token 0 owns rows 3, 0; token 1 rows 4, 7; token 2 rows 5, 1;
  // token 3 rows 2, 6.
  Buf<double> dxp({8, 2}), dx({4, 2});
  for (int r = 0; r < 8; ++r) dxp[2 * r] = r, dxp[2 * r + 1] = 10 * r;
  for (auto& v : dx.v) v = 99;  // overwritten
  permute_backward(ctx, dx, dxp, Tensor(), slot_row);
  CHECK(dx.v == std::vector<double>{3, 30, 11, 110, 6, 60, 8, 80});
  // A second source adds its rows in the same gather: dxp2 row r = (100 r, 1000 r).
  Buf<double> dxp2({8, 2});
  for (int r = 0; r < 8; ++r) dxp2[2 * r] = 100 * r, dxp2[2 * r + 1] = 1000 * r;
  permute_backward(ctx, dx, dxp, dxp2, slot_row);
  CHECK(dx.v == std::vector<double>{303, 3030, 1111, 11110, 606, 6060, 808, 8080});
  Buf<double> bad({7, 2});
  try {
    permute_backward(ctx, dx, dxp, bad, slot_row);
    FAIL("a dxp2 of the wrong shape was accepted");
  } catch (const InternalError& e) {
    CHECK(std::string(e.what()).find("permute_backward: dxp2") != std::string::npos);
  }
  // permute_backward_add: the same sums from base's rows (the MoE combine with the residual add).
  auto base = make<double>({4, 2}, {0.5, -1, 2, 4, -3, 0.25, 7, 8});
  Buf<double> y({4, 2});
  for (auto& v : y.v) v = 99;  // overwritten
  permute_backward_add(ctx, y, base, dxp, slot_row);
  CHECK(y.v == std::vector<double>{3.5, 29, 13, 114, 3, 60.25, 15, 88});
  try {
    permute_backward_add(ctx, y, y, dxp, slot_row);
    FAIL("base in y's memory was accepted");
  } catch (const InternalError& e) {
    CHECK(std::string(e.what()).find("base must not be y's memory") != std::string::npos);
  }
  try {
    permute_backward_add(ctx, y, bad, dxp, slot_row);
    FAIL("a base of the wrong shape was accepted");
  } catch (const InternalError& e) {
    CHECK(std::string(e.what()).find("permute_backward_add: base") != std::string::npos);
  }
}

TEST_CASE("permute_backward matches finite differences of permute_forward") {
  const int64_t n = 5, k = 2, e = 3, d = 3;
  auto topk = make<int32_t>({n, k}, {0, 1, 1, 2, 0, 2, 1, 0, 2, 1});
  Buf<int32_t> offsets({e + 1}), row_token({n * k}), slot_row({n * k});
  Ctx ctx = cpu_ctx();
  moe_permute_plan(ctx, offsets, row_token, slot_row, topk);
  auto x = random_buf({n, d}, 51);
  auto w = random_buf({n * k, d}, 52);
  Buf<double> xp({n * k, d}), dx({n, d});
  permute_backward(ctx, dx, w, Tensor(), slot_row);
  check_gradient(
      x.v, dx.v,
      [&] {
        permute_forward(ctx, xp, x, row_token);
        return dot(w.v, xp.v);
      },
      1e-6, 1e-7, 1e-10, "dx");
  // With a second source (the MoE layer's gradients through w1 and w3 gathered at once): the
  // gradient of dot(w, xp) + dot(w2, xp), into a dx that held other values.
  auto w2 = random_buf({n * k, d}, 53);
  Buf<double> dx2 = random_buf({n, d}, 54);  // overwritten
  permute_backward(ctx, dx2, w, w2, slot_row);
  check_gradient(
      x.v, dx2.v,
      [&] {
        permute_forward(ctx, xp, x, row_token);
        return dot(w.v, xp.v) + dot(w2.v, xp.v);
      },
      1e-6, 1e-7, 1e-10, "dx with dxp2");
}

// permute_backward_add (the combine with the residual add, y = base + the sum of each token's K
// rows of yp) on random values: y against base + permute_backward(yp), and its adjoint by finite
// differences: d/dbase = dy, d/dyp = permute_forward(dy) (each row the gradient of its token).
TEST_CASE("permute_backward_add is base + the combine; its gradients by finite differences") {
  const int64_t n = 5, k = 2, e = 3, d = 3;
  auto topk = make<int32_t>({n, k}, {2, 1, 0, 2, 1, 0, 2, 0, 1, 2});
  Buf<int32_t> offsets({e + 1}), row_token({n * k}), slot_row({n * k});
  Ctx ctx = cpu_ctx();
  moe_permute_plan(ctx, offsets, row_token, slot_row, topk);
  auto base = random_buf({n, d}, 55), yp = random_buf({n * k, d}, 56), w = random_buf({n, d}, 57);
  Buf<double> y = random_buf({n, d}, 58);  // overwritten
  permute_backward_add(ctx, y, base, yp, slot_row);
  Buf<double> combined({n, d});
  permute_backward(ctx, combined, yp, Tensor(), slot_row);
  for (int64_t i = 0; i < n * d; ++i)
    CHECK(y[i] == Approx(base[i] + combined[i]).epsilon(1e-14).margin(1e-14));
  auto loss = [&] {
    permute_backward_add(ctx, y, base, yp, slot_row);
    return dot(w.v, y.v);
  };
  Buf<double> dyp({n * k, d});
  permute_forward(ctx, dyp, w, row_token);
  check_gradient(base.v, w.v, loss, 1e-6, 1e-7, 1e-10, "dbase");
  check_gradient(yp.v, dyp.v, loss, 1e-6, 1e-7, 1e-10, "dyp");
}

// ---- routing weights in row order, combine ------------------------------------------------------

TEST_CASE("permute_weights_forward puts each slot's weight on its row; the backward gathers back") {
  auto topk = make<int32_t>({2, 2}, {1, 0, 0, 1});  // slot_row = (2, 0, 1, 3)
  Buf<int32_t> offsets({3}), row_token({4}), slot_row({4});
  Ctx ctx = cpu_ctx();
  moe_permute_plan(ctx, offsets, row_token, slot_row, topk);
  REQUIRE(slot_row.v == std::vector<int32_t>{2, 0, 1, 3});
  auto w = make<double>({2, 2}, {0.25, 0.75, 0.5, 2.0});
  Buf<double> row_w({4});
  permute_weights_forward(ctx, row_w, w, slot_row);
  CHECK(row_w.v == std::vector<double>{0.75, 0.5, 0.25, 2.0});
  auto drow = make<double>({4}, {1, 2, 3, 4});
  Buf<double> dw({2, 2});
  permute_weights_backward(ctx, dw, drow, slot_row);
  CHECK(dw.v == std::vector<double>{3, 1, 2, 4});
  Buf<float> row_w32({4});
  CHECK_THROWS_WITH(permute_weights_forward(ctx, row_w32, w, slot_row),
                    Catch::Contains("permute_weights_forward: row_w, topk_w"));
  Buf<double> short_row({3});
  CHECK_THROWS_WITH(permute_weights_backward(ctx, dw, short_row, slot_row),
                    Catch::Contains("permute_weights_backward: drow_w"));
  auto bad_rows = make<int32_t>({4}, {2, 0, 4, 3});
  CHECK_THROWS_WITH(permute_weights_forward(ctx, row_w, w, bad_rows),
                    Catch::Contains("permute_weights_forward: slot_row"));
}

TEST_CASE("permute_weights_backward matches finite differences") {
  const int64_t n = 4, k = 3, e = 5;
  auto topk = make<int32_t>({n, k}, {4, 0, 2, 1, 4, 3, 0, 2, 4, 3, 2, 1});
  Buf<int32_t> offsets({e + 1}), row_token({n * k}), slot_row({n * k});
  Ctx ctx = cpu_ctx();
  moe_permute_plan(ctx, offsets, row_token, slot_row, topk);
  auto tw = random_buf({n, k}, 62), wr = random_buf({n * k}, 63);
  Buf<double> row_w({n * k}), dtw({n, k});
  permute_weights_backward(ctx, dtw, wr, slot_row);
  check_gradient(
      tw.v, dtw.v,
      [&] {
        permute_weights_forward(ctx, row_w, tw, slot_row);
        return dot(wr.v, row_w.v);
      },
      1e-6, 1e-7, 1e-10, "dtopk_w");
}

// The MoE layer's reordering: y[n] = sum_k w_nk W2_e (silu(W1_e x) * W3_e x) computed directly,
// against the routing weights applied in the SwiGLU and the combine as permute_backward's sum.
TEST_CASE("the combine after the weighted SwiGLU is the weighted sum of the expert outputs") {
  const int64_t n = 6, k = 2, e = 3, d = 4, f = 5;
  Buf<int32_t> topk({n, k});
  for (int64_t i = 0; i < n; ++i) topk[i * k] = i % e, topk[i * k + 1] = (i + 1) % e;
  Buf<int32_t> offsets({e + 1}), row_token({n * k}), slot_row({n * k});
  Ctx ctx = cpu_ctx();
  moe_permute_plan(ctx, offsets, row_token, slot_row, topk);
  auto x = random_buf({n, d}, 81), tw = random_buf({n, k}, 82);
  auto w1 = random_buf({e, f, d}, 83), w3 = random_buf({e, f, d}, 84),
       w2 = random_buf({e, d, f}, 85);
  Buf<double> row_w({n * k}), xp({n * k, d}), gate({n * k, f}), up({n * k, f}), h({n * k, f});
  Buf<double> yp({n * k, d}), y({n, d});
  permute_weights_forward(ctx, row_w, tw, slot_row);
  permute_forward(ctx, xp, x, row_token);
  grouped_swiglu_forward(ctx, gate, up, h, xp, w1, w3, row_w, offsets);
  grouped_linear_forward(ctx, yp, h, w2, offsets);
  permute_backward(ctx, y, yp, Tensor(), slot_row);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < d; ++j) {
      double want = 0;
      for (int64_t i = 0; i < k; ++i) {
        const int64_t ex = topk[t * k + i];
        double out = 0;
        for (int64_t q = 0; q < f; ++q) {
          double g = 0, u = 0;
          for (int64_t c = 0; c < d; ++c) {
            g += w1[(ex * f + q) * d + c] * x[t * d + c];
            u += w3[(ex * f + q) * d + c] * x[t * d + c];
          }
          out += w2[(ex * d + j) * f + q] * g / (1 + std::exp(-g)) * u;
        }
        want += tw[t * k + i] * out;
      }
      CHECK(y[t * d + j] == Approx(want).epsilon(1e-12).margin(1e-14));
    }
}

TEST_CASE("permute and the routing weights: f32 agrees with f64") {
  const int64_t n = 9, k = 2, e = 4, d = 5;
  Buf<int32_t> topk({n, k});
  for (int64_t i = 0; i < n; ++i) topk[i * k] = i % e, topk[i * k + 1] = (i + 1 + i / 4) % e;
  Buf<int32_t> offsets({e + 1}), row_token({n * k}), slot_row({n * k});
  Ctx ctx = cpu_ctx();
  moe_permute_plan(ctx, offsets, row_token, slot_row, topk);
  auto x = random_buf({n, d}, 71), yp = random_buf({n * k, d}, 72);
  auto tw = random_buf({n, k}, 73);
  auto x32 = to_f32(x), yp32 = to_f32(yp), tw32 = to_f32(tw);
  Buf<double> xp({n * k, d}), dx({n, d}), row_w({n * k}), dtw({n, k});
  Buf<float> xp32({n * k, d}), dx32({n, d}), row_w32({n * k}), dtw32({n, k});
  permute_forward(ctx, xp, x, row_token);
  permute_forward(ctx, xp32, x32, row_token);
  permute_backward(ctx, dx, yp, Tensor(), slot_row);
  permute_backward(ctx, dx32, yp32, Tensor(), slot_row);
  permute_weights_forward(ctx, row_w, tw, slot_row);
  permute_weights_forward(ctx, row_w32, tw32, slot_row);
  permute_weights_backward(ctx, dtw, row_w, slot_row);
  permute_weights_backward(ctx, dtw32, row_w32, slot_row);
  CHECK(max_rel_diff(xp32.v, xp.v) < 1e-7);
  CHECK(max_rel_diff(dx32.v, dx.v) < 1e-6);
  CHECK(max_rel_diff(row_w32.v, row_w.v) < 1e-7);
  CHECK(dtw.v == tw.v);  // the round trip of a permutation
  CHECK(dtw32.v == tw32.v);
  // the combine with the residual add
  auto base = random_buf({n, d}, 74);
  auto base32 = to_f32(base);
  Buf<double> y({n, d});
  Buf<float> y32({n, d});
  permute_backward_add(ctx, y, base, yp, slot_row);
  permute_backward_add(ctx, y32, base32, yp32, slot_row);
  CHECK(max_rel_diff(y32.v, y.v) < 1e-6);
}

TEST_CASE("routing ops reject bad indices and shapes") {
  Ctx ctx = cpu_ctx();
  auto topk = make<int32_t>({2, 1}, {0, 3});  // expert 3 does not exist for E = 3
  Buf<int32_t> offsets({4}), row_token({2}), slot_row({2});
  CHECK_THROWS_AS(moe_permute_plan(ctx, offsets, row_token, slot_row, topk), InternalError);
  Buf<double> logits({2, 3}), probs({2, 4}), w({2, 1});
  Buf<int32_t> idx({2, 1}), counts({3});
  CHECK_THROWS_AS(router_topk_forward(ctx, probs, idx, w, counts, logits, Tensor(), true),
                  InternalError);
  Buf<double> probs_ok({2, 3});
  // A non-finite row is the numbers' divergence, not a bug: the trainer reports it as such.
  logits[4] = std::nan("");
  CHECK_THROWS_AS(router_topk_forward(ctx, probs_ok, idx, w, counts, logits, Tensor(), true),
                  NonFiniteError);
  logits[4] = 0, logits[0] = INFINITY;
  CHECK_THROWS_AS(router_topk_forward(ctx, probs_ok, idx, w, counts, logits, Tensor(), true),
                  NonFiniteError);
  logits[0] = 0;
  CHECK_NOTHROW(router_topk_forward(ctx, probs_ok, idx, w, counts, logits, Tensor(), true));
}

// ---- the grouped backward's bf16 weight gradient --------------------------------------------

namespace {

using float16::bf16_to_float;
using float16::float_to_bf16;

// A host bf16 tensor of raw bits.
struct Bf16Buf {
  std::vector<uint16_t> v;
  Tensor t;
  Bf16Buf(std::initializer_list<int64_t> dims, std::vector<uint16_t> bits) : v(std::move(bits)) {
    t = Tensor(v.data(), DType::bf16, Device{}, dims);
    REQUIRE(static_cast<int64_t>(v.size()) == t.numel());
  }
  Bf16Buf(const Bf16Buf&) = delete;
  operator Tensor() const { return t; }
};

std::vector<uint16_t> random_bf16(size_t n, uint64_t seed) {
  const Buf<double> r = random_buf({static_cast<int64_t>(n)}, seed);
  std::vector<uint16_t> bits(n);
  for (size_t i = 0; i < n; ++i) bits[i] = float_to_bf16(static_cast<float>(r.v[i]));
  return bits;
}

// The bf16 form's want: the f32 gradient from zero rounded once, onto dw0 unless overwrite; an
// expert without rows keeps dw0's bits (zeros with overwrite).
std::vector<uint16_t> rounded_dw(const std::vector<float>& sums, const std::vector<uint16_t>& dw0,
                                 const std::vector<int32_t>& offsets, bool overwrite) {
  const size_t experts = offsets.size() - 1, per_expert = sums.size() / experts;
  std::vector<uint16_t> want(sums.size());
  for (size_t i = 0; i < sums.size(); ++i) {
    const size_t e = i / per_expert;
    const bool empty = offsets[e] == offsets[e + 1];
    want[i] = overwrite ? float_to_bf16(sums[i])
              : empty   ? dw0[i]
                        : float_to_bf16(bf16_to_float(dw0[i]) + sums[i]);
  }
  return want;
}

}  // namespace

TEST_CASE("grouped backward ops with a bf16 dw: the f32 gradient rounded once per element") {
  Ctx ctx = cpu_ctx();
  const int64_t e = 4, r = 9, in = 6, out = 5;
  const auto offsets = make<int32_t>({e + 1}, {0, 2, 2, 7, 9});  // expert 1 has no rows
  const auto x = to_f32(random_buf({r, in}, 81)), w = to_f32(random_buf({e, out, in}, 82)),
             w3 = to_f32(random_buf({e, out, in}, 83)), dy = to_f32(random_buf({r, out}, 84)),
             dy3 = to_f32(random_buf({r, out}, 85));
  // the f32 gradients from zero (and dx) the bf16 form rounds
  Buf<float> dx({r, in}), sums({e, out, in}), sums3({e, out, in});
  grouped_linear_backward(ctx, dx, sums, dy, x, w, offsets, true);
  for (bool overwrite : {true, false}) {
    INFO("overwrite " << overwrite);
    const std::vector<uint16_t> dw0 = random_bf16(static_cast<size_t>(e * out * in), 86);
    Bf16Buf dw({e, out, in}, dw0);
    Buf<float> dx16({r, in});
    grouped_linear_backward(ctx, dx16, dw, dy, x, w, offsets, overwrite);
    CHECK(dw.v == rounded_dw(sums.v, dw0, offsets.v, overwrite));
    CHECK(dx16.v == dx.v);
  }
  {  // the pair: each gradient rounded as its own grouped_linear_backward's
    Buf<float> pdx({r, in}), pdx2({r, in});
    grouped_linear_backward_pair(ctx, pdx, pdx2, sums, sums3, dy, dy3, x, w, w3, offsets, true);
    const std::vector<uint16_t> dw0 = random_bf16(static_cast<size_t>(e * out * in), 87);
    Bf16Buf dw1({e, out, in}, dw0), dw3({e, out, in}, dw0);
    Buf<float> dx16({r, in}), dx2({r, in});
    grouped_linear_backward_pair(ctx, dx16, dx2, dw1, dw3, dy, dy3, x, w, w3, offsets, false);
    CHECK(dw1.v == rounded_dw(sums.v, dw0, offsets.v, false));
    CHECK(dw3.v == rounded_dw(sums3.v, dw0, offsets.v, false));
    CHECK(dx16.v == pdx.v);
    // dw1 and dw3 of one dtype
    CHECK_THROWS_WITH(
        grouped_linear_backward_pair(ctx, dx16, dx2, dw1, sums3, dy, dy3, x, w, w3, offsets, false),
        Catch::Contains("grouped_linear_backward_pair: dw3, dw1"));
  }
  {  // the down projection's backward (h = x, w2 = w): dw2 as grouped_linear_backward's
    const auto gate = to_f32(random_buf({r, in}, 92)), up = to_f32(random_buf({r, in}, 93)),
               row_w = to_f32(random_buf({r}, 94, 0.1, 1.0));
    const std::vector<uint16_t> dw0 = random_bf16(static_cast<size_t>(e * out * in), 95);
    Bf16Buf dw2({e, out, in}, dw0);
    Buf<float> dgate({r, in}), dup({r, in}), drow({r});
    grouped_swiglu_down_backward(ctx, dgate, dup, drow, dw2, dy, x, w, gate, up, row_w, offsets);
    CHECK(dw2.v == rounded_dw(sums.v, dw0, offsets.v, false));
  }
  // bf16 beside f64 inputs (on the CPU, f32 only)
  const auto x64 = random_buf({r, in}, 88), w64 = random_buf({e, out, in}, 89),
             dy64 = random_buf({r, out}, 90);
  Buf<double> dx64({r, in});
  Bf16Buf dw({e, out, in}, random_bf16(static_cast<size_t>(e * out * in), 91));
  CHECK_THROWS_WITH(grouped_linear_backward(ctx, dx64, dw, dy64, x64, w64, offsets),
                    Catch::Contains("grouped_linear_backward: dw: dtype bf16 needs bf16 inputs"));
}
