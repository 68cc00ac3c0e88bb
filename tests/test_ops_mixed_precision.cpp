// Tests of the mixed-precision pieces of the CPU ops: acc_dtype, the convert op (f32 <-> f64 and
// f32 / f64 -> bf16 / f16 rounding on chosen values: ties to even, overflow, subnormals, the double
// rounding that f64 -> 16 bits must avoid, and accumulation), accumulate_sum, add_counts, and the
// shared argument checks that reject a statistic or gradient not in acc_dtype of the compute dtype
// with a message naming the op and argument. Expected values are written as exact bit patterns or
// exactly representable sums, so every comparison is exact.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "catch.hpp"
#include "moe/ops/attention.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/embedding.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/loss.hpp"
#include "moe/ops/mod.hpp"
#include "moe/ops/norm.hpp"
#include "moe/ops/permute.hpp"
#include "moe/ops/rope.hpp"
#include "moe/ops/router.hpp"
#include "moe/ops/swiglu.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

// A host tensor of 16-bit storage (f16 or bf16), held as raw bit patterns.
struct Buf16 {
  std::vector<uint16_t> v;
  Tensor t;
  Buf16(DType dt, std::vector<uint16_t> bits) : v(std::move(bits)) {
    t = Tensor(v.data(), dt, Device{}, {static_cast<int64_t>(v.size())});
  }
  Buf16(const Buf16&) = delete;
  operator Tensor() const { return t; }
};

double p2(int e) {
  return std::ldexp(1.0, e);
}

// The message of the InternalError that f throws (the test fails if it throws nothing).
template <class F>
std::string internal_error_of(F&& f) {
  try {
    f();
  } catch (const InternalError& e) {
    return e.what();
  }
  FAIL("expected an InternalError");
  return "";
}

}  // namespace

TEST_CASE("acc_dtype: f64 for f64, f32 for every other float dtype, i32 throws", "[mixed]") {
  CHECK(acc_dtype(DType::f64) == DType::f64);
  CHECK(acc_dtype(DType::f32) == DType::f32);
  CHECK(acc_dtype(DType::f16) == DType::f32);
  CHECK(acc_dtype(DType::bf16) == DType::f32);
  CHECK_THROWS_AS(acc_dtype(DType::i32), InternalError);
}

// ---- convert ------------------------------------------------------------------------------------

TEST_CASE("convert: f64 -> f32 rounds to nearest even, f32 -> f64 is exact", "[mixed][convert]") {
  Ctx ctx = cpu_ctx();
  // 1 + 2^-24 is a tie between 1 and 1 + 2^-23: to even (1). 1 + 3 * 2^-24 ties up to the even
  // 1 + 2^-22. Just above a tie goes up.
  auto d = make<double>({4}, {1 + p2(-24), 1 + 3 * p2(-24), 1 + p2(-24) + p2(-50), -0.1});
  Buf<float> f({4});
  convert(ctx, f, d, false);
  CHECK(f.v == std::vector<float>{1.0f, 1.0f + static_cast<float>(p2(-22)),
                                  1.0f + static_cast<float>(p2(-23)), -0.1f});
  Buf<double> back({4});
  convert(ctx, back, f, false);
  for (int i = 0; i < 4; ++i) CHECK(back[i] == static_cast<double>(f[i]));

  // Accumulate: the sum is formed in double (f64 on one side) and rounded once into f32.
  auto acc = make<float>({2}, {1.0f, 3.0f});
  auto add = make<double>({2}, {p2(-24) + p2(-50), -0.5});
  convert(ctx, acc, add, true);
  CHECK(acc.v == std::vector<float>{1.0f + static_cast<float>(p2(-23)), 2.5f});
  // f32 += f32 is a plain add; f64 += f32 exact.
  auto acc64 = make<double>({2}, {0.1, 1e300});
  convert(ctx, acc64, make<float>({2}, {0.25f, -1.0f}), true);
  CHECK(acc64.v == std::vector<double>{0.1 + 0.25, 1e300 - 1.0});
}

TEST_CASE("convert: f32 -> bf16 rounds to nearest even", "[mixed][convert]") {
  Ctx ctx = cpu_ctx();
  const float big = std::numeric_limits<float>::max();
  auto src = make<float>({9}, {1.0f, 1.0f + static_cast<float>(p2(-8)),  // tie: to even 1.0
                               1.0f + static_cast<float>(3 * p2(-8)),    // tie: to even 1 + 2^-6
                               1.0f + static_cast<float>(p2(-8) + p2(-20)),  // above the tie: up
                               -1.5f, big,  // FLT_MAX rounds past the largest bf16: inf
                               static_cast<float>(p2(-133)),  // a float subnormal, exact in bf16
                               0.0f, -std::numeric_limits<float>::infinity()});
  Buf16 dst(DType::bf16, std::vector<uint16_t>(9, 0x7fc0));  // NaN: every element must be written
  convert(ctx, dst, src, false);
  CHECK(dst.v == std::vector<uint16_t>{0x3f80, 0x3f80, 0x3f82, 0x3f81, 0xbfc0, 0x7f80, 0x0001,
                                       0x0000, 0xff80});
  // Back to f32 exactly.
  Buf<float> wide({9});
  convert(ctx, wide, dst, false);
  CHECK(wide[2] == 1.0f + static_cast<float>(p2(-6)));
  CHECK(wide[4] == -1.5f);
  CHECK(wide[6] == static_cast<float>(p2(-133)));
  CHECK(std::isinf(wide[5]));
}

TEST_CASE("convert: f32 -> f16 rounds to nearest even, overflow and subnormals",
          "[mixed][convert]") {
  Ctx ctx = cpu_ctx();
  auto src = make<float>({9}, {1.0f + static_cast<float>(p2(-11)),      // tie: to even 1.0
                               1.0f + static_cast<float>(3 * p2(-11)),  // tie: to even 1 + 2^-9
                               65504.0f, 65519.0f,  // the largest f16, and just below the tie
                               65520.0f,            // the tie above 65504 rounds to inf
                               static_cast<float>(p2(-24)),      // the smallest f16 subnormal
                               static_cast<float>(p2(-25)),      // tie with 0: to even 0
                               static_cast<float>(3 * p2(-25)),  // tie: to even 2 * 2^-24
                               -2.0f});
  Buf16 dst(DType::f16, std::vector<uint16_t>(9, 0x7e00));
  convert(ctx, dst, src, false);
  CHECK(dst.v == std::vector<uint16_t>{0x3c00, 0x3c02, 0x7bff, 0x7bff, 0x7c00, 0x0001, 0x0000,
                                       0x0002, 0xc000});
}

TEST_CASE("convert: f64 -> bf16 / f16 rounds once, not twice through f32", "[mixed][convert]") {
  Ctx ctx = cpu_ctx();
  // Just above a 16-bit tie by less than half an f32 ulp: rounding to f32 first would land exactly
  // on the tie and then go to even (down); one rounding goes up.
  auto to_bf16 = make<double>({3}, {1 + p2(-8) + p2(-40), 1 + p2(-8) - p2(-40), 1 + p2(-8)});
  Buf16 b(DType::bf16, std::vector<uint16_t>(3, 0));
  convert(ctx, b, to_bf16, false);
  CHECK(b.v == std::vector<uint16_t>{0x3f81, 0x3f80, 0x3f80});
  auto to_f16 = make<double>({4}, {1 + p2(-11) + p2(-40), 1 + p2(-11) - p2(-40), 1 + p2(-11),
                                   65520.0 - p2(-30)});  // just below the overflow tie
  Buf16 h(DType::f16, std::vector<uint16_t>(4, 0));
  convert(ctx, h, to_f16, false);
  CHECK(h.v == std::vector<uint16_t>{0x3c01, 0x3c00, 0x3c00, 0x7bff});
  // A double beyond the float range still overflows to inf, a tiny one to a signed zero.
  auto extreme = make<double>({3}, {1e300, -1e300, -1e-300});
  Buf16 e(DType::bf16, std::vector<uint16_t>(3, 0));
  convert(ctx, e, extreme, false);
  CHECK(e.v == std::vector<uint16_t>{0x7f80, 0xff80, 0x8000});
}

TEST_CASE("convert: accumulate into 16 bits rounds the fp32 sum once; 16 -> 16 via f32",
          "[mixed][convert]") {
  Ctx ctx = cpu_ctx();
  // bf16 1.0 += f32 2^-8 (a tie: stays 1.0), += 2^-8 + 2^-20 (above the tie: 1 + 2^-7).
  Buf16 acc(DType::bf16, {0x3f80, 0x3f80, 0x4000});
  convert(
      ctx, acc,
      make<float>({3}, {static_cast<float>(p2(-8)), static_cast<float>(p2(-8) + p2(-20)), -0.5f}),
      true);
  CHECK(acc.v == std::vector<uint16_t>{0x3f80, 0x3f81, 0x3fc0});  // 2 - 0.5 = 1.5
  // f16 += f64: the sum in double, one rounding (to odd through f32, then to even).
  Buf16 h(DType::f16, {0x3c00});
  convert(ctx, h, make<double>({1}, {p2(-11) + p2(-40)}), true);
  CHECK(h.v == std::vector<uint16_t>{0x3c01});
  // f32 += bf16 (a 16-bit gradient into the fp32 accumulator): exact here.
  auto g = make<float>({2}, {0.5f, -3.0f});
  Buf16 src(DType::bf16, {0x3f81, 0xbfc0});  // 1 + 2^-7, -1.5
  convert(ctx, g, src, true);
  CHECK(g.v == std::vector<float>{1.5f + static_cast<float>(p2(-7)), -4.5f});
  // f16 -> bf16 and bf16 -> f16.
  Buf16 f16v(DType::f16, {0x3c01, 0x7bff});  // 1 + 2^-10, 65504
  Buf16 bf(DType::bf16, {0, 0});
  convert(ctx, bf, f16v, false);
  CHECK(bf.v == std::vector<uint16_t>{0x3f80, 0x4780});  // 1 + 2^-10 -> 1; 65504 -> 65536
  Buf16 back(DType::f16, {0, 0});
  convert(ctx, back, bf, false);
  CHECK(back.v == std::vector<uint16_t>{0x3c00, 0x7c00});  // 65536 overflows f16
}

TEST_CASE("convert rejects mismatched sizes and index tensors", "[mixed][convert]") {
  Ctx ctx = cpu_ctx();
  Buf<float> a({4});
  Buf<double> b({5});
  Buf<int32_t> idx({4});
  CHECK_THROWS_WITH(convert(ctx, a, b, false),
                    Catch::Contains("convert") && Catch::Contains("element counts differ"));
  CHECK_THROWS_WITH(convert(ctx, a, idx, false), Catch::Contains("float tensors"));
}

// ---- accumulate_sum, add_counts -----------------------------------------------------------------

TEST_CASE("accumulate_sum adds scale * sum(x) into an f64 scalar, deterministically",
          "[mixed][elementwise]") {
  Ctx ctx = cpu_ctx();
  auto out = make<double>({1}, {2.5});
  accumulate_sum(ctx, out, make<float>({2, 3}, {1, 2, 3, 4, 5, 6.5f}), 0.5);
  CHECK(out[0] == 2.5 + 0.5 * 21.5);
  accumulate_sum(ctx, out, make<double>({2}, {-1.25, 0.25}), -2.0);
  CHECK(out[0] == 2.5 + 0.5 * 21.5 + 2.0);

  // Many elements: the same bits for 1, 2 and 3 threads, and close to the exact sum.
  auto x = random_buf({100003}, 7);
  long double exact = 0;
  for (double v : x.v) exact += v;
  const int saved = omp_get_max_threads();
  std::vector<double> got;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    auto o = make<double>({1}, {0.0});
    accumulate_sum(ctx, o, x, 3.0);
    got.push_back(o[0]);
  }
  omp_set_num_threads(saved);
  CHECK(got[0] == got[1]);
  CHECK(got[0] == got[2]);
  CHECK(std::fabs(got[0] - 3.0 * static_cast<double>(exact)) < 1e-9);

  Buf<float> f32_out({1});
  CHECK_THROWS_WITH(accumulate_sum(ctx, f32_out, x, 1.0),
                    Catch::Contains("accumulate_sum: out must be a 1-element f64 tensor"));
}

TEST_CASE("add_counts adds i32 expert loads into an f32 or f64 accumulator", "[mixed][router]") {
  Ctx ctx = cpu_ctx();
  auto counts = make<int32_t>({4}, {3, 0, 7, 16777215});
  Buf<float> acc({4});
  add_counts(ctx, acc, counts);
  add_counts(ctx, acc, make<int32_t>({4}, {1, 2, 0, 0}));
  CHECK(acc.v == std::vector<float>{4, 2, 7, 16777215});
  Buf<double> acc64({4});
  add_counts(ctx, acc64, counts);
  CHECK(acc64.v == std::vector<double>{3, 0, 7, 16777215});
  Buf16 acc16(DType::bf16, std::vector<uint16_t>(4, 0));
  CHECK_THROWS_WITH(add_counts(ctx, acc16, counts), Catch::Contains("add_counts: acc"));
  CHECK_THROWS_WITH(add_counts(ctx, acc, make<int32_t>({3}, {1, 2, 3})),
                    Catch::Contains("add_counts: counts"));
  CHECK_THROWS_WITH(add_counts(ctx, acc, make<float>({4}, {1, 2, 3, 4})),
                    Catch::Contains("add_counts: counts must be i32"));
}

// ---- statistics and gradients in acc_dtype ------------------------------------------------------

TEST_CASE("ops reject a statistic or gradient that is not in acc_dtype(T)", "[mixed][checks]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 4, d = 6;
  Buf<double> x = random_buf({n, d}, 1), w = random_buf({d}, 2), y({n, d});
  Buf<float> rstd32({n});
  std::string msg = internal_error_of([&] { rmsnorm_forward(ctx, y, rstd32, x, w, 1e-5); });
  CHECK(contains(msg, "rmsnorm_forward: rstd"));
  CHECK(contains(msg, "expected f64"));

  Buf<double> rstd({n}), dx({n, d});
  Buf<float> dw32({d});
  msg = internal_error_of([&] { rmsnorm_backward(ctx, dx, dw32, y, x, w, rstd); });
  CHECK(contains(msg, "rmsnorm_backward: dw"));

  // 16-bit x: rstd must be f32, not the 16-bit dtype.
  Buf16 x16(DType::bf16, std::vector<uint16_t>(n * d, 0x3f80)),
      w16(DType::bf16, {0, 0, 0, 0, 0, 0});
  Buf16 y16(DType::bf16, std::vector<uint16_t>(n * d, 0)), r16(DType::bf16, {0, 0, 0, 0});
  Tensor x16t = x16.t.view({n, d}), y16t = y16.t.view({n, d});
  msg = internal_error_of([&] { rmsnorm_forward(ctx, y16t, r16, x16t, w16, 1e-5); });
  CHECK(contains(msg, "rmsnorm_forward: rstd: dtype bf16, expected f32"));
  // With an f32 rstd the shared checks pass; the CPU backend then says it computes in f32 / f64.
  msg = internal_error_of([&] { rmsnorm_forward(ctx, y16t, rstd32, x16t, w16, 1e-5); });
  CHECK(contains(msg, "f32 or f64"));

  Buf<double> lin_x = random_buf({n, d}, 3), lin_w = random_buf({3, d}, 4),
              dy = random_buf({n, 3}, 5);
  Buf<float> ldw32({3, d});
  msg = internal_error_of([&] { linear_backward(ctx, Tensor{}, ldw32, dy, lin_x, lin_w, false); });
  CHECK(contains(msg, "linear_backward: dw"));

  Buf<double> gw = random_buf({2, 3, d}, 6), gdx({n, d});
  Buf<float> gdw32({2, 3, d});
  auto offsets = make<int32_t>({3}, {0, 1, 4});
  msg =
      internal_error_of([&] { grouped_linear_backward(ctx, gdx, gdw32, dy, lin_x, gw, offsets); });
  CHECK(contains(msg, "grouped_linear_backward: dw"));

  auto ids = make<int32_t>({n}, {0, 1, 1, 2});
  Buf<float> dtable32({3, d});
  msg = internal_error_of([&] { embedding_backward(ctx, dtable32, y, ids); });
  CHECK(contains(msg, "embedding_backward: dtable"));

  Buf<double> logits = random_buf({n, 5}, 7), losses({n});
  Buf<float> lse32({n});
  auto targets = make<int32_t>({n}, {0, 1, 2, 3});
  msg = internal_error_of([&] { cross_entropy_forward(ctx, losses, lse32, logits, targets); });
  CHECK(contains(msg, "cross_entropy_forward: lse"));
  msg = internal_error_of([&] { cross_entropy_backward(ctx, logits, logits, lse32, targets, 1); });
  CHECK(contains(msg, "cross_entropy_backward: lse"));

  Buf<double> q = random_buf({1, 3, 2, 4}, 8), k = random_buf({1, 3, 1, 4}, 9), out({1, 3, 2, 4});
  Buf<float> alse32({1, 2, 3});
  msg = internal_error_of([&] { attention_forward(ctx, out, alse32, q, k, k); });
  CHECK(contains(msg, "attention_forward: lse"));
  Buf<double> dq({1, 3, 2, 4}), dk({1, 3, 1, 4}), dv({1, 3, 1, 4});
  msg = internal_error_of(
      [&] { attention_backward(ctx, dq, dk, dv, out, q, k, k, out, alse32, Tensor()); });
  CHECK(contains(msg, "attention_backward: lse"));

  Buf<float> cos32({8, 2}), sin32({8, 2});
  Buf<double> rx = random_buf({n, 2, 4}, 10);
  auto pos = make<int32_t>({n}, {0, 1, 2, 3});
  msg = internal_error_of([&] { rope_forward(ctx, rx, pos, cos32, sin32); });
  CHECK(contains(msg, "rope_forward: cos"));
  Buf16 cos16(DType::bf16, std::vector<uint16_t>(16, 0)),
      sin16(DType::bf16, std::vector<uint16_t>(16, 0));
  Tensor cos16t = cos16.t.view({8, 2}), sin16t = sin16.t.view({8, 2});
  msg = internal_error_of([&] { rope_table(ctx, cos16t, sin16t, 10000.0); });
  CHECK(contains(msg, "rope_table: the table must be f32 or f64"));

  Buf<double> sg = random_buf({n, d}, 11), su = random_buf({n, d}, 13), sh({n, d});
  Buf<float> row_w32({n});
  msg = internal_error_of([&] { swiglu_weighted_forward(ctx, sh, sg, su, row_w32); });
  CHECK(contains(msg, "swiglu_weighted_forward: row_w"));
  Buf<double> row_w({n}), sdg({n, d}), sdu({n, d});
  msg = internal_error_of(
      [&] { swiglu_weighted_backward(ctx, sdg, sdu, row_w32, sh, sg, su, row_w); });
  CHECK(contains(msg, "swiglu_weighted_backward: drow_w"));

  auto sel = make<int32_t>({1, 2}, {0, 2});
  Buf<float> scores32({1, n});
  Buf<double> ys = random_buf({2, d}, 12), mout({n, d});
  msg = internal_error_of([&] { mod_scatter_forward(ctx, mout, x, ys, scores32, sel); });
  CHECK(contains(msg, "mod_scatter_forward: scores"));
  Buf<double> scores({1, n}), mdx({n, d}), mdys({2, d});
  msg = internal_error_of(
      [&] { mod_scatter_backward(ctx, mdx, mdys, scores32, y, x, ys, scores, sel); });
  CHECK(contains(msg, "mod_scatter_backward: dscores"));
}
