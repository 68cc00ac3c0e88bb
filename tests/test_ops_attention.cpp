// Tests of the CPU rotary embedding and causal grouped-query attention. RoPE: the table and a
// hand-computed rotation with the rotate-half pairing (i, i + hd/2), backward undoing forward, and
// finite differences. Attention: the first position attends only to itself, a uniform-score case,
// the GQA head mapping (heads 0,1 -> kv head 0, heads 2,3 -> kv head 1), a naive full-softmax
// reference, finite differences for dq/dk/dv (f64, h = 1e-6, rtol 1e-6: the truncation + rounding
// error is ~1e-10 on these O(1) losses), f32 vs f64 agreement and thread-count independence.
#include <omp.h>

#include <cmath>
#include <vector>

#include "catch.hpp"
#include "moe/ops/attention.hpp"
#include "moe/ops/rope.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

// ---- RoPE ---------------------------------------------------------------------------------------

TEST_CASE("rope_table holds cos and sin of p * theta^(-2j/hd)", "[rope]") {
  Ctx ctx = cpu_ctx();
  const int64_t max_pos = 6, half = 3;  // hd = 6
  Buf<double> cos_t({max_pos, half}), sin_t({max_pos, half});
  rope_table(ctx, cos_t, sin_t, 500.0);
  for (int64_t p = 0; p < max_pos; ++p)
    for (int64_t j = 0; j < half; ++j) {
      const double angle = p * std::pow(500.0, -2.0 * j / 6.0);
      CHECK(cos_t[p * half + j] == Approx(std::cos(angle)).epsilon(1e-14));
      CHECK(sin_t[p * half + j] == Approx(std::sin(angle)).margin(1e-15));
    }
}

TEST_CASE("rope_forward rotates pairs (i, i + hd/2) on a known vector", "[rope]") {
  Ctx ctx = cpu_ctx();
  // hd = 4, theta = 10000: inv_freq = [1, 0.01]. Row 0 at position 0, row 1 at position 1.
  Buf<double> cos_t({2, 2}), sin_t({2, 2});
  rope_table(ctx, cos_t, sin_t, 10000.0);
  Buf<double> x({2, 1, 4});
  x.v = {1, 2, 3, 4, 1, 2, 3, 4};
  Buf<int32_t> pos({2});
  pos.v = {0, 1};
  rope_forward(ctx, x, pos, cos_t, sin_t);
  // Position 0: unchanged.
  CHECK(x[0] == 1);
  CHECK(x[1] == 2);
  CHECK(x[2] == 3);
  CHECK(x[3] == 4);
  // Position 1: (x0, x2) = (1, 3) turns by 1 rad, (x1, x3) = (2, 4) by 0.01 rad:
  // y0 = 1 cos1 - 3 sin1, y1 = 2 cos.01 - 4 sin.01, y2 = 3 cos1 + 1 sin1, y3 = 4 cos.01 + 2 sin.01.
  CHECK(x[4] == Approx(-1.9841106485555495).epsilon(1e-13));
  CHECK(x[5] == Approx(1.959900667496664).epsilon(1e-13));
  CHECK(x[6] == Approx(2.4623779024123156).epsilon(1e-13));
  CHECK(x[7] == Approx(4.019799668334994).epsilon(1e-13));
}

TEST_CASE("rope_backward undoes rope_forward and matches finite differences", "[rope][grad]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 5, heads = 3, hd = 8, max_pos = 16;
  Buf<double> cos_t({max_pos, hd / 2}), sin_t({max_pos, hd / 2});
  rope_table(ctx, cos_t, sin_t, 10000.0);
  Buf<int32_t> pos({n});
  pos.v = {0, 3, 7, 15, 3};
  Buf<double> x = random_buf({n, heads, hd}, 1);
  Buf<double> y = x;
  rope_forward(ctx, y, pos, cos_t, sin_t);
  bool changed = false;
  for (size_t i = 0; i < y.size(); ++i) changed = changed || std::fabs(y[i] - x[i]) > 1e-3;
  CHECK(changed);
  Buf<double> back = y;
  rope_backward(ctx, back, pos, cos_t, sin_t);
  for (size_t i = 0; i < x.size(); ++i) CHECK(back[i] == Approx(x[i]).margin(1e-14));

  // d/dx dot(w, rope(x)) = rope_backward(w). Linear map: rtol 1e-7.
  Buf<double> w = random_buf({n, heads, hd}, 2), tmp({n, heads, hd});
  auto loss = [&] {
    tmp.v = x.v;
    rope_forward(ctx, tmp, pos, cos_t, sin_t);
    return dot(w.v, tmp.v);
  };
  Buf<double> dx = w;
  rope_backward(ctx, dx, pos, cos_t, sin_t);
  check_gradient(x.v, dx.v, loss, 1e-6, 1e-7, 1e-9, "rope dx");

  Buf<int32_t> bad({n});
  bad.v = {0, 1, 2, 16, 4};  // 16 is past the table
  CHECK_THROWS_AS(rope_forward(ctx, y, bad, cos_t, sin_t), InternalError);
}

TEST_CASE("rope f32 agrees with f64", "[rope][f32]") {
  Ctx ctx = cpu_ctx();
  const int64_t n = 7, heads = 2, hd = 16, max_pos = 64;
  Buf<double> cos_t({max_pos, hd / 2}), sin_t({max_pos, hd / 2});
  Buf<float> cos_f({max_pos, hd / 2}), sin_f({max_pos, hd / 2});
  rope_table(ctx, cos_t, sin_t, 10000.0);
  rope_table(ctx, cos_f, sin_f, 10000.0);
  Buf<int32_t> pos({n});
  pos.v = {0, 1, 5, 63, 40, 2, 9};
  Buf<double> x = random_buf({n, heads, hd}, 3);
  Buf<float> xf = to_f32(x);
  rope_forward(ctx, x, pos, cos_t, sin_t);
  rope_forward(ctx, xf, pos, cos_f, sin_f);
  CHECK(max_rel_diff(xf.v, x.v) < 1e-6);
}

// ---- attention ----------------------------------------------------------------------------------

namespace {

struct AttnShape {
  int64_t b, t, nh, nkv, hd;
};

// Reference: explicit causal softmax(q k^T / sqrt(hd)) v with query head h reading kv head
// h / (nh / nkv). Returns out [B, T, nh, hd] and fills lse [B, nh, T].
std::vector<double> naive_attention(const AttnShape& s, const std::vector<double>& q,
                                    const std::vector<double>& k, const std::vector<double>& v,
                                    std::vector<double>* lse) {
  std::vector<double> out(static_cast<size_t>(s.b * s.t * s.nh * s.hd), 0.0);
  if (lse) lse->assign(static_cast<size_t>(s.b * s.nh * s.t), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.hd));
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t h = 0; h < s.nh; ++h) {
      const int64_t g = h / (s.nh / s.nkv);
      for (int64_t i = 0; i < s.t; ++i) {
        std::vector<double> score(static_cast<size_t>(i + 1));
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double d = 0;
          for (int64_t c = 0; c < s.hd; ++c)
            d += q[((b * s.t + i) * s.nh + h) * s.hd + c] *
                 k[((b * s.t + j) * s.nkv + g) * s.hd + c];
          score[j] = std::exp(d * scale);
          sum += score[j];
        }
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t c = 0; c < s.hd; ++c)
            out[((b * s.t + i) * s.nh + h) * s.hd + c] +=
                score[j] / sum * v[((b * s.t + j) * s.nkv + g) * s.hd + c];
        if (lse) (*lse)[(b * s.nh + h) * s.t + i] = std::log(sum);
      }
    }
  return out;
}

template <class T>
struct AttnBufs {
  Buf<T> q, k, v, out, lse;
  explicit AttnBufs(const AttnShape& s)
      : q({s.b, s.t, s.nh, s.hd}),
        k({s.b, s.t, s.nkv, s.hd}),
        v({s.b, s.t, s.nkv, s.hd}),
        out({s.b, s.t, s.nh, s.hd}),
        lse({s.b, s.nh, s.t}) {}
};

AttnBufs<double> random_attn(const AttnShape& s, uint64_t seed) {
  AttnBufs<double> a(s);
  fill_uniform(a.q, seed);
  fill_uniform(a.k, seed + 1);
  fill_uniform(a.v, seed + 2);
  for (auto& x : a.q.v) x *= 2;  // sharper softmax than uniform-ish scores
  return a;
}

}  // namespace

TEST_CASE("attention: the first position attends only to itself", "[attention]") {
  Ctx ctx = cpu_ctx();
  const AttnShape s{2, 3, 2, 1, 4};
  AttnBufs<double> a = random_attn(s, 10);
  attention_forward(ctx, a.out, a.lse, a.q, a.k, a.v);
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t h = 0; h < s.nh; ++h) {
      for (int64_t c = 0; c < s.hd; ++c)
        CHECK(a.out[((b * s.t) * s.nh + h) * s.hd + c] ==
              Approx(a.v[(b * s.t) * s.nkv * s.hd + c]).epsilon(1e-14));
      double qk = 0;
      for (int64_t c = 0; c < s.hd; ++c)
        qk += a.q[((b * s.t) * s.nh + h) * s.hd + c] * a.k[(b * s.t) * s.nkv * s.hd + c];
      CHECK(a.lse[(b * s.nh + h) * s.t] == Approx(qk / 2.0).epsilon(1e-13));  // sqrt(hd) = 2
    }
}

TEST_CASE("attention: equal keys give uniform weights over the causal prefix", "[attention]") {
  Ctx ctx = cpu_ctx();
  const AttnShape s{1, 5, 1, 1, 3};
  AttnBufs<double> a = random_attn(s, 20);
  for (int64_t j = 1; j < s.t; ++j)
    for (int64_t c = 0; c < s.hd; ++c) a.k[j * s.hd + c] = a.k[c];  // every key = key 0
  attention_forward(ctx, a.out, a.lse, a.q, a.k, a.v);
  for (int64_t i = 0; i < s.t; ++i) {
    double qk = 0;
    for (int64_t c = 0; c < s.hd; ++c) qk += a.q[i * s.hd + c] * a.k[c];
    for (int64_t c = 0; c < s.hd; ++c) {
      double mean = 0;
      for (int64_t j = 0; j <= i; ++j) mean += a.v[j * s.hd + c] / (i + 1);
      CHECK(a.out[i * s.hd + c] == Approx(mean).epsilon(1e-13));
    }
    CHECK(a.lse[i] == Approx(qk / std::sqrt(3.0) + std::log(i + 1.0)).epsilon(1e-13));
  }
}

TEST_CASE("attention: GQA maps heads 0,1 to kv head 0 and heads 2,3 to kv head 1", "[attention]") {
  Ctx ctx = cpu_ctx();
  const AttnShape s{1, 3, 4, 2, 2};
  AttnBufs<double> a(s);
  // q is the same for every head, so only the kv head a head reads tells the heads apart: kv head
  // 0 has values in [1, 3.25], kv head 1 in [10, 12.25] and different keys.
  const double kq[3][2] = {{0.3, -0.2}, {0.9, 0.4}, {-0.5, 0.7}};
  for (int64_t t = 0; t < s.t; ++t)
    for (int64_t h = 0; h < s.nh; ++h)
      for (int64_t c = 0; c < s.hd; ++c) a.q[(t * s.nh + h) * s.hd + c] = kq[t][c];
  for (int64_t t = 0; t < s.t; ++t)
    for (int64_t g = 0; g < s.nkv; ++g)
      for (int64_t c = 0; c < s.hd; ++c) {
        a.k[(t * s.nkv + g) * s.hd + c] = (g == 0 ? 1.0 : -1.5) * kq[(t + c) % 3][c];
        a.v[(t * s.nkv + g) * s.hd + c] = (g == 0 ? 1.0 : 10.0) + t + 0.25 * c;
      }
  attention_forward(ctx, a.out, a.lse, a.q, a.k, a.v);
  // Position 0 reads exactly the v row of its kv head.
  for (int64_t h = 0; h < s.nh; ++h)
    for (int64_t c = 0; c < s.hd; ++c)
      CHECK(a.out[h * s.hd + c] == Approx(a.v[(h / 2) * s.hd + c]).epsilon(1e-14));
  // Every position matches the reference with mapping h / (nh / nkv) ...
  const std::vector<double> want = naive_attention(s, a.q.v, a.k.v, a.v.v, nullptr);
  for (size_t i = 0; i < want.size(); ++i) CHECK(a.out[i] == Approx(want[i]).epsilon(1e-13));
  // ... and differs from the interleaved mapping h % nkv (heads 1 and 2 would swap).
  for (int64_t t = 0; t < s.t; ++t)
    for (int64_t h : {1, 2})
      CHECK(std::fabs(a.out[(t * s.nh + h) * s.hd] - a.out[(t * s.nh + (h == 1 ? 2 : 1)) * s.hd]) >
            1.0);
}

TEST_CASE("attention_forward matches a naive full-softmax reference", "[attention]") {
  Ctx ctx = cpu_ctx();
  const AttnShape s{2, 6, 4, 2, 5};
  AttnBufs<double> a = random_attn(s, 30);
  attention_forward(ctx, a.out, a.lse, a.q, a.k, a.v);
  std::vector<double> lse;
  const std::vector<double> want = naive_attention(s, a.q.v, a.k.v, a.v.v, &lse);
  for (size_t i = 0; i < want.size(); ++i) CHECK(a.out[i] == Approx(want[i]).epsilon(1e-12));
  for (size_t i = 0; i < lse.size(); ++i) CHECK(a.lse[i] == Approx(lse[i]).epsilon(1e-12));
  CHECK_THROWS_AS(attention_forward(ctx, a.out, a.lse, a.q, a.q, a.v), InternalError);  // k shape
}

TEST_CASE("attention_backward matches finite differences", "[attention][grad]") {
  Ctx ctx = cpu_ctx();
  const AttnShape s{2, 4, 4, 2, 3};
  AttnBufs<double> a = random_attn(s, 40);
  Buf<double> w = random_buf({s.b, s.t, s.nh, s.hd}, 44);
  auto loss = [&] {
    attention_forward(ctx, a.out, a.lse, a.q, a.k, a.v);
    return dot(w.v, a.out.v);
  };
  loss();
  // Garbage in the gradients: the op must overwrite them.
  Buf<double> dq = random_buf({s.b, s.t, s.nh, s.hd}, 45);
  Buf<double> dk = random_buf({s.b, s.t, s.nkv, s.hd}, 46);
  Buf<double> dv = random_buf({s.b, s.t, s.nkv, s.hd}, 47);
  attention_backward(ctx, dq, dk, dv, w, a.q, a.k, a.v, a.out, a.lse, Tensor());
  check_gradient(a.q.v, dq.v, loss, 1e-6, 1e-6, 1e-9, "dq");
  check_gradient(a.k.v, dk.v, loss, 1e-6, 1e-6, 1e-9, "dk");
  check_gradient(a.v.v, dv.v, loss, 1e-6, 1e-6, 1e-9, "dv");

  // A dq scratch (the GPU's one-pass sum) is checked and changes nothing on the CPU; a wrong one
  // is named.
  loss();  // the saved out and lse of the unperturbed inputs again
  attention_backward(ctx, dq, dk, dv, w, a.q, a.k, a.v, a.out, a.lse, Tensor());
  const std::vector<double> dq_ref = dq.v;
  Buf<float> acc({s.b, s.nh, s.t, s.hd});
  attention_backward(ctx, dq, dk, dv, w, a.q, a.k, a.v, a.out, a.lse, acc);
  CHECK(dq.v == dq_ref);
  Buf<float> acc_shape({s.b, s.nh, s.t, s.hd + 1});
  Buf<double> acc_f64({s.b, s.nh, s.t, s.hd});
  CHECK_THROWS_WITH(attention_backward(ctx, dq, dk, dv, w, a.q, a.k, a.v, a.out, a.lse, acc_shape),
                    Catch::Contains("attention_backward: dq_acc"));
  CHECK_THROWS_WITH(attention_backward(ctx, dq, dk, dv, w, a.q, a.k, a.v, a.out, a.lse, acc_f64),
                    Catch::Contains("attention_backward: dq_acc must be f32, got f64"));
}

TEST_CASE("attention f32 agrees with f64 and is thread-count independent", "[attention][f32]") {
  Ctx ctx = cpu_ctx();
  const AttnShape s{2, 17, 4, 2, 8};
  AttnBufs<double> a = random_attn(s, 50);
  Buf<double> dout = random_buf({s.b, s.t, s.nh, s.hd}, 55);
  Buf<double> dq({s.b, s.t, s.nh, s.hd}), dk({s.b, s.t, s.nkv, s.hd}), dv({s.b, s.t, s.nkv, s.hd});
  attention_forward(ctx, a.out, a.lse, a.q, a.k, a.v);
  attention_backward(ctx, dq, dk, dv, dout, a.q, a.k, a.v, a.out, a.lse, Tensor());

  AttnBufs<float> f(s);
  f.q = to_f32(a.q);
  f.k = to_f32(a.k);
  f.v = to_f32(a.v);
  Buf<float> doutf = to_f32(dout);
  Buf<float> dqf({s.b, s.t, s.nh, s.hd}), dkf({s.b, s.t, s.nkv, s.hd}),
      dvf({s.b, s.t, s.nkv, s.hd});
  attention_forward(ctx, f.out, f.lse, f.q, f.k, f.v);
  attention_backward(ctx, dqf, dkf, dvf, doutf, f.q, f.k, f.v, f.out, f.lse, Tensor());
  CHECK(max_rel_diff(f.out.v, a.out.v) < 1e-5);
  CHECK(max_rel_diff(f.lse.v, a.lse.v) < 1e-5);
  CHECK(max_rel_diff(dqf.v, dq.v) < 1e-5);
  CHECK(max_rel_diff(dkf.v, dk.v) < 1e-5);
  CHECK(max_rel_diff(dvf.v, dv.v) < 1e-5);

  Buf<float> out1({s.b, s.t, s.nh, s.hd}), lse1({s.b, s.nh, s.t});
  Buf<float> dq1({s.b, s.t, s.nh, s.hd}), dk1({s.b, s.t, s.nkv, s.hd}),
      dv1({s.b, s.t, s.nkv, s.hd});
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  attention_forward(ctx, out1, lse1, f.q, f.k, f.v);
  attention_backward(ctx, dq1, dk1, dv1, doutf, f.q, f.k, f.v, out1, lse1, Tensor());
  omp_set_num_threads(saved);
  CHECK(out1.v == f.out.v);
  CHECK(lse1.v == f.lse.v);
  CHECK(dq1.v == dqf.v);
  CHECK(dk1.v == dkf.v);
  CHECK(dv1.v == dvf.v);
}
