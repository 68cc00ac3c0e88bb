// Tests of the decode attention op (one query per row over a key/value cache). The reference is
// the training op: the decode output for a row whose cache holds t entries must equal row t-1 of
// a causal attention_forward over the same keys and values (same double accumulation, so they
// agree to ~1e-15 in f64). Also: per-row lengths in one batch, cache entries beyond the length
// never read (filled with NaN), a naive softmax written out for the GQA head mapping, f32 against
// f64, and the argument checks.
#include <cmath>
#include <limits>
#include <vector>

#include "catch.hpp"
#include "moe/ops/attention.hpp"
#include "moe/ops/decode.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

constexpr int64_t kB = 2, kT = 7, kNh = 4, kNkv = 2, kHd = 6;

struct Qkv {
  Buf<double> q, k, v;  // [B, T, nh, hd], [B, T, nkv, hd] x2
};

Qkv random_qkv(uint64_t seed) {
  Qkv r{Buf<double>({kB, kT, kNh, kHd}), Buf<double>({kB, kT, kNkv, kHd}),
        Buf<double>({kB, kT, kNkv, kHd})};
  fill_uniform(r.q, seed, -2.0, 2.0);
  fill_uniform(r.k, seed + 1, -2.0, 2.0);
  fill_uniform(r.v, seed + 2);
  return r;
}

// The query rows at position len[b] - 1 of each sequence: [B, nh, hd].
template <class T>
Buf<T> last_queries(const Buf<double>& q, const std::vector<int32_t>& len) {
  Buf<T> out({kB, kNh, kHd});
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t i = 0; i < kNh * kHd; ++i)
      out[b * kNh * kHd + i] = static_cast<T>(q[((b * kT + len[b] - 1) * kNh) * kHd + i]);
  return out;
}

template <class T>
Buf<T> cast(const Buf<double>& x) {
  Buf<T> out;
  out.v.assign(x.v.begin(), x.v.end());
  out.t = x.t;
  out.t.dtype = dtype_of<T>();
  out.t.data = out.v.data();
  return out;
}

Buf<int32_t> lengths_buf(const std::vector<int32_t>& len) {
  Buf<int32_t> l({static_cast<int64_t>(len.size())});
  l.v = len;
  l.t.data = l.v.data();
  return l;
}

}  // namespace

TEST_CASE("decode attention equals the last row of causal attention", "[decode]") {
  Ctx ctx = cpu_ctx();
  const Qkv in = random_qkv(11);
  Buf<double> full({kB, kT, kNh, kHd}), lse({kB, kNh, kT});
  attention_forward(ctx, full, lse, in.q, in.k, in.v);
  // Every cache length, with the two rows of the batch at different lengths.
  for (int32_t t = 1; t <= kT; ++t) {
    const std::vector<int32_t> len{t, static_cast<int32_t>(kT + 1 - t)};
    Buf<double> q = last_queries<double>(in.q, len), out({kB, kNh, kHd});
    Buf<int32_t> lengths = lengths_buf(len);
    attention_decode_forward(ctx, out, q, in.k, in.v, lengths);
    double worst = 0;
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t i = 0; i < kNh * kHd; ++i)
        worst = std::max(worst, std::fabs(out[b * kNh * kHd + i] -
                                          full[((b * kT + len[b] - 1) * kNh) * kHd + i]));
    INFO("lengths " << len[0] << ", " << len[1]);
    CHECK(worst < 1e-14);
  }
}

TEST_CASE("decode attention never reads the cache beyond each row's length", "[decode]") {
  Ctx ctx = cpu_ctx();
  Qkv in = random_qkv(21);
  const std::vector<int32_t> len{3, 5};
  Buf<double> q = last_queries<double>(in.q, len), clean({kB, kNh, kHd}), dirty({kB, kNh, kHd});
  Buf<int32_t> lengths = lengths_buf(len);
  attention_decode_forward(ctx, clean, q, in.k, in.v, lengths);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t j = len[b]; j < kT; ++j)
      for (int64_t i = 0; i < kNkv * kHd; ++i) {
        in.k[((b * kT + j) * kNkv) * kHd + i] = nan;
        in.v[((b * kT + j) * kNkv) * kHd + i] = nan;
      }
  attention_decode_forward(ctx, dirty, q, in.k, in.v, lengths);
  CHECK(dirty.v == clean.v);
}

TEST_CASE("decode attention maps query heads to kv heads h / (nh / nkv)", "[decode]") {
  Ctx ctx = cpu_ctx();
  const Qkv in = random_qkv(31);
  const std::vector<int32_t> len{kT, 4};
  Buf<double> q = last_queries<double>(in.q, len), out({kB, kNh, kHd});
  Buf<int32_t> lengths = lengths_buf(len);
  attention_decode_forward(ctx, out, q, in.k, in.v, lengths);
  // Naive softmax(q k^T / sqrt(hd)) v per (b, h), written out.
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t h = 0; h < kNh; ++h) {
      const int64_t g = h / (kNh / kNkv);
      std::vector<double> p(static_cast<size_t>(len[b]));
      double z = 0;
      for (int64_t j = 0; j < len[b]; ++j) {
        double s = 0;
        for (int64_t c = 0; c < kHd; ++c)
          s += q[(b * kNh + h) * kHd + c] * in.k[((b * kT + j) * kNkv + g) * kHd + c];
        p[j] = std::exp(s / std::sqrt(static_cast<double>(kHd)));
        z += p[j];
      }
      for (int64_t c = 0; c < kHd; ++c) {
        double o = 0;
        for (int64_t j = 0; j < len[b]; ++j)
          o += p[j] / z * in.v[((b * kT + j) * kNkv + g) * kHd + c];
        CHECK(out[(b * kNh + h) * kHd + c] == Approx(o).epsilon(1e-12).margin(1e-14));
      }
    }
}

TEST_CASE("decode attention in f32 agrees with f64", "[decode]") {
  Ctx ctx = cpu_ctx();
  const Qkv in = random_qkv(41);
  const std::vector<int32_t> len{6, 2};
  Buf<int32_t> lengths = lengths_buf(len);
  Buf<double> q64 = last_queries<double>(in.q, len), out64({kB, kNh, kHd});
  Buf<float> q32 = last_queries<float>(in.q, len), out32({kB, kNh, kHd});
  Buf<float> k32 = cast<float>(in.k), v32 = cast<float>(in.v);
  attention_decode_forward(ctx, out64, q64, in.k, in.v, lengths);
  attention_decode_forward(ctx, out32, q32, k32, v32, lengths);
  double worst = 0;
  for (size_t i = 0; i < out64.size(); ++i)
    worst = std::max(worst, std::fabs(out32[i] - out64[i]) / (1.0 + std::fabs(out64[i])));
  CHECK(worst < 2e-6);
}

TEST_CASE("decode attention checks its arguments", "[decode]") {
  Ctx ctx = cpu_ctx();
  const Qkv in = random_qkv(51);
  Buf<double> q = last_queries<double>(in.q, {1, 1}), out({kB, kNh, kHd});
  SECTION("a length of 0 or beyond the cache") {
    for (int32_t bad : {0, static_cast<int32_t>(kT + 1), -2}) {
      Buf<int32_t> lengths = lengths_buf({2, bad});
      CHECK_THROWS_AS(attention_decode_forward(ctx, out, q, in.k, in.v, lengths), InternalError);
    }
  }
  SECTION("shapes and dtypes") {
    Buf<int32_t> lengths = lengths_buf({1, 1});
    Buf<double> wrong_out({kB, kNh, kHd + 2});
    CHECK_THROWS_AS(attention_decode_forward(ctx, wrong_out, q, in.k, in.v, lengths),
                    InternalError);
    Buf<double> odd_heads_q({kB, 3, kHd}), odd_heads_out({kB, 3, kHd});
    CHECK_THROWS_AS(attention_decode_forward(ctx, odd_heads_out, odd_heads_q, in.k, in.v, lengths),
                    InternalError);
    Buf<float> k32 = cast<float>(in.k);
    CHECK_THROWS_AS(attention_decode_forward(ctx, out, q, k32, in.v, lengths), InternalError);
    Buf<int32_t> short_lengths = lengths_buf({1});
    CHECK_THROWS_AS(attention_decode_forward(ctx, out, q, in.k, in.v, short_lengths),
                    InternalError);
  }
}
