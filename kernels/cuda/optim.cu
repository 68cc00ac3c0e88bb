// AdamW on CUDA over one contiguous segment of the parameter buffer: the elementwise update of
// include/moe/ops/optim.hpp, exactly as the CPU op writes it,
//   g' = grad_scale g;  m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2
//   p -= lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay p_old)
// with decoupled weight decay on the pre-update parameter. The bias corrections are computed once
// on the host in double; the per-element math is fp32 for f32/f16/bf16 storage (the trainer keeps
// f32 master weights and moments) and double for f64. A grid-stride loop over int64 indices, so
// any segment length works with a bounded grid; each element is read and written by one thread.
#include <algorithm>
#include <cmath>
#include <string>

#include "common/optim_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "moe/ops/optim.hpp"

namespace moe::cuda_detail::optim_impl {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

__device__ __forceinline__ float dev_sqrt(float x) {
  return sqrtf(x);
}
__device__ __forceinline__ double dev_sqrt(double x) {
  return sqrt(x);
}

template <class A>
struct AdamConsts {
  A lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, grad_scale, bc1, bc2;
};

template <class T>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m, T* __restrict__ v,
                 int64_t n, AdamConsts<acc_t<T>> c) {
  using A = acc_t<T>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const A gi = c.grad_scale * load(g[i]);
    const A mi = c.beta1 * load(m[i]) + c.one_minus_beta1 * gi;
    const A vi = c.beta2 * load(v[i]) + c.one_minus_beta2 * gi * gi;
    const A update = (mi / c.bc1) / (dev_sqrt(vi / c.bc2) + c.eps);
    const A pi = load(p[i]);
    p[i] = store<T>(pi - c.lr * (update + c.weight_decay * pi));
    m[i] = store<T>(mi);
    v[i] = store<T>(vi);
  }
}

void adamw_step_cuda(Ctx& ctx, Tensor p, Tensor g, Tensor m, Tensor v, const AdamWArgs& a) {
  const int64_t n = p.numel();
  check_adamw_step_args(p, g, m, v, a);
  for (const Tensor* t : {&p, &g, &m, &v})
    MOE_CHECK(t->device.type == DeviceType::cuda,
              "adamw_step: tensor on " + t->device.str() + ", expected a CUDA device");
  if (n == 0) return;
  const double t = static_cast<double>(a.step);
  const double bc1 = 1.0 - std::pow(a.beta1, t), bc2 = 1.0 - std::pow(a.beta2, t);
  const int64_t blocks = std::min((n + kThreads - 1) / kThreads, kMaxBlocks);
  dispatch_storage(p.dtype, "adamw_step", [&](auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    const AdamConsts<A> c{static_cast<A>(a.lr),
                          static_cast<A>(a.beta1),
                          static_cast<A>(a.beta2),
                          static_cast<A>(1.0 - a.beta1),
                          static_cast<A>(1.0 - a.beta2),
                          static_cast<A>(a.eps),
                          static_cast<A>(a.weight_decay),
                          static_cast<A>(a.grad_scale),
                          static_cast<A>(bc1),
                          static_cast<A>(bc2)};
    adamw_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(p), data_of<T>(g), data_of<T>(m), data_of<T>(v), n, c);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace moe::cuda_detail::optim_impl

MOE_REGISTER_CUDA_OP(adamw_step, &::moe::cuda_detail::optim_impl::adamw_step_cuda);
