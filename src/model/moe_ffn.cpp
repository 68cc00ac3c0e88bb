// The dropless MoE layer, read as its four stages (Megatron-Core style):
//   route   logits = x Wr^T; softmax; top-K; renormalise; aux + z losses
//   permute rows of x copied into expert order (N*K rows, offsets per expert), and the routing
//           weights w_nk with them
//   experts grouped SwiGLU over each expert's rows, each row's h scaled by its w_nk before the
//           down projection (linear, so W2 (w h) = w W2 h)
//   combine y[n] = sum_k expert_out[slot(n, k)]  (+ shared experts on every token)
// and backward as the same stages reversed. Because the weights act before W2, the combine is a
// plain sum whose backward is a gather, and the weights' gradient comes from the SwiGLU backward
// (<dh, silu(gate) up> per row): the expert outputs [N*K, d] are never kept for the backward.
// Every buffer is sized by N*K, known in advance. (MOE_PERMUTE_FUSED=1 with the expert rows
// recomputed: the expert GEMMs read x's and dy's rows in expert order themselves, and the permuted
// copies are never made; see gathers_expert_rows.)
#include <algorithm>
#include <string>

#include "model/layers.hpp"
#include "moe/env_switch.hpp"
#include "moe/memory.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/permute.hpp"
#include "moe/ops/router.hpp"
#include "moe/ops/swiglu.hpp"

namespace moe {

MoeFfn::MoeFfn(const LayerEnv& env, int layer, int moe_index) : env_(env), moe_index_(moe_index) {
  const std::string p = "model.layers." + std::to_string(layer) + ".block_sparse_moe.";
  gate_ = env.param(p + "gate.weight");
  w1_ = env.param(p + "experts.{j}.w1.weight");
  w3_ = env.param(p + "experts.{j}.w3.weight");
  w2_ = env.param(p + "experts.{j}.w2.weight");
  for (int s = 0; s < env.cfg.num_shared_experts; ++s)
    shared_.push_back(std::make_unique<DenseFfn>(
        env, p + "shared_experts." + std::to_string(s) + ".", "w1", "w3", "w2"));
}

void MoeFfn::plan_state(Arena& state) {
  const int64_t e = env_.cfg.num_local_experts;
  bias_ = state.alloc(env_.acc, {e});
  load_ = env_.loads.rows(moe_index_, moe_index_ + 1).view({e});
}

void MoeFfn::plan(Arena& acts, int64_t rows) {
  const auto& c = env_.cfg;
  const int64_t e = c.num_local_experts, k = c.num_experts_per_tok, d = c.hidden_size;
  const int64_t f = c.intermediate_size, r = rows * k;
  const DType dt = env_.dtype, acc = env_.acc;
  rows_ = rows;
  logits_ = acts.alloc(acc, {rows, e});
  probs_ = acts.alloc(acc, {rows, e});
  topk_idx_ = acts.alloc(DType::i32, {rows, k});
  topk_w_ = acts.alloc(acc, {rows, k});
  counts_ = acts.alloc(DType::i32, {e});
  aux_losses_ = acts.alloc(acc, {2});
  offsets_ = acts.alloc(DType::i32, {e + 1});
  row_token_ = acts.alloc(DType::i32, {r});
  slot_row_ = acts.alloc(DType::i32, {r});
  row_w_ = acts.alloc(acc, {r});
  // The expert GEMMs' inputs, xp and hact, are kept unless the backward rebuilds them
  // (train.recompute_expert_rows: xp, train.recompute_expert_inputs: both; the rebuilt ones live
  // in scratch, see expert_inputs).
  if (!env_.model.recomputes_expert_rows()) xp_ = acts.alloc(dt, {r, d});
  if (!env_.model.recomputes_expert_inputs()) hact_ = acts.alloc(dt, {r, f});
  hgate_ = acts.alloc(dt, {r, f});
  hup_ = acts.alloc(dt, {r, f});
  for (auto& s : shared_) s->plan(acts, rows);
}

MoeFfn::ExpertInputs MoeFfn::expert_inputs(Arena& scratch, bool rows_wanted) const {
  const auto& c = env_.cfg;
  const int64_t r = rows_ * c.num_experts_per_tok;
  ExpertInputs in{xp_, hact_};
  if (env_.model.recomputes_expert_rows() && rows_wanted)
    in.xp = scratch.alloc(env_.dtype, {r, c.hidden_size});
  if (env_.model.recomputes_expert_inputs())
    in.hact = scratch.alloc(env_.dtype, {r, c.intermediate_size});
  return in;
}

// MOE_PERMUTE_FUSED=1 (read at every call): where the backward would rebuild the expert rows
// (train.recompute_expert_rows), the gate and up products' forward and weight gradients read x's
// rows in expert order themselves, and the down projection's backward dy's
// (grouped_swiglu_forward_gathered, grouped_linear_backward_gathered,
// grouped_swiglu_down_backward_gathered; fused on sm_90 only, elsewhere the ops permute into a
// buffer of their own): no permuted copy of either is made. Off by default until measured
// (docs/perf.md, 15th session).
bool MoeFfn::gathers_expert_rows() const {
  return env_switch("MOE_PERMUTE_FUSED", false) && env_.model.recomputes_expert_rows();
}

void MoeFfn::forward(Ctx& ctx, Tensor y, Tensor x, Tensor residual) {
  const auto& c = env_.cfg;
  Arena& s = env_.scratch;
  // route, in the accumulation dtype (fp32 router math with the master gate weights)
  Tensor bias = c.router_bias_update_rate > 0 ? bias_ : Tensor();
  router_route_forward(ctx, env_, logits_, probs_, topk_idx_, topk_w_, counts_, x, gate_.master,
                       bias, c.norm_topk_prob);
  router_aux_loss_forward(ctx, aux_losses_, logits_, probs_, counts_, c.num_experts_per_tok,
                          c.router_aux_loss_coef, c.router_z_loss_coef);
  // permute
  const size_t inputs_mark = s.mark();
  const bool gather = gathers_expert_rows();
  const ExpertInputs in = expert_inputs(s, !gather);
  moe_permute_plan(ctx, offsets_, row_token_, slot_row_, topk_idx_);
  permute_weights_forward(ctx, row_w_, topk_w_, slot_row_);
  // experts (the routing weights applied in the SwiGLU)
  if (gather) {
    grouped_swiglu_forward_gathered(ctx, hgate_, hup_, in.hact, x, row_token_, w1_.w, w3_.w, row_w_,
                                    offsets_);
  } else {
    permute_forward(ctx, in.xp, x, row_token_);
    grouped_swiglu_forward(ctx, hgate_, hup_, in.hact, in.xp, w1_.w, w3_.w, row_w_, offsets_);
  }
  Tensor yp = s.alloc(env_.dtype, {row_token_.size(0), c.hidden_size});
  grouped_linear_forward(ctx, yp, in.hact, w2_.w, offsets_);
  // combine: the plain sum of a token's K expert rows, the gather of permute_backward, from the
  // residual's row. With shared experts the residual is added last, as a plain add: their
  // outputs would otherwise be rounded into the residual's magnitude twice.
  if (shared_.empty())
    permute_backward_add(ctx, y, residual, yp, slot_row_);
  else
    permute_backward(ctx, y, yp, Tensor(), slot_row_);
  s.release(inputs_mark);
  for (auto& sh : shared_) sh->forward(ctx, y, x, true);
  if (!shared_.empty()) add(ctx, y, residual, y);
  // statistics stay on the device: no read-back inside the step
  if (env_.recomputing) return;
  // stats[aux], stats[z] += aux_losses[0], [1]: one elementwise kernel (the sum's two launches a
  // loss cost ~7 us, each of them, per layer)
  static_assert(kStatZ == kStatAux + 1, "the aux and z sums side by side");
  convert(ctx, env_.stats.rows(kStatAux, kStatZ + 1), aux_losses_, true);
  add_counts(ctx, load_, counts_);
}

void MoeFfn::backward(Ctx& ctx, Tensor dx, Tensor dy, Tensor x, double grad_scale) {
  const auto& c = env_.cfg;
  Arena& s = env_.scratch;
  const size_t mark = s.mark();
  const DType dt = env_.dtype, acc = env_.acc;
  // The router's gradients first: the experts' buffers below are released before the router's
  // backward, which may take scratch of its own (the fp32 path: 128 MiB on moe-fine).
  Tensor dtopk_w = s.alloc(acc, {topk_w_.size(0), topk_w_.size(1)});
  Tensor dlogits = s.alloc(acc, {logits_.size(0), logits_.size(1)});
  const size_t experts_mark = s.mark();
  // gathering: no permuted copies of x or dy (gathers_expert_rows)
  const bool gather = gathers_expert_rows();
  const ExpertInputs in = expert_inputs(s, !gather);
  // rebuilt from the layer input and gate / up
  if (env_.model.recomputes_expert_rows() && !gather) permute_forward(ctx, in.xp, x, row_token_);
  if (env_.model.recomputes_expert_inputs())
    swiglu_weighted_forward(ctx, in.hact, hgate_, hup_, row_w_);
  const int64_t r = row_token_.size(0);
  // the expert rows' output gradient (gathering: read from dy by the down projection's backward)
  Tensor dyp = gather ? Tensor() : s.alloc(dt, {r, c.hidden_size});
  Tensor drow_w = s.alloc(acc, {r});
  Tensor dgate = s.alloc(dt, {hgate_.size(0), hgate_.size(1)});
  Tensor dup = s.alloc(dt, {hgate_.size(0), hgate_.size(1)});
  // Buffers dead by then take the input gradients: dyp once the down projection's backward has
  // run (one [N*K, d] of backward scratch fewer: 256 MiB on moe-fine; gathering, dxp has the
  // [N*K, d] dyp would have had), and dgate once w1's backward has, when it is large enough
  // (F >= d; moe-small: 64 MiB fewer): dxp_up, the second product's dx where it is computed apart
  // (grouped_linear_backward_pair's workspace: it reads dgate before writing it).
  const int64_t d = x.size(1), f = hgate_.size(1);
  Tensor dxp = gather ? s.alloc(dt, {r, d}) : dyp;
  // (none where the op runs dx as one product: grouped_linear_backward_pair_needs_dx2)
  const bool needs_dx2 = grouped_linear_backward_pair_needs_dx2(ctx, dt, r, w1_.w.size(0), d, f);
  Tensor dxp_up = !needs_dx2 ? Tensor()
                  : f >= d   ? dgate.view({r * f}).rows(0, r * d).view({r, d})
                             : s.alloc(dt, {r, d});
  // combine (a plain sum: each expert row's gradient is its token's: the permute of dy, or
  // gathering, the expert GEMMs read dy's and x's rows themselves); experts (the SwiGLU backward
  // gives the routing weights' gradient too)
  const bool dw_overwrite = env_.model.backward_writes_expert_grads();
  if (gather) {
    grouped_swiglu_down_backward_gathered(ctx, dgate, dup, drow_w, w2_.g, dy, row_token_, in.hact,
                                          w2_.w, hgate_, hup_, row_w_, offsets_, dw_overwrite);
    grouped_linear_backward_pair_gathered(ctx, dxp, dxp_up, w1_.g, w3_.g, dgate, dup, x, row_token_,
                                          w1_.w, w3_.w, offsets_, dw_overwrite);
  } else {
    permute_forward(ctx, dyp, dy, row_token_);
    grouped_swiglu_down_backward(ctx, dgate, dup, drow_w, w2_.g, dyp, in.hact, w2_.w, hgate_, hup_,
                                 row_w_, offsets_, dw_overwrite);
    // dxp = dgate w1 + dup w3 (dxp_up: the op's workspace where it sums them apart)
    grouped_linear_backward_pair(ctx, dxp, dxp_up, w1_.g, w3_.g, dgate, dup, in.xp, w1_.w, w3_.w,
                                 offsets_, dw_overwrite);
  }
  // permute (the gather of the rows' summed input gradient)
  permute_backward(ctx, dx, dxp, Tensor(), slot_row_);
  permute_weights_backward(ctx, dtopk_w, drow_w, slot_row_);
  s.release(experts_mark);  // the experts' buffers are dead from here
  // route: through the combine weights, then the auxiliary losses
  router_topk_backward(ctx, dlogits, dtopk_w, probs_, topk_idx_, c.norm_topk_prob);
  router_aux_loss_backward(ctx, dlogits, logits_, probs_, counts_, c.num_experts_per_tok,
                           c.router_aux_loss_coef, c.router_z_loss_coef, grad_scale);
  router_matmul_backward(ctx, env_, dx, gate_.g, dlogits, x, gate_.master);
  for (auto& sh : shared_) sh->backward(ctx, dx, dy, x, true);
  s.release(mark);
}

void MoeFfn::after_step(Ctx& ctx) {
  const auto& c = env_.cfg;
  if (c.router_bias_update_rate <= 0) return;
  router_bias_update(ctx, bias_, load_, c.router_bias_update_rate);
}

}  // namespace moe
