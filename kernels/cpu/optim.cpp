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
// a convert after the step. adamw_step_split runs the same element update on the decoded split
// master (common/split_master.hpp) and encodes the result.
#include <cmath>
#include <string>
#include <type_traits>

#include "common/adamw_scale.hpp"
#include "common/float16.hpp"
#include "common/optim_checks.hpp"
#include "common/split_master.hpp"
#include "cpu/convert_element.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/optim.hpp"

namespace moe::cpu {
namespace {

constexpr int64_t kAdamWork = 16;  // scalar operations per element (a sqrt, a division, ~12 flops)

// One element's update in double, rounded once into T; m and v are written here. Both loops
// below run it, so a split master's p is updated exactly as an fp32 buffer's.
struct AdamElement {
  double lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale;
  template <class T>
  T operator()(T p, T g, T& m, T& v) const {
    const double gi = grad_scale * g;
    const double mi = beta1 * m + (1.0 - beta1) * gi;
    const double vi = beta2 * v + (1.0 - beta2) * gi * gi;
    const double update = (mi / bc1) / (std::sqrt(vi / bc2) + eps);
    const double pi = p;
    m = static_cast<T>(mi);
    v = static_cast<T>(vi);
    return static_cast<T>(pi - lr * (update + weight_decay * pi));
  }
};

AdamElement adam_element(const AdamWArgs& a, double grad_scale) {
  const double t = static_cast<double>(a.step);
  return {a.lr,
          a.beta1,
          a.beta2,
          a.eps,
          a.weight_decay,
          1.0 - std::pow(a.beta1, t),
          1.0 - std::pow(a.beta2, t),
          grad_scale};
}

// D: the storage type of a.compute_out, void when there is none.
template <class T, class D>
void adamw_impl(Tensor p, Tensor g, Tensor m, Tensor v, const AdamWArgs& a, double grad_scale) {
  const int64_t n = p.numel();
  T* pp = p.ptr<T>();
  [[maybe_unused]] D* out = static_cast<D*>(a.compute_out.data);
  const T* gp = g.ptr<T>();
  T* mp = m.ptr<T>();
  T* vp = v.ptr<T>();
  const AdamElement step = adam_element(a, grad_scale);
#pragma omp parallel for schedule(static) if (parallel_worth(n * kAdamWork))
  for (int64_t i = 0; i < n; ++i) {
    pp[i] = step(pp[i], gp[i], mp[i], vp[i]);
    if constexpr (!std::is_void_v<D>) out[i] = convert_element<D>(pp[i]);
  }
}

// The step's gradient scale from a.norm_sq (clip), or false when the step is skipped.
bool step_scale(const AdamWArgs& a, double* grad_scale) {
  *grad_scale = a.grad_scale;
  return a.norm_sq.empty() ||
         adamw_clipped_scale(a.norm_sq.ptr<double>()[0], a.grad_scale, a.max_norm, grad_scale);
}

}  // namespace

void adamw_step(Ctx& ctx, Tensor p, Tensor g, Tensor m, Tensor v, const AdamWArgs& a) {
  check_adamw_step_args(p, g, m, v, a);
  if (!a.grad_sq_out.empty()) cpu::sum_squares(ctx, a.grad_sq_out, g);  // g is only read below
  dispatch_float(p.dtype, "adamw_step", [&](auto zero) {
    using T = decltype(zero);
    double grad_scale = 1;
    if (!step_scale(a, &grad_scale))
      return;  // non-finite norm: the step is skipped, p, m, v (and compute_out) untouched
    if (a.compute_out.empty()) return adamw_impl<T, void>(p, g, m, v, a, grad_scale);
    dispatch_any_float(a.compute_out.dtype, "adamw_step", [&](auto out_zero) {
      adamw_impl<T, decltype(out_zero)>(p, g, m, v, a, grad_scale);
    });
  });
}

void adamw_step_split(Ctx& ctx, Tensor hi, Tensor lo, Tensor g, Tensor m, Tensor v,
                      const AdamWArgs& a) {
  check_adamw_step_split_args(hi, lo, g, m, v, a);
  if (!a.grad_sq_out.empty()) cpu::sum_squares(ctx, a.grad_sq_out, g);  // g is only read below
  double grad_scale = 1;
  if (!step_scale(a, &grad_scale)) return;
  const int64_t n = hi.numel();
  auto* hp = static_cast<uint16_t*>(hi.data);
  auto* lp = static_cast<uint16_t*>(lo.data);
  float* mp = m.ptr<float>();
  float* vp = v.ptr<float>();
  const AdamElement step = adam_element(a, grad_scale);
  // g: f32, or bf16 (train.bf16_expert_grads), widened exactly
  const bool g16 = g.dtype == DType::bf16;
  const float* gp = g16 ? nullptr : g.ptr<float>();
  const auto* gb = static_cast<const uint16_t*>(g.data);
#pragma omp parallel for schedule(static) if (parallel_worth(n * kAdamWork))
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g16 ? float16::bf16_to_float(gb[i]) : gp[i];
    const float p = step(split_master_decode_one(hp[i], lp[i]), gi, mp[i], vp[i]);
    split_master_encode_one(p, &hp[i], &lp[i]);
  }
}

void split_master_decode(Ctx& ctx, Tensor master, Tensor hi, Tensor lo) {
  check_split_master_args(hi, lo, {&master}, "split_master_decode");
  const int64_t n = hi.numel();
  const auto* hp = static_cast<const uint16_t*>(hi.data);
  const auto* lp = static_cast<const uint16_t*>(lo.data);
  float* out = master.ptr<float>();
#pragma omp parallel for schedule(static) if (parallel_worth(n))
  for (int64_t i = 0; i < n; ++i) out[i] = split_master_decode_one(hp[i], lp[i]);
}

}  // namespace moe::cpu
