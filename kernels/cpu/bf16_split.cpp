// split_bf16 and sum_column_blocks on the CPU (moe/ops/bf16_split.hpp): the reference the CUDA
// ops match bitwise.
#include "common/bf16_split_checks.hpp"
#include "common/float16.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/bf16_split.hpp"

namespace moe::cpu {

void split_bf16(Ctx& ctx, Tensor dst, Tensor src, const std::vector<int>& parts) {
  check_split_bf16_args(dst, src, parts);
  const int64_t rows = src.size(0), cols = src.size(1), p = static_cast<int64_t>(parts.size());
  const float* s = src.ptr<float>();
  uint16_t* d = static_cast<uint16_t*>(dst.data);
#pragma omp parallel for if (parallel_worth(rows * cols * p))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = s[r * cols + c];
      const uint16_t p1 = float16::float_to_bf16(v);
      const float r1 = v - float16::bf16_to_float(p1);
      const uint16_t p2 = float16::float_to_bf16(r1);
      const uint16_t p3 = float16::float_to_bf16(r1 - float16::bf16_to_float(p2));
      for (int64_t j = 0; j < p; ++j)
        d[(r * p + j) * cols + c] = parts[j] == 1 ? p1 : parts[j] == 2 ? p2 : p3;
    }
}

void sum_column_blocks(Ctx& ctx, Tensor y, Tensor t, const std::vector<int>& blocks,
                       bool accumulate) {
  const int64_t cols = check_sum_column_blocks_args(y, t, blocks);
  const int64_t rows = y.size(0), tcols = t.size(1);
  float* out = y.ptr<float>();
  const float* in = t.ptr<float>();
#pragma omp parallel for if (parallel_worth(rows * cols * static_cast <int64_t>(blocks.size())))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float sum = in[r * tcols + blocks[0] * cols + c];
      for (size_t j = 1; j < blocks.size(); ++j) sum += in[r * tcols + blocks[j] * cols + c];
      out[r * cols + c] = accumulate ? out[r * cols + c] + sum : sum;
    }
}

}  // namespace moe::cpu
