// Internal building blocks of the model. Each layer owns views of its parameters and gradients
// and its saved activations (planned in an Arena before the first step), and has forward and
// backward side by side. Backward scratch comes from a stack arena (mark/release), planned by
// running the same allocation function in measuring mode.
#pragma once
#include <memory>
#include <vector>

#include "moe/model.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// A parameter: w the compute copy the ops read, g its gradient and `master` the weights the
// optimizer updates (in the gradient's dtype; the same memory as w in f32 / f64 models).
struct ParamView {
  Tensor w, g, master;
};

// What every layer needs to know about its surroundings.
struct LayerEnv {
  const ModelConfig& cfg;
  DType dtype;  // compute: activations and w
  DType acc;    // statistics, routing, losses and gradients: acc_dtype(dtype)
  Model& model;
  Arena& scratch;
  Tensor rope_cos, rope_sin;
  Tensor stats;  // f64 [kStats] device sums of the losses (lm, aux, z, mod_pred), then the flags
  // [MoE layers, E] in acc: each MoE layer's slots per expert since reset (row moe_index), one
  // tensor so a step zeroes, reads back and sums them across ranks in one op each.
  Tensor loads;
  // Set while backward re-runs a layer's forward (activation recomputation): the forward then
  // only rebuilds activations and must not count its losses or loads a second time.
  bool recomputing = false;
  ParamView param(const std::string& name) const;
  RoutingStats& routing() const { return model.routing_; }
  bool mixed() const { return dtype != acc; }
};

// Index of each loss in LayerEnv::stats, then the step flags (Model::raise_step_flag).
enum StatIndex : int64_t {
  kStatLm = 0,
  kStatAux = 1,
  kStatZ = 2,
  kStatModPred = 3,
  kStatFlags = 4,
  kStats = kStatFlags + kStepFlags
};

// y = x w^T and its backward (dx += dy w unless dx is empty, dw += dy^T x) for the fp32 router
// matmuls: y, dy, dw and w (the master weights) in the accumulation dtype, x and dx in the
// compute dtype (router_matmul.cpp picks the fused op or cuBLAS by the output width).
void router_matmul_forward(Ctx& ctx, const LayerEnv& env, Tensor y, Tensor x, Tensor w);
void router_matmul_backward(Ctx& ctx, const LayerEnv& env, Tensor dx, Tensor dw, Tensor dy,
                            Tensor x, Tensor w);
// The routers with their product: the MoE gate's logits and routing (router_topk_forward's
// outputs) and the MoD router's scores and selection (mod_select's). Where the product is the
// narrow fused one they are one op each (router_forward, mod_route: one launch on sm_80+ GPUs),
// unless MOE_ROUTER_FUSED=0 (read at every call), which runs the product and the routing apart.
void router_route_forward(Ctx& ctx, const LayerEnv& env, Tensor logits, Tensor probs,
                          Tensor topk_idx, Tensor topk_w, Tensor counts, Tensor x, Tensor w,
                          Tensor bias, bool norm_topk_prob);
void mod_route_forward(Ctx& ctx, const LayerEnv& env, Tensor scores, Tensor sel, Tensor mask,
                       Tensor x, Tensor w);

// Rows of a layer's input: B sequences of T tokens (T = C inside a MoD block).
struct Dims {
  int64_t B, T;
  int64_t rows() const { return B * T; }
};

// Dense SwiGLU FFN: y (+)= W2 (silu(W1 x) * (W3 x)). Also each shared expert.
class DenseFfn {
 public:
  DenseFfn(const LayerEnv& env, const std::string& prefix, const char* w1, const char* w3,
           const char* w2);
  void plan(Arena& acts, int64_t rows);
  void forward(Ctx& ctx, Tensor y, Tensor x, bool accumulate);
  // dx = (or += when accumulate_dx) d/dx
  void backward(Ctx& ctx, Tensor dx, Tensor dy, Tensor x, bool accumulate_dx);

 private:
  const LayerEnv& env_;
  ParamView w1_, w3_, w2_;
  Tensor gate_, up_, act_;  // [rows, F]
};

// Dropless MoE FFN: route -> permute -> grouped experts -> combine (+ shared experts).
class MoeFfn {
 public:
  MoeFfn(const LayerEnv& env, int layer, int moe_index);
  void plan_state(Arena& state);  // what lives across steps: router bias, step loads
  void plan(Arena& acts, int64_t rows);
  // y = residual + MoE(x) (residual: y's shape, not y's memory): the block's last residual add,
  // in the combine's pass where there are no shared experts. Its backward is the identity, so
  // backward's dy is the gradient of MoE(x).
  void forward(Ctx& ctx, Tensor y, Tensor x, Tensor residual);
  void backward(Ctx& ctx, Tensor dx, Tensor dy, Tensor x, double grad_scale);
  void after_step(Ctx& ctx);
  Tensor bias() const { return bias_; }

 private:
  const LayerEnv& env_;
  int moe_index_;
  int64_t rows_ = 0;
  ParamView gate_, w1_, w3_, w2_;
  std::vector<std::unique_ptr<DenseFfn>> shared_;
  // Router, statistics and routing weights in the accumulation dtype (fp32 in mixed precision).
  Tensor bias_, load_;                         // aux-loss-free bias; slots per expert since reset
  Tensor logits_, probs_, topk_idx_, topk_w_;  // [N, E], [N, E], [N, K], [N, K]
  Tensor counts_, aux_losses_;                 // [E] i32, [2]
  Tensor offsets_, row_token_, slot_row_;      // [E+1], [N*K], [N*K]
  Tensor row_w_;                               // [R]: topk_w in permuted-row order
  Tensor xp_, hgate_, hup_, hact_;             // [R, d], [R, F] x3: compute dtype

  // The expert GEMMs' inputs: the permuted rows [R, d] and the SwiGLU output [R, F]. The kept
  // activations, or (train.recompute_expert_rows: xp; train.recompute_expert_inputs: both) fresh
  // tensors in `scratch` that the caller fills and releases. rows_wanted false: no fresh xp (the
  // expert GEMMs gather x's rows themselves: gathers_expert_rows).
  struct ExpertInputs {
    Tensor xp, hact;
  };
  ExpertInputs expert_inputs(Arena& scratch, bool rows_wanted = true) const;
  bool gathers_expert_rows() const;
};

// Causal GQA self-attention with RoPE: y = Wo attn(rope(Wq x), rope(Wk x), Wv x).
class SelfAttention {
 public:
  SelfAttention(const LayerEnv& env, const std::string& prefix);
  void plan(Arena& acts, Dims dims);
  void forward(Ctx& ctx, Tensor y, Tensor x, Tensor pos);
  void backward(Ctx& ctx, Tensor dx, Tensor dy, Tensor x, Tensor pos);

 private:
  // The i-th [B, T, heads, hd] of a [3 B, T, heads, hd] tensor.
  static Tensor stacked(Tensor t, int64_t i);

  const LayerEnv& env_;
  ParamView wq_, wk_, wv_, wo_;
  Dims dims_{0, 0};
  bool stacked_qkv_ = false;  // nh == nkv: q_, k_ and v_ side by side in qkv_
  Tensor qkv_;
  Tensor q_, k_, v_, att_, lse_;
};

// A layer of the residual stream: out = f(x) on [B*T, d] rows with positions pos.
class Layer {
 public:
  virtual ~Layer() = default;
  // Persistent state (router biases, step loads), then the activations the backward reads (with
  // recomputation, every layer's activations share one region: plan() is called from the same
  // arena mark for each layer).
  virtual void plan_state(Arena& state) = 0;
  virtual void plan(Arena& acts) = 0;
  virtual void forward(Ctx& ctx, Tensor out, Tensor x, Tensor pos) = 0;
  virtual void backward(Ctx& ctx, Tensor dx, Tensor dout, Tensor x, Tensor pos,
                        double grad_scale) = 0;
  // True when backward leaves the input's gradient in dout's memory instead of dx's (dx then
  // untouched): a MoD block, whose gradient on the skipped rows is dout itself, updates only its
  // selected rows in place rather than copying the other 1 - capacity of them.
  virtual bool backward_in_place() const { return false; }
  virtual void after_step(Ctx&) {}
  // Appends the layer's non-parameter persistent state (router biases).
  virtual void collect_state(std::vector<Tensor>& out) const = 0;
};

// Pre-norm transformer block: h = x + Attn(norm1(x)); out = h + FFN(norm2(h)).
class Block : public Layer {
 public:
  Block(const LayerEnv& env, int layer, int moe_index, Dims dims);
  void plan_state(Arena& state) override {
    if (moe_) moe_->plan_state(state);
  }
  void plan(Arena& acts) override;
  void forward(Ctx& ctx, Tensor out, Tensor x, Tensor pos) override;
  void backward(Ctx& ctx, Tensor dx, Tensor dout, Tensor x, Tensor pos, double grad_scale) override;
  void after_step(Ctx& ctx) override;
  void collect_state(std::vector<Tensor>& out) const override {
    if (moe_) out.push_back(moe_->bias());
  }

 private:
  const LayerEnv& env_;
  Dims dims_;
  ParamView norm1_, norm2_;
  SelfAttention attn_;
  std::unique_ptr<DenseFfn> dense_;
  std::unique_ptr<MoeFfn> moe_;
  Tensor xn1_, rstd1_, h_, xn2_, rstd2_;
};

// Mixture-of-Depths wrapper: the inner block runs on the C best-scoring tokens per sequence;
// a causal predictor learns (on stop-gradient x) which tokens get selected, for sampling.
class ModBlock : public Layer {
 public:
  ModBlock(const LayerEnv& env, int layer, int moe_index, Dims dims);
  void plan_state(Arena& state) override { inner_.plan_state(state); }
  void plan(Arena& acts) override;
  void forward(Ctx& ctx, Tensor out, Tensor x, Tensor pos) override;
  // Leaves dx in dout's memory (backward_in_place).
  void backward(Ctx& ctx, Tensor dx, Tensor dout, Tensor x, Tensor pos, double grad_scale) override;
  bool backward_in_place() const override { return true; }
  void after_step(Ctx& ctx) override { inner_.after_step(ctx); }
  void collect_state(std::vector<Tensor>& out) const override { inner_.collect_state(out); }

 private:
  const LayerEnv& env_;
  Dims dims_;
  int64_t keep_;  // C
  ParamView router_, fc1_, fc2_;
  Block inner_;
  // scores, mask and the predictor in the accumulation dtype; xs, ys in the compute dtype
  Tensor scores_, sel_, mask_, xs_, ys_;    // [B*T,1], [B,C], [B,T], [B*C,d] x2
  Tensor pred_h_, pred_logit_, pred_loss_;  // [B*T,P], [B*T,1], [1]
};

std::unique_ptr<Layer> make_layer(const LayerEnv& env, int layer, int moe_index, Dims dims);

}  // namespace moe
