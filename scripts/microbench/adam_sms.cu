// The split AdamW's 28 bytes a parameter (hi, lo, g, m, v read; hi, lo, m, v written; the element
// math of kernels/cuda/adam_element.cuh in short) streamed by a few blocks, and beside a cuBLAS
// bf16 GEMM (8192 x 8192 x 4096, ten times) whose SM count target leaves SMs to them
// (docs/perf.md, 21st session, "AdamW beside the backward"). Kernels: plain loads (4 or 16
// elements a thread in flight, grid-stride over the given blocks), bulk copies (cp.async.bulk
// into a shared-memory ring, bulk stores back) and short blocks (4096 blocks of 256 threads that
// take whatever SMs are free). Not part of the build; on a GPU machine:
//   nvcc -std=c++17 -O3 -arch=sm_90 scripts/microbench/adam_sms.cu -lcublas -o /tmp/adam_sms
//   /tmp/adam_sms            the update on a stream above the GEMM's priority
//   LOWPRI=1 /tmp/adam_sms   the update on a stream below it
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include "check.cuh"

struct C {
  float lr, b1, b2, ob1, ob2, eps, wd, bc1, bc2;
};
__device__ __forceinline__ void upd(uint16_t& hi, uint16_t& lo, float g, float& m, float& v,
                                    const C& c) {
  float p = __uint_as_float((uint32_t(hi) << 16) | lo);
  float mi = c.b1 * m + c.ob1 * g, vi = c.b2 * v + c.ob2 * g * g;
  float u = (mi / c.bc1) / (sqrtf(vi / c.bc2) + c.eps);
  p = p - c.lr * (u + c.wd * p);
  uint32_t b = __float_as_uint(p);
  hi = b >> 16;
  lo = b & 0xffff;
  m = mi;
  v = vi;
}
// plain: E elements per thread per iteration, all loads first
template <int E>
__global__ void plain(uint16_t* hi, uint16_t* lo, const float* g, float* m, float* v, int64_t n,
                      C c) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x * E;
  for (int64_t i0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i0 < n; i0 += step) {
    ushort4 h[E / 4], l[E / 4];
    float4 gg[E / 4], mm[E / 4], vv[E / 4];
#pragma unroll
    for (int j = 0; j < E / 4; ++j) {
      int64_t i = i0 + int64_t(j) * blockDim.x * gridDim.x * 4;
      if (i < n) {
        h[j] = *(ushort4*)(hi + i);
        l[j] = *(ushort4*)(lo + i);
        gg[j] = *(const float4*)(g + i);
        mm[j] = *(float4*)(m + i);
        vv[j] = *(float4*)(v + i);
      }
    }
#pragma unroll
    for (int j = 0; j < E / 4; ++j) {
      int64_t i = i0 + int64_t(j) * blockDim.x * gridDim.x * 4;
      if (i < n) {
        upd(h[j].x, l[j].x, gg[j].x, mm[j].x, vv[j].x, c);
        upd(h[j].y, l[j].y, gg[j].y, mm[j].y, vv[j].y, c);
        upd(h[j].z, l[j].z, gg[j].z, mm[j].z, vv[j].z, c);
        upd(h[j].w, l[j].w, gg[j].w, mm[j].w, vv[j].w, c);
        *(ushort4*)(hi + i) = h[j];
        *(ushort4*)(lo + i) = l[j];
        *(float4*)(m + i) = mm[j];
        *(float4*)(v + i) = vv[j];
      }
    }
  }
}
__device__ __forceinline__ uint32_t sa(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ld_bulk(uint32_t dst, const void* src, uint32_t bytes,
                                        uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void st_bulk(void* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void wait_bar(uint32_t bar, uint32_t ph) {
  asm volatile(
      "{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra "
      "W;\n}\n" ::"r"(bar),
      "r"(ph)
      : "memory");
}
// bulk: chunks of K elements, S stages (hi, lo, g, m, v per stage)
template <int K, int S>
__global__ void __launch_bounds__(256, 1)
    bulk(uint16_t* hi, uint16_t* lo, const float* g, float* m, float* v, int64_t n, C c) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) uint64_t full[S];
  constexpr int kStage = K * 16;  // 2 + 2 + 4 + 4 + 4
  const int64_t chunks = n / K;   // n a multiple of K here
  auto stage = [&](int s) { return sm + s * kStage; };
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(sa(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto load = [&](int64_t ch, int s) {
    const int64_t e0 = ch * K;
    unsigned char* b = stage(s);
    const uint32_t bar = sa(&full[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(kStage)
                 : "memory");
    ld_bulk(sa(b), hi + e0, K * 2, bar);
    ld_bulk(sa(b + K * 2), lo + e0, K * 2, bar);
    ld_bulk(sa(b + K * 4), g + e0, K * 4, bar);
    ld_bulk(sa(b + K * 8), m + e0, K * 4, bar);
    ld_bulk(sa(b + K * 12), v + e0, K * 4, bar);
  };
  int64_t mine = 0;  // this block's chunks: blockIdx.x + i * grid
  for (int64_t ch = blockIdx.x; ch < chunks; ch += gridDim.x) ++mine;
  if (threadIdx.x == 0)
    for (int i = 0; i < S && i < mine; ++i) load(blockIdx.x + int64_t(i) * gridDim.x, i);
  for (int64_t i = 0; i < mine; ++i) {
    const int s = int(i % S);
    wait_bar(sa(&full[s]), uint32_t((i / S) & 1));
    unsigned char* b = stage(s);
    uint16_t* h = (uint16_t*)b;
    uint16_t* l = (uint16_t*)(b + K * 2);
    float* gg = (float*)(b + K * 4);
    float* mm = (float*)(b + K * 8);
    float* vv = (float*)(b + K * 12);
    for (int j = threadIdx.x; j < K; j += 256) upd(h[j], l[j], gg[j], mm[j], vv[j], c);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      const int64_t e0 = (blockIdx.x + i * gridDim.x) * K;
      st_bulk(hi + e0, sa(h), K * 2);
      st_bulk(lo + e0, sa(l), K * 2);
      st_bulk(m + e0, sa(mm), K * 4);
      st_bulk(v + e0, sa(vv), K * 4);
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      if (i >= 1 && i - 1 + S < mine) {
        asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
        load(blockIdx.x + (i - 1 + S) * gridDim.x, int((i - 1) % S));
      }
    }
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

int main() {
  const int64_t n = int64_t(1) << 26;  // 64M elements: 1.8 GB moved
  uint16_t *hi, *lo;
  float *g, *m, *v;
  CK(cudaMalloc(&hi, n * 2));
  CK(cudaMalloc(&lo, n * 2));
  CK(cudaMalloc(&g, n * 4));
  CK(cudaMalloc(&m, n * 4));
  CK(cudaMalloc(&v, n * 4));
  CK(cudaMemset(hi, 0x3c, n * 2));
  CK(cudaMemset(lo, 0, n * 2));
  CK(cudaMemset(g, 0x3c, n * 4));
  CK(cudaMemset(m, 0, n * 4));
  CK(cudaMemset(v, 0, n * 4));
  C c{1e-4f, 0.9f, 0.95f, 0.1f, 0.05f, 1e-8f, 0.1f, 0.1f, 0.05f};
  int lo_p, hi_p;
  CK(cudaDeviceGetStreamPriorityRange(&lo_p, &hi_p));
  cudaStream_t sa_, sb;
  CK(cudaStreamCreateWithPriority(&sa_, cudaStreamNonBlocking, lo_p));
  CK(cudaStreamCreateWithPriority(&sb, cudaStreamNonBlocking, hi_p));
  cudaEvent_t e0, e1, e2, e3;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventCreate(&e2);
  cudaEventCreate(&e3);
  constexpr int K = 2048, S = 6;
  const size_t smem = size_t(K) * 16 * S;
  CK(cudaFuncSetAttribute(bulk<K, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  constexpr int K2 = 1024, S2 = 12;
  const size_t smem2 = size_t(K2) * 16 * S2;
  CK(cudaFuncSetAttribute(bulk<K2, S2>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem2)));
  auto run = [&](int kind, int blocks, cudaStream_t st) {
    if (kind == 0)
      plain<4><<<blocks, 1024, 0, st>>>(hi, lo, g, m, v, n, c);
    else if (kind == 1)
      plain<16><<<blocks, 512, 0, st>>>(hi, lo, g, m, v, n, c);
    else if (kind == 2)
      bulk<K, S><<<blocks, 256, smem, st>>>(hi, lo, g, m, v, n, c);
    else if (kind == 3)
      bulk<K2, S2><<<blocks, 256, smem2, st>>>(hi, lo, g, m, v, n, c);
    else
      plain<8><<<4096, 256, 0, st>>>(hi, lo, g, m, v, n, c);  // short blocks, any SMs free
  };
  const char* names[] = {"plain4x1024", "plain16x512", "bulk2048x6", "bulk1024x12", "short4096"};
  printf("%-12s %5s %9s %9s %8s\n", "kernel", "SMs", "ms", "GB/s", "GB/s/SM");
  for (int kind = 0; kind < 5; ++kind)
    for (int sms : {8, 16, 24, 32, 132}) {
      if (kind == 4 && sms != 132) continue;  // (its grid is fixed)
      run(kind, sms, sa_);
      CK(cudaStreamSynchronize(sa_));
      cudaEventRecord(e0, sa_);
      run(kind, sms, sa_);
      cudaEventRecord(e1, sa_);
      CK(cudaEventSynchronize(e1));
      float ms;
      cudaEventElapsedTime(&ms, e0, e1);
      double gbs = n * 28.0 / ms / 1e6;
      printf("%-12s %5d %9.3f %9.1f %8.1f\n", names[kind], sms, ms, gbs, gbs / sms);
    }
  // beside a GEMM: bf16 8192 x 8192 x 4096 repeated, cuBLAS limited to 132 - k SMs
  cublasHandle_t hb;
  cublasCreate(&hb);
  cublasSetStream(hb, sa_);
  const int M = 8192, N = 8192, Kd = 4096;
  __nv_bfloat16 *A, *B, *Cm;
  CK(cudaMalloc(&A, size_t(M) * Kd * 2));
  CK(cudaMalloc(&B, size_t(N) * Kd * 2));
  CK(cudaMalloc(&Cm, size_t(M) * N * 2));
  CK(cudaMemset(A, 0x3c, size_t(M) * Kd * 2));
  CK(cudaMemset(B, 0x3c, size_t(N) * Kd * 2));
  float one = 1, zero = 0;
  auto gemms = [&](int reps) {
    for (int r = 0; r < reps; ++r)
      cublasGemmEx(hb, CUBLAS_OP_T, CUBLAS_OP_N, M, N, Kd, &one, A, CUDA_R_16BF, Kd, B, CUDA_R_16BF,
                   Kd, &zero, Cm, CUDA_R_16BF, M, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  printf("\n%-12s %5s %10s %10s %10s %10s\n", "adam", "SMs", "gemm_ms", "gemm+adam", "adam_ms",
         "sum_alone");
  // low-priority adam (stream sc) beside a higher-priority gemm stream (sd)
  cudaStream_t sc, sd;
  CK(cudaStreamCreateWithPriority(&sc, cudaStreamNonBlocking, lo_p));
  CK(cudaStreamCreateWithPriority(&sd, cudaStreamNonBlocking, lo_p - 1));
  if (getenv("LOWPRI")) {
    sb = sc;
    sa_ = sd;
    cublasSetStream(hb, sa_);
  }
  for (int kind : {0, 2, 3, 4})
    for (int sms : {0, 4, 8, 16, 24}) {
      cublasSetSmCountTarget(hb, sms ? 132 - sms : 0);
      gemms(2);
      CK(cudaDeviceSynchronize());
      cudaEventRecord(e0, sa_);
      gemms(10);
      cudaEventRecord(e1, sa_);
      CK(cudaEventSynchronize(e1));
      float g_alone;
      cudaEventElapsedTime(&g_alone, e0, e1);
      float a_alone = 0;
      if (sms) {
        cudaEventRecord(e2, sb);
        run(kind, sms, sb);
        cudaEventRecord(e3, sb);
        CK(cudaEventSynchronize(e3));
        cudaEventElapsedTime(&a_alone, e2, e3);
      }
      // together: the update's three runs queued first on its stream, then the gemms
      cudaEventRecord(e0, sa_);
      CK(cudaStreamWaitEvent(sb, e0));
      if (sms) {
        run(kind, sms, sb);
        run(kind, sms, sb);
        run(kind, sms, sb);
      }
      gemms(10);
      cudaEventRecord(e1, sa_);
      cudaEventRecord(e3, sb);
      CK(cudaEventSynchronize(e1));
      CK(cudaEventSynchronize(e3));
      float both, adam3;
      cudaEventElapsedTime(&both, e0, e1);
      cudaEventElapsedTime(&adam3, e0, e3);
      printf("%-12s %5d %10.3f %10.3f %10.3f %10.3f\n", names[kind], sms, g_alone, both, adam3,
             g_alone + 3 * a_alone);
    }
  CK(cudaDeviceSynchronize());
  return 0;
}
