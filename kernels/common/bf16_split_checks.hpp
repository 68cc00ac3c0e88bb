// Argument checks of split_bf16 and sum_column_blocks (moe/ops/bf16_split.hpp), shared by the CPU
// (kernels/cpu/bf16_split.cpp) and CUDA (kernels/cuda/bf16_split.cu) backends.
#pragma once
#include <string>
#include <vector>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

constexpr int kMaxSplitBlocks = 8;

// The [R, C] source of split_bf16, parts each 1, 2 or 3.
inline void check_split_bf16_args(const Tensor& dst, const Tensor& src,
                                  const std::vector<int>& parts) {
  const int64_t p = static_cast<int64_t>(parts.size());
  MOE_CHECK(p >= 1 && p <= kMaxSplitBlocks,
            "split_bf16: 1 to 8 parts, got " + std::to_string(parts.size()));
  for (int part : parts)
    MOE_CHECK(part >= 1 && part <= 3,
              "split_bf16: a part is 1, 2 or 3, got " + std::to_string(part));
  MOE_CHECK(src.ndim == 2 && src.dtype == DType::f32, "split_bf16: src must be [R, C] f32, got " +
                                                          std::string(dtype_name(src.dtype)) + " " +
                                                          src.shape_str());
  MOE_CHECK(dst.dtype == DType::bf16,
            std::string("split_bf16: dst must be bf16, got ") + dtype_name(dst.dtype));
  check_shape(dst, {src.size(0), p * src.size(1)}, "split_bf16: dst");
  MOE_CHECK(dst.device == src.device,
            "split_bf16: dst is on " + dst.device.str() + ", src on " + src.device.str());
}

// y [R, C] f32, t [R, B C] f32 with B > every block index; C from y.
inline int64_t check_sum_column_blocks_args(const Tensor& y, const Tensor& t,
                                            const std::vector<int>& blocks) {
  const int64_t n = static_cast<int64_t>(blocks.size());
  MOE_CHECK(n >= 1 && n <= kMaxSplitBlocks,
            "sum_column_blocks: 1 to 8 blocks, got " + std::to_string(blocks.size()));
  MOE_CHECK(y.ndim == 2 && y.dtype == DType::f32 && t.ndim == 2 && t.dtype == DType::f32,
            "sum_column_blocks: y and t must be 2-D f32, got " + y.shape_str() + " " +
                dtype_name(y.dtype) + " and " + t.shape_str() + " " + dtype_name(t.dtype));
  const int64_t c = y.size(1);
  MOE_CHECK(t.size(0) == y.size(0) && c > 0 && t.size(1) % c == 0,
            "sum_column_blocks: t " + t.shape_str() + " is not whole column blocks of y " +
                y.shape_str());
  const int64_t b = t.size(1) / c;
  for (int block : blocks)
    MOE_CHECK(block >= 0 && block < b, "sum_column_blocks: block " + std::to_string(block) +
                                           " outside t's " + std::to_string(b) + " blocks");
  MOE_CHECK(y.device == t.device,
            "sum_column_blocks: y is on " + y.device.str() + ", t on " + t.device.str());
  return c;
}

}  // namespace moe
