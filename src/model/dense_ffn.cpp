// Dense SwiGLU FFN (dense layers and shared experts): y = W2 (silu(W1 x) * (W3 x)).
#include "model/layers.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/swiglu.hpp"

namespace moe {

DenseFfn::DenseFfn(const LayerEnv& env, const std::string& prefix, const char* w1, const char* w3,
                   const char* w2)
    : env_(env),
      w1_(env.param(prefix + w1 + ".weight")),
      w3_(env.param(prefix + w3 + ".weight")),
      w2_(env.param(prefix + w2 + ".weight")) {}

void DenseFfn::plan(Arena& acts, int64_t rows) {
  const int64_t f = w1_.w.size(0);
  gate_ = acts.alloc(env_.dtype, {rows, f});
  up_ = acts.alloc(env_.dtype, {rows, f});
  act_ = acts.alloc(env_.dtype, {rows, f});
}

void DenseFfn::forward(Ctx& ctx, Tensor y, Tensor x, bool accumulate) {
  linear_forward(ctx, gate_, x, w1_.w, false);
  linear_forward(ctx, up_, x, w3_.w, false);
  swiglu_forward(ctx, act_, gate_, up_);
  linear_forward(ctx, y, act_, w2_.w, accumulate);
}

void DenseFfn::backward(Ctx& ctx, Tensor dx, Tensor dy, Tensor x, bool accumulate_dx) {
  const size_t mark = env_.scratch.mark();
  Tensor dact = env_.scratch.alloc(env_.dtype, {act_.size(0), act_.size(1)});
  Tensor dgate = env_.scratch.alloc(env_.dtype, {act_.size(0), act_.size(1)});
  Tensor dup = env_.scratch.alloc(env_.dtype, {act_.size(0), act_.size(1)});
  linear_backward(ctx, dact, w2_.g, dy, act_, w2_.w, false);
  swiglu_backward(ctx, dgate, dup, dact, gate_, up_);
  linear_backward(ctx, dx, w1_.g, dgate, x, w1_.w, accumulate_dx);
  linear_backward(ctx, dx, w3_.g, dup, x, w3_.w, true);
  env_.scratch.release(mark);
}

}  // namespace moe
