// SiLU and its derivative in fp32 (double for f64), shared by the SwiGLU kernels (swiglu.cu) and
// the grouped GEMM that applies SwiGLU in its epilogue (grouped_wgmma_sm90.cu): one definition,
// so the fused and the plain paths give the same bits. sigmoid(a) = 1 / (1 + exp(-a)) saturates
// cleanly at both ends (exp overflow gives 1/inf = 0). fp32 takes the hardware exp2 and
// reciprocal (__expf, __fdividef: a few ulp, far inside the 16-bit outputs' rounding): the
// accurate expf and IEEE division cost ~25 instructions per element, which the grouped GEMM's
// epilogue pays on 64 elements per thread between two tiles' main loops.
#pragma once
#include <cuda_runtime.h>

namespace moe::cuda_detail {

__device__ __forceinline__ float sigmoid(float a) {
  return __fdividef(1.0f, 1.0f + __expf(-a));  // 1 / inf = 0 and 1 / (1 + 0) = 1 exactly
}
__device__ __forceinline__ double sigmoid(double a) {
  return 1.0 / (1.0 + exp(-a));
}

template <class A>
__device__ __forceinline__ A silu(A a) {
  return a * sigmoid(a);
}
template <class A>
__device__ __forceinline__ A silu_grad(A a) {
  const A s = sigmoid(a);
  return s * (A(1) + a * (A(1) - s));
}

}  // namespace moe::cuda_detail
