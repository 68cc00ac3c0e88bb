// The tensor pipe's rate for the wgmma shapes the grouped GEMM's schedules issue, with no loads:
// each block (one an SM) holds one 48 KiB k-slice (A 128 x 64, B 256 x 64, bf16, 128-byte
// swizzle, K-major as the rows kernels stage them) and its math warpgroups issue the slice's four
// k16 steps over and over, one commit group a slice, one group in flight behind the next (the
// rows kernels' wgmma_wait<1>). The question (docs/perf.md, 30th session): the ping-pong rows
// kernel's one warpgroup issuing two m64n128k16 a k16 step kept the tensor pipe busy 52% of the
// time against the cooperative kernel's 77% (two warpgroups, one m64n256k16 each), with L2 at the
// same 58%; whether one warpgroup, or the m64n128 shape (B read from shared memory once per 64
// rows: 96 bytes a cycle against m64n256's 80), caps the rate.
//   pp128: two m64n128k16 a k16 step (rows 0-63 and 64-127, one B): ping-pong's 128 x 128
//   w256: one m64n256k16 a k16 step: the cooperative kernel's 64 x 256 a warpgroup
//   n128: one m64n128k16 a k16 step: 64 x 128 a warpgroup
// each with 1 or 2 math warpgroups in the block. Not part of the build; on an sm_90 machine:
//   nvcc -std=c++17 -O3 -arch=sm_90a -Ikernels scripts/microbench/wgmma_rate.cu -o /tmp/wgmma_rate
//   /tmp/wgmma_rate [slices = 20000]
#include <cuda_bf16.h>

#include <cstdio>
#include <cstdlib>

#include "cuda/wgmma_sm90.cuh"

using namespace moe::cuda_detail;

#define CK(x)                                                     \
  do {                                                            \
    auto e_ = (x);                                                \
    if (e_ != cudaSuccess) {                                      \
      printf("%s (line %d)\n", cudaGetErrorString(e_), __LINE__); \
      exit(1);                                                    \
    }                                                             \
  } while (0)

enum Shape { pp128, w256, n128 };
constexpr int kABytes = 128 * 128, kBBytes = 256 * 128;  // 128 / 256 rows of 64 bf16

// Descriptor of k16 step s of the K-major operand at `base`, `row0` rows down (step_desc<true>).
__device__ uint64_t desc(uint32_t base, int row0, int s) {
  return smem_desc_sw128(base + row0 * 128 + s * 32, 16, 1024);
}

template <Shape kShape>
__global__ void __launch_bounds__(256, 1) rate_kernel(int slices, float* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = (static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + 1023) & ~1023u;
  // Small values (the rate does not depend on them; no infinities).
  for (int i = threadIdx.x; i < (kABytes + kBBytes) / 2; i += blockDim.x) {
    const __nv_bfloat16 v = __float2bfloat16(((i * 37) % 17 - 8) * 0.01f);
    asm volatile("st.shared.b16 [%0], %1;" ::"r"(base + 2 * i), "h"(*(const uint16_t*)&v));
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int g = threadIdx.x / 128;  // the warpgroup: rows 64 g on for w256 / n128
  const uint32_t a = base, b = base + kABytes;
  float acc[2][64] = {};
  float wide[128] = {};
  for (int t = 0; t < slices; ++t) {
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      if constexpr (kShape == pp128) {
        wgmma_m64n128<__nv_bfloat16, 0, 0>(acc[0], desc(a, 0, s), desc(b, 0, s));
        wgmma_m64n128<__nv_bfloat16, 0, 0>(acc[1], desc(a, 64, s), desc(b, 0, s));
      } else if constexpr (kShape == w256) {
        wgmma_m64n256<__nv_bfloat16, 0, 0>(wide, desc(a, 64 * g, s), desc(b, 0, s));
      } else {
        wgmma_m64n128<__nv_bfloat16, 0, 0>(acc[0], desc(a, 64 * g, s), desc(b, 0, s));
      }
    }
    wgmma_commit();
    wgmma_wait<1>();
    fence_accumulators(acc[0]);
    fence_accumulators(acc[1]);
    fence_accumulators(wide);
  }
  wgmma_wait<0>();
  fence_accumulators(acc[0]);
  fence_accumulators(acc[1]);
  fence_accumulators(wide);
  float sum = 0.0f;
  for (int i = 0; i < 64; ++i) sum += acc[0][i] + acc[1][i] + wide[i] + wide[64 + i];
  if (sum == 12345.678f) sink[threadIdx.x] = sum;  // (keeps the products)
}

// Multiply-adds a k16 step of one warpgroup.
constexpr double step_macs(Shape s) {
  return s == pp128 ? 2.0 * 64 * 128 * 16 : s == w256 ? 64.0 * 256 * 16 : 64.0 * 128 * 16;
}

template <Shape kShape>
void run(const char* name, int warpgroups, int slices, int sms, float* sink) {
  auto kernel = rate_kernel<kShape>;
  const int smem = kABytes + kBBytes + 1024;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<sms, 128 * warpgroups, smem>>>(slices / 10, sink);  // warm-up
  CK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  kernel<<<sms, 128 * warpgroups, smem>>>(slices, sink);
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  const double flops = 2.0 * step_macs(kShape) * 4 * slices * warpgroups * sms;
  printf("%-6s %d warpgroup(s)  %8.3f ms  %7.1f TFLOP/s\n", name, warpgroups, ms,
         flops / (ms * 1e-3) / 1e12);
}

int main(int argc, char** argv) {
  const int slices = argc > 1 ? atoi(argv[1]) : 20000;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* sink = nullptr;
  CK(cudaMalloc(&sink, 256 * sizeof(float)));
  for (int w = 1; w <= 2; ++w) {
    run<pp128>("pp128", w, slices, sms, sink);
    run<w256>("w256", w, slices, sms, sink);
    run<n128>("n128", w, slices, sms, sink);
  }
  return 0;
}
