// The gradient scale of one AdamW step when AdamWArgs::norm_sq is given, shared verbatim by the CPU
// op (kernels/cpu/optim.cpp, on the host value) and the CUDA kernel (kernels/cuda/optim.cu, each
// thread on the device value), so both backends decide skip and clip with the same double math.
#pragma once
#include <cfloat>
#include <cmath>

#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__
#else
#define MOE_HOST_DEVICE
#endif

namespace moe {

// a * b and a + b rounded on their own: nvcc would otherwise be free to fuse the norm's product
// into the following add (an FMA), and the device would not reproduce the host's bits.
MOE_HOST_DEVICE inline double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
MOE_HOST_DEVICE inline double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// norm = grad_scale * sqrt(norm_sq). Returns false when norm is not finite (an fp16 overflow
// somewhere in the gradient: the step must be skipped); otherwise sets *scale to grad_scale,
// times max_norm / (norm + 1e-6) when max_norm > 0 and norm > max_norm (the factor of
// moe::clip_factor, so a device clip equals the host-computed one bit for bit).
MOE_HOST_DEVICE inline bool adamw_clipped_scale(double norm_sq, double grad_scale, double max_norm,
                                                double* scale) {
  const double norm = mul_rn(grad_scale, std::sqrt(norm_sq));
  if (!(norm >= -DBL_MAX && norm <= DBL_MAX)) return false;  // NaN or +-inf
  *scale = grad_scale;
  if (max_norm > 0 && norm > max_norm) *scale = mul_rn(grad_scale, max_norm / add_rn(norm, 1e-6));
  return true;
}

}  // namespace moe
