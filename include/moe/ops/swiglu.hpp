// SwiGLU gate: h = silu(gate) * up, silu(a) = a * sigmoid(a); and plain SiLU.
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// h, gate, up: [R, F]
MOE_OP(swiglu_forward, (Ctx & ctx, Tensor h, Tensor gate, Tensor up), (ctx, h, gate, up))
// dgate = dh * up * silu'(gate), dup = dh * silu(gate) (overwritten)
MOE_OP(swiglu_backward, (Ctx & ctx, Tensor dgate, Tensor dup, Tensor dh, Tensor gate, Tensor up),
       (ctx, dgate, dup, dh, gate, up))
// The MoE experts' SwiGLU with the routing weight of each row applied (the weight moves before the
// down projection, which is linear: W2 (w h) = w (W2 h), so the combine that follows is a plain
// sum and the backward needs no expert outputs). h[r, :] = row_w[r] * silu(gate[r, :]) * up[r, :],
// the product silu(gate) * up rounded to h's dtype before the weight's (as float arithmetic does
// for f32; the CUDA backend's 16-bit kernels and its fused GEMM epilogue round twice alike).
// h, gate, up: [R, F]; row_w: [R] in acc_dtype(h).
MOE_OP(swiglu_weighted_forward, (Ctx & ctx, Tensor h, Tensor gate, Tensor up, Tensor row_w),
       (ctx, h, gate, up, row_w))
// Its backward, dh the gradient of h: dgate = w dh up silu'(gate), dup = w dh silu(gate), and
// drow_w[r] = <dh[r, :], silu(gate[r, :]) up[r, :]> (all overwritten; dgate or dup may alias dh).
// drow_w: [R] in acc_dtype(h).
MOE_OP(swiglu_weighted_backward,
       (Ctx & ctx, Tensor dgate, Tensor dup, Tensor drow_w, Tensor dh, Tensor gate, Tensor up,
        Tensor row_w),
       (ctx, dgate, dup, drow_w, dh, gate, up, row_w))
// y = silu(x)
MOE_OP(silu_forward, (Ctx & ctx, Tensor y, Tensor x), (ctx, y, x))
// dx = dy * silu'(x) (overwritten)
MOE_OP(silu_backward, (Ctx & ctx, Tensor dx, Tensor dy, Tensor x), (ctx, dx, dy, x))

}  // namespace moe
