// SwiGLU and SiLU on the GPU: h = silu(gate) * up, silu(a) = a * sigmoid(a),
// silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a))) (silu.cuh). Elementwise grid-stride loops in
// fp32 (double for f64), one rounding on store. Each thread reads all inputs of an element before
// writing its outputs, so outputs may alias inputs elementwise (e.g. dgate over dh), as on the CPU.
#include <algorithm>
#include <string>

#include "common/swiglu_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "cuda/silu.cuh"
#include "cuda/vec16.cuh"
#include "moe/ops/swiglu.hpp"

namespace moe::cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1 << 16;  // grid cap (grid-stride loops)

// ---- kernels ------------------------------------------------------------------------------------

// 16-byte accesses when every pointer allows them (vec16.cuh), scalar otherwise and for the tail.
template <class T>
__global__ void swiglu_forward_kernel(T* h, const T* gate, const T* up, int64_t n, bool vec) {
  grid_elements<T>(
      n, vec,
      [&](int64_t i) {
        const Vec16<T> g = load16(gate + i), u = load16(up + i);
        Vec16<T> o;
#pragma unroll
        for (int j = 0; j < kVec<T>; ++j) o.v[j] = store<T>(silu(load(g.v[j])) * load(u.v[j]));
        store16(h + i, o);
      },
      [&](int64_t i) { h[i] = store<T>(silu(load(gate[i])) * load(up[i])); });
}

template <class T>
__global__ void swiglu_backward_kernel(T* dgate, T* dup, const T* dh, const T* gate, const T* up,
                                       int64_t n, bool vec) {
  grid_elements<T>(
      n, vec,
      [&](int64_t i) {
        const Vec16<T> g = load16(gate + i), u = load16(up + i), d = load16(dh + i);
        Vec16<T> dg, du;
#pragma unroll
        for (int j = 0; j < kVec<T>; ++j) {
          const auto gj = load(g.v[j]), uj = load(u.v[j]), dj = load(d.v[j]);
          dg.v[j] = store<T>(dj * uj * silu_grad(gj));
          du.v[j] = store<T>(dj * silu(gj));
        }
        store16(dgate + i, dg);
        store16(dup + i, du);
      },
      [&](int64_t i) {
        const auto g = load(gate[i]), u = load(up[i]), d = load(dh[i]);
        dgate[i] = store<T>(d * u * silu_grad(g));
        dup[i] = store<T>(d * silu(g));
      });
}

template <class T>
__global__ void silu_forward_kernel(T* y, const T* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = store<T>(silu(load(x[i])));
}

template <class T>
__global__ void silu_backward_kernel(T* dx, const T* dy, const T* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dx[i] = store<T>(load(dy[i]) * silu_grad(load(x[i])));
}

// ---- host side ----------------------------------------------------------------------------------

unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>(blocks_for(n, kThreads), kMaxBlocks));
}

// h, gate, up: [R, F]
void swiglu_forward_cuda(Ctx& ctx, Tensor h, Tensor gate, Tensor up) {
  check_like(gate, {&h, &up}, {"h", "up"}, "swiglu_forward");
  const int64_t n = gate.numel();
  if (n == 0) return;
  dispatch_storage(gate.dtype, "swiglu_forward", [&](auto zero) {
    using T = decltype(zero);
    swiglu_forward_kernel<T><<<grid_for(n), kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(h), data_of<T>(gate), data_of<T>(up), n,
        aligned16({h.data, gate.data, up.data}));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// dgate, dup (overwritten), dh, gate, up: [R, F]
void swiglu_backward_cuda(Ctx& ctx, Tensor dgate, Tensor dup, Tensor dh, Tensor gate, Tensor up) {
  check_like(gate, {&dgate, &dup, &dh, &up}, {"dgate", "dup", "dh", "up"}, "swiglu_backward");
  const int64_t n = gate.numel();
  if (n == 0) return;
  dispatch_storage(gate.dtype, "swiglu_backward", [&](auto zero) {
    using T = decltype(zero);
    swiglu_backward_kernel<T><<<grid_for(n), kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(dgate), data_of<T>(dup), data_of<T>(dh), data_of<T>(gate), data_of<T>(up), n,
        aligned16({dgate.data, dup.data, dh.data, gate.data, up.data}));
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// y, x: same shape
void silu_forward_cuda(Ctx& ctx, Tensor y, Tensor x) {
  check_like(x, {&y}, {"y"}, "silu_forward");
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_storage(x.dtype, "silu_forward", [&](auto zero) {
    using T = decltype(zero);
    silu_forward_kernel<T>
        <<<grid_for(n), kThreads, 0, stream_of(ctx)>>>(data_of<T>(y), data_of<T>(x), n);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

// dx (overwritten), dy, x: same shape
void silu_backward_cuda(Ctx& ctx, Tensor dx, Tensor dy, Tensor x) {
  check_like(x, {&dx, &dy}, {"dx", "dy"}, "silu_backward");
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_storage(x.dtype, "silu_backward", [&](auto zero) {
    using T = decltype(zero);
    silu_backward_kernel<T><<<grid_for(n), kThreads, 0, stream_of(ctx)>>>(
        data_of<T>(dx), data_of<T>(dy), data_of<T>(x), n);
    MOE_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace moe::cuda_detail

namespace moe {
MOE_REGISTER_CUDA_OP(swiglu_forward, &cuda_detail::swiglu_forward_cuda);
MOE_REGISTER_CUDA_OP(swiglu_backward, &cuda_detail::swiglu_backward_cuda);
MOE_REGISTER_CUDA_OP(silu_forward, &cuda_detail::silu_forward_cuda);
MOE_REGISTER_CUDA_OP(silu_backward, &cuda_detail::silu_backward_cuda);
}  // namespace moe
