// AdamW with decoupled weight decay over a contiguous segment of the parameter buffer.
//   g' = grad_scale * g;  m = b1 m + (1-b1) g';  v = b2 v + (1-b2) g'^2
//   p -= lr * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + weight_decay * p)
#pragma once
#include "moe/ops/common.hpp"

namespace moe {

struct AdamWArgs {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  long step = 1;            // t, 1-based, for bias correction
  double grad_scale = 1.0;  // applied to g first (clipping, loss-scale and accumulation factor)
};

// p, g, m, v: same element count and float dtype (m, v start at 0); step >= 1
MOE_OP(adamw_step, (Ctx & ctx, Tensor p, Tensor g, Tensor m, Tensor v, const AdamWArgs& a),
       (ctx, p, g, m, v, a))

}  // namespace moe
