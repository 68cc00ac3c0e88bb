// PTX wrappers for the sm_80+ tensor-core path: cp.async (global -> shared copies that bypass
// the registers, so loads of the next k-slices overlap the math of this one), ldmatrix (a warp
// loads 8x8 16-bit tiles from shared memory straight into mma fragment layout, optionally
// transposed) and mma.sync m16n8k16 with fp32 accumulation for f16 and bf16 (m16n8k8 for tf32).
//
// Every wrapper's body exists only in device code compiled for sm_80+ (kHasSm80); callers wrap
// their use in `if constexpr (kHasSm80)` and the host launches them only where compiled_arch()
// says so, as for HasMma.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace moe::cuda_detail {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
constexpr bool kHasSm80 = true;
#else
constexpr bool kHasSm80 = false;
#endif

__device__ __forceinline__ uint32_t shared_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes from global `src` to shared `dst` asynchronously; with !valid it writes 16 zero
// bytes and reads nothing (src must still be a valid address: pass the tensor's base).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
#endif
}

// Copies 4 bytes (cached in L1: .ca) likewise; with !valid it writes 4 zero bytes.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0));
#endif
}

// Closes the group of cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most kPending committed groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the shared-memory addresses of matrix i's rows and
// r[i] receives (row lane/4, columns 2*(lane%4), +1) of matrix i, or of its transpose (kTrans).
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_addr(row)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_addr(row)));
#endif
}

// d += A B for one 16x8x16 step: a holds the 16x16 A fragment (row major), b0/b1 the 16x8 B
// fragment (k 0-7 and 8-15), d the 16x8 fp32 accumulator: d[0], d[1] at (lane/4, 2*(lane%4) + 0/1),
// d[2], d[3] eight rows further down.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// c += A B for one 16x8x8 tf32 step (the operands: fp32 bit patterns, exact in tf32), the same
// fragment layout as mma_16816 with k 0-3 in a0/a1/b0 and 4-7 in a2/a3/b1 (a1, a3: eight rows
// down).
__device__ __forceinline__ void mma_tf32(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Two adjacent outputs (p 4-byte aligned), rounded once.
template <class T>
__device__ __forceinline__ void store_pair(T* p, float a, float b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
  else
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}

// Two values rounded to T in one register, the first in the low half (the lower column of an
// mma fragment pair): an accumulator pair becomes an A-fragment register.
template <class T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Starts copying rows [row0, row0 + kRows) of a matrix with kCols contiguous elements per row
// (row i at src + i * stride, 16-byte aligned) into dst[r * kLd + c]; rows >= limit are
// zero-filled. kThreads threads share the copy.
template <class T, int kRows, int kCols, int kLd, int kThreads>
__device__ __forceinline__ void cp_async_rows(T* dst, const T* src, int64_t stride, int64_t row0,
                                              int64_t limit) {
  constexpr int kChunks = kRows * (kCols / 8);
  static_assert(kChunks % kThreads == 0, "rows must split evenly over the threads");
#pragma unroll
  for (int it = 0; it < kChunks / kThreads; ++it) {
    const int c = static_cast<int>(threadIdx.x) + it * kThreads;
    const int r = c / (kCols / 8), col = (c % (kCols / 8)) * 8;
    const int64_t i = row0 + r;
    const bool valid = i < limit;
    cp_async16(dst + r * kLd + col, valid ? src + i * stride + col : src, valid);
  }
}

}  // namespace moe::cuda_detail
