// Causal GQA self-attention: q, k, v projections, RoPE on q and k at each row's position,
// attention (log-sum-exp saved, no T x T matrix kept), output projection.
#include "model/layers.hpp"
#include "moe/ops/attention.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/rope.hpp"

namespace moe {

SelfAttention::SelfAttention(const LayerEnv& env, const std::string& prefix)
    : env_(env),
      wq_(env.param(prefix + "self_attn.q_proj.weight")),
      wk_(env.param(prefix + "self_attn.k_proj.weight")),
      wv_(env.param(prefix + "self_attn.v_proj.weight")),
      wo_(env.param(prefix + "self_attn.o_proj.weight")) {}

void SelfAttention::plan(Arena& acts, Dims dims) {
  const auto& c = env_.cfg;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.resolved_head_dim();
  dims_ = dims;
  q_ = acts.alloc(env_.dtype, {dims.B, dims.T, nh, hd});
  k_ = acts.alloc(env_.dtype, {dims.B, dims.T, nkv, hd});
  v_ = acts.alloc(env_.dtype, {dims.B, dims.T, nkv, hd});
  att_ = acts.alloc(env_.dtype, {dims.B, dims.T, nh, hd});
  lse_ = acts.alloc(env_.acc, {dims.B, nh, dims.T});
}

// Views of a [B, T, heads, hd] tensor as matmul rows [B*T, heads*hd] and RoPE rows [B*T, heads,
// hd].
static Tensor as_rows(Tensor t) {
  return t.view({t.size(0) * t.size(1), t.size(2) * t.size(3)});
}
static Tensor as_heads(Tensor t) {
  return t.view({t.size(0) * t.size(1), t.size(2), t.size(3)});
}

void SelfAttention::forward(Ctx& ctx, Tensor y, Tensor x, Tensor pos) {
  linear_forward(ctx, as_rows(q_), x, wq_.w, false);
  linear_forward(ctx, as_rows(k_), x, wk_.w, false);
  linear_forward(ctx, as_rows(v_), x, wv_.w, false);
  rope_forward(ctx, as_heads(q_), pos, env_.rope_cos, env_.rope_sin);
  rope_forward(ctx, as_heads(k_), pos, env_.rope_cos, env_.rope_sin);
  attention_forward(ctx, att_, lse_, q_, k_, v_);
  linear_forward(ctx, y, as_rows(att_), wo_.w, false);
}

void SelfAttention::backward(Ctx& ctx, Tensor dx, Tensor dy, Tensor x, Tensor pos) {
  Arena& s = env_.scratch;
  const size_t mark = s.mark();
  Tensor datt = s.alloc(env_.dtype, {att_.size(0), att_.size(1), att_.size(2), att_.size(3)});
  Tensor dq = s.alloc(env_.dtype, {q_.size(0), q_.size(1), q_.size(2), q_.size(3)});
  Tensor dk = s.alloc(env_.dtype, {k_.size(0), k_.size(1), k_.size(2), k_.size(3)});
  Tensor dv = s.alloc(env_.dtype, {v_.size(0), v_.size(1), v_.size(2), v_.size(3)});
  linear_backward(ctx, as_rows(datt), wo_.g, dy, as_rows(att_), wo_.w, false);
  attention_backward(ctx, dq, dk, dv, datt, q_, k_, v_, att_, lse_);
  rope_backward(ctx, as_heads(dq), pos, env_.rope_cos, env_.rope_sin);
  rope_backward(ctx, as_heads(dk), pos, env_.rope_cos, env_.rope_sin);
  linear_backward(ctx, dx, wq_.g, as_rows(dq), x, wq_.w, false);
  linear_backward(ctx, dx, wk_.g, as_rows(dk), x, wk_.w, true);
  linear_backward(ctx, dx, wv_.g, as_rows(dv), x, wv_.w, true);
  s.release(mark);
}

}  // namespace moe
