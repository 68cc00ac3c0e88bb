#include "optim/host_adamw.hpp"

#include <cmath>

#include "common/adamw_scale.hpp"

namespace moe {

namespace {

// Below this many elements one thread does the update: a parallel region costs more (the same
// break-even reasoning as kernels/cpu's parallel_worth, ~16 operations per element).
constexpr size_t kParallelMinElems = size_t{1} << 12;

// Reads p, g, m, v and writes p_out, m_out, v_out: the same arrays in place, or a second copy
// of the state (the overlapped step). Not restrict-qualified since in place they alias; the
// `simd` clause is what lets the compiler vectorise (element i reads and writes index i only).
template <class T>
void update(const T* p, const T* g, const T* m, const T* v, T* p_out, T* m_out, T* v_out, size_t n,
            const HostAdamWStep& s) {
  const double lr = s.lr, b1 = s.beta1, b2 = s.beta2, c1 = s.one_minus_beta1,
               c2 = s.one_minus_beta2, eps = s.eps, wd = s.weight_decay, bc1 = s.bias_correction1,
               bc2 = s.bias_correction2, scale = s.grad_scale;
  const auto count = static_cast<long long>(n);
#pragma omp parallel for simd schedule(static) if (n >= kParallelMinElems)
  for (long long i = 0; i < count; ++i) {
    const double gi = scale * g[i];
    const double mi = b1 * m[i] + c1 * gi;
    const double vi = b2 * v[i] + c2 * gi * gi;
    const double step = (mi / bc1) / (std::sqrt(vi / bc2) + eps);
    const double pi = p[i];
    p_out[i] = static_cast<T>(pi - lr * (step + wd * pi));
    m_out[i] = static_cast<T>(mi);
    v_out[i] = static_cast<T>(vi);
  }
}

}  // namespace

bool host_adamw_scale(const AdamWArgs& a, double norm_sq, double* grad_scale) {
  *grad_scale = a.grad_scale;
  if (a.norm_sq.empty()) return true;
  return adamw_clipped_scale(norm_sq, a.grad_scale, a.max_norm, grad_scale);
}

HostAdamWStep host_adamw_step(const AdamWArgs& a, double grad_scale) {
  const double t = static_cast<double>(a.step);
  HostAdamWStep s;
  s.lr = a.lr;
  s.beta1 = a.beta1;
  s.beta2 = a.beta2;
  s.one_minus_beta1 = 1.0 - a.beta1;
  s.one_minus_beta2 = 1.0 - a.beta2;
  s.eps = a.eps;
  s.weight_decay = a.weight_decay;
  s.bias_correction1 = 1.0 - std::pow(a.beta1, t);
  s.bias_correction2 = 1.0 - std::pow(a.beta2, t);
  s.grad_scale = grad_scale;
  return s;
}

void host_adamw_update(float* p, const float* g, float* m, float* v, size_t n,
                       const HostAdamWStep& s) {
  update(p, g, m, v, p, m, v, n, s);
}
void host_adamw_update(double* p, const double* g, double* m, double* v, size_t n,
                       const HostAdamWStep& s) {
  update(p, g, m, v, p, m, v, n, s);
}
void host_adamw_update(const HostAdamWState<float>& in, const float* g,
                       const HostAdamWState<float>& out, size_t n, const HostAdamWStep& s) {
  update(in.p, g, in.m, in.v, out.p, out.m, out.v, n, s);
}
void host_adamw_update(const HostAdamWState<double>& in, const double* g,
                       const HostAdamWState<double>& out, size_t n, const HostAdamWStep& s) {
  update(in.p, g, in.m, in.v, out.p, out.m, out.v, n, s);
}

}  // namespace moe
