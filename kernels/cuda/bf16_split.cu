// split_bf16 and sum_column_blocks on CUDA (moe/ops/bf16_split.hpp), bitwise the CPU ops
// (kernels/cpu/bf16_split.cpp): the same fp32 operations in the same order, bf16 rounding to
// nearest even (NaN bit patterns aside). Both are small passes beside the matmuls they feed (the
// router's [N, E] and [E, d] operands), grid-stride loops of one element (all its parts, or all
// its blocks) per thread.
#include <cuda_bf16.h>

#include <algorithm>

#include "common/bf16_split_checks.hpp"
#include "cuda/cuda_common.cuh"
#include "moe/ops/bf16_split.hpp"

namespace moe::cuda_detail {
namespace {

constexpr int kThreads = 256;

// Up to kMaxSplitBlocks small indices, passed by value.
struct Indices {
  int v[kMaxSplitBlocks];
  int n;
};

Indices indices_of(const std::vector<int>& list) {
  Indices r{};
  r.n = static_cast<int>(list.size());
  std::copy(list.begin(), list.end(), r.v);
  return r;
}

__global__ void split_bf16_kernel(__nv_bfloat16* dst, const float* src, int64_t rows, int64_t cols,
                                  Indices parts) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const float v = src[i];
    const __nv_bfloat16 p1 = __float2bfloat16_rn(v);
    const float r1 = __fsub_rn(v, __bfloat162float(p1));
    const __nv_bfloat16 p2 = __float2bfloat16_rn(r1);
    const __nv_bfloat16 p3 = __float2bfloat16_rn(__fsub_rn(r1, __bfloat162float(p2)));
    for (int j = 0; j < parts.n; ++j)
      dst[(r * parts.n + j) * cols + c] = parts.v[j] == 1 ? p1 : parts.v[j] == 2 ? p2 : p3;
  }
}

__global__ void sum_column_blocks_kernel(float* y, const float* t, int64_t rows, int64_t cols,
                                         int64_t tcols, Indices blocks, bool accumulate) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const float* row = t + r * tcols + c;
    float sum = row[blocks.v[0] * cols];
    for (int j = 1; j < blocks.n; ++j) sum = __fadd_rn(sum, row[blocks.v[j] * cols]);
    y[i] = accumulate ? __fadd_rn(y[i], sum) : sum;
  }
}

unsigned grid_for(int64_t n) {
  return grid_stride_blocks(n, kThreads);
}

void split_bf16_cuda(Ctx& ctx, Tensor dst, Tensor src, const std::vector<int>& parts) {
  check_split_bf16_args(dst, src, parts);
  check_on_gpu({&dst, &src}, "split_bf16");
  const int64_t n = src.numel();
  if (n == 0) return;
  split_bf16_kernel<<<grid_for(n), kThreads, 0, stream_of(ctx)>>>(data_of<__nv_bfloat16>(dst),
                                                                  data_of<float>(src), src.size(0),
                                                                  src.size(1), indices_of(parts));
  MOE_CUDA_LAUNCH_CHECK();
}

void sum_column_blocks_cuda(Ctx& ctx, Tensor y, Tensor t, const std::vector<int>& blocks,
                            bool accumulate) {
  const int64_t cols = check_sum_column_blocks_args(y, t, blocks);
  check_on_gpu({&y, &t}, "sum_column_blocks");
  const int64_t n = y.numel();
  if (n == 0) return;
  sum_column_blocks_kernel<<<grid_for(n), kThreads, 0, stream_of(ctx)>>>(
      data_of<float>(y), data_of<float>(t), y.size(0), cols, t.size(1), indices_of(blocks),
      accumulate);
  MOE_CUDA_LAUNCH_CHECK();
}

}  // namespace
}  // namespace moe::cuda_detail

namespace moe {
MOE_REGISTER_CUDA_OP(split_bf16, &cuda_detail::split_bf16_cuda);
MOE_REGISTER_CUDA_OP(sum_column_blocks, &cuda_detail::sum_column_blocks_cuda);
}  // namespace moe
