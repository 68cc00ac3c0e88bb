// Matmuls with weights stored [out_features, in_features] row-major (Hugging Face layout).
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// y = x w^T (accumulate: y += x w^T)        y: [N, out], x: [N, in], w: [out, in]
MOE_OP(linear_forward, (Ctx & ctx, Tensor y, Tensor x, Tensor w, bool accumulate),
       (ctx, y, x, w, accumulate))
// dx = dy w (or dx += when accumulate_dx; skipped when dx is empty), dw += dy^T x
// dw in acc_dtype(x): a 16-bit product is accumulated into the fp32 gradient with one rounding.
MOE_OP(linear_backward,
       (Ctx & ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, bool accumulate_dx),
       (ctx, dx, dw, dy, x, w, accumulate_dx))

// Grouped (per-expert) linear over rows sorted by expert: rows [offsets[e], offsets[e+1]) use w[e].
// y: [R, out], x: [R, in], w: [E, out, in], offsets: [E+1] i32 (offsets[0] = 0, offsets[E] = R),
// resident on ctx's device (never copied to the host by the CUDA backend). Empty groups are fine.
MOE_OP(grouped_linear_forward, (Ctx & ctx, Tensor y, Tensor x, Tensor w, Tensor offsets),
       (ctx, y, x, w, offsets))
// dx = dy w[e] per group (overwritten), dw[e] += dy_e^T x_e (an expert with no rows gets += 0),
// dw in acc_dtype(x).
MOE_OP(grouped_linear_backward,
       (Ctx & ctx, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor offsets),
       (ctx, dx, dw, dy, x, w, offsets))

}  // namespace moe
