// The routers in one op on the CPU (router_forward, mod_route): each must give the bits of its two
// ops in turn (router_logits_forward then router_topk_forward; router_logits_forward then
// mod_select), which have their own tests against double references, on random non-zero inputs in
// f32 and f64, with and without the selection bias and the renormalisation; and mod_route names
// itself when its scores are not [B, T] (a shape check: InternalError, as the other ops').
#include <cstdint>
#include <cstring>
#include <vector>

#include "catch.hpp"
#include "moe/ops/mod.hpp"
#include "moe/ops/router.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

// A host tensor of dtype dt (f32 / f64 / i32) and shape dims, filled from v (or zeros).
struct Any {
  std::vector<double> store;  // 8 bytes a value: room for any of the three dtypes
  Tensor t;
  Any(DType dt, std::initializer_list<int64_t> dims, const std::vector<double>& v = {}) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    store.assign(static_cast<size_t>(n), 0.0);
    t = Tensor(store.data(), dt, Device{}, dims);
    for (int64_t i = 0; i < n && !v.empty(); ++i) {
      if (dt == DType::f64) t.ptr<double>()[i] = v[size_t(i)];
      if (dt == DType::f32) t.ptr<float>()[i] = static_cast<float>(v[size_t(i)]);
    }
  }
  bool same_bits(const Any& o) const {
    return t.nbytes() == o.t.nbytes() && std::memcmp(t.data, o.t.data, t.nbytes()) == 0;
  }
  operator Tensor() const { return t; }
};

std::vector<double> values(size_t n, uint64_t seed, double scale) {
  Buf<double> b({static_cast<int64_t>(n)});
  fill_uniform(b, seed, -scale, scale);
  return b.v;
}

}  // namespace

TEST_CASE("router_forward on the CPU is router_logits_forward then router_topk_forward",
          "[router_fused]") {
  Ctx ctx = cpu_ctx();
  for (DType dt : {DType::f32, DType::f64})
    for (bool with_bias : {false, true})
      for (bool norm : {true, false}) {
        INFO(dtype_name(dt) << (with_bias ? " bias" : "") << (norm ? " norm_topk_prob" : " raw"));
        const int64_t n = 37, d = 24, e = 6, k = 2;
        Any x(dt, {n, d}, values(size_t(n * d), 1, 1.0)),
            w(dt, {e, d}, values(size_t(e * d), 2, 0.3));
        Any bias(dt, {e}, values(size_t(e), 3, 0.2));
        const Tensor b = with_bias ? Tensor(bias) : Tensor();
        Any l1(dt, {n, e}), p1(dt, {n, e}), i1(DType::i32, {n, k}), w1(dt, {n, k}),
            c1(DType::i32, {e});
        Any l2(dt, {n, e}), p2(dt, {n, e}), i2(DType::i32, {n, k}), w2(dt, {n, k}),
            c2(DType::i32, {e});
        router_forward(ctx, l1, p1, i1, w1, c1, x, w, b, norm);
        router_logits_forward(ctx, l2, x, w);
        router_topk_forward(ctx, p2, i2, w2, c2, l2, b, norm);
        CHECK(l1.same_bits(l2));
        CHECK(p1.same_bits(p2));
        CHECK(i1.same_bits(i2));
        CHECK(w1.same_bits(w2));
        CHECK(c1.same_bits(c2));
        int64_t routed = 0;
        for (int64_t j = 0; j < e; ++j) routed += c1.t.ptr<int32_t>()[j];
        CHECK(routed == n * k);
      }
}

TEST_CASE("mod_route on the CPU is router_logits_forward then mod_select", "[router_fused]") {
  Ctx ctx = cpu_ctx();
  for (DType dt : {DType::f32, DType::f64}) {
    INFO(dtype_name(dt));
    const int64_t b = 3, t = 20, c = 5, d = 16;
    Any x(dt, {b * t, d}, values(size_t(b * t * d), 4, 1.0)),
        w(dt, {1, d}, values(size_t(d), 5, 0.3));
    Any s1(dt, {b, t}), sel1(DType::i32, {b, c}), m1(dt, {b, t});
    Any s2(dt, {b, t}), sel2(DType::i32, {b, c}), m2(dt, {b, t});
    mod_route(ctx, s1, sel1, m1, x, w);
    router_logits_forward(ctx, Tensor(s2).view({b * t, 1}), x, w);
    mod_select(ctx, sel2, m2, s2);
    CHECK(s1.same_bits(s2));
    CHECK(sel1.same_bits(sel2));
    CHECK(m1.same_bits(m2));
  }
  Any x(DType::f32, {6, 4}, values(24, 6, 1.0)), w(DType::f32, {1, 4}, values(4, 7, 1.0));
  Any flat(DType::f32, {6}), sel(DType::i32, {1, 2}), mask(DType::f32, {1, 6});
  std::string msg;
  try {
    mod_route(ctx, flat, sel, mask, x, w);
  } catch (const InternalError& err) {
    msg = err.what();
  }
  CHECK(contains(msg, "mod_route"));
  CHECK(contains(msg, "[B, T]"));
}
