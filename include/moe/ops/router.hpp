// MoE router: softmax over experts, top-K, optional renormalisation, load statistics and the
// auxiliary losses. Router math is always in the float dtype of `logits` (fp32 in training).
//
//   p      = softmax(logits)                          [N, E]
//   top-K by (logits + bias) (bias only steers selection; ties: lower expert index wins),
//          listed in descending order of the selection score
//   w_k    = p_k / sum_topk(p)   if norm_topk_prob, else p_k
//   aux    = aux_coef * E * sum_e f_e * P_e,  f_e = counts_e / (N*K) (a constant),
//            P_e = mean_n p_ne
//   z      = z_coef * mean_n logsumexp(logits_n)^2
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

// probs: [N, E], topk_idx: [N, K] i32, topk_w: [N, K], counts: [E] i32 (overwritten: slots per
// expert), logits: [N, E], bias: [E] or empty. K = topk_idx.size(1). Non-finite scores throw.
MOE_OP(router_topk_forward,
       (Ctx & ctx, Tensor probs, Tensor topk_idx, Tensor topk_w, Tensor counts, Tensor logits,
        Tensor bias, bool norm_topk_prob),
       (ctx, probs, topk_idx, topk_w, counts, logits, bias, norm_topk_prob))
// dlogits: [N, E] (overwritten) from dtopk_w: [N, K] through the renormalisation and softmax.
// With norm_topk_prob only the selected logits get gradient (w is invariant to the others);
// without it every logit does, through the softmax.
MOE_OP(router_topk_backward,
       (Ctx & ctx, Tensor dlogits, Tensor dtopk_w, Tensor probs, Tensor topk_idx,
        bool norm_topk_prob),
       (ctx, dlogits, dtopk_w, probs, topk_idx, norm_topk_prob))

// losses: [2] (overwritten: aux, z) in the float dtype of logits. counts: the forward's [E] i32
// (f_e is a constant of the loss: no gradient flows through the selection), k = K.
MOE_OP(router_aux_loss_forward,
       (Ctx & ctx, Tensor losses, Tensor logits, Tensor probs, Tensor counts, int k,
        double aux_coef, double z_coef),
       (ctx, losses, logits, probs, counts, k, aux_coef, z_coef))
// dlogits += grad_scale * d(aux + z)/dlogits
MOE_OP(router_aux_loss_backward,
       (Ctx & ctx, Tensor dlogits, Tensor logits, Tensor probs, Tensor counts, int k,
        double aux_coef, double z_coef, double grad_scale),
       (ctx, dlogits, logits, probs, counts, k, aux_coef, z_coef, grad_scale))

// The router in one op: router_logits_forward(logits, x, w), then router_topk_forward(probs,
// topk_idx, topk_w, counts, logits, bias, norm_topk_prob) on those logits. On CUDA, where the
// device has sm_80 tensor cores, x is 16-bit with rows of a multiple of 8 elements and E <= 8, it
// is one launch that reads x once: the gate products on tensor cores (tf32, with w split exactly
// into three parts, so every product is exact and only the fp32 sums' order differs from the
// CPU's router_logits_forward: the logits agree with it to fp32 rounding, and bitwise with the
// CUDA router_logits_forward, which takes the same product at that shape), then each token
// routed from its logits in registers exactly as router_topk_forward routes those logits
// (bitwise). Elsewhere the two ops in turn.
MOE_OP(router_forward,
       (Ctx & ctx, Tensor logits, Tensor probs, Tensor topk_idx, Tensor topk_w, Tensor counts,
        Tensor x, Tensor w, Tensor bias, bool norm_topk_prob),
       (ctx, logits, probs, topk_idx, topk_w, counts, x, w, bias, norm_topk_prob))

// Aux-loss-free balancing: bias_e += rate * sign(mean(load) - load_e), sign(0) = 0.
// bias: [E], load: [E]
// (float, routed slots summed over the step's micro-batches).
MOE_OP(router_bias_update, (Ctx & ctx, Tensor bias, Tensor load, double rate),
       (ctx, bias, load, rate))

// acc[e] += counts[e]    acc: [E] f32 or f64, counts: [E] i32 (router_topk_forward's counts).
// Sums the expert loads of a step's micro-batches on the device (exact below 2^24 in f32).
MOE_OP(add_counts, (Ctx & ctx, Tensor acc, Tensor counts), (ctx, acc, counts))

// The router's gate matmul, fused: 16-bit x is widened exactly as it is read, so no fp32 copy of
// x and no separate GEMM are needed.
// logits = x w^T in acc_dtype(x) arithmetic (x widened exactly; fp32 for f32/f16/bf16 x, f64 for
// f64 x). logits: [N, E] acc_dtype(x); x: [N, d] any float dtype; w: [E, d] acc_dtype(x) (the
// master gate weights). On CUDA at the MoE gate's shape (sm_80+, 16-bit x, d a multiple of 8,
// E <= 8) the product runs on tensor cores as router_forward's (exact tf32 parts, fp32 sums);
// for the wider bf16 gates (below: router_logits_on_tensor_cores) on bf16 tensor cores with w
// split exactly into three bf16 parts: the logits agree with the CPU op to fp32 rounding.
MOE_OP(router_logits_forward, (Ctx & ctx, Tensor logits, Tensor x, Tensor w), (ctx, logits, x, w))
// dx += dlogits w (accumulated in acc arithmetic onto dx's value and rounded once to dx's dtype =
// x's dtype; skipped when dx is empty: the MoD predictor's input is stop-gradient), dw +=
// dlogits^T x (acc dtype). dlogits: [N, E] acc dtype. On CUDA at the gate's shape (16-bit x,
// E <= 8, d a multiple of 8 up to 2048) dx and dw come from one pass over the rows.
// On CUDA with sm_80 tensor cores, bf16 x, 16 < E <= 64 a multiple of 4 and d a multiple of 128
// (the wider gates: moe-fine's 64 experts) it runs on bf16 tensor cores with dlogits and w split
// exactly into three bf16 parts (every product exact): dw agrees with the CPU op to fp32 rounding
// of the sums; dx takes the three largest cross terms of the parts (dl1 w1, dl1 w2, dl2 w1; the
// others are below 2^-16 of the largest, 2^-7 of dx's bf16 rounding step), so it rounds as the
// fp32 product would in all but a fraction of a percent of elements, one bf16 step off there.
MOE_OP(router_logits_backward,
       (Ctx & ctx, Tensor dx, Tensor dw, Tensor dlogits, Tensor x, Tensor w),
       (ctx, dx, dw, dlogits, x, w))
// Whether router_logits_forward and _backward take those bf16 tensor-core passes for an [N, d] x
// of dtype dt and E experts on ctx's device (16-byte aligned tensors assumed, as arena allocations
// are; d up to 8192). Decided from sizes and the device alone, so the planning dry run and the
// step agree. (The ops themselves still take the general kernels, same contract but slower, for
// views not 16-byte aligned or, in the backward, a dx that overlaps x.)
#ifdef MOE_WITH_CUDA
namespace cuda {
inline bool (*router_logits_on_tensor_cores)(DType dt, int64_t n, int64_t e, int64_t d) = nullptr;
}
#endif
inline bool router_logits_on_tensor_cores(const Ctx& ctx, DType dt, int64_t n, int64_t e,
                                          int64_t d) {
#ifdef MOE_WITH_CUDA
  if (ctx.device.type == DeviceType::cuda && cuda::router_logits_on_tensor_cores)
    return cuda::router_logits_on_tensor_cores(dt, n, e, d);
#endif
  (void)ctx, (void)dt, (void)n, (void)e, (void)d;
  return false;
}

}  // namespace moe
