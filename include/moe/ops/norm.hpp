// RMSNorm: y = w * x / sqrt(mean(x^2) + eps), statistics in fp32 or better.
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// y: [N, d], rstd: [N] (saved 1/sqrt(mean(x^2)+eps), in acc_dtype(x)), x: [N, d], w: [d]
MOE_OP(rmsnorm_forward, (Ctx & ctx, Tensor y, Tensor rstd, Tensor x, Tensor w, double eps),
       (ctx, y, rstd, x, w, eps))
// dx: [N, d] (overwritten), dw: [d] (+=, in acc_dtype(x)), dy: [N, d], rstd in acc_dtype(x)
// dx = rstd * (w*dy - x * rstd^2 * mean(w*dy*x)),  dw += sum_n dy * x * rstd
MOE_OP(rmsnorm_backward,
       (Ctx & ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd),
       (ctx, dx, dw, dy, x, w, rstd))

}  // namespace moe
