// Losses: softmax cross-entropy for the LM head and binary cross-entropy with logits for the
// MoD predictor. Both computed with a max-shifted log-sum-exp, in fp32 or better.
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// losses[n] = lse_n - logits[n, targets[n]] (0 where targets[n] < 0: ignored), lse: [N] saved.
// logits: [N, V], targets: [N] i32; losses and lse in acc_dtype(logits) (fp32 for 16-bit logits).
MOE_OP(cross_entropy_forward, (Ctx & ctx, Tensor losses, Tensor lse, Tensor logits, Tensor targets),
       (ctx, losses, lse, logits, targets))
// dlogits = grad_scale * (softmax(logits) - onehot(targets)) (overwritten; 0 rows where ignored).
// dlogits may alias logits (the fused path overwrites logits with their gradient). dlogits: the
// logits' dtype; lse: acc_dtype(logits).
MOE_OP(cross_entropy_backward,
       (Ctx & ctx, Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, double grad_scale),
       (ctx, dlogits, logits, lse, targets, grad_scale))
// Both in one call: cross_entropy_forward, then cross_entropy_backward from the lse it wrote (the
// same bits as the two ops). The training step's LM head, whose loss gradient's scale is known
// before its forward: the CUDA backend reads each row of logits once for both.
MOE_OP(cross_entropy_forward_backward,
       (Ctx & ctx, Tensor losses, Tensor lse, Tensor dlogits, Tensor logits, Tensor targets,
        double grad_scale),
       (ctx, losses, lse, dlogits, logits, targets, grad_scale))

// loss[0] = mean_n BCE(sigmoid(logits[n]), targets[n])    loss: [1], logits, targets: [N] float,
// all of one dtype
// evaluated as max(x, 0) - x t + log1p(exp(-|x|)), finite for any finite x.
MOE_OP(bce_with_logits_forward, (Ctx & ctx, Tensor loss, Tensor logits, Tensor targets),
       (ctx, loss, logits, targets))
// dlogits = grad_scale * (sigmoid(logits) - targets) / N (overwritten)
MOE_OP(bce_with_logits_backward,
       (Ctx & ctx, Tensor dlogits, Tensor logits, Tensor targets, double grad_scale),
       (ctx, dlogits, logits, targets, grad_scale))

}  // namespace moe
