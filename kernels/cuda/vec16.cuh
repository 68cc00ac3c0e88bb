// 16-byte vector access for the elementwise kernels: 8 f16/bf16, 4 f32 or 2 f64 values per load
// and store instead of one. The scalar grid-stride loops read 2 bytes per thread per step and
// reached ~45% of the copy bandwidth on the H200 (swiglu, add); whole 16-byte accesses are
// what the memory system serves at full rate.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "cuda/cuda_common.cuh"

namespace moe::cuda_detail {

template <class T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte access

template <class T>
struct alignas(16) Vec16 {
  T v[kVec<T>];
};

template <class T>
__device__ __forceinline__ Vec16<T> load16(const T* p) {
  Vec16<T> r;
  *reinterpret_cast<uint4*>(&r) = *reinterpret_cast<const uint4*>(p);
  return r;
}

template <class T>
__device__ __forceinline__ void store16(T* p, const Vec16<T>& r) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&r);
}

// A chunk of zeros (+0 in every float dtype).
template <class T>
__device__ __forceinline__ Vec16<T> zero_chunk() {
  Vec16<T> z;
  *reinterpret_cast<uint4*>(&z) = make_uint4(0, 0, 0, 0);
  return z;
}

// The chunk's values in acc_t, exactly (bf16 is the top half of an fp32: a shift). 16-bit chunks
// are taken as four 32-bit words, so the compiler keeps them packed in four registers. Used by the
// router kernels (router_logits.cu, router_fused.cu).
template <class T>
__device__ __forceinline__ void widen_chunk(const Vec16<T>& c, acc_t<T> (&out)[kVec<T>]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) {
    const uint4 u = *reinterpret_cast<const uint4*>(&c);
    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
      } else {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec<T>; ++j) out[j] = load(c.v[j]);
  }
}

// Whether every pointer is 16-byte aligned (then the vector path may be used).
inline bool aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// The work items grid_elements gives the grid: a 16-byte chunk each on the vector path (the
// tail's elements go to the first threads), an element each otherwise (grid_stride_blocks).
template <class T>
constexpr int64_t element_items(int64_t n, bool vec) {
  return vec ? n / kVec<T> + n % kVec<T> : n;
}

// Over the whole grid: vec_body(i) for every i = kVec * c below n (elements i .. i + kVec - 1)
// when `vec`, then scalar_body(i) for the elements left (all of them without `vec`). Each element
// is handled by one thread, once.
template <class T, class VecBody, class ScalarBody>
__device__ __forceinline__ void grid_elements(int64_t n, bool vec, VecBody&& vec_body,
                                              ScalarBody&& scalar_body) {
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t first_scalar = 0;
  if (vec) {
    const int64_t chunks = n / kVec<T>;
    for (int64_t c = tid; c < chunks; c += stride) vec_body(c * kVec<T>);
    first_scalar = chunks * kVec<T>;
  }
  for (int64_t i = first_scalar + tid; i < n; i += stride) scalar_body(i);
}

}  // namespace moe::cuda_detail
