// The split fp32 master (kernels/common/split_master.hpp, train.split_master) on the CPU:
//  - encode/decode gives back every fp32 bit pattern tried exactly (all 65536 high halves with
//    the low halves at and around the rounding boundaries, 2^22 random patterns, the specials);
//    NaNs stay NaN (canonicalised), and hi is the bf16 round-to-nearest-even conversion except at
//    exact ties (low half 0x8000), where it is the neighbour toward zero;
//  - adamw_step_split stores bitwise the master, m and v that adamw_step stores from the same
//    fp32 state (plain, clipped by norm_sq, and a skipped step that leaves hi and lo untouched);
//  - split_master_decode is the element decode; bad operands name the op and the tensor.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "common/float16.hpp"
#include "common/split_master.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/optim.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;
using moe::float16::bf16_to_float;
using moe::float16::float_to_bf16;

namespace {

// Checks one bit pattern; returns false (with the failure recorded) on a mismatch.
bool check_pattern(uint32_t bits) {
  const float x = split_bits_float(bits);
  uint16_t hi = 0, lo = 0;
  split_master_encode_one(x, &hi, &lo);
  const float back = split_master_decode_one(hi, lo);
  if (std::isnan(x)) {
    if (std::isnan(back) && std::isnan(bf16_to_float(hi))) return true;
    FAIL_CHECK("NaN pattern " << std::hex << bits << " decodes to " << split_float_bits(back)
                              << " with hi " << hi);
    return false;
  }
  if (split_float_bits(back) != bits) {
    FAIL_CHECK("pattern " << std::hex << bits << " comes back as " << split_float_bits(back));
    return false;
  }
  // hi against round-to-nearest-even: the same but at ties, where it is the truncation.
  const uint16_t rne = float_to_bf16(x);
  const uint16_t want = (bits & 0xFFFFu) == 0x8000u ? static_cast<uint16_t>(bits >> 16) : rne;
  if (hi != want) {
    FAIL_CHECK("pattern " << std::hex << bits << ": hi " << hi << ", want " << want);
    return false;
  }
  return true;
}

}  // namespace

TEST_CASE("split master: encode then decode gives back every fp32 pattern; hi rounds to nearest") {
  size_t checked = 0;
  bool ok = true;
  // Every high half with the low halves at and around the rounding boundary and the ends.
  const uint32_t lows[] = {0x0000, 0x0001, 0x7FFE, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF};
  for (uint32_t h = 0; h < 0x10000u && ok; ++h)
    for (uint32_t l : lows) {
      ok = check_pattern((h << 16) | l) && ok;
      ++checked;
    }
  std::mt19937 rng(12345);
  for (int i = 0; i < (1 << 22) && ok; ++i, ++checked) ok = check_pattern(rng());
  for (float x : {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), std::nanf("")})
    ok = check_pattern(split_float_bits(x)) && ok;
  CHECK(ok);
  CHECK(checked > (size_t{1} << 22));
  // CUDA's canonical NaN (0x7FFFFFFF) would round over into the sign bit without the
  // canonicalisation: its hi must still be a NaN.
  uint16_t hi = 0, lo = 0;
  split_master_encode_one(split_bits_float(0x7FFFFFFFu), &hi, &lo);
  CHECK(std::isnan(bf16_to_float(hi)));
}

namespace {

struct SplitState {
  std::vector<uint16_t> hi, lo;
  Tensor thi, tlo;
  explicit SplitState(const std::vector<float>& p) : hi(p.size()), lo(p.size()) {
    for (size_t i = 0; i < p.size(); ++i) split_master_encode_one(p[i], &hi[i], &lo[i]);
    const auto n = static_cast<int64_t>(p.size());
    thi = Tensor(hi.data(), DType::bf16, Device{}, {n});
    tlo = Tensor(lo.data(), DType::u16, Device{}, {n});
  }
  std::vector<float> decoded() const {
    std::vector<float> p(hi.size());
    for (size_t i = 0; i < p.size(); ++i) p[i] = split_master_decode_one(hi[i], lo[i]);
    return p;
  }
};

// One step of adamw_step_split against adamw_step on the same fp32 state: bitwise the same.
void check_split_step_matches(int64_t n, uint64_t seed, AdamWArgs a, bool clip) {
  Ctx ctx = cpu_ctx();
  Buf<float> p = to_f32(random_buf({n}, seed, -2, 2)), g = to_f32(random_buf({n}, seed + 1, -3, 3));
  Buf<float> m = to_f32(random_buf({n}, seed + 2, -0.1, 0.1));
  Buf<float> v = to_f32(random_buf({n}, seed + 3, 1e-4, 0.1));
  Buf<double> norm_sq({1});
  if (clip) {
    sum_squares(ctx, norm_sq, g);
    a.norm_sq = norm_sq;
    a.max_norm = 1.0;
    REQUIRE(a.grad_scale * std::sqrt(norm_sq[0]) > 1.0);  // really clips
  }
  SplitState s(p.v);
  Buf<float> sm = m, sv = v;  // (a copy points at its own values)
  REQUIRE(s.decoded() == p.v);
  adamw_step(ctx, p, g, m, v, a);
  adamw_step_split(ctx, s.thi, s.tlo, g, sm, sv, a);
  CHECK(s.decoded() == p.v);
  CHECK(sm.v == m.v);
  CHECK(sv.v == v.v);
}

}  // namespace

TEST_CASE("adamw_step_split stores the master adamw_step stores, bit for bit") {
  AdamWArgs a;
  a.lr = 1e-2, a.beta1 = 0.9, a.beta2 = 0.95, a.weight_decay = 0.1, a.step = 3, a.grad_scale = 0.5;
  SECTION("plain") {
    check_split_step_matches(1031, 21, a, false);
  }
  SECTION("clipped by norm_sq") {
    check_split_step_matches(1031, 31, a, true);
  }
  SECTION("several steps") {
    Ctx ctx = cpu_ctx();
    const int64_t n = 515;
    Buf<float> p = to_f32(random_buf({n}, 41, -2, 2)), g = to_f32(random_buf({n}, 42, -3, 3));
    Buf<float> m({n}), v({n}), sm({n}), sv({n});
    SplitState s(p.v);
    for (long t = 1; t <= 4; ++t) {
      a.step = t;
      adamw_step(ctx, p, g, m, v, a);
      adamw_step_split(ctx, s.thi, s.tlo, g, sm, sv, a);
    }
    CHECK(s.decoded() == p.v);
    CHECK(sm.v == m.v);
    CHECK(sv.v == v.v);
  }
}

TEST_CASE("adamw_step_split with a bf16 g updates as with that g widened to f32") {
  // train.bf16_expert_grads: the experts' gradients arrive in bf16.
  Ctx ctx = cpu_ctx();
  const int64_t n = 1031;
  Buf<float> g32 = to_f32(random_buf({n}, 71, -3, 3));
  std::vector<uint16_t> gb(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    gb[i] = float_to_bf16(g32[i]);
    g32[i] = bf16_to_float(gb[i]);  // the f32 g is the bf16 one, exactly
  }
  Tensor g16(gb.data(), DType::bf16, Device{}, {n});
  Buf<float> m = to_f32(random_buf({n}, 72, -0.1, 0.1)), v = to_f32(random_buf({n}, 73, 1e-4, 0.1));
  Buf<float> m16 = m, v16 = v;
  const std::vector<float> p = to_f32(random_buf({n}, 74, -2, 2)).v;
  SplitState s32(p), s16(p);
  Buf<double> sq32({1}), sq16({1});
  AdamWArgs a;
  a.lr = 1e-2, a.beta1 = 0.9, a.beta2 = 0.95, a.weight_decay = 0.1, a.step = 2, a.grad_scale = 0.5;
  a.grad_sq_out = sq32;
  adamw_step_split(ctx, s32.thi, s32.tlo, g32, m, v, a);
  a.grad_sq_out = sq16;
  adamw_step_split(ctx, s16.thi, s16.tlo, g16, m16, v16, a);
  CHECK(s16.hi == s32.hi);
  CHECK(s16.lo == s32.lo);
  CHECK(m16.v == m.v);
  CHECK(v16.v == v.v);
  CHECK(s16.decoded() != p);  // the update ran
  CHECK(sq16[0] == Approx(sq32[0]).epsilon(1e-12));
  CHECK(sq16[0] > 0);
  // Neither f16 nor a short g.
  Tensor g_f16(gb.data(), DType::f16, Device{}, {n}),
      g_short(gb.data(), DType::bf16, Device{}, {n - 1});
  CHECK_THROWS_WITH(adamw_step_split(ctx, s16.thi, s16.tlo, g_f16, m16, v16, AdamWArgs{}),
                    Catch::Contains("adamw_step_split: g must be f32 or bf16 [1031]"));
  CHECK_THROWS_WITH(adamw_step_split(ctx, s16.thi, s16.tlo, g_short, m16, v16, AdamWArgs{}),
                    Catch::Contains("got bf16 [1030]"));
}

TEST_CASE("adamw_step_split with a non-finite norm_sq leaves hi, lo, m and v unchanged") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 64;
  Buf<float> g = to_f32(random_buf({n}, 51, -3, 3)), m = to_f32(random_buf({n}, 52, -0.1, 0.1));
  Buf<float> v = to_f32(random_buf({n}, 53, 1e-4, 0.1));
  SplitState s(to_f32(random_buf({n}, 54, -2, 2)).v);
  const std::vector<uint16_t> hi0 = s.hi, lo0 = s.lo;
  const std::vector<float> m0 = m.v, v0 = v.v;
  auto norm_sq = make<double>({1}, {std::numeric_limits<double>::quiet_NaN()});
  AdamWArgs a;
  a.step = 2, a.norm_sq = norm_sq, a.max_norm = 1.0;
  adamw_step_split(ctx, s.thi, s.tlo, g, m, v, a);
  CHECK(s.hi == hi0);
  CHECK(s.lo == lo0);
  CHECK(m.v == m0);
  CHECK(v.v == v0);
}

TEST_CASE("split_master_decode writes each element's decode; bad operands are named") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 300;
  SplitState s(to_f32(random_buf({n}, 61, -5, 5)).v);
  Buf<float> out({n});
  for (float& x : out.v) x = std::nanf("");
  split_master_decode(ctx, out, s.thi, s.tlo);
  CHECK(out.v == s.decoded());

  Buf<float> g({n}), m({n}), v({n}), short_out({n - 1});
  CHECK_THROWS_WITH(split_master_decode(ctx, short_out, s.thi, s.tlo),
                    Catch::Contains("split_master_decode: expected f32 [300]"));
  CHECK_THROWS_WITH(adamw_step_split(ctx, s.tlo, s.thi, g, m, v, AdamWArgs{}),
                    Catch::Contains("adamw_step_split: hi must be bf16 and lo u16, got u16, bf16"));
  AdamWArgs with_copy;
  with_copy.compute_out = s.thi;
  CHECK_THROWS_WITH(adamw_step_split(ctx, s.thi, s.tlo, g, m, v, with_copy),
                    Catch::Contains("compute_out must be empty"));
}

TEST_CASE(
    "grouped_linear_forward_adamw: the product, then the update; an overlapping slab throws") {
  Ctx ctx = cpu_ctx();
  const int64_t e = 3, in = 8, out = 6, n = 259;
  std::vector<int32_t> off = {0, 5, 5, 12};
  const int64_t r = off.back();
  Buf<double> x = random_buf({r, in}, 51), w = random_buf({e, out, in}, 52);
  Tensor toff(off.data(), DType::i32, Device{}, {e + 1});
  Buf<float> p = to_f32(random_buf({n}, 53, -2, 2)), g = to_f32(random_buf({n}, 54, -3, 3));
  AdamWArgs a;
  a.lr = 1e-2, a.step = 2, a.weight_decay = 0.1;
  Buf<float> m1({n}), v1({n}), m2({n}), v2({n});
  SplitState s1(p.v), s2(p.v);
  Buf<double> y1({r, out}), y2({r, out});
  grouped_linear_forward_adamw(ctx, y1, x, w, toff, s1.thi, s1.tlo, g, m1, v1, a);
  grouped_linear_forward(ctx, y2, x, w, toff);
  adamw_step_split(ctx, s2.thi, s2.tlo, g, m2, v2, a);
  CHECK(y1.v == y2.v);
  CHECK(s1.hi == s2.hi);
  CHECK(s1.lo == s2.lo);
  CHECK(m1.v == m2.v);
  CHECK(v1.v == v2.v);
  CHECK(s1.decoded() != p.v);  // the update ran
  // The update's g inside the product's x: refused before anything runs.
  Tensor g_in_x(x.v.data(), DType::f32, Device{}, {n});
  CHECK_THROWS_WITH(
      grouped_linear_forward_adamw(ctx, y1, x, w, toff, s1.thi, s1.tlo, g_in_x, m1, v1, a),
      Catch::Contains("overlap the product"));
}
