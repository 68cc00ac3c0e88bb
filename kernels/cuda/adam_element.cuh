// The AdamW element update of the CUDA kernels (optim.cu) and of the kernels that carry an update
// in their spare warps (adam_rider.cuh): the step's constants, one element's update, the split
// master's form of it. One function for every kernel, so each gives the same bits.
#pragma once
#include <cmath>
#include <cstdint>

#include "common/adamw_scale.hpp"
#include "common/split_master.hpp"
#include "cuda/cuda_common.cuh"
#include "moe/ops/optim.hpp"

namespace moe::cuda_detail {

__device__ __forceinline__ float dev_sqrt(float x) {
  return sqrtf(x);
}
__device__ __forceinline__ double dev_sqrt(double x) {
  return sqrt(x);
}

template <class A>
struct AdamConsts {
  A lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, grad_scale, bc1, bc2;
  // The clipping inputs (used when norm_sq is not null), in double as on the host.
  const double* norm_sq;
  double grad_scale_d, max_norm;
};

// One element's update (every AdamW kernel runs this same function, so a vectorised and a
// scalar launch give the same bits). Returns the stored p; m and v are written here.
template <class T, class A>
__device__ __forceinline__ T adam_element(T p, T g, T& m, T& v, A grad_scale,
                                          const AdamConsts<A>& c) {
  const A gi = grad_scale * load(g);
  const A mi = c.beta1 * load(m) + c.one_minus_beta1 * gi;
  const A vi = c.beta2 * load(v) + c.one_minus_beta2 * gi * gi;
  const A update = (mi / c.bc1) / (dev_sqrt(vi / c.bc2) + c.eps);
  const A pi = load(p);
  m = store<T>(mi);
  v = store<T>(vi);
  return store<T>(pi - c.lr * (update + c.weight_decay * pi));
}

// The gradient scale of the step, or false when the step is skipped (non-finite norm).
template <class A>
__device__ __forceinline__ bool step_scale(const AdamConsts<A>& c, A* grad_scale) {
  *grad_scale = c.grad_scale;
  if (!c.norm_sq) return true;
  double s = 0;
  if (!adamw_clipped_scale(*c.norm_sq, c.grad_scale_d, c.max_norm, &s)) return false;
  *grad_scale = static_cast<A>(s);
  return true;
}

// The step's constants in A (the bias corrections computed on the host in double).
template <class A>
AdamConsts<A> adam_consts(const AdamWArgs& a) {
  const double t = static_cast<double>(a.step);
  const double bc1 = 1.0 - std::pow(a.beta1, t), bc2 = 1.0 - std::pow(a.beta2, t);
  return {static_cast<A>(a.lr),
          static_cast<A>(a.beta1),
          static_cast<A>(a.beta2),
          static_cast<A>(1.0 - a.beta1),
          static_cast<A>(1.0 - a.beta2),
          static_cast<A>(a.eps),
          static_cast<A>(a.weight_decay),
          static_cast<A>(a.grad_scale),
          static_cast<A>(bc1),
          static_cast<A>(bc2),
          static_cast<const double*>(a.norm_sq.data),
          a.grad_scale,
          a.max_norm};
}

// The split master (common/split_master.hpp): each thread decodes its element's p from hi and
// lo, runs adam_element on it as the f32 kernels do (so the same bits) and encodes it back.
// Four elements per thread in 8-byte hi / lo and 16-byte g / m / v accesses when every array
// is aligned for them: 28 bytes per element (the f32 master with its bf16 copy moves 30).
__device__ __forceinline__ void adam_split_element(uint16_t& hi, uint16_t& lo, float g, float& m,
                                                   float& v, float grad_scale,
                                                   const AdamConsts<float>& c) {
  const float p = adam_element(split_master_decode_one(hi, lo), g, m, v, grad_scale, c);
  split_master_encode_one(p, &hi, &lo);
}

// One quad (four elements) of the split update, in place.
__device__ __forceinline__ void adam_split_quad(ushort4& h, ushort4& l, const float4& gq,
                                                float4& mq, float4& vq, float grad_scale,
                                                const AdamConsts<float>& c) {
  adam_split_element(h.x, l.x, gq.x, mq.x, vq.x, grad_scale, c);
  adam_split_element(h.y, l.y, gq.y, mq.y, vq.y, grad_scale, c);
  adam_split_element(h.z, l.z, gq.z, mq.z, vq.z, grad_scale, c);
  adam_split_element(h.w, l.w, gq.w, mq.w, vq.w, grad_scale, c);
}

}  // namespace moe::cuda_detail
