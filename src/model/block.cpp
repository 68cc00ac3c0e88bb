// The pre-norm transformer block (MODEL_SPEC "Block l"):
//   h = x + Attn(RMSNorm_1(x));  out = h + FFN(RMSNorm_2(h)),  FFN dense or MoE per moe_layer_freq.
// The residual adds that meet a norm run fused into it (add_rmsnorm_forward, rmsnorm_backward_add):
// one pass over [N, d] per add saved. The final add of the forward has no norm of this block
// after it: a MoE FFN adds h itself (in its combine's pass where it has no shared experts:
// MoeFfn::forward's residual), a dense one with a plain add.
#include "model/layers.hpp"
#include "moe/memory.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/norm.hpp"

namespace moe {

Block::Block(const LayerEnv& env, int layer, int moe_index, Dims dims)
    : env_(env),
      dims_(dims),
      norm1_(env.param("model.layers." + std::to_string(layer) + ".input_layernorm.weight")),
      norm2_(
          env.param("model.layers." + std::to_string(layer) + ".post_attention_layernorm.weight")),
      attn_(env, "model.layers." + std::to_string(layer) + ".") {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  if (env.cfg.is_moe_layer(layer))
    moe_ = std::make_unique<MoeFfn>(env, layer, moe_index);
  else
    dense_ = std::make_unique<DenseFfn>(env, p + "mlp.", "gate_proj", "up_proj", "down_proj");
}

void Block::plan(Arena& acts) {
  const int64_t n = dims_.rows(), d = env_.cfg.hidden_size;
  // Kept for the backward: the norms' inputs and outputs. The attention's and the FFN's outputs
  // are not (the residual adds' gradients do not read them): they are written straight into h
  // and into the block's output, which the adds then update in place.
  xn1_ = acts.alloc(env_.dtype, {n, d});
  rstd1_ = acts.alloc(env_.acc, {n});
  h_ = acts.alloc(env_.dtype, {n, d});
  xn2_ = acts.alloc(env_.dtype, {n, d});
  rstd2_ = acts.alloc(env_.acc, {n});
  attn_.plan(acts, dims_);
  if (moe_) moe_->plan(acts, n);
  if (dense_) dense_->plan(acts, n);
}

void Block::forward(Ctx& ctx, Tensor out, Tensor x, Tensor pos) {
  const double eps = env_.cfg.rms_norm_eps;
  rmsnorm_forward(ctx, xn1_, rstd1_, x, norm1_.w, eps);
  attn_.forward(ctx, h_, xn1_, pos);                                 // h = attn_y
  add_rmsnorm_forward(ctx, h_, xn2_, rstd2_, x, h_, norm2_.w, eps);  // h = x + attn_y (in place)
  if (moe_) {
    moe_->forward(ctx, out, xn2_, h_);  // out = h + ffn_y (out is never h)
  } else {
    dense_->forward(ctx, out, xn2_, false);
    add(ctx, out, h_, out);  // out = h + ffn_y
  }
}

void Block::backward(Ctx& ctx, Tensor dx, Tensor dout, Tensor x, Tensor pos, double grad_scale) {
  Arena& s = env_.scratch;
  const size_t mark = s.mark();
  const int64_t n = dims_.rows(), d = env_.cfg.hidden_size;
  Tensor dh = s.alloc(env_.dtype, {n, d});
  Tensor dxn = s.alloc(env_.dtype, {n, d});
  // out = h + FFN(norm2(h)): dh = dout + norm2'(dxn)
  if (moe_)
    moe_->backward(ctx, dxn, dout, xn2_, grad_scale);
  else
    dense_->backward(ctx, dxn, dout, xn2_, false);
  rmsnorm_backward_add(ctx, dh, norm2_.g, dxn, h_, norm2_.w, rstd2_, dout);
  // h = x + Attn(norm1(x)): dx = dh + norm1'(dxn)
  attn_.backward(ctx, dxn, dh, xn1_, pos);
  rmsnorm_backward_add(ctx, dx, norm1_.g, dxn, x, norm1_.w, rstd1_, dh);
  s.release(mark);
}

void Block::after_step(Ctx& ctx) {
  if (moe_) moe_->after_step(ctx);
}

ParamView LayerEnv::param(const std::string& name) const {
  const ParamInfo& p = model.table().find(name);
  return ParamView{model.work(p), model.grad(p), model.param(p)};
}

std::unique_ptr<Layer> make_layer(const LayerEnv& env, int layer, int moe_index, Dims dims) {
  if (env.cfg.is_mod_layer(layer)) return std::make_unique<ModBlock>(env, layer, moe_index, dims);
  return std::make_unique<Block>(env, layer, moe_index, dims);
}

}  // namespace moe
