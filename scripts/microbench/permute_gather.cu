// The MoE permute's gather (xp[r, :] = x[row_token[r], :], kernels/cuda/permute.cu's
// permute_forward) in several forms at the peer configs' shapes: lanes a row, 16-byte accesses in
// flight a lane, and L2 cache hints (x kept with evict_last, xp streamed with st.global.cs or an
// evict_first policy: xp, 8x larger than x, otherwise pushes x out of L2 while it is gathered).
// Each timed launch follows a copy that rewrites x (as the layer's RMSNorm does before the
// permute). Every form's xp is compared with the first's. Not part of the build; on a GPU machine:
//   nvcc -std=c++17 -O3 -arch=sm_90 scripts/microbench/permute_gather.cu -o /tmp/permute_gather
//   /tmp/permute_gather
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "check.cuh"

using T = __nv_bfloat16;
constexpr int kThreads = 256;

enum Hint { kPlain, kStreamStore, kPolicies, kStoreFirst };

__device__ __forceinline__ uint64_t policy(bool last) {
  uint64_t p;
  if (last)
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  else
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint4 load_hint(const uint4* a, uint64_t pol) {
  uint4 v;
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(a), "l"(pol));
  return v;
}
__device__ __forceinline__ void store_hint(uint4* a, uint4 v, uint64_t pol) {
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(a), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol)
               : "memory");
}

// kLanes lanes a row, kU 16-byte accesses a lane in flight.
template <int kLanes, int kU, Hint kHint>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(T* xp, const T* x, const int32_t* row_token, int64_t rows, int64_t d) {
  const int64_t r = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / kLanes;
  if (r >= rows) return;
  const int lane = threadIdx.x % kLanes;
  const uint4* src = reinterpret_cast<const uint4*>(x + int64_t(row_token[r]) * d);
  uint4* dst = reinterpret_cast<uint4*>(xp + r * d);
  const int64_t units = d / 8;
  uint64_t keep = 0, stream = 0;
  if constexpr (kHint == kPolicies) keep = policy(true);
  if constexpr (kHint == kPolicies || kHint == kStoreFirst) stream = policy(false);
  for (int64_t c0 = lane; c0 < units; c0 += kLanes * kU) {
    uint4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t c = c0 + u * kLanes;
      if (c < units) v[u] = kHint == kPolicies ? load_hint(src + c, keep) : src[c];
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t c = c0 + u * kLanes;
      if (c >= units) continue;
      if constexpr (kHint == kStreamStore)
        __stcs(dst + c, v[u]);
      else if constexpr (kHint == kPolicies || kHint == kStoreFirst)
        store_hint(dst + c, v[u], stream);
      else
        dst[c] = v[u];
    }
  }
}

__global__ void copy_kernel(uint4* dst, const uint4* src, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

int main() {
  struct Shape {
    const char* name;
    int64_t n, k, e, d;
  };
  const Shape shapes[] = {{"moe-fine", 16384, 8, 64, 1024}, {"moe-small", 16384, 2, 8, 1024}};
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (const Shape& s : shapes) {
    const int64_t slots = s.n * s.k;
    // random top-k routing (K distinct experts a token), the plan's stable expert order
    std::mt19937 rng(7);
    std::vector<int32_t> expert(slots);
    for (int64_t t = 0; t < s.n; ++t) {
      std::vector<int32_t> e(s.e);
      for (int i = 0; i < s.e; ++i) e[i] = i;
      std::shuffle(e.begin(), e.end(), rng);
      for (int i = 0; i < s.k; ++i) expert[t * s.k + i] = e[i];
    }
    std::vector<int64_t> order(slots);
    for (int64_t i = 0; i < slots; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return expert[a] < expert[b]; });
    std::vector<int32_t> row_token(slots);
    for (int64_t r = 0; r < slots; ++r) row_token[r] = int32_t(order[r] / s.k);
    const size_t xbytes = size_t(s.n) * s.d * 2, pbytes = size_t(slots) * s.d * 2;
    T *x, *x0, *xp;
    int32_t* rt;
    CK(cudaMalloc(&x, xbytes));
    CK(cudaMalloc(&x0, xbytes));
    CK(cudaMalloc(&xp, pbytes));
    CK(cudaMalloc(&rt, slots * 4));
    std::vector<uint16_t> hx(size_t(s.n) * s.d);
    for (auto& v : hx) v = uint16_t(rng() & 0x3fff);
    CK(cudaMemcpy(x0, hx.data(), xbytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(rt, row_token.data(), slots * 4, cudaMemcpyHostToDevice));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    auto refresh = [&] {
      copy_kernel<<<sms * 8, 256>>>(reinterpret_cast<uint4*>(x), reinterpret_cast<const uint4*>(x0),
                                    int64_t(xbytes / 16));
      CK(cudaGetLastError());
    };
    std::vector<uint16_t> first, got(pbytes / 2);
    const size_t dram = xbytes + pbytes;
    auto time = [&](const char* name, auto kernel, int lanes) {
      const unsigned blocks = unsigned((slots * lanes + kThreads - 1) / kThreads);
      CK(cudaMemset(xp, 0, pbytes));
      float total = 0;
      const int reps = 20;
      for (int i = 0; i < reps + 2; ++i) {
        refresh();
        CK(cudaEventRecord(a));
        kernel<<<blocks, kThreads>>>(xp, x, rt, slots, s.d);
        CK(cudaGetLastError());
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (i >= 2) total += ms;
      }
      CK(cudaMemcpy(got.data(), xp, pbytes, cudaMemcpyDeviceToHost));
      if (first.empty()) first = got;
      const float us = 1000 * total / reps;
      std::printf("%-9s %-26s %8.1f us %7.0f GB/s %s\n", s.name, name, us, dram / (us * 1e3),
                  got == first ? "" : "WRONG");
    };
    time("8 lanes x2 (trainer)", gather_kernel<8, 2, kPlain>, 8);
    time("8 lanes x2 st.cs", gather_kernel<8, 2, kStreamStore>, 8);
    time("8 lanes x2 st evict_first", gather_kernel<8, 2, kStoreFirst>, 8);
    time("8 lanes x2 both policies", gather_kernel<8, 2, kPolicies>, 8);
    time("8 lanes x4", gather_kernel<8, 4, kPlain>, 8);
    time("8 lanes x4 st.cs", gather_kernel<8, 4, kStreamStore>, 8);
    time("8 lanes x4 both policies", gather_kernel<8, 4, kPolicies>, 8);
    time("16 lanes x2", gather_kernel<16, 2, kPlain>, 16);
    time("16 lanes x4 st.cs", gather_kernel<16, 4, kStreamStore>, 16);
    time("32 lanes x4", gather_kernel<32, 4, kPlain>, 32);
    time("32 lanes x4 st.cs", gather_kernel<32, 4, kStreamStore>, 32);
    time("32 lanes x4 both policies", gather_kernel<32, 4, kPolicies>, 32);
    time("4 lanes x4", gather_kernel<4, 4, kPlain>, 4);
    time("4 lanes x4 st.cs", gather_kernel<4, 4, kStreamStore>, 4);
    CK(cudaFree(x));
    CK(cudaFree(x0));
    CK(cudaFree(xp));
    CK(cudaFree(rt));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
  }
  return 0;
}
