// The trainer's configuration: one JSON file parsed into these typed structs.
// Top-level names follow DeepSpeed; `model` uses Hugging Face MixtralConfig names plus the extra
// keys of MODEL_SPEC. Every key, default and range is documented in docs/config.md.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace moe {

struct ModConfig {
  bool enabled = false;
  double capacity = 0.125;           // fraction of each sequence's tokens a MoD block keeps, (0, 1]
  int every = 2;                     // layer l is MoD when l % every == every - 1
  int predictor_hidden_size = 64;    // hidden width of the causal predictor MLP
  double predictor_loss_coef = 1.0;  // weight of the predictor's BCE in the training loss
};

struct ModelConfig {
  int vocab_size = 32000;
  int hidden_size = 1024;
  int intermediate_size = 2816;  // F, per routed expert
  int num_hidden_layers = 8;
  int num_attention_heads = 16;
  int num_key_value_heads = 16;
  int head_dim = 0;  // 0 = hidden_size / num_attention_heads
  double rms_norm_eps = 1e-5;
  double rope_theta = 1e6;
  int max_position_embeddings = 4096;
  int num_local_experts = 8;
  int num_experts_per_tok = 2;
  double router_aux_loss_coef = 0.01;
  double router_z_loss_coef = 0.0;
  double router_bias_update_rate = 0.0;  // > 0: aux-loss-free balancing bias
  bool tie_word_embeddings = false;
  int moe_layer_freq = 1;           // layer l is MoE when l % freq == freq - 1
  int dense_intermediate_size = 0;  // 0 = intermediate_size
  bool norm_topk_prob = true;
  int num_shared_experts = 0;
  int shared_expert_intermediate_size = 0;  // 0 = intermediate_size
  double initializer_range = 0.02;
  std::string init_from;  // "" or a Hugging Face Mixtral checkpoint (directory or .safetensors)
  ModConfig mod;

  // Derived (filled by validation).
  int resolved_head_dim() const {
    return head_dim > 0 ? head_dim : hidden_size / num_attention_heads;
  }
  int resolved_dense_ffn() const {
    return dense_intermediate_size > 0 ? dense_intermediate_size : intermediate_size;
  }
  int resolved_shared_ffn() const {
    return shared_expert_intermediate_size > 0 ? shared_expert_intermediate_size
                                               : intermediate_size;
  }
  bool is_moe_layer(int l) const { return l % moe_layer_freq == moe_layer_freq - 1; }
  bool is_mod_layer(int l) const { return mod.enabled && l % mod.every == mod.every - 1; }
};

struct OptimizerConfig {
  std::string type = "AdamW";
  double lr = 3e-4;
  double beta1 = 0.9, beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

// scheduler.type: "WarmupCosineLR" (linear warmup, cosine decay to cos_min_ratio * lr) or
// "WarmupLR" (linear warmup, then constant).
struct SchedulerConfig {
  std::string type = "WarmupCosineLR";
  int warmup_num_steps = 0;
  double warmup_min_ratio = 0.0;
  int total_num_steps = 0;  // 0 = train.max_steps
  double cos_min_ratio = 0.1;
};

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0;  // 0 = dynamic
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  double min_loss_scale = 1;
};

// DeepSpeed's zero_optimization.offload_optimizer: this rank's fp32 master weights and AdamW
// moments in host memory, updated by a CPU AdamW (ZeRO stage 1, 2 or 3).
// offload_param (stage 3, with offload_optimizer): this rank's chunks of the weights and of the
// gradients live in host memory too; each unit streams to the GPU just before use.
struct OffloadOptimizerConfig {
  std::string device = "none";  // none | cpu
  bool pin_memory = false;      // page-locked host buffers (GPU runs: faster copies)
  // offload_optimizer only: with overlap_comm at stages 1-2, the CPU AdamW updates each bucket
  // as it reaches the host during the backward (OffloadOptions::overlap). Off by default: it
  // costs 12 bytes of host memory per owned parameter and gains little where the host's memory
  // bandwidth bounds the CPU AdamW (docs/perf.md).
  bool overlap_backward = false;
};

struct ZeroConfig {
  int stage = 0;
  // Reduce the gradients in buckets while the backward of the last micro-batch runs (on a
  // communication stream on GPUs) instead of once after it.
  bool overlap_comm = false;
  double reduce_bucket_size = 5e8;  // elements per bucket (a whole number; DeepSpeed writes 5e8)
  OffloadOptimizerConfig offload_optimizer;
  OffloadOptimizerConfig offload_param;  // device and pin_memory
  bool offloads_optimizer() const { return offload_optimizer.device == "cpu"; }
  bool offloads_params() const { return offload_param.device == "cpu"; }
  // Whether the CPU AdamW runs during the backward (see OffloadOptimizerConfig).
  bool overlaps_offloaded_step() const {
    return offloads_optimizer() && offload_optimizer.overlap_backward && overlap_comm &&
           (stage == 1 || stage == 2);
  }
};

struct SyntheticDataConfig {
  int seed = 1234;    // seed of the Markov chain itself (independent of train.seed)
  int branching = 4;  // next-token choices per order-2 context
};

struct DataConfig {
  std::string source = "synthetic";  // synthetic | shards
  int seq_len = 256;
  std::string train_files;  // glob of token shards (source "shards")
  std::string val_files;    // glob of held-out shards ("" = no evaluation)
  bool shuffle = true;      // shuffle training windows each epoch (deterministic from the seed)
  SyntheticDataConfig synthetic;
};

struct TrainConfig {
  int max_steps = 100;
  int log_interval = 10;
  int eval_interval = 0;  // 0 = only at the end
  int eval_batches = 4;
  uint64_t seed = 42;
  std::string device = "auto";           // auto | cpu | cuda | cuda:N
  std::string out_dir = "runs/default";  // metrics.jsonl and step_NNNNNNNN/ checkpoints
  int save_interval = 0;                 // steps between checkpoints (0 = only at the end)
  bool save_at_end = true;               // checkpoint when the run ends (off for benchmarks)
  int keep_checkpoints = 3;              // newest complete checkpoints kept (0 = all)
  std::string resume;                    // "" | "auto" (newest in out_dir) | a checkpoint path
  double comm_timeout_s = 600;           // collective watchdog (data parallel); 0 = off
  bool recompute_layers = false;         // activation recomputation, layer by layer
  bool recompute_expert_inputs = false;  // MoE layers: rebuild the expert GEMMs' inputs
  bool recompute_expert_rows = false;    // MoE layers: rebuild the permuted rows only
  // bf16 models: the fp32 master stored as the compute copy plus 16-bit low halves (4 bytes per
  // parameter instead of 6); ZeRO stage 0 without offload.
  bool split_master = false;
  // Split-master bf16 models: the routed experts' weight gradients stored in bf16 (the precision
  // of torch._grouped_mm's), not fp32: 2 bytes per expert parameter fewer to write, read and keep.
  // One process, one micro-batch per step.
  bool bf16_expert_grads = false;
  // Tokens whose logits ([tokens, V]) the head holds at once; each chunk's cross-entropy
  // gradient goes through the head's backward before the next chunk (0 = the whole micro-batch).
  int head_chunk_tokens = 2048;
  // One GPU, AdamW state on it: the update runs on a side stream behind the next step's
  // forward, unit by unit; elsewhere, and with --profile, it runs in line.
  bool overlap_optimizer = true;
  // GiB the trainer may allocate on its GPU (0 = no cap): a larger card checks that a run fits
  // a smaller one's budget (e.g. 16 for a T4). --gpu-memory-limit overrides it.
  double gpu_memory_limit_gib = 0;
};

struct Config {
  int train_micro_batch_size_per_gpu = 8;
  int gradient_accumulation_steps = 1;
  // 0 = micro * accumulation * world size; otherwise must equal it (the config check accepts any
  // multiple of micro * accumulation; train() checks it against the launched world size).
  int train_batch_size = 0;
  double gradient_clipping = 1.0;  // 0 disables clipping
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  Fp16Config fp16;
  bool bf16_enabled = false;
  ZeroConfig zero_optimization;
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
};

// Parses JSON text (with `overrides` "a.b=value" applied first) into a validated Config.
// Throws ConfigError naming the JSON path on unknown keys (with a suggestion), wrong types,
// out-of-range or inconsistent values. `source` names the file in messages.
Config parse_config(const std::string& json_text, const std::vector<std::string>& overrides,
                    const std::string& source);
Config load_config(const std::string& path, const std::vector<std::string>& overrides);
// The fully resolved config (every key with its effective value) as JSON text.
std::string config_to_json(const Config& c, int indent = 2);
// train.device's grammar: auto, cpu, cuda or cuda:N (also the --device flags of eval and sample).
bool is_device_name(const std::string& d);
nlohmann::json config_to_json_value(const Config& c);

}  // namespace moe
