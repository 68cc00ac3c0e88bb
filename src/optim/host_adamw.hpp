// The CPU AdamW of optimizer offload (zero_optimization.offload_optimizer): one update over
// host arrays of this rank's partition, on every core (OpenMP) and in SIMD lanes.
//
// The math is the adamw_step op's, term for term in the same order and in double
// (kernels/cpu/optim.cpp; include/moe/ops/optim.hpp states it), so an offloaded run updates its
// weights bit for bit as the CPU op would: tests/test_training_parts.cpp compares them on random
// inputs. It differs from the op in what it is for, not in what it computes: raw pointers
// (host buffers that are not model tensors), constants computed once per step, an
// `omp parallel for simd` loop the compiler vectorises (checked with
// -fopt-info-vec; the file is compiled with -fno-math-errno so that sqrt can be vectorised,
// which changes no result).
#pragma once
#include <cstddef>

#include "moe/ops/optim.hpp"

namespace moe {

// The per-step constants of one (range x weight-decay segment) update.
struct HostAdamWStep {
  double lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  double bias_correction1, bias_correction2;  // 1 - beta^t
  double grad_scale;                          // after clipping (see host_adamw_scale)
};

// The scale the gradients get: a.grad_scale, clipped by the norm when a.norm_sq is given (read
// from `norm_sq`, the host copy of it). Returns false when the norm is not finite: the step is
// skipped (nothing may change), exactly as the op decides.
bool host_adamw_scale(const AdamWArgs& a, double norm_sq, double* grad_scale);
HostAdamWStep host_adamw_step(const AdamWArgs& a, double grad_scale);

// p, m, v updated in place from g over n elements (f32 or f64 storage).
void host_adamw_update(float* p, const float* g, float* m, float* v, size_t n,
                       const HostAdamWStep& s);
void host_adamw_update(double* p, const double* g, double* m, double* v, size_t n,
                       const HostAdamWStep& s);

// The weights and moments of n elements (host arrays).
template <class T>
struct HostAdamWState {
  T *p, *m, *v;
};
// The same update out of place: reads `in` and g, writes `out` (in is left as it was), so that
// an update made before the step's clip factor was known can be made again from `in`.
void host_adamw_update(const HostAdamWState<float>& in, const float* g,
                       const HostAdamWState<float>& out, size_t n, const HostAdamWStep& s);
void host_adamw_update(const HostAdamWState<double>& in, const double* g,
                       const HostAdamWState<double>& out, size_t n, const HostAdamWStep& s);

}  // namespace moe
