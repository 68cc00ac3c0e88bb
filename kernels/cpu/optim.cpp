// AdamW on the CPU over one contiguous segment of the parameter buffer (the whole buffer, or one
// ZeRO shard, or one offloaded chunk). Elementwise, so it runs over OpenMP threads and is trivially
// deterministic. Each element's update is evaluated in double and rounded once into the stored
// dtype, which keeps the f32 reference close to the exact formula; the bias corrections 1 - b^t are
// computed once per call. Weight decay is decoupled (AdamW, not L2): it uses the parameter value
// from before this step and is not scaled by the adaptive denominator.
//
// With AdamWArgs::norm_sq the gradient scale comes from the norm (clip, or skip the step when the
// norm is not finite) by common/adamw_scale.hpp, the function the CUDA kernel runs on the device.
// With AdamWArgs::compute_out each updated element is converted as it is stored, by the convert
// op's own element conversion (cpu/convert_element.hpp) applied to the stored p: the same bits as
// a convert after the step.
#include <cmath>
#include <string>
#include <type_traits>

#include "common/adamw_scale.hpp"
#include "common/optim_checks.hpp"
#include "cpu/convert_element.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/optim.hpp"

namespace moe::cpu {
namespace {

constexpr int64_t kAdamWork = 16;  // scalar operations per element (a sqrt, a division, ~12 flops)

// D: the storage type of a.compute_out, void when there is none.
template <class T, class D>
void adamw_impl(Tensor p, Tensor g, Tensor m, Tensor v, const AdamWArgs& a, double grad_scale) {
  const int64_t n = p.numel();
  T* pp = p.ptr<T>();
  [[maybe_unused]] D* out = static_cast<D*>(a.compute_out.data);
  const T* gp = g.ptr<T>();
  T* mp = m.ptr<T>();
  T* vp = v.ptr<T>();
  const double t = static_cast<double>(a.step);
  const double bc1 = 1.0 - std::pow(a.beta1, t), bc2 = 1.0 - std::pow(a.beta2, t);
#pragma omp parallel for schedule(static) if (parallel_worth(n * kAdamWork))
  for (int64_t i = 0; i < n; ++i) {
    const double gi = grad_scale * gp[i];
    const double mi = a.beta1 * mp[i] + (1.0 - a.beta1) * gi;
    const double vi = a.beta2 * vp[i] + (1.0 - a.beta2) * gi * gi;
    const double update = (mi / bc1) / (std::sqrt(vi / bc2) + a.eps);
    const double pi = pp[i];
    pp[i] = static_cast<T>(pi - a.lr * (update + a.weight_decay * pi));
    if constexpr (!std::is_void_v<D>) out[i] = convert_element<D>(pp[i]);
    mp[i] = static_cast<T>(mi);
    vp[i] = static_cast<T>(vi);
  }
}

}  // namespace

void adamw_step(Ctx& ctx, Tensor p, Tensor g, Tensor m, Tensor v, const AdamWArgs& a) {
  check_adamw_step_args(p, g, m, v, a);
  dispatch_float(p.dtype, "adamw_step", [&](auto zero) {
    using T = decltype(zero);
    double grad_scale = a.grad_scale;
    if (!a.norm_sq.empty() &&
        !adamw_clipped_scale(a.norm_sq.ptr<double>()[0], a.grad_scale, a.max_norm, &grad_scale))
      return;  // non-finite norm: the step is skipped, p, m, v (and compute_out) untouched
    if (a.compute_out.empty()) return adamw_impl<T, void>(p, g, m, v, a, grad_scale);
    dispatch_any_float(a.compute_out.dtype, "adamw_step", [&](auto out_zero) {
      adamw_impl<T, decltype(out_zero)>(p, g, m, v, a, grad_scale);
    });
  });
}

}  // namespace moe::cpu
