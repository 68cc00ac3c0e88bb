// The fp32 "router" matmuls on the 16-bit residual stream: the MoE gate (E outputs), the MoD
// router (1) and the MoD predictor's first layer (predictor_hidden_size). Up to
// kFusedRouterOutputs outputs the fused op reads x as stored and is bound by that read (H200,
// 16384 x 1024 bf16, E = 8: 22 + 70 us forward + backward, against ~210 us for a converted fp32
// copy of x through cuBLAS's fp32 GEMM and a convert-add of dx). Beyond, its fp32 FMAs bound it
// and cuBLAS on the converted copy is the faster one (E = 64: 402 against ~275 us per layer).
#include "model/layers.hpp"
#include "moe/memory.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/router.hpp"

namespace moe {
namespace {

constexpr int64_t kFusedRouterOutputs = 16;

bool fused(const Tensor& w) {
  return w.size(0) <= kFusedRouterOutputs;
}

// x in the accumulation dtype: x itself when the model computes in it, else a converted copy in
// the scratch arena (the caller releases it).
Tensor in_acc_dtype(Ctx& ctx, const LayerEnv& env, Tensor x) {
  if (!env.mixed()) return x;
  Tensor x32 = env.scratch.alloc(env.acc, {x.size(0), x.size(1)});
  convert(ctx, x32, x, false);
  return x32;
}

}  // namespace

void router_matmul_forward(Ctx& ctx, const LayerEnv& env, Tensor y, Tensor x, Tensor w) {
  if (fused(w)) {
    router_logits_forward(ctx, y, x, w);
    return;
  }
  const size_t mark = env.scratch.mark();
  linear_forward(ctx, y, in_acc_dtype(ctx, env, x), w, false);
  env.scratch.release(mark);
}

void router_matmul_backward(Ctx& ctx, const LayerEnv& env, Tensor dx, Tensor dw, Tensor dy,
                            Tensor x, Tensor w) {
  if (fused(w)) {
    router_logits_backward(ctx, dx, dw, dy, x, w);
    return;
  }
  const size_t mark = env.scratch.mark();
  const Tensor xa = in_acc_dtype(ctx, env, x);
  // Whether a dx is wanted, from its shape: in the planning dry run every tensor's data is null,
  // and the scratch it measures must be what the step then takes.
  const bool wants_dx = dx.ndim > 0;
  if (wants_dx && env.mixed()) {  // dx += dy w, through an fp32 product
    Tensor dxa = env.scratch.alloc(env.acc, {x.size(0), x.size(1)});
    linear_backward(ctx, dxa, dw, dy, xa, w, false);
    convert(ctx, dx, dxa, true);
  } else {
    linear_backward(ctx, dx, dw, dy, xa, w, true);
  }
  env.scratch.release(mark);
}

}  // namespace moe
