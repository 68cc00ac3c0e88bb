// CUDA losses and AdamW against the CPU reference (run in f64 on the same inputs rounded to the
// storage dtype). Outputs are poisoned (NaN) first; inputs are random and never zero.
//  - cross-entropy: N = 9 rows over V = 1000 with ignored targets (-1, -5) and targets 0 and V-1;
//    losses and lse (in acc_dtype: f32 for 16-bit logits), then the backward both into a separate
//    dlogits and in place (dlogits == logits, the fused head's path), grad_scale 0.37. Ignored rows
//    must come back exactly 0. Odd shapes (V = 1, 3, 1003, 20011, logits at an element offset so
//    rows start anywhere within 16 bytes, -inf logits) take the vectors' scalar heads and tails
//    and, for a dlogits at another 16-byte phase, the all-scalar backward: the same bits as the
//    vector path in place, and the forward bitwise the same on a second run.
//  - BCE with logits: N = 1001 with |x| up to 1000 (where exp(|x|) overflows even in f64) and soft
//    targets; the mean must be finite and match, and be bitwise the same on a second run.
//  - AdamW: two steps (t = 1 from zero moments, then t = 2) with weight decay and grad_scale, f32
//    and f64; p, m and v compared after each step. With norm_sq (a device scalar): clipping equals
//    the CPU op's and the host-computed clip factor bit for bit (the scale is derived in double on
//    both), and a non-finite norm leaves p, m and v bitwise untouched. compute_out (bf16, f16,
//    f32) is bitwise the GPU's updated p converted (by the GPU and the CPU convert), and a
//    skipped step leaves it unchanged.
// Tolerance per element: |gpu - ref| <= rtol (|ref| + max|ref|) with rtol = rtol_for(dtype) for the
// losses (f32 2e-5, f64 1e-11, f16 4e-3, bf16 2e-2: fp32 math, one rounding into the dtype; the
// fp32 losses and lse of 16-bit logits get the f32 bound) and for AdamW rtol 1e-6 in f32 (fp32
// math vs the reference's double), 1e-12 in f64.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/loss.hpp"
#include "moe/ops/optim.hpp"

using namespace moe;
using namespace moe::test;

namespace {

const DType kAllFloat[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

}  // namespace

TEST_CASE("gpu cross-entropy forward/backward match the CPU, in place too", "[gpu][loss]") {
  const int64_t N = 9, V = 1000;
  const std::vector<int32_t> targets = {3, -1, 0, 999, 517, -5, 42, 998, 1};
  const double grad_scale = 0.37;
  for (DType dt : kAllFloat) {
    INFO("dtype " << dtype_name(dt));
    const double rtol = rtol_for(dt);
    const DType acc = acc_dtype(dt);
    const std::vector<double> logits = round_to(dt, random_values(N * V, 41, -6.0, 6.0));
    Ctx cpu{};
    Host cl({N, V}, logits), closs({N}), clse({N});
    std::vector<int32_t> tgt_host = targets;
    Tensor ctgt(tgt_host.data(), DType::i32, Device{}, {N});
    cross_entropy_forward(cpu, closs, clse, cl, ctgt);

    Ctx ctx = gpu_ctx();
    DeviceTensor gl = on_device(dt, {N, V}, logits);
    DeviceTensor gtgt(DType::i32, {N});
    upload_i32(gtgt, targets);
    DeviceTensor gloss = poisoned(acc, {N}), glse = poisoned(acc, {N});
    gpu::synchronize();
    cross_entropy_forward(ctx, gloss, glse, gl, gtgt);
    gpu::synchronize();
    const std::vector<double> loss = download(gloss);
    expect_close(loss, closs.v, rtol_for(acc), "losses");
    expect_close(download(glse), clse.v, rtol_for(acc), "lse");
    CHECK(loss[1] == 0.0);
    CHECK(loss[5] == 0.0);

    // Backward from the reference lse rounded to the acc dtype (the same input on both sides).
    const std::vector<double> lse_r = round_to(acc, clse.v);
    Host clse_r({N}, lse_r), cdl({N, V});
    cross_entropy_backward(cpu, cdl, cl, clse_r, ctgt, grad_scale);
    upload(glse, lse_r);
    DeviceTensor gdl = poisoned(dt, {N, V});
    gpu::synchronize();
    cross_entropy_backward(ctx, gdl, gl, glse, gtgt, grad_scale);
    gpu::synchronize();
    const std::vector<double> dl = download(gdl);
    expect_close(dl, cdl.v, rtol, "dlogits");
    for (int64_t j = 0; j < V; ++j) {
      CHECK(dl[static_cast<size_t>(1 * V + j)] == 0.0);
      CHECK(dl[static_cast<size_t>(5 * V + j)] == 0.0);
    }

    // In place: dlogits is the logits buffer.
    cross_entropy_backward(ctx, gl, gl, glse, gtgt, grad_scale);
    gpu::synchronize();
    const std::vector<double> in_place = download(gl);
    expect_close(in_place, cdl.v, rtol, "dlogits in place");
    CHECK(in_place == dl);  // same arithmetic, same bits
  }
}

namespace {

// A [rows, cols] view of buf starting `offset` elements in: rows at other offsets within 16 bytes
// than a fresh allocation's.
Tensor view_at(const DeviceTensor& buf, DType dt, int64_t offset, int64_t rows, int64_t cols) {
  return Tensor(static_cast<char*>(buf.t.data) + offset * static_cast<int64_t>(dtype_size(dt)), dt,
                gpu0(), {rows, cols});
}

// Cross-entropy on [n, v] logits of dt, `offset` elements into their buffer, against the CPU op.
// Every fourth row is ignored; row 0 targets 0, row 1 targets v - 1; rows 0, 3, 6, ... hold one
// -inf logit (a masked vocabulary entry, never the target). The backward runs into a fresh
// dlogits (all-scalar when offset leaves the logits' rows at another 16-byte phase) and in place.
void check_ce(int64_t n, int64_t v, DType dt, int64_t offset, uint64_t seed) {
  INFO("cross-entropy N=" << n << " V=" << v << " offset=" << offset << " dtype "
                          << dtype_name(dt));
  const DType acc = acc_dtype(dt);
  const double grad_scale = 0.37;
  std::vector<int32_t> targets(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    targets[i] = i % 4 == 2 ? -1 : static_cast<int32_t>((seed * 7919 + i * 104729) % v);
  targets[0] = 0;
  if (n > 1) targets[1] = static_cast<int32_t>(v - 1);
  std::vector<double> logits = round_to(dt, random_values(n * v, seed, -6.0, 6.0));
  if (v > 1)
    for (int64_t i = 0; i < n; i += 3)
      logits[i * v + (std::max(targets[i], 0) + 1) % v] = -std::numeric_limits<double>::infinity();

  Ctx cpu{};
  Host cl({n, v}, logits), closs({n}), clse({n});
  Tensor ctgt(targets.data(), DType::i32, Device{}, {n});
  cross_entropy_forward(cpu, closs, clse, cl, ctgt);
  const std::vector<double> lse_r = round_to(acc, clse.v);
  Host clse_r({n}, lse_r), cdl({n, v});
  cross_entropy_backward(cpu, cdl, cl, clse_r, ctgt, grad_scale);

  Ctx ctx = gpu_ctx();
  DeviceTensor lbuf(dt, {n * v + offset});
  const Tensor gl = view_at(lbuf, dt, offset, n, v);
  upload(gl, logits);
  DeviceTensor gtgt(DType::i32, {n});
  upload_i32(gtgt, targets);
  DeviceTensor gloss = poisoned(acc, {n}), glse = poisoned(acc, {n});
  cross_entropy_forward(ctx, gloss, glse, gl, gtgt);
  gpu::synchronize();
  const std::vector<double> loss = download(gloss), lse = download(glse);
  expect_close(loss, closs.v, rtol_for(acc), "losses");
  expect_close(lse, clse.v, rtol_for(acc), "lse");
  for (int64_t i = 2; i < n; i += 4) CHECK(loss[static_cast<size_t>(i)] == 0.0);
  poison(gloss);
  poison(glse);
  cross_entropy_forward(ctx, gloss, glse, gl, gtgt);
  gpu::synchronize();
  CHECK(download(gloss) == loss);  // fixed reduction order
  CHECK(download(glse) == lse);

  upload(glse, lse_r);
  DeviceTensor gdl = poisoned(dt, {n, v});
  cross_entropy_backward(ctx, gdl, gl, glse, gtgt, grad_scale);
  gpu::synchronize();
  const std::vector<double> dl = download(gdl);
  expect_close(dl, cdl.v, rtol_for(dt), "dlogits");
  for (int64_t i = 2; i < n; i += 4)
    for (int64_t j = 0; j < v; ++j) CHECK(dl[static_cast<size_t>(i * v + j)] == 0.0);
  cross_entropy_backward(ctx, gl, gl, glse, gtgt, grad_scale);
  gpu::synchronize();
  const std::vector<double> in_place = download(gl);
  expect_close(in_place, cdl.v, rtol_for(dt), "dlogits in place");
  CHECK(in_place == dl);  // vector and scalar paths: the same arithmetic per element

  // Both in one call: the bits of the two GPU ops (the forward's lse feeding the backward),
  // into a fresh dlogits (the fused kernel when its rows share the logits' 16-byte phase, else
  // the two kernels) and in place; rows past the fused kernel's registers take the two kernels.
  upload(gl, logits);
  upload(glse, lse);
  DeviceTensor ref_dl = poisoned(dt, {n, v});
  cross_entropy_backward(ctx, ref_dl, gl, glse, gtgt, grad_scale);
  gpu::synchronize();
  const std::vector<double> ref = download(ref_dl);
  DeviceTensor floss = poisoned(acc, {n}), flse = poisoned(acc, {n}), fdl = poisoned(dt, {n, v});
  cross_entropy_forward_backward(ctx, floss, flse, fdl, gl, gtgt, grad_scale);
  gpu::synchronize();
  CHECK(download(floss) == loss);
  CHECK(download(flse) == lse);
  CHECK(download(fdl) == ref);
  poison(floss);
  poison(flse);
  cross_entropy_forward_backward(ctx, floss, flse, gl, gl, gtgt, grad_scale);
  gpu::synchronize();
  CHECK(download(floss) == loss);
  CHECK(download(flse) == lse);
  CHECK(download(gl) == ref);
}

}  // namespace

TEST_CASE("gpu cross-entropy: odd V, rows at any 16-byte offset, -inf logits", "[gpu][loss]") {
  for (DType dt : kAllFloat) {
    check_ce(7, 1003, dt, 0, 1);   // every row at another offset: scalar head and tail
    check_ce(5, 20011, dt, 3, 2);  // several unrolled vector rounds; dlogits at another phase
    check_ce(6, 4096, dt, 1, 3);   // V a multiple of 8 but misaligned rows
    check_ce(4, 3, dt, 1, 4);      // V below one vector: all scalar
    check_ce(3, 1, dt, 0, 5);      // V = 1: lse = the logit, loss 0
    check_ce(3, 32000, dt, 0, 6);  // the LM head's vocabulary: 16-bit rows fused, 16 vectors
    check_ce(2, 12000, dt, 1, 8);  // 16-bit: the fused kernel's 8-vector variant
    check_ce(2, 40001, dt, 2, 7);  // past the fused kernel's registers: the two kernels
  }
}

TEST_CASE("gpu BCE with logits matches the CPU for large |x|", "[gpu][loss]") {
  const int64_t N = 1001;
  const double grad_scale = 1.7;
  std::vector<double> x = random_values(N, 51, -8.0, 8.0);
  const double big[] = {30.0, -30.0, 80.0, -80.0, 1000.0, -1000.0, 200.0, -200.0};
  for (size_t i = 0; i < sizeof big / sizeof big[0]; ++i) x[i * 97] = big[i];
  std::vector<double> t = random_values(N, 52, 0.0, 1.0);
  t[0] = 1e-3;  // near-hard targets
  t[97] = 1.0;
  t[4 * 97] = 0.5;
  for (DType dt : kAllFloat) {
    INFO("dtype " << dtype_name(dt));
    const double rtol = rtol_for(dt);
    const std::vector<double> xr = round_to(dt, x), tr = round_to(dt, t);
    Ctx cpu{};
    Host cx({N}, xr), ct({N}, tr), closs({1}), cdx({N});
    bce_with_logits_forward(cpu, closs, cx, ct);
    bce_with_logits_backward(cpu, cdx, cx, ct, grad_scale);

    Ctx ctx = gpu_ctx();
    DeviceTensor gx = on_device(dt, {N}, xr), gt = on_device(dt, {N}, tr);
    DeviceTensor gloss = poisoned(dt, {1}), gdx = poisoned(dt, {N});
    gpu::synchronize();
    bce_with_logits_forward(ctx, gloss, gx, gt);
    bce_with_logits_backward(ctx, gdx, gx, gt, grad_scale);
    gpu::synchronize();
    const std::vector<double> loss = download(gloss);
    REQUIRE(std::isfinite(loss[0]));
    expect_close(loss, closs.v, rtol, "mean loss");
    expect_close(download(gdx), cdx.v, rtol, "dlogits");

    poison(gloss);
    gpu::synchronize();
    bce_with_logits_forward(ctx, gloss, gx, gt);
    gpu::synchronize();
    CHECK(download(gloss) == loss);  // deterministic reduction
  }
}

TEST_CASE("gpu AdamW two steps match the CPU (weight decay, grad_scale)", "[gpu][optim]") {
  const int64_t n = 1003;  // not a multiple of the block size
  AdamWArgs a;
  a.lr = 1e-2;
  a.beta1 = 0.9;
  a.beta2 = 0.95;
  a.eps = 1e-8;
  a.weight_decay = 0.1;
  a.grad_scale = 0.25;
  for (DType dt : {DType::f32, DType::f64}) {
    INFO("dtype " << dtype_name(dt));
    const double rtol = dt == DType::f32 ? 1e-6 : 1e-12;
    const std::vector<double> p0 = round_to(dt, random_values(n, 61, -2.0, 2.0));
    const std::vector<double> g1 = round_to(dt, random_values(n, 62, -3.0, 3.0));
    const std::vector<double> g2 = round_to(dt, random_values(n, 63, -3.0, 3.0));
    const std::vector<double> zeros(static_cast<size_t>(n), 0.0);  // moments start at 0
    Ctx cpu{};
    Host cp({n}, p0), cg({n}, g1), cm({n}, zeros), cv({n}, zeros);
    Ctx ctx = gpu_ctx();
    DeviceTensor gp = on_device(dt, {n}, p0), gg = on_device(dt, {n}, g1);
    DeviceTensor gm = on_device(dt, {n}, zeros), gv = on_device(dt, {n}, zeros);
    for (long step = 1; step <= 2; ++step) {
      INFO("step " << step);
      a.step = step;
      if (step == 2) {
        std::copy(g2.begin(), g2.end(), cg.v.begin());
        upload(gg, g2);
      }
      adamw_step(cpu, cp, cg, cm, cv, a);
      gpu::synchronize();
      adamw_step(ctx, gp, gg, gm, gv, a);
      gpu::synchronize();
      expect_close(download(gp), cp.v, rtol, "p");
      expect_close(download(gm), cm.v, rtol, "m");
      expect_close(download(gv), cv.v, rtol, "v");
    }
  }
}

// The f32 kernel takes four elements per thread when every array is 16-byte aligned and falls
// back to one per thread otherwise (a segment at an odd offset of the parameter buffer): both
// must give the same bits (ZeRO-3's chunks start at other offsets than stage 0's segments, and
// the two are compared bitwise), with and without the compute copy.
TEST_CASE("gpu AdamW: the vectorised and the one-element kernels give the same bits",
          "[gpu][optim]") {
  const int64_t n = 4099;
  AdamWArgs a;
  a.lr = 1e-2, a.beta1 = 0.9, a.beta2 = 0.95, a.weight_decay = 0.1, a.step = 2, a.grad_scale = 0.5;
  const std::vector<double> p0 = round_to(DType::f32, random_values(n, 71, -2.0, 2.0));
  const std::vector<double> g = round_to(DType::f32, random_values(n, 72, -3.0, 3.0));
  const std::vector<double> m0 = round_to(DType::f32, random_values(n, 73, -0.1, 0.1));
  const std::vector<double> v0 = round_to(DType::f32, random_values(n, 74, 1e-3, 0.1));
  for (bool with_copy : {false, true}) {
    INFO("compute copy " << with_copy);
    Ctx ctx = gpu_ctx();
    // Aligned: the arrays themselves (vectorised, and the n % 4 tail one by one).
    DeviceTensor ap = on_device(DType::f32, {n}, p0), ag = on_device(DType::f32, {n}, g);
    DeviceTensor am = on_device(DType::f32, {n}, m0), av = on_device(DType::f32, {n}, v0);
    DeviceTensor aout = poisoned(DType::bf16, {n});
    // Misaligned: the same values one element into buffers of n + 1 (one element per thread).
    auto shifted = [&](const std::vector<double>& x) {
      std::vector<double> y(1, 7.0);
      y.insert(y.end(), x.begin(), x.end());
      return on_device(DType::f32, {n + 1}, y);
    };
    DeviceTensor sp = shifted(p0), sg = shifted(g), sm = shifted(m0), sv = shifted(v0);
    DeviceTensor sout = poisoned(DType::bf16, {n + 1});
    AdamWArgs aa = a, sa = a;
    if (with_copy) aa.compute_out = aout, sa.compute_out = Tensor(sout).rows(1, n + 1);
    adamw_step(ctx, ap, ag, am, av, aa);
    adamw_step(ctx, Tensor(sp).rows(1, n + 1), Tensor(sg).rows(1, n + 1), Tensor(sm).rows(1, n + 1),
               Tensor(sv).rows(1, n + 1), sa);
    gpu::synchronize();
    auto tail = [](const std::vector<double>& x) {
      return std::vector<double>(x.begin() + 1, x.end());
    };
    CHECK(download(ap) == tail(download(sp)));
    CHECK(download(am) == tail(download(sm)));
    CHECK(download(av) == tail(download(sv)));
    if (with_copy) CHECK(download(aout) == tail(download(sout)));
  }
}

namespace {

// moe::clip_factor (src/optim) written out: the factor a trainer computes on the host.
double host_clip_factor(double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0;
  return max_norm / (norm + 1e-6);
}

}  // namespace

// Every storage dtype: f32 / f64 within rtol of the CPU op; 16-bit storage (p, g, m, v all bf16 or
// all f16: the op's contract allows any float dtype, the kernel computes each element in fp32 and
// rounds p, m and v once into the dtype; the trainer keeps fp32 state, so no model test reaches
// it) within 1e-6 + rtol_for(dt) |cpu| of the CPU op in f64 on the same rounded values (one
// rounding to dt, fp32 math; 1e-6 for a moment that lands in f16's subnormals), and the step
// moves p (an update of ~lr: many elements cross a 16-bit rounding boundary).
TEST_CASE("gpu AdamW with norm_sq clips on the device like the CPU and the host clip factor",
          "[gpu][optim]") {
  const int64_t n = 1003;
  AdamWArgs a;
  a.lr = 1e-2, a.beta1 = 0.9, a.beta2 = 0.95, a.weight_decay = 0.1, a.step = 3;
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    const bool half = dt == DType::bf16 || dt == DType::f16;
    const double rtol = dt == DType::f32 ? 1e-6 : 1e-12;
    auto close = [&](const std::vector<double>& got, const std::vector<double>& want,
                     const char* what) {
      if (half)
        check_close(got, want, dt, 1e-6, what);
      else
        expect_close(got, want, rtol, what);
    };
    for (double grad_scale : {1.0, 0.25}) {
      for (double max_norm : {0.0, 1.0, 1e6}) {  // off, clipping, not needed
        INFO("dtype " << dtype_name(dt) << " grad_scale " << grad_scale << " max_norm "
                      << max_norm);
        const std::vector<double> p0 = round_to(dt, random_values(n, 71, -2.0, 2.0));
        const std::vector<double> g = round_to(dt, random_values(n, 72, -3.0, 3.0));
        const std::vector<double> m0 = round_to(dt, random_values(n, 73, -0.1, 0.1));
        const std::vector<double> v0 = round_to(dt, random_values(n, 74, 1e-3, 0.1));
        Ctx cpu{}, ctx = gpu_ctx();
        DeviceTensor gp = on_device(dt, {n}, p0), gg = on_device(dt, {n}, g);
        DeviceTensor gm = on_device(dt, {n}, m0), gv = on_device(dt, {n}, v0);
        DeviceTensor gns = on_device(DType::f64, {1}, {0.0});
        sum_squares(ctx, gns, gg);  // the norm stays on the device
        gpu::synchronize();
        const double norm_sq = download(gns)[0];         // (read here only to build the references)
        REQUIRE(grad_scale * std::sqrt(norm_sq) > 1.0);  // max_norm 1 really clips

        AdamWArgs da = a;
        da.grad_scale = grad_scale;
        da.max_norm = max_norm;
        da.norm_sq = gns;
        adamw_step(ctx, gp, gg, gm, gv, da);

        // CPU op with the same norm_sq (a host copy of it).
        Host cp({n}, p0), cg({n}, g), cm({n}, m0), cv({n}, v0), cns({1}, {norm_sq});
        AdamWArgs ca = da;
        ca.norm_sq = cns;
        adamw_step(cpu, cp, cg, cm, cv, ca);
        // The same GPU op with the clip factor computed on the host.
        DeviceTensor hp = on_device(dt, {n}, p0), hm = on_device(dt, {n}, m0);
        DeviceTensor hv = on_device(dt, {n}, v0);
        AdamWArgs ha = a;
        ha.grad_scale = grad_scale * host_clip_factor(grad_scale * std::sqrt(norm_sq), max_norm);
        adamw_step(ctx, hp, gg, hm, hv, ha);
        gpu::synchronize();

        const std::vector<double> p1 = download(gp);
        close(p1, cp.v, "p vs CPU");
        close(download(gm), cm.v, "m vs CPU");
        close(download(gv), cv.v, "v vs CPU");
        size_t moved = 0;
        for (int64_t i = 0; i < n; ++i) moved += p1[i] != p0[i];
        CHECK(moved > static_cast<size_t>(n) / 4);
        CHECK(download(gp) == download(hp));  // device clip == host clip, bit for bit
        CHECK(download(gm) == download(hm));
        CHECK(download(gv) == download(hv));
      }
    }
  }
}

TEST_CASE("gpu AdamW with a non-finite norm_sq skips the step, p, m, v bitwise unchanged",
          "[gpu][optim]") {
  const int64_t n = 1003;
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    for (double bad : {std::numeric_limits<double>::infinity(), std::nan("")}) {
      INFO("dtype " << dtype_name(dt) << " norm_sq " << bad);
      const std::vector<double> p0 = round_to(dt, random_values(n, 81, -2.0, 2.0));
      const std::vector<double> g = round_to(dt, random_values(n, 82, -3.0, 3.0));
      const std::vector<double> m0 = round_to(dt, random_values(n, 83, -0.1, 0.1));
      const std::vector<double> v0 = round_to(dt, random_values(n, 84, 1e-3, 0.1));
      Ctx ctx = gpu_ctx();
      DeviceTensor gp = on_device(dt, {n}, p0), gg = on_device(dt, {n}, g);
      DeviceTensor gm = on_device(dt, {n}, m0), gv = on_device(dt, {n}, v0);
      DeviceTensor gns = on_device(DType::f64, {1}, {bad});
      AdamWArgs a;
      a.step = 2, a.weight_decay = 0.1, a.max_norm = 1.0, a.norm_sq = gns;
      adamw_step(ctx, gp, gg, gm, gv, a);
      gpu::synchronize();
      CHECK(download(gp) == p0);
      CHECK(download(gm) == m0);
      CHECK(download(gv) == v0);
    }
  }
  // norm_sq must be a device f64 scalar.
  Ctx ctx = gpu_ctx();
  DeviceTensor p(DType::f32, {4}), ns32(DType::f32, {1});
  AdamWArgs a;
  a.norm_sq = ns32;
  CHECK_THROWS_WITH(adamw_step(ctx, p, p, p, p, a),
                    Catch::Contains("adamw_step: norm_sq must be a 1-element f64 tensor"));
  double host_ns = 1.0;
  a.norm_sq = Tensor(&host_ns, DType::f64, Device{}, {1});
  CHECK_THROWS_WITH(adamw_step(ctx, p, p, p, p, a), Catch::Contains("adamw_step: norm_sq is on"));
}

// compute_out (the fused 16-bit compute copy): p, m and v as without it (against the CPU op, the
// tolerances above), and compute_out bitwise the GPU's own p converted, by the GPU convert op and
// by the CPU convert (the oracle) of p's downloaded bits. Clipped and unclipped steps through
// norm_sq; a non-finite norm leaves compute_out as it was.
TEST_CASE("gpu AdamW compute_out is the updated p converted, bitwise; a skipped step keeps it",
          "[gpu][optim]") {
  const int64_t n = 1003;
  AdamWArgs a;
  a.lr = 1e-2, a.beta1 = 0.9, a.beta2 = 0.95, a.weight_decay = 0.1, a.step = 3, a.grad_scale = 0.25;
  for (DType dt : {DType::f32, DType::f64}) {
    const std::vector<double> p0 = round_to(dt, random_values(n, 91, -2.0, 2.0));
    const std::vector<double> g = round_to(dt, random_values(n, 92, -3.0, 3.0));
    const std::vector<double> m0 = round_to(dt, random_values(n, 93, -0.1, 0.1));
    const std::vector<double> v0 = round_to(dt, random_values(n, 94, 1e-3, 0.1));
    for (DType out_dt : {DType::bf16, DType::f16, DType::f32}) {
      for (double max_norm : {0.0, 1.0}) {  // no clipping, clipping
        INFO("dtype " << dtype_name(dt) << " compute_out " << dtype_name(out_dt) << " max_norm "
                      << max_norm);
        Ctx cpu{}, ctx = gpu_ctx();
        DeviceTensor gp = on_device(dt, {n}, p0), gg = on_device(dt, {n}, g);
        DeviceTensor gm = on_device(dt, {n}, m0), gv = on_device(dt, {n}, v0);
        DeviceTensor gns = on_device(DType::f64, {1}, {0.0});
        DeviceTensor out = poisoned(out_dt, {n});
        sum_squares(ctx, gns, gg);
        gpu::synchronize();
        const double norm_sq = download(gns)[0];
        REQUIRE(a.grad_scale * std::sqrt(norm_sq) > 1.0);  // max_norm 1 really clips
        AdamWArgs da = a;
        da.max_norm = max_norm;
        da.norm_sq = gns;
        da.compute_out = out;
        adamw_step(ctx, gp, gg, gm, gv, da);
        // The GPU convert op of the GPU's p: what Model::weights_changed used to run.
        DeviceTensor converted = poisoned(out_dt, {n});
        gpu::synchronize();
        convert(ctx, converted, gp, false);
        gpu::synchronize();

        Host cp({n}, p0), cg({n}, g), cm({n}, m0), cv({n}, v0), cns({1}, {norm_sq});
        AdamWArgs ca = da;
        ca.norm_sq = cns;
        ca.compute_out = Tensor();
        adamw_step(cpu, cp, cg, cm, cv, ca);
        const double rtol = dt == DType::f32 ? 1e-6 : 1e-12;
        expect_close(download(gp), cp.v, rtol, "p vs CPU");
        expect_close(download(gm), cm.v, rtol, "m vs CPU");
        expect_close(download(gv), cv.v, rtol, "v vs CPU");

        const std::vector<unsigned char> got = bytes_of(out);
        CHECK(got == bytes_of(converted));
        // The CPU convert of the GPU's p bits.
        std::vector<unsigned char> p_bits = bytes_of(gp), want(got.size(), 0);
        convert(cpu, Tensor(want.data(), out_dt, Device{}, {n}),
                Tensor(p_bits.data(), dt, Device{}, {n}), false);
        CHECK(got == want);

        // A second step with a non-finite norm: skipped, compute_out keeps the first step's bits.
        upload(gns, {std::numeric_limits<double>::infinity()});
        gpu::synchronize();
        da.step = 4;
        adamw_step(ctx, gp, gg, gm, gv, da);
        gpu::synchronize();
        CHECK(bytes_of(out) == got);
        CHECK(bytes_of(gp) == p_bits);
      }
    }
  }
  // compute_out must be a device tensor of p's size, bf16 / f16 / f32.
  Ctx ctx = gpu_ctx();
  DeviceTensor p(DType::f32, {4}), short_out(DType::bf16, {3});
  AdamWArgs bad;
  bad.compute_out = short_out;
  CHECK_THROWS_WITH(adamw_step(ctx, p, p, p, p, bad), Catch::Contains("differ in size"));
  uint16_t host_out[4] = {};
  bad.compute_out = Tensor(host_out, DType::bf16, Device{}, {4});
  CHECK_THROWS_WITH(adamw_step(ctx, p, p, p, p, bad),
                    Catch::Contains("adamw_step: compute_out is on"));
}

// AdamWArgs::grad_sq_out on the GPU: the sum of squares of g from the update's own read, in
// every kernel (f32 four at a time and its tail, one element at a time at an odd offset, f64,
// the split master four at a time and one at a time), close to sum_squares (another summation
// order), deterministic, added into what is there, and the update bitwise the one without it.
TEST_CASE("gpu AdamW grad_sq_out: the gradients' sum of squares, the update unchanged",
          "[gpu][optim]") {
  const int64_t n = (int64_t{1} << 19) + 7;  // more blocks than the partials, plus a tail
  AdamWArgs a;
  a.lr = 1e-2, a.beta1 = 0.9, a.beta2 = 0.95, a.weight_decay = 0.1, a.step = 2, a.grad_scale = 0.5;
  for (DType dt : {DType::f32, DType::f64}) {
    for (int64_t shift : {0, 1}) {
      INFO(dtype_name(dt) << " shift " << shift);
      const int64_t total = n + shift;
      const std::vector<double> p0 = round_to(dt, random_values(total, 71, -2.0, 2.0));
      const std::vector<double> g = round_to(dt, random_values(total, 72, -3.0, 3.0));
      const std::vector<double> m0 = round_to(dt, random_values(total, 73, -0.1, 0.1));
      const std::vector<double> v0 = round_to(dt, random_values(total, 74, 1e-3, 0.1));
      Ctx ctx = gpu_ctx();
      auto part = [&](const DeviceTensor& t) { return Tensor(t).rows(shift, shift + n); };
      DeviceTensor gd = on_device(dt, {total}, g);
      DeviceTensor expect = on_device(DType::f64, {1}, {0.0});
      sum_squares(ctx, expect, part(gd));
      gpu::synchronize();
      const double want = download(expect)[0];
      // The plain update, then three with the norm: from 0 twice (the same bits) and from 1.5.
      std::vector<std::vector<uint8_t>> state;
      std::vector<double> sums;
      for (double start : {-1.0, 0.0, 0.0, 1.5}) {
        DeviceTensor p = on_device(dt, {total}, p0), m = on_device(dt, {total}, m0);
        DeviceTensor v = on_device(dt, {total}, v0);
        DeviceTensor sq = on_device(DType::f64, {1}, {start});
        AdamWArgs with = a;
        if (start >= 0) with.grad_sq_out = sq;
        adamw_step(ctx, part(p), part(gd), part(m), part(v), with);
        gpu::synchronize();
        const std::vector<uint8_t> bytes = bytes_of(p), mb = bytes_of(m), vb = bytes_of(v);
        if (state.empty()) state = {bytes, mb, vb};
        CHECK(bytes == state[0]);
        CHECK(mb == state[1]);
        CHECK(vb == state[2]);
        sums.push_back(download(sq)[0]);
      }
      CHECK(sums[1] == Approx(want).epsilon(1e-12));
      CHECK(sums[2] == sums[1]);
      CHECK(sums[3] == Approx(1.5 + want).epsilon(1e-12));

      if (dt != DType::f32) continue;
      // The split master: hi / lo of any bits, its f32 gradients.
      std::vector<uint16_t> hi_bits(static_cast<size_t>(total)), lo_bits(hi_bits.size());
      for (size_t i = 0; i < hi_bits.size(); ++i) {
        hi_bits[i] = float_to_bf16(static_cast<float>(p0[i]));
        lo_bits[i] = static_cast<uint16_t>((i * 40503u) & 0xFFFF);
      }
      std::vector<double> split_sums;
      for (int run = 0; run < 2; ++run) {
        DeviceTensor hi(DType::bf16, {total}), lo(DType::u16, {total});
        copy_from_host(hi, hi_bits.data());
        copy_from_host(lo, lo_bits.data());
        DeviceTensor m = on_device(dt, {total}, m0), v = on_device(dt, {total}, v0);
        DeviceTensor sq = on_device(DType::f64, {1}, {0.0});
        AdamWArgs with = a;
        with.grad_sq_out = sq;
        adamw_step_split(ctx, part(hi), part(lo), part(gd), part(m), part(v), with);
        gpu::synchronize();
        split_sums.push_back(download(sq)[0]);
      }
      CHECK(split_sums[0] == Approx(want).epsilon(1e-12));
      CHECK(split_sums[1] == split_sums[0]);
    }
  }
}
