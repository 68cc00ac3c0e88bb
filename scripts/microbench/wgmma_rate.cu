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
// each with 1 or 2 math warpgroups in the block. Then the same shapes fed as the rows kernels feed
// them ("fed" rows): a producer warp bulk-copies each slice's stage (L2-resident) into a ring of
// shared stages under full / empty barriers while the math warpgroups read from the ring, so the
// shared-memory writes compete with wgmma's operand reads (the 30th session's second hypothesis:
// 128 x 128 ping-pong slices write 64 bytes a tensor cycle beside 96 read, past 128 a cycle).
//   coop256: 2 warpgroups, 128 x 256 a slice (A 16 KiB + B 32 KiB), 4 stages: the default kernel
//   pp128: 1 warpgroup, 128 x 128 a slice (16 + 16 KiB), 6 stages: ping-pong's main loop, the
//          epilogue perfectly hidden
//   pp64x256: 1 warpgroup, 64 x 256 a slice (8 + 32 KiB), 4 stages: the proposed ping-pong form
// Not part of the build; on an sm_90 machine:
//   nvcc -std=c++17 -O3 -arch=sm_90a -Ikernels -Iinclude -Isrc scripts/microbench/wgmma_rate.cu
//     -o /tmp/wgmma_rate
//   /tmp/wgmma_rate [slices = 20000]
#include <cuda_bf16.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/tma_sm90.cuh"
#include "cuda/wgmma_sm90.cuh"

using namespace moe::cuda_detail;

#include "check.cuh"

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

// One bulk copy of `bytes` (a multiple of 16) from global `src` into shared `dst`, completing its
// bytes on barrier `bar`.
__device__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// The fed form: warps 0 .. 4 kWg - 1 compute, warp 4 kWg (one thread) loads. A stage holds A's
// kRows rows then B's kCols rows of 64 bf16 (128-byte swizzle; the data's layout does not matter
// to the rate). Each math warp's lane 0 releases a stage once its slice's group has retired.
template <int kWg, int kRows, int kCols, int kStages>
__global__ void __launch_bounds__(128 * kWg + 32, 1)
    fed_kernel(int slices, const unsigned char* src, int src_stages, float* sink) {
  constexpr uint32_t kA = kRows * 128, kStage = kA + kCols * 128;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = (static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + 1023) & ~1023u;
  const uint32_t bars = base + kStages * kStage;  // full[s] then empty[s]
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kStages + s); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 4 * kWg);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  if (warp == 4 * kWg) {
    if (threadIdx.x % 32 == 0) {
      for (int t = 0; t < slices; ++t) {
        const int s = t % kStages;
        mbar_wait(empty(s), ((t / kStages) & 1) ^ 1);
        mbar_arrive_expect_tx(full(s), kStage);
        bulk_load(base + s * kStage, src + size_t((t + blockIdx.x) % src_stages) * kStage, kStage,
                  full(s));
      }
    }
    return;
  }
  const int g = threadIdx.x / 128;  // rows 64 g on when two warpgroups share a slice
  float acc[kRows / 64 / kWg][kCols / 2] = {};
  for (int t = 0; t < slices; ++t) {
    const int s = t % kStages;
    mbar_wait(full(s), (t / kStages) & 1);
    const uint32_t a = base + s * kStage, b = a + kA;
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int m = 0; m < kRows / 64 / kWg; ++m) {
        const int row0 = 64 * (m + g * (kRows / 64 / kWg));
        if constexpr (kCols == 256)
          wgmma_m64n256<__nv_bfloat16, 0, 0>(acc[m], desc(a, row0, k), desc(b, 0, k));
        else
          wgmma_m64n128<__nv_bfloat16, 0, 0>(acc[m], desc(a, row0, k), desc(b, 0, k));
      }
    }
    wgmma_commit();
    wgmma_wait<1>();
#pragma unroll
    for (int m = 0; m < kRows / 64 / kWg; ++m) fence_accumulators(acc[m]);
    if (t > 0 && threadIdx.x % 32 == 0) mbar_arrive(empty((t - 1) % kStages));
  }
  wgmma_wait<0>();
  float sum = 0.0f;
#pragma unroll
  for (int m = 0; m < kRows / 64 / kWg; ++m) {
    fence_accumulators(acc[m]);
    for (int i = 0; i < kCols / 2; ++i) sum += acc[m][i];
  }
  if (sum == 12345.678f) sink[threadIdx.x] = sum;  // (keeps the products)
}

// The milliseconds of launch(slices), after a warm-up launch(slices / 10).
template <class Launch>
float timed_ms(int slices, Launch&& launch) {
  launch(slices / 10);
  CK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  launch(slices);
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms;
}

template <int kWg, int kRows, int kCols, int kStages>
void run_fed(const char* name, int slices, int sms, const unsigned char* src, int src_stages,
             float* sink) {
  auto kernel = fed_kernel<kWg, kRows, kCols, kStages>;
  const int smem = kStages * (kRows + kCols) * 128 + 2 * kStages * 8 + 1024;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const float ms = timed_ms(
      slices, [&](int n) { kernel<<<sms, 128 * kWg + 32, smem>>>(n, src, src_stages, sink); });
  const double flops = 2.0 * kRows * kCols * 64.0 * slices * sms;
  printf("fed %-9s %d warpgroup(s) %d stages  %8.3f ms  %7.1f TFLOP/s  %6.0f GB/s loaded\n", name,
         kWg, kStages, ms, flops / (ms * 1e-3) / 1e12,
         double(kRows + kCols) * 128 * slices * sms / (ms * 1e-3) / 1e9);
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
  const float ms =
      timed_ms(slices, [&](int n) { kernel<<<sms, 128 * warpgroups, smem>>>(n, sink); });
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
  // The stages' source: 16 stages of small bf16 values (~768 KiB, L2-resident), block b starting
  // at stage b so that the blocks do not read one line at once.
  constexpr int kSrcStages = 16, kSrcBytes = kSrcStages * 48 * 1024;
  unsigned char* src = nullptr;
  CK(cudaMalloc(&src, kSrcBytes));
  {
    std::vector<__nv_bfloat16> h(kSrcBytes / 2);
    for (size_t i = 0; i < h.size(); ++i) h[i] = __float2bfloat16(((i * 37) % 17 - 8) * 0.01f);
    CK(cudaMemcpy(src, h.data(), kSrcBytes, cudaMemcpyHostToDevice));
  }
  for (int rep = 0; rep < 2; ++rep) {
    run_fed<2, 128, 256, 4>("coop256", slices, sms, src, kSrcStages, sink);
    run_fed<1, 128, 128, 6>("pp128", slices, sms, src, kSrcStages * 48 / 32, sink);
    run_fed<1, 64, 256, 4>("pp64x256", slices, sms, src, kSrcStages * 48 / 40, sink);
    run_fed<2, 128, 128, 6>("coop128", slices, sms, src, kSrcStages * 48 / 32, sink);
  }
  return 0;
}
