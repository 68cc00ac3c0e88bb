// The fp32 "router" matmuls on the 16-bit residual stream: the MoE gate (E outputs), the MoD
// router (1) and the MoD predictor's first layer (predictor_hidden_size). Up to
// kFusedRouterOutputs outputs the fused op reads x as stored and is bound by that read (H200,
// 16384 x 1024 bf16, E = 8: 22 + 70 us forward + backward, against ~210 us for a converted fp32
// copy of x through cuBLAS's fp32 GEMM and a convert-add of dx). Beyond, its fp32 FMAs bound it
// and cuBLAS on the converted copy is the faster one (E = 64: 402 against ~275 us per layer).
//
// In bf16 runs (unless MOE_ROUTER_SPLIT_BF16=0), the wide case runs on bf16 tensor cores instead,
// with no fp32 copy of x (moe/ops/bf16_split.hpp): w is split into three bf16 parts w1 + w2 + w3 =
// w (exact), and
// - forward: t = x [w1; w2; w3]^T in fp32 ([N, 3E], every product exact), y = t1 + t2 + t3;
// - backward: dy = a1 + a2 + a3 likewise, and one product over k = 6E, A = [a1 a1 a2 a1 a2 a3]
//   times B = [w1; w2; w1; w3; w2; w1], gives dx += dy w as the six cross terms down to 2^-24
//   of the largest (the three left out are below fp32's rounding), rounded once into dx by
//   cuBLAS's epilogue; its weight gradient A^T x holds a1^T x in column blocks 0, 1 and 3,
//   a2^T x in 2 and 4, a3^T x in 5, so dw += blocks 0 + 2 + 5. Without dx (the MoD predictor)
//   A = [a1 a2 a3] and dw += blocks 0 + 1 + 2.
// Measured on the H200 (12th session): moe-fine (E = 64) 250,015 -> 255,637 tok/s, the same
// losses to 4 digits; the cuBLAS fp32 path stays for fp16 / fp32 runs and the comparison.
// Where router_logits_forward and _backward run their bf16 tensor-core passes for the shape
// (16 < E <= 64, sm_80+: the same parts, split as they are loaded, no [N, 3E] or [N, 6E] buffers
// and no summing passes; dx from the three largest of the six terms, ops/router.hpp), the split
// path takes those ops instead (unless MOE_ROUTER_SPLIT_MMA=0).

#include "model/layers.hpp"
#include "moe/env_switch.hpp"
#include "moe/memory.hpp"
#include "moe/ops/bf16_split.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/mod.hpp"
#include "moe/ops/router.hpp"

namespace moe {
namespace {

constexpr int64_t kFusedRouterOutputs = 16;

bool fused(const Tensor& w) {
  return w.size(0) <= kFusedRouterOutputs;
}

// The routers' one-op paths (router_forward, mod_route) unless MOE_ROUTER_FUSED=0.
bool fused_routing(const Tensor& w) {
  return fused(w) && env_switch("MOE_ROUTER_FUSED", true);
}

// The split path's one-op form (the top comment), unless MOE_ROUTER_SPLIT_MMA=0: read at every
// call, as split_path.
bool split_in_one_op(Ctx& ctx, Tensor x, Tensor w) {
  return env_switch("MOE_ROUTER_SPLIT_MMA", true) &&
         router_logits_on_tensor_cores(ctx, x.dtype, x.size(0), w.size(0), x.size(1));
}

// The bf16 tensor-core path (see the top comment): bf16 compute, an fp32 master w, the switch
// not 0. Read at every call, so the planning dry run and the step agree.
bool split_path(const LayerEnv& env) {
  return env.dtype == DType::bf16 && env.acc == DType::f32 &&
         env_switch("MOE_ROUTER_SPLIT_BF16", true);
}

// w [E, d] f32 as its bf16 parts, stacked as rows [P E, d] in the given order.
Tensor split_rows(Ctx& ctx, const LayerEnv& env, Tensor w, const std::vector<int>& parts) {
  const int64_t e = w.size(0), d = w.size(1), p = static_cast<int64_t>(parts.size());
  Tensor out = env.scratch.alloc(DType::bf16, {p * e, d});
  split_bf16(ctx, out.view({1, p * e * d}), w.view({1, e * d}), parts);
  return out;
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
  if (fused(w) || (split_path(env) && split_in_one_op(ctx, x, w))) {
    router_logits_forward(ctx, y, x, w);
    return;
  }
  const size_t mark = env.scratch.mark();
  if (split_path(env)) {
    const int64_t n = x.size(0), e = w.size(0);
    const Tensor w3 = split_rows(ctx, env, w, {1, 2, 3});
    Tensor t = env.scratch.alloc(DType::f32, {n, 3 * e});
    linear_forward(ctx, t, x, w3, false);
    sum_column_blocks(ctx, y, t, {0, 1, 2}, false);
  } else {
    linear_forward(ctx, y, in_acc_dtype(ctx, env, x), w, false);
  }
  env.scratch.release(mark);
}

namespace {

// The backward's split path (the top comment): dx += dy w unless dx is empty, dw += dy^T x.
void split_backward(Ctx& ctx, const LayerEnv& env, Tensor dx, Tensor dw, Tensor dy, Tensor x,
                    Tensor w, bool wants_dx) {
  const int64_t n = x.size(0), d = x.size(1), e = w.size(0);
  const std::vector<int> a_parts =
      wants_dx ? std::vector<int>{1, 1, 2, 1, 2, 3} : std::vector<int>{1, 2, 3};
  const std::vector<int> dw_blocks =
      wants_dx ? std::vector<int>{0, 2, 5} : std::vector<int>{0, 1, 2};
  const int64_t k = static_cast<int64_t>(a_parts.size());
  Tensor a = env.scratch.alloc(DType::bf16, {n, k * e});
  split_bf16(ctx, a, dy, a_parts);
  // B is read only for dx; without one it just gives linear_backward its [k E, d] shape.
  const Tensor b = wants_dx ? split_rows(ctx, env, w, {1, 2, 1, 3, 2, 1})
                            : env.scratch.alloc(DType::bf16, {k * e, d});
  Tensor dwk = env.scratch.alloc(DType::f32, {k * e, d});
  fill(ctx, dwk, 0.0);
  linear_backward(ctx, wants_dx ? dx : Tensor(), dwk, a, x, b, true);
  sum_column_blocks(ctx, dw.view({1, e * d}), dwk.view({1, k * e * d}), dw_blocks, true);
}

}  // namespace

void router_matmul_backward(Ctx& ctx, const LayerEnv& env, Tensor dx, Tensor dw, Tensor dy,
                            Tensor x, Tensor w) {
  if (fused(w) || (split_path(env) && split_in_one_op(ctx, x, w))) {
    router_logits_backward(ctx, dx, dw, dy, x, w);
    return;
  }
  const size_t mark = env.scratch.mark();
  // Whether a dx is wanted, from its shape: in the planning dry run every tensor's data is null,
  // and the scratch it measures must be what the step then takes.
  const bool wants_dx = dx.ndim > 0;
  if (split_path(env)) {
    split_backward(ctx, env, dx, dw, dy, x, w, wants_dx);
    env.scratch.release(mark);
    return;
  }
  const Tensor xa = in_acc_dtype(ctx, env, x);
  if (wants_dx && env.mixed()) {  // dx += dy w, through an fp32 product
    Tensor dxa = env.scratch.alloc(env.acc, {x.size(0), x.size(1)});
    linear_backward(ctx, dxa, dw, dy, xa, w, false);
    convert(ctx, dx, dxa, true);
  } else {
    linear_backward(ctx, dx, dw, dy, xa, w, true);
  }
  env.scratch.release(mark);
}

void router_route_forward(Ctx& ctx, const LayerEnv& env, Tensor logits, Tensor probs,
                          Tensor topk_idx, Tensor topk_w, Tensor counts, Tensor x, Tensor w,
                          Tensor bias, bool norm_topk_prob) {
  if (fused_routing(w)) {
    router_forward(ctx, logits, probs, topk_idx, topk_w, counts, x, w, bias, norm_topk_prob);
    return;
  }
  router_matmul_forward(ctx, env, logits, x, w);
  router_topk_forward(ctx, probs, topk_idx, topk_w, counts, logits, bias, norm_topk_prob);
}

void mod_route_forward(Ctx& ctx, const LayerEnv& env, Tensor scores, Tensor sel, Tensor mask,
                       Tensor x, Tensor w) {
  if (fused_routing(w)) {
    mod_route(ctx, scores, sel, mask, x, w);
    return;
  }
  router_matmul_forward(ctx, env, scores.view({scores.numel(), 1}), x, w);
  mod_select(ctx, sel, mask, scores);
}

}  // namespace moe
