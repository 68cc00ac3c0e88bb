// split_bf16 and sum_column_blocks on CUDA (moe/ops/bf16_split.hpp), bitwise the CPU ops
// (kernels/cpu/bf16_split.cpp): the same fp32 operations in the same order, bf16 rounding to
// nearest even (NaN bit patterns aside). Both are small passes beside the matmuls they feed (the
// router's [N, E] and [E, d] operands), grid-stride loops of one group of a row's columns (all
// its parts, or all its blocks) per thread: 4 columns where the row lengths and pointers allow
// (16-byte loads), else 1, and 32-bit indices where they fit (the 64-bit division of one element's
// index by the row length cost more than the element's own work).
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "common/bf16_split_checks.hpp"
#include "cuda/bf16_parts.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/vec16.cuh"
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

// A thread per group of V columns of a row (V = 4: one 16-byte load and 8-byte stores a part;
// else 1), I the index type (dispatch_groups below).
template <int V, class I>
__global__ void split_bf16_kernel(__nv_bfloat16* dst, const float* src, I rows, I cols,
                                  Indices parts) {
  const I groups = cols / V, n = rows * groups;
  for (I i = blockIdx.x * I(blockDim.x) + threadIdx.x; i < n; i += I(gridDim.x) * blockDim.x) {
    const I r = i / groups, c = (i - r * groups) * V;
    float v[V];
    if constexpr (V == 4) {
      const float4 q = *reinterpret_cast<const float4*>(src + r * cols + c);
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
      v[0] = src[r * cols + c];
    }
    Bf16Parts e[V];
#pragma unroll
    for (int k = 0; k < V; ++k) e[k] = split3(v[k]);
    for (int j = 0; j < parts.n; ++j) {
      const int which = parts.v[j] - 1;
      __nv_bfloat16 o[V];
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = e[k].p[which];
      __nv_bfloat16* at = dst + (r * parts.n + j) * cols + c;
      if constexpr (V == 4)
        *reinterpret_cast<uint2*>(at) = *reinterpret_cast<const uint2*>(o);
      else
        at[0] = o[0];
    }
  }
}

// y[r, c] (+)= the listed column blocks of t's row r summed in order, V columns a thread as above.
template <int V, class I>
__global__ void sum_column_blocks_kernel(float* y, const float* t, I rows, I cols, I tcols,
                                         Indices blocks, bool accumulate) {
  const I groups = cols / V, n = rows * groups;
  for (I i = blockIdx.x * I(blockDim.x) + threadIdx.x; i < n; i += I(gridDim.x) * blockDim.x) {
    const I r = i / groups, c = (i - r * groups) * V;
    const float* row = t + r * tcols + c;
    float sum[V], b[V];
    auto load = [&](float(&out)[V], const float* at) {
      if constexpr (V == 4) {
        const float4 q = *reinterpret_cast<const float4*>(at);
        out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
      } else {
        out[0] = at[0];
      }
    };
    load(sum, row + I(blocks.v[0]) * cols);
    for (int j = 1; j < blocks.n; ++j) {
      load(b, row + I(blocks.v[j]) * cols);
#pragma unroll
      for (int k = 0; k < V; ++k) sum[k] = __fadd_rn(sum[k], b[k]);
    }
    float* out = y + r * cols + c;
    if (accumulate) {
      load(b, out);
#pragma unroll
      for (int k = 0; k < V; ++k) sum[k] = __fadd_rn(b[k], sum[k]);
    }
    if constexpr (V == 4)
      *reinterpret_cast<float4*>(out) = make_float4(sum[0], sum[1], sum[2], sum[3]);
    else
      out[0] = sum[0];
  }
}

// Calls f(V, I) with V = std::integral_constant<int, 4> where the row lengths (cols, and widest:
// the longest row of any operand) are multiples of 4 and every pointer is 16-byte aligned (8-byte
// bf16 stores then are too), else 1; and I = uint32_t where every element index, and the grid
// stride past the last, stays below 2^31 (no wrap), else int64_t.
template <class F>
void dispatch_groups(int64_t rows, int64_t cols, int64_t widest,
                     std::initializer_list<const void*> ptrs, F&& f) {
  const bool vec = cols % 4 == 0 && widest % 4 == 0 && aligned16(ptrs);
  const bool narrow = rows * widest <= int64_t(INT32_MAX) / 2;
  using V4 = std::integral_constant<int, 4>;
  using V1 = std::integral_constant<int, 1>;
  if (vec && narrow)
    f(V4{}, uint32_t{});
  else if (vec)
    f(V4{}, int64_t{});
  else if (narrow)
    f(V1{}, uint32_t{});
  else
    f(V1{}, int64_t{});
}

unsigned grid_for(int64_t n) {
  return grid_stride_blocks(n, kThreads);
}

void split_bf16_cuda(Ctx& ctx, Tensor dst, Tensor src, const std::vector<int>& parts) {
  check_split_bf16_args(dst, src, parts);
  check_on_gpu({&dst, &src}, "split_bf16");
  const int64_t rows = src.size(0), cols = src.size(1), p = static_cast<int64_t>(parts.size());
  if (rows * cols == 0) return;
  dispatch_groups(rows, cols, p * cols, {dst.data, src.data}, [&](auto v, auto index) {
    constexpr int V = decltype(v)::value;
    using I = decltype(index);
    split_bf16_kernel<V, I><<<grid_for(rows * (cols / V)), kThreads, 0, stream_of(ctx)>>>(
        data_of<__nv_bfloat16>(dst), data_of<float>(src), I(rows), I(cols), indices_of(parts));
  });
  MOE_CUDA_LAUNCH_CHECK();
}

void sum_column_blocks_cuda(Ctx& ctx, Tensor y, Tensor t, const std::vector<int>& blocks,
                            bool accumulate) {
  const int64_t cols = check_sum_column_blocks_args(y, t, blocks);
  check_on_gpu({&y, &t}, "sum_column_blocks");
  const int64_t rows = y.size(0), tcols = t.size(1);
  if (rows * cols == 0) return;
  dispatch_groups(rows, cols, tcols, {y.data, t.data}, [&](auto v, auto index) {
    constexpr int V = decltype(v)::value;
    using I = decltype(index);
    sum_column_blocks_kernel<V, I><<<grid_for(rows * (cols / V)), kThreads, 0, stream_of(ctx)>>>(
        data_of<float>(y), data_of<float>(t), I(rows), I(cols), I(tcols), indices_of(blocks),
        accumulate);
  });
  MOE_CUDA_LAUNCH_CHECK();
}

}  // namespace
}  // namespace moe::cuda_detail

namespace moe {
MOE_REGISTER_CUDA_OP(split_bf16, &cuda_detail::split_bf16_cuda);
MOE_REGISTER_CUDA_OP(sum_column_blocks, &cuda_detail::sum_column_blocks_cuda);
}  // namespace moe
