// Tests of the CPU losses (softmax cross-entropy, BCE with logits) and of AdamW.
// Forwards against hand computations (log-softmax written out, the naive BCE formula, AdamW steps
// worked through by hand), backwards against central finite differences in f64, f32 against f64 on
// random inputs, and the BCE mean for bitwise determinism across thread counts. AdamW's norm_sq
// path (clipping and the overflow skip decided inside the op) against the host-computed clip
// factor, bit for bit; its compute_out (the fused 16-bit compute copy) against convert after the
// step, bit for bit, and unchanged by a skipped step.
// Gradient-check tolerances: rtol 1e-6, atol 1e-9 for both losses (softmax / sigmoid), well above
// the ~1e-10 truncation + rounding error of h = 1e-6 central differences on O(1) losses.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/loss.hpp"
#include "moe/ops/optim.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

// -log softmax(l)[t], written out without any shift (fine for the small logits it is used on).
double naive_ce(const std::vector<double>& l, int t) {
  double s = 0;
  for (double v : l) s += std::exp(v);
  return -std::log(std::exp(l[t]) / s);
}

// -(t log s + (1 - t) log(1 - s)), s = sigmoid(x): the textbook form (overflows for large |x|).
double naive_bce(double x, double t) {
  const double s = 1 / (1 + std::exp(-x));
  return -(t * std::log(s) + (1 - t) * std::log(1 - s));
}

}  // namespace

// ---- cross-entropy ------------------------------------------------------------------------------

TEST_CASE("cross_entropy_forward: log-softmax by hand, ignored targets, large logits") {
  // Row 2 is row 0 shifted by 1000: without the max shift exp would overflow.
  auto logits = make<double>({4, 3}, {0.5, -1, 2,         //
                                      1, 2, 3,            //
                                      1000.5, 999, 1002,  //
                                      0.1, 0.2, 0.3});
  auto targets = make<int32_t>({4}, {2, -1, 0, 1});
  Buf<double> losses({4}), lse({4});
  Ctx ctx = cpu_ctx();
  cross_entropy_forward(ctx, losses, lse, logits, targets);
  CHECK(losses[0] == Approx(naive_ce({0.5, -1, 2}, 2)).epsilon(1e-14));
  CHECK(losses[1] == 0);  // ignored
  CHECK(losses[2] == Approx(naive_ce({0.5, -1, 2}, 0)).epsilon(1e-12));
  CHECK(losses[3] == Approx(naive_ce({0.1, 0.2, 0.3}, 1)).epsilon(1e-14));
  CHECK(lse[1] == Approx(std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0))).epsilon(1e-14));
  CHECK(lse[2] ==
        Approx(1000 + std::log(std::exp(0.5) + std::exp(-1.0) + std::exp(2.0))).epsilon(1e-14));
}

TEST_CASE("cross_entropy_backward matches finite differences; ignored rows are zero") {
  const int64_t n = 4, v = 5;
  const double grad_scale = 0.3;
  auto logits = random_buf({n, v}, 131, -2, 2);
  auto targets = make<int32_t>({n}, {3, -1, 0, 4});
  Buf<double> losses({n}), lse({n}), dlogits({n, v});
  Ctx ctx = cpu_ctx();
  cross_entropy_forward(ctx, losses, lse, logits, targets);
  cross_entropy_backward(ctx, dlogits, logits, lse, targets, grad_scale);
  for (int64_t j = 0; j < v; ++j) CHECK(dlogits[1 * v + j] == 0);  // ignored row
  Buf<double> lse2({n});
  check_gradient(
      logits.v, dlogits.v,
      [&] {
        cross_entropy_forward(ctx, losses, lse2, logits, targets);
        double s = 0;
        for (double l : losses.v) s += l;
        return grad_scale * s;
      },
      1e-6, 1e-6, 1e-9, "dlogits");
}

TEST_CASE("cross_entropy_backward: dlogits may alias logits") {
  const int64_t n = 3, v = 6;
  auto logits = random_buf({n, v}, 141, -3, 3);
  auto targets = make<int32_t>({n}, {5, 0, -1});
  Buf<double> losses({n}), lse({n}), dlogits({n, v});
  Ctx ctx = cpu_ctx();
  cross_entropy_forward(ctx, losses, lse, logits, targets);
  cross_entropy_backward(ctx, dlogits, logits, lse, targets, 1.0);
  cross_entropy_backward(ctx, logits, logits, lse, targets, 1.0);  // in place
  CHECK(logits.v == dlogits.v);
  // rows of softmax - onehot sum to zero
  double row0 = 0;
  for (int64_t j = 0; j < v; ++j) row0 += dlogits[j];
  CHECK(std::fabs(row0) < 1e-15);
}

TEST_CASE("cross_entropy_forward_backward: the two ops' bits, in place too; shapes checked") {
  const int64_t n = 5, v = 37;
  auto logits = random_buf({n, v}, 161, -4, 4);
  auto targets = make<int32_t>({n}, {36, -1, 0, 17, 17});
  const double grad_scale = 0.61;
  Ctx ctx = cpu_ctx();
  Buf<double> losses({n}), lse({n}), dlogits({n, v});
  cross_entropy_forward(ctx, losses, lse, logits, targets);
  cross_entropy_backward(ctx, dlogits, logits, lse, targets, grad_scale);
  Buf<double> losses2({n}), lse2({n}), dlogits2({n, v});
  for (Buf<double>* b : {&losses2, &lse2, &dlogits2}) std::fill(b->v.begin(), b->v.end(), -7.0);
  cross_entropy_forward_backward(ctx, losses2, lse2, dlogits2, logits, targets, grad_scale);
  CHECK(losses2.v == losses.v);
  CHECK(lse2.v == lse.v);
  CHECK(dlogits2.v == dlogits.v);
  Buf<double> losses3({n}), lse3({n});
  cross_entropy_forward_backward(ctx, losses3, lse3, logits, logits, targets, grad_scale);
  CHECK(logits.v == dlogits.v);  // in place: the logits now hold their gradient
  CHECK(losses3.v == losses.v);
  Buf<double> short_dl({n, v - 1}), short_lse({n - 1});
  CHECK_THROWS_WITH(
      cross_entropy_forward_backward(ctx, losses2, lse2, short_dl, dlogits2, targets, 1.0),
      Catch::Contains("cross_entropy_backward: dlogits"));
  CHECK_THROWS_WITH(
      cross_entropy_forward_backward(ctx, losses2, short_lse, dlogits2, dlogits2, targets, 1.0),
      Catch::Contains("cross_entropy_forward: lse"));
}

TEST_CASE("cross_entropy: f32 agrees with f64") {
  const int64_t n = 6, v = 50;
  auto logits = random_buf({n, v}, 151, -5, 5);
  auto targets = make<int32_t>({n}, {0, 49, -1, 7, 7, 23});
  auto logits32 = to_f32(logits);
  Buf<double> losses({n}), lse({n}), dl({n, v});
  Buf<float> losses32({n}), lse32({n}), dl32({n, v});
  Ctx ctx = cpu_ctx();
  cross_entropy_forward(ctx, losses, lse, logits, targets);
  cross_entropy_forward(ctx, losses32, lse32, logits32, targets);
  cross_entropy_backward(ctx, dl, logits, lse, targets, 0.5);
  cross_entropy_backward(ctx, dl32, logits32, lse32, targets, 0.5);
  CHECK(max_rel_diff(losses32.v, losses.v) < 1e-6);
  CHECK(max_rel_diff(lse32.v, lse.v) < 1e-6);
  CHECK(max_rel_diff(dl32.v, dl.v) < 1e-6);
}

TEST_CASE("cross_entropy rejects a target outside the vocabulary") {
  Buf<double> logits({2, 3}), losses({2}), lse({2});
  auto targets = make<int32_t>({2}, {1, 3});
  Ctx ctx = cpu_ctx();
  CHECK_THROWS_AS(cross_entropy_forward(ctx, losses, lse, logits, targets), InternalError);
}

// ---- BCE with logits ----------------------------------------------------------------------------

TEST_CASE("bce_with_logits_forward: the naive formula, and finite for large |x|") {
  auto x = make<double>({4}, {-1.5, 0.0, 0.7, 3.0});
  auto t = make<double>({4}, {0, 1, 1, 0.25});
  Buf<double> loss({1});
  Ctx ctx = cpu_ctx();
  bce_with_logits_forward(ctx, loss, x, t);
  double want = 0;
  for (int i = 0; i < 4; ++i) want += naive_bce(x[i], t[i]);
  CHECK(loss[0] == Approx(want / 4).epsilon(1e-14));
  // |x| = 800: the naive form gives log(0) = -inf. Exact limits: x = 800, t = 0 -> 800;
  // x = -800, t = 1 -> 800; confident and right -> 0 (up to exp(-800), i.e. exactly 0 here).
  auto xl = make<double>({4}, {800, -800, 800, -800});
  auto tl = make<double>({4}, {0, 1, 1, 0});
  bce_with_logits_forward(ctx, loss, xl, tl);
  CHECK(std::isfinite(loss[0]));
  CHECK(loss[0] == Approx((800.0 + 800.0) / 4).epsilon(1e-15));
  Buf<float> loss32({1});
  bce_with_logits_forward(ctx, loss32, to_f32(xl), to_f32(tl));
  CHECK(loss32[0] == Approx(400.0f));
  Buf<double> dl({4});
  bce_with_logits_backward(ctx, dl, xl, tl, 1.0);
  CHECK(dl.v == std::vector<double>{0.25, -0.25, 0.0, 0.0});
}

TEST_CASE("bce_with_logits_backward matches finite differences") {
  const int64_t n = 7;
  const double grad_scale = 1.7;
  auto x = random_buf({n}, 161, -4, 4);
  auto t = random_buf({n}, 162, 0, 1);
  t[0] = 0, t[1] = 1;
  Buf<double> loss({1}), dx({n});
  Ctx ctx = cpu_ctx();
  bce_with_logits_backward(ctx, dx, x, t, grad_scale);
  check_gradient(
      x.v, dx.v,
      [&] {
        bce_with_logits_forward(ctx, loss, x, t);
        return grad_scale * loss[0];
      },
      1e-6, 1e-6, 1e-9, "dlogits");
}

TEST_CASE("bce_with_logits: f32 agrees with f64, the mean is thread-count independent") {
  const int64_t n = 1000;
  auto x = random_buf({n}, 171, -6, 6);
  auto t = random_buf({n}, 172, 0, 1);
  Buf<double> loss({1}), dx({n});
  Buf<float> loss32({1}), dx32({n});
  Ctx ctx = cpu_ctx();
  bce_with_logits_forward(ctx, loss, x, t);
  bce_with_logits_forward(ctx, loss32, to_f32(x), to_f32(t));
  bce_with_logits_backward(ctx, dx, x, t, 1.0);
  bce_with_logits_backward(ctx, dx32, to_f32(x), to_f32(t), 1.0);
  CHECK(max_rel_diff(loss32.v, loss.v) < 1e-6);
  CHECK(max_rel_diff(dx32.v, dx.v) < 1e-6);
  const int saved = omp_get_max_threads();
  std::vector<double> per_threads;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    bce_with_logits_forward(ctx, loss, x, t);
    per_threads.push_back(loss[0]);
  }
  omp_set_num_threads(saved);
  CHECK(per_threads[0] == per_threads[1]);
  CHECK(per_threads[0] == per_threads[2]);
}

// ---- AdamW --------------------------------------------------------------------------------------

TEST_CASE("adamw_step: one and two steps by hand, grad_scale applied") {
  // lr 0.1, betas (0.9, 0.999), eps 1e-8, wd 0.1, grad_scale 2; p0 = 1, g = 0.5 then -0.25.
  // Step 1: g' = 1, m = 0.1, v = 0.001, m^ = 1, v^ = 1 -> p = 1 - 0.1 (1/(1+1e-8) + 0.1 * 1)
  //         = 0.890000001.
  // Step 2: g' = -0.5, m = 0.09 - 0.05 = 0.04, v = 0.000999 + 0.00025 = 0.001249,
  //         m^ = 0.04 / 0.19, v^ = 0.001249 / 0.001999,
  //         p = 0.890000001 - 0.1 (m^ / (sqrt(v^) + 1e-8) + 0.1 * 0.890000001) = 0.85446629736...
  auto p = make<double>({1}, {1.0});
  auto g = make<double>({1}, {0.5});
  Buf<double> m({1}), v({1});
  AdamWArgs a;
  a.lr = 0.1, a.beta1 = 0.9, a.beta2 = 0.999, a.eps = 1e-8, a.weight_decay = 0.1;
  a.grad_scale = 2.0, a.step = 1;
  Ctx ctx = cpu_ctx();
  adamw_step(ctx, p, g, m, v, a);
  CHECK(p[0] == Approx(0.890000001).epsilon(1e-14));
  CHECK(m[0] == Approx(0.1).epsilon(1e-14));
  CHECK(v[0] == Approx(0.001).epsilon(1e-14));
  g[0] = -0.25, a.step = 2;
  adamw_step(ctx, p, g, m, v, a);
  CHECK(m[0] == Approx(0.04).epsilon(1e-14));
  CHECK(v[0] == Approx(0.001249).epsilon(1e-14));
  const double m_hat = 0.04 / 0.19, v_hat = 0.001249 / 0.001999;
  CHECK(p[0] == Approx(0.890000001 - 0.1 * (m_hat / (std::sqrt(v_hat) + 1e-8) + 0.1 * 0.890000001))
                    .epsilon(1e-13));
  CHECK(p[0] == Approx(0.8544662973609032).epsilon(1e-13));
}

TEST_CASE("adamw_step: weight decay is decoupled from the adaptive step") {
  // g = 0, fresh state: the Adam update is 0 and p shrinks by exactly lr * wd * p:
  // 2 - 0.1 * 0.25 * 2 = 1.95. (L2-in-the-gradient would give g = 0.5, an update of ~1 and 1.9.)
  auto p = make<double>({1}, {2.0});
  Buf<double> g({1}), m({1}), v({1});
  AdamWArgs a;
  a.lr = 0.1, a.weight_decay = 0.25, a.step = 1;
  Ctx ctx = cpu_ctx();
  adamw_step(ctx, p, g, m, v, a);
  CHECK(p[0] == Approx(1.95).epsilon(1e-15));
  CHECK(m[0] == 0);
  CHECK(v[0] == 0);
}

TEST_CASE("adamw_step: grad_scale multiplies g before the moments") {
  // With existing moments (m 0.1, v 0.01, step 5) the update depends on the scale of g:
  // g = 4 with grad_scale 0.25 must equal g = 1 unscaled, and differ from g = 4 unscaled.
  AdamWArgs a;
  a.lr = 0.01, a.beta1 = 0.9, a.beta2 = 0.99, a.step = 5;
  Ctx ctx = cpu_ctx();
  auto run = [&](double grad, double scale) {
    auto p = make<double>({1}, {1.0});
    auto g = make<double>({1}, {grad});
    auto m = make<double>({1}, {0.1});
    auto v = make<double>({1}, {0.01});
    a.grad_scale = scale;
    adamw_step(ctx, p, g, m, v, a);
    return p[0];
  };
  // By hand: m = 0.19, v = 0.0199, p = 1 - 0.01 (0.19/(1-0.9^5)) / (sqrt(0.0199/(1-0.99^5)) + 1e-8)
  CHECK(run(4.0, 0.25) == Approx(0.9927187712598261).epsilon(1e-14));
  CHECK(run(1.0, 1.0) == Approx(0.9927187712598261).epsilon(1e-14));
  CHECK(std::fabs(run(4.0, 1.0) - 0.9927187712598261) > 1e-4);
}

TEST_CASE("adamw_step: f32 agrees with f64 over several steps") {
  const int64_t n = 64;
  auto p = random_buf({n}, 181), m = random_buf({n}, 182, 0, 0.1), v = random_buf({n}, 183, 0, 0.1);
  auto p32 = to_f32(p), m32 = to_f32(m), v32 = to_f32(v);
  for (size_t i = 0; i < p.size(); ++i) p[i] = p32[i], m[i] = m32[i], v[i] = v32[i];
  AdamWArgs a;
  a.lr = 1e-2, a.weight_decay = 0.1, a.grad_scale = 0.5;
  Ctx ctx = cpu_ctx();
  for (long step = 1; step <= 3; ++step) {
    auto g = random_buf({n}, 190 + step);
    for (auto& x : g.v) x = static_cast<float>(x);
    a.step = step;
    adamw_step(ctx, p, g, m, v, a);
    adamw_step(ctx, p32, to_f32(g), m32, v32, a);
  }
  CHECK(max_rel_diff(p32.v, p.v) < 1e-6);
  CHECK(max_rel_diff(m32.v, m.v) < 1e-6);
  CHECK(max_rel_diff(v32.v, v.v) < 1e-6);
}

namespace {

// moe::clip_factor (src/optim) written out: the factor a trainer computes on the host.
double host_clip_factor(double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0;
  return max_norm / (norm + 1e-6);
}

struct AdamState {
  Buf<double> p, g, m, v;
};

AdamState random_adam_state(int64_t n, uint64_t seed) {
  return {random_buf({n}, seed, -2, 2), random_buf({n}, seed + 1, -3, 3),
          random_buf({n}, seed + 2, -0.1, 0.1), random_buf({n}, seed + 3, 0, 0.1)};
}

}  // namespace

TEST_CASE("adamw_step with norm_sq clips exactly like the host-computed clip factor") {
  const int64_t n = 257;
  Ctx ctx = cpu_ctx();
  AdamWArgs a;
  a.lr = 1e-2, a.weight_decay = 0.1, a.step = 3;
  for (double grad_scale : {1.0, 0.5}) {
    for (double max_norm : {0.0, 1.0, 1e6}) {  // off, clipping, not needed
      INFO("grad_scale " << grad_scale << " max_norm " << max_norm);
      AdamState host = random_adam_state(n, 11), dev = random_adam_state(n, 11);
      Buf<double> norm_sq({1});
      sum_squares(ctx, norm_sq, dev.g);
      const double norm = grad_scale * std::sqrt(norm_sq[0]);
      REQUIRE(norm > 1.0);  // the middle case really clips
      // Host path: the trainer multiplies the clip factor into grad_scale.
      AdamWArgs ha = a;
      ha.grad_scale = grad_scale * host_clip_factor(norm, max_norm);
      adamw_step(ctx, host.p, host.g, host.m, host.v, ha);
      // Device path: the op reads norm_sq itself.
      AdamWArgs da = a;
      da.grad_scale = grad_scale;
      da.norm_sq = norm_sq;
      da.max_norm = max_norm;
      adamw_step(ctx, dev.p, dev.g, dev.m, dev.v, da);
      CHECK(dev.p.v == host.p.v);
      CHECK(dev.m.v == host.m.v);
      CHECK(dev.v.v == host.v.v);
    }
  }
}

TEST_CASE("adamw_step with a non-finite norm_sq skips the step: p, m, v bitwise unchanged") {
  const int64_t n = 64;
  Ctx ctx = cpu_ctx();
  for (double bad : {std::numeric_limits<double>::infinity(), std::nan("")}) {
    AdamState s = random_adam_state(n, 21);
    const AdamState before = s;
    auto norm_sq = make<double>({1}, {bad});
    AdamWArgs a;
    a.step = 2, a.weight_decay = 0.1, a.norm_sq = norm_sq, a.max_norm = 1.0;
    adamw_step(ctx, s.p, s.g, s.m, s.v, a);
    CHECK(s.p.v == before.p.v);
    CHECK(s.m.v == before.m.v);
    CHECK(s.v.v == before.v.v);
    // f32 too (the trainer's dtype).
    auto p32 = to_f32(before.p), g32 = to_f32(before.g), m32 = to_f32(before.m);
    auto v32 = to_f32(before.v);
    const auto p32_before = p32.v;
    adamw_step(ctx, p32, g32, m32, v32, a);
    CHECK(p32.v == p32_before);
  }
  // A finite norm that overflows once scaled (grad_scale * sqrt(norm_sq) = inf) is skipped too.
  AdamState s = random_adam_state(n, 31);
  const AdamState before = s;
  auto norm_sq = make<double>({1}, {1e300});
  AdamWArgs a;
  a.grad_scale = 1e200, a.norm_sq = norm_sq;
  adamw_step(ctx, s.p, s.g, s.m, s.v, a);
  CHECK(s.p.v == before.p.v);
}

TEST_CASE("adamw_step rejects a norm_sq that is not a 1-element f64 tensor") {
  Ctx ctx = cpu_ctx();
  Buf<double> p({4}), g({4}), m({4}), v({4});
  Buf<float> ns32({1});
  AdamWArgs a;
  a.norm_sq = ns32;
  CHECK_THROWS_WITH(adamw_step(ctx, p, g, m, v, a),
                    Catch::Contains("adamw_step: norm_sq must be a 1-element f64 tensor"));
  Buf<double> ns2({2});
  a.norm_sq = ns2;
  CHECK_THROWS_WITH(adamw_step(ctx, p, g, m, v, a), Catch::Contains("adamw_step: norm_sq"));
}

// ---- AdamW's compute-copy output ----------------------------------------------------------------

namespace {

// A host tensor of n elements of any dtype over raw bytes (f16 / bf16 as bit patterns), every
// byte `fill` first, so an element the op leaves unwritten stands out.
struct RawBuf {
  std::vector<unsigned char> bytes;
  Tensor t;
  RawBuf(DType dt, int64_t n, unsigned char fill) {
    t = Tensor(nullptr, dt, Device{}, {n});
    bytes.assign(t.nbytes(), fill);
    t.data = bytes.data();
  }
  RawBuf(const RawBuf&) = delete;
  operator Tensor() const { return t; }
};

// The f64 state in storage type T (rounded to float for f32).
template <class T>
Buf<T> as_storage(const Buf<double>& b) {
  if constexpr (std::is_same_v<T, float>)
    return to_f32(b);
  else
    return b;
}

// One step of the op with compute_out (dtype out_dt) against the op without it followed by
// convert(compute_out, p): the same p, m and v, and the same compute-copy bits.
template <class T>
void check_compute_out_matches_convert(const AdamState& s0, DType out_dt, const AdamWArgs& a) {
  Ctx ctx = cpu_ctx();
  const int64_t n = static_cast<int64_t>(s0.p.size());
  Buf<T> rp = as_storage<T>(s0.p), rg = as_storage<T>(s0.g), rm = as_storage<T>(s0.m),
         rv = as_storage<T>(s0.v);
  RawBuf before(out_dt, n, 0), want(out_dt, n, 0);
  convert(ctx, before, rp, false);
  adamw_step(ctx, rp, rg, rm, rv, a);
  convert(ctx, want, rp, false);
  REQUIRE(want.bytes != before.bytes);  // the step moves the 16-bit values, so the test sees it

  Buf<T> fp = as_storage<T>(s0.p), fg = as_storage<T>(s0.g), fm = as_storage<T>(s0.m),
         fv = as_storage<T>(s0.v);
  RawBuf got(out_dt, n, 0xA5);
  AdamWArgs fa = a;
  fa.compute_out = got;
  adamw_step(ctx, fp, fg, fm, fv, fa);
  CHECK(fp.v == rp.v);  // the output changes nothing of the update
  CHECK(fm.v == rm.v);
  CHECK(fv.v == rv.v);
  CHECK(got.bytes == want.bytes);
}

}  // namespace

TEST_CASE("adamw_step with compute_out writes the updated p as convert would, bit for bit") {
  const int64_t n = 257;
  Ctx ctx = cpu_ctx();
  const AdamState s0 = random_adam_state(n, 41);
  Buf<double> norm_sq({1});
  sum_squares(ctx, norm_sq, s0.g);
  AdamWArgs a;
  a.lr = 1e-2, a.weight_decay = 0.1, a.step = 3, a.grad_scale = 0.5;
  a.norm_sq = norm_sq;
  REQUIRE(a.grad_scale * std::sqrt(norm_sq[0]) > 1.0);  // max_norm 1 really clips
  for (DType out_dt : {DType::bf16, DType::f16, DType::f32}) {
    for (double max_norm : {0.0, 1.0}) {  // no clipping, clipping
      INFO("compute_out " << dtype_name(out_dt) << " max_norm " << max_norm);
      a.max_norm = max_norm;
      check_compute_out_matches_convert<float>(s0, out_dt, a);  // the trainer's master dtype
      check_compute_out_matches_convert<double>(s0, out_dt, a);
    }
  }
}

TEST_CASE("adamw_step with a non-finite norm_sq leaves compute_out unchanged") {
  const int64_t n = 64;
  Ctx ctx = cpu_ctx();
  for (DType out_dt : {DType::bf16, DType::f16}) {
    INFO("compute_out " << dtype_name(out_dt));
    const AdamState s = random_adam_state(n, 51);
    auto p = to_f32(s.p), g = to_f32(s.g), m = to_f32(s.m), v = to_f32(s.v);
    const auto p_before = p.v;
    auto norm_sq = make<double>({1}, {std::numeric_limits<double>::infinity()});
    RawBuf out(out_dt, n, 0xA5);
    const std::vector<unsigned char> out_before = out.bytes;
    AdamWArgs a;
    a.step = 2, a.weight_decay = 0.1, a.norm_sq = norm_sq, a.max_norm = 1.0;
    a.compute_out = out;
    adamw_step(ctx, p, g, m, v, a);
    CHECK(p.v == p_before);
    CHECK(out.bytes == out_before);
  }
}

TEST_CASE("adamw_step rejects a compute_out of another size or dtype") {
  Ctx ctx = cpu_ctx();
  Buf<float> p({4}), g({4}), m({4}), v({4});
  AdamWArgs a;
  RawBuf short_out(DType::bf16, 3, 0);
  a.compute_out = short_out;
  CHECK_THROWS_WITH(adamw_step(ctx, p, g, m, v, a),
                    Catch::Contains("adamw_step: compute_out [3] and p [4] differ in size"));
  RawBuf f64_out(DType::f64, 4, 0);
  a.compute_out = f64_out;
  CHECK_THROWS_WITH(adamw_step(ctx, p, g, m, v, a),
                    Catch::Contains("adamw_step: compute_out must be bf16, f16 or f32, got f64"));
}

TEST_CASE(
    "adamw_step / adamw_step_split: grad_sq_out adds sum_squares of g; the update unchanged") {
  const int64_t n = 37;
  std::vector<double> pv(n), gv(n);
  for (int64_t i = 0; i < n; ++i) pv[i] = 0.1 * static_cast<double>(i % 7) - 0.3;
  for (int64_t i = 0; i < n; ++i) gv[i] = 0.05 * static_cast<double>((i * 5) % 11) - 0.25;
  Ctx ctx = cpu_ctx();
  AdamWArgs a;
  a.lr = 1e-2, a.weight_decay = 0.1, a.step = 2, a.grad_scale = 0.5;
  auto p1 = make<double>({n}, pv), p2 = make<double>({n}, pv), g = make<double>({n}, gv);
  Buf<double> m1({n}), v1({n}), m2({n}), v2({n});
  Buf<double> sq({1}), expect({1});
  sq[0] = 2.0, expect[0] = 2.0;  // both add into what is there
  sum_squares(ctx, expect, g);
  adamw_step(ctx, p1, g, m1, v1, a);
  AdamWArgs with = a;
  with.grad_sq_out = sq;
  adamw_step(ctx, p2, g, m2, v2, with);
  CHECK(sq[0] == expect[0]);
  CHECK(p2.v == p1.v);
  CHECK(m2.v == m1.v);
  CHECK(v2.v == v1.v);

  // the split master: the same sum (from its f32 gradients)
  std::vector<uint16_t> hi(n), lo(n);
  std::vector<float> g32(gv.begin(), gv.end()), ms(n, 0.0f), vs(n, 0.0f);
  Tensor tg(g32.data(), DType::f32, Device{}, {n});
  Buf<double> ssq({1}), sexpect({1});
  sum_squares(ctx, sexpect, tg);
  AdamWArgs split = a;
  split.grad_sq_out = ssq;
  adamw_step_split(ctx, Tensor(hi.data(), DType::bf16, Device{}, {n}),
                   Tensor(lo.data(), DType::u16, Device{}, {n}), tg,
                   Tensor(ms.data(), DType::f32, Device{}, {n}),
                   Tensor(vs.data(), DType::f32, Device{}, {n}), split);
  CHECK(ssq[0] == sexpect[0]);
  CHECK(ssq[0] > 0);

  // with norm_sq too: rejected, by name (the norm is known before the update then)
  Buf<double> norm({1});
  AdamWArgs both = with;
  both.norm_sq = norm;
  CHECK_THROWS_WITH(adamw_step(ctx, p2, g, m2, v2, both), Catch::Contains("grad_sq_out"));
}
