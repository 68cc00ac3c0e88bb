// Causal grouped-query attention on the CPU, the flash-attention recipe written as plain loops.
// Forward, per query row i of head h (kv head g = h / (nh / nkv)):
//   s_j = q_i . k_j / sqrt(hd) for j <= i,  lse_i = log sum_j exp(s_j),  o_i = sum_j exp(s_j -
//   lse_i) v_j
// Only lse is saved. The backward recomputes P_ij = exp(s_ij - lse_i) row by row and uses
//   dP_ij = dO_i . v_j,  D_i = dO_i . o_i,  dS_ij = P_ij (dP_ij - D_i)
//   dq_i = sum_j dS_ij k_j / sqrt(hd),  dk_j += dS_ij q_i / sqrt(hd),  dv_j += P_ij dO_i
// so no T x T matrix exists between the calls (each row keeps a [T] scratch while it is computed).
// Dot products and softmax sums accumulate in double. The forward is parallel over (batch, head);
// the backward over (batch, kv head), running that kv head's query heads in order inside one task,
// because those heads all add into the same dk/dv rows: no races, and bitwise-stable results for
// any thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/attention_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/attention.hpp"

namespace moe::cpu {
namespace {

struct AttnDims {
  int64_t batch, seq, heads, kv_heads, hd;
  int64_t group() const { return heads / kv_heads; }  // query heads per kv head
  // Offsets of row (b, t, head) in [B, T, nh, hd] and [B, T, nkv, hd] tensors, and (b, h, t) in
  // lse.
  int64_t q_at(int64_t b, int64_t t, int64_t h) const { return ((b * seq + t) * heads + h) * hd; }
  int64_t kv_at(int64_t b, int64_t t, int64_t g) const {
    return ((b * seq + t) * kv_heads + g) * hd;
  }
  int64_t lse_at(int64_t b, int64_t h, int64_t t) const { return (b * heads + h) * seq + t; }
};

AttnDims attention_dims(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  check_attention_qkv_shapes(q, k, v, op);
  const AttnDims s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  check_attention_qkv_dtypes(q, k, v, op);
  return s;
}

// Scalar operations of one attention pass, about: T^2/2 causal pairs per head, a few hd-long dot
// products and updates per pair.
int64_t attention_work(const AttnDims& s) {
  return s.batch * s.heads * s.seq * s.seq * s.hd;
}

// One (batch, head): out rows and lse for every query position.
template <class T>
void forward_head(const AttnDims& s, int64_t b, int64_t h, const T* q, const T* k, const T* v,
                  T* out, T* lse) {
  const int64_t g = h / s.group(), hd = s.hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> score(static_cast<size_t>(s.seq));  // row scratch: [T]
  std::vector<double> acc(static_cast<size_t>(hd));       // output row accumulator: [hd]
  for (int64_t i = 0; i < s.seq; ++i) {
    const T* qi = q + s.q_at(b, i, h);
    double max_s = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j <= i; ++j) {
      score[j] = scale * dot_acc(qi, k + s.kv_at(b, j, g), hd);
      max_s = std::max(max_s, score[j]);
    }
    double sum = 0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t j = 0; j <= i; ++j) {
      const double p = std::exp(score[j] - max_s);
      sum += p;
      const T* vj = v + s.kv_at(b, j, g);
      for (int64_t c = 0; c < hd; ++c) acc[c] += p * static_cast<double>(vj[c]);
    }
    T* oi = out + s.q_at(b, i, h);
    for (int64_t c = 0; c < hd; ++c) oi[c] = static_cast<T>(acc[c] / sum);
    lse[s.lse_at(b, h, i)] = static_cast<T>(max_s + std::log(sum));
  }
}

// Per-(batch, kv head) backward state: dk and dv rows of that kv head, summed over its query heads.
struct KvGrads {
  std::vector<double> dk, dv;  // [T, hd] each
};

// Adds query head h's contribution to dk/dv (in g) and writes its dq rows.
template <class T>
void backward_head(const AttnDims& s, int64_t b, int64_t h, const T* dout, const T* q, const T* k,
                   const T* v, const T* out, const T* lse, T* dq, KvGrads& g_acc) {
  const int64_t g = h / s.group(), hd = s.hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> dq_row(static_cast<size_t>(hd));  // [hd]
  for (int64_t i = 0; i < s.seq; ++i) {
    const T* qi = q + s.q_at(b, i, h);
    const T* doi = dout + s.q_at(b, i, h);
    const double lse_i = static_cast<double>(lse[s.lse_at(b, h, i)]);
    const double d_i = dot_acc(doi, out + s.q_at(b, i, h), hd);  // D_i = <dO_i, O_i>
    std::fill(dq_row.begin(), dq_row.end(), 0.0);
    for (int64_t j = 0; j <= i; ++j) {
      const T* kj = k + s.kv_at(b, j, g);
      const T* vj = v + s.kv_at(b, j, g);
      const double p = std::exp(scale * dot_acc(qi, kj, hd) - lse_i);
      const double ds = p * (dot_acc(doi, vj, hd) - d_i);
      double* dkj = g_acc.dk.data() + j * hd;
      double* dvj = g_acc.dv.data() + j * hd;
      for (int64_t c = 0; c < hd; ++c) {
        dq_row[c] += ds * static_cast<double>(kj[c]);
        dkj[c] += scale * ds * static_cast<double>(qi[c]);
        dvj[c] += p * static_cast<double>(doi[c]);
      }
    }
    T* dqi = dq + s.q_at(b, i, h);
    for (int64_t c = 0; c < hd; ++c) dqi[c] = static_cast<T>(scale * dq_row[c]);
  }
}

}  // namespace

// out: [B, T, nh, hd], lse: [B, nh, T], q: [B, T, nh, hd], k, v: [B, T, nkv, hd]
void attention_forward(Ctx& ctx, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) {
  const AttnDims s = attention_dims(q, k, v, "attention_forward");
  check_attention_forward_outputs(out, lse, q);
  dispatch_float(q.dtype, "attention_forward", [&](auto zero) {
    using T = decltype(zero);
    const T *pq = q.ptr<T>(), *pk = k.ptr<T>(), *pv = v.ptr<T>();
    T *po = out.ptr<T>(), *pl = lse.ptr<T>();
    const int64_t tasks = s.batch * s.heads;
#pragma omp parallel for schedule(dynamic) if (parallel_worth(attention_work(s)))
    for (int64_t t = 0; t < tasks; ++t)
      forward_head<T>(s, t / s.heads, t % s.heads, pq, pk, pv, po, pl);
  });
}

// dq: [B, T, nh, hd], dk, dv: [B, T, nkv, hd] (all overwritten), dout, out: [B, T, nh, hd],
// lse: [B, nh, T]; dq_acc: checked, not used (the CPU sums dq in its own registers)
void attention_backward(Ctx& ctx, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                        Tensor v, Tensor out, Tensor lse, Tensor dq_acc) {
  const AttnDims s = attention_dims(q, k, v, "attention_backward");
  check_attention_backward_args(dq, dk, dv, dout, q, k, out, lse, dq_acc);
  dispatch_float(q.dtype, "attention_backward", [&](auto zero) {
    using T = decltype(zero);
    const T *pdo = dout.ptr<T>(), *pq = q.ptr<T>(), *pk = k.ptr<T>(), *pv = v.ptr<T>();
    const T *po = out.ptr<T>(), *pl = lse.ptr<T>();
    T *pdq = dq.ptr<T>(), *pdk = dk.ptr<T>(), *pdv = dv.ptr<T>();
    const int64_t tasks = s.batch * s.kv_heads;
#pragma omp parallel for schedule(dynamic) if (parallel_worth(attention_work(s)))
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t b = t / s.kv_heads, g = t % s.kv_heads;
      KvGrads acc{std::vector<double>(static_cast<size_t>(s.seq * s.hd), 0.0),
                  std::vector<double>(static_cast<size_t>(s.seq * s.hd), 0.0)};
      for (int64_t h = g * s.group(); h < (g + 1) * s.group(); ++h)
        backward_head<T>(s, b, h, pdo, pq, pk, pv, po, pl, pdq, acc);
      for (int64_t j = 0; j < s.seq; ++j) {
        T* dkj = pdk + s.kv_at(b, j, g);
        T* dvj = pdv + s.kv_at(b, j, g);
        for (int64_t c = 0; c < s.hd; ++c) {
          dkj[c] = static_cast<T>(acc.dk[j * s.hd + c]);
          dvj[c] = static_cast<T>(acc.dv[j * s.hd + c]);
        }
      }
    }
  });
}

}  // namespace moe::cpu
