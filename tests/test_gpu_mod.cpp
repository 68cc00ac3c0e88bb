// CUDA Mixture-of-Depths ops against the CPU reference (kernels/cpu/mod.cpp, mod_predictor.cpp) on
// the same inputs: values rounded to the storage dtype, the CPU computing in f64. Outputs are
// poisoned before each GPU call (except the accumulating dx of mod_gather_backward, which starts
// from random values).
//
// Shapes cover both row paths of the gather / scatter kernels (16-byte vectors when d fills whole
// vectors: d = 8, 16, 64, 1032; one element per lane otherwise) and the radix select's edge
// cases (ties at the threshold, signed zeros, infinities, C = 1 ... T, T > the block size).
// mod_select keeps one dtype (scores and mask of dt); the gated scatter reads the same score values
// from an acc_dtype(dt) tensor (f32 for 16-bit activations) and writes dscores in it.
// sel and mask must equal the CPU exactly (mask holds exact 0/1). Float outputs:
//   |gpu - cpu| <= atol + rtol * |cpu|, rtol = rtol_for(dtype) (f32 2e-5, f16 4e-3, bf16 2e-2,
//   f64 1e-11), atol = rtol * max|cpu| (gated differences and dot products can cancel); pure
//   copies (gather forward, skipped rows of the scatters) must be exact; dscores gets the bound of
//   its (acc) dtype.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "moe/ops/mod.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

const DType kFloatTypes[] = {DType::f32, DType::f16, DType::bf16, DType::f64};

// Scores from a small set of exactly representable non-zero values: many exact ties.
std::vector<double> tied(size_t n, uint64_t seed) {
  return tied_values(n, seed, {-1.0, 0.5, 1.0, 1.5, 2.0});
}

// All MoD ops for B sequences of length T keeping C, width d.
void check_mod(int64_t b, int64_t t, int64_t c, int64_t d, bool ties, DType dt, uint64_t seed) {
  INFO("MoD B=" << b << " T=" << t << " C=" << c << " d=" << d << " ties=" << ties
                << " dtype=" << dtype_name(dt));
  Ctx cctx = cpu_ctx(), gctx = gpu_ctx();
  const int64_t rows = b * t, kept = b * c;
  const DType acc = acc_dtype(dt);

  // ---- select
  const std::vector<double> sc =
      round_to(dt, ties ? tied(static_cast<size_t>(rows), seed)
                        : uniform_values(static_cast<size_t>(rows), seed, -3.0, 3.0));
  Buf<double> hs = host({b, t}, sc), hmask({b, t});
  Buf<int32_t> hsel({b, c});
  cpu::mod_select(cctx, hsel, hmask, hs);
  DeviceTensor gs = on_device(dt, {b, t}, sc), gmask = poisoned(dt, {b, t});
  DeviceTensor gsel = poisoned(DType::i32, {b, c});
  mod_select(gctx, gsel, gmask, gs);
  CHECK(download_i32(gsel) == hsel.v);
  CHECK(download(gmask) == hmask.v);

  // ---- gather forward (exact copy) and backward (accumulates)
  const std::vector<double> x =
      round_to(dt, uniform_values(static_cast<size_t>(rows * d), seed + 1));
  Buf<double> hx = host({rows, d}, x), hxs({kept, d});
  cpu::mod_gather_forward(cctx, hxs, hx, hsel);
  DeviceTensor gx = on_device(dt, {rows, d}, x), gxs = poisoned(dt, {kept, d});
  mod_gather_forward(gctx, gxs, gx, gsel);
  CHECK(download(gxs) == hxs.v);

  const std::vector<double> dx0 =
      round_to(dt, uniform_values(static_cast<size_t>(rows * d), seed + 2));
  const std::vector<double> dxs =
      round_to(dt, uniform_values(static_cast<size_t>(kept * d), seed + 3));
  Buf<double> hdx = host({rows, d}, dx0), hdxs = host({kept, d}, dxs);
  cpu::mod_gather_backward(cctx, hdx, hdxs, hsel);
  DeviceTensor gdx = on_device(dt, {rows, d}, dx0), gdxs = on_device(dt, {kept, d}, dxs);
  mod_gather_backward(gctx, gdx, gdxs, gsel);
  check_grad(download(gdx), hdx.v, dt, "mod_gather_backward");

  // ---- scatter forward, into a fresh out and in place (out = x); the same score values, held in
  // acc_dtype (exact: sc is rounded to dt, which f32 holds)
  const std::vector<double> ys =
      round_to(dt, uniform_values(static_cast<size_t>(kept * d), seed + 4));
  Buf<double> hys = host({kept, d}, ys), hout({rows, d});
  cpu::mod_scatter_forward(cctx, hout, hx, hys, hs, hsel);
  DeviceTensor gsa = on_device(acc, {b, t}, sc);
  DeviceTensor gys = on_device(dt, {kept, d}, ys), gout = poisoned(dt, {rows, d});
  mod_scatter_forward(gctx, gout, gx, gys, gsa, gsel);
  check_grad(download(gout), hout.v, dt, "mod_scatter_forward");
  {
    DeviceTensor inplace = on_device(dt, {rows, d}, x);
    mod_scatter_forward(gctx, inplace, inplace, gys, gsa, gsel);
    check_grad(download(inplace), hout.v, dt, "mod_scatter_forward in place");
  }

  // ---- scatter backward, into a fresh dx and in place (dx = dout)
  const std::vector<double> dout =
      round_to(dt, uniform_values(static_cast<size_t>(rows * d), seed + 5));
  Buf<double> hdout = host({rows, d}, dout), hdx2({rows, d}), hdys({kept, d}), hds({b, t});
  cpu::mod_scatter_backward(cctx, hdx2, hdys, hds, hdout, hx, hys, hs, hsel);
  DeviceTensor gdout = on_device(dt, {rows, d}, dout);
  DeviceTensor gdx2 = poisoned(dt, {rows, d}), gdys = poisoned(dt, {kept, d});
  DeviceTensor gds = poisoned(acc, {b, t});
  mod_scatter_backward(gctx, gdx2, gdys, gds, gdout, gx, gys, gsa, gsel);
  check_grad(download(gdx2), hdx2.v, dt, "mod_scatter_backward dx");
  check_grad(download(gdys), hdys.v, dt, "mod_scatter_backward dys");
  check_grad(download(gds), hds.v, acc, "mod_scatter_backward dscores");
  {
    DeviceTensor inplace = on_device(dt, {rows, d}, dout);
    poison(gdys);
    poison(gds);
    mod_scatter_backward(gctx, inplace, gdys, gds, inplace, gx, gys, gsa, gsel);
    check_grad(download(inplace), hdx2.v, dt, "mod_scatter_backward dx in place");
    check_grad(download(gdys), hdys.v, dt, "mod_scatter_backward dys (in place)");
    check_grad(download(gds), hds.v, acc, "mod_scatter_backward dscores (in place)");
  }
  if (dt != acc)  // 16-bit scores are rejected by the scatter
    CHECK_THROWS_WITH(mod_scatter_forward(gctx, gout, gx, gys, gs, gsel),
                      Catch::Contains("mod_scatter_forward: scores"));
}

}  // namespace

TEST_CASE("gpu MoD: random scores", "[gpu][mod]") {
  for (DType dt : kFloatTypes) {
    check_mod(3, 203, 26, 37, false, dt, 1);     // capacity 0.125 of T = 203
    check_mod(2, 64, 8, 300, false, dt, 2);      // rows longer than a block
    check_mod(2, 2500, 313, 16, false, dt, 3);   // T spans several select groups and tiles
    check_mod(16, 1024, 128, 64, false, dt, 4);  // the bench's selection shape
    check_mod(2, 64, 8, 1032, false, dt, 5);     // vector rows: several unrolled rounds + a partial
    check_mod(3, 40, 5, 8, false, dt, 6);        // vector rows of one 16-byte vector (bf16, f16)
  }
}

namespace {

// mod_select alone against the CPU op on the given score values (already rounded to dt).
void check_select(int64_t b, int64_t t, int64_t c, DType dt, const std::vector<double>& sc) {
  INFO("mod_select B=" << b << " T=" << t << " C=" << c << " dtype=" << dtype_name(dt));
  Ctx cctx = cpu_ctx(), gctx = gpu_ctx();
  Buf<double> hs = host({b, t}, sc), hmask({b, t});
  Buf<int32_t> hsel({b, c});
  cpu::mod_select(cctx, hsel, hmask, hs);
  DeviceTensor gs = on_device(dt, {b, t}, sc), gmask = poisoned(dt, {b, t});
  DeviceTensor gsel = poisoned(DType::i32, {b, c});
  mod_select(gctx, gsel, gmask, gs);
  CHECK(download_i32(gsel) == hsel.v);
  CHECK(download(gmask) == hmask.v);
}

}  // namespace

// The selection compares order-preserving integer keys: -0 must still tie with +0, negative
// scores order below positive ones, infinities and values that round to 16-bit subnormals stay
// in place, and a tie group at the threshold runs every digit pass (or every bit of the bitwise
// search). T = 300 and 1,024 (every warp of the block full) take the bitwise search (a thread a
// score), T = 1,500 the radix passes.
TEST_CASE("gpu MoD: select with signed zeros, infinities, subnormals and wide ranges",
          "[gpu][mod]") {
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t t = GENERATE(as<int64_t>{}, 300, 1024, 1500);
  for (DType dt : kFloatTypes) {
    const int64_t b = 2;
    const std::vector<double> special = round_to(
        dt, tied_values(static_cast<size_t>(b * t), 31,
                        {-0.0, 0.0, inf, -inf, 1e-7, -1e-7, 3e-5, -3e-5, 6e4, -6e4, 1.0, -1.0}));
    const std::vector<double> zeros =
        round_to(dt, tied_values(static_cast<size_t>(b * t), 32, {-0.0, 0.0, -0.5}));
    const std::vector<double> wide =
        round_to(dt, uniform_values(static_cast<size_t>(b * t), 33, -6e4, 6e4));
    for (int64_t c : {int64_t{1}, int64_t{37}, t / 2, t - 1, t}) {
      check_select(b, t, c, dt, special);
      check_select(b, t, c, dt, zeros);
      check_select(b, t, c, dt, wide);
    }
    // Scores of one sign in a narrow range: the keys share their first digits.
    const std::vector<double> narrow =
        round_to(dt, uniform_values(static_cast<size_t>(b * t), 34, 0.25, 0.4));
    for (int64_t c : {int64_t{1}, int64_t{37}, t - 1}) check_select(b, t, c, dt, narrow);
  }
}

TEST_CASE("gpu MoD: tied scores resolve to the lower position", "[gpu][mod]") {
  for (DType dt : kFloatTypes) {
    check_mod(3, 203, 26, 19, true, dt, 11);
    check_mod(2, 1100, 100, 8, true, dt, 12);
    // All scores equal: the first C positions.
    Ctx gctx = gpu_ctx();
    const int64_t b = 2, t = 100, c = 13;
    const std::vector<double> sc(static_cast<size_t>(b * t), 0.5);
    DeviceTensor gs = on_device(dt, {b, t}, sc), gmask = poisoned(dt, {b, t});
    DeviceTensor gsel = poisoned(DType::i32, {b, c});
    mod_select(gctx, gsel, gmask, gs);
    std::vector<int32_t> want;
    for (int64_t bi = 0; bi < b; ++bi)
      for (int32_t i = 0; i < c; ++i) want.push_back(i);
    CHECK(download_i32(gsel) == want);
  }
}

TEST_CASE("gpu MoD: C = 1 and C = T", "[gpu][mod]") {
  for (DType dt : kFloatTypes) {
    check_mod(3, 203, 1, 21, false, dt, 21);
    check_mod(3, 203, 203, 21, false, dt, 22);
    check_mod(2, 77, 1, 5, true, dt, 23);
    check_mod(2, 77, 77, 5, true, dt, 24);
    check_mod(1, 1, 1, 3, false, dt, 25);
    check_mod(2, 1024, 1, 8, false, dt, 26);  // C = 1 with a score for every thread of the block
  }
}

// ---- the causal predictor's head ----------------------------------------------------------------
// Against kernels/cpu/mod_predictor.cpp on the same f32 / f64 values. logit and dh: rtol_for(dt)
// of the output's scale; dw2 (a sum over N rows, accumulating into a random start): rtol_for(dt)
// times the column's sum of |terms| (its rounding scales with it, not with the result, which
// cancels). Run twice: the bits of logit, dh and dw2 must repeat (fixed summation order).
namespace {

void check_predictor_head(int64_t n, int64_t p, DType dt, uint64_t seed) {
  INFO("predictor head N=" << n << " P=" << p << " dtype=" << dtype_name(dt));
  Ctx cctx = cpu_ctx(), gctx = gpu_ctx();
  const double grad_scale = 0.5;
  const auto h = round_to(dt, uniform_values(static_cast<size_t>(n * p), seed, -4.0, 4.0));
  const auto w2 = round_to(dt, uniform_values(static_cast<size_t>(p), seed + 1));
  const auto dw0 = round_to(dt, uniform_values(static_cast<size_t>(p), seed + 2, -0.1, 0.1));
  std::vector<double> tg = tied_values(static_cast<size_t>(n), seed + 3, {0.0, 1.0});
  Buf<double> hh = host({n, p}, h), hw = host({1, p}, w2), hdw = host({1, p}, dw0);
  Buf<double> ht = host({n}, tg), hl({n}), hdh({n, p});
  cpu::mod_predictor_head_forward(cctx, hl, hh, hw);
  cpu::mod_predictor_head_backward(cctx, hdh, hdw, hh, hw, hl, ht, grad_scale);
  // the size of each dw2 column's terms
  std::vector<double> terms(static_cast<size_t>(p), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const double dl = grad_scale / n * std::fabs(1.0 / (1.0 + std::exp(-hl[i])) - tg[i]);
    for (int64_t j = 0; j < p; ++j) {
      const double a = h[i * p + j];
      terms[j] += dl * std::fabs(a / (1.0 + std::exp(-a)));
    }
  }

  DeviceTensor gh = on_device(dt, {n, p}, h), gw = on_device(dt, {1, p}, w2);
  DeviceTensor gt = on_device(dt, {n}, tg);
  // logit, dh, dw2 of a fresh run
  auto run = [&] {
    DeviceTensor gl = poisoned(dt, {n}), gdh = poisoned(dt, {n, p});
    DeviceTensor gdw = on_device(dt, {1, p}, dw0);
    mod_predictor_head_forward(gctx, gl, gh, gw);
    mod_predictor_head_backward(gctx, gdh, gdw, gh, gw, gl, gt, grad_scale);
    return std::vector<std::vector<double>>{download(gl), download(gdh), download(gdw)};
  };
  const std::vector<std::vector<double>> first = run();
  const std::vector<std::vector<double>> again = run();
  CHECK(again[0] == first[0]);
  CHECK(again[1] == first[1]);
  CHECK(again[2] == first[2]);
  const std::vector<double>&logit = first[0], &dh = first[1], &dw = first[2];
  check_grad(logit, hl.v, dt, "mod_predictor_head_forward logit");
  check_grad(dh, hdh.v, dt, "mod_predictor_head_backward dh");
  for (int64_t j = 0; j < p; ++j) {
    INFO("dw2[" << j << "] gpu " << dw[j] << " cpu " << hdw[j] << " terms " << terms[j]);
    CHECK(std::fabs(dw[j] - hdw[j]) <= rtol_for(dt) * (terms[j] + std::fabs(dw0[j])));
  }
}

}  // namespace

TEST_CASE("gpu MoD predictor head against the CPU", "[gpu][mod]") {
  for (DType dt : {DType::f32, DType::f64}) {
    check_predictor_head(37, 64, dt, 11);     // one backward block, fewer rows than warps x 8
    check_predictor_head(16384, 64, dt, 12);  // the model's shape: 256 blocks' partials
    check_predictor_head(1000, 1, dt, 13);    // one column
    check_predictor_head(3001, 100, dt, 14);  // P past a 32-column slice, a partial last block
  }
  check_predictor_head(300000, 64, DType::f64, 15);  // partials past the scratch: 128-row blocks
}
