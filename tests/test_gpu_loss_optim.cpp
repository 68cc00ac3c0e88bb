// CUDA losses and AdamW against the CPU reference (run in f64 on the same inputs rounded to the
// storage dtype). Outputs are poisoned (NaN) first; inputs are random and never zero.
//  - cross-entropy: N = 9 rows over V = 1000 with ignored targets (-1, -5) and targets 0 and V-1;
//    losses and lse, then the backward both into a separate dlogits and in place (dlogits ==
//    logits, the fused head's path), grad_scale 0.37. Ignored rows must come back exactly 0.
//  - BCE with logits: N = 1001 with |x| up to 1000 (where exp(|x|) overflows even in f64) and soft
//    targets; the mean must be finite and match, and be bitwise the same on a second run.
//  - AdamW: two steps (t = 1 from zero moments, then t = 2) with weight decay and grad_scale, f32
//    and f64; p, m and v compared after each step.
// Tolerance per element: |gpu - ref| <= rtol (|ref| + max|ref|) with rtol = rtol_for(dtype) for the
// losses (f32 2e-5, f64 1e-11, f16 4e-3, bf16 2e-2: fp32 math, one rounding into the dtype) and for
// AdamW rtol 1e-6 in f32 (fp32 math vs the reference's double), 1e-12 in f64.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "moe/cuda_runtime.hpp"
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
    DeviceTensor gloss = poisoned(dt, {N}), glse = poisoned(dt, {N});
    gpu::synchronize();
    cross_entropy_forward(ctx, gloss, glse, gl, gtgt);
    gpu::synchronize();
    const std::vector<double> loss = download(gloss);
    expect_close(loss, closs.v, rtol, "losses");
    expect_close(download(glse), clse.v, rtol, "lse");
    CHECK(loss[1] == 0.0);
    CHECK(loss[5] == 0.0);

    // Backward from the reference lse rounded to the dtype (the same input on both sides).
    const std::vector<double> lse_r = round_to(dt, clse.v);
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
