// RMSNorm: y = w * x / sqrt(mean(x^2) + eps), statistics in fp32 or better.
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// y: [N, d], rstd: [N] (saved 1/sqrt(mean(x^2)+eps), in acc_dtype(x)), x: [N, d], w: [d]
MOE_OP(rmsnorm_forward, (Ctx & ctx, Tensor y, Tensor rstd, Tensor x, Tensor w, double eps),
       (ctx, y, rstd, x, w, eps))
// dx: [N, d] (overwritten), dw: [d] (+=, in acc_dtype(x)), dy: [N, d], rstd in acc_dtype(x)
// dx = rstd * (w*dy - x * rstd^2 * mean(w*dy*x)),  dw += sum_n dy * x * rstd
// dx may alias dy.
MOE_OP(rmsnorm_backward,
       (Ctx & ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd),
       (ctx, dx, dw, dy, x, w, rstd))

// The pre-norm block's residual add fused into the norm that follows it, one pass over the rows
// instead of two: h = x + r, rounded once into h's dtype exactly as add(h, x, r) rounds it, then
// y, rstd = RMSNorm(h) computed from that stored (rounded) h. The results are bitwise those of
// add(h, x, r) then rmsnorm_forward(y, rstd, h, w, eps) on the same backend.
// h, y, x, r: [N, d], w: [d], rstd: [N] in acc_dtype(x). h may alias x or r (each element is read
// before it is written, by its writer); y must not alias h, x or r.
MOE_OP(add_rmsnorm_forward,
       (Ctx & ctx, Tensor h, Tensor y, Tensor rstd, Tensor x, Tensor r, Tensor w, double eps),
       (ctx, h, y, rstd, x, r, w, eps))
// rmsnorm_backward plus the gradient of the residual branch that skips the norm:
// dx = residual + rstd * (w*dy - x * rstd^2 * mean(w*dy*x)),  dw += sum_n dy * x * rstd.
// The sum is formed in the arithmetic type (double on the CPU, fp32 / f64 on CUDA) and rounded
// once into dx's dtype. So it is NOT bitwise rmsnorm_backward into a temporary followed by add:
// that path rounds the norm's gradient into dx's dtype (16 bits in mixed precision) before the add
// and rounds again after it; this one skips the first rounding (more accurate; in f64 on the CPU
// the two agree bitwise, in f32 to within an f32 ulp of max(|residual|, |gradient|)).
// dx: [N, d] (overwritten), dw: [d] (+=, in acc_dtype(x)), dy, x, residual: [N, d], w: [d],
// rstd: [N] in acc_dtype(x). dx may alias residual (the residual stream's gradient updated in
// place) or dy; it must not alias x.
MOE_OP(rmsnorm_backward_add,
       (Ctx & ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd,
        Tensor residual),
       (ctx, dx, dw, dy, x, w, rstd, residual))

}  // namespace moe
