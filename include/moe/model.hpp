// The model: parameters in one contiguous buffer (gradients in a second of the same layout),
// layers that orchestrate ops in the order of MODEL_SPEC's math, and an explicit backward.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "moe/config.hpp"
#include "moe/memory.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// What a parameter is decides how it is treated (weight decay, init), never its position.
enum class ParamKind : uint8_t {
  embedding,  // [V, d]: decayed, std initializer_range
  matrix,     // linear weights: decayed, std initializer_range
  residual,   // output projections into the residual stream: decayed, std / sqrt(2L)
  norm,       // RMSNorm gains: not decayed, init 1
};
bool param_kind_decays(ParamKind k);

// One named parameter (or a stack of `stack` same-shaped ones, e.g. the experts of a layer).
// `name` is the Hugging Face name; "{j}" in it stands for the index within the stack.
struct ParamInfo {
  std::string name;
  ParamKind kind;
  int stack = 1;                  // E for expert stacks, 1 otherwise
  std::vector<int64_t> shape;     // of one member of the stack
  size_t offset = 0;              // elements from the start of the parameter buffer
  size_t numel() const;           // of the whole stack
};

// The fixed layout of every parameter, built from the model config alone.
struct ParamTable {
  std::vector<ParamInfo> params;
  size_t total = 0;  // elements
  const ParamInfo& find(const std::string& name) const;
};
ParamTable build_param_table(const ModelConfig& m);

// Parameter counts for `info` and the progress header.
struct ParamCounts {
  double total = 0;               // every parameter
  double active_per_token = 0;    // parameters one token touches (K routed experts, MoD skips)
  double flops_per_token = 0;     // training FLOPs (forward + backward) per token
};
ParamCounts count_params(const ModelConfig& m, int seq_len);

// Losses of one forward pass (averages over the micro-batch).
struct Losses {
  double lm = 0;        // MODEL_SPEC's LM loss (mean cross-entropy)
  double aux = 0;       // load-balance loss, summed over MoE layers
  double z = 0;         // router z-loss, summed over MoE layers
  double mod_pred = 0;  // causal predictor BCE, summed over MoD layers
  double total() const { return lm + aux + z + mod_pred; }
};

// Routing statistics accumulated since the last reset (one training step).
struct RoutingStats {
  std::vector<std::vector<double>> expert_load;  // per MoE layer, slots per expert
  double mod_kept = 0, mod_seen = 0;             // tokens kept / tokens offered to MoD blocks
  double maxvio_mean() const;
  double maxvio_max() const;
  void reset();
};

class Layer;
struct LayerEnv;

class Model {
 public:
  // Plans every buffer for micro-batches of `batch` sequences of `seq_len` tokens. With
  // allocate = false nothing is allocated: the plan alone, for memory estimates.
  Model(const ModelConfig& cfg, DType dtype, Device dev, int batch, int seq_len,
        bool allocate = true);
  ~Model();

  void init_weights(uint64_t seed);
  // Forward and backward on one micro-batch; gradients accumulate (+=) into grads() scaled by
  // `grad_scale` (1 / gradient_accumulation_steps for an averaged step).
  Losses forward_backward(Ctx& ctx, const int32_t* ids, const int32_t* targets, double grad_scale);
  // Forward only (evaluation): the same losses, no gradients.
  Losses forward(Ctx& ctx, const int32_t* ids, const int32_t* targets);
  // End of an optimizer step: updates aux-loss-free router biases from the step's loads.
  void after_step(Ctx& ctx);

  const ModelConfig& config() const { return cfg_; }
  const ParamTable& table() const { return table_; }
  DType dtype() const { return dtype_; }
  Tensor params() const;
  Tensor grads() const;
  Tensor param(const ParamInfo& p) const;
  Tensor grad(const ParamInfo& p) const;
  void zero_grads(Ctx& ctx);
  RoutingStats& routing() { return routing_; }
  // Logits [B*T, V] of the last forward() (forward_backward overwrites them with gradients).
  Tensor logits() const { return logits_; }
  // Non-parameter state that training changes and a checkpoint must keep: the aux-loss-free
  // router biases ([E] per MoE layer, in layer order).
  std::vector<Tensor> router_biases() const;
  size_t activation_bytes() const { return acts_.peak_bytes(); }
  size_t scratch_bytes() const { return scratch_.peak_bytes(); }
  int batch() const { return batch_; }
  int seq_len() const { return seq_len_; }

 private:
  Losses run(Ctx& ctx, const int32_t* ids, const int32_t* targets, bool backward,
             double grad_scale);
  void plan();
  void backward(Ctx& ctx, double grad_scale, int64_t valid_targets);

  ModelConfig cfg_;
  DType dtype_;
  Device dev_;
  int batch_, seq_len_;
  bool allocated_;
  ParamTable table_;
  Buffer param_buf_, grad_buf_;
  Arena acts_, scratch_;
  std::unique_ptr<LayerEnv> env_;
  std::vector<std::unique_ptr<Layer>> layers_;
  RoutingStats routing_;
  // Model-level activations: the residual stream between layers and the head.
  Tensor ids_, targets_, pos_, rope_cos_, rope_sin_;
  std::vector<Tensor> stream_;          // L+1 tensors [N, d]: input of each layer, then the output
  Tensor dstream_a_, dstream_b_;        // [N, d] gradient ping-pong
  Tensor xf_, rstdf_, logits_, losses_, lse_;  // final norm, [N, V] logits, per-token losses
  std::vector<float> host_losses_f32_;         // reused host copies of losses_ (no allocation
  std::vector<double> host_losses_f64_;        // inside a step after the first)
};

}  // namespace moe
