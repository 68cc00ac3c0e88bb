// The fused router ops on the CPU: each is its two ops in turn (the oracle of
// kernels/cuda/router_fused.cu, whose one-launch path computes the same things).
#include "moe/ops/mod.hpp"
#include "moe/ops/router.hpp"

namespace moe::cpu {

void router_forward(Ctx& ctx, Tensor logits, Tensor probs, Tensor topk_idx, Tensor topk_w,
                    Tensor counts, Tensor x, Tensor w, Tensor bias, bool norm_topk_prob) {
  cpu::router_logits_forward(ctx, logits, x, w);
  cpu::router_topk_forward(ctx, probs, topk_idx, topk_w, counts, logits, bias, norm_topk_prob);
}

void mod_route(Ctx& ctx, Tensor scores, Tensor sel, Tensor mask, Tensor x, Tensor w) {
  MOE_CHECK(scores.ndim == 2, "mod_route: scores must be [B, T], got " + scores.shape_str());
  cpu::router_logits_forward(ctx, scores.view({scores.numel(), 1}), x, w);
  cpu::mod_select(ctx, sel, mask, scores);
}

}  // namespace moe::cpu
