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
  stacked_qkv_ = nh == nkv;
  if (stacked_qkv_) {  // q, k and v side by side: the batched projections' [3, B*T, nh*hd] output
    qkv_ = acts.alloc(env_.dtype, {3 * dims.B, dims.T, nh, hd});
    q_ = stacked(qkv_, 0);
    k_ = stacked(qkv_, 1);
    v_ = stacked(qkv_, 2);
  } else {
    q_ = acts.alloc(env_.dtype, {dims.B, dims.T, nh, hd});
    k_ = acts.alloc(env_.dtype, {dims.B, dims.T, nkv, hd});
    v_ = acts.alloc(env_.dtype, {dims.B, dims.T, nkv, hd});
  }
  att_ = acts.alloc(env_.dtype, {dims.B, dims.T, nh, hd});
  lse_ = acts.alloc(env_.acc, {dims.B, nh, dims.T});
}

// Views of a [B, T, heads, hd] tensor as matmul rows [B*T, heads*hd] and RoPE rows [B*T, heads,
// hd]; of a [3 B, T, heads, hd] one (q, k, v side by side) as its i-th [B, T, heads, hd] and as the
// batched matmul's [3, B*T, heads*hd].
static Tensor as_rows(Tensor t) {
  return t.view({t.size(0) * t.size(1), t.size(2) * t.size(3)});
}
static Tensor as_heads(Tensor t) {
  return t.view({t.size(0) * t.size(1), t.size(2), t.size(3)});
}
Tensor SelfAttention::stacked(Tensor t, int64_t i) {
  const int64_t b = t.size(0) / 3;
  return t.rows(i * b, (i + 1) * b);
}
static Tensor as_batched_rows(Tensor t) {
  return t.view({3, t.size(0) / 3 * t.size(1), t.size(2) * t.size(3)});
}

// q, k and v's weights (or gradients) as one [3, out, in] tensor, when they lie side by side in
// that order (the parameter table's layout; not where ZeRO-3 gathers them apart); else empty.
static Tensor side_by_side(const Tensor& q, const Tensor& k, const Tensor& v) {
  const auto next = [](const Tensor& a, const Tensor& b) {
    return a.data != nullptr && static_cast<const char*>(a.data) + a.nbytes() == b.data &&
           a.dtype == b.dtype && a.device == b.device && b.ndim == 2 && a.size(0) == b.size(0) &&
           a.size(1) == b.size(1);
  };
  if (q.ndim != 2 || !next(q, k) || !next(k, v)) return Tensor();
  return Tensor(q.data, q.dtype, q.device, {3, q.size(0), q.size(1)});
}

void SelfAttention::forward(Ctx& ctx, Tensor y, Tensor x, Tensor pos) {
  // The three projections in one launch where q, k, v and their weights lie side by side.
  const Tensor w_qkv = stacked_qkv_ ? side_by_side(wq_.w, wk_.w, wv_.w) : Tensor();
  if (!w_qkv.empty()) {
    linear_forward_batched(ctx, as_batched_rows(qkv_), x, w_qkv);
  } else {
    linear_forward(ctx, as_rows(q_), x, wq_.w, false);
    linear_forward(ctx, as_rows(k_), x, wk_.w, false);
    linear_forward(ctx, as_rows(v_), x, wv_.w, false);
  }
  rope_forward(ctx, as_heads(q_), pos, env_.rope_cos, env_.rope_sin);
  rope_forward(ctx, as_heads(k_), pos, env_.rope_cos, env_.rope_sin);
  attention_forward(ctx, att_, lse_, q_, k_, v_);
  linear_forward(ctx, y, as_rows(att_), wo_.w, false);
}

void SelfAttention::backward(Ctx& ctx, Tensor dx, Tensor dy, Tensor x, Tensor pos) {
  Arena& s = env_.scratch;
  const size_t mark = s.mark();
  Tensor datt = s.alloc(env_.dtype, {att_.size(0), att_.size(1), att_.size(2), att_.size(3)});
  Tensor dqkv, dq, dk, dv;  // side by side as q, k, v where those are
  if (stacked_qkv_) {
    dqkv = s.alloc(env_.dtype, {3 * q_.size(0), q_.size(1), q_.size(2), q_.size(3)});
    dq = stacked(dqkv, 0);
    dk = stacked(dqkv, 1);
    dv = stacked(dqkv, 2);
  } else {
    dq = s.alloc(env_.dtype, {q_.size(0), q_.size(1), q_.size(2), q_.size(3)});
    dk = s.alloc(env_.dtype, {k_.size(0), k_.size(1), k_.size(2), k_.size(3)});
    dv = s.alloc(env_.dtype, {v_.size(0), v_.size(1), v_.size(2), v_.size(3)});
  }
  // Where the backward sums dq over key tiles in fp32 in the same pass as dk and dv (the sm_90
  // kernel, ops/attention.hpp), its scratch.
  Tensor dq_acc;
  if (attention_backward_wants_dq_acc(ctx, env_.dtype, q_.size(0), q_.size(1), q_.size(2),
                                      k_.size(2), q_.size(3)))
    dq_acc = s.alloc(DType::f32, {q_.size(0), q_.size(2), q_.size(1), q_.size(3)});
  linear_backward(ctx, as_rows(datt), wo_.g, dy, as_rows(att_), wo_.w, false);
  attention_backward(ctx, dq, dk, dv, datt, q_, k_, v_, att_, lse_, dq_acc);
  rope_backward(ctx, as_heads(dq), pos, env_.rope_cos, env_.rope_sin);
  rope_backward(ctx, as_heads(dk), pos, env_.rope_cos, env_.rope_sin);
  const Tensor w_qkv = stacked_qkv_ ? side_by_side(wq_.w, wk_.w, wv_.w) : Tensor();
  const Tensor g_qkv = stacked_qkv_ ? side_by_side(wq_.g, wk_.g, wv_.g) : Tensor();
  if (!w_qkv.empty() && !g_qkv.empty()) {
    linear_backward_batched(ctx, dx, g_qkv, as_batched_rows(dqkv), x, w_qkv, false);
  } else {
    linear_backward(ctx, dx, wq_.g, as_rows(dq), x, wq_.w, false);
    linear_backward(ctx, dx, wk_.g, as_rows(dk), x, wk_.w, true);
    linear_backward(ctx, dx, wv_.g, as_rows(dv), x, wv_.w, true);
  }
  s.release(mark);
}

}  // namespace moe
