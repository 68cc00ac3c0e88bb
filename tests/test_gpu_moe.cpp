// CUDA MoE router and permutation ops against the CPU reference (kernels/cpu/{router,permute}.cpp)
// on the same inputs: values rounded to the storage dtype, the CPU computing in f64. Outputs are
// poisoned before each GPU call so anything left unwritten fails.
//
// Index outputs (topk_idx, counts, offsets, row_token, slot_row) must equal the CPU bitwise, in
// every dtype (the selection compares logits + bias in double on both sides). Float outputs:
//   |gpu - cpu| <= atol + rtol * |cpu|, rtol = rtol_for(dtype) (f32 2e-5, f16 4e-3, bf16 2e-2,
//   f64 1e-11); atol = 1e-3 * rtol for probabilities and weights (scale 1), rtol * max|cpu| for
//   gradients and dot products (cancellation), 0 for pure copies (which must be exact). The
//   routing weights (topk_w, their row-order copy and the gradients) are in acc_dtype (f32 for
//   16-bit activations); their moves are exact.
// add_counts (acc += counts on the device) must equal the CPU exactly.
#include <algorithm>
#include <deque>
#include <random>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "moe/ops/permute.hpp"
#include "moe/ops/router.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

const DType kFloatTypes[] = {DType::f32, DType::f16, DType::bf16, DType::f64};

// Values drawn from a small set of exactly representable non-zero numbers: many exact ties.
std::vector<double> tied(size_t n, uint64_t seed) {
  return tied_values(n, seed, {-1.0, 0.5, 1.0, 1.5});
}

struct RouteCase {
  int64_t n, e, k;
  std::vector<double> logits;  // [N, E]
  std::vector<double> bias;    // [E] or empty
  const char* name;
};

// Random logits; `skew`: column hot gets +6 (most tokens' first pick), the last two columns -8
// (no token picks them while K <= E - 2 and hot/cold dominate).
RouteCase make_case(int64_t n, int64_t e, int64_t k, bool with_bias, bool skew, bool ties,
                    uint64_t seed, const char* name) {
  RouteCase c{n, e, k, {}, {}, name};
  c.logits = ties ? tied(static_cast<size_t>(n * e), seed)
                  : uniform_values(static_cast<size_t>(n * e), seed, -2.0, 2.0);
  if (skew)
    for (int64_t t = 0; t < n; ++t) {
      c.logits[t * e + 1] += 6.0;
      c.logits[t * e + e - 1] -= 8.0;
      c.logits[t * e + e - 2] -= 8.0;
    }
  if (with_bias) {
    c.bias = ties ? tied(static_cast<size_t>(e), seed + 1)
                  : uniform_values(static_cast<size_t>(e), seed + 1, -0.5, 0.5);
    if (skew) c.bias[2] += 3.0;  // steers selection only
  }
  return c;
}

// Runs forward (and, from its outputs, backward, aux loss, aux backward and the plan) on the GPU
// in dtype dt and on the CPU in f64, and compares.
void check_routing(const RouteCase& rc, bool norm, DType dt) {
  const int64_t n = rc.n, e = rc.e, k = rc.k;
  INFO(rc.name << ": N=" << n << " E=" << e << " K=" << k << " norm=" << norm
               << " bias=" << !rc.bias.empty() << " dtype=" << dtype_name(dt));
  Ctx cctx = cpu_ctx(), gctx = gpu_ctx();
  const std::vector<double> lr = round_to(dt, rc.logits);
  const std::vector<double> br = round_to(dt, rc.bias);

  // ---- forward
  Buf<double> l = host({n, e}, lr), p({n, e}), w({n, k});
  Buf<double> b = rc.bias.empty() ? Buf<double>() : host({e}, br);
  Buf<int32_t> idx({n, k}), cnt({e});
  cpu::router_topk_forward(cctx, p, idx, w, cnt, l, rc.bias.empty() ? Tensor() : b.t, norm);

  DeviceTensor gl = on_device(dt, {n, e}, lr);
  DeviceTensor gp = poisoned(dt, {n, e}), gw = poisoned(dt, {n, k});
  DeviceTensor gidx = poisoned(DType::i32, {n, k}), gcnt = poisoned(DType::i32, {e});
  Tensor gbias;
  DeviceTensor gb(dt, {std::max<int64_t>(e, 1)});
  if (!rc.bias.empty()) {
    upload(gb, br);
    gbias = gb;
  }
  router_topk_forward(gctx, gp, gidx, gw, gcnt, gl, gbias, norm);
  CHECK(download_i32(gidx) == idx.v);
  CHECK(download_i32(gcnt) == cnt.v);
  check_close(download(gp), p.v, dt, 1e-3 * rtol_for(dt), "probs");
  check_close(download(gw), w.v, dt, 1e-3 * rtol_for(dt), "topk_w");

  // ---- backward (both sides from the same rounded probs)
  const std::vector<double> pr = round_to(dt, p.v);
  const std::vector<double> dwr =
      round_to(dt, uniform_values(static_cast<size_t>(n * k), 77 + static_cast<uint64_t>(n)));
  {
    Buf<double> hp = host({n, e}, pr), hdw = host({n, k}, dwr), hdl({n, e});
    cpu::router_topk_backward(cctx, hdl, hdw, hp, idx, norm);
    DeviceTensor dp = on_device(dt, {n, e}, pr), ddw = on_device(dt, {n, k}, dwr);
    DeviceTensor ddl = poisoned(dt, {n, e});
    router_topk_backward(gctx, ddl, ddw, dp, gidx, norm);
    if (norm && k == 1) {
      // w = p / p = 1 whatever the logits: the gradient is zero up to rounding, so a tolerance
      // relative to the (all but zero) reference does not apply.
      double worst_gpu = 0, worst_cpu = 0;
      for (double v : download(ddl)) worst_gpu = std::max(worst_gpu, std::abs(v));
      for (double v : hdl.v) worst_cpu = std::max(worst_cpu, std::abs(v));
      CHECK(worst_gpu <= 1e-12);
      CHECK(worst_cpu <= 1e-12);
    } else {
      check_grad(download(ddl), hdl.v, dt, "router_topk_backward dlogits");
    }
  }

  // ---- aux losses
  const double aux_coef = 0.5, z_coef = 0.1, grad_scale = 0.7;
  {
    Buf<double> hp = host({n, e}, pr), hloss({2});
    cpu::router_aux_loss_forward(cctx, hloss, l, hp, cnt, static_cast<int>(k), aux_coef, z_coef);
    DeviceTensor dp = on_device(dt, {n, e}, pr), dloss = poisoned(dt, {2});
    router_aux_loss_forward(gctx, dloss, gl, dp, gcnt, static_cast<int>(k), aux_coef, z_coef);
    const std::vector<double> first = download(dloss);
    check_close(first, hloss.v, dt, 1e-30, "router_aux_loss_forward");
    poison(dloss);
    router_aux_loss_forward(gctx, dloss, gl, dp, gcnt, static_cast<int>(k), aux_coef, z_coef);
    CHECK(download(dloss) == first);  // deterministic reduction

    // Accumulates into a small random dlogits.
    const std::vector<double> dl0 =
        round_to(dt, uniform_values(static_cast<size_t>(n * e), 99, -1e-3, 1e-3));
    Buf<double> hdl = host({n, e}, dl0);
    cpu::router_aux_loss_backward(cctx, hdl, l, hp, cnt, static_cast<int>(k), aux_coef, z_coef,
                                  grad_scale);
    DeviceTensor ddl = on_device(dt, {n, e}, dl0);
    router_aux_loss_backward(gctx, ddl, gl, dp, gcnt, static_cast<int>(k), aux_coef, z_coef,
                             grad_scale);
    check_grad(download(ddl), hdl.v, dt, "router_aux_loss_backward dlogits");
  }

  // ---- plan from the routing (index-only: once, in f32)
  if (dt == DType::f32) {
    const int64_t slots = n * k;
    Buf<int32_t> off({e + 1}), rt({slots}), sr({slots});
    cpu::moe_permute_plan(cctx, off, rt, sr, idx);
    DeviceTensor goff = poisoned(DType::i32, {e + 1});
    DeviceTensor grt = poisoned(DType::i32, {slots}), gsr = poisoned(DType::i32, {slots});
    moe_permute_plan(gctx, goff, grt, gsr, gidx);
    CHECK(download_i32(goff) == off.v);
    CHECK(download_i32(grt) == rt.v);
    CHECK(download_i32(gsr) == sr.v);
  }
}

void check_routing_all(const RouteCase& rc) {
  for (DType dt : kFloatTypes)
    for (bool norm : {true, false}) check_routing(rc, norm, dt);
}

}  // namespace

TEST_CASE("gpu router: random logits, with and without bias", "[gpu][moe]") {
  check_routing_all(make_case(203, 8, 2, false, false, false, 1, "random"));
  check_routing_all(make_case(203, 8, 2, true, false, false, 2, "random+bias"));
  check_routing_all(make_case(203, 64, 8, false, false, false, 3, "E64 K8"));
  check_routing_all(make_case(203, 64, 8, true, false, false, 4, "E64 K8 +bias"));
  check_routing_all(make_case(1000, 16, 4, true, false, false, 5, "N1000 E16 K4"));
  check_routing_all(make_case(1, 8, 3, false, false, false, 6, "single token"));
  check_routing_all(make_case(37, 100, 40, true, false, false, 7, "E100 K40 (K > warp)"));
}

TEST_CASE("gpu router: group layouts (E not a power of 2, E > 256, K = 1 and K = E)",
          "[gpu][moe]") {
  // The CUDA kernels give each token a group of lanes sized by E: one thread (E <= 8), contiguous
  // 16-byte runs (E a power of 2) or every G-th value (other E), and past E = 256 values that do
  // not fit in registers. Odd token counts leave the last groups of a block without a token.
  check_routing_all(make_case(203, 40, 1, false, false, false, 51, "E40 K1"));
  check_routing_all(make_case(257, 72, 8, true, false, false, 52, "E72 K8 +bias"));
  check_routing_all(make_case(129, 64, 1, false, false, false, 53, "E64 K1"));
  check_routing_all(make_case(131, 8, 8, false, false, false, 54, "E8 K8 (K = E)"));
  check_routing_all(make_case(131, 8, 1, true, false, false, 55, "E8 K1 +bias"));
  check_routing_all(make_case(77, 1, 1, false, false, false, 56, "E1"));
  check_routing_all(make_case(99, 5, 2, false, false, false, 57, "E5 K2"));
  check_routing_all(make_case(51, 128, 2, true, false, false, 58, "E128 K2 +bias"));
  check_routing_all(make_case(33, 256, 8, false, false, false, 59, "E256 K8"));
  check_routing_all(make_case(65, 300, 8, true, false, false, 60, "E300 K8 +bias"));
  check_routing_all(make_case(45, 600, 20, false, false, true, 61, "E600 K20 ties"));
  check_routing_all(make_case(63, 72, 8, false, false, true, 62, "E72 ties"));
  // E > 8192: the per-block counts no longer fit the shared-memory histogram and go straight to
  // the scratch accumulator (several blocks: 4 tokens per block at 32 lanes per token).
  check_routing_all(make_case(37, 8200, 3, false, false, false, 63, "E8200 K3 (global counts)"));
}

TEST_CASE("gpu router: many tokens (grid-stride blocks, counts and aux partials of many blocks)",
          "[gpu][moe]") {
  // More tokens than the capped grid covers in one pass, for E = 8 and E = 64.
  const RouteCase small = make_case(300007, 8, 2, false, false, false, 71, "N300007 E8 K2");
  const RouteCase fine = make_case(70001, 64, 8, true, false, false, 72, "N70001 E64 K8 +bias");
  for (DType dt : {DType::f32, DType::bf16}) {
    check_routing(small, true, dt);
    check_routing(fine, true, dt);
  }
}

TEST_CASE("gpu router: results do not depend on the alignment of the views", "[gpu][moe]") {
  // A logits view one element into its buffer is read without 16-byte vectors; every output must
  // be bitwise the one of an aligned view (the reduction order depends on the shape only).
  Ctx gctx = gpu_ctx();
  for (DType dt : {DType::f32, DType::f16}) {
    const int64_t n = 301, e = 64, k = 8;
    INFO("dtype=" << dtype_name(dt));
    const std::vector<double> lr =
        round_to(dt, uniform_values(static_cast<size_t>(n * e), 81, -2.0, 2.0));
    std::vector<double> padded(1, 0.0);
    padded.insert(padded.end(), lr.begin(), lr.end());
    DeviceTensor aligned = on_device(dt, {n, e}, lr);
    DeviceTensor buf = on_device(dt, {n * e + 1}, padded);
    Tensor shifted(static_cast<char*>(buf.t.data) + dtype_size(dt), dt, gpu0(), {n, e});
    struct Out {
      std::vector<unsigned char> probs, w, loss, dl;
      std::vector<int32_t> idx, counts;
    };
    auto run = [&](Tensor logits) {
      DeviceTensor p = poisoned(dt, {n, e}), w = poisoned(dt, {n, k});
      DeviceTensor idx = poisoned(DType::i32, {n, k}), cnt = poisoned(DType::i32, {e});
      DeviceTensor loss = poisoned(dt, {2});
      router_topk_forward(gctx, p, idx, w, cnt, logits, Tensor(), true);
      router_aux_loss_forward(gctx, loss, logits, p, cnt, static_cast<int>(k), 0.5, 0.1);
      DeviceTensor dl = on_device(dt, {n, e}, std::vector<double>(static_cast<size_t>(n * e), 0.0));
      router_aux_loss_backward(gctx, dl, logits, p, cnt, static_cast<int>(k), 0.5, 0.1, 0.7);
      return Out{bytes_of(p),  bytes_of(w),       bytes_of(loss),
                 bytes_of(dl), download_i32(idx), download_i32(cnt)};
    };
    const Out a = run(aligned), b = run(shifted);
    CHECK(a.idx == b.idx);
    CHECK(a.counts == b.counts);
    CHECK(a.probs == b.probs);
    CHECK(a.w == b.w);
    CHECK(a.loss == b.loss);
    CHECK(a.dl == b.dl);
  }
}

TEST_CASE("gpu router: skewed routing (one hot expert, some experts empty)", "[gpu][moe]") {
  for (bool with_bias : {false, true}) {
    RouteCase rc = make_case(203, 8, 2, with_bias, true, false, 11, "skew E8");
    check_routing_all(rc);
    // The case is what it claims: the last two experts receive no slot.
    Buf<double> l = host({rc.n, rc.e}, rc.logits), p({rc.n, rc.e}), w({rc.n, rc.k});
    Buf<double> b = with_bias ? host({rc.e}, rc.bias) : Buf<double>();
    Buf<int32_t> idx({rc.n, rc.k}), cnt({rc.e});
    Ctx cctx = cpu_ctx();
    cpu::router_topk_forward(cctx, p, idx, w, cnt, l, with_bias ? b.t : Tensor(), true);
    CHECK(cnt[rc.e - 1] == 0);
    CHECK(cnt[rc.e - 2] == 0);
    check_routing_all(make_case(300, 64, 8, with_bias, true, false, 12, "skew E64"));
  }
}

TEST_CASE("gpu router: exact ties resolve to the lower expert index", "[gpu][moe]") {
  check_routing_all(make_case(203, 8, 2, false, false, true, 21, "ties"));
  check_routing_all(make_case(203, 8, 2, true, false, true, 22, "ties+bias"));
  check_routing_all(make_case(203, 64, 8, true, false, true, 23, "ties E64"));
  // All logits equal: every token picks experts 0..K-1 in that order.
  RouteCase flat{50, 8, 3, std::vector<double>(400, 0.5), {}, "all equal"};
  check_routing_all(flat);
}

TEST_CASE("gpu router: bias update", "[gpu][moe]") {
  Ctx cctx = cpu_ctx(), gctx = gpu_ctx();
  for (DType dt : kFloatTypes) {
    for (int64_t e : {8, 64, 300}) {
      INFO("E=" << e << " dtype=" << dtype_name(dt));
      std::vector<double> load(static_cast<size_t>(e));
      std::mt19937_64 rng(static_cast<uint64_t>(e));
      for (auto& x : load) x = static_cast<double>(rng() % 9);  // integer loads: exact mean
      if (e == 8) load = {4, 4, 1, 8, 2, 6, 4, 3};              // mean 4: three with sign 0
      const std::vector<double> b0 =
          round_to(dt, uniform_values(static_cast<size_t>(e), 5 + static_cast<uint64_t>(e)));
      const std::vector<double> lr = round_to(dt, load);
      Buf<double> hb = host({e}, b0), hl = host({e}, lr);
      cpu::router_bias_update(cctx, hb, hl, 0.25);
      DeviceTensor db = on_device(dt, {e}, b0), dl = on_device(dt, {e}, lr);
      router_bias_update(gctx, db, dl, 0.25);
      check_close(download(db), hb.v, dt, 1e-30, "router_bias_update");
    }
  }
}

namespace {

// Device views whose data starts `shift` elements into a larger buffer: shift 1 misaligns every
// row start, which must send the kernels down their scalar path even when d allows 16-byte access.
struct ShiftedTensors {
  int64_t shift = 0;
  std::deque<DeviceTensor> owned;
  Tensor make(DType dt, std::initializer_list<int64_t> dims) {
    int64_t numel = 1;
    for (int64_t x : dims) numel *= x;
    const DeviceTensor& b = owned.emplace_back(dt, std::initializer_list<int64_t>{numel + shift});
    return Tensor(static_cast<char*>(b.t.data) + shift * dtype_size(dt), dt, gpu0(), dims);
  }
  Tensor holding(DType dt, std::initializer_list<int64_t> dims, const std::vector<double>& v) {
    Tensor t = make(dt, dims);
    upload(t, v);
    return t;
  }
  Tensor poisoned(DType dt, std::initializer_list<int64_t> dims) {
    Tensor t = make(dt, dims);
    poison(t);
    return t;
  }
};

// Permute forward and backward (the backward is also the MoE combine) and the routing weights in
// row order on a routing of (n, e, k), model width d; with
// `misaligned`, every activation tensor starts one element past a 16-byte boundary.
void check_permute(int64_t n, int64_t e, int64_t k, int64_t d, DType dt, uint64_t seed,
                   bool misaligned = false) {
  INFO("permute N=" << n << " E=" << e << " K=" << k << " d=" << d << " dtype=" << dtype_name(dt)
                    << " misaligned=" << misaligned);
  Ctx cctx = cpu_ctx(), gctx = gpu_ctx();
  ShiftedTensors dev{misaligned ? 1 : 0, {}};
  const int64_t slots = n * k;
  // Routing and plan on the CPU (the plan itself is compared in the router tests).
  RouteCase rc = make_case(n, e, k, true, false, false, seed, "permute");
  Buf<double> l = host({n, e}, rc.logits), b = host({e}, rc.bias), p({n, e}), w({n, k});
  Buf<int32_t> idx({n, k}), cnt({e}), off({e + 1}), rt({slots}), sr({slots});
  cpu::router_topk_forward(cctx, p, idx, w, cnt, l, b, true);
  cpu::moe_permute_plan(cctx, off, rt, sr, idx);
  DeviceTensor grt(DType::i32, {slots}), gsr(DType::i32, {slots});
  upload_i32(grt, rt.v);
  upload_i32(gsr, sr.v);

  // permute_forward: an exact copy
  const std::vector<double> x = round_to(dt, uniform_values(static_cast<size_t>(n * d), seed + 1));
  Buf<double> hx = host({n, d}, x), hxp({slots, d});
  cpu::permute_forward(cctx, hxp, hx, rt);
  Tensor gx = dev.holding(dt, {n, d}, x), gxp = dev.poisoned(dt, {slots, d});
  permute_forward(gctx, gxp, gx, grt);
  CHECK(download(gxp) == hxp.v);

  // permute_backward: sum of a token's K rows
  const std::vector<double> dxp =
      round_to(dt, uniform_values(static_cast<size_t>(slots * d), seed + 2));
  Buf<double> hdxp = host({slots, d}, dxp), hdx({n, d});
  cpu::permute_backward(cctx, hdx, hdxp, Tensor(), sr);
  Tensor gdxp = dev.holding(dt, {slots, d}, dxp), gdx = dev.poisoned(dt, {n, d});
  permute_backward(gctx, gdx, gdxp, Tensor(), gsr);
  check_grad(download(gdx), hdx.v, dt, "permute_backward");
  // Sums run in a fixed order: a second run gives the same bits.
  const std::vector<unsigned char> dx_bits = bytes_of(gdx);
  poison(gdx);
  permute_backward(gctx, gdx, gdxp, Tensor(), gsr);
  CHECK(bytes_of(gdx) == dx_bits);
  // With a second source (the MoE layer's gradients through w1 and w3) in the same gather.
  const std::vector<double> dxp2 =
      round_to(dt, uniform_values(static_cast<size_t>(slots * d), seed + 7));
  Buf<double> hdxp2 = host({slots, d}, dxp2), hdx2({n, d});
  cpu::permute_backward(cctx, hdx2, hdxp, hdxp2, sr);
  Tensor gdxp2 = dev.holding(dt, {slots, d}, dxp2);
  permute_backward(gctx, gdx, gdxp, gdxp2, gsr);
  check_grad(download(gdx), hdx2.v, dt, "permute_backward with dxp2");
  // permute_backward_add: the MoE combine with the residual add, the sums from base's rows
  const std::vector<double> res =
      round_to(dt, uniform_values(static_cast<size_t>(n * d), seed + 8));
  Buf<double> hres = host({n, d}, res), hy({n, d});
  cpu::permute_backward_add(cctx, hy, hres, hdxp, sr);
  Tensor gres = dev.holding(dt, {n, d}, res), gy = dev.poisoned(dt, {n, d});
  permute_backward_add(gctx, gy, gres, gdxp, gsr);
  check_grad(download(gy), hy.v, dt, "permute_backward_add");

  // permute_weights_forward / _backward (the router's weights in acc_dtype): exact moves
  const DType acc = acc_dtype(dt);
  const std::vector<double> wr = round_to(acc, w.v);
  Buf<double> hw = host({n, k}, wr), hrow({slots}), hdw({n, k});
  cpu::permute_weights_forward(cctx, hrow, hw, sr);
  Tensor gw = dev.holding(acc, {n, k}, wr), grow = dev.poisoned(acc, {slots});
  permute_weights_forward(gctx, grow, gw, gsr);
  CHECK(download(grow) == hrow.v);
  const std::vector<double> drow =
      round_to(acc, uniform_values(static_cast<size_t>(slots), seed + 3));
  Buf<double> hdrow = host({slots}, drow);
  cpu::permute_weights_backward(cctx, hdw, hdrow, sr);
  Tensor gdrow = dev.holding(acc, {slots}, drow), gdw = dev.poisoned(acc, {n, k});
  permute_weights_backward(gctx, gdw, gdrow, gsr);
  CHECK(download(gdw) == hdw.v);

  // A 16-bit routing weight is rejected.
  if (dt != acc) {
    DeviceTensor w16(dt, {n, k});
    CHECK_THROWS_WITH(permute_weights_forward(gctx, grow, w16, gsr),
                      Catch::Contains("permute_weights_forward: topk_w"));
  }
}

}  // namespace

TEST_CASE("gpu permute, its backward (also the combine) and the routing weights", "[gpu][moe]") {
  // d % 8 == 0 takes the 16-byte path in every dtype; other d the scalar one (d = 130: vector in
  // f64 only). Odd token counts, K = 1..8, E not a power of two.
  for (DType dt : kFloatTypes) {
    check_permute(203, 8, 2, 37, dt, 31);
    check_permute(203, 64, 8, 130, dt, 32);
    check_permute(64, 16, 4, 1000, dt, 33);  // rows longer than a block
    check_permute(1, 8, 3, 5, dt, 34);
    check_permute(333, 12, 1, 64, dt, 35);  // top-1
    check_permute(257, 100, 8, 256, dt, 36);
    check_permute(129, 6, 5, 24, dt, 37);  // rows shorter than a lane group
    check_permute(97, 24, 2, 1032, dt, 38);
  }
}

TEST_CASE("gpu permute: rows not 16-byte aligned take the scalar path", "[gpu][moe]") {
  for (DType dt : kFloatTypes) {
    check_permute(203, 64, 8, 128, dt, 41, true);
    check_permute(97, 10, 1, 1032, dt, 42, true);
  }
}

TEST_CASE("gpu permute plan: large, skewed and hand-made routings", "[gpu][moe]") {
  Ctx cctx = cpu_ctx(), gctx = gpu_ctx();
  auto check_plan = [&](int64_t n, int64_t e, int64_t k, const std::vector<int32_t>& experts) {
    INFO("plan N=" << n << " E=" << e << " K=" << k);
    const int64_t slots = n * k;
    Buf<int32_t> idx({n, k}), off({e + 1}), rt({slots}), sr({slots});
    idx.v = experts;
    cpu::moe_permute_plan(cctx, off, rt, sr, idx);
    DeviceTensor gidx(DType::i32, {n, k});
    upload_i32(gidx, experts);
    DeviceTensor goff = poisoned(DType::i32, {e + 1});
    DeviceTensor grt = poisoned(DType::i32, {slots}), gsr = poisoned(DType::i32, {slots});
    moe_permute_plan(gctx, goff, grt, gsr, gidx);
    CHECK(download_i32(goff) == off.v);
    CHECK(download_i32(grt) == rt.v);
    CHECK(download_i32(gsr) == sr.v);
  };
  std::mt19937_64 rng(41);
  // Many slots (several chunks of the placement kernel), E = 64, K = 8, skewed: expert 5 gets
  // about half of the slots, experts >= 60 none. (Not a valid top-K: repeats within a token are
  // fine for the plan.)
  {
    const int64_t n = 4099, e = 64, k = 8;
    std::vector<int32_t> ex(static_cast<size_t>(n * k));
    for (auto& x : ex) x = rng() % 2 ? 5 : static_cast<int32_t>(rng() % 60);
    check_plan(n, e, k, ex);
  }
  // Every slot to the last expert; every slot to expert 0.
  check_plan(777, 8, 2, std::vector<int32_t>(1554, 7));
  check_plan(777, 8, 2, std::vector<int32_t>(1554, 0));
  // E = 1.
  check_plan(203, 1, 1, std::vector<int32_t>(203, 0));
  // Uniform routings over the tiling's regimes: many tiles (moe-fine, moe-small and E = 256
  // shapes), E not a power of two, fewer slots than experts (one tile), E large enough that a
  // block holds fewer warps' counters, and the largest E the CUDA plan takes.
  auto uniform = [&](int64_t n, int64_t e, int64_t k) {
    std::vector<int32_t> ex(static_cast<size_t>(n * k));
    for (auto& x : ex) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(e));
    check_plan(n, e, k, ex);
  };
  uniform(16384, 64, 8);
  uniform(16384, 8, 2);
  uniform(16384, 256, 8);
  uniform(16383, 100, 7);
  uniform(333, 12, 1);
  uniform(1, 8, 3);
  uniform(5000, 1000, 4);
  uniform(700, 5000, 8);
  uniform(3, 12288, 2);
  // Asked twice: the same positions every run.
  {
    const int64_t n = 2049, e = 24, k = 8;
    std::vector<int32_t> ex(static_cast<size_t>(n * k));
    for (auto& x : ex) x = static_cast<int32_t>(rng() % 3 ? rng() % e : 7);
    check_plan(n, e, k, ex);
    check_plan(n, e, k, ex);
  }
}

TEST_CASE("gpu add_counts: expert loads summed over micro-batches on the device", "[gpu][moe]") {
  Ctx cctx = cpu_ctx(), gctx = gpu_ctx();
  for (DType dt : {DType::f32, DType::f64}) {
    for (int64_t e : {1, 8, 300}) {
      INFO("E=" << e << " dtype=" << dtype_name(dt));
      std::vector<double> acc0(static_cast<size_t>(e));
      std::vector<int32_t> c1(static_cast<size_t>(e)), c2(static_cast<size_t>(e));
      std::mt19937_64 rng(static_cast<uint64_t>(e));
      for (auto& a : acc0) a = static_cast<double>(rng() % 100000);  // earlier micro-batches
      for (auto& c : c1) c = static_cast<int32_t>(rng() % 1000);
      for (auto& c : c2) c = static_cast<int32_t>(rng() % 1000);
      Buf<double> hacc = host({e}, acc0);
      cpu::add_counts(cctx, hacc, host_i32(c1));
      cpu::add_counts(cctx, hacc, host_i32(c2));
      DeviceTensor gacc = on_device(dt, {e}, acc0);
      DeviceTensor g1(DType::i32, {e}), g2(DType::i32, {e});
      upload_i32(g1, c1);
      upload_i32(g2, c2);
      add_counts(gctx, gacc, g1);
      add_counts(gctx, gacc, g2);
      // Integer loads far below 2^24: exact in f32 too, so the sums must match bit for bit.
      CHECK(download(gacc) == hacc.v);
    }
  }
  DeviceTensor acc16(DType::bf16, {4}), counts(DType::i32, {4});
  CHECK_THROWS_WITH(add_counts(gctx, acc16, counts), Catch::Contains("add_counts: acc"));
}
