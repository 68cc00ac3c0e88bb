// The model: parameters in one contiguous buffer (gradients in a second of the same layout),
// layers that orchestrate ops in the order of MODEL_SPEC's math, and an explicit backward.
#pragma once
#include <functional>
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
  int stack = 1;               // E for expert stacks, 1 otherwise
  std::vector<int64_t> shape;  // of one member of the stack
  size_t offset = 0;           // elements from the start of the parameter buffer
  // Read by fp32 ops (the MoE router and the MoD router and predictor run in fp32 on a
  // mixed-precision model): a split master keeps a decoded fp32 copy of these.
  bool fp32_reads = false;
  size_t numel() const;  // of the whole stack
  // The tensor over `data` ([stack, shape...] for a stack, else shape) of dtype dt on dev.
  Tensor view(void* data, DType dt, Device dev) const;
};

// The fixed layout of every parameter, built from the model config alone.
struct ParamTable {
  std::vector<ParamInfo> params;
  size_t total = 0;  // elements
  const ParamInfo& find(const std::string& name) const;
};
ParamTable build_param_table(const ModelConfig& m);
// The units ZeRO stage 3 gathers and reduces whole: the embedding, each layer, then the final
// norm with an untied head. Unit starts in the parameter buffer, then its total P.
std::vector<size_t> param_unit_bounds(const ParamTable& t, const ModelConfig& m);

// Parameter counts for `info` and the progress header.
struct ParamCounts {
  double total = 0;             // every parameter
  double active_per_token = 0;  // parameters one token touches (K routed experts, MoD skips)
  double flops_per_token = 0;   // training FLOPs (forward + backward) per token
};
ParamCounts count_params(const ModelConfig& m, int seq_len);

// Flags a step's statistics carry beside its losses (Losses::flags).
constexpr int kStepFlags = 3;

// Losses of one forward pass (averages over the micro-batch).
struct Losses {
  double lm = 0;        // MODEL_SPEC's LM loss (mean cross-entropy)
  double aux = 0;       // load-balance loss, summed over MoE layers
  double z = 0;         // router z-loss, summed over MoE layers
  double mod_pred = 0;  // causal predictor BCE, summed over MoD layers
  // The step flags raised on this rank (Model::raise_step_flag), with several ranks summed over
  // them: the trainer's stop requests, which so need no collective of their own.
  double flags[kStepFlags] = {};
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
class ShardedParams;
class Comm;
struct ZeroPartition;

// ZeRO stage 3: the model keeps only this rank's chunk of each unit and gathers a unit over the
// comm just before it runs (src/model/sharded_params.hpp).
struct ParamSharding {
  const ZeroPartition* partition = nullptr;  // ZeroPartition::per_unit over param_unit_bounds
  Comm* comm = nullptr;                      // may be null for a plan (allocate = false)
  // zero_optimization.offload_param: the chunks of the weights and gradients live in host
  // memory (page-locked with pin_memory on a GPU); params() / grads() are host tensors.
  bool offload = false;
  bool pin_memory = false;
};

// The memory choices: which activations the backward rebuilds instead of keeping
// (train.recompute_layers, train.recompute_expert_inputs, train.recompute_expert_rows), how many
// tokens' logits the head holds at once (train.head_chunk_tokens) and whether a bf16 model keeps
// its fp32 master split into the compute copy and low halves (train.split_master); Model's
// constructor says what each costs.
struct MemoryPlan {
  bool recompute_layers = false;
  bool recompute_expert_inputs = false;
  bool recompute_expert_rows = false;
  int64_t head_chunk_tokens = 0;  // 0: the whole micro-batch
  bool split_master = false;
  bool bf16_expert_grads = false;
  bool forward_only = false;
};
inline MemoryPlan memory_plan_of(const TrainConfig& t) {
  return {t.recompute_layers,      t.recompute_expert_inputs,
          t.recompute_expert_rows, t.head_chunk_tokens,
          t.split_master,          t.bf16_expert_grads};
}

class Model {
 public:
  // Plans every buffer for micro-batches of `batch` sequences of `seq_len` tokens. With
  // allocate = false nothing is allocated: the plan alone, for memory estimates.
  // `compute` is the dtype of activations and of the weights the ops read. f32 and f64 models
  // keep one copy of the weights; f16 / bf16 models keep fp32 master weights and gradients (what
  // the optimizer and checkpoints see) plus a compute copy refreshed by weights_changed(), and do
  // router, statistics and loss math in fp32.
  // memory.recompute_layers: keep only each layer's input between forward and backward and re-run
  // the layer's forward just before its backward (activation recomputation): one layer's
  // activations in memory instead of all of them, for about one more forward pass of compute.
  // memory.recompute_expert_inputs: the MoE layers keep neither their permuted rows nor the SwiGLU
  // output; the backward rebuilds them (a permute and a SwiGLU pass per MoE layer).
  // memory.recompute_expert_rows: the permuted rows only (a permute per MoE layer); implied by
  // recompute_expert_inputs.
  // memory.head_chunk_tokens (> 0): the LM head runs over chunks of that many tokens, and in
  // training each chunk's logits become their cross-entropy gradient and go through the head's
  // backward at once, so a [chunk, V] buffer replaces the [B*T, V] logits (same FLOPs; the head's
  // weight gradient is accumulated once per chunk).
  // memory.split_master (bf16 compute, unsharded): the fp32 master is not a buffer of its own but
  // the bf16 compute copy plus a u16 buffer of low halves (kernels/common/split_master.hpp), 4
  // bytes per parameter instead of 6, read and written exactly by master_to_host /
  // master_from_host and updated in place by AdamW (adamw_step_split). The compute copy rounds
  // ties toward zero instead of to even (one fp32 pattern in 65536). params() is then not
  // available, and param(p) only for the parameters fp32 ops read (ParamInfo::fp32_reads: a
  // decoded copy that weights_changed refreshes).
  // memory.bf16_expert_grads (a split master): the expert stacks' gradients (stack > 1) are bf16,
  // the rest f32, in one buffer in layout order (grad_bytes()); grads() is then not available,
  // grad_spans() gives the runs of one dtype and grad(p) each parameter's.
  // memory.forward_only (eval, sample): no gradient buffer and scratch for the forward alone;
  // grads() is then empty and the backward refused.
  // `sharding` (ZeRO stage 3): params() and grads() hold this rank's chunks only (the partition's
  // local layout); param() / grad() / work() are views of a unit's gathered copy, valid while
  // the model runs that unit; weights are written with init_weights or through the partition.
  Model(const ModelConfig& cfg, DType compute, Device dev, int batch, int seq_len,
        bool allocate = true, MemoryPlan memory = {}, const ParamSharding* sharding = nullptr);
  ~Model();

  void init_weights(uint64_t seed);
  // Elements [begin, end) of the flat fp32 (master dtype) weights to or from host memory, exact
  // whichever way the master is stored (not ZeRO-3: there params() holds this rank's chunks).
  // After master_from_host the caller calls weights_changed, as after any write of the weights.
  void master_to_host(size_t begin, size_t end, void* host) const;
  void master_from_host(size_t begin, size_t end, const void* host);
  bool splits_master() const { return memory_.split_master; }
  // Whether the next backward writes (=) the experts' weight gradients: zero_grads(ctx, true)
  // left them (the MoE layers pass it to the grouped ops as dw_overwrite).
  bool backward_writes_expert_grads() const { return experts_overwrite_; }
  // The split master's low halves ([P] u16; empty unless splits_master()); compute_params() is
  // the other half.
  Tensor master_low() const;
  // After anything wrote params() (optimizer step, checkpoint load): refresh the compute copy.
  // compute_copy_current: the writer kept compute_params() current itself (AdamW's fused
  // compute-copy output: AdamW::writes_compute_copy), so the whole-buffer convert is skipped;
  // everything else weights_changed does still happens.
  void weights_changed(Ctx& ctx, bool compute_copy_current = false);
  // The same for the parameters inside elements [begin, end) only (whole parameters: a unit of
  // param_unit_bounds), for an optimizer that updates the model unit by unit; not ZeRO-3.
  void weights_changed(Ctx& ctx, bool compute_copy_current, size_t begin, size_t end);

  // ---- the training step: queued on ctx's stream, nothing read back ----
  // Zeroes the device-side loss sums, expert loads and MoD counts (not the gradients).
  void reset_stats(Ctx& ctx);
  // Copies a micro-batch to the device (checked: ids inside the vocabulary). On a GPU through
  // page-locked staging slots, so the host waits for nothing but a slot's previous upload.
  void upload_batch(Ctx& ctx, const int32_t* ids, const int32_t* targets);
  // Called during the backward each time a range [begin, end) of grads() (elements) has received
  // its last contribution of this backward: the LM head and final norm first, then each layer
  // from the last to the first, then the embedding (tied to the head: only then). The ranges are
  // adjacent and descending and cover the whole buffer once; the call comes after the range's
  // gradient ops are queued on ctx's stream (data parallelism reduces them there, while the
  // backward of earlier layers goes on).
  using GradientReady = std::function<void(Ctx& ctx, size_t begin, size_t end)>;
  // Forward and backward on the uploaded micro-batch: gradients accumulate (+=) into grads()
  // scaled by `grad_scale` (1 / gradient_accumulation_steps for an averaged step, times the fp16
  // loss scale); losses and expert loads are summed on the device. `ready`, when given, is told
  // of each finished gradient range (see GradientReady).
  void queue_forward_backward(Ctx& ctx, double grad_scale, const GradientReady& ready = nullptr);
  // Forward only (evaluation) on the uploaded micro-batch.
  void queue_forward(Ctx& ctx);
  // Waits for ctx's stream (not the whole device: an optimizer update on a side stream goes on):
  // mean losses over the micro-batches since reset_stats(), and routing() refreshed with the
  // loads summed since then.
  Losses read_stats(Ctx& ctx);
  // Sets step flag `flag` (< kStepFlags) for read_stats, on ctx's stream; reset_stats clears it.
  void raise_step_flag(Ctx& ctx, int flag);
  // The device tensors behind read_stats, for data parallelism to sum across ranks first:
  // f64 [4 + kStepFlags] loss sums (lm, aux, z, mod_pred; each a sum of micro-batch means) and
  // step flags, and the MoE layers' expert loads, [MoE layers, E] (empty without MoE layers;
  // the router-bias update reads them in after_step).
  Tensor loss_sums() const { return stats_; }
  Tensor expert_loads() const { return loads_; }

  // ---- conveniences (each reads back, so each waits for the device) ----
  Losses forward_backward(Ctx& ctx, const int32_t* ids, const int32_t* targets, double grad_scale);
  Losses forward(Ctx& ctx, const int32_t* ids, const int32_t* targets);
  // End of an optimizer step: updates aux-loss-free router biases from the step's loads.
  void after_step(Ctx& ctx);

  const ModelConfig& config() const { return cfg_; }
  const ParamTable& table() const { return table_; }
  DType dtype() const { return param_dtype_; }  // master weights, gradients, optimizer state
  DType compute_dtype() const { return compute_; }
  // Master weights (ZeRO-3: this rank's chunks); not with a split master (master_to_host).
  Tensor params() const;
  // The flat gradient buffer; not with bf16 expert gradients (grad_spans).
  Tensor grads() const;
  // A run of gradients of one dtype: elements [begin, begin + g.numel()) of the layout.
  struct GradSpan {
    size_t begin;
    Tensor g;
  };
  // Elements [begin, end) of the layout's gradients as runs of one dtype each, in order: one run
  // of grads() unless bf16 expert gradients split them (not ZeRO-3).
  std::vector<GradSpan> grad_spans(size_t begin, size_t end) const;
  std::vector<GradSpan> grad_spans() const { return grad_spans(0, table_.total); }
  // Parameter p's gradient dtype: bf16 for an expert stack with bf16_expert_grads, else dtype().
  DType grad_dtype(const ParamInfo& p) const;
  size_t grad_bytes() const;  // of the unsharded gradient buffer
  Device device() const { return dev_; }
  // The 16-bit compute copy of params() as one flat tensor of the compute dtype, laid out like
  // params(); empty when there is none to keep current from outside: an f32 / f64 model (the
  // master is the compute copy), a ZeRO-3 model (each unit is converted as it is gathered) or a
  // plan (allocate = false).
  Tensor compute_params() const;
  bool params_sharded() const { return sharded_ != nullptr; }
  // ZeRO-3, for code that needs the whole weights (checkpoints, imports): gather_params writes
  // them all into `host` ([P] of the master dtype in host memory; may be null on ranks that do
  // not need them) and must be called on every rank (each unit is gathered over the comm);
  // scatter_params takes this rank's chunks out of the whole weights `host`.
  void gather_params(Ctx& ctx, void* host);
  void scatter_params(Ctx& ctx, const void* host);
  // ZeRO-3 parameter offload: `wait(local_end)` is called before a unit's host chunk (ending at
  // that local offset) is copied to the GPU, so the optimizer may still be updating later units.
  void set_chunk_wait(std::function<void(size_t local_end)> wait);
  // `wait(ctx, unit)` is called before each forward uses unit `unit` of param_unit_bounds (0 the
  // embedding, l + 1 layer l, the last the final norm and head, whose use runs on into the
  // backward), so an optimizer still updating later units on another stream can make ctx's stream
  // wait for that unit only (AdamW::wait_unit).
  void set_unit_wait(std::function<void(Ctx& ctx, int unit)> wait) { unit_wait_ = std::move(wait); }
  Tensor param(const ParamInfo& p) const;
  Tensor grad(const ParamInfo& p) const;
  Tensor work(const ParamInfo& p) const;  // the compute copy (the master itself in f32 / f64)
  // The next backward starts the gradients from zero. (With ZeRO-3 parameter offload the host
  // chunks keep their old values until that backward overwrites them.) experts_by_backward
  // (unsharded models; the trainer, whose every step starts with a backward): the experts' weight
  // stacks are not cleared but written (=) by that backward's grouped dw ops (dw_overwrite), which
  // saves a pass over most of a MoE model's gradients; until then they hold stale values.
  void zero_grads(Ctx& ctx, bool experts_by_backward = false);
  const RoutingStats& routing() const { return routing_; }
  // Logits of the last forward(): [B*T, V], or with head chunks the last chunk's rows
  // (forward_backward overwrites them with gradients).
  Tensor logits() const { return logits_; }
  // Non-parameter state that training changes and a checkpoint must keep: the aux-loss-free
  // router biases ([E] per MoE layer, in layer order).
  std::vector<Tensor> router_biases() const;
  size_t activation_bytes() const { return acts_.peak_bytes(); }
  size_t scratch_bytes() const { return scratch_.peak_bytes(); }
  // Parameters, gradients and the compute copy (optimizer state not included).
  size_t weight_bytes() const;
  int batch() const { return batch_; }
  int seq_len() const { return seq_len_; }
  bool recomputes_layers() const { return memory_.recompute_layers; }
  bool recomputes_expert_inputs() const { return memory_.recompute_expert_inputs; }
  bool recomputes_expert_rows() const {
    return memory_.recompute_expert_rows || memory_.recompute_expert_inputs;
  }

 private:
  friend struct LayerEnv;
  void plan();
  // Parameter p's initial values (all p.numel() of them, in the master dtype; ZeRO-3 keeps this
  // rank's part).
  void write_param(const ParamInfo& p, const void* host);
  void run_layers(Ctx& ctx, bool backward_too, double grad_scale,
                  const GradientReady& ready = nullptr);
  void backward(Ctx& ctx, double grad_scale, double ce_scale, const GradientReady& ready);
  // The LM head over xf_ chunk by chunk: logits, per-token losses and lse; with backward_too
  // also each chunk's backward at once (dlogits = ce_scale (softmax - onehot) in place, dxf into
  // dstream_b_, the head's gradient accumulated).
  void head_chunks(Ctx& ctx, bool backward_too, double ce_scale);
  // ZeRO-3 (forward): unit's weights gathered and ready, unit + 1 gathering meanwhile.
  void acquire_unit(Ctx& ctx, int unit);

  ModelConfig cfg_;
  DType compute_, param_dtype_;
  Device dev_;
  int batch_, seq_len_;
  bool allocated_;
  MemoryPlan memory_;
  ParamTable table_;
  // Where each layer's parameters start in the flat buffer; [L] = the final norm's offset.
  std::vector<size_t> layer_offsets_;
  Buffer param_buf_, grad_buf_, work_buf_;  // work_buf_ only when compute_ != param_dtype_
  // Where each parameter's gradient starts in grad_buf_ (bytes; by index in table_.params), and
  // the buffer's size: in layout order, each in its grad_dtype.
  std::vector<size_t> grad_at_;
  size_t grad_total_bytes_ = 0;
  // Split master: the low halves (work_buf_ holds the high ones; no param_buf_) and the decoded
  // fp32 copy of the fp32_reads parameters, each at fp32_slot_[index in table_.params].
  Buffer low_buf_, fp32_copy_buf_;
  std::vector<size_t> fp32_slot_;
  size_t fp32_copy_elems_ = 0;
  Arena acts_, scratch_;
  std::unique_ptr<ShardedParams> sharded_;    // ZeRO stage 3 only
  std::function<void(Ctx&, int)> unit_wait_;  // set_unit_wait
  std::unique_ptr<LayerEnv> env_;
  std::vector<std::unique_ptr<Layer>> layers_;
  RoutingStats routing_;
  int64_t valid_targets_ = 0;  // of the uploaded micro-batch
  int micro_batches_ = 0;      // since reset_stats
  // zero_grads(ctx, true) left the expert stacks' gradients for the next backward to write.
  bool experts_overwrite_ = false;
  // Model-level activations: the residual stream between layers and the head.
  Tensor ids_, targets_, pos_, rope_cos_, rope_sin_;
  std::vector<Tensor> stream_;    // L+1 tensors [N, d]: input of each layer, then the output
  Tensor dstream_a_, dstream_b_;  // [N, d] gradient ping-pong
  Tensor xf_, rstdf_, logits_, losses_, lse_;  // final norm, [N, V] logits, per-token losses
  Tensor stats_;  // f64 [kStats] device sums: lm, aux, z, mod_pred, the step flags
  Tensor loads_;  // [MoE layers, E] step loads (LayerEnv::loads)
  std::vector<double> host_loads_;     // reused by read_stats (no allocation per step)
  std::vector<float> host_loads_f32_;  // the same for loads in f32
  struct Staging;                      // page-locked upload slots (GPU only)
  std::unique_ptr<Staging> staging_;
};

}  // namespace moe
