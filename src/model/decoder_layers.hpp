// Internal building blocks of the autoregressive Decoder (include/moe/sampler.hpp): the training
// layers of layers.hpp rewritten for one token at a time of one sequence. They read the trained
// Model's parameters (views, never copies) and own only their per-token scratch and, for
// attention, the key/value cache. Every buffer is planned in an Arena before the first token, the
// same two-pass way the Model plans its activations, so decoding allocates nothing per token.
// Forward only: sampling never differentiates.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "moe/memory.hpp"
#include "moe/model.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// What every decode layer needs to know about its surroundings.
struct DecodeEnv {
  const ModelConfig& cfg;
  DType dtype;
  const Model& model;
  int64_t max_len;            // cache entries per layer: max_position_embeddings
  Tensor rope_cos, rope_sin;  // [max_len, hd/2]
  Tensor param(const std::string& name) const { return model.param(model.table().find(name)); }
};

// The three weights of one SwiGLU FFN (a dense FFN, a routed or a shared expert).
struct SwigluWeights {
  Tensor w1, w3, w2;  // gate [F, d], up [F, d], down [d, F]
};

// y (+)= W2 (silu(W1 x) * (W3 x)) for one row, on scratch sized for hidden width F.
class SwigluRow {
 public:
  explicit SwigluRow(int64_t hidden) : hidden_(hidden) {}
  void plan(Arena& acts, DType dtype);
  void forward(Ctx& ctx, Tensor y, Tensor x, const SwigluWeights& w, bool accumulate);

 private:
  int64_t hidden_;
  Tensor gate_, up_, act_;  // [1, F]
};

// MoE FFN for one token: route, run each of the K chosen experts on the token, weight and sum,
// then add the shared experts. With one row there is nothing to permute.
class DecodeMoe {
 public:
  DecodeMoe(const DecodeEnv& env, int layer, Tensor bias);
  void plan(Arena& acts);
  void forward(Ctx& ctx, Tensor y, Tensor x);

 private:
  const DecodeEnv& env_;
  Tensor gate_, w1_, w3_, w2_;  // [E, d], [E, F, d] x2, [E, d, F]
  Tensor bias_;                 // [E] aux-loss-free selection bias, or empty
  std::vector<SwigluWeights> shared_;
  SwigluRow expert_, shared_row_;
  Tensor logits_, probs_, topk_idx_, topk_w_, counts_, expert_y_;  // [1,E] x2, [1,K] x2, [E], [1,d]
  std::vector<int32_t> host_idx_;  // the K picks and their weights, read back for the loop
  std::vector<double> host_w_;
};

// Causal GQA self-attention of the newest token over a key/value cache of earlier tokens.
class DecodeAttention {
 public:
  DecodeAttention(const DecodeEnv& env, const std::string& prefix);
  void plan(Arena& acts);
  // Appends the token's rotated key and its value to the cache, then attends over the cache.
  void forward(Ctx& ctx, Tensor y, Tensor x, Tensor pos);
  int64_t cached() const { return len_; }
  void reset() { len_ = 0; }

 private:
  const DecodeEnv& env_;
  Tensor wq_, wk_, wv_, wo_;
  Tensor k_cache_, v_cache_;  // [1, S_max, nkv, hd]
  Tensor q_, att_, lengths_;  // [1, nh, hd] x2, [1] i32
  int64_t len_ = 0;           // entries in the cache
};

// A layer of the residual stream for one token at position pos ([1] i32).
class DecodeLayer {
 public:
  virtual ~DecodeLayer() = default;
  virtual void plan(Arena& acts) = 0;
  virtual void forward(Ctx& ctx, Tensor out, Tensor x, Tensor pos) = 0;
  // Tokens held in the layer's key/value cache.
  virtual int64_t cached() const = 0;
  virtual void reset() = 0;
};

// Pre-norm block: h = x + Attn(norm1(x)); out = h + FFN(norm2(h)).
class DecodeBlock : public DecodeLayer {
 public:
  DecodeBlock(const DecodeEnv& env, int layer, Tensor router_bias);
  void plan(Arena& acts) override;
  void forward(Ctx& ctx, Tensor out, Tensor x, Tensor pos) override;
  int64_t cached() const override { return attn_.cached(); }
  void reset() override { attn_.reset(); }

 private:
  const DecodeEnv& env_;
  Tensor norm1_, norm2_;
  DecodeAttention attn_;
  std::unique_ptr<SwigluWeights> dense_;
  std::unique_ptr<SwigluRow> dense_row_;
  std::unique_ptr<DecodeMoe> moe_;
  Tensor xn1_, rstd1_, attn_y_, h_, xn2_, rstd2_, ffn_y_;  // [1, d] / [1]
};

// Mixture-of-Depths layer at sampling time: the causal predictor decides (p > 0.5) whether the
// token enters the block; a kept token gets out = x + sigmoid(r) (Block(x) - x) and joins this
// layer's cache, a skipped one passes through and leaves the cache as it was.
class DecodeModLayer : public DecodeLayer {
 public:
  DecodeModLayer(const DecodeEnv& env, int layer, Tensor router_bias);
  void plan(Arena& acts) override;
  void forward(Ctx& ctx, Tensor out, Tensor x, Tensor pos) override;
  int64_t cached() const override { return inner_.cached(); }
  void reset() override { inner_.reset(); }

 private:
  bool predictor_keeps(Ctx& ctx, Tensor x);

  const DecodeEnv& env_;
  Tensor router_, fc1_, fc2_;  // [1, d], [P, d], [1, P]
  DecodeBlock inner_;
  Tensor score_, pred_h_, pred_a_, pred_logit_, ys_, sel_;  // [1,1], [1,P] x2, [1,1], [1,d], [1,1]
  std::vector<double> host_logit_;                          // the predictor's logit, read back
};

std::unique_ptr<DecodeLayer> make_decode_layer(const DecodeEnv& env, int layer, Tensor router_bias);

}  // namespace moe
