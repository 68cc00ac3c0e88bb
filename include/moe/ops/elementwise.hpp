// Elementwise helpers over whole tensors (any float dtype; all arguments share it, except where a
// comment says otherwise).
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
// out[0] += scale * sum(x), out a 1-element f64 tensor on x's device, the sum in double with a
// fixed reduction order (bitwise repeatable): keeps loss sums on the device, read once per step.
MOE_OP(accumulate_sum, (Ctx & ctx, Tensor out, Tensor x, double scale), (ctx, out, x, scale))
// dst[:] = src[:] converted to dst's dtype (or dst[:] += src[:] when accumulate); same numel, any
// float dtypes (f32, f64, f16, bf16) on either side, on both backends. The value (or the sum,
// formed in f32, or in f64 when either side is f64) is rounded once into dst's dtype, to nearest
// even: f64 -> f16 / bf16 does not round twice through f32. Master weights -> 16-bit working copy,
// and 16-bit gradients -> fp32 accumulators.
MOE_OP(convert, (Ctx & ctx, Tensor dst, Tensor src, bool accumulate), (ctx, dst, src, accumulate))

}  // namespace moe
