// Losses on the CPU: softmax cross-entropy for the LM head and binary cross-entropy with logits for
// the MoD predictor, each with its backward.
//
// Cross-entropy keeps the per-row log-sum-exp (max-shifted, accumulated in double) from the forward
// so the backward is one elementwise pass, exp(l - lse) - onehot, that reads each logit before it
// writes the same element: that is what lets dlogits alias logits (the fused head overwrites its
// [N, V] logits with their gradient instead of holding a second buffer). Targets < 0 are ignored:
// their loss and their gradient row are 0.
// BCE uses the overflow-free form max(x, 0) - x t + log1p(exp(-|x|)), and its mean is summed in a
// fixed blocking, so the value is bitwise the same for any thread count.
#include <algorithm>
#include <cmath>
#include <string>

#include "common/loss_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/loss.hpp"

namespace moe::cpu {
namespace {

// BCE(sigmoid(x), t) without overflow for any x.
inline double bce_with_logits(double x, double t) {
  return std::max(x, 0.0) - x * t + std::log1p(std::exp(-std::fabs(x)));
}

template <class T>
void ce_forward_impl(Tensor losses, Tensor lse, Tensor logits, Tensor targets) {
  const int64_t n = logits.size(0), v = logits.size(1);
  const T* l = logits.ptr<T>();
  const int32_t* tgt = targets.ptr<int32_t>();
  T* loss = losses.ptr<T>();
  T* lse_p = lse.ptr<T>();
#pragma omp parallel for schedule(static) if (parallel_worth(n * v * kExpWork))
  for (int64_t i = 0; i < n; ++i) {
    const double s = logsumexp_row(l + i * v, v);
    lse_p[i] = static_cast<T>(s);
    loss[i] = tgt[i] < 0 ? T(0) : static_cast<T>(s - l[i * v + tgt[i]]);
  }
}

template <class T>
void ce_backward_impl(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets,
                      double grad_scale) {
  const int64_t n = logits.size(0), v = logits.size(1);
  T* dl = dlogits.ptr<T>();  // may alias l: element j is read, then written
  const T* l = logits.ptr<T>();
  const T* lse_p = lse.ptr<T>();
  const int32_t* tgt = targets.ptr<int32_t>();
#pragma omp parallel for schedule(static) if (parallel_worth(n * v * kExpWork))
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tgt[i];
    const double s = lse_p[i];
    for (int64_t j = 0; j < v; ++j) {
      const double p = t < 0 ? 0.0 : std::exp(static_cast<double>(l[i * v + j]) - s);
      const double onehot = j == t ? 1.0 : 0.0;
      dl[i * v + j] = static_cast<T>(t < 0 ? 0.0 : grad_scale * (p - onehot));
    }
  }
}

template <class T>
void bce_forward_impl(Tensor loss, Tensor logits, Tensor targets) {
  const int64_t n = logits.size(0);
  const T* x = logits.ptr<T>();
  const T* t = targets.ptr<T>();
  const double sum =
      deterministic_sum(n, 2 * kExpWork, [&](int64_t i) { return bce_with_logits(x[i], t[i]); });
  loss.ptr<T>()[0] = static_cast<T>(n > 0 ? sum / n : 0.0);
}

template <class T>
void bce_backward_impl(Tensor dlogits, Tensor logits, Tensor targets, double grad_scale) {
  const int64_t n = logits.size(0);
  T* dx = dlogits.ptr<T>();  // may alias logits: element i is read, then written
  const T* x = logits.ptr<T>();
  const T* t = targets.ptr<T>();
  const double scale = n > 0 ? grad_scale / n : 0.0;
#pragma omp parallel for schedule(static) if (parallel_worth(n * kExpWork))
  for (int64_t i = 0; i < n; ++i)
    dx[i] = static_cast<T>(scale * (sigmoid(static_cast<double>(x[i])) - t[i]));
}

// Throws unless targets is i32 [N] with every entry < V (negative entries are ignored rows).
void check_targets(const Tensor& targets, int64_t n, int64_t v, const char* op) {
  check_loss_targets_args(targets, n, op);
  const int32_t* t = targets.ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    MOE_CHECK(t[i] < v, std::string(op) + ": targets[" + std::to_string(i) +
                            "] = " + std::to_string(t[i]) + " is not below the vocab size " +
                            std::to_string(v));
}

}  // namespace

// ---- softmax cross-entropy ----------------------------------------------------------------------

void cross_entropy_forward(Ctx& ctx, Tensor losses, Tensor lse, Tensor logits, Tensor targets) {
  check_cross_entropy_forward_args(losses, lse, logits);
  const int64_t n = logits.size(0), v = logits.size(1);
  check_targets(targets, n, v, "cross_entropy_forward");
  dispatch_float(logits.dtype, "cross_entropy_forward", [&](auto zero) {
    using T = decltype(zero);
    ce_forward_impl<T>(losses, lse, logits, targets);
  });
}

void cross_entropy_backward(Ctx& ctx, Tensor dlogits, Tensor logits, Tensor lse, Tensor targets,
                            double grad_scale) {
  check_cross_entropy_backward_args(dlogits, logits, lse);
  const int64_t n = logits.size(0), v = logits.size(1);
  check_targets(targets, n, v, "cross_entropy_backward");
  dispatch_float(logits.dtype, "cross_entropy_backward", [&](auto zero) {
    using T = decltype(zero);
    ce_backward_impl<T>(dlogits, logits, lse, targets, grad_scale);
  });
}

void cross_entropy_forward_backward(Ctx& ctx, Tensor losses, Tensor lse, Tensor dlogits,
                                    Tensor logits, Tensor targets, double grad_scale) {
  check_cross_entropy_forward_backward_args(losses, lse, dlogits, logits);
  cpu::cross_entropy_forward(ctx, losses, lse, logits, targets);
  cpu::cross_entropy_backward(ctx, dlogits, logits, lse, targets, grad_scale);
}

// ---- binary cross-entropy with logits -----------------------------------------------------------

void bce_with_logits_forward(Ctx& ctx, Tensor loss, Tensor logits, Tensor targets) {
  check_bce_with_logits_forward_args(loss, logits, targets);
  dispatch_float(logits.dtype, "bce_with_logits_forward", [&](auto zero) {
    using T = decltype(zero);
    bce_forward_impl<T>(loss, logits, targets);
  });
}

void bce_with_logits_backward(Ctx& ctx, Tensor dlogits, Tensor logits, Tensor targets,
                              double grad_scale) {
  check_bce_with_logits_backward_args(dlogits, logits, targets);
  dispatch_float(logits.dtype, "bce_with_logits_backward", [&](auto zero) {
    using T = decltype(zero);
    bce_backward_impl<T>(dlogits, logits, targets, grad_scale);
  });
}

}  // namespace moe::cpu
