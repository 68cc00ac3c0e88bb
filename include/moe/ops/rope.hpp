// Rotary position embedding, Hugging Face "rotate_half" convention: for j < hd/2 the pair
// (x_j, x_{j+hd/2}) at position p rotates by angle p * theta^(-2j/hd).
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// Builds the cached table once: cos, sin: [P, hd/2] with cos[p, j] = cos(p * theta^(-2j/hd)).
// The table is f32 or f64: it is read in acc_dtype(x) by the rotations (an f16 / bf16 table would
// put a 16-bit rounding into every angle).
MOE_OP(rope_table, (Ctx & ctx, Tensor cos, Tensor sin, double theta), (ctx, cos, sin, theta))
// In place: x: [N, H, hd] rotated per row by position pos[n] (i32, [N], < P; a position outside
// [0, P) is a caller bug: InternalError). cos, sin: acc_dtype(x).
MOE_OP(rope_forward, (Ctx & ctx, Tensor x, Tensor pos, Tensor cos, Tensor sin),
       (ctx, x, pos, cos, sin))
// In place: dx: [N, H, hd] rotated back (the transpose of the forward rotation).
MOE_OP(rope_backward, (Ctx & ctx, Tensor dx, Tensor pos, Tensor cos, Tensor sin),
       (ctx, dx, pos, cos, sin))

}  // namespace moe
