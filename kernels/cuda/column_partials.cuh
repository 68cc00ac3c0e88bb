// Fixed-order column sums of per-block partials, for kernels that reduce over rows without
// atomics (RMSNorm's gain gradient in norm.cu, the router matmul's weight gradient in
// router_logits.cu): each block of the first kernel writes its partial row [cols] into a static
// device scratch, then this kernel adds the partials to the gradient in an order that depends on
// the number of partials only, so the bits do not depend on timing.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_common.cuh"

namespace moe::cuda_detail {

// 32 columns (one coalesced warp) x 16 strided subsets of the partials per block.
constexpr int kPartialColumns = 32;
constexpr int kPartialGroups = 16;

// grid ceil(cols / kPartialColumns), block (kPartialColumns, kPartialGroups): out[col] += the sum
// over `blocks` partials [blocks, cols] at Scratch::get<A>(), each column's in a fixed order
// (strided subsets, then the subsets in order). Scratch names the device scratch (a __device__
// array is reached from device code only).
template <class A, class Scratch>
__global__ void add_column_partials_kernel(A* __restrict__ out, int64_t blocks, int64_t cols) {
  __shared__ A sums[kPartialGroups][kPartialColumns];
  const A* partial = Scratch::template get<A>();
  const int64_t col = int64_t(blockIdx.x) * kPartialColumns + threadIdx.x;
  A s = 0;
  if (col < cols)
#pragma unroll 4
    for (int64_t b = threadIdx.y; b < blocks; b += kPartialGroups) s += partial[b * cols + col];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y > 0 || col >= cols) return;
  A t = sums[0][threadIdx.x];
  for (int g = 1; g < kPartialGroups; ++g) t += sums[g][threadIdx.x];
  out[col] += t;
}

template <class A, class Scratch>
void add_column_partials(cudaStream_t stream, A* out, int64_t blocks, int64_t cols) {
  add_column_partials_kernel<A, Scratch>
      <<<blocks_for(cols, kPartialColumns), dim3(kPartialColumns, kPartialGroups), 0, stream>>>(
          out, blocks, cols);
  MOE_CUDA_LAUNCH_CHECK();
}

}  // namespace moe::cuda_detail
