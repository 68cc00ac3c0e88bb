// Shared by the tensor-core kernels (grouped_mma.cu, attention_mma.cu): which device code has
// WMMA for a storage type, and which virtual architecture a kernel's code was compiled from.
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/cuda_common.cuh"

namespace moe::cuda_detail {

// Whether the device code being compiled has WMMA for T: f16 from sm_70 (so the sm_75 / T4 build
// has it), bf16 from sm_80. The host pass never runs kernel bodies, so false there is harmless;
// kernels wrap their body in `if constexpr (HasMma<T>::value)`.
template <class T>
struct HasMma : std::false_type {};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
template <>
struct HasMma<__half> : std::true_type {};
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <>
struct HasMma<__nv_bfloat16> : std::true_type {};
#endif

// 2^x in one MUFU instruction (ex2.approx.ftz: max relative error ~2^-22; -inf gives 0; results
// below 2^-126 flush to 0, which no softmax weight or its gradient notices). exp2f without
// fast-math adds a range test and two multiplies around the same instruction.
__device__ __forceinline__ float exp2_ftz(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// The virtual architecture (e.g. 75 for the PTX-only sm_75 build JIT-run on a newer GPU) of the
// code the current device runs for `kernel`: decides whether HasMma held there, so the host
// launches a tensor-core kernel only where its body was compiled.
template <class Kernel>
int compiled_arch(Kernel kernel) {
  cudaFuncAttributes attr{};
  MOE_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  return attr.ptxVersion;
}

// Lets `kernel` use `bytes` of dynamic shared memory (above the 48 KiB default). Call once per
// kernel and process (the trainer uses one device per process), before the first launch.
template <class Kernel>
void allow_dynamic_smem(Kernel kernel, size_t bytes) {
  MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
}

// The minimum compiled_arch at which HasMma<T> holds.
template <class T>
constexpr int kMmaArch = std::is_same_v<T, __half> ? 70 : 80;

}  // namespace moe::cuda_detail
