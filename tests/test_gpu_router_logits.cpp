// The CUDA router gate matmul (router_logits_forward / _backward, kernels/cuda/router_logits.cu)
// against the CPU op (kernels/cpu/router_logits.cpp) on the same inputs: x and dx rounded to the
// storage dtype, w, dlogits and dw to acc_dtype, all random and non-zero; the CPU computes in f64.
// Outputs of the forward are poisoned before each GPU call, so an unwritten logit fails; dx and dw
// start from non-zero values (both ops accumulate).
//
// Tolerances: |gpu - cpu| <= rtol (|cpu| + max|cpu|) with rtol = rtol_for(dtype): logits and dw
// are sums in acc_dtype of exact products (rtol_for(acc): f32 2e-5, f64 1e-11), dx is rounded
// once to x's dtype (rtol_for(x): bf16 2e-2, f16 4e-3).
//
// The kernels' summation orders depend on the shape only, so results must also be bitwise the
// same on a second run, and for the general kernels (E > 8, f32, f64) for views of every input
// one element off 16-byte alignment (the element-by-element path). The gate's shape (16-bit x,
// E <= 8, aligned rows) has kernels of its own (the tf32 tensor-core product of router_fused.cu,
// the one-pass backward of router_backward_rows.cu) with other summation orders, so there an
// unaligned view runs the general kernels and is checked against the CPU op instead; so do the
// wider bf16 gates whose backward runs on tensor cores (router_split_mma.cu: E <= 64, d a
// multiple of 128).
//
// Also the bf16 split behind the wider router matmuls (split_bf16, sum_column_blocks bitwise the
// CPU ops; linear_forward's fp32 y from bf16 operands against a double reference).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "moe/ops/bf16_split.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/router.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

const DType kFloatTypes[] = {DType::f32, DType::f16, DType::bf16, DType::f64};

// One call's host values (already rounded to their dtypes).
struct Inputs {
  DType dt, acc;
  int64_t n, d, e;
  std::vector<double> x, w, dl, dx0, dw0;
  Inputs(DType t, int64_t n_, int64_t d_, int64_t e_, uint64_t seed)
      : dt(t), acc(acc_dtype(t)), n(n_), d(d_), e(e_) {
    x = rounded_random_values(dt, size_t(n * d), seed);
    w = rounded_random_values(acc, size_t(e * d), seed + 1, -0.5, 0.5);
    dl = rounded_random_values(acc, size_t(n * e), seed + 2);
    dx0 = rounded_random_values(dt, size_t(n * d), seed + 3);
    dw0 = rounded_random_values(acc, size_t(e * d), seed + 4);
  }
};

// The GPU op's outputs as raw bytes, for bitwise comparisons.
struct Bits {
  std::vector<unsigned char> logits, dx, dw;
  bool operator==(const Bits& o) const { return logits == o.logits && dx == o.dx && dw == o.dw; }
};

// A device tensor of the given shape starting `offset` elements into a fresh buffer (offset 1
// breaks 16-byte alignment), holding v.
struct Placed {
  DeviceTensor buf;
  Tensor t;
  Placed(DType dt, std::initializer_list<int64_t> dims, const std::vector<double>& v, int offset)
      : buf(dt, {static_cast<int64_t>(v.size()) + 8}) {
    t = Tensor(static_cast<char*>(buf.t.data) + offset * dtype_size(dt), dt, gpu0(), dims);
    upload(t, v);
  }
  operator Tensor() const { return t; }
};

// Runs forward and backward on the GPU with every input `offset` elements into its buffer.
Bits run_gpu(const Inputs& in, int offset, std::vector<double>* logits = nullptr,
             std::vector<double>* dx = nullptr, std::vector<double>* dw = nullptr) {
  Ctx ctx = gpu_ctx();
  const int64_t n = in.n, d = in.d, e = in.e;
  Placed x(in.dt, {n, d}, in.x, offset), w(in.acc, {e, d}, in.w, offset);
  Placed dl(in.acc, {n, e}, in.dl, offset), gdx(in.dt, {n, d}, in.dx0, offset);
  Placed gdw(in.acc, {e, d}, in.dw0, offset);
  Placed gl(in.acc, {n, e}, std::vector<double>(size_t(n * e), 0.0), offset);
  poison(gl);
  router_logits_forward(ctx, gl, x, w);
  router_logits_backward(ctx, gdx, gdw, dl, x, w);
  if (logits) *logits = download(gl);
  if (dx) *dx = download(gdx);
  if (dw) *dw = download(gdw);
  return {bytes_of(gl), bytes_of(gdx), bytes_of(gdw)};
}

void check_case(DType dt, int64_t n, int64_t d, int64_t e, uint64_t seed, int offset = 0) {
  INFO(dtype_name(dt) << " N=" << n << " d=" << d << " E=" << e << " offset " << offset);
  const Inputs in(dt, n, d, e, seed);
  // CPU reference in f64 on the same (rounded) values.
  Ctx cctx = cpu_ctx();
  Host x({n, d}, in.x), w({e, d}, in.w), dl({n, e}, in.dl), logits({n, e});
  Host dx({n, d}, in.dx0), dw({e, d}, in.dw0);
  cpu::router_logits_forward(cctx, logits, x, w);
  cpu::router_logits_backward(cctx, dx, dw, dl, x, w);

  std::vector<double> g_logits, g_dx, g_dw;
  const Bits first = run_gpu(in, offset, &g_logits, &g_dx, &g_dw);
  expect_close(g_logits, logits.v, rtol_for(in.acc), "logits");
  expect_close(g_dx, dx.v, rtol_for(dt), "dx");
  expect_close(g_dw, dw.v, rtol_for(in.acc), "dw");
  // Deterministic: a second run gives the same bits.
  CHECK(run_gpu(in, offset) == first);
}

}  // namespace

TEST_CASE("gpu router_logits: small and odd shapes in every dtype", "[gpu][router_logits]") {
  for (DType dt : kFloatTypes) {
    check_case(dt, 1, 1024, 8, 1);      // one token
    check_case(dt, 1, 7, 1, 2);         // one token, one expert, one partial chunk
    check_case(dt, 203, 1024, 8, 3);    // N not a multiple of a block's rows
    check_case(dt, 203, 1023, 8, 4);    // d odd: element-by-element path
    check_case(dt, 130, 64, 1, 5);      // E = 1
    check_case(dt, 99, 96, 5, 6);       // E = 5: a partial tile
    check_case(dt, 77, 1024, 64, 7);    // E = 64: tiles of 16 experts
    check_case(dt, 66, 200, 17, 8);     // E = 17: a last tile of one expert
    check_case(dt, 45, 513, 300, 9);    // E = 300: dx stages the experts in pieces (16-bit x)
    check_case(dt, 300, 2500, 16, 10);  // d past the W tile: several column tiles
  }
}

TEST_CASE("gpu router_logits: many tokens (persistent blocks, many dw partials)",
          "[gpu][router_logits]") {
  for (DType dt : {DType::bf16, DType::f32}) {
    check_case(dt, 40001, 256, 8, 21);
    check_case(dt, 20001, 128, 64, 22);
  }
  check_case(DType::bf16, 16384, 1024, 8, 23);  // the model's shape
}

TEST_CASE("gpu router_logits: the gate's one-pass backward at every row-lane width",
          "[gpu][router_logits]") {
  // d / 8 chunks in row lanes of 32 (d <= 256: 8 row lanes a block), 64, 128 and 256 (d = 2048:
  // one row lane); E from 1 to 8; N giving one block (direct into dw), a few, and as many as the
  // partials' scratch holds at d = 2048 (64), with rows left over per row lane (the most blocks,
  // 132, run in "many tokens" above at d = 256); d = 2056 is past the one-pass kernel.
  for (DType dt : {DType::bf16, DType::f16}) {
    check_case(dt, 63, 256, 8, 51);     // one block: dw written directly
    check_case(dt, 1001, 512, 3, 52);   // 15 blocks, 4 row lanes of 64
    check_case(dt, 9001, 2048, 8, 53);  // 64 blocks, one row lane of 256
    check_case(dt, 777, 8, 1, 54);      // one chunk a row
    check_case(dt, 300, 2056, 7, 55);   // past 2048: the general kernels
  }
}

TEST_CASE("gpu router_logits: the wider bf16 gates' backward on tensor cores",
          "[gpu][router_logits]") {
  // router_split_mma.cu where the device has it (bf16, 16 < E <= 64 a multiple of 4, d a
  // multiple of 128): one row group written straight into dw (N <= 512), several (the partials),
  // a last tile of a few rows, E not a multiple of 16 (zero-padded experts; E = 36 leaves the
  // second half of the experts partly padded), several column slices; the model's shape
  // (moe-fine's gate: 32 row groups); the partials' cap binding (d = 4096: 8 groups of 16 tiles);
  // d = 8192, the widest the W parts' buffer holds, and 8320 past it; E = 12 below the range.
  // Elsewhere the general kernels run these.
  const std::tuple<int64_t, int64_t, int64_t> shapes[] = {
      {64, 128, 64},   {9, 1024, 64},     {130, 384, 12},   {1000, 256, 32}, {4099, 640, 20},
      {2000, 512, 36}, {16384, 1024, 64}, {8192, 4096, 64}, {600, 8192, 64}, {300, 8320, 64}};
  // The passes need sm_80 code (the build's code the device runs, gpu::code_arch); then every
  // shape here takes them but the last (d past 8192) and E = 12.
  const bool split_code = gpu::code_arch(gpu_ctx().device.index) >= 80;
  for (auto [n, d, e] : shapes) {
    const bool on = router_logits_on_tensor_cores(gpu_ctx(), DType::bf16, n, e, d);
    INFO("N=" << n << " d=" << d << " E=" << e << " tensor cores: " << on);
    CHECK(on == (split_code && d <= 8192 && e != 12));
    check_case(DType::bf16, n, d, e, 71 + uint64_t(n));
  }
}

TEST_CASE("gpu router_logits: the backward without dx updates dw alone", "[gpu][router_logits]") {
  const std::tuple<int64_t, int64_t, int64_t> shapes[] = {
      {700, 1024, 4}, {50, 96, 8}, {3000, 512, 64}, {200, 128, 16}};
  for (DType dt : {DType::bf16, DType::f32})
    for (auto [n, d, e] : shapes) {
      INFO(dtype_name(dt) << " N=" << n << " d=" << d << " E=" << e);
      const Inputs in(dt, n, d, e, 61);
      Ctx cctx = cpu_ctx();
      Host x({n, d}, in.x), w({e, d}, in.w), dl({n, e}, in.dl), dw({e, d}, in.dw0);
      cpu::router_logits_backward(cctx, Tensor(), dw, dl, x, w);
      Ctx ctx = gpu_ctx();
      DeviceTensor gx = on_device(dt, {n, d}, in.x), gw = on_device(in.acc, {e, d}, in.w);
      DeviceTensor gdl = on_device(in.acc, {n, e}, in.dl), gdw = on_device(in.acc, {e, d}, in.dw0);
      router_logits_backward(ctx, Tensor(), gdw, gdl, gx, gw);
      expect_close(download(gdw), dw.v, rtol_for(in.acc), "dw");
    }
}

TEST_CASE("gpu router_logits: results do not depend on the alignment of the views",
          "[gpu][router_logits]") {
  // Every input and output one element into its buffer (a 2-byte offset for 16-bit x): rows are
  // read element by element, and every output must be bitwise the one of aligned views. At the
  // gate's shape (16-bit x, E = 8) the aligned views run kernels of their own: the shifted ones
  // are checked against the CPU op (check_case's bounds).
  for (DType dt : kFloatTypes)
    for (int64_t e : {8, 64}) {
      INFO(dtype_name(dt) << " E=" << e);
      const Inputs in(dt, 203, 1024, e, 31);
      const bool own_kernels = ((dt == DType::bf16 || dt == DType::f16) && e <= 8) ||
                               router_logits_on_tensor_cores(gpu_ctx(), dt, 203, e, 1024);
      if (own_kernels) {
        check_case(dt, 203, 1024, e, 31, /*offset=*/1);
        continue;
      }
      const Bits aligned = run_gpu(in, 0), shifted = run_gpu(in, 1);
      CHECK(aligned.logits == shifted.logits);
      CHECK(aligned.dx == shifted.dx);
      CHECK(aligned.dw == shifted.dw);
    }
}

TEST_CASE("gpu router_logits: an empty d writes zero logits and leaves dx, dw alone",
          "[gpu][router_logits]") {
  Ctx ctx = gpu_ctx();
  DeviceTensor x(DType::bf16, {5, 0}), w(DType::f32, {3, 0}), dx(DType::bf16, {5, 0});
  DeviceTensor dw(DType::f32, {3, 0});
  DeviceTensor logits = poisoned(DType::f32, {5, 3});
  router_logits_forward(ctx, logits, x, w);
  CHECK(download(logits) == std::vector<double>(15, 0.0));
  DeviceTensor dl = on_device(DType::f32, {5, 3}, rounded_random_values(DType::f32, 15, 41));
  CHECK_NOTHROW(router_logits_backward(ctx, dx, dw, dl, x, w));
}

TEST_CASE("gpu router_logits: host tensors are rejected by name", "[gpu][router_logits]") {
  Ctx ctx = gpu_ctx();
  DeviceTensor x = on_device(DType::bf16, {4, 8}, rounded_random_values(DType::bf16, 32, 51));
  DeviceTensor logits(DType::f32, {4, 2});
  Buf<float> w_host({2, 8});
  try {
    router_logits_forward(ctx, logits, x, w_host);
    FAIL("expected an InternalError");
  } catch (const InternalError& err) {
    CHECK_THAT(std::string(err.what()),
               Catch::Contains("router_logits_forward: w is on cpu, the op runs on cuda:0"));
  }
}

// ---- the bf16 split of the wider router matmuls (moe/ops/bf16_split.hpp) ----

// split_bf16 and sum_column_blocks: bitwise the CPU ops on random fp32 values over many binades
// (the kernels do the same fp32 operations in the same order), with odd shapes and part lists.
TEST_CASE("gpu split_bf16 and sum_column_blocks are bitwise the CPU ops", "[gpu][bf16_split]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {7, 13}, {300, 64}, {1, 70001}}) {
    INFO(rows << " x " << cols);
    std::vector<double> src = rounded_random_values(DType::f32, size_t(rows * cols), rows + cols);
    for (size_t i = 0; i < src.size(); ++i) src[i] = std::ldexp(src[i], int(i % 61) - 30);
    for (const std::vector<int>& parts :
         {std::vector<int>{1, 2, 3}, std::vector<int>{1, 1, 2, 1, 2, 3}, std::vector<int>{3}}) {
      const int64_t p = static_cast<int64_t>(parts.size());
      HostAny hsrc(DType::f32, src),
          hdst(DType::bf16, std::vector<double>(size_t(rows * p * cols)));
      cpu::split_bf16(cpu, hdst.t.view({rows, p * cols}), hsrc.t.view({rows, cols}), parts);
      DeviceTensor gsrc = on_device(DType::f32, {rows, cols}, src);
      DeviceTensor gdst = poisoned(DType::bf16, {rows, p * cols});
      split_bf16(gpu, gdst, gsrc, parts);
      CHECK(bytes_of(gdst) == bytes_of(hdst.t));

      // the parts back through sum_column_blocks (as f32), in two orders, = and +=
      const std::vector<double> parts_f = hdst.values();
      const std::vector<double> y0 = rounded_random_values(DType::f32, size_t(rows * cols), 9);
      for (bool accumulate : {false, true}) {
        std::vector<int> blocks(parts.size());
        for (int j = 0; j < p; ++j) blocks[j] = accumulate ? p - 1 - j : j;
        HostAny ht(DType::f32, parts_f), hy(DType::f32, y0);
        cpu::sum_column_blocks(cpu, hy.t.view({rows, cols}), ht.t.view({rows, p * cols}), blocks,
                               accumulate);
        DeviceTensor gt = on_device(DType::f32, {rows, p * cols}, parts_f);
        DeviceTensor gy = on_device(DType::f32, {rows, cols}, y0);
        sum_column_blocks(gpu, gy, gt, blocks, accumulate);
        CHECK(bytes_of(gy) == bytes_of(hy.t));
      }
    }
  }
}

// linear_forward with 16-bit x and w and an fp32 y (the split router's product): the fp32 sums of
// exact products, against a double reference within the fp32 bound rtol_for(f32).
TEST_CASE("gpu linear_forward: bf16 x and w into an fp32 y", "[gpu][bf16_split]") {
  Ctx gpu = gpu_ctx();
  const int64_t n = 333, d = 520, e = 192;
  const std::vector<double> x = rounded_random_values(DType::bf16, size_t(n * d), 1),
                            w = rounded_random_values(DType::bf16, size_t(e * d), 2, -0.5, 0.5),
                            y0 = rounded_random_values(DType::f32, size_t(n * e), 3);
  for (bool accumulate : {false, true}) {
    std::vector<double> want(size_t(n * e)), scale(size_t(n * e));
    for (int64_t r = 0; r < n; ++r)
      for (int64_t o = 0; o < e; ++o) {
        double s = accumulate ? y0[r * e + o] : 0.0, a = std::fabs(s);
        for (int64_t k = 0; k < d; ++k) {
          s += x[r * d + k] * w[o * d + k];
          a += std::fabs(x[r * d + k] * w[o * d + k]);
        }
        want[r * e + o] = s;
        scale[r * e + o] = a;
      }
    DeviceTensor gx = on_device(DType::bf16, {n, d}, x), gw = on_device(DType::bf16, {e, d}, w);
    DeviceTensor gy = accumulate ? on_device(DType::f32, {n, e}, y0) : poisoned(DType::f32, {n, e});
    linear_forward(gpu, gy, gx, gw, accumulate);
    const std::vector<double> got = download(gy);
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i)
      worst = std::max(worst, std::fabs(got[i] - want[i]) / (scale[i] * d * 0x1p-24 + 1e-30));
    INFO("worst error in units of d u sum|terms|: " << worst);
    CHECK(worst <= 1.0);
  }
}
