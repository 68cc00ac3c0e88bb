// SwiGLU gate: h = silu(gate) * up, silu(a) = a * sigmoid(a); and plain SiLU.
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// h, gate, up: [R, F]
MOE_OP(swiglu_forward, (Ctx & ctx, Tensor h, Tensor gate, Tensor up), (ctx, h, gate, up))
// dgate = dh * up * silu'(gate), dup = dh * silu(gate) (overwritten)
MOE_OP(swiglu_backward, (Ctx & ctx, Tensor dgate, Tensor dup, Tensor dh, Tensor gate, Tensor up),
       (ctx, dgate, dup, dh, gate, up))
// y = silu(x)
MOE_OP(silu_forward, (Ctx & ctx, Tensor y, Tensor x), (ctx, y, x))
// dx = dy * silu'(x) (overwritten)
MOE_OP(silu_backward, (Ctx & ctx, Tensor dx, Tensor dy, Tensor x), (ctx, dx, dy, x))

}  // namespace moe
