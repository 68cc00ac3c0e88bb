// The MoD causal predictor's head on the CPU: logit = silu(h) . w2 and, from the saved logits, its
// backward through the predictor's BCE (dl, then dh and dw2 in one pass over h). The reference of
// kernels/cuda/mod_predictor.cu. In double (silu from cpu_common.hpp), rounded once to the
// tensors' dtype.
#include <vector>

#include "common/mod_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/loss.hpp"
#include "moe/ops/mod.hpp"

namespace moe::cpu {

void mod_predictor_head_forward(Ctx& ctx, Tensor logit, Tensor h, Tensor w2) {
  check_mod_predictor_head_args(h, w2, logit, nullptr, nullptr, nullptr,
                                "mod_predictor_head_forward");
  dispatch_float(h.dtype, "mod_predictor_head_forward", [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = h.size(0), p = h.size(1);
    const T* ph = h.ptr<T>();
    const T* pw = w2.ptr<T>();
    T* pl = logit.ptr<T>();
#pragma omp parallel for if (parallel_worth(n * p * kExpWork))
    for (int64_t i = 0; i < n; ++i) {
      double s = 0;
      for (int64_t j = 0; j < p; ++j)
        s += silu(static_cast<double>(ph[i * p + j])) * static_cast<double>(pw[j]);
      pl[i] = static_cast<T>(s);
    }
  });
}

void mod_predictor_head_backward(Ctx& ctx, Tensor dh, Tensor dw2, Tensor h, Tensor w2, Tensor logit,
                                 Tensor targets, double grad_scale) {
  check_mod_predictor_head_args(h, w2, logit, &dh, &dw2, &targets, "mod_predictor_head_backward");
  dispatch_float(h.dtype, "mod_predictor_head_backward", [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = h.size(0), p = h.size(1);
    const T* ph = h.ptr<T>();
    const T* pw = w2.ptr<T>();
    T* pdh = dh.ptr<T>();
    T* pdw = dw2.ptr<T>();
    // dl: the BCE's gradient, by bce_with_logits_backward itself
    std::vector<T> dl(static_cast<size_t>(n));
    cpu::bce_with_logits_backward(ctx, Tensor(dl.data(), h.dtype, Device{}, {n}), logit.view({n}),
                                  targets.view({n}), grad_scale);
#pragma omp parallel for if (parallel_worth(n * p * kExpWork))
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < p; ++j)
        pdh[i * p + j] = static_cast<T>(static_cast<double>(dl[i]) * static_cast<double>(pw[j]) *
                                        silu_grad(static_cast<double>(ph[i * p + j])));
        // each column's sum in row order, whatever the thread count
#pragma omp parallel for if (parallel_worth(n * p * kExpWork))
    for (int64_t j = 0; j < p; ++j) {
      double s = 0;
      for (int64_t i = 0; i < n; ++i)
        s += static_cast<double>(dl[i]) * silu(static_cast<double>(ph[i * p + j]));
      pdw[j] = static_cast<T>(static_cast<double>(pdw[j]) + s);
    }
  });
}

}  // namespace moe::cpu
