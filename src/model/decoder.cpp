// The decode layers: the model's block, MoE FFN and MoD wrapper for one token at a time, composed
// from the same ops as the training layers (block.cpp, self_attention.cpp, moe_ffn.cpp,
// dense_ffn.cpp, mod_block.cpp) in the same order, so a kept token's hidden state matches the
// training forward's row for that token to rounding. What differs is only what one row allows:
//   attention  the new key/value go into a cache and one query attends over it
//              (attention_decode_forward) instead of a causal T x T pass;
//   MoE        the K chosen experts run directly on the token's row (each a plain SwiGLU on
//              the expert's weight slice) instead of permute -> grouped matmuls -> combine;
//   MoD        the causal predictor, not the top-C of the sequence, picks the kept tokens,
//              because the scores of future tokens are unknown while sampling.
#include <algorithm>
#include <cmath>
#include <vector>

#include "model/decoder_layers.hpp"
#include "moe/ops/decode.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/mod.hpp"
#include "moe/ops/norm.hpp"
#include "moe/ops/rope.hpp"
#include "moe/ops/router.hpp"
#include "moe/ops/swiglu.hpp"

namespace moe {
namespace {

std::string layer_prefix(int layer) {
  return "model.layers." + std::to_string(layer) + ".";
}

// Member e of a stacked [E, out, in] expert weight as an [out, in] matrix (a stack of one
// expert is stored without its leading dimension).
Tensor expert_slice(Tensor stack, int64_t e) {
  if (stack.ndim == 2) return stack;
  return stack.rows(e, e + 1).view({stack.size(1), stack.size(2)});
}

// A small float tensor's values on the host as doubles (router pick weights, predictor logit), in
// one copy (on a GPU each copy waits for the device).
void read_floats(Tensor t, std::vector<double>& out) {
  MOE_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64,
            "decoder: float tensor expected, got " + std::string(dtype_name(t.dtype)));
  out.resize(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::f64) {
    copy_to_host(out.data(), t);
  } else {
    std::vector<float> values(out.size());
    copy_to_host(values.data(), t);
    std::copy(values.begin(), values.end(), out.begin());
  }
}

SwigluWeights swiglu_weights(const DecodeEnv& env, const std::string& prefix, const char* w1,
                             const char* w3, const char* w2) {
  return SwigluWeights{env.param(prefix + w1 + ".weight"), env.param(prefix + w3 + ".weight"),
                       env.param(prefix + w2 + ".weight")};
}

}  // namespace

// ---- SwiGLU on one row --------------------------------------------------------------------------

void SwigluRow::plan(Arena& acts, DType dtype) {
  gate_ = acts.alloc(dtype, {1, hidden_});
  up_ = acts.alloc(dtype, {1, hidden_});
  act_ = acts.alloc(dtype, {1, hidden_});
}

void SwigluRow::forward(Ctx& ctx, Tensor y, Tensor x, const SwigluWeights& w, bool accumulate) {
  linear_forward(ctx, gate_, x, w.w1, false);
  linear_forward(ctx, up_, x, w.w3, false);
  swiglu_forward(ctx, act_, gate_, up_);
  linear_forward(ctx, y, act_, w.w2, accumulate);
}

// ---- MoE FFN ------------------------------------------------------------------------------------

DecodeMoe::DecodeMoe(const DecodeEnv& env, int layer, Tensor bias)
    : env_(env),
      bias_(bias),
      expert_(env.cfg.intermediate_size),
      shared_row_(env.cfg.resolved_shared_ffn()) {
  const std::string p = layer_prefix(layer) + "block_sparse_moe.";
  gate_ = env.param(p + "gate.weight");
  w1_ = env.param(p + "experts.{j}.w1.weight");
  w3_ = env.param(p + "experts.{j}.w3.weight");
  w2_ = env.param(p + "experts.{j}.w2.weight");
  for (int s = 0; s < env.cfg.num_shared_experts; ++s)
    shared_.push_back(
        swiglu_weights(env, p + "shared_experts." + std::to_string(s) + ".", "w1", "w3", "w2"));
  host_idx_.resize(static_cast<size_t>(env.cfg.num_experts_per_tok));
}

void DecodeMoe::plan(Arena& acts) {
  const auto& c = env_.cfg;
  const int64_t e = c.num_local_experts, k = c.num_experts_per_tok, d = c.hidden_size;
  const DType dt = env_.dtype;
  logits_ = acts.alloc(dt, {1, e});
  probs_ = acts.alloc(dt, {1, e});
  topk_idx_ = acts.alloc(DType::i32, {1, k});
  topk_w_ = acts.alloc(dt, {1, k});
  counts_ = acts.alloc(DType::i32, {e});
  expert_y_ = acts.alloc(dt, {1, d});
  expert_.plan(acts, dt);
  shared_row_.plan(acts, dt);
}

void DecodeMoe::forward(Ctx& ctx, Tensor y, Tensor x) {
  const auto& c = env_.cfg;
  // route (the bias steers the selection only, as in training)
  linear_forward(ctx, logits_, x, gate_, false);
  router_topk_forward(ctx, probs_, topk_idx_, topk_w_, counts_, logits_, bias_, c.norm_topk_prob);
  copy_to_host(host_idx_.data(), topk_idx_);
  read_floats(topk_w_, host_w_);
  // experts, summed in pick order like combine_forward
  fill(ctx, y, 0.0);
  for (size_t k = 0; k < host_idx_.size(); ++k) {
    const int64_t e = host_idx_[k];
    const SwigluWeights w{expert_slice(w1_, e), expert_slice(w3_, e), expert_slice(w2_, e)};
    expert_.forward(ctx, expert_y_, x, w, false);
    axpy(ctx, y, expert_y_, host_w_[k]);
  }
  for (const auto& s : shared_) shared_row_.forward(ctx, y, x, s, true);
}

// ---- attention over the cache -------------------------------------------------------------------

DecodeAttention::DecodeAttention(const DecodeEnv& env, const std::string& prefix)
    : env_(env),
      wq_(env.param(prefix + "self_attn.q_proj.weight")),
      wk_(env.param(prefix + "self_attn.k_proj.weight")),
      wv_(env.param(prefix + "self_attn.v_proj.weight")),
      wo_(env.param(prefix + "self_attn.o_proj.weight")) {}

void DecodeAttention::plan(Arena& acts) {
  const auto& c = env_.cfg;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.resolved_head_dim();
  k_cache_ = acts.alloc(env_.dtype, {1, env_.max_len, nkv, hd});
  v_cache_ = acts.alloc(env_.dtype, {1, env_.max_len, nkv, hd});
  q_ = acts.alloc(env_.dtype, {1, nh, hd});
  att_ = acts.alloc(env_.dtype, {1, nh, hd});
  lengths_ = acts.alloc(DType::i32, {1});
  len_ = 0;
}

void DecodeAttention::forward(Ctx& ctx, Tensor y, Tensor x, Tensor pos) {
  MOE_CHECK(len_ < env_.max_len, "DecodeAttention: the key/value cache is full");
  const int64_t nh = q_.size(1), nkv = k_cache_.size(2), hd = q_.size(2);
  // The new token's key and value are written straight into their cache slot.
  Tensor k_row = k_cache_.view({env_.max_len, nkv * hd}).rows(len_, len_ + 1);
  Tensor v_row = v_cache_.view({env_.max_len, nkv * hd}).rows(len_, len_ + 1);
  linear_forward(ctx, q_.view({1, nh * hd}), x, wq_, false);
  linear_forward(ctx, k_row, x, wk_, false);
  linear_forward(ctx, v_row, x, wv_, false);
  rope_forward(ctx, q_, pos, env_.rope_cos, env_.rope_sin);
  rope_forward(ctx, k_row.view({1, nkv, hd}), pos, env_.rope_cos, env_.rope_sin);
  ++len_;
  const int32_t len = static_cast<int32_t>(len_);
  copy_from_host(lengths_, &len);
  attention_decode_forward(ctx, att_, q_, k_cache_, v_cache_, lengths_);
  linear_forward(ctx, y, att_.view({1, nh * hd}), wo_, false);
}

// ---- block --------------------------------------------------------------------------------------

DecodeBlock::DecodeBlock(const DecodeEnv& env, int layer, Tensor router_bias)
    : env_(env),
      norm1_(env.param(layer_prefix(layer) + "input_layernorm.weight")),
      norm2_(env.param(layer_prefix(layer) + "post_attention_layernorm.weight")),
      attn_(env, layer_prefix(layer)) {
  if (env.cfg.is_moe_layer(layer)) {
    moe_ = std::make_unique<DecodeMoe>(env, layer, router_bias);
  } else {
    dense_ = std::make_unique<SwigluWeights>(
        swiglu_weights(env, layer_prefix(layer) + "mlp.", "gate_proj", "up_proj", "down_proj"));
    dense_row_ = std::make_unique<SwigluRow>(env.cfg.resolved_dense_ffn());
  }
}

void DecodeBlock::plan(Arena& acts) {
  const int64_t d = env_.cfg.hidden_size;
  const DType dt = env_.dtype;
  xn1_ = acts.alloc(dt, {1, d});
  rstd1_ = acts.alloc(dt, {1});
  attn_y_ = acts.alloc(dt, {1, d});
  h_ = acts.alloc(dt, {1, d});
  xn2_ = acts.alloc(dt, {1, d});
  rstd2_ = acts.alloc(dt, {1});
  ffn_y_ = acts.alloc(dt, {1, d});
  attn_.plan(acts);
  if (moe_) moe_->plan(acts);
  if (dense_row_) dense_row_->plan(acts, dt);
}

void DecodeBlock::forward(Ctx& ctx, Tensor out, Tensor x, Tensor pos) {
  const double eps = env_.cfg.rms_norm_eps;
  rmsnorm_forward(ctx, xn1_, rstd1_, x, norm1_, eps);
  attn_.forward(ctx, attn_y_, xn1_, pos);
  add_rmsnorm_forward(ctx, h_, xn2_, rstd2_, x, attn_y_, norm2_, eps);  // bitwise add + norm
  if (moe_)
    moe_->forward(ctx, ffn_y_, xn2_);
  else
    dense_row_->forward(ctx, ffn_y_, xn2_, *dense_, false);
  add(ctx, out, h_, ffn_y_);
}

// ---- Mixture-of-Depths --------------------------------------------------------------------------

DecodeModLayer::DecodeModLayer(const DecodeEnv& env, int layer, Tensor router_bias)
    : env_(env),
      router_(env.param(layer_prefix(layer) + "mod.router.weight")),
      fc1_(env.param(layer_prefix(layer) + "mod.predictor.fc1.weight")),
      fc2_(env.param(layer_prefix(layer) + "mod.predictor.fc2.weight")),
      inner_(env, layer, router_bias) {}

void DecodeModLayer::plan(Arena& acts) {
  const int64_t d = env_.cfg.hidden_size, p = fc1_.size(0);
  const DType dt = env_.dtype;
  score_ = acts.alloc(dt, {1, 1});
  pred_h_ = acts.alloc(dt, {1, p});
  pred_a_ = acts.alloc(dt, {1, p});
  pred_logit_ = acts.alloc(dt, {1, 1});
  ys_ = acts.alloc(dt, {1, d});
  sel_ = acts.alloc(DType::i32, {1, 1});
  if (!acts.measuring()) {
    // A one-token "sequence" whose one token is kept: the gated scatter then does exactly the
    // training update out = x + sigmoid(r) (ys - x) on it.
    const int32_t first = 0;
    copy_from_host(sel_, &first);
  }
  inner_.plan(acts);
}

// p = sigmoid(fc2(silu(fc1 x))) > 0.5, evaluated in double on the host.
bool DecodeModLayer::predictor_keeps(Ctx& ctx, Tensor x) {
  linear_forward(ctx, pred_h_, x, fc1_, false);
  silu_forward(ctx, pred_a_, pred_h_);
  linear_forward(ctx, pred_logit_, pred_a_, fc2_, false);
  read_floats(pred_logit_, host_logit_);
  const double p = 1.0 / (1.0 + std::exp(-host_logit_[0]));
  return p > 0.5;
}

void DecodeModLayer::forward(Ctx& ctx, Tensor out, Tensor x, Tensor pos) {
  if (!predictor_keeps(ctx, x)) {
    copy(ctx, out, x);
    return;
  }
  linear_forward(ctx, score_, x, router_, false);
  inner_.forward(ctx, ys_, x, pos);
  mod_scatter_forward(ctx, out, x, ys_, score_, sel_);
}

std::unique_ptr<DecodeLayer> make_decode_layer(const DecodeEnv& env, int layer,
                                               Tensor router_bias) {
  if (env.cfg.is_mod_layer(layer)) return std::make_unique<DecodeModLayer>(env, layer, router_bias);
  return std::make_unique<DecodeBlock>(env, layer, router_bias);
}

}  // namespace moe
