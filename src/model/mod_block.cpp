// Mixture-of-Depths block (MODEL_SPEC "Mixture-of-Depths block"):
//   r = x w_mod; S = top-C of r per sequence (position order); x_S = gather(x, S)
//   out_S = x_S + sigmoid(r_S) * (Block(x_S) - x_S),  out_i = x_i elsewhere
// The selected rows keep their original positions (RoPE) and their order (causal mask), so the
// inner block is an ordinary block over B sequences of C tokens. The causal predictor
// (fc2(silu(fc1(x)))) trains on stop-gradient x to guess "i in S" for sampling; its BCE enters
// the training loss with mod.predictor_loss_coef and is reported apart.
#include <cmath>

#include "model/layers.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/loss.hpp"
#include "moe/ops/mod.hpp"

namespace moe {

static int64_t mod_keep(double capacity, int64_t seq_len) {
  // ceil with a guard against 0.125 * 64 = 8.000000001 style rounding
  int64_t c = static_cast<int64_t>(std::ceil(capacity * static_cast<double>(seq_len) - 1e-9));
  return std::max<int64_t>(1, std::min<int64_t>(c, seq_len));
}

ModBlock::ModBlock(const LayerEnv& env, int layer, int moe_index, Dims dims)
    : env_(env),
      dims_(dims),
      keep_(mod_keep(env.cfg.mod.capacity, dims.T)),
      router_(env.param("model.layers." + std::to_string(layer) + ".mod.router.weight")),
      fc1_(env.param("model.layers." + std::to_string(layer) + ".mod.predictor.fc1.weight")),
      fc2_(env.param("model.layers." + std::to_string(layer) + ".mod.predictor.fc2.weight")),
      inner_(env, layer, moe_index, Dims{dims.B, mod_keep(env.cfg.mod.capacity, dims.T)}) {}

void ModBlock::plan(Arena& acts) {
  const int64_t n = dims_.rows(), d = env_.cfg.hidden_size, p = fc1_.w.size(0);
  const DType dt = env_.dtype, acc = env_.acc;
  scores_ = acts.alloc(acc, {n, 1});
  sel_ = acts.alloc(DType::i32, {dims_.B, keep_});
  mask_ = acts.alloc(acc, {dims_.B, dims_.T});
  xs_ = acts.alloc(dt, {dims_.B * keep_, d});
  ys_ = acts.alloc(dt, {dims_.B * keep_, d});
  pred_h_ = acts.alloc(acc, {n, p});
  pred_logit_ = acts.alloc(acc, {n, 1});
  pred_loss_ = acts.alloc(acc, {1});
  inner_.plan(acts);
}

// The MoD router runs in the accumulation dtype (fp32 in mixed precision) on the master weights:
// selection by top-C is sensitive to rounding of the scores. The predictor only guesses that
// selection for sampling: its first layer is an ordinary compute-dtype product (bf16 tensor cores,
// fp32 sums and output, like the model's other linears), its head (silu, fc2, BCE) fp32 on the
// master fc2. In bf16 the fp32-exact product (router_matmul's three bf16 parts of an fp32 master)
// cost three times the product plus the parts' split and sum: ~0.2 ms of moe-small's MoD step.
void ModBlock::forward(Ctx& ctx, Tensor out, Tensor x, Tensor /*pos*/) {
  const Tensor scores = scores_.view({dims_.B, dims_.T});
  const Tensor sel_pos = sel_.view({dims_.B * keep_});  // positions of the kept tokens
  mod_route_forward(ctx, env_, scores, sel_, mask_, x, router_.master);
  // causal predictor on stop-gradient x
  linear_forward(ctx, pred_h_, x, fc1_.w, false);
  mod_predictor_head_forward(ctx, pred_logit_, pred_h_, fc2_.master);
  bce_with_logits_forward(ctx, pred_loss_, pred_logit_.view({dims_.rows()}),
                          mask_.view({dims_.rows()}));
  if (!env_.recomputing)
    accumulate_sum(ctx, env_.stats.rows(kStatModPred, kStatModPred + 1), pred_loss_,
                   env_.cfg.mod.predictor_loss_coef);
  // the block on the selected tokens
  mod_gather_forward(ctx, xs_, x, sel_);
  inner_.forward(ctx, ys_, xs_, sel_pos);
  mod_scatter_forward(ctx, out, x, ys_, scores, sel_);
  if (ctx.dry_run || env_.recomputing) return;
  RoutingStats& r = env_.routing();  // shapes only: known on the host
  r.mod_kept += static_cast<double>(dims_.B * keep_);
  r.mod_seen += static_cast<double>(dims_.rows());
}

// The input's gradient goes into dout's memory (backward_in_place): dout on the skipped rows as it
// stands, the selected rows' gradient written over theirs by the scatter's backward and added to
// by the gather's; dx is not touched.
void ModBlock::backward(Ctx& ctx, Tensor /*dx*/, Tensor dout, Tensor x, Tensor /*pos*/,
                        double grad_scale) {
  Arena& s = env_.scratch;
  const size_t mark = s.mark();
  const int64_t n = dims_.rows(), d = env_.cfg.hidden_size, p = fc1_.w.size(0);
  const DType dt = env_.dtype, acc = env_.acc;
  const Tensor scores = scores_.view({dims_.B, dims_.T});
  const Tensor sel_pos = sel_.view({dims_.B * keep_});
  Tensor dys = s.alloc(dt, {dims_.B * keep_, d});
  Tensor dxs = s.alloc(dt, {dims_.B * keep_, d});
  Tensor dscores = s.alloc(acc, {n, 1});
  Tensor dph = s.alloc(acc, {n, p});
  const Tensor dx = dout;
  mod_scatter_backward(ctx, dx, dys, dscores.view({dims_.B, dims_.T}), dout, x, ys_, scores, sel_);
  inner_.backward(ctx, dxs, dys, xs_, sel_pos, grad_scale);
  // The router's gradient: dscores is 0 off the selected rows (the top-C choice passes none), so
  // its dw and its dx term come from the B*C selected rows of x (xs_) alone, the dx term added
  // into dxs before the gather's backward adds dxs into dx: a pass over 1/capacity fewer rows
  // (x read and dx updated) than over all of them.
  Tensor dscores_sel = s.alloc(acc, {dims_.B * keep_, 1});
  mod_gather_forward(ctx, dscores_sel, dscores, sel_);
  router_matmul_backward(ctx, env_, dxs, router_.g, dscores_sel, xs_, router_.master);
  mod_gather_backward(ctx, dx, dxs, sel_);
  // predictor: parameters only (x is stop-gradient)
  mod_predictor_head_backward(ctx, dph, fc2_.g, pred_h_, fc2_.master, pred_logit_.view({n}),
                              mask_.view({n}), grad_scale * env_.cfg.mod.predictor_loss_coef);
  Tensor dph_c = dph;  // the product's dy in the compute dtype, as every linear's
  if (env_.mixed()) {
    dph_c = s.alloc(dt, {n, p});
    convert(ctx, dph_c, dph, false);
  }
  linear_backward(ctx, Tensor(), fc1_.g, dph_c, x, fc1_.w, false);
  s.release(mark);
}

}  // namespace moe
