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
// y[n, :] = sum_k w[n, k] * yp[slot_row[n*K+k], :]      y: [N, d] (overwritten), yp: [N*K, d],
// topk_w: [N, K] in acc_dtype(y) (the router's fp32 weights)
MOE_OP(combine_forward, (Ctx & ctx, Tensor y, Tensor yp, Tensor topk_w, Tensor slot_row),
       (ctx, y, yp, topk_w, slot_row))
// dyp[slot_row[s], :] = w[s] * dy[n, :],  dtopk_w[n, k] = <dy[n, :], yp[slot_row[s], :]>
// (both overwritten; slot_row must be the plan's permutation, so each dyp row is written once).
// topk_w, dtopk_w: acc_dtype(dy); dyp, yp: dy's dtype.
MOE_OP(combine_backward,
       (Ctx & ctx, Tensor dyp, Tensor dtopk_w, Tensor dy, Tensor yp, Tensor topk_w,
        Tensor slot_row),
       (ctx, dyp, dtopk_w, dy, yp, topk_w, slot_row))

}  // namespace moe
