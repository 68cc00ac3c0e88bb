// GPU tests of the grouped expert GEMMs (kernels/cuda/grouped_*.cu: the sm_90 TMA + wgmma kernels
// in each of their settings, the sm_80+ mma.sync and sm_75 kernels) against the CPU reference
// ops, and of their fused forms (the SwiGLU epilogue, the gathering loads, the backward pair)
// against the separate ops' bits. Inputs, poisoning and error bounds as in test_gpu_dense.cpp
// (gpu_op_checks.hpp).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "gpu_op_checks.hpp"
#include "gpu_test_util.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/permute.hpp"
#include "moe/ops/swiglu.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

// ---- grouped linear -----------------------------------------------------------------------------
namespace {
struct GroupedCase {
  int64_t rows, in, out;
  std::vector<int32_t> offsets;  // [E+1]
  int64_t experts() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t max_rows() const {  // the largest expert's rows
    int64_t m = 0;
    for (size_t i = 0; i + 1 < offsets.size(); ++i)
      m = std::max<int64_t>(m, offsets[i + 1] - offsets[i]);
    return m;
  }
};

// The grouped GEMM kernels a case runs: "sm90-n256" / "sm90-n128" (the sm_90 TMA + wgmma kernels
// with 256- / 128-column tiles; where they decline, the sm_80+ ones), "sm90-pingpong" (the
// ping-pong kernels: 128 x 128 tiles alternating between the math warpgroups), "sm90-multicast"
// (the rows kernels in clusters of two blocks sharing B by TMA multicast), "sm90-pp-multicast"
// (ping-pong rows kernels in such pairs), "sm90-deferred" / "sm90-n128-deferred" (the
// cooperative kernels with the rows kernels' deferred epilogue, the held stage freed after the
// next tile's first / third slice) or "sm80-k32" / "sm80-k64" (the sm_80+ kernels with 32- /
// 64-wide k-slices).
void select_grouped_kernel(const std::string& kernel) {
  const bool sm90 = kernel.rfind("sm90", 0) == 0;
  set_grouped_sm90(!sm90                            ? "0"
                   : kernel == "sm90-n128"          ? "128"
                   : kernel == "sm90-pingpong"      ? "pingpong"
                   : kernel == "sm90-multicast"     ? "multicast"
                   : kernel == "sm90-pp-multicast"  ? "pingpong-multicast"
                   : kernel == "sm90-deferred"      ? "256-deferred"
                   : kernel == "sm90-n128-deferred" ? "128-deferred3"
                                                    : "256");
  setenv("MOE_GROUPED_TILE_K", kernel == "sm80-k64" ? "64" : "32", 1);
}
// An empty expert in the middle and one taking most rows; empty first and last experts with a
// single expert taking every row over several tiles; a single expert.
const GroupedCase kGroupedCases[] = {
    {77, 48, 40, {0, 3, 3, 73, 77}},
    {150, 80, 136, {0, 0, 150, 150}},
    {77, 48, 40, {0, 77}},
    {150, 80, 136, {0, 64, 65, 129, 130, 150}},
    // several 128-row tiles and 32-deep K steps per expert (the tensor-core path's tiles), and a
    // feature count that is not a multiple of 8 (no 16-byte loads)
    {700, 256, 192, {0, 10, 10, 400, 700}},
    {300, 52, 70, {0, 130, 300}},
    // the sm_90 wgmma kernels' edges: 128-row tiles cut mid-expert, features that are multiples of
    // 8 but not of the 64-wide k-slices or the 128 / 256-column tiles, more k-slices than the
    // 4-deep ring (forward 5, dx 9, dw up to 8), an empty expert between full ones
    {1001, 264, 520, {0, 129, 129, 600, 1001}},
    {640, 136, 72, {0, 0, 256, 640, 640}},
    // the persistent TMA rows kernel: more tiles than an H200 has SMs (each block runs several,
    // its ring carried from tile to tile)
    {9000, 200, 520, {0, 1000, 1000, 4100, 8000, 9000}},
};

// 40 experts: the device-side tile scan takes two 32-expert passes; a few empty, one large.
GroupedCase forty_experts() {
  GroupedCase c{0, 64, 48, {0}};
  for (int e = 0; e < 40; ++e) {
    const int rows = e % 7 == 3 ? 0 : (e == 33 ? 300 : 5 + e);
    c.offsets.push_back(c.offsets.back() + rows);
  }
  c.rows = c.offsets.back();
  return c;
}

// 300 experts: more than the sm_90 rows kernel keeps in shared memory (256), so its tile scan
// reads the offsets from global memory; rows of 0-9 per expert, one of 200.
GroupedCase three_hundred_experts() {
  GroupedCase c{0, 72, 56, {0}};
  for (int e = 0; e < 300; ++e) c.offsets.push_back(c.offsets.back() + (e == 150 ? 200 : e % 10));
  c.rows = c.offsets.back();
  return c;
}

// kGroupedCases, forty experts and, with three_hundred, 300 (past the sm_90 rows kernel's table).
std::vector<GroupedCase> grouped_cases(bool three_hundred) {
  std::vector<GroupedCase> cases(std::begin(kGroupedCases), std::end(kGroupedCases));
  cases.push_back(forty_experts());
  if (three_hundred) cases.push_back(three_hundred_experts());
  return cases;
}
}  // namespace

TEST_CASE("gpu grouped_linear: forward and backward per expert, offsets on the device", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const std::vector<GroupedCase> cases = grouped_cases(true);
  // Each kernel configuration this device runs: the sm_90 TMA + wgmma kernels
  // (grouped_wgmma_sm90.cu, 256- and 128-column tiles; elsewhere they decline) and, with those
  // off, both of the sm_80+ kernels (grouped_mma_sm80.cu: 32- and 64-wide k-slices).
  const std::string kernel =
      GENERATE(as<std::string>{}, "sm90-n256", "sm90-n128", "sm90-pingpong", "sm90-multicast",
               "sm90-pp-multicast", "sm90-deferred", "sm90-n128-deferred", "sm80-k32", "sm80-k64");
  select_grouped_kernel(kernel);
  int case_index = 0;
  for (const GroupedCase& gc : cases) {
    const int64_t e = gc.experts();
    const int64_t r = gc.rows, in = gc.in, out = gc.out;
    const int64_t max_rows = gc.max_rows();
    const std::string tag = " [case " + std::to_string(case_index++) + ", " + kernel + "]";
    for (DType dt : kDtypes) {
      const DType acc = acc_dtype(dt);
      const auto x = rounded_random_values(dt, r * in, 80),
                 w = rounded_random_values(dt, e * out * in, 81);
      const auto dy = rounded_random_values(dt, r * out, 82),
                 dw0 = rounded_random_values(acc, e * out * in, 83);
      Buf<double> hx = host({r, in}, x), hw = host({e, out, in}, w), hdy = host({r, out}, dy);
      Buf<int32_t> hoff = host_i32(gc.offsets);
      DeviceTensor gx = on_device(dt, {r, in}, x), gw = on_device(dt, {e, out, in}, w);
      DeviceTensor gdy = on_device(dt, {r, out}, dy), goff = ids_on_device(gc.offsets);

      Buf<double> hy({r, out});
      cpu::grouped_linear_forward(cpu, hy, hx, hw, hoff);
      DeviceTensor gy = poisoned(dt, {r, out});
      grouped_linear_forward(gpu, gy, gx, gw, goff);
      check_close("grouped_linear_forward y" + tag, dt, download(gy), hy.v, sum_tol(dt, in));

      Buf<double> hdx({r, in}), hdw = host({e, out, in}, dw0);
      cpu::grouped_linear_backward(cpu, hdx, hdw, hdy, hx, hw, hoff);
      DeviceTensor gdx = poisoned(dt, {r, in}), gdw = on_device(acc, {e, out, in}, dw0);
      const auto dw_before = bytes_of(gdw);
      grouped_linear_backward(gpu, gdx, gdw, gdy, gx, gw, goff);
      check_close("grouped_linear_backward dx" + tag, dt, download(gdx), hdx.v, sum_tol(dt, out));
      check_close("grouped_linear_backward dw" + tag, acc, download(gdw), hdw.v,
                  sum_tol(acc, max_rows));
      // An expert with no rows keeps its dw bit for bit.
      const auto dw_after = bytes_of(gdw);
      const size_t per_expert = static_cast<size_t>(out * in) * dtype_size(acc);
      for (int64_t i = 0; i < e; ++i) {
        if (gc.offsets[i + 1] != gc.offsets[i]) continue;
        INFO("empty expert " << i << tag << " [" << dtype_name(dt) << "]");
        CHECK(std::equal(dw_before.begin() + i * per_expert,
                         dw_before.begin() + (i + 1) * per_expert,
                         dw_after.begin() + i * per_expert));
      }
      // dw_overwrite over a poisoned dw: the CPU's dw from zero, the empty experts exactly 0.
      Buf<double> hdx_o({r, in}), hdw_o({e, out, in});
      cpu::grouped_linear_backward(cpu, hdx_o, hdw_o, hdy, hx, hw, hoff);
      DeviceTensor gdw_o = poisoned(acc, {e, out, in});
      grouped_linear_backward(gpu, gdx, gdw_o, gdy, gx, gw, goff, true);
      const std::vector<double> over = download(gdw_o);
      check_close("grouped_linear_backward dw overwrite" + tag, acc, over, hdw_o.v,
                  sum_tol(acc, max_rows));
      for (int64_t i = 0; i < e; ++i) {
        if (gc.offsets[i + 1] != gc.offsets[i]) continue;
        INFO("empty expert " << i << " overwritten" << tag << " [" << dtype_name(dt) << "]");
        CHECK(std::all_of(over.begin() + i * out * in, over.begin() + (i + 1) * out * in,
                          [](double v) { return v == 0.0; }));
      }
      // The offsets are never modified.
      CHECK(download_i32(goff) == gc.offsets);
    }
  }
  unsetenv("MOE_GROUPED_TILE_K");
  clear_grouped_sm90();
}

// The gate and up projections' backward together: dx = dy1 w1 + dy3 w3 (on sm_90 one product
// over both k ranges, the second operands loaded for the second half of the k-slices; elsewhere
// the two products apart and added), dw1 and dw3 overwritten (on sm_90 in one launch, each
// expert's dw1 tiles then its dw3 tiles, a hot expert's chunks in order), against the CPU op,
// with every kernel setting of the grouped test above; dx2 aliasing dy1 (the model's layout).
TEST_CASE("gpu grouped_linear_backward_pair: dx of both projections, each one's dw", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const std::vector<GroupedCase> cases = grouped_cases(false);
  const std::string kernel =
      GENERATE(as<std::string>{}, "sm90-n256", "sm90-n128", "sm90-pingpong", "sm90-multicast",
               "sm90-pp-multicast", "sm90-deferred", "sm90-n128-deferred", "sm80-k32", "sm80-k64");
  select_grouped_kernel(kernel);
  int case_index = 0;
  for (const GroupedCase& gc : cases) {
    const int64_t e = gc.experts();
    const int64_t r = gc.rows, in = gc.in, out = gc.out;
    const int64_t max_rows = gc.max_rows();
    const std::string tag = " [case " + std::to_string(case_index++) + ", " + kernel + "]";
    for (DType dt : kDtypes) {
      INFO(dtype_name(dt) << tag);
      const DType acc = acc_dtype(dt);
      const auto x = rounded_random_values(dt, r * in, 84),
                 w1 = rounded_random_values(dt, e * out * in, 85),
                 w3 = rounded_random_values(dt, e * out * in, 86);
      const auto dy1 = rounded_random_values(dt, r * out, 87),
                 dy3 = rounded_random_values(dt, r * out, 88);
      Buf<double> hx = host({r, in}, x), hw1 = host({e, out, in}, w1), hw3 = host({e, out, in}, w3);
      Buf<double> hdy1 = host({r, out}, dy1), hdy3 = host({r, out}, dy3);
      Buf<int32_t> hoff = host_i32(gc.offsets);
      Buf<double> hdx({r, in}), hdx2({r, in}), hdw1({e, out, in}), hdw3({e, out, in});
      cpu::grouped_linear_backward_pair(cpu, hdx, hdx2, hdw1, hdw3, hdy1, hdy3, hx, hw1, hw3, hoff,
                                        true);
      DeviceTensor gx = on_device(dt, {r, in}, x), gw1 = on_device(dt, {e, out, in}, w1),
                   gw3 = on_device(dt, {e, out, in}, w3), goff = ids_on_device(gc.offsets);
      DeviceTensor gdy1 = on_device(dt, {r, out}, dy1), gdy3 = on_device(dt, {r, out}, dy3);
      DeviceTensor gdx = poisoned(dt, {r, in}), gdx2 = poisoned(dt, {r, in});
      DeviceTensor gdw1 = poisoned(acc, {e, out, in}), gdw3 = poisoned(acc, {e, out, in});
      grouped_linear_backward_pair(gpu, gdx, gdx2, gdw1, gdw3, gdy1, gdy3, gx, gw1, gw3, goff,
                                   true);
      // The sm_90 one product rounds once; apart (the sm_80 kernels, f32 / f64, rows that are not
      // 16-byte multiples, a build without sm_90a code) each product is rounded before the sum:
      // the bound takes ulp(dt) of each product's size more, whichever path ran (a product left
      // out or misplaced is off by the product itself).
      {
        Buf<double> p1({r, in}), p3({r, in}), scratch({e, out, in});
        cpu::grouped_linear_backward(cpu, p1, scratch, hdy1, hx, hw1, hoff, true);
        cpu::grouped_linear_backward(cpu, p3, scratch, hdy3, hx, hw3, hoff, true);
        check_close_rounded_parts("grouped_linear_backward_pair dx" + tag, dt, download(gdx), hdx.v,
                                  p1.v, p3.v, sum_tol(dt, 2 * out));
      }
      check_close("grouped_linear_backward_pair dw1" + tag, acc, download(gdw1), hdw1.v,
                  sum_tol(acc, max_rows));
      check_close("grouped_linear_backward_pair dw3" + tag, acc, download(gdw3), hdw3.v,
                  sum_tol(acc, max_rows));
      {  // no workspace where the op says it runs one product (the same bits); elsewhere refused
        DeviceTensor gdxn = poisoned(dt, {r, in});
        DeviceTensor gdw1n = poisoned(acc, {e, out, in}), gdw3n = poisoned(acc, {e, out, in});
        auto run = [&] {
          grouped_linear_backward_pair(gpu, gdxn, Tensor(), gdw1n, gdw3n, gdy1, gdy3, gx, gw1, gw3,
                                       goff, true);
        };
        if (!grouped_linear_backward_pair_needs_dx2(gpu, dt, r, e, in, out)) {
          run();
          CHECK(download(gdxn) == download(gdx));
          CHECK(download(gdw1n) == download(gdw1));
          CHECK(download(gdw3n) == download(gdw3));
        } else {
          CHECK_THROWS_WITH(run(), Catch::Contains("dx2 is empty"));
        }
      }
      {  // x's rows gathered from a token table (reversed): the same bits
        std::vector<double> xt(x.size());
        std::vector<int32_t> row_token(static_cast<size_t>(r));
        for (int64_t i = 0; i < r; ++i) {
          row_token[i] = static_cast<int32_t>(r - 1 - i);
          std::copy(x.begin() + i * in, x.begin() + (i + 1) * in, xt.begin() + (r - 1 - i) * in);
        }
        DeviceTensor gxt = on_device(dt, {r, in}, xt), grt = ids_on_device(row_token);
        DeviceTensor gdxg = poisoned(dt, {r, in}), gdx2g = poisoned(dt, {r, in});
        DeviceTensor gdw1g = poisoned(acc, {e, out, in}), gdw3g = poisoned(acc, {e, out, in});
        grouped_linear_backward_pair_gathered(gpu, gdxg, gdx2g, gdw1g, gdw3g, gdy1, gdy3, gxt, grt,
                                              gw1, gw3, goff, true);
        CHECK(download(gdxg) == download(gdx));
        CHECK(download(gdw1g) == download(gdw1));
        CHECK(download(gdw3g) == download(gdw3));
      }
      if (out >= in) {  // dx2 over dy1's memory, as the model lays it out when F >= d
        DeviceTensor gdy1b = on_device(dt, {r, out}, dy1), gdxb = poisoned(dt, {r, in});
        Tensor over_dy1 = Tensor(gdy1b.t.data, dt, gdy1b.t.device, {r, in});
        grouped_linear_backward_pair(gpu, gdxb, over_dy1, gdw1, gdw3, gdy1b, gdy3, gx, gw1, gw3,
                                     goff, true);
        CHECK(download(gdxb) == download(gdx));
      }
    }
  }
  unsetenv("MOE_GROUPED_TILE_K");
  clear_grouped_sm90();
}

// A hot expert: the sm_90 dw kernel cuts an expert's rows into chunks of twice the mean rows per
// expert and adds them in chunk order (flags per tile). One expert of 32 holds most rows (15
// chunks, with a ragged last one), an empty one beside it, its tiles more than once over the SMs
// with the other experts' units: dw must match the CPU and give the same bits on every run, over
// a non-zero dw, with 256- and 128-column tiles and the ping-pong kernel (there the half tile is
// one warpgroup's 64 rows; elsewhere the sm_80 kernels run the same checks). The deferred
// settings run dx's rows kernel with the deferred epilogue over more tiles than an H200 has SMs
// (the hot expert's alone: 118 row tiles x 2 column tiles), so blocks pass a held stage from one
// tile to the next.
TEST_CASE("gpu grouped_linear_backward: a hot expert's chunks add in a fixed order", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const std::string kernel = GENERATE(as<std::string>{}, "256", "128", "pingpong", "multicast",
                                      "pingpong-multicast", "256-deferred", "256-deferred3");
  set_grouped_sm90(kernel);
  INFO("tiles " << kernel);
  const DType dt = DType::bf16, acc = DType::f32;
  // out: two whole 128-row tiles of dw and a half one (its second warpgroup skips)
  const int64_t e = 32, in = 512, out = 320;
  std::vector<int32_t> offsets = {0};
  for (int64_t i = 0; i < e; ++i)
    offsets.push_back(offsets.back() + (i == 5 ? 15000 : i == 6 ? 0 : 40));
  const int64_t r = offsets.back(), hot = 15000;
  const auto x = rounded_random_values(dt, r * in, 84),
             w = rounded_random_values(dt, e * out * in, 85);
  const auto dy = rounded_random_values(dt, r * out, 86),
             dw0 = rounded_random_values(acc, e * out * in, 87);
  DeviceTensor gx = on_device(dt, {r, in}, x), gw = on_device(dt, {e, out, in}, w);
  DeviceTensor gdy = on_device(dt, {r, out}, dy), goff = ids_on_device(offsets);
  DeviceTensor gdx = poisoned(dt, {r, in}), gdw = on_device(acc, {e, out, in}, dw0);
  grouped_linear_backward(gpu, gdx, gdw, gdy, gx, gw, goff);
  const auto bits = bytes_of(gdw);
  for (int run = 0; run < 3; ++run) {
    upload(gdw, dw0);
    grouped_linear_backward(gpu, gdx, gdw, gdy, gx, gw, goff);
    INFO("run " << run);
    CHECK(bytes_of(gdw) == bits);
  }
  Buf<double> hx = host({r, in}, x), hw = host({e, out, in}, w), hdy = host({r, out}, dy);
  Buf<double> hdx({r, in}), hdw = host({e, out, in}, dw0);
  Buf<int32_t> hoff = host_i32(offsets);
  cpu::grouped_linear_backward(cpu, hdx, hdw, hdy, hx, hw, hoff);
  check_close("grouped_linear_backward dw, hot expert", acc, download(gdw), hdw.v,
              sum_tol(acc, hot));
  check_close("grouped_linear_backward dx, hot expert", dt, download(gdx), hdx.v, sum_tol(dt, out));
  // dw_overwrite: the first chunk of each tile stores, the others add behind it; over a poisoned
  // dw that is the sum onto zeros (the same values: x + 0 = x but for -0), every run.
  DeviceTensor gdw_zero = on_device(acc, {e, out, in}, std::vector<double>(e * out * in, 0.0));
  grouped_linear_backward(gpu, gdx, gdw_zero, gdy, gx, gw, goff);
  const std::vector<double> from_zero = download(gdw_zero);
  for (int run = 0; run < 2; ++run) {
    DeviceTensor gdw_o = poisoned(acc, {e, out, in});
    grouped_linear_backward(gpu, gdx, gdw_o, gdy, gx, gw, goff, true);
    INFO("overwrite run " << run);
    CHECK(download(gdw_o) == from_zero);
  }
  clear_grouped_sm90();
}

// The MoE layer's row -> token map for the gathered ops: r rows over n tokens, at random (tokens
// taken several times, once or never).
std::vector<int32_t> random_row_tokens(int64_t r, int64_t n, int64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<int32_t> tokens(static_cast<size_t>(r));
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(n));
  return tokens;
}

// The SwiGLU products' cases, {rows, in, features, offsets}: features not a multiple of the
// 128-feature (forward) or 256-column (dh) tiles, an empty expert, tiles cut mid-expert, more
// tiles than SMs (the persistent kernel); in = 72 and 136 end mid-slice. hot_expert: also one
// expert with most rows (the dw kernel's chunked tiles).
std::vector<GroupedCase> swiglu_cases(bool hot_expert = false) {
  std::vector<GroupedCase> cases = {{300, 64, 200, {0, 100, 100, 300}},
                                    {1001, 136, 704, {0, 129, 129, 600, 1001}},
                                    {9000, 72, 264, {0, 1000, 1000, 4100, 8000, 9000}}};
  if (hot_expert) cases.push_back({5000, 64, 136, {0, 4800, 4800, 5000}});
  return cases;
}

TEST_CASE("gpu grouped_swiglu_forward: the fused epilogue gives the three ops' bits", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const std::vector<GroupedCase> cases = swiglu_cases();
  // The fused sm_90 kernel (256-column tiles; "pingpong": 64 features a tile, the gate and up
  // columns of a piece going to two tensors; "multicast": in block pairs; with 128-column tiles
  // the op runs the three ops itself; "256-deferred(3)": the deferred epilogue, warpgroup 0's
  // three pieces in its last slice's stage) against the three ops.
  const std::string kernel = GENERATE(as<std::string>{}, "256", "128", "pingpong", "multicast",
                                      "pingpong-multicast", "256-deferred", "256-deferred3");
  set_grouped_sm90(kernel);
  for (const GroupedCase& gc : cases) {
    const int64_t e = gc.experts();
    const int64_t r = gc.rows, in = gc.in, f = gc.out;
    const std::string tag =
        " [R=" + std::to_string(r) + " F=" + std::to_string(f) + ", tiles " + kernel + "]";
    for (DType dt : kDtypes) {
      const auto x = rounded_random_values(dt, r * in, 90),
                 w1 = rounded_random_values(dt, e * f * in, 91),
                 w3 = rounded_random_values(dt, e * f * in, 92);
      const auto row_w = rounded_random_values(acc_dtype(dt), r, 89, 0.05, 1.0);
      DeviceTensor gx = on_device(dt, {r, in}, x), gw1 = on_device(dt, {e, f, in}, w1),
                   gw3 = on_device(dt, {e, f, in}, w3), goff = ids_on_device(gc.offsets),
                   gw = on_device(acc_dtype(dt), {r}, row_w);
      DeviceTensor gate = poisoned(dt, {r, f}), up = poisoned(dt, {r, f}), h = poisoned(dt, {r, f});
      grouped_swiglu_forward(gpu, gate, up, h, gx, gw1, gw3, gw, goff);
      DeviceTensor gate2 = poisoned(dt, {r, f}), up2 = poisoned(dt, {r, f}),
                   h2 = poisoned(dt, {r, f});
      grouped_linear_forward(gpu, gate2, gx, gw1, goff);
      grouped_linear_forward(gpu, up2, gx, gw3, goff);
      swiglu_weighted_forward(gpu, h2, gate2, up2, gw);
      INFO(dtype_name(dt) << tag);
      CHECK(bytes_of(gate) == bytes_of(gate2));
      CHECK(bytes_of(up) == bytes_of(up2));
      CHECK(bytes_of(h) == bytes_of(h2));
      // and against the CPU op
      Buf<double> hgate({r, f}), hup({r, f}), hh({r, f});
      Buf<double> hx = host({r, in}, x), hw1 = host({e, f, in}, w1), hw3 = host({e, f, in}, w3),
                  hrw = host({r}, row_w);
      Buf<int32_t> hoff = host_i32(gc.offsets);
      cpu::grouped_swiglu_forward(cpu, hgate, hup, hh, hx, hw1, hw3, hrw, hoff);
      check_close("grouped_swiglu_forward gate" + tag, dt, download(gate), hgate.v,
                  sum_tol(dt, in));
      check_close("grouped_swiglu_forward up" + tag, dt, download(up), hup.v, sum_tol(dt, in));
      // h from the GPU's own rounded gate and up (the CPU's are not rounded)
      Buf<double> hh_gpu({r, f}), gate_gpu = host({r, f}, download(gate)),
                                  up_gpu = host({r, f}, download(up));
      cpu::swiglu_weighted_forward(cpu, hh_gpu, gate_gpu, up_gpu, hrw);
      check_close("grouped_swiglu_forward h" + tag, dt, download(h), hh_gpu.v, pointwise_tol(dt));
    }
  }
  clear_grouped_sm90();
}

// The gather of A's rows fused into the sm_90 kernel (its producer's cp.async copies; 256-column
// tiles) and the op's own permute elsewhere ("128", "0") give the bits of permute_forward and
// grouped_swiglu_forward.
TEST_CASE("gpu grouped_swiglu_forward_gathered: the permute and the fused forward's bits",
          "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const std::vector<GroupedCase> cases = swiglu_cases();
  const std::string kernel = GENERATE(as<std::string>{}, "256", "128", "pingpong", "multicast",
                                      "pingpong-multicast", "256-deferred", "0");
  set_grouped_sm90(kernel);
  for (const GroupedCase& gc : cases) {
    const int64_t e = gc.experts();
    const int64_t r = gc.rows, in = gc.in, f = gc.out, n = r / 3 + 1;
    const std::vector<int32_t> tokens = random_row_tokens(r, n, r);
    const std::string tag =
        " [R=" + std::to_string(r) + " F=" + std::to_string(f) + ", tiles " + kernel + "]";
    for (DType dt : kDtypes) {
      const auto x = rounded_random_values(dt, n * in, 93),
                 w1 = rounded_random_values(dt, e * f * in, 94),
                 w3 = rounded_random_values(dt, e * f * in, 95);
      const auto row_w = rounded_random_values(acc_dtype(dt), r, 96, 0.05, 1.0);
      DeviceTensor gx = on_device(dt, {n, in}, x), gw1 = on_device(dt, {e, f, in}, w1),
                   gw3 = on_device(dt, {e, f, in}, w3), goff = ids_on_device(gc.offsets),
                   gw = on_device(acc_dtype(dt), {r}, row_w), gtok = ids_on_device(tokens);
      DeviceTensor gate = poisoned(dt, {r, f}), up = poisoned(dt, {r, f}), h = poisoned(dt, {r, f});
      grouped_swiglu_forward_gathered(gpu, gate, up, h, gx, gtok, gw1, gw3, gw, goff);
      DeviceTensor xp = poisoned(dt, {r, in}), gate2 = poisoned(dt, {r, f}),
                   up2 = poisoned(dt, {r, f}), h2 = poisoned(dt, {r, f});
      permute_forward(gpu, xp, gx, gtok);
      grouped_swiglu_forward(gpu, gate2, up2, h2, xp, gw1, gw3, gw, goff);
      INFO(dtype_name(dt) << tag);
      CHECK(bytes_of(gate) == bytes_of(gate2));
      CHECK(bytes_of(up) == bytes_of(up2));
      CHECK(bytes_of(h) == bytes_of(h2));
      // and against the CPU op
      Buf<double> hgate({r, f}), hup({r, f}), hh({r, f});
      Buf<double> hx = host({n, in}, x), hw1 = host({e, f, in}, w1), hw3 = host({e, f, in}, w3),
                  hrw = host({r}, row_w);
      Buf<int32_t> hoff = host_i32(gc.offsets), htok = host_i32(tokens);
      cpu::grouped_swiglu_forward_gathered(cpu, hgate, hup, hh, hx, htok, hw1, hw3, hrw, hoff);
      check_close("grouped_swiglu_forward_gathered gate" + tag, dt, download(gate), hgate.v,
                  sum_tol(dt, in));
      check_close("grouped_swiglu_forward_gathered up" + tag, dt, download(up), hup.v,
                  sum_tol(dt, in));
    }
  }
  clear_grouped_sm90();
}

// The gather of x's rows fused into the sm_90 dw kernel (256- and 128-column tiles, ping-pong) and
// the op's own permute elsewhere ("0") give the bits of permute_forward and
// grouped_linear_backward, dw added to and overwritten, chunked hot experts included.
TEST_CASE("gpu grouped_linear_backward_gathered: the permute and the backward's bits", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const std::string kernel = GENERATE(as<std::string>{}, "256", "128", "pingpong", "multicast",
                                      "pingpong-multicast", "256-deferred", "0");
  set_grouped_sm90(kernel);
  const std::vector<GroupedCase> cases = swiglu_cases(true);
  for (const GroupedCase& gc : cases) {
    const int64_t e = gc.experts();
    const int64_t r = gc.rows, in = gc.in, out = gc.out, n = r / 3 + 1;
    const std::vector<int32_t> tokens = random_row_tokens(r, n, r + 7);
    for (DType dt : kDtypes) {
      const DType acc = acc_dtype(dt);
      const auto x = rounded_random_values(dt, n * in, 97),
                 w = rounded_random_values(dt, e * out * in, 98),
                 dy = rounded_random_values(dt, r * out, 99);
      const auto dw0 = rounded_random_values(acc, e * out * in, 100);
      DeviceTensor gx = on_device(dt, {n, in}, x), gw = on_device(dt, {e, out, in}, w),
                   gdy = on_device(dt, {r, out}, dy), goff = ids_on_device(gc.offsets),
                   gtok = ids_on_device(tokens);
      DeviceTensor xp = poisoned(dt, {r, in});
      permute_forward(gpu, xp, gx, gtok);
      for (bool overwrite : {false, true}) {
        INFO(dtype_name(dt) << " R=" << r << " tiles " << kernel << " overwrite " << overwrite);
        DeviceTensor dx = poisoned(dt, {r, in}), dw = on_device(acc, {e, out, in}, dw0);
        DeviceTensor dx2 = poisoned(dt, {r, in}), dw2 = on_device(acc, {e, out, in}, dw0);
        grouped_linear_backward_gathered(gpu, dx, dw, gdy, gx, gtok, gw, goff, overwrite);
        grouped_linear_backward(gpu, dx2, dw2, gdy, xp, gw, goff, overwrite);
        CHECK(bytes_of(dx) == bytes_of(dx2));
        CHECK(bytes_of(dw) == bytes_of(dw2));
        if (overwrite) continue;
        // and against the CPU op
        Buf<double> hdx({r, in}), hdw = host({e, out, in}, dw0);
        Buf<double> hx = host({n, in}, x), hw = host({e, out, in}, w), hdy = host({r, out}, dy);
        Buf<int32_t> hoff = host_i32(gc.offsets), htok = host_i32(tokens);
        cpu::grouped_linear_backward_gathered(cpu, hdx, hdw, hdy, hx, htok, hw, hoff);
        check_close("grouped_linear_backward_gathered dw", acc, download(dw), hdw.v,
                    sum_tol(acc, r));
        check_close("grouped_linear_backward_gathered dx", dt, download(dx), hdx.v,
                    sum_tol(dt, out));
      }
    }
  }
  clear_grouped_sm90();
}

// dh lives in dgate and the SwiGLU backward runs in place: the same bits as the two ops into
// separate buffers, at every kernel setting of the dh GEMM.
TEST_CASE("gpu grouped_swiglu_down_backward: the two ops' bits, dh in place", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const std::vector<GroupedCase> cases = swiglu_cases();  // (d: the down projection's output)
  const std::string kernel = GENERATE(as<std::string>{}, "256", "128", "pingpong", "multicast",
                                      "pingpong-multicast", "256-deferred", "0");
  set_grouped_sm90(kernel);
  for (const GroupedCase& gc : cases) {
    const int64_t e = gc.experts();
    const int64_t r = gc.rows, d = gc.in, f = gc.out;
    const std::string tag =
        " [R=" + std::to_string(r) + " F=" + std::to_string(f) + ", tiles " + kernel + "]";
    for (DType dt : kDtypes) {
      const DType acc = acc_dtype(dt);
      const auto dy = rounded_random_values(dt, r * d, 93),
                 h = rounded_random_values(dt, r * f, 94),
                 w2 = rounded_random_values(dt, e * d * f, 95),
                 gate = rounded_random_values(dt, r * f, 96),
                 up = rounded_random_values(dt, r * f, 97),
                 dw0 = rounded_random_values(acc, e * d * f, 98),
                 row_w = rounded_random_values(acc, r, 99, 0.05, 1.0);
      DeviceTensor gdy = on_device(dt, {r, d}, dy), gh = on_device(dt, {r, f}, h),
                   gw2 = on_device(dt, {e, d, f}, w2), ggate = on_device(dt, {r, f}, gate),
                   gup = on_device(dt, {r, f}, up), goff = ids_on_device(gc.offsets),
                   grw = on_device(acc, {r}, row_w);
      DeviceTensor dgate = poisoned(dt, {r, f}), dup = poisoned(dt, {r, f}),
                   drow = poisoned(acc, {r}), dw2 = on_device(acc, {e, d, f}, dw0);
      grouped_swiglu_down_backward(gpu, dgate, dup, drow, dw2, gdy, gh, gw2, ggate, gup, grw, goff);
      DeviceTensor dh2 = poisoned(dt, {r, f}), dgate2 = poisoned(dt, {r, f}),
                   dup2 = poisoned(dt, {r, f}), drow2 = poisoned(acc, {r}),
                   dw2_2 = on_device(acc, {e, d, f}, dw0);
      grouped_linear_backward(gpu, dh2, dw2_2, gdy, gh, gw2, goff);
      const std::vector<double> dh_gpu = download(dh2);
      swiglu_weighted_backward(gpu, dgate2, dup2, drow2, dh2, ggate, gup, grw);
      INFO(dtype_name(dt) << tag);
      CHECK(bytes_of(dgate) == bytes_of(dgate2));
      CHECK(bytes_of(dup) == bytes_of(dup2));
      CHECK(bytes_of(drow) == bytes_of(drow2));
      CHECK(bytes_of(dw2) == bytes_of(dw2_2));
      // and against the CPU op
      Buf<double> hdgate({r, f}), hdup({r, f}), hdrow({r}), hdw2 = host({e, d, f}, dw0);
      Buf<double> hdy = host({r, d}, dy), hh = host({r, f}, h), hw2 = host({e, d, f}, w2),
                  hgate = host({r, f}, gate), hup = host({r, f}, up), hrw = host({r}, row_w);
      Buf<int32_t> hoff = host_i32(gc.offsets);
      cpu::grouped_swiglu_down_backward(cpu, hdgate, hdup, hdrow, hdw2, hdy, hh, hw2, hgate, hup,
                                        hrw, hoff);
      // The sum's bound, twice: dh is rounded to the dtype before the product (the CPU's is not).
      const Tol sum = sum_tol(dt, d), tol{2 * sum.rtol, 2 * sum.atol};
      check_close("grouped_swiglu_down_backward dup" + tag, dt, download(dup), hdup.v, tol);
      check_close("grouped_swiglu_down_backward dgate" + tag, dt, download(dgate), hdgate.v, tol);
      // drow_w against the CPU's weighted SwiGLU backward on the GPU's own (rounded) dh
      Buf<double> dh_host = host({r, f}, dh_gpu), cg({r, f}), cu({r, f}), crow({r});
      cpu::swiglu_weighted_backward(cpu, cg, cu, crow, dh_host, hgate, hup, hrw);
      check_row_dots("grouped_swiglu_down_backward drow_w" + tag, dt, download(drow), crow.v,
                     row_abs_dots(dh_host, hgate, hup, r, f), dt == DType::f64 ? 1e-13 : 1e-5);
    }
  }
  clear_grouped_sm90();
}

// dy's rows gathered into the sm_90 dh and dw kernels' loads (256- and 128-column tiles,
// ping-pong) and
// the op's own permute elsewhere ("0"): the bits of permute_forward and
// grouped_swiglu_down_backward, dw2 added to and overwritten.
TEST_CASE("gpu grouped_swiglu_down_backward_gathered: the permute and the backward's bits",
          "[gpu]") {
  Ctx gpu = gpu_ctx();
  const std::string kernel = GENERATE(as<std::string>{}, "256", "128", "pingpong", "multicast",
                                      "pingpong-multicast", "256-deferred", "0");
  set_grouped_sm90(kernel);
  // (in: d, the down projection's output)
  const std::vector<GroupedCase> cases = swiglu_cases(true);
  for (const GroupedCase& gc : cases) {
    const int64_t e = gc.experts();
    const int64_t r = gc.rows, d = gc.in, f = gc.out, n = r / 3 + 1;
    const std::vector<int32_t> tokens = random_row_tokens(r, n, r + 11);
    for (DType dt : kDtypes) {
      const DType acc = acc_dtype(dt);
      const auto dy = rounded_random_values(dt, n * d, 101),
                 h = rounded_random_values(dt, r * f, 102),
                 w2 = rounded_random_values(dt, e * d * f, 103),
                 gate = rounded_random_values(dt, r * f, 104),
                 up = rounded_random_values(dt, r * f, 105),
                 dw0 = rounded_random_values(acc, e * d * f, 106),
                 row_w = rounded_random_values(acc, r, 107, 0.05, 1.0);
      DeviceTensor gdy = on_device(dt, {n, d}, dy), gh = on_device(dt, {r, f}, h),
                   gw2 = on_device(dt, {e, d, f}, w2), ggate = on_device(dt, {r, f}, gate),
                   gup = on_device(dt, {r, f}, up), goff = ids_on_device(gc.offsets),
                   grw = on_device(acc, {r}, row_w), gtok = ids_on_device(tokens);
      DeviceTensor dyp = poisoned(dt, {r, d});
      permute_forward(gpu, dyp, gdy, gtok);
      for (bool overwrite : {false, true}) {
        INFO(dtype_name(dt) << " R=" << r << " tiles " << kernel << " overwrite " << overwrite);
        DeviceTensor dgate = poisoned(dt, {r, f}), dup = poisoned(dt, {r, f}),
                     drow = poisoned(acc, {r}), dw2 = on_device(acc, {e, d, f}, dw0);
        DeviceTensor dgate2 = poisoned(dt, {r, f}), dup2 = poisoned(dt, {r, f}),
                     drow2 = poisoned(acc, {r}), dw2_2 = on_device(acc, {e, d, f}, dw0);
        grouped_swiglu_down_backward_gathered(gpu, dgate, dup, drow, dw2, gdy, gtok, gh, gw2, ggate,
                                              gup, grw, goff, overwrite);
        grouped_swiglu_down_backward(gpu, dgate2, dup2, drow2, dw2_2, dyp, gh, gw2, ggate, gup, grw,
                                     goff, overwrite);
        CHECK(bytes_of(dgate) == bytes_of(dgate2));
        CHECK(bytes_of(dup) == bytes_of(dup2));
        CHECK(bytes_of(drow) == bytes_of(drow2));
        CHECK(bytes_of(dw2) == bytes_of(dw2_2));
      }
    }
  }
  clear_grouped_sm90();
}

// ---- the bf16 weight gradient (linear.hpp's bf16 form) -----------------------------------------
namespace {

// The largest |running sum| of dy_e^T x_e over each expert's rows, element by element: how large
// a chunked sum's partial results get. dy: [R, out], x: [R, in]; returns [E, out, in].
std::vector<double> running_sum_bound(const std::vector<double>& dy, const std::vector<double>& x,
                                      const std::vector<int32_t>& offsets, int64_t in,
                                      int64_t out) {
  const int64_t experts = static_cast<int64_t>(offsets.size()) - 1, per = out * in;
  std::vector<double> bound(static_cast<size_t>(experts * per), 0.0), run(per);
  for (int64_t e = 0; e < experts; ++e) {
    std::fill(run.begin(), run.end(), 0.0);
    double* b = bound.data() + e * per;
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          double& v = run[o * in + i];
          v += dy[r * out + o] * x[r * in + i];
          b[o * in + i] = std::max(b[o * in + i], std::fabs(v));
        }
  }
  return bound;
}

double round_bf16(double v) {
  return bf16_to_float(float_to_bf16(static_cast<float>(v)));
}

// The expected bf16 dw of one op run. dw0: where it started (zeros under overwrite); f32_dw: the
// same op's dw in f32 from float(dw0); want: the CPU op's f64 dw; running: running_sum_bound.
struct Bf16DwWant {
  const std::vector<double>& dw0;
  const std::vector<double>& f32_dw;
  const std::vector<double>& want;
  const std::vector<double>& running;
};

// A bf16 dw from the GPU against the f32 dw rounded once, bit for bit, in experts of at most twice
// the mean rows (the sm_90 dw kernel's chunk: never split), and against the CPU op everywhere:
// fp32 accumulation error (sum_tol) plus a bf16 rounding per chunk, ulp(bf16) (|want| + (chunks -
// 1) (|dw0| + running)), chunks at most ceil(rows_e E / 2R) (a chunk holds at least twice the mean
// rows). An expert without rows: zeros under overwrite, else dw0 bit for bit.
void check_bf16_dw(const std::string& what, const std::vector<double>& got, const Bf16DwWant& w,
                   const std::vector<int32_t>& offsets, bool overwrite) {
  const int64_t experts = static_cast<int64_t>(offsets.size()) - 1, rows = offsets.back();
  const int64_t per = static_cast<int64_t>(got.size()) / experts;
  REQUIRE(got.size() == w.want.size());
  int64_t max_rows = 1;
  for (int64_t e = 0; e < experts; ++e)
    max_rows = std::max<int64_t>(max_rows, offsets[e + 1] - offsets[e]);
  const Tol tol = sum_tol(DType::f32, max_rows);
  double worst = 0;
  int64_t inexact = 0, untouched_wrong = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    const int64_t chunks = std::max<int64_t>(1, (n * experts + 2 * rows - 1) / (2 * rows));
    for (int64_t i = e * per; i < (e + 1) * per; ++i) {
      if (n == 0) {
        untouched_wrong += got[i] != (overwrite ? 0.0 : w.dw0[i]);
        continue;
      }
      if (n * experts <= 2 * rows) inexact += got[i] != round_bf16(w.f32_dw[i]);
      const double bound =
          tol.atol + tol.rtol * std::fabs(w.want[i]) +
          ulp(DType::bf16) *
              (std::fabs(w.want[i]) + double(chunks - 1) * (std::fabs(w.dw0[i]) + w.running[i]));
      worst = std::max(worst, std::isnan(got[i]) ? 1e300 : std::fabs(got[i] - w.want[i]) / bound);
    }
  }
  INFO(what << ": worst error / bound " << worst << ", " << inexact
            << " unsplit elements not the f32 dw rounded, " << untouched_wrong
            << " wrong in experts without rows");
  CHECK(worst <= 1.0);
  CHECK(inexact == 0);
  CHECK(untouched_wrong == 0);
}

// An op that writes `count` weight gradients (the pair: from dy, then from dy3), each [E, out, in]
// over x; run(dws, overwrite).
struct DwOp {
  std::string name;
  int count;
  std::function<void(const std::vector<Tensor>&, bool)> run;
};

// Balanced routing with an empty expert (no split anywhere); one expert of 8 with 80% of the rows
// (the sm_90 dw kernel cuts it into 4 chunks of 1024 rows, the last ragged; out = 136: a dw tile
// row block of 8 rows); features the sm_90 and sm_80 kernels decline (not multiples of 8: the
// WMMA kernel into the fp32 temporary).
const GroupedCase kBf16DwCases[] = {
    {1000, 128, 192, {0, 130, 260, 260, 400, 530, 660, 800, 1000}},
    {4000, 128, 136, {0, 100, 100, 3300, 3440, 3580, 3720, 3860, 4000}},
    {300, 52, 70, {0, 130, 130, 300}},
};

}  // namespace

// Every op that takes a weight gradient, with a bf16 one (beside bf16 inputs), dw overwritten and
// added to: the f32 gradient rounded once per element (per chunk where the sm_90 kernel splits a
// hot expert, in a fixed order: the same bits run after run), against the CPU op; sm_90's native
// bf16 epilogue (256- and 128-column tiles, ping-pong) and the sm_80 / WMMA kernels' fp32
// temporary ("sm80-k32": the sm_90 kernels off).
TEST_CASE("gpu grouped backward ops with a bf16 dw: the f32 dw rounded, per chunk on sm_90",
          "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const std::string kernel =
      GENERATE(as<std::string>{}, "sm90-n256", "sm90-n128", "sm90-pingpong", "sm80-k32");
  select_grouped_kernel(kernel);
  const DType dt = DType::bf16;
  int case_index = 0;
  for (const GroupedCase& gc : kBf16DwCases) {
    const int64_t e = gc.experts(), r = gc.rows, in = gc.in, out = gc.out;
    const std::string tag = " [case " + std::to_string(case_index++) + ", " + kernel + "]";
    const auto x = rounded_random_values(dt, r * in, 110),
               w = rounded_random_values(dt, e * out * in, 111),
               w3 = rounded_random_values(dt, e * out * in, 112);
    const auto dy = rounded_random_values(dt, r * out, 113),
               dy3 = rounded_random_values(dt, r * out, 114);
    const auto gate = rounded_random_values(dt, r * in, 115),
               up = rounded_random_values(dt, r * in, 116);
    const auto row_w = rounded_random_values(DType::f32, r, 117, 0.05, 1.0);
    const auto dw0 = rounded_random_values(dt, e * out * in, 118);
    const std::vector<double> zeros(dw0.size(), 0.0);
    // The gathered ops' token tables: x's and dy's rows reversed (row i is token r - 1 - i).
    std::vector<double> xt(x.size()), dyt(dy.size());
    std::vector<int32_t> row_token(static_cast<size_t>(r));
    for (int64_t i = 0; i < r; ++i) {
      row_token[i] = static_cast<int32_t>(r - 1 - i);
      std::copy(x.begin() + i * in, x.begin() + (i + 1) * in, xt.begin() + (r - 1 - i) * in);
      std::copy(dy.begin() + i * out, dy.begin() + (i + 1) * out, dyt.begin() + (r - 1 - i) * out);
    }
    DeviceTensor gx = on_device(dt, {r, in}, x), gw = on_device(dt, {e, out, in}, w),
                 gw3 = on_device(dt, {e, out, in}, w3), gdy = on_device(dt, {r, out}, dy),
                 gdy3 = on_device(dt, {r, out}, dy3), goff = ids_on_device(gc.offsets),
                 gxt = on_device(dt, {r, in}, xt), gdyt = on_device(dt, {r, out}, dyt),
                 grt = ids_on_device(row_token), ggate = on_device(dt, {r, in}, gate),
                 gup = on_device(dt, {r, in}, up), grw = on_device(DType::f32, {r}, row_w);
    DeviceTensor gdx = poisoned(dt, {r, in}), gdx2 = poisoned(dt, {r, in}),
                 dgate = poisoned(dt, {r, in}), dup = poisoned(dt, {r, in}),
                 drow = poisoned(DType::f32, {r});
    const std::vector<DwOp> ops = {
        {"grouped_linear_backward", 1,
         [&](const std::vector<Tensor>& d, bool ow) {
           grouped_linear_backward(gpu, gdx, d[0], gdy, gx, gw, goff, ow);
         }},
        {"grouped_linear_backward_gathered", 1,
         [&](const std::vector<Tensor>& d, bool ow) {
           grouped_linear_backward_gathered(gpu, gdx, d[0], gdy, gxt, grt, gw, goff, ow);
         }},
        {"grouped_linear_backward_pair", 2,
         [&](const std::vector<Tensor>& d, bool ow) {
           grouped_linear_backward_pair(gpu, gdx, gdx2, d[0], d[1], gdy, gdy3, gx, gw, gw3, goff,
                                        ow);
         }},
        {"grouped_linear_backward_pair_gathered", 2,
         [&](const std::vector<Tensor>& d, bool ow) {
           grouped_linear_backward_pair_gathered(gpu, gdx, gdx2, d[0], d[1], gdy, gdy3, gxt, grt,
                                                 gw, gw3, goff, ow);
         }},
        {"grouped_swiglu_down_backward", 1,  // h = x, w2 = w
         [&](const std::vector<Tensor>& d, bool ow) {
           grouped_swiglu_down_backward(gpu, dgate, dup, drow, d[0], gdy, gx, gw, ggate, gup, grw,
                                        goff, ow);
         }},
        {"grouped_swiglu_down_backward_gathered", 1,
         [&](const std::vector<Tensor>& d, bool ow) {
           grouped_swiglu_down_backward_gathered(gpu, dgate, dup, drow, d[0], gdyt, grt, gx, gw,
                                                 ggate, gup, grw, goff, ow);
         }},
    };
    // The CPU's f64 gradients (from zero and onto dw0) and running sums, from dy and dy3.
    Buf<double> hx = host({r, in}, x), hw = host({e, out, in}, w);
    Buf<int32_t> hoff = host_i32(gc.offsets);
    std::vector<double> want_zero[2], want_dw0[2], running[2];
    for (int k = 0; k < 2; ++k) {
      const std::vector<double>& g = k == 0 ? dy : dy3;
      Buf<double> hdy = host({r, out}, g), hdx({r, in});
      Buf<double> from_zero({e, out, in}), onto = host({e, out, in}, dw0);
      cpu::grouped_linear_backward(cpu, hdx, from_zero, hdy, hx, hw, hoff, true);
      cpu::grouped_linear_backward(cpu, hdx, onto, hdy, hx, hw, hoff);
      want_zero[k] = from_zero.v, want_dw0[k] = onto.v;
      running[k] = running_sum_bound(g, x, gc.offsets, in, out);
    }
    for (const DwOp& op : ops)
      for (bool overwrite : {true, false}) {
        INFO(op.name << tag << " overwrite " << overwrite);
        const std::vector<double>& start = overwrite ? zeros : dw0;
        // (overwrite: over poisoned gradients)
        auto fresh = [&](DType t) {
          std::vector<DeviceTensor> d;
          for (int k = 0; k < op.count; ++k)
            d.push_back(overwrite ? poisoned(t, {e, out, in}) : on_device(t, {e, out, in}, dw0));
          return d;
        };
        auto tensors = [](const std::vector<DeviceTensor>& d) {
          return std::vector<Tensor>(d.begin(), d.end());
        };
        std::vector<DeviceTensor> f32 = fresh(DType::f32), b16 = fresh(dt), again = fresh(dt);
        op.run(tensors(f32), overwrite);
        op.run(tensors(b16), overwrite);
        op.run(tensors(again), overwrite);
        for (int k = 0; k < op.count; ++k) {
          const std::string what = op.name + " dw" + std::to_string(k) + tag;
          const std::vector<double> f32_dw = download(f32[k]);
          check_bf16_dw(what, download(b16[k]),
                        {start, f32_dw, overwrite ? want_zero[k] : want_dw0[k], running[k]},
                        gc.offsets, overwrite);
          CHECK(bytes_of(b16[k]) == bytes_of(again[k]));  // a fixed order
        }
      }
  }
  unsetenv("MOE_GROUPED_TILE_K");
  clear_grouped_sm90();
}

TEST_CASE("gpu grouped_linear: bad shapes and offsets dtype throw", "[gpu]") {
  Ctx gpu = gpu_ctx();
  DeviceTensor x(DType::f32, {10, 8}), w(DType::f32, {2, 6, 8}), y(DType::f32, {10, 6});
  DeviceTensor off_bad_len(DType::i32, {2}), off_f32(DType::f32, {3}), y_bad(DType::f32, {10, 5});
  DeviceTensor off(DType::i32, {3});
  CHECK_THROWS(grouped_linear_forward(gpu, y, x, w, off_bad_len));
  CHECK_THROWS(grouped_linear_forward(gpu, y, x, w, off_f32));
  CHECK_THROWS(grouped_linear_forward(gpu, y_bad, x, w, off));
  // A grouped dw in acc_dtype(x) or, beside bf16 x only, bf16; the plain linear's in acc_dtype.
  DeviceTensor x16(DType::bf16, {10, 8}), w16(DType::bf16, {2, 6, 8}), dy16(DType::bf16, {10, 6});
  DeviceTensor dx16(DType::bf16, {10, 8}), dw16(DType::bf16, {2, 6, 8}), dwh(DType::f16, {2, 6, 8});
  CHECK_THROWS_WITH(grouped_linear_backward(gpu, dx16, dwh, dy16, x16, w16, off),
                    Catch::Contains("grouped_linear_backward: dw: dtype f16, expected f32"));
  DeviceTensor xh(DType::f16, {10, 8}), wh(DType::f16, {2, 6, 8}), dyh(DType::f16, {10, 6});
  DeviceTensor dxh(DType::f16, {10, 8});
  CHECK_THROWS_WITH(grouped_linear_backward(gpu, dxh, dw16, dyh, xh, wh, off),
                    Catch::Contains("grouped_linear_backward: dw: dtype bf16 needs bf16 inputs"));
  DeviceTensor lw16(DType::bf16, {6, 8}), ldw16(DType::bf16, {6, 8});
  CHECK_THROWS_WITH(linear_backward(gpu, Tensor{}, ldw16, dy16, x16, lw16, false),
                    Catch::Contains("linear_backward: dw: dtype bf16, expected f32"));
}
