// Decode attention on the CPU: one query row per (batch, head) against that row's cached keys and
// values, for one token at a time of autoregressive sampling:
//   s_j = q . k_j / sqrt(hd) for j < lengths[b],  o = sum_j exp(s_j - max_s) v_j / sum_j exp(...)
// The loops follow attention_forward's row computation term for term (double dot products,
// max-shifted exponentials summed in index order), so on the same inputs the decode output of a
// token equals the training attention's output at that token's row to rounding (bitwise, built
// with the same flags).
// Entries at or beyond lengths[b] are never read: they may hold anything. Parallel over
// (batch, head) once the work is large enough to pay for a thread team.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/decode_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/decode.hpp"

namespace moe::cpu {
namespace {

struct DecodeDims {
  int64_t batch, max_len, heads, kv_heads, hd;
  int64_t group() const { return heads / kv_heads; }  // query heads per kv head
  // Offsets of (b, h) in [B, nh, hd] and of (b, j, g) in [B, S_max, nkv, hd].
  int64_t q_at(int64_t b, int64_t h) const { return (b * heads + h) * hd; }
  int64_t kv_at(int64_t b, int64_t j, int64_t g) const {
    return ((b * max_len + j) * kv_heads + g) * hd;
  }
};

DecodeDims decode_dims(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& lengths) {
  const std::string op = "attention_decode_forward";
  check_decode_shapes(out, q, k, v);
  const DecodeDims s{q.size(0), k.size(1), q.size(1), k.size(2), q.size(2)};
  check_decode_dtypes(out, q, k, v, lengths);
  // Checked serially here so nothing throws inside the parallel loop.
  const int32_t* len = lengths.ptr<int32_t>();
  for (int64_t b = 0; b < s.batch; ++b)
    MOE_CHECK(len[b] >= 1 && len[b] <= s.max_len,
              op + ": lengths[" + std::to_string(b) + "] = " + std::to_string(len[b]) +
                  " is outside [1, " + std::to_string(s.max_len) + "]");
  return s;
}

// One (batch, head): the new token's output row. score, acc: scratch of [S_max] and [hd].
template <class T>
void decode_head(const DecodeDims& s, int64_t b, int64_t h, int64_t len, const T* q, const T* k,
                 const T* v, T* out, std::vector<double>& score, std::vector<double>& acc) {
  const int64_t g = h / s.group(), hd = s.hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const T* qh = q + s.q_at(b, h);
  double max_s = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < len; ++j) {
    score[j] = scale * dot_acc(qh, k + s.kv_at(b, j, g), hd);
    max_s = std::max(max_s, score[j]);
  }
  double sum = 0;
  std::fill(acc.begin(), acc.end(), 0.0);
  for (int64_t j = 0; j < len; ++j) {
    const double p = std::exp(score[j] - max_s);
    sum += p;
    const T* vj = v + s.kv_at(b, j, g);
    for (int64_t c = 0; c < hd; ++c) acc[c] += p * static_cast<double>(vj[c]);
  }
  T* oh = out + s.q_at(b, h);
  for (int64_t c = 0; c < hd; ++c) oh[c] = static_cast<T>(acc[c] / sum);
}

}  // namespace

// out: [B, nh, hd], q: [B, nh, hd], k_cache, v_cache: [B, S_max, nkv, hd], lengths: [B] i32
void attention_decode_forward(Ctx& ctx, Tensor out, Tensor q, Tensor k_cache, Tensor v_cache,
                              Tensor lengths) {
  const DecodeDims s = decode_dims(out, q, k_cache, v_cache, lengths);
  const int32_t* len = lengths.ptr<int32_t>();
  int64_t work = 0;  // multiply-adds over every row's cached entries
  for (int64_t b = 0; b < s.batch; ++b) work += 2 * len[b] * s.heads * s.hd;
  dispatch_float(q.dtype, "attention_decode_forward", [&](auto zero) {
    using T = decltype(zero);
    const T *pq = q.ptr<T>(), *pk = k_cache.ptr<T>(), *pv = v_cache.ptr<T>();
    T* po = out.ptr<T>();
    const int64_t tasks = s.batch * s.heads;
#pragma omp parallel if (parallel_worth(work))
    {
      std::vector<double> score(static_cast<size_t>(s.max_len));  // one scratch per thread
      std::vector<double> acc(static_cast<size_t>(s.hd));
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tasks; ++t) {
        const int64_t b = t / s.heads, h = t % s.heads;
        decode_head<T>(s, b, h, len[b], pq, pk, pv, po, score, acc);
      }
    }
  });
}

}  // namespace moe::cpu
