// cuBLAS bf16 times of the dense linears' shapes as kernels/cuda/linear.cu issues them (GemmEx /
// StridedBatchedEx, CUBLAS_COMPUTE_32F, reduced-precision split-K off; median of 20 samples after
// 5 warm-ups): the attention's q, k, v products one after another, strided batched, and as one
// [N, 3D] product, their dx and dw likewise, and the LM head's 8192-token chunk (docs/perf.md,
// 20th session). Not part of the build; on a GPU machine:
//   nvcc -O2 -arch=sm_90 scripts/microbench/gemm_shapes.cu -lcublas -o /tmp/gemm_shapes
//   /tmp/gemm_shapes [D = 1024]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <functional>
#include <vector>
#include <algorithm>

#include "check.cuh"

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned s) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ s;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * 0.1f);
  }
}

cublasHandle_t H;
float tm(std::function<void()> f) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 5; ++i) f();
  std::vector<float> t;
  for (int r = 0; r < 20; ++r) {
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms * 1000);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
// row-major C[m,n] (+)= A[m,k] B[n,k]^T  (y = x w^T)
void fwd(const void* x, const void* w, void* y, int m, int n, int k, float beta,
         cudaDataType_t ct = CUDA_R_16BF) {
  float one = 1;
  CK(cublasGemmEx(H, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16BF, k, x, CUDA_R_16BF, k,
                  &beta, y, ct, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}
// dx[m,k] (+)= dy[m,n] w[n,k]
void bdx(const void* dy, const void* w, void* dx, int m, int n, int k, float beta) {
  float one = 1;
  CK(cublasGemmEx(H, CUBLAS_OP_N, CUBLAS_OP_N, k, m, n, &one, w, CUDA_R_16BF, k, dy, CUDA_R_16BF, n,
                  &beta, dx, CUDA_R_16BF, k, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}
// dw[n,k] += dy[m,n]^T x[m,k]  (fp32 dw)
void bdw(const void* dy, const void* x, void* dw, int m, int n, int k) {
  float one = 1;
  CK(cublasGemmEx(H, CUBLAS_OP_N, CUBLAS_OP_T, k, n, m, &one, x, CUDA_R_16BF, k, dy, CUDA_R_16BF, n,
                  &one, dw, CUDA_R_32F, k, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

int main(int argc, char** argv) {
  const int N = 16384, D = argc > 1 ? atoi(argv[1]) : 1024, V = 32000, C = 8192;
  CK(cublasCreate(&H));
  cublasSetMathMode(H, CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
  size_t big = size_t(N) * 3 * D;
  __nv_bfloat16 *x, *w, *y, *dy, *dx, *hw, *lg;
  float* dw;
  CK(cudaMalloc(&x, big * 2));
  CK(cudaMalloc(&w, size_t(3) * D * D * 2));
  CK(cudaMalloc(&y, big * 2));
  CK(cudaMalloc(&dy, big * 2));
  CK(cudaMalloc(&dx, big * 2));
  CK(cudaMalloc(&dw, size_t(V) * D * 4));
  CK(cudaMalloc(&hw, size_t(V) * D * 2));
  CK(cudaMalloc(&lg, size_t(C) * V * 2));
  fill<<<1024, 256>>>(x, big, 1);
  fill<<<1024, 256>>>(w, 3 * D * D, 2);
  fill<<<1024, 256>>>(dy, big, 3);
  fill<<<1024, 256>>>(hw, size_t(V) * D, 4);
  fill<<<1024, 256>>>(lg, size_t(C) * V, 5);
  cudaMemset(dw, 0, size_t(V) * D * 4);
  const double f1 = 2.0 * N * D * D;
  auto rep = [](const char* nm, float us, double fl) {
    printf("%-34s %9.1f us %7.1f TFLOP/s\n", nm, us, fl / us * 1e-6);
  };
  rep("qkv fwd 3 x [N,D]x[D,D]", tm([&] {
        for (int i = 0; i < 3; ++i)
          fwd(x, w + size_t(i) * D * D, y + size_t(i) * N * D, N, D, D, 0);
      }),
      3 * f1);
  rep("qkv fwd batched(3)", tm([&] {
        float one = 1, zero = 0;
        CK(cublasGemmStridedBatchedEx(H, CUBLAS_OP_T, CUBLAS_OP_N, D, N, D, &one, w, CUDA_R_16BF, D,
                                      (long long)D * D, x, CUDA_R_16BF, D, 0, &zero, y, CUDA_R_16BF,
                                      D, (long long)N * D, 3, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
      }),
      3 * f1);
  rep("qkv fwd one [N,3D]", tm([&] { fwd(x, w, y, N, 3 * D, D, 0); }), 3 * f1);
  rep("o fwd [N,D]x[D,D]", tm([&] { fwd(x, w, y, N, D, D, 0); }), f1);
  rep("qkv dx 3 (beta 0,1,1)", tm([&] {
        for (int i = 0; i < 3; ++i)
          bdx(dy + size_t(i) * N * D, w + size_t(i) * D * D, dx, N, D, D, i ? 1 : 0);
      }),
      3 * f1);
  rep("qkv dx one K=3D", tm([&] { bdx(dy, w, dx, N, 3 * D, D, 0); }), 3 * f1);
  rep("qkv dw 3", tm([&] {
        for (int i = 0; i < 3; ++i) bdw(dy + size_t(i) * N * D, x, dw + size_t(i) * D * D, N, D, D);
      }),
      3 * f1);
  rep("qkv dw one [3D,D]", tm([&] { bdw(dy, x, dw, N, 3 * D, D); }), 3 * f1);
  rep("qkv dw batched(3)", tm([&] {
        float one = 1;
        CK(cublasGemmStridedBatchedEx(H, CUBLAS_OP_N, CUBLAS_OP_T, D, D, N, &one, x, CUDA_R_16BF, D,
                                      0, dy, CUDA_R_16BF, D, (long long)N * D, &one, dw, CUDA_R_32F,
                                      D, (long long)D * D, 3, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
      }),
      3 * f1);
  const double fh = 2.0 * C * V * D;
  rep("head fwd [8192,D]x[V,D]", tm([&] { fwd(x, hw, lg, C, V, D, 0); }), fh);
  rep("head dx", tm([&] { bdx(lg, hw, dx, C, V, D, 0); }), fh);
  rep("head dw", tm([&] { bdw(lg, x, dw, C, V, D); }), fh);
  const double f8 = 2.0 * 8192.0 * 8192 * 8192;
  __nv_bfloat16* big8;
  CK(cudaMalloc(&big8, size_t(8192) * 8192 * 2 * 3));
  fill<<<1024, 256>>>(big8, size_t(8192) * 8192 * 3, 7);
  rep("8192^3", tm([&] {
        fwd(big8, big8 + size_t(8192) * 8192, big8 + size_t(2) * 8192 * 8192, 8192, 8192, 8192, 0);
      }),
      f8);
  cudaDeviceSynchronize();
  CK(cudaGetLastError());
  return 0;
}
