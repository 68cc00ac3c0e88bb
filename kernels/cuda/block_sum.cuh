// A block's double sum in a fixed tree, the one-block pass that adds a kernel's per-block
// partials in a fixed order, and the per-device buffers of those partials: the deterministic
// reductions of sum_squares, accumulate_sum (elementwise.cu) and AdamW's gradient norm
// (optim.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "cuda/cuda_common.cuh"

namespace moe::cuda_detail {
namespace {

// Sum of v over the block in a fixed tree (warp shuffles, then warp 0 over the warp sums); the
// result is valid in thread 0. Every thread of the block must call it.
__device__ double block_sum_to_thread0(double v) {
  __shared__ double warp_sums[32];
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? warp_sums[lane] : 0.0;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  }
  return v;
}

// Pass 2 (one block): out[0] += scale * sum of partial[0, count). (scale = 1 for sum_squares:
// 1 * s == s, the bits sum_squares always produced.)
__global__ void sum_partials_kernel(double* out, const double* partial, int count, double scale) {
  double s = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
  s = block_sum_to_thread0(s);
  if (threadIdx.x == 0) out[0] += scale * s;
}

// `Count` doubles on the current device, allocated on first use and kept for the life of the
// process; each Tag names its own buffer (reductions that may run on different streams at once
// need their own).
template <class Tag, int64_t Count>
double* partials_scratch() {
  static std::mutex mutex;
  static std::vector<double*> per_device;
  int dev = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mutex);
  if (per_device.size() <= static_cast<size_t>(dev)) per_device.resize(dev + 1, nullptr);
  double*& p = per_device[dev];
  if (!p) MOE_CUDA_CHECK(cudaMalloc(&p, Count * sizeof(double)));
  return p;
}

}  // namespace
}  // namespace moe::cuda_detail
