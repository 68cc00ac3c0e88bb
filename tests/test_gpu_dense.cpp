// GPU tests of the dense CUDA ops (kernels/cuda/{elementwise,embedding,norm,rope,swiglu,linear}.cu)
// against the CPU reference ops. For every op and every storage dtype (f32, bf16, f16, f64) the
// inputs are seeded uniform values (never zero), rounded to the dtype (round_to: exactly what the
// GPU sees); the reference is the CPU op run in f64 on those rounded inputs; outputs are poisoned
// (NaN) before each GPU run, so an element left unwritten fails. Accumulating outputs start from
// random values instead. Statistics, tables and parameter gradients (rmsnorm rstd and dw, rope
// cos / sin, the linears' dw, embedding dtable) are in acc_dtype(dt): f32 for the 16-bit cases.
//
// Tolerances: |got - want| <= atol + rtol |want| per element, with ulp(dt) the relative spacing of
// the dtype (bf16 2^-7, f16 2^-10, f32 2^-23, f64 2^-52) and acc the error of the fp32 arithmetic
// the kernels use for 16/32-bit data (1e-6; 1e-13 for f64, whose device exp/pow/cos differ from
// glibc by an ulp or two):
// - copies and gathers (copy, fill, embedding forward): exact.
// - exactly rounded elementwise ops (add, axpy, scale): rtol = atol = 2 ulp (one rounding of the
//   result, plus fp32 intermediates for axpy).
// - pointwise nonlinear ops (SwiGLU, SiLU, RoPE rotations): rtol = 2 ulp + 4 acc, atol = 4 acc.
// - sums of K terms (RMSNorm, dw / dx / y of the linears, embedding dtable): rtol = 2 ulp +
//   acc sqrt(K), atol = 4 acc sqrt(K) (fp32 accumulation of O(1) terms, then one rounding), with
//   ulp that of the output's dtype: for 16-bit inputs rstd and every dw / dtable are fp32 outputs,
//   so their bound is the f32 one (no 16-bit rounding of the product, none of the sum).
// - sum_squares: rtol 1e-12 (squares of rounded values are exact in double; only the order of the
//   double sum differs) and bitwise repeatable.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>
#include <utility>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/embedding.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/norm.hpp"
#include "moe/ops/permute.hpp"
#include "moe/ops/rope.hpp"
#include "moe/ops/swiglu.hpp"
#include "gpu_op_checks.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

// ---- elementwise --------------------------------------------------------------------------------

TEST_CASE("gpu elementwise: fill, copy, add, axpy, scale", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const int64_t rows = 25, cols = 41;
  const int64_t n = rows * cols;
  for (DType dt : kDtypes) {
    const auto a = rounded_random_values(dt, n, 1), b = rounded_random_values(dt, n, 2);

    DeviceTensor x = poisoned(dt, {rows, cols});
    fill(gpu, x, 0.3);
    check_exact("fill", dt, download(x), round_to(dt, std::vector<double>(n, 0.3)));

    DeviceTensor src = on_device(dt, {rows, cols}, a), dst = poisoned(dt, {n});
    copy(gpu, dst, src);
    check_exact("copy", dt, download(dst), a);

    Buf<double> ha = host({n}, a), hb = host({n}, b), hout({n});
    cpu::add(cpu, hout, ha, hb);
    DeviceTensor da = on_device(dt, {n}, a), db = on_device(dt, {n}, b), out = poisoned(dt, {n});
    add(gpu, out, da, db);
    check_close("add", dt, download(out), hout.v, elementwise_tol(dt));
    add(gpu, da, da, db);  // out aliasing a
    check_close("add in place", dt, download(da), hout.v, elementwise_tol(dt));

    Buf<double> hy = host({n}, a);
    cpu::axpy(cpu, hy, hb, -0.37);
    DeviceTensor y = on_device(dt, {n}, a);
    axpy(gpu, y, db, -0.37);
    check_close("axpy", dt, download(y), hy.v, elementwise_tol(dt));

    Buf<double> hs = host({n}, b);
    cpu::scale(cpu, hs, 1.7);
    scale(gpu, db, 1.7);
    check_close("scale", dt, download(db), hs.v, elementwise_tol(dt));
  }
}

// The zero fill is a memset and the add's grid counts 16-byte chunks: a view inside a poisoned
// buffer keeps its neighbours, -0 still goes through the element loop, and an add over several
// blocks with a tail covers every element.
TEST_CASE("gpu elementwise: zero fill of a view, -0, an add over several blocks", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  for (DType dt : kDtypes) {
    const int64_t n = 3 * 256 * 8 + 7;  // three blocks of 16-byte chunks for 16-bit types, a tail
    DeviceTensor x = poisoned(dt, {n});
    const std::vector<double> before = download(x);
    fill(gpu, Tensor(x).rows(5, n - 3), 0.0);
    const std::vector<double> after = download(x);
    for (int64_t i = 0; i < n; ++i) {
      INFO(dtype_name(dt) << " element " << i);
      if (i < 5 || i >= n - 3)
        CHECK(std::memcmp(&after[i], &before[i], sizeof(double)) == 0);  // NaN poison: bits
      else
        CHECK((after[i] == 0 && !std::signbit(after[i])));
    }
    fill(gpu, x, -0.0);
    for (double v : download(x)) CHECK((v == 0 && std::signbit(v)));

    const auto a = rounded_random_values(dt, n, 3), b = rounded_random_values(dt, n, 4);
    Buf<double> ha = host({n}, a), hb = host({n}, b), hout({n});
    cpu::add(cpu, hout, ha, hb);
    DeviceTensor da = on_device(dt, {n}, a), db = on_device(dt, {n}, b), out = poisoned(dt, {n});
    add(gpu, out, da, db);
    check_close("add, several blocks", dt, download(out), hout.v, elementwise_tol(dt));
  }
}

TEST_CASE("gpu elementwise: shape and dtype mismatches throw", "[gpu]") {
  Ctx gpu = gpu_ctx();
  DeviceTensor a(DType::f32, {4, 3}), b(DType::f32, {5}), c(DType::bf16, {12});
  CHECK_THROWS(add(gpu, a, a, b));
  CHECK_THROWS(copy(gpu, a, c));
  CHECK_THROWS(axpy(gpu, a, c, 1.0));
  CHECK_THROWS(sum_squares(gpu, a, a));  // out must be f64 [1]
}

TEST_CASE("gpu sum_squares: accumulates in double, deterministically", "[gpu]") {
  Ctx gpu = gpu_ctx();
  for (DType dt : kDtypes) {
    for (int64_t n : {int64_t{1}, int64_t{77 * 40}, int64_t{300001}}) {
      const auto v = rounded_random_values(dt, static_cast<size_t>(n), 3 + n);
      long double sum = 0;  // reference in extended precision
      for (double x : v) sum += static_cast<long double>(x) * x;
      const double want = 2.5 + static_cast<double>(sum);  // 2.5: the pre-set value it adds to
      DeviceTensor x = on_device(dt, {n}, v);
      DeviceTensor out = on_device(DType::f64, {1}, {2.5});
      sum_squares(gpu, out, x);
      const double got = download(out)[0];
      INFO("sum_squares [" << dtype_name(dt) << "] n = " << n << ": got " << got << " want "
                           << want);
      CHECK(std::fabs(got - want) <= 1e-12 * want);
      upload(out, {2.5});
      sum_squares(gpu, out, x);
      CHECK(download(out)[0] == got);  // bitwise repeatable
      sum_squares(gpu, out, x);        // accumulates
      CHECK(std::fabs(download(out)[0] - (2 * want - 2.5)) <= 2e-12 * want);
    }
  }
}

// ---- embedding ----------------------------------------------------------------------------------

TEST_CASE("gpu embedding: forward gathers, backward scatters in token order", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  // A vocabulary of 50 gives each bucket one id (its token lists repeat it: added one at a time);
  // 32000 over 9000 tokens (three chunks of 4096, the last partial) gives lists of mostly distinct
  // ids (added 16 at a time) with repeats among them (one at a time, in order).
  const auto [n, vocab] =
      GENERATE(std::pair<int64_t, int64_t>{77, 50}, std::pair<int64_t, int64_t>{2500, 50},
               std::pair<int64_t, int64_t>{9000, 32000});
  std::mt19937 rng(static_cast<unsigned>(11 + n));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
  ids[5] = ids[6] = ids[40] = ids[76] = 7;  // a token repeated, adjacent and far apart
  ids[0] = 0;
  ids[1] = static_cast<int32_t>(vocab - 1);
  std::vector<int> repeats(static_cast<size_t>(vocab), 0);
  for (int32_t id : ids) ++repeats[static_cast<size_t>(id)];
  const int max_repeat = *std::max_element(repeats.begin(), repeats.end());
  for (int64_t d : {int64_t{40}, int64_t{136}}) {
    for (DType dt : kDtypes) {
      const DType acc = acc_dtype(dt);
      const auto table = rounded_random_values(dt, vocab * d, 20 + d);
      const auto dout = rounded_random_values(dt, n * d, 21 + d);
      const auto dtable0 = rounded_random_values(acc, vocab * d, 22 + d);
      Buf<int32_t> hids = host_i32(ids);
      DeviceTensor dids = ids_on_device(ids);

      Buf<double> htable = host({vocab, d}, table), hout({n, d});
      cpu::embedding_forward(cpu, hout, hids, htable);
      DeviceTensor dtab = on_device(dt, {vocab, d}, table), out = poisoned(dt, {n, d});
      embedding_forward(gpu, out, dids, dtab);
      check_exact("embedding_forward d=" + std::to_string(d), dt, download(out), hout.v);

      Buf<double> hdtable = host({vocab, d}, dtable0), hdout = host({n, d}, dout);
      cpu::embedding_backward(cpu, hdtable, hdout, hids);
      DeviceTensor ddtable = on_device(acc, {vocab, d}, dtable0),
                   ddout = on_device(dt, {n, d}, dout);
      embedding_backward(gpu, ddtable, ddout, dids);
      // Each add rounds once, into the acc dtype: up to max_repeat roundings per element.
      const Tol tol{(max_repeat + 1) * ulp(acc) + acc_eps(dt), (max_repeat + 1) * ulp(acc)};
      check_close("embedding_backward d=" + std::to_string(d), dt, download(ddtable), hdtable.v,
                  tol);
      // Bitwise repeatable.
      const auto first = bytes_of(ddtable);
      upload(ddtable, dtable0);
      embedding_backward(gpu, ddtable, ddout, dids);
      CHECK(bytes_of(ddtable) == first);
    }
  }
}

TEST_CASE("gpu embedding: an out-of-range id gives a NaN row, never a stray access", "[gpu]") {
  Ctx gpu = gpu_ctx();
  const int64_t vocab = 10, d = 8;
  const auto table = rounded_random_values(DType::f32, vocab * d, 5);
  DeviceTensor dtab = on_device(DType::f32, {vocab, d}, table), out = poisoned(DType::f32, {3, d});
  DeviceTensor dids = ids_on_device({2, static_cast<int32_t>(vocab), 4});
  embedding_forward(gpu, out, dids, dtab);
  const auto got = download(out);
  for (int64_t j = 0; j < d; ++j) {
    CHECK(got[j] == table[2 * d + j]);
    CHECK(std::isnan(got[d + j]));
    CHECK(got[2 * d + j] == table[4 * d + j]);
  }
  DeviceTensor dtable = on_device(DType::f32, {vocab, d}, table);
  embedding_backward(gpu, dtable, out.t, dids);  // row 1 skipped; rows 2 and 4 get finite adds
  for (double v : download(dtable)) CHECK(!std::isnan(v));
}

// ---- RMSNorm ------------------------------------------------------------------------------------

TEST_CASE("gpu rmsnorm: forward and backward", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const double eps = 1e-5;
  // 77 rows and 1001 (several rows per dw row group, d = 48 only to keep the test short).
  for (const auto& [n, d] : {std::pair<int64_t, int64_t>{77, 48}, {77, 1000}, {1001, 48}}) {
    for (DType dt : kDtypes) {
      const DType acc = acc_dtype(dt);
      const auto x = rounded_random_values(dt, n * d, 30 + d),
                 w = rounded_random_values(dt, d, 31 + d);
      const auto dy = rounded_random_values(dt, n * d, 32 + d),
                 dw0 = rounded_random_values(acc, d, 33 + d);
      const std::string tag = " n=" + std::to_string(n) + " d=" + std::to_string(d);

      Buf<double> hx = host({n, d}, x), hw = host({d}, w), hy({n, d}), hr({n});
      cpu::rmsnorm_forward(cpu, hy, hr, hx, hw, eps);
      DeviceTensor dx_in = on_device(dt, {n, d}, x), dw_in = on_device(dt, {d}, w);
      DeviceTensor y = poisoned(dt, {n, d}), rstd = poisoned(acc, {n});
      rmsnorm_forward(gpu, y, rstd, dx_in, dw_in, eps);
      check_close("rmsnorm_forward y" + tag, dt, download(y), hy.v, sum_tol(dt, d));
      check_close("rmsnorm_forward rstd" + tag, acc, download(rstd), hr.v, sum_tol(acc, d));

      // Backward from the rstd the forward saves (the reference rounded to the acc dtype).
      const auto r = round_to(acc, hr.v);
      Buf<double> hdy = host({n, d}, dy), hrr = host({n}, r), hdx({n, d}), hdw = host({d}, dw0);
      cpu::rmsnorm_backward(cpu, hdx, hdw, hdy, hx, hw, hrr);
      DeviceTensor ddy = on_device(dt, {n, d}, dy), drr = on_device(acc, {n}, r);
      DeviceTensor ddx = poisoned(dt, {n, d}), ddw = on_device(acc, {d}, dw0);
      rmsnorm_backward(gpu, ddx, ddw, ddy, dx_in, dw_in, drr);
      check_close("rmsnorm_backward dx" + tag, dt, download(ddx), hdx.v, sum_tol(dt, d));
      check_close("rmsnorm_backward dw" + tag, acc, download(ddw), hdw.v, sum_tol(acc, n));
    }
  }
}

// The residual adds fused into RMSNorm (the pre-norm block's h = x + attn_y before norm2, and the
// backward's dh = dout + norm2'(.), dx = dh + norm1'(.)), at d a multiple of 8 or not, below one
// warp, and over the 256-thread row block.
// - add_rmsnorm_forward: bitwise add + rmsnorm_forward on the GPU (h, y and rstd); h against the
//   exactly rounded x + r, y and rstd against the CPU norm of the GPU's h; h over x (in place).
// - rmsnorm_backward_add: against the CPU op in f64 (one rounding of residual + gradient, so the
//   sum bound holds even where the two cancel); dw bitwise that of rmsnorm_backward; against the
//   GPU composition rmsnorm_backward + add within 2 ulp(dt) of |residual| + |gradient| (the
//   composition rounds the gradient to dt first); dx over the residual or over dy (in place),
//   bitwise the out-of-place result.
TEST_CASE("gpu rmsnorm with the residual add fused: forward and backward", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const int64_t n = 77;
  const double eps = 1e-5;
  for (int64_t d : {int64_t{5}, int64_t{48}, int64_t{1000}, int64_t{1003}}) {
    for (DType dt : kDtypes) {
      const DType acc = acc_dtype(dt);
      const auto x = rounded_random_values(dt, n * d, 130 + d),
                 r = rounded_random_values(dt, n * d, 131 + d),
                 w = rounded_random_values(dt, d, 132 + d);
      const std::string tag = " d=" + std::to_string(d);
      DeviceTensor gx = on_device(dt, {n, d}, x), gr = on_device(dt, {n, d}, r),
                   gw = on_device(dt, {d}, w);

      // forward
      DeviceTensor h = poisoned(dt, {n, d}), y = poisoned(dt, {n, d}), rstd = poisoned(acc, {n});
      add_rmsnorm_forward(gpu, h, y, rstd, gx, gr, gw, eps);
      DeviceTensor h_ref = poisoned(dt, {n, d}), y_ref = poisoned(dt, {n, d}),
                   rstd_ref = poisoned(acc, {n});
      add(gpu, h_ref, gx, gr);
      rmsnorm_forward(gpu, y_ref, rstd_ref, h_ref, gw, eps);
      {
        INFO("add_rmsnorm_forward is bitwise add + rmsnorm_forward" << tag << " [" << dtype_name(dt)
                                                                    << "]");
        CHECK(bytes_of(h) == bytes_of(h_ref));
        CHECK(bytes_of(y) == bytes_of(y_ref));
        CHECK(bytes_of(rstd) == bytes_of(rstd_ref));
      }
      std::vector<double> sum(x.size());
      for (size_t i = 0; i < x.size(); ++i) sum[i] = x[i] + r[i];
      const auto hv = download(h);
      check_close("add_rmsnorm_forward h" + tag, dt, hv, round_to(dt, sum), elementwise_tol(dt));
      Buf<double> hh = host({n, d}, hv), hw = host({d}, w), hy({n, d}), hr({n});
      cpu::rmsnorm_forward(cpu, hy, hr, hh, hw, eps);
      check_close("add_rmsnorm_forward y" + tag, dt, download(y), hy.v, sum_tol(dt, d));
      check_close("add_rmsnorm_forward rstd" + tag, acc, download(rstd), hr.v, sum_tol(acc, d));
      DeviceTensor x_in_place = on_device(dt, {n, d}, x), y2 = poisoned(dt, {n, d}),
                   rstd2 = poisoned(acc, {n});
      add_rmsnorm_forward(gpu, x_in_place, y2, rstd2, x_in_place, gr, gw, eps);
      {
        INFO("add_rmsnorm_forward with h over x" << tag << " [" << dtype_name(dt) << "]");
        CHECK(bytes_of(x_in_place) == bytes_of(h));
        CHECK(bytes_of(y2) == bytes_of(y));
      }

      // backward, at the h and rstd the forward saved
      const auto dy = rounded_random_values(dt, n * d, 133 + d),
                 res = rounded_random_values(dt, n * d, 134 + d),
                 dw0 = rounded_random_values(acc, d, 135 + d);
      const auto rv = download(rstd);
      Buf<double> hdy = host({n, d}, dy), hres = host({n, d}, res), hrr = host({n}, rv),
                  hdx({n, d}), hdw = host({d}, dw0);
      cpu::rmsnorm_backward_add(cpu, hdx, hdw, hdy, hh, hw, hrr, hres);
      DeviceTensor gdy = on_device(dt, {n, d}, dy), gres = on_device(dt, {n, d}, res);
      DeviceTensor gdx = poisoned(dt, {n, d}), gdw = on_device(acc, {d}, dw0);
      rmsnorm_backward_add(gpu, gdx, gdw, gdy, h, gw, rstd, gres);
      const auto dxv = download(gdx);
      check_close("rmsnorm_backward_add dx" + tag, dt, dxv, hdx.v, sum_tol(dt, d));
      check_close("rmsnorm_backward_add dw" + tag, acc, download(gdw), hdw.v, sum_tol(acc, n));

      // the unfused composition: same dw bits, dx within its extra rounding
      DeviceTensor g = poisoned(dt, {n, d}), dx_old = poisoned(dt, {n, d}),
                   dw_old = on_device(acc, {d}, dw0);
      rmsnorm_backward(gpu, g, dw_old, gdy, h, gw, rstd);
      add(gpu, dx_old, gres, g);
      const auto gv = download(g), oldv = download(dx_old);
      double worst = 0;
      for (size_t i = 0; i < dxv.size(); ++i) {
        const double bound = 2 * ulp(dt) * (std::fabs(res[i]) + std::fabs(gv[i])) +
                             4 * acc_eps(dt) * std::sqrt(static_cast<double>(d));
        worst = std::max(worst, std::isnan(dxv[i]) ? 1e300 : std::fabs(dxv[i] - oldv[i]) / bound);
      }
      {
        INFO("rmsnorm_backward_add vs rmsnorm_backward + add"
             << tag << " [" << dtype_name(dt) << "]: worst error / bound = " << worst);
        CHECK(worst <= 1.0);
        CHECK(bytes_of(gdw) == bytes_of(dw_old));
      }

      // in place: dx over the residual, and over dy
      DeviceTensor res_in_place = on_device(dt, {n, d}, res), dw_a = on_device(acc, {d}, dw0);
      rmsnorm_backward_add(gpu, res_in_place, dw_a, gdy, h, gw, rstd, res_in_place);
      DeviceTensor dy_in_place = on_device(dt, {n, d}, dy), dw_b = on_device(acc, {d}, dw0);
      rmsnorm_backward_add(gpu, dy_in_place, dw_b, dy_in_place, h, gw, rstd, gres);
      {
        INFO("rmsnorm_backward_add in place" << tag << " [" << dtype_name(dt) << "]");
        CHECK(bytes_of(res_in_place) == bytes_of(gdx));
        CHECK(bytes_of(dw_a) == bytes_of(gdw));
        CHECK(bytes_of(dy_in_place) == bytes_of(gdx));
        CHECK(bytes_of(dw_b) == bytes_of(gdw));
      }
    }
  }
}

// The row kernels load 16 bytes at a time where d is a multiple of 16 bytes' worth of elements
// (8 for 16-bit, 4 for f32, 2 for f64) and every pointer is 16-byte aligned, element by element
// otherwise, in the same order: the same values one element off alignment must give the same
// bits, fused and plain, forward and backward. Rows of one warp (d = 48), two (1000), 16 (4104,
// 16-bit) and past the row kernels (8200: the wide kernels); dw in one block (n = 5) or
// from many blocks' partials (1001). Checked against the CPU op as above.
TEST_CASE("gpu rmsnorm: aligned and misaligned rows agree bitwise", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const double eps = 1e-5;
  for (const auto& [n, d] :
       {std::pair<int64_t, int64_t>{5, 48}, {1001, 1000}, {33, 4104}, {9, 8200}}) {
    for (DType dt : kDtypes) {
      const DType acc = acc_dtype(dt);
      const auto x = rounded_random_values(dt, n * d, 230 + d),
                 r = rounded_random_values(dt, n * d, 231 + d),
                 w = rounded_random_values(dt, d, 232 + d),
                 dy = rounded_random_values(dt, n * d, 233 + d),
                 dw0 = rounded_random_values(acc, d, 234 + d);
      const std::string tag = " n=" + std::to_string(n) + " d=" + std::to_string(d);
      std::vector<std::vector<unsigned char>> aligned;
      for (int shift = 0; shift < 2; ++shift) {
        // Each tensor `shift` elements past the start of its own (poisoned) allocation.
        std::vector<DeviceTensor> keep;
        keep.reserve(16);
        auto tensor = [&](DType t, std::initializer_list<int64_t> dims) {
          int64_t count = 1;
          for (int64_t s : dims) count *= s;
          DeviceTensor& b = keep.emplace_back(t, std::initializer_list<int64_t>{count + shift});
          poison(b);
          return Tensor(static_cast<char*>(b.t.data) + shift * dtype_size(t), t, gpu0(), dims);
        };
        Tensor gx = tensor(dt, {n, d}), gr = tensor(dt, {n, d}), gw = tensor(dt, {d}),
               gdy = tensor(dt, {n, d}), h = tensor(dt, {n, d}), y = tensor(dt, {n, d}),
               rstd = tensor(acc, {n}), y2 = tensor(dt, {n, d}), rstd2 = tensor(acc, {n}),
               dx = tensor(dt, {n, d}), dw = tensor(acc, {d}), dx2 = tensor(dt, {n, d}),
               dw2 = tensor(acc, {d});
        for (auto [t, v] : {std::pair<Tensor, const std::vector<double>*>{gx, &x},
                            {gr, &r},
                            {gw, &w},
                            {gdy, &dy},
                            {dw, &dw0},
                            {dw2, &dw0}})
          upload(t, *v);
        add_rmsnorm_forward(gpu, h, y, rstd, gx, gr, gw, eps);
        rmsnorm_forward(gpu, y2, rstd2, h, gw, eps);
        rmsnorm_backward_add(gpu, dx, dw, gdy, h, gw, rstd, gr);
        rmsnorm_backward(gpu, dx2, dw2, gdy, h, gw, rstd);
        const std::vector<std::vector<unsigned char>> got = {
            bytes_of(h),  bytes_of(y),  bytes_of(rstd), bytes_of(y2),
            bytes_of(dx), bytes_of(dw), bytes_of(dx2),  bytes_of(dw2)};
        INFO("rmsnorm" << tag << " [" << dtype_name(dt) << "], shift " << shift);
        CHECK(got[1] == got[3]);  // add_rmsnorm_forward is bitwise rmsnorm_forward of its h
        CHECK(got[2] == bytes_of(rstd2));
        CHECK(got[5] == got[7]);  // the same dw with and without the residual
        if (shift == 1) {
          for (size_t k = 0; k < got.size(); ++k) {
            INFO("output " << k << " (h, y, rstd, y2, dx, dw, dx2, dw2)");
            CHECK(got[k] == aligned[k]);
          }
          continue;
        }
        aligned = got;
        const auto hv = download(h), rv = download(rstd);
        Buf<double> hh = host({n, d}, hv), hw = host({d}, w), hy({n, d}), hr({n});
        cpu::rmsnorm_forward(cpu, hy, hr, hh, hw, eps);
        check_close("rmsnorm_forward y" + tag, dt, download(y), hy.v, sum_tol(dt, d));
        check_close("rmsnorm_forward rstd" + tag, acc, rv, hr.v, sum_tol(acc, d));
        Buf<double> hdy = host({n, d}, dy), hres = host({n, d}, r), hrr = host({n}, rv),
                    hdx({n, d}), hdw = host({d}, dw0), hdx2({n, d}), hdw2 = host({d}, dw0);
        cpu::rmsnorm_backward_add(cpu, hdx, hdw, hdy, hh, hw, hrr, hres);
        cpu::rmsnorm_backward(cpu, hdx2, hdw2, hdy, hh, hw, hrr);
        check_close("rmsnorm_backward_add dx" + tag, dt, download(dx), hdx.v, sum_tol(dt, d));
        check_close("rmsnorm_backward_add dw" + tag, acc, download(dw), hdw.v, sum_tol(acc, n));
        check_close("rmsnorm_backward dx" + tag, dt, download(dx2), hdx2.v, sum_tol(dt, d));
      }
    }
  }
}

// ---- RoPE ---------------------------------------------------------------------------------------

TEST_CASE("gpu rope: table, forward and backward at non-contiguous positions", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const int64_t max_pos = 40, heads = 3, hd = 16, half = hd / 2;
  const std::vector<int32_t> pos = {5, 0, 39, 17, 17, 3, 22, 38, 1, 30, 12, 9, 26};
  const int64_t n = static_cast<int64_t>(pos.size());
  const double theta = 10000.0;
  Buf<double> hcos({max_pos, half}), hsin({max_pos, half});
  cpu::rope_table(cpu, hcos, hsin, theta);
  // The table: f32 or f64 only (the rotations read it in acc_dtype(x)); angles in double on both
  // sides, rounded once to the dtype.
  for (DType dt : {DType::f32, DType::f64}) {
    DeviceTensor gcos = poisoned(dt, {max_pos, half}), gsin = poisoned(dt, {max_pos, half});
    rope_table(gpu, gcos, gsin, theta);
    const Tol tab_tol{dt == DType::f64 ? 1e-13 : ulp(dt), dt == DType::f64 ? 1e-13 : 1e-9};
    check_close("rope_table cos", dt, download(gcos), round_to(dt, hcos.v), tab_tol);
    check_close("rope_table sin", dt, download(gsin), round_to(dt, hsin.v), tab_tol);
  }
  {
    DeviceTensor c16(DType::bf16, {max_pos, half}), s16(DType::bf16, {max_pos, half});
    CHECK_THROWS_WITH(rope_table(gpu, c16, s16, theta),
                      Catch::Contains("rope_table: the table must be f32 or f64"));
  }
  for (DType dt : kDtypes) {
    // Rotations use the table rounded to acc_dtype(dt) on both sides.
    const DType acc = acc_dtype(dt);
    const auto c = round_to(acc, hcos.v), s = round_to(acc, hsin.v);
    const auto x = rounded_random_values(dt, n * heads * hd, 40);
    Buf<double> hc = host({max_pos, half}, c), hs = host({max_pos, half}, s);
    Buf<int32_t> hpos = host_i32(pos);
    DeviceTensor dc = on_device(acc, {max_pos, half}, c), ds = on_device(acc, {max_pos, half}, s);
    DeviceTensor dpos = ids_on_device(pos);

    Buf<double> hf = host({n, heads, hd}, x);
    cpu::rope_forward(cpu, hf, hpos, hc, hs);
    DeviceTensor v = on_device(dt, {n, heads, hd}, x);
    rope_forward(gpu, v, dpos, dc, ds);
    const auto rotated = download(v);
    check_close("rope_forward", dt, rotated, hf.v, pointwise_tol(dt));

    Buf<double> hb = host({n, heads, hd}, x);
    cpu::rope_backward(cpu, hb, hpos, hc, hs);
    DeviceTensor g = on_device(dt, {n, heads, hd}, x);
    rope_backward(gpu, g, dpos, dc, ds);
    check_close("rope_backward", dt, download(g), hb.v, pointwise_tol(dt));

    // backward(forward(x)) == x up to the table's and the two outputs' rounding.
    rope_backward(gpu, v, dpos, dc, ds);
    const double rt = 8 * ulp(dt) + 4 * acc_eps(dt);
    check_close("rope round trip", dt, download(v), x, Tol{rt, rt});
  }
}

// The rotations read and write 16 bytes at a time (pairs j .. j+kVec-1) where head_dim/2 is a
// multiple of 16 bytes' worth of elements and x, cos and sin are 16-byte aligned, one pair at a
// time otherwise, with the same roundings: hd 64 takes the vector path for every dtype, 12 and 20
// (half 6, 10) only for f64, and x or the table one element off alignment the scalar one. All
// must match the CPU op and give the same bits; a position outside the table turns its row to NaN
// on either path and leaves the other rows alone.
TEST_CASE("gpu rope: vector and scalar paths agree bitwise", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const int64_t max_pos = 50, heads = 3;
  const std::vector<int32_t> pos = {7, 0, 49, 21, 21, 3, 33, 48, 1, 12, 40};
  const int64_t n = static_cast<int64_t>(pos.size());
  std::vector<int32_t> bad_pos = pos;
  bad_pos[2] = static_cast<int32_t>(max_pos);
  bad_pos[7] = -1;
  DeviceTensor dpos = ids_on_device(pos), dbad = ids_on_device(bad_pos);
  Buf<int32_t> hpos = host_i32(pos);
  for (int64_t hd : {int64_t{64}, int64_t{12}, int64_t{20}}) {
    const int64_t half = hd / 2, width = heads * hd;
    Buf<double> hcos({max_pos, half}), hsin({max_pos, half});
    cpu::rope_table(cpu, hcos, hsin, 10000.0);
    for (DType dt : kDtypes) {
      const DType acc = acc_dtype(dt);
      const auto c = round_to(acc, hcos.v), s = round_to(acc, hsin.v);
      const auto x = rounded_random_values(dt, n * width, 300 + hd);
      Buf<double> hc = host({max_pos, half}, c), hs = host({max_pos, half}, s);
      Buf<double> hf = host({n, heads, hd}, x), hb = host({n, heads, hd}, x);
      cpu::rope_forward(cpu, hf, hpos, hc, hs);
      cpu::rope_backward(cpu, hb, hpos, hc, hs);
      std::vector<std::vector<unsigned char>> aligned;  // forward, backward, bad positions
      for (const auto& [xs, ts] : {std::pair<int, int>{0, 0}, {1, 0}, {0, 1}}) {
        // Each tensor `shift` elements past the start of its own (poisoned) allocation.
        std::vector<DeviceTensor> keep;
        keep.reserve(8);
        auto tensor = [&](DType t, std::initializer_list<int64_t> dims, int shift,
                          const std::vector<double>& values) {
          int64_t count = 1;
          for (int64_t d : dims) count *= d;
          DeviceTensor& buf = keep.emplace_back(t, std::initializer_list<int64_t>{count + shift});
          poison(buf);
          Tensor view(static_cast<char*>(buf.t.data) + shift * dtype_size(t), t, gpu0(), dims);
          upload(view, values);
          return view;
        };
        Tensor dc = tensor(acc, {max_pos, half}, ts, c), ds = tensor(acc, {max_pos, half}, ts, s);
        Tensor f = tensor(dt, {n, heads, hd}, xs, x), g = tensor(dt, {n, heads, hd}, xs, x),
               fbad = tensor(dt, {n, heads, hd}, xs, x);
        rope_forward(gpu, f, dpos, dc, ds);
        rope_backward(gpu, g, dpos, dc, ds);
        rope_forward(gpu, fbad, dbad, dc, ds);
        const std::string tag = " hd=" + std::to_string(hd) + " x shift " + std::to_string(xs) +
                                " table shift " + std::to_string(ts);
        const auto fv = download(f), badv = download(fbad);
        check_close("rope_forward" + tag, dt, fv, hf.v, pointwise_tol(dt));
        check_close("rope_backward" + tag, dt, download(g), hb.v, pointwise_tol(dt));
        for (int64_t i = 0; i < n; ++i) {
          bool ok = true;  // NaN rows where the position is bad, the good run's values elsewhere
          for (int64_t k = i * width; k < (i + 1) * width; ++k)
            ok = ok && (bad_pos[i] == pos[i] ? badv[k] == fv[k] : std::isnan(badv[k]));
          INFO("rope_forward" << tag << " [" << dtype_name(dt) << "], row " << i << " at position "
                              << bad_pos[i]);
          CHECK(ok);
        }
        const std::vector<std::vector<unsigned char>> got = {bytes_of(f), bytes_of(g),
                                                             bytes_of(fbad)};
        if (aligned.empty()) {
          aligned = got;
          continue;
        }
        for (size_t k = 0; k < got.size(); ++k) {
          INFO("rope" << tag << " [" << dtype_name(dt) << "]: output " << k
                      << " (forward, backward, forward at bad positions) vs the aligned run");
          CHECK(got[k] == aligned[k]);
        }
      }
    }
  }
}

// ---- SwiGLU / SiLU ------------------------------------------------------------------------------

TEST_CASE("gpu swiglu and silu: forward and backward", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const int64_t r = 77, f = 40, n = r * f;
  for (DType dt : kDtypes) {
    const auto gate = rounded_random_values(dt, n, 50, -6.0, 6.0),
               up = rounded_random_values(dt, n, 51);
    const auto dh = rounded_random_values(dt, n, 52);
    Buf<double> hg = host({r, f}, gate), hu = host({r, f}, up), hdh = host({r, f}, dh);
    DeviceTensor dg = on_device(dt, {r, f}, gate), du = on_device(dt, {r, f}, up);
    DeviceTensor ddh = on_device(dt, {r, f}, dh);

    Buf<double> hh({r, f});
    cpu::swiglu_forward(cpu, hh, hg, hu);
    DeviceTensor h = poisoned(dt, {r, f});
    swiglu_forward(gpu, h, dg, du);
    check_close("swiglu_forward", dt, download(h), hh.v, pointwise_tol(dt));

    Buf<double> hdg({r, f}), hdu({r, f});
    cpu::swiglu_backward(cpu, hdg, hdu, hdh, hg, hu);
    DeviceTensor dgate = poisoned(dt, {r, f}), dup = poisoned(dt, {r, f});
    swiglu_backward(gpu, dgate, dup, ddh, dg, du);
    check_close("swiglu_backward dgate", dt, download(dgate), hdg.v, pointwise_tol(dt));
    check_close("swiglu_backward dup", dt, download(dup), hdu.v, pointwise_tol(dt));

    Buf<double> hy({r, f});
    cpu::silu_forward(cpu, hy, hg);
    DeviceTensor y = poisoned(dt, {r, f});
    silu_forward(gpu, y, dg);
    check_close("silu_forward", dt, download(y), hy.v, pointwise_tol(dt));

    Buf<double> hdx({r, f});
    cpu::silu_backward(cpu, hdx, hdh, hg);
    DeviceTensor dx = poisoned(dt, {r, f});
    silu_backward(gpu, dx, ddh, dg);
    check_close("silu_backward", dt, download(dx), hdx.v, pointwise_tol(dt));

    // dgate written over dh (outputs may alias inputs elementwise).
    swiglu_backward(gpu, ddh, dup, ddh, dg, du);
    check_close("swiglu_backward dgate over dh", dt, download(ddh), hdg.v, pointwise_tol(dt));
  }
}

// The plain SwiGLU / SiLU and add kernels take 16-byte accesses only when every pointer is
// 16-byte aligned: views one element into their buffers take the scalar path (the model's
// tensors are aligned, so only this reaches it), which must give the CPU op's values too.
TEST_CASE("gpu swiglu, silu and add on views one element in: the scalar path", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const int64_t n = 77 * 40;
  // A view of n elements from element 1 of an (n + 1)-element buffer holding `values` there.
  auto shifted = [](DType dt, const std::vector<double>& values) {
    std::vector<double> padded(1, 0.5);
    padded.insert(padded.end(), values.begin(), values.end());
    return on_device(dt, {n + 1}, padded);
  };
  auto view = [](const DeviceTensor& d) { return Tensor(d).rows(1, n + 1); };
  for (DType dt : kDtypes) {
    const auto gate = rounded_random_values(dt, n, 53, -6.0, 6.0),
               up = rounded_random_values(dt, n, 54), dh = rounded_random_values(dt, n, 55);
    Buf<double> hg = host({n}, gate), hu = host({n}, up), hdh = host({n}, dh);
    const DeviceTensor dg = shifted(dt, gate), du = shifted(dt, up), ddh = shifted(dt, dh);

    Buf<double> hh({n}), hdg({n}), hdu({n}), hy({n}), hdx({n}), hsum({n});
    cpu::swiglu_forward(cpu, hh, hg, hu);
    cpu::swiglu_backward(cpu, hdg, hdu, hdh, hg, hu);
    cpu::silu_forward(cpu, hy, hg);
    cpu::silu_backward(cpu, hdx, hdh, hg);
    cpu::add(cpu, hsum, hg, hu);

    const DeviceTensor h = poisoned(dt, {n + 1}), dgate = poisoned(dt, {n + 1}),
                       dup = poisoned(dt, {n + 1}), y = poisoned(dt, {n + 1}),
                       dx = poisoned(dt, {n + 1}), sum = poisoned(dt, {n + 1});
    swiglu_forward(gpu, view(h), view(dg), view(du));
    swiglu_backward(gpu, view(dgate), view(dup), view(ddh), view(dg), view(du));
    silu_forward(gpu, view(y), view(dg));
    silu_backward(gpu, view(dx), view(ddh), view(dg));
    add(gpu, view(sum), view(dg), view(du));
    // (element 0 of each output buffer stays poisoned: nothing writes before the view)
    auto tail = [](const DeviceTensor& d) {
      const std::vector<double> all = download(d);
      CHECK(std::isnan(all[0]));
      return std::vector<double>(all.begin() + 1, all.end());
    };
    check_close("swiglu_forward (scalar path)", dt, tail(h), hh.v, pointwise_tol(dt));
    check_close("swiglu_backward dgate (scalar path)", dt, tail(dgate), hdg.v, pointwise_tol(dt));
    check_close("swiglu_backward dup (scalar path)", dt, tail(dup), hdu.v, pointwise_tol(dt));
    check_close("silu_forward (scalar path)", dt, tail(y), hy.v, pointwise_tol(dt));
    check_close("silu_backward (scalar path)", dt, tail(dx), hdx.v, pointwise_tol(dt));
    check_close("add (scalar path)", dt, tail(sum), hsum.v, elementwise_tol(dt));
  }
}

TEST_CASE("gpu swiglu_weighted: forward and backward against the CPU, in place", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const int64_t r = 77;
  // F = 40: the 16-byte path for 16-bit types; F = 37: rows not 16-byte aligned, scalar path.
  for (int64_t f : {int64_t{40}, int64_t{37}}) {
    const int64_t n = r * f;
    for (DType dt : kDtypes) {
      const DType acc = acc_dtype(dt);
      INFO("F = " << f);
      const auto gate = rounded_random_values(dt, n, 60, -6.0, 6.0),
                 up = rounded_random_values(dt, n, 61), dh = rounded_random_values(dt, n, 62);
      const auto w = rounded_random_values(acc, r, 63, 0.05, 1.0);
      Buf<double> hg = host({r, f}, gate), hu = host({r, f}, up), hdh = host({r, f}, dh),
                  hw = host({r}, w);
      DeviceTensor dg = on_device(dt, {r, f}, gate), du = on_device(dt, {r, f}, up),
                   ddh = on_device(dt, {r, f}, dh), dw = on_device(acc, {r}, w);

      Buf<double> hh({r, f});
      cpu::swiglu_weighted_forward(cpu, hh, hg, hu, hw);
      DeviceTensor h = poisoned(dt, {r, f});
      swiglu_weighted_forward(gpu, h, dg, du, dw);
      check_close("swiglu_weighted_forward", dt, download(h), hh.v, pointwise_tol(dt));

      Buf<double> hdg({r, f}), hdu({r, f}), hdw({r});
      cpu::swiglu_weighted_backward(cpu, hdg, hdu, hdw, hdh, hg, hu, hw);
      DeviceTensor dgate = poisoned(dt, {r, f}), dup = poisoned(dt, {r, f}),
                   drow = poisoned(acc, {r});
      swiglu_weighted_backward(gpu, dgate, dup, drow, ddh, dg, du, dw);
      check_close("swiglu_weighted_backward dgate", dt, download(dgate), hdg.v, pointwise_tol(dt));
      check_close("swiglu_weighted_backward dup", dt, download(dup), hdu.v, pointwise_tol(dt));
      const double rel = dt == DType::f64 ? 1e-13 : 1e-5;
      check_row_dots("swiglu_weighted_backward drow_w", dt, download(drow), hdw.v,
                     row_abs_dots(hdh, hg, hu, r, f), rel);
      // the same bits on a second run, and with dgate written over dh
      const auto first = bytes_of(drow), first_dgate = bytes_of(dgate);
      swiglu_weighted_backward(gpu, ddh, dup, drow, ddh, dg, du, dw);
      CHECK(bytes_of(drow) == first);
      CHECK(bytes_of(ddh) == first_dgate);
    }
  }
}

// ---- linear -------------------------------------------------------------------------------------

namespace {
struct LinearShape {
  int64_t n, in, out;
};
const LinearShape kLinearShapes[] = {{77, 48, 40}, {150, 80, 136}};
}  // namespace

TEST_CASE("gpu linear: forward, overwrite and accumulate", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  for (const LinearShape& sh : kLinearShapes) {
    const std::string tag = " [" + std::to_string(sh.n) + "x" + std::to_string(sh.in) + "->" +
                            std::to_string(sh.out) + "]";
    for (DType dt : kDtypes) {
      const auto x = rounded_random_values(dt, sh.n * sh.in, 60),
                 w = rounded_random_values(dt, sh.out * sh.in, 61);
      const auto y0 = rounded_random_values(dt, sh.n * sh.out, 62);
      Buf<double> hx = host({sh.n, sh.in}, x), hw = host({sh.out, sh.in}, w);
      DeviceTensor dx = on_device(dt, {sh.n, sh.in}, x), dw = on_device(dt, {sh.out, sh.in}, w);
      for (bool accumulate : {false, true}) {
        Buf<double> hy = host({sh.n, sh.out}, y0);
        cpu::linear_forward(cpu, hy, hx, hw, accumulate);
        DeviceTensor y =
            accumulate ? on_device(dt, {sh.n, sh.out}, y0) : poisoned(dt, {sh.n, sh.out});
        linear_forward(gpu, y, dx, dw, accumulate);
        if (accumulate)
          check_close_accumulated("linear_forward +=" + tag, dt, download(y), hy.v, y0,
                                  sum_tol(dt, sh.in));
        else
          check_close("linear_forward =" + tag, dt, download(y), hy.v, sum_tol(dt, sh.in));
      }
    }
  }
}

TEST_CASE("gpu linear: backward dx (=, +=, skipped) and dw +=", "[gpu]") {
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  for (const LinearShape& sh : kLinearShapes) {
    const std::string tag = " [" + std::to_string(sh.n) + "x" + std::to_string(sh.in) + "->" +
                            std::to_string(sh.out) + "]";
    for (DType dt : kDtypes) {
      const DType acc_dt = acc_dtype(dt);
      const auto x = rounded_random_values(dt, sh.n * sh.in, 70),
                 w = rounded_random_values(dt, sh.out * sh.in, 71);
      const auto dy = rounded_random_values(dt, sh.n * sh.out, 72);
      const auto dx0 = rounded_random_values(dt, sh.n * sh.in, 73);
      const auto dw0 = rounded_random_values(acc_dt, sh.out * sh.in, 74);
      Buf<double> hx = host({sh.n, sh.in}, x), hw = host({sh.out, sh.in}, w);
      Buf<double> hdy = host({sh.n, sh.out}, dy);
      DeviceTensor gx = on_device(dt, {sh.n, sh.in}, x), gw = on_device(dt, {sh.out, sh.in}, w);
      DeviceTensor gdy = on_device(dt, {sh.n, sh.out}, dy);
      for (int mode = 0; mode < 3; ++mode) {  // dx =, dx +=, no dx
        const bool acc = mode == 1, skip = mode == 2;
        Buf<double> hdx = host({sh.n, sh.in}, dx0), hdw = host({sh.out, sh.in}, dw0);
        cpu::linear_backward(cpu, skip ? Tensor{} : hdx.t, hdw, hdy, hx, hw, acc);
        DeviceTensor gdx = acc ? on_device(dt, {sh.n, sh.in}, dx0) : poisoned(dt, {sh.n, sh.in});
        DeviceTensor gdw = on_device(acc_dt, {sh.out, sh.in}, dw0);
        linear_backward(gpu, skip ? Tensor{} : gdx.t, gdw, gdy, gx, gw, acc);
        const std::string m = mode == 0 ? " (dx =)" : mode == 1 ? " (dx +=)" : " (no dx)";
        if (acc)
          check_close_accumulated("linear_backward dx" + m + tag, dt, download(gdx), hdx.v, dx0,
                                  sum_tol(dt, sh.out));
        else if (!skip)
          check_close("linear_backward dx" + m + tag, dt, download(gdx), hdx.v,
                      sum_tol(dt, sh.out));
        // dw is fp32 for 16-bit inputs (C of CUDA_R_32F): the fp32 product is added to the fp32
        // gradient with fp32 roundings only, so the bound is the f32 one, 16-bit inputs or not.
        check_close_accumulated("linear_backward dw" + m + tag, acc_dt, download(gdw), hdw.v, dw0,
                                sum_tol(acc_dt, sh.n));
      }
    }
  }
}

TEST_CASE("gpu linear_*_batched: three weights against one x", "[gpu]") {
  // The strided-batched launches (the attention's q, k, v projections): y[b] (poisoned first) and
  // dw[b] += against the CPU ops; dx (=, += and none) is the three products in turn, so bitwise
  // linear_backward called three times on the GPU (whose dx the test above checks).
  Ctx gpu = gpu_ctx(), cpu = cpu_ctx();
  const int64_t nb = 3;
  for (const LinearShape& sh : kLinearShapes)
    for (DType dt : kDtypes) {
      const std::string tag = " [" + std::to_string(sh.n) + "x" + std::to_string(sh.in) + "->3x" +
                              std::to_string(sh.out) + "]";
      const DType acc_dt = acc_dtype(dt);
      const auto x = rounded_random_values(dt, sh.n * sh.in, 80),
                 w = rounded_random_values(dt, nb * sh.out * sh.in, 81);
      const auto dy = rounded_random_values(dt, nb * sh.n * sh.out, 82);
      const auto dx0 = rounded_random_values(dt, sh.n * sh.in, 83);
      const auto dw0 = rounded_random_values(acc_dt, nb * sh.out * sh.in, 84);
      Buf<double> hx = host({sh.n, sh.in}, x), hw = host({nb, sh.out, sh.in}, w);
      Buf<double> hdy = host({nb, sh.n, sh.out}, dy), hy({nb, sh.n, sh.out});
      DeviceTensor gx = on_device(dt, {sh.n, sh.in}, x), gw = on_device(dt, {nb, sh.out, sh.in}, w);
      DeviceTensor gdy = on_device(dt, {nb, sh.n, sh.out}, dy);
      cpu::linear_forward_batched(cpu, hy, hx, hw);
      DeviceTensor gy = poisoned(dt, {nb, sh.n, sh.out});
      linear_forward_batched(gpu, gy, gx, gw);
      check_close("linear_forward_batched" + tag, dt, download(gy), hy.v, sum_tol(dt, sh.in));
      for (int mode = 0; mode < 3; ++mode) {  // dx =, dx +=, no dx
        const bool acc = mode == 1, skip = mode == 2;
        Buf<double> hdw = host({nb, sh.out, sh.in}, dw0);
        cpu::linear_backward_batched(cpu, Tensor{}, hdw, hdy, hx, hw, acc);
        DeviceTensor gdx = acc ? on_device(dt, {sh.n, sh.in}, dx0) : poisoned(dt, {sh.n, sh.in});
        DeviceTensor gdw = on_device(acc_dt, {nb, sh.out, sh.in}, dw0);
        linear_backward_batched(gpu, skip ? Tensor{} : gdx.t, gdw, gdy, gx, gw, acc);
        const std::string m = mode == 0 ? " (dx =)" : mode == 1 ? " (dx +=)" : " (no dx)";
        check_close_accumulated("linear_backward_batched dw" + m + tag, acc_dt, download(gdw),
                                hdw.v, dw0, sum_tol(acc_dt, sh.n));
        if (skip) continue;
        DeviceTensor want_dx =
            acc ? on_device(dt, {sh.n, sh.in}, dx0) : poisoned(dt, {sh.n, sh.in});
        DeviceTensor scratch_dw =
            on_device(acc_dt, {sh.out, sh.in}, std::vector<double>(sh.out * sh.in, 0.0));
        for (int64_t b = 0; b < nb; ++b)
          linear_backward(gpu, want_dx, scratch_dw, gdy.t.rows(b, b + 1).view({sh.n, sh.out}), gx,
                          gw.t.rows(b, b + 1).view({sh.out, sh.in}), acc || b > 0);
        check_exact("linear_backward_batched dx" + m + tag, dt, download(gdx), download(want_dx));
      }
    }
}
