// MoE router on the CPU: softmax over experts, top-K selection, renormalisation, per-expert counts,
// the auxiliary load-balance and z losses with their gradients, the aux-loss-free bias update, and
// add_counts (the per-step sum of the micro-batches' expert loads).
//
// The router decides which expert sees which token, so it has to be exactly reproducible and agree
// with the CUDA backend on the selected set. Hence:
// - softmax, log-sum-exp and the weight renormalisation run in double whatever the tensor dtype;
// - selection ranks experts by the score logits + bias with a strict total order (higher score
//   first, then lower expert index), so ties are resolved the same way everywhere. The softmax is
//   monotone, so with no bias this is "top-K by p"; the weights always use the unbiased p;
// - the K picks are found by K scans over E ("the best expert ranked after the previous pick"),
//   which needs no scratch and lists them in descending score order;
// - rows are independent and split over OpenMP threads; sums over rows (the loss values) use
//   deterministic_sum's fixed blocking, whose partials are added in block order, so results are
//   bitwise the same for any thread count. Index checks run serially before the parallel loops
//   (nothing throws inside them).
#include <algorithm>
#include <cmath>
#include <string>

#include "common/router_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/router.hpp"

namespace moe::cpu {
namespace {

// Selection order: a ranks before b when its score is higher, or equal with a lower index.
inline bool ranks_before(double score_a, int64_t a, double score_b, int64_t b) {
  return score_a > score_b || (score_a == score_b && a < b);
}

// Top-K of one row by score = l + bias, in descending selection order; all -1 when a score is not
// finite (the serial count pass then throws).  l: [E], bias: [E] or null, idx: [K]
template <class T>
void topk_row(const T* l, const T* bias, int64_t num_experts, int64_t k, int32_t* idx) {
  auto score = [&](int64_t e) {
    return static_cast<double>(l[e]) + (bias ? static_cast<double>(bias[e]) : 0.0);
  };
  for (int64_t e = 0; e < num_experts; ++e) {
    if (!std::isfinite(score(e))) {
      for (int64_t j = 0; j < k; ++j) idx[j] = -1;
      return;
    }
  }
  int64_t prev = -1;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    double best_score = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      const double s = score(e);
      const bool after_prev = prev < 0 || ranks_before(score(prev), prev, s, e);
      if (after_prev && (best < 0 || ranks_before(s, e, best_score, best))) {
        best = e;
        best_score = s;
      }
    }
    idx[j] = static_cast<int32_t>(best);
    prev = best;
  }
}

// Throws unless every entry of idx lies in [0, num_experts).
void check_expert_indices(const int32_t* idx, int64_t n, int64_t num_experts, const char* op) {
  for (int64_t i = 0; i < n; ++i)
    MOE_CHECK(0 <= idx[i] && idx[i] < num_experts,
              std::string(op) + ": topk_idx[" + std::to_string(i) +
                  "] = " + std::to_string(idx[i]) + " is not an expert in [0, " +
                  std::to_string(num_experts) + ")");
}

template <class T>
void topk_forward_impl(Tensor probs, Tensor topk_idx, Tensor topk_w, Tensor counts, Tensor logits,
                       Tensor bias, bool norm_topk_prob) {
  const int64_t n_tok = logits.size(0), n_exp = logits.size(1), k = topk_idx.size(1);
  const T* l = logits.ptr<T>();
  const T* b = bias.empty() ? nullptr : bias.ptr<T>();
  T* p = probs.ptr<T>();
  T* w = topk_w.ptr<T>();
  int32_t* idx = topk_idx.ptr<int32_t>();
  // Per row: softmax (an exp per expert), K selection scans over E, K more exps.
#pragma omp parallel for schedule(static) if (parallel_worth(n_tok * n_exp * (kExpWork + 4 * k)))
  for (int64_t n = 0; n < n_tok; ++n) {
    // l_n, p_n: [E]   idx_n, w_n: [K]
    const T* ln = l + n * n_exp;
    T* pn = p + n * n_exp;
    const double lse = logsumexp_row(ln, n_exp);
    for (int64_t e = 0; e < n_exp; ++e) pn[e] = static_cast<T>(std::exp(ln[e] - lse));
    int32_t* in = idx + n * k;
    topk_row(ln, b, n_exp, k, in);
    double sum_topk = 0;
    for (int64_t j = 0; j < k; ++j) sum_topk += in[j] >= 0 ? std::exp(ln[in[j]] - lse) : 0.0;
    for (int64_t j = 0; j < k; ++j) {
      const double pj = in[j] >= 0 ? std::exp(ln[in[j]] - lse) : 0.0;
      w[n * k + j] = static_cast<T>(norm_topk_prob ? pj / sum_topk : pj);
    }
  }
  // Serial: a non-finite row throws here, outside the parallel loop; counts: [E] exact.
  for (int64_t n = 0; n < n_tok; ++n)
    if (k > 0 && idx[n * k] < 0)
      throw NonFiniteError("router_topk_forward: row " + std::to_string(n) +
                           " of logits (+ bias) is not finite");
  int32_t* c = counts.ptr<int32_t>();
  for (int64_t e = 0; e < n_exp; ++e) c[e] = 0;
  for (int64_t s = 0; s < n_tok * k; ++s) ++c[idx[s]];
}

template <class T>
void topk_backward_impl(Tensor dlogits, Tensor dtopk_w, Tensor probs, Tensor topk_idx,
                        bool norm_topk_prob) {
  const int64_t n_tok = probs.size(0), n_exp = probs.size(1), k = topk_idx.size(1);
  const T* p = probs.ptr<T>();
  const T* dw = dtopk_w.ptr<T>();
  const int32_t* idx = topk_idx.ptr<int32_t>();
  T* dl = dlogits.ptr<T>();
  check_expert_indices(idx, n_tok * k, n_exp, "router_topk_backward");
#pragma omp parallel for schedule(static) if (parallel_worth(n_tok * (n_exp + 8 * k)))
  for (int64_t n = 0; n < n_tok; ++n) {
    const T* pn = p + n * n_exp;
    const T* dwn = dw + n * k;
    const int32_t* in = idx + n * k;
    // Renormalisation w_j = p_j / S:  dp_j = (dw_j - sum_i dw_i w_i) / S on the top-K, 0 elsewhere.
    double sum_topk = 0, dw_dot_w = 0;
    for (int64_t j = 0; j < k; ++j) sum_topk += pn[in[j]];
    for (int64_t j = 0; j < k; ++j) dw_dot_w += static_cast<double>(dwn[j]) * pn[in[j]] / sum_topk;
    auto dp = [&](int64_t j) {
      return norm_topk_prob ? (dwn[j] - dw_dot_w) / sum_topk : static_cast<double>(dwn[j]);
    };
    // Softmax: dl_e = p_e * (dp_e - sum_j p_j dp_j), so every expert gets gradient.
    double p_dot_dp = 0;
    for (int64_t j = 0; j < k; ++j) p_dot_dp += pn[in[j]] * dp(j);
    T* dln = dl + n * n_exp;
    for (int64_t e = 0; e < n_exp; ++e) dln[e] = static_cast<T>(-pn[e] * p_dot_dp);
    for (int64_t j = 0; j < k; ++j) dln[in[j]] = static_cast<T>(pn[in[j]] * (dp(j) - p_dot_dp));
  }
}

// The constant factor of the aux-loss gradient: d aux / d p_ne = aux_coef * E * f_e / N.
inline double aux_grad_factor(double aux_coef, int64_t n_exp, int32_t count, int64_t n_tok, int k) {
  return aux_coef * n_exp * (static_cast<double>(count) / (n_tok * k)) / n_tok;
}

template <class T>
void aux_forward_impl(Tensor losses, Tensor logits, Tensor probs, Tensor counts, int k,
                      double aux_coef, double z_coef) {
  const int64_t n_tok = logits.size(0), n_exp = logits.size(1);
  const T* l = logits.ptr<T>();
  const T* p = probs.ptr<T>();
  const int32_t* c = counts.ptr<int32_t>();
  T* out = losses.ptr<T>();
  if (n_tok == 0) {
    out[0] = out[1] = T(0);
    return;
  }
  // aux = sum_n sum_e (d aux / d p_ne) p_ne, since aux is linear in p with f held constant.
  const double aux = deterministic_sum(n_tok, 8 * n_exp, [&](int64_t n) {
    double s = 0;
    for (int64_t e = 0; e < n_exp; ++e)
      s += aux_grad_factor(aux_coef, n_exp, c[e], n_tok, k) * p[n * n_exp + e];
    return s;
  });
  const double sum_lse2 = deterministic_sum(n_tok, n_exp * kExpWork, [&](int64_t n) {
    const double lse = logsumexp_row(l + n * n_exp, n_exp);
    return lse * lse;
  });
  out[0] = static_cast<T>(aux);
  out[1] = static_cast<T>(z_coef * sum_lse2 / n_tok);
}

template <class T>
void aux_backward_impl(Tensor dlogits, Tensor logits, Tensor probs, Tensor counts, int k,
                       double aux_coef, double z_coef, double grad_scale) {
  const int64_t n_tok = logits.size(0), n_exp = logits.size(1);
  const T* l = logits.ptr<T>();
  const T* p = probs.ptr<T>();
  const int32_t* c = counts.ptr<int32_t>();
  T* dl = dlogits.ptr<T>();
#pragma omp parallel for schedule(static) if (parallel_worth(n_tok * n_exp * (kExpWork + 16)))
  for (int64_t n = 0; n < n_tok; ++n) {
    const T* pn = p + n * n_exp;
    // aux through the softmax: p_e * (g_e - sum_j p_j g_j), g_e = aux_grad_factor(e).
    double p_dot_g = 0;
    for (int64_t e = 0; e < n_exp; ++e)
      p_dot_g += pn[e] * aux_grad_factor(aux_coef, n_exp, c[e], n_tok, k);
    // z = z_coef * mean lse^2:  d z / d l_e = z_coef * 2 lse / N * p_e.
    const double dz_dlse = z_coef * 2.0 * logsumexp_row(l + n * n_exp, n_exp) / n_tok;
    T* dln = dl + n * n_exp;
    for (int64_t e = 0; e < n_exp; ++e) {
      const double g = aux_grad_factor(aux_coef, n_exp, c[e], n_tok, k);
      const double d = pn[e] * (g - p_dot_g) + dz_dlse * pn[e];
      dln[e] = static_cast<T>(dln[e] + grad_scale * d);
    }
  }
}

template <class T>
void bias_update_impl(Tensor bias, Tensor load, double rate) {
  const int64_t n_exp = bias.size(0);
  T* b = bias.ptr<T>();
  const T* ld = load.ptr<T>();
  double mean = 0;
  for (int64_t e = 0; e < n_exp; ++e) mean += ld[e];
  mean /= static_cast<double>(n_exp);
  for (int64_t e = 0; e < n_exp; ++e) {
    const double err = mean - ld[e];
    const double sign = err > 0 ? 1.0 : (err < 0 ? -1.0 : 0.0);
    b[e] = static_cast<T>(b[e] + rate * sign);
  }
}

}  // namespace

// ---- top-K routing ------------------------------------------------------------------------------

void router_topk_forward(Ctx& ctx, Tensor probs, Tensor topk_idx, Tensor topk_w, Tensor counts,
                         Tensor logits, Tensor bias, bool norm_topk_prob) {
  check_router_topk_forward_args(probs, topk_idx, topk_w, counts, logits, bias);
  dispatch_float(logits.dtype, "router_topk_forward", [&](auto zero) {
    using T = decltype(zero);
    topk_forward_impl<T>(probs, topk_idx, topk_w, counts, logits, bias, norm_topk_prob);
  });
}

void router_topk_backward(Ctx& ctx, Tensor dlogits, Tensor dtopk_w, Tensor probs, Tensor topk_idx,
                          bool norm_topk_prob) {
  check_router_topk_backward_args(dlogits, dtopk_w, probs, topk_idx);
  dispatch_float(probs.dtype, "router_topk_backward", [&](auto zero) {
    using T = decltype(zero);
    topk_backward_impl<T>(dlogits, dtopk_w, probs, topk_idx, norm_topk_prob);
  });
}

// ---- auxiliary losses ---------------------------------------------------------------------------

void router_aux_loss_forward(Ctx& ctx, Tensor losses, Tensor logits, Tensor probs, Tensor counts,
                             int k, double aux_coef, double z_coef) {
  check_router_aux_loss_forward_args(losses, logits, probs, counts, k);
  dispatch_float(logits.dtype, "router_aux_loss_forward", [&](auto zero) {
    using T = decltype(zero);
    aux_forward_impl<T>(losses, logits, probs, counts, k, aux_coef, z_coef);
  });
}

void router_aux_loss_backward(Ctx& ctx, Tensor dlogits, Tensor logits, Tensor probs, Tensor counts,
                              int k, double aux_coef, double z_coef, double grad_scale) {
  check_router_aux_loss_backward_args(dlogits, logits, probs, counts, k);
  dispatch_float(logits.dtype, "router_aux_loss_backward", [&](auto zero) {
    using T = decltype(zero);
    aux_backward_impl<T>(dlogits, logits, probs, counts, k, aux_coef, z_coef, grad_scale);
  });
}

// ---- aux-loss-free balancing --------------------------------------------------------------------

void router_bias_update(Ctx& ctx, Tensor bias, Tensor load, double rate) {
  check_router_bias_update_args(bias, load);
  dispatch_float(bias.dtype, "router_bias_update", [&](auto zero) {
    using T = decltype(zero);
    bias_update_impl<T>(bias, load, rate);
  });
}

// acc: [E] (+= counts), counts: [E] i32. Integer loads are exact in f32 below 2^24.
void add_counts(Ctx& ctx, Tensor acc, Tensor counts) {
  check_add_counts_args(acc, counts);
  dispatch_float(acc.dtype, "add_counts", [&](auto zero) {
    using T = decltype(zero);
    T* a = acc.ptr<T>();
    const int32_t* c = counts.ptr<int32_t>();
    for (int64_t e = 0; e < acc.numel(); ++e) a[e] += static_cast<T>(c[e]);
  });
}

}  // namespace moe::cpu
