// Token permutation for dropless MoE. The N*K routed slots (slot s = n*K + k) are laid out in
// expert order; within an expert, by slot index (so the order is deterministic).
//   offsets[e]   first permuted row of expert e (offsets[E] = N*K)
//   row_token[r] token whose copy sits in permuted row r
//   slot_row[s]  permuted row of slot s
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// offsets: [E+1] i32, row_token: [N*K] i32, slot_row: [N*K] i32, topk_idx: [N, K] i32
MOE_OP(moe_permute_plan,
       (Ctx & ctx, Tensor offsets, Tensor row_token, Tensor slot_row, Tensor topk_idx),
       (ctx, offsets, row_token, slot_row, topk_idx))
// xp[r, :] = x[row_token[r], :]        xp: [N*K, d], x: [N, d]
MOE_OP(permute_forward, (Ctx & ctx, Tensor xp, Tensor x, Tensor row_token), (ctx, xp, x, row_token))
// dx[n, :] = sum_k dxp[slot_row[n*K+k], :] (overwritten; gathers, no atomics). With dxp2 (not
// empty, dxp's shape and dtype) dx[n, :] = sum_k (dxp[r, :] + dxp2[r, :]): the MoE layer's two
// input gradients (through w1 and w3) summed in the gather instead of by an extra pass.
MOE_OP(permute_backward, (Ctx & ctx, Tensor dx, Tensor dxp, Tensor dxp2, Tensor slot_row),
       (ctx, dx, dxp, dxp2, slot_row))
// y[n, :] = base[n, :] + sum_k yp[slot_row[n*K+k], :] (overwritten; base: y's shape and dtype, not
// y's memory): the MoE combine with the block's residual add in the same pass, one rounding of
// the token's sum.
MOE_OP(permute_backward_add, (Ctx & ctx, Tensor y, Tensor base, Tensor yp, Tensor slot_row),
       (ctx, y, base, yp, slot_row))
// The routing weights in permuted-row order: row_w[slot_row[s]] = topk_w[s] (overwritten). The
// experts' SwiGLU applies them (swiglu_weighted_forward), so the combine is the plain gather-sum
// permute_backward: y[n, :] = sum_k yp[slot_row[n*K+k], :], and its backward permute_forward.
// row_w: [N*K], topk_w: [N, K], both f32 / f64 (the router's accumulation dtype).
MOE_OP(permute_weights_forward, (Ctx & ctx, Tensor row_w, Tensor topk_w, Tensor slot_row),
       (ctx, row_w, topk_w, slot_row))
// dtopk_w[s] = drow_w[slot_row[s]] (overwritten); dtopk_w: [N, K], drow_w: [N*K].
MOE_OP(permute_weights_backward, (Ctx & ctx, Tensor dtopk_w, Tensor drow_w, Tensor slot_row),
       (ctx, dtopk_w, drow_w, slot_row))

}  // namespace moe
