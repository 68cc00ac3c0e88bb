// Elementwise helpers over whole tensors (any float dtype; all arguments share it).
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// x[:] = value
MOE_OP(fill, (Ctx & ctx, Tensor x, double value), (ctx, x, value))
// dst[:] = src[:]  (same numel)
MOE_OP(copy, (Ctx & ctx, Tensor dst, Tensor src), (ctx, dst, src))
// out = a + b  (out may alias a or b)
MOE_OP(add, (Ctx & ctx, Tensor out, Tensor a, Tensor b), (ctx, out, a, b))
// y += alpha * x
MOE_OP(axpy, (Ctx & ctx, Tensor y, Tensor x, double alpha), (ctx, y, x, alpha))
// x *= alpha
MOE_OP(scale, (Ctx & ctx, Tensor x, double alpha), (ctx, x, alpha))
// out[0] += sum(x^2), out a 1-element f64 tensor on x's device (partial sums of a global norm).
MOE_OP(sum_squares, (Ctx & ctx, Tensor out, Tensor x), (ctx, out, x))

}  // namespace moe
