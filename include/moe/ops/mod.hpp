// Mixture-of-Depths: each sequence keeps its C highest-scoring tokens for the block; the rest skip.
//   sel[b, :]  positions of the C largest scores of sequence b (ties: lower position wins),
//              ascending (position order, so causal attention among them stays causal)
//   out_i = x_i + sigmoid(r_i) * (ys_i - x_i) for selected i, out_i = x_i otherwise
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// sel: [B, C] i32, mask: [B, T] float (1 where selected, else 0: the predictor's target),
// scores: [B, T], of mask's dtype (fp32 in the model)
MOE_OP(mod_select, (Ctx & ctx, Tensor sel, Tensor mask, Tensor scores), (ctx, sel, mask, scores))
// The MoD router and selection in one op: router_logits_forward(scores viewed [B*T, 1], x, w),
// then mod_select(sel, mask, scores). scores, mask: [B, T] acc_dtype(x), sel: [B, C] i32,
// x: [B*T, d], w: [1, d] acc_dtype(x). On CUDA (sm_80+, 16-bit x, d a multiple of 8) one launch:
// the scores as router_forward computes logits (tensor cores; fp32 rounding away from
// router_logits_forward), and the block that writes a sequence's last score selects that sequence
// exactly as mod_select selects on those scores (bitwise). Elsewhere the two ops in turn.
MOE_OP(mod_route, (Ctx & ctx, Tensor scores, Tensor sel, Tensor mask, Tensor x, Tensor w),
       (ctx, scores, sel, mask, x, w))
// The gather and scatter ops require sel strictly ascending inside [0, T) per sequence (as
// mod_select writes it) and check it; T = x.size(0) / B.
// xs[b*C + c, :] = x[b*T + sel[b, c], :]       xs: [B*C, d], x: [B*T, d]
MOE_OP(mod_gather_forward, (Ctx & ctx, Tensor xs, Tensor x, Tensor sel), (ctx, xs, x, sel))
// dx[b*T + sel[b, c], :] += dxs[b*C + c, :]
MOE_OP(mod_gather_backward, (Ctx & ctx, Tensor dx, Tensor dxs, Tensor sel), (ctx, dx, dxs, sel))
// out: [B*T, d] = x, then the gated update on the selected rows; ys: [B*C, d], scores: [B, T]
// in acc_dtype(x). out may alias x.
MOE_OP(mod_scatter_forward, (Ctx & ctx, Tensor out, Tensor x, Tensor ys, Tensor scores, Tensor sel),
       (ctx, out, x, ys, scores, sel))
// dx: [B*T, d] (overwritten: dout on skipped rows, (1-g)*dout on selected rows),
// dys: [B*C, d] (overwritten: g*dout),
// dscores: [B, T] (overwritten: g(1-g)<dout, ys-x>, 0 if skipped). dx may alias dout.
// scores, dscores: acc_dtype(x).
MOE_OP(mod_scatter_backward,
       (Ctx & ctx, Tensor dx, Tensor dys, Tensor dscores, Tensor dout, Tensor x, Tensor ys,
        Tensor scores, Tensor sel),
       (ctx, dx, dys, dscores, dout, x, ys, scores, sel))

// The causal predictor's head on its hidden pre-activations h = fc1(x):
//   logit[n] = silu(h[n, :]) . w2           (fc2, one output, no bias)
// h: [N, P], w2: [1, P], logit: [N], of one accumulation dtype (f32 or f64: the model's fp32).
// The predictor's BCE on the logits is bce_with_logits_forward's.
MOE_OP(mod_predictor_head_forward, (Ctx & ctx, Tensor logit, Tensor h, Tensor w2),
       (ctx, logit, h, w2))
// Its backward through that BCE, from the saved logits (targets: [N], the selection mask):
//   dl[n] = grad_scale * (sigmoid(logit[n]) - targets[n]) / N   (bce_with_logits_backward's)
//   dh[n, :] = dl[n] * w2 * silu'(h[n, :])   (overwritten)
//   dw2 += sum_n dl[n] * silu(h[n, :])
// One pass over h instead of bce_with_logits_backward, linear_backward and silu_backward's four.
MOE_OP(mod_predictor_head_backward,
       (Ctx & ctx, Tensor dh, Tensor dw2, Tensor h, Tensor w2, Tensor logit, Tensor targets,
        double grad_scale),
       (ctx, dh, dw2, h, w2, logit, targets, grad_scale))

// The CUDA head's limits, which the config checks (model.mod.predictor_hidden_size): its backward
// sums dw2 over blocks of up to kModHeadMaxBlockRows rows into at most kModHeadPartials fp32
// partials (blocks x P), and its forward holds w2 in shared memory (P <= 12288). P is capped
// well below both: the predictor only guesses the router's choice for sampling.
constexpr int64_t kModHeadMaxBlockRows = 4096;
constexpr int64_t kModHeadPartials = int64_t(1) << 19;
constexpr int64_t kModPredictorMaxHidden = 4096;

}  // namespace moe
