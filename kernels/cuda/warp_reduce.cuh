// Device math and warp reductions shared by the CUDA kernels: exp/log overloads for fp32 and f64
// accumulation, -inf, and the xor-butterfly warp sum (every lane ends with the bitwise same value,
// independent of timing).
#pragma once
#include <limits>

#include "cuda/cuda_common.cuh"

namespace moe::cuda_detail {

constexpr int kWarpLanes = 32;

__device__ __forceinline__ float dev_exp(float x) {
  return expf(x);
}
__device__ __forceinline__ double dev_exp(double x) {
  return exp(x);
}
__device__ __forceinline__ float dev_log(float x) {
  return logf(x);
}
__device__ __forceinline__ double dev_log(double x) {
  return log(x);
}
__device__ __forceinline__ float dev_log1p(float x) {
  return log1pf(x);
}
__device__ __forceinline__ double dev_log1p(double x) {
  return log1p(x);
}
__device__ __forceinline__ float dev_abs(float x) {
  return fabsf(x);
}
__device__ __forceinline__ double dev_abs(double x) {
  return fabs(x);
}

template <class A>
__device__ __forceinline__ A neg_inf() {
  return -std::numeric_limits<A>::infinity();
}

template <class A>
__device__ __forceinline__ A warp_sum(A x) {
#pragma unroll
  for (int o = kWarpLanes / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

}  // namespace moe::cuda_detail
