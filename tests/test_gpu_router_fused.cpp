// The routers in one op (router_forward, mod_route; kernels/cuda/router_fused.cu) against their
// two halves. The products (logits, MoD scores) against an f64 reference on the same rounded
// inputs, within rtol_for(acc_dtype(x)) of (|ref| + max|ref|) (fp32's; f64's for f64 x): the fused
// path sums exact tf32 products on tensor cores in another order than router_logits_forward. The
// routing and the selection are checked bitwise against router_topk_forward and mod_select run on
// the fused op's own logits and scores (those ops have their own CPU-oracle tests). Outputs are
// poisoned before each call, a second call must give the same bits (the tickets and counters
// reset themselves), and the shapes take both paths: the one-launch kernel (16-bit x, d a multiple
// of 8, E <= 8) and the two ops in turn (f32 or f64 x, E = 16, d = 100). router_logits_forward
// gives router_forward's logits bitwise (at the one-launch shape it takes the same tensor-core
// product).
#include <cstdint>
#include <vector>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "moe/ops/mod.hpp"
#include "moe/ops/router.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

// out[n, e] = sum_k x[n, k] w[e, k] in double.
std::vector<double> product(const std::vector<double>& x, const std::vector<double>& w, int64_t n,
                            int64_t d, int64_t e) {
  std::vector<double> out(static_cast<size_t>(n * e), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < e; ++j) {
      double s = 0;
      for (int64_t q = 0; q < d; ++q) s += x[size_t(i * d + q)] * w[size_t(j * d + q)];
      out[size_t(i * e + j)] = s;
    }
  return out;
}

struct RouterBits {
  std::vector<unsigned char> logits, probs, idx, w, counts;
  bool operator==(const RouterBits& o) const {
    return logits == o.logits && probs == o.probs && idx == o.idx && w == o.w && counts == o.counts;
  }
};

void check_router(DType dt, int64_t n, int64_t d, int64_t e, int64_t k, bool with_bias, bool norm,
                  uint64_t seed) {
  INFO(dtype_name(dt) << " N=" << n << " d=" << d << " E=" << e << " K=" << k
                      << (with_bias ? " bias" : "") << (norm ? " norm" : ""));
  const DType acc = acc_dtype(dt);
  const std::vector<double> xv = rounded_random_values(dt, size_t(n * d), seed);
  const std::vector<double> wv = rounded_random_values(acc, size_t(e * d), seed + 1, -0.1, 0.1);
  const std::vector<double> bv = rounded_random_values(acc, size_t(e), seed + 2, -0.2, 0.2);
  DeviceTensor x = on_device(dt, {n, d}, xv), w = on_device(acc, {e, d}, wv);
  DeviceTensor bias = on_device(acc, {e}, bv);
  Ctx ctx = gpu_ctx();
  auto run = [&](std::vector<double>* logits_out) {
    DeviceTensor logits = poisoned(acc, {n, e}), probs = poisoned(acc, {n, e});
    DeviceTensor idx = poisoned(DType::i32, {n, k}), tw = poisoned(acc, {n, k});
    DeviceTensor counts = poisoned(DType::i32, {e});
    router_forward(ctx, logits, probs, idx, tw, counts, x, w, with_bias ? Tensor(bias) : Tensor(),
                   norm);
    // The routing half against router_topk_forward on the same logits: bitwise.
    DeviceTensor probs2 = poisoned(acc, {n, e}), idx2 = poisoned(DType::i32, {n, k});
    DeviceTensor tw2 = poisoned(acc, {n, k}), counts2 = poisoned(DType::i32, {e});
    router_topk_forward(ctx, probs2, idx2, tw2, counts2, logits,
                        with_bias ? Tensor(bias) : Tensor(), norm);
    CHECK(bytes_of(probs) == bytes_of(probs2));
    CHECK(bytes_of(idx) == bytes_of(idx2));
    CHECK(bytes_of(tw) == bytes_of(tw2));
    CHECK(bytes_of(counts) == bytes_of(counts2));
    int64_t routed = 0;
    for (int32_t c : download_i32(counts)) routed += c;
    CHECK(routed == n * k);
    // router_logits_forward takes the same product at this shape (or the same fallback): the same
    // logits, bitwise.
    DeviceTensor logits2 = poisoned(acc, {n, e});
    router_logits_forward(ctx, logits2, x, w);
    CHECK(bytes_of(logits2) == bytes_of(logits));
    if (logits_out) *logits_out = download(logits);
    return RouterBits{bytes_of(logits), bytes_of(probs), bytes_of(idx), bytes_of(tw),
                      bytes_of(counts)};
  };
  std::vector<double> logits;
  const RouterBits first = run(&logits);
  expect_close(logits, product(xv, wv, n, d, e), rtol_for(acc), "logits");
  CHECK(run(nullptr) == first);
}

void check_mod(DType dt, int64_t b, int64_t t, int64_t c, int64_t d, uint64_t seed) {
  INFO(dtype_name(dt) << " B=" << b << " T=" << t << " C=" << c << " d=" << d);
  const DType acc = acc_dtype(dt);
  const int64_t n = b * t;
  const std::vector<double> xv = rounded_random_values(dt, size_t(n * d), seed);
  const std::vector<double> wv = rounded_random_values(acc, size_t(d), seed + 1, -0.1, 0.1);
  DeviceTensor x = on_device(dt, {n, d}, xv), w = on_device(acc, {1, d}, wv);
  Ctx ctx = gpu_ctx();
  auto run = [&](std::vector<double>* scores_out) {
    DeviceTensor scores = poisoned(acc, {b, t}), sel = poisoned(DType::i32, {b, c});
    DeviceTensor mask = poisoned(acc, {b, t});
    mod_route(ctx, scores, sel, mask, x, w);
    // The selection half against mod_select on the same scores: bitwise.
    DeviceTensor sel2 = poisoned(DType::i32, {b, c}), mask2 = poisoned(acc, {b, t});
    mod_select(ctx, sel2, mask2, scores);
    CHECK(bytes_of(sel) == bytes_of(sel2));
    CHECK(bytes_of(mask) == bytes_of(mask2));
    if (scores_out) *scores_out = download(scores);
    return std::vector<std::vector<unsigned char>>{bytes_of(scores), bytes_of(sel), bytes_of(mask)};
  };
  std::vector<double> scores;
  const auto first = run(&scores);
  expect_close(scores, product(xv, wv, n, d, 1), rtol_for(acc), "scores");
  CHECK(run(nullptr) == first);
}

}  // namespace

TEST_CASE("gpu router_forward: the logits and routing of router_logits + router_topk",
          "[gpu][router_fused]") {
  for (DType dt : {DType::bf16, DType::f16}) {
    check_router(dt, 16384, 1024, 8, 2, false, true, 1);  // moe-small's shape
    check_router(dt, 1000, 512, 8, 2, false, true, 2);    // N not a multiple of 32
    check_router(dt, 333, 200, 6, 3, true, false, 3);     // a partial k-block, bias, E = 6
    check_router(dt, 77, 8, 4, 4, false, true, 4);        // d = 8: one chunk, K = E
    check_router(dt, 45, 64, 1, 1, true, true, 5);        // E = 1
    check_router(dt, 1, 1024, 8, 2, false, true, 6);      // one token
  }
  // The two ops in turn: f32 x, E past 8, d not a multiple of 8.
  check_router(DType::f32, 500, 256, 8, 2, false, true, 7);
  check_router(DType::f64, 333, 64, 6, 3, true, false, 10);  // f64: the two ops, f64 bounds
  check_router(DType::bf16, 500, 256, 16, 4, false, true, 8);
  check_router(DType::bf16, 500, 100, 8, 2, true, true, 9);
}

// MOE_MOD_ROUTE_PDL=0: the one launch; 1 (sm_90, the default there): the product, then the
// selection launched as its programmatic dependent: the same bits either way.
TEST_CASE("gpu mod_route: the scores and selection of router_logits + mod_select",
          "[gpu][router_fused]") {
  const std::string pdl = GENERATE(as<std::string>{}, "0", "1");
  setenv("MOE_MOD_ROUTE_PDL", pdl.c_str(), 1);
  INFO("MOE_MOD_ROUTE_PDL=" << pdl);
  for (DType dt : {DType::bf16, DType::f16}) {
    check_mod(dt, 16, 1024, 128, 1024, 11);  // moe-small's MoD shape
    check_mod(dt, 5, 777, 97, 256, 12);      // T not a multiple of a block's 32 rows
    check_mod(dt, 7, 10, 3, 64, 13);         // blocks that finish several sequences
    check_mod(dt, 3, 40, 40, 32, 14);        // C = T
    check_mod(dt, 2, 50, 1, 8, 15);          // C = 1, d = 8
    check_mod(dt, 2, 5000, 300, 64, 18);     // T past the scores staged in shared memory
  }
  check_mod(DType::f32, 4, 100, 13, 64, 16);   // the two ops in turn
  check_mod(DType::f64, 3, 77, 9, 64, 19);     // f64: the two ops, f64 bounds
  check_mod(DType::bf16, 4, 100, 13, 60, 17);  // d not a multiple of 8
  unsetenv("MOE_MOD_ROUTE_PDL");
}
