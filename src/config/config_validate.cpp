// Range and consistency checks of a parsed Config. Each failure is a ConfigError at the JSON path
// of the key the user should change, with the offending value in the message.
#include <cctype>
#include <cstdint>
#include <cmath>
#include <string>

#include "config/config_internal.hpp"
#include "moe/error.hpp"
#include "moe/ops/mod.hpp"

namespace moe::config_internal {
namespace {

// What this build can run. The config already names these features (DeepSpeed layout) so configs
// stay stable as backends land; flipping a flag removes the matching rejection below.
constexpr bool kHasTokenShards = true;  // llm.c-layout token shards (data.train_files)

// Set-up looks each layer's parameters up by name (quadratic in the depth: 16k layers take
// minutes before the first step); far deeper than any model this trainer is meant for.
constexpr int kMaxLayers = 1024;
// 2^40 parameters are 16 TiB of fp32 weights, gradients and AdamW moments: a larger count is a
// typo, and past it the element counts of the buffers near the 64-bit range (a config of 2^31-wide
// sizes wraps them), so it is refused before anything is planned or allocated.
constexpr double kMaxParameters = 1099511627776.0;

[[noreturn]] void fail(const std::string& path, const std::string& msg) {
  throw ConfigError(path, msg);
}

void require_at_least(const char* path, int64_t v, int64_t lo) {
  if (v < lo) fail(path, "must be >= " + std::to_string(lo) + ", got " + std::to_string(v));
}

void require_positive(const char* path, double v) {
  if (!(v > 0)) fail(path, "must be > 0, got " + shown(v));
}

void require_non_negative(const char* path, double v) {
  if (!(v >= 0)) fail(path, "must be >= 0, got " + shown(v));
}

void require_unit_interval(const char* path, double v) {
  if (!(v >= 0 && v <= 1)) fail(path, "must be in [0, 1], got " + shown(v));
}

// ---- model
// ---------------------------------------------------------------------------------------

void validate_model_sizes(const ModelConfig& m) {
  require_at_least("model.vocab_size", m.vocab_size, 2);
  require_at_least("model.hidden_size", m.hidden_size, 1);
  require_at_least("model.intermediate_size", m.intermediate_size, 1);
  require_at_least("model.num_hidden_layers", m.num_hidden_layers, 1);
  if (m.num_hidden_layers > kMaxLayers)
    fail("model.num_hidden_layers", "must be <= " + std::to_string(kMaxLayers) + ", got " +
                                        std::to_string(m.num_hidden_layers));
  require_at_least("model.num_attention_heads", m.num_attention_heads, 1);
  require_at_least("model.num_key_value_heads", m.num_key_value_heads, 1);
  require_at_least("model.max_position_embeddings", m.max_position_embeddings, 1);
  require_at_least("model.num_local_experts", m.num_local_experts, 1);
  require_at_least("model.moe_layer_freq", m.moe_layer_freq, 1);
  require_at_least("model.num_shared_experts", m.num_shared_experts, 0);
  // 0 means "derive from another size" for these three.
  require_at_least("model.head_dim", m.head_dim, 0);
  require_at_least("model.dense_intermediate_size", m.dense_intermediate_size, 0);
  require_at_least("model.shared_expert_intermediate_size", m.shared_expert_intermediate_size, 0);
}

void validate_attention_shape(const ModelConfig& m) {
  // GQA: each kv head serves a whole group of query heads.
  if (m.num_attention_heads % m.num_key_value_heads != 0)
    fail("model.num_key_value_heads", "num_attention_heads (" +
                                          std::to_string(m.num_attention_heads) +
                                          ") must be divisible by num_key_value_heads (" +
                                          std::to_string(m.num_key_value_heads) + ")");
  if (m.head_dim == 0 && m.hidden_size % m.num_attention_heads != 0)
    fail("model.num_attention_heads",
         "hidden_size (" + std::to_string(m.hidden_size) +
             ") must be divisible by num_attention_heads (" +
             std::to_string(m.num_attention_heads) +
             ") when head_dim is 0 (derived); change the sizes or set model.head_dim");
  // RoPE rotates pairs (i, i + head_dim/2).
  if (m.resolved_head_dim() % 2 != 0)
    fail("model.head_dim", "head_dim must be even for RoPE, got " +
                               std::to_string(m.resolved_head_dim()) +
                               (m.head_dim == 0 ? " (hidden_size / num_attention_heads)" : ""));
}

// The parameter count in double (it cannot wrap), layer by layer as build_param_table lays them
// out (which counts in 64-bit integers: past 2^40 the check below refuses before it runs).
double parameter_count(const ModelConfig& m) {
  const double d = m.hidden_size, hd = m.resolved_head_dim();
  const double attention =  // q, k, v, o and the two norms
      2 * d * hd * (static_cast<double>(m.num_attention_heads) + m.num_key_value_heads) + 2 * d;
  const double moe = m.num_local_experts * d * (1 + 3.0 * m.intermediate_size) +  // router, experts
                     3 * d * m.num_shared_experts * m.resolved_shared_ffn();
  const double dense = 3 * d * m.resolved_dense_ffn();
  const double mod = d + m.mod.predictor_hidden_size * (d + 1);       // router, predictor
  double n = m.vocab_size * d * (m.tie_word_embeddings ? 1 : 2) + d;  // embedding, head, norm
  for (int l = 0; l < m.num_hidden_layers; ++l)
    n += attention + (m.is_moe_layer(l) ? moe : dense) + (m.is_mod_layer(l) ? mod : 0);
  return n;
}

void validate_parameter_count(const ModelConfig& m) {
  const double n = parameter_count(m);
  if (n > kMaxParameters)
    fail("model", "the sizes give " + shown(n) + " parameters, more than the " +
                      shown(kMaxParameters) +
                      " (2^40) this trainer can hold; lower model.hidden_size, "
                      "intermediate_size, num_local_experts, num_hidden_layers or vocab_size");
}

void validate_routing(const ModelConfig& m) {
  if (m.num_experts_per_tok < 1 || m.num_experts_per_tok > m.num_local_experts)
    fail("model.num_experts_per_tok",
         "must be in [1, num_local_experts = " + std::to_string(m.num_local_experts) + "], got " +
             std::to_string(m.num_experts_per_tok));
  require_non_negative("model.router_aux_loss_coef", m.router_aux_loss_coef);
  require_non_negative("model.router_z_loss_coef", m.router_z_loss_coef);
  require_non_negative("model.router_bias_update_rate", m.router_bias_update_rate);
}

void validate_numerics(const ModelConfig& m) {
  require_positive("model.rms_norm_eps", m.rms_norm_eps);
  require_positive("model.rope_theta", m.rope_theta);
  require_positive("model.initializer_range", m.initializer_range);
}

void validate_mod(const ModConfig& mod, int num_hidden_layers) {
  if (!(mod.capacity > 0 && mod.capacity <= 1))
    fail(
        "model.mod.capacity",
        "must be in (0, 1] (the fraction of tokens a MoD block keeps), got " + shown(mod.capacity));
  require_at_least("model.mod.every", mod.every, 1);
  // Layer l is MoD when l % every == every - 1: a period past the depth leaves no MoD block, and
  // an enabled MoD run would silently train the plain model.
  if (mod.enabled && mod.every > num_hidden_layers)
    fail("model.mod.every",
         "is " + std::to_string(mod.every) + " but the model has " +
             std::to_string(num_hidden_layers) +
             " layers, so no layer would be a MoD block (layer l is one when l % every == every - "
             "1); use every <= num_hidden_layers or set model.mod.enabled to false");
  require_at_least("model.mod.predictor_hidden_size", mod.predictor_hidden_size, 1);
  if (mod.predictor_hidden_size > kModPredictorMaxHidden)
    fail("model.mod.predictor_hidden_size",
         "must be <= " + std::to_string(kModPredictorMaxHidden) +
             " (the CUDA predictor head's limit; the predictor only guesses the router's choice "
             "for sampling: 64 is the default), got " +
             std::to_string(mod.predictor_hidden_size));
  require_non_negative("model.mod.predictor_loss_coef", mod.predictor_loss_coef);
}

void validate_model(const ModelConfig& m) {
  validate_model_sizes(m);
  validate_attention_shape(m);
  validate_routing(m);
  validate_numerics(m);
  validate_mod(m.mod, m.num_hidden_layers);
  validate_parameter_count(m);  // after the sizes it multiplies are known to be sane
}

// ---- optimisation
// --------------------------------------------------------------------------------

bool equals_ignoring_case(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  return true;
}

void validate_optimizer(const OptimizerConfig& o) {
  if (!equals_ignoring_case(o.type, "AdamW"))
    fail("optimizer.type", "unsupported optimizer \"" + o.type + "\"; use \"AdamW\"");
  require_positive("optimizer.params.lr", o.lr);
  if (!(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1))
    fail("optimizer.params.betas",
         "each beta must be in [0, 1), got [" + shown(o.beta1) + ", " + shown(o.beta2) + "]");
  require_positive("optimizer.params.eps", o.eps);
  require_non_negative("optimizer.params.weight_decay", o.weight_decay);
}

void validate_scheduler(const SchedulerConfig& s) {
  if (s.type != "WarmupCosineLR" && s.type != "WarmupLR")
    fail("scheduler.type",
         "unsupported scheduler \"" + s.type + "\"; use \"WarmupCosineLR\" or \"WarmupLR\"");
  require_at_least("scheduler.params.warmup_num_steps", s.warmup_num_steps, 0);
  require_unit_interval("scheduler.params.warmup_min_ratio", s.warmup_min_ratio);
  require_unit_interval("scheduler.params.cos_min_ratio", s.cos_min_ratio);
  require_at_least("scheduler.params.total_num_steps", s.total_num_steps, 0);
  if (s.total_num_steps > 0 && s.total_num_steps < s.warmup_num_steps)
    fail("scheduler.params.total_num_steps",
         "must be 0 (= train.max_steps) or >= warmup_num_steps (" +
             std::to_string(s.warmup_num_steps) + "), got " + std::to_string(s.total_num_steps));
}

void validate_batch(const Config& c) {
  require_at_least("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu, 1);
  require_at_least("gradient_accumulation_steps", c.gradient_accumulation_steps, 1);
  // The world size is known only once the ranks start: here train_batch_size must be a positive
  // multiple of micro * accumulation; train() checks the multiple against the world size.
  const int64_t per_rank =
      int64_t{c.train_micro_batch_size_per_gpu} * c.gradient_accumulation_steps;
  if (c.train_batch_size != 0 && (c.train_batch_size < 0 || c.train_batch_size % per_rank != 0))
    fail("train_batch_size",
         "must be 0 (derived) or train_micro_batch_size_per_gpu * gradient_accumulation_steps * "
         "world size, a multiple of " +
             std::to_string(c.train_micro_batch_size_per_gpu) + " * " +
             std::to_string(c.gradient_accumulation_steps) + " = " + std::to_string(per_rank) +
             ", got " + std::to_string(c.train_batch_size));
  require_non_negative("gradient_clipping", c.gradient_clipping);
}

// The MoD predictor head's backward over a micro-batch: its dw2 partials (mod.hpp) hold
// ceil(tokens / kModHeadMaxBlockRows) x predictor_hidden_size values.
void validate_mod_batch(const Config& c) {
  if (!c.model.mod.enabled) return;
  const int64_t tokens = int64_t{c.train_micro_batch_size_per_gpu} * c.data.seq_len;
  const int64_t blocks = (tokens + kModHeadMaxBlockRows - 1) / kModHeadMaxBlockRows;
  if (blocks * c.model.mod.predictor_hidden_size > kModHeadPartials)
    fail("model.mod.predictor_hidden_size",
         std::to_string(c.model.mod.predictor_hidden_size) + " x ceil(" + std::to_string(tokens) +
             " tokens a micro-batch (train_micro_batch_size_per_gpu x data.seq_len) / " +
             std::to_string(kModHeadMaxBlockRows) +
             ") must be <= " + std::to_string(kModHeadPartials) +
             " (the CUDA predictor backward's partial sums): a smaller predictor or micro-batch");
}

// Checked even while fp16 is disabled, so a config is not found broken only when it is enabled.
void validate_fp16(const Fp16Config& f) {
  require_non_negative("fp16.loss_scale", f.loss_scale);
  require_at_least("fp16.initial_scale_power", f.initial_scale_power, 0);
  require_at_least("fp16.loss_scale_window", f.loss_scale_window, 1);
  require_at_least("fp16.hysteresis", f.hysteresis, 1);
  require_positive("fp16.min_loss_scale", f.min_loss_scale);
  if (f.loss_scale == 0 && f.initial_scale_power < 1024 &&
      f.min_loss_scale > std::ldexp(1.0, f.initial_scale_power))
    fail("fp16.min_loss_scale", "must be <= the initial dynamic scale 2^initial_scale_power = " +
                                    shown(std::ldexp(1.0, f.initial_scale_power)) + ", got " +
                                    shown(f.min_loss_scale));
}

void validate_zero(const ZeroConfig& z) {
  if (z.stage < 0 || z.stage > 3)
    fail("zero_optimization.stage", "must be 0, 1, 2 or 3, got " + std::to_string(z.stage));
  if (!(z.reduce_bucket_size >= 1) || z.reduce_bucket_size != std::floor(z.reduce_bucket_size) ||
      z.reduce_bucket_size > 9.0e15)
    fail("zero_optimization.reduce_bucket_size",
         "must be a whole number of elements >= 1 (e.g. 5e8), got " + shown(z.reduce_bucket_size));
  const std::string& dev = z.offload_optimizer.device;
  if (dev == "nvme")
    fail("zero_optimization.offload_optimizer.device",
         "\"nvme\" (ZeRO-Infinity) is not available; use \"cpu\" or \"none\"");
  if (dev != "none" && dev != "cpu")
    fail("zero_optimization.offload_optimizer.device",
         "must be \"none\" or \"cpu\", got \"" + dev + "\"");
  const std::string& pdev = z.offload_param.device;
  if (pdev == "nvme")
    fail("zero_optimization.offload_param.device",
         "\"nvme\" (ZeRO-Infinity) is not available; use \"cpu\" or \"none\"");
  if (pdev != "none" && pdev != "cpu")
    fail("zero_optimization.offload_param.device",
         "must be \"none\" or \"cpu\", got \"" + pdev + "\"");
  if (pdev == "cpu" && z.stage != 3)
    fail("zero_optimization.offload_param.device",
         "\"cpu\" needs zero_optimization.stage 3 (only stage 3 shards the parameters), got "
         "stage " +
             std::to_string(z.stage));
  // The offloaded weight chunks are the CPU AdamW's master weights, updated where they lie.
  if (pdev == "cpu" && dev != "cpu")
    fail("zero_optimization.offload_param.device",
         "\"cpu\" needs zero_optimization.offload_optimizer.device \"cpu\" too (the host "
         "weights are updated by the CPU AdamW)");
  // DeepSpeed's rule: the offloaded optimizer state is this rank's ZeRO partition.
  if (dev == "cpu" && z.stage < 1)
    fail("zero_optimization.offload_optimizer.device",
         "\"cpu\" needs zero_optimization.stage 1, 2 or 3 (the offloaded state is this rank's "
         "ZeRO partition, as in DeepSpeed), got stage " +
             std::to_string(z.stage));
}

// ---- data and run
// --------------------------------------------------------------------------------

void validate_data(const DataConfig& d, const ModelConfig& m) {
  require_at_least("data.seq_len", d.seq_len, 1);
  if (d.seq_len > m.max_position_embeddings)
    fail("data.seq_len", "must be <= model.max_position_embeddings (" +
                             std::to_string(m.max_position_embeddings) + "), got " +
                             std::to_string(d.seq_len));
  if (d.source != "synthetic" && d.source != "shards" && d.source != "random")
    fail("data.source",
         "must be \"synthetic\", \"random\" or \"shards\", got \"" + d.source + "\"");
  if (d.source == "shards" && d.train_files.empty())
    fail("data.train_files",
         "data.source \"shards\" needs a glob of token shards here "
         "(written by `moe-train prepare`)");
  if (d.synthetic.branching < 1 || d.synthetic.branching > m.vocab_size)
    fail("data.synthetic.branching",
         "must be in [1, model.vocab_size = " + std::to_string(m.vocab_size) + "], got " +
             std::to_string(d.synthetic.branching));
}

// auto | cpu | cuda | cuda:N
bool is_device_name(const std::string& d) {
  if (d == "auto" || d == "cpu" || d == "cuda") return true;
  const std::string prefix = "cuda:";
  if (d.size() <= prefix.size() || d.size() > prefix.size() + 4 || d.rfind(prefix, 0) != 0)
    return false;
  for (size_t i = prefix.size(); i < d.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(d[i]))) return false;
  return true;
}

void validate_train(const TrainConfig& t) {
  require_at_least("train.max_steps", t.max_steps, 1);
  require_at_least("train.log_interval", t.log_interval, 1);
  require_at_least("train.head_chunk_tokens", t.head_chunk_tokens, 0);
  require_at_least("train.eval_interval", t.eval_interval, 0);
  require_at_least("train.eval_batches", t.eval_batches, 1);
  if (!is_device_name(t.device))
    fail("train.device", "must be auto, cpu, cuda or cuda:N, got \"" + t.device + "\"");
  require_at_least("train.save_interval", t.save_interval, 0);
  require_at_least("train.keep_checkpoints", t.keep_checkpoints, 0);
  if (t.out_dir.empty()) fail("train.out_dir", "must name a directory");
  require_non_negative("train.comm_timeout_s", t.comm_timeout_s);
  require_non_negative("train.gpu_memory_limit_gib", t.gpu_memory_limit_gib);
  if (t.gpu_memory_limit_gib > 1e6)
    fail("train.gpu_memory_limit_gib",
         "must be at most 1e6 GiB (0 = no cap), got " + shown(t.gpu_memory_limit_gib));
}

// Features the layout can express but this build cannot run: refused up front, never ignored.
void reject_unavailable_features(const Config& c) {
  // (Mixed precision needs a GPU: the trainer checks that once the device is known.)
  if (c.fp16.enabled && c.bf16_enabled)
    fail("bf16.enabled", "fp16.enabled and bf16.enabled are both true; enable at most one");
  // The split master is the bf16 compute copy plus the low halves, updated in place: the ZeRO
  // stages' fp32 all_gather of the master and the offloaded host master (stages 1-3 only) have
  // no split form yet.
  if (c.train.split_master) {
    if (!c.bf16_enabled)
      fail("train.split_master", "needs bf16.enabled (its high halves are the bf16 compute copy)");
    if (c.zero_optimization.stage != 0)
      fail("train.split_master", "needs zero_optimization.stage 0, got stage " +
                                     std::to_string(c.zero_optimization.stage));
  }
  // bf16 expert gradients are written once per step by the dw products: accumulating
  // micro-batches or ranks into them would round once per addition (and AdamW reads them only in
  // its split form).
  if (c.train.bf16_expert_grads) {
    if (!c.train.split_master)
      fail("train.bf16_expert_grads",
           "needs train.split_master (and so bf16.enabled and zero_optimization.stage 0)");
    if (c.gradient_accumulation_steps != 1)
      fail("train.bf16_expert_grads",
           "needs gradient_accumulation_steps 1 (a bf16 sum over micro-batches would round at "
           "every addition), got " +
               std::to_string(c.gradient_accumulation_steps));
  }
  if (!kHasTokenShards && c.data.source != "synthetic")
    fail("data.source",
         "got \"" + c.data.source + "\": token shards are not available yet; use \"synthetic\"");
}

// Derived model sizes become explicit so every consumer, and the printed config, sees real shapes.
void resolve(Config& c) {
  ModelConfig& m = c.model;
  m.head_dim = m.resolved_head_dim();
  m.dense_intermediate_size = m.resolved_dense_ffn();
  m.shared_expert_intermediate_size = m.resolved_shared_ffn();
  c.optimizer.type = "AdamW";  // accepted case-insensitively; one spelling downstream
}

}  // namespace

void validate_and_resolve(Config& c) {
  validate_model(c.model);
  validate_batch(c);
  validate_optimizer(c.optimizer);
  validate_scheduler(c.scheduler);
  validate_fp16(c.fp16);
  validate_zero(c.zero_optimization);
  validate_data(c.data, c.model);
  validate_mod_batch(c);
  validate_train(c.train);
  reject_unavailable_features(c);
  resolve(c);
}

}  // namespace moe::config_internal

namespace moe {

bool is_device_name(const std::string& d) {
  return config_internal::is_device_name(d);
}

}  // namespace moe
