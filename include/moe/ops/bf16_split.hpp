// fp32 matmuls on bf16 tensor cores, for the router matmuls of mixed-precision bf16 runs: an fp32
// value v is the exact sum of three bf16 parts, p1 = bf16(v), p2 = bf16(v - p1), p3 = v - p1 - p2
// (v - p1 and then r - p2 are exact in fp32, and what is left has at most 8 significant bits, so
// bf16 holds it; exact while the parts stay normal and finite, 2^-110 <= |v| < 3.39e38, bf16's
// largest, where p1 would round to inf). A product of a bf16 value and
// a part is exact in fp32, so x w^T with w split into three stacked parts is the fp32 product up
// to the fp32 sums' rounding. Inf and NaN give NaN parts (inf - inf).
#pragma once
#include <vector>

#include "moe/ops/common.hpp"

namespace moe {

// dst [R, P C] bf16, src [R, C] f32: dst[r, j C + c] = part parts[j] (1, 2 or 3, as above) of
// src[r, c], each part rounded to nearest even. P = parts.size() (1 .. 8).
MOE_OP(split_bf16, (Ctx & ctx, Tensor dst, Tensor src, const std::vector<int>& parts),
       (ctx, dst, src, parts))

// y [R, C] f32 = (or += when accumulate) s, s[r, c] the sum of t[r, b C + c] over b in blocks,
// added in the order given (t [R, B C] f32, every index below B; 1 .. 8 of them); y + s is formed
// after s, so a sum of parts is rounded as one value before it meets y.
MOE_OP(sum_column_blocks,
       (Ctx & ctx, Tensor y, Tensor t, const std::vector<int>& blocks, bool accumulate),
       (ctx, y, t, blocks, accumulate))

}  // namespace moe
