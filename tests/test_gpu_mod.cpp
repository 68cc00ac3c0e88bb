// CUDA Mixture-of-Depths ops against the CPU reference (kernels/cpu/mod.cpp) on the same inputs:
// values rounded to the storage dtype, the CPU computing in f64. Outputs are poisoned before each
// GPU call (except the accumulating dx of mod_gather_backward, which starts from random values).
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

// The radix select compares order-preserving integer keys: -0 must still tie with +0, negative
// scores order below positive ones, infinities and values that round to 16-bit subnormals stay
// in place, and a tie group at the threshold runs every digit pass.
TEST_CASE("gpu MoD: select with signed zeros, infinities, subnormals and wide ranges",
          "[gpu][mod]") {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : kFloatTypes) {
    const int64_t b = 2, t = 300;
    const std::vector<double> special = round_to(
        dt, tied_values(static_cast<size_t>(b * t), 31,
                        {-0.0, 0.0, inf, -inf, 1e-7, -1e-7, 3e-5, -3e-5, 6e4, -6e4, 1.0, -1.0}));
    const std::vector<double> zeros =
        round_to(dt, tied_values(static_cast<size_t>(b * t), 32, {-0.0, 0.0, -0.5}));
    const std::vector<double> wide =
        round_to(dt, uniform_values(static_cast<size_t>(b * t), 33, -6e4, 6e4));
    for (int64_t c : {1, 37, 150, 299, 300}) {
      check_select(b, t, c, dt, special);
      check_select(b, t, c, dt, zeros);
      check_select(b, t, c, dt, wide);
    }
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
  }
}
