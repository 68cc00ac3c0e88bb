// PTX wrappers for Hopper's warpgroup MMA (sm_90a): wgmma.mma_async with both operands read from
// shared memory through 64-bit matrix descriptors, fp32 accumulators in registers, and the fences
// that order it (wgmma.fence, commit_group, wait_group, fence.proxy.async).
//
// wgmma exists only in code compiled for the arch-specific target sm_90a (the top CMakeLists.txt
// builds MOE_CUDA_ARCHS entry 90 as 90a SASS plus compute_90 PTX): MOE_HAS_WGMMA is 1 there and 0
// in every other pass (host, sm_75, sm_80, compute_90 PTX), where the wrappers are empty. Callers
// wrap their use in `if constexpr (kHasWgmma)` and the host launches them only where the code that
// runs on the device was built for sm_90a (grouped_wgmma_sm90.cu says how it knows).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOE_HAS_WGMMA 1
#else
#define MOE_HAS_WGMMA 0
#endif

namespace moe::cuda_detail {

constexpr bool kHasWgmma = MOE_HAS_WGMMA != 0;

// Shared-memory matrix descriptor for a tile stored in the 128-byte swizzle: rows of 128 bytes,
// the 16-byte chunk c of row r stored at chunk c ^ (r % 8), in 1024-byte atoms of 8 rows (the
// hardware applies the XOR on address bits, so atoms must be 1024-byte aligned). `lbo` and `sbo`
// in bytes: for a K-major operand (rows = M or N, 64 k-elements per row) sbo is the stride between
// 8-row groups (1024) and lbo is unused; for an MN-major operand (rows = k, 64 m/n-elements per
// row) lbo is the stride between 64-wide m/n blocks and sbo the stride between 8-row k groups.
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t smem_addr, uint32_t lbo,
                                                    uint32_t sbo) {
  uint64_t d = 0;
  d |= uint64_t((smem_addr & 0x3FFFF) >> 4);  // bits 0-13: start address / 16
  d |= uint64_t((lbo >> 4) & 0x3FFF) << 16;   // bits 16-29: leading byte offset / 16
  d |= uint64_t((sbo >> 4) & 0x3FFF) << 32;   // bits 32-45: stride byte offset / 16
  d |= uint64_t(1) << 62;                     // bits 62-63: 1 = 128-byte swizzle
  return d;
}

// Orders this warpgroup's earlier register accesses before the wgmma that follow.
__device__ __forceinline__ void wgmma_fence() {
#if MOE_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

// Closes the group of wgmma issued since the last commit.
__device__ __forceinline__ void wgmma_commit() {
#if MOE_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most kPending committed wgmma groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if MOE_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Makes this thread's earlier shared-memory writes (cp.async included) visible to the async proxy
// that wgmma reads shared memory through; a barrier after it publishes them to the warpgroups.
__device__ __forceinline__ void fence_proxy_async_smem() {
#if MOE_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Keeps the compiler from moving accumulator reads or writes across this point (the wgmma write
// them asynchronously, behind the compiler's back, until wgmma_wait).
template <int kN>
__device__ __forceinline__ void fence_accumulators(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One wgmma m64nNk16 (N = 128 or 256) per call: d += A B with A (64 x 16) and B (16 x N) read
// through the descriptors; kTransA / kTransB = 1 when the operand is stored MN-major. Accumulator
// layout: thread t of the warpgroup holds, for each 8-column block j, d[4j + 0/1] at row
// 16 * (t / 32) + (t % 32) / 4, columns 8j + 2 * (t % 4) + 0/1, and d[4j + 2/3] eight rows down.
// The accumulator operands of one wgmma, "+f"(d[i]) in register-list order, and their list in
// the instruction (operands 0 .. N/2 - 1); the descriptors, the scale-d flag and the transpose
// immediates follow them.
#define MOE_WGMMA_ACC8(i)                                                                     \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define MOE_WGMMA_ACC64                                                         \
  MOE_WGMMA_ACC8(0), MOE_WGMMA_ACC8(8), MOE_WGMMA_ACC8(16), MOE_WGMMA_ACC8(24), \
      MOE_WGMMA_ACC8(32), MOE_WGMMA_ACC8(40), MOE_WGMMA_ACC8(48), MOE_WGMMA_ACC8(56)
#define MOE_WGMMA_ACC128                                                                           \
  MOE_WGMMA_ACC64, MOE_WGMMA_ACC8(64), MOE_WGMMA_ACC8(72), MOE_WGMMA_ACC8(80), MOE_WGMMA_ACC8(88), \
      MOE_WGMMA_ACC8(96), MOE_WGMMA_ACC8(104), MOE_WGMMA_ACC8(112), MOE_WGMMA_ACC8(120)
#define MOE_WGMMA_REGS64                                                             \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MOE_WGMMA_REGS128                                                                        \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                       \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "             \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "             \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "             \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define MOE_WGMMA_OPERANDS "l"(desc_a), "l"(desc_b), "r"(1), "n"(kTransA), "n"(kTransB)

// d[0..63] += A B for one m64n128k16 step (see wgmma_step); TYPE "bf16" or "f16".
#define MOE_WGMMA_M64N128(TYPE)                                                          \
  asm volatile(                                                                          \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                       \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {" MOE_WGMMA_REGS64 \
      "}, %64, %65, p, 1, 1, %67, %68;\n}\n"                                             \
      : MOE_WGMMA_ACC64                                                                  \
      : MOE_WGMMA_OPERANDS)
// d[0..127] += A B for one m64n256k16 step.
#define MOE_WGMMA_M64N256(TYPE)                                                           \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                       \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {" MOE_WGMMA_REGS128 \
      "}, %128, %129, p, 1, 1, %131, %132;\n}\n"                                          \
      : MOE_WGMMA_ACC128                                                                  \
      : MOE_WGMMA_OPERANDS)

template <class T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#if MOE_HAS_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    MOE_WGMMA_M64N128("bf16");
  else
    MOE_WGMMA_M64N128("f16");
#endif
}

template <class T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
#if MOE_HAS_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    MOE_WGMMA_M64N256("bf16");
  else
    MOE_WGMMA_M64N256("f16");
#endif
}

// The flash attention kernels (attention_sm90.cu) use two more shapes, with a scale-d operand
// (0: d = A B, the accumulators' old values ignored; 1: d += A B) so a product starts without
// zeroing its accumulators:
//   m64n64k16 and m64n128k16 with A and B from shared memory (S = Q K^T and friends), and
//   m64n64k16 with A from registers (O += P V): a[0..3] hold, for the warp's 16 rows of A, the
//   16-bit pairs (row r, k 2c..2c+1), (r + 8, 2c..), (r, 2c + 8..), (r + 8, 2c + 8..) with
//   r = (t % 32) / 4 and c = t % 4: the mma.m16n8k16 A fragment of each warp, so an accumulator
//   of two adjacent n8 blocks packs into it in place (attention_sm90.cu says how).
#define MOE_WGMMA_ACC32 MOE_WGMMA_ACC8(0), MOE_WGMMA_ACC8(8), MOE_WGMMA_ACC8(16), MOE_WGMMA_ACC8(24)
#define MOE_WGMMA_REGS32                                                   \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MOE_WGMMA_SS_OPERANDS "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB)

#define MOE_WGMMA_M64N64_SS(TYPE)                                                       \
  asm volatile(                                                                         \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                      \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {" MOE_WGMMA_REGS32 \
      "}, %32, %33, p, 1, 1, %35, %36;\n}\n"                                            \
      : MOE_WGMMA_ACC32                                                                 \
      : MOE_WGMMA_SS_OPERANDS)
#define MOE_WGMMA_M64N128_SS(TYPE)                                                       \
  asm volatile(                                                                          \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                       \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {" MOE_WGMMA_REGS64 \
      "}, %64, %65, p, 1, 1, %67, %68;\n}\n"                                             \
      : MOE_WGMMA_ACC64                                                                  \
      : MOE_WGMMA_SS_OPERANDS)
// A from registers: operands 32-35, then the B descriptor, scale-d and B's transpose immediate.
#define MOE_WGMMA_M64N64_RS(TYPE)                                                       \
  asm volatile(                                                                         \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                      \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {" MOE_WGMMA_REGS32 \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                \
      : MOE_WGMMA_ACC32                                                                 \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB))

// m64n32k16 with A and B from shared memory (the one-pass attention backward's dQ = dS K, each
// math warpgroup 32 of its 64 columns).
#define MOE_WGMMA_ACC16 MOE_WGMMA_ACC8(0), MOE_WGMMA_ACC8(8)
#define MOE_WGMMA_M64N32_SS(TYPE)                                            \
  asm volatile(                                                              \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                           \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE            \
      " {"                                                                   \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
      "}, %16, %17, p, 1, 1, %19, %20;\n}\n"                                 \
      : MOE_WGMMA_ACC16                                                      \
      : MOE_WGMMA_SS_OPERANDS)

template <class T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n32(float (&d)[16], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
#if MOE_HAS_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    MOE_WGMMA_M64N32_SS("bf16");
  else
    MOE_WGMMA_M64N32_SS("f16");
#endif
}

template <class T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
#if MOE_HAS_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    MOE_WGMMA_M64N64_SS("bf16");
  else
    MOE_WGMMA_M64N64_SS("f16");
#endif
}

template <class T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                              int scale_d) {
#if MOE_HAS_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    MOE_WGMMA_M64N128_SS("bf16");
  else
    MOE_WGMMA_M64N128_SS("f16");
#endif
}

template <class T, int kTransB>
__device__ __forceinline__ void wgmma_m64n64_rs(float (&d)[32], const uint32_t (&a)[4],
                                                uint64_t desc_b, int scale_d) {
#if MOE_HAS_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    MOE_WGMMA_M64N64_RS("bf16");
  else
    MOE_WGMMA_M64N64_RS("f16");
#endif
}

// Like fence_accumulators, for A fragments that a wgmma reads asynchronously: keeps them (and
// their registers) alive and unchanged up to this point, after the wgmma_wait that retires it.
template <int kS>
__device__ __forceinline__ void fence_fragments(uint32_t (&a)[kS][4]) {
#pragma unroll
  for (int s = 0; s < kS; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[s][i])::"memory");
}

}  // namespace moe::cuda_detail
