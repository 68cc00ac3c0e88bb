// The whole model: embedding -> L layers (Block or ModBlock) -> final norm -> LM head + loss,
// and the backward in reverse. Buffers are planned in the constructor: saved activations by each
// layer's plan(), backward scratch by a dry run of backward (ops skip, the Arena measures).
#include <algorithm>
#include <cmath>

#include "model/layers.hpp"
#include "moe/model.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/embedding.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/loss.hpp"
#include "moe/ops/norm.hpp"
#include "moe/ops/rope.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/rng.hpp"

namespace moe {

// Page-locked host slots for micro-batch uploads. A slot is rewritten only after the device has
// consumed its previous upload (its event), so the host may run up to kSlots micro-batches
// ahead of the device and never waits for the device to drain.
struct Model::Staging {
  static constexpr int kSlots = 2;
  explicit Staging(size_t tokens) : n(tokens) {
    try {
      for (int i = 0; i < kSlots; ++i) {
        host[i] = static_cast<int32_t*>(gpu::malloc_pinned(2 * n * sizeof(int32_t)));
        event[i] = gpu::event_create();
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~Staging() { release(); }
  // Never throws: it also runs while an error (perhaps a device fault) unwinds the trainer.
  void release() noexcept {
    for (int i = 0; i < kSlots; ++i) {
      try {
        if (used[i]) gpu::event_synchronize(event[i]);  // the copy may still read the slot
      } catch (...) {  // a faulted device: nothing to wait for any more
      }
      gpu::free_pinned(host[i]);
      gpu::event_destroy(event[i]);
      host[i] = nullptr;
      event[i] = nullptr;
    }
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  size_t n;  // tokens per micro-batch (each slot holds ids then targets)
  int next = 0;
  int32_t* host[kSlots] = {};
  void* event[kSlots] = {};
  bool used[kSlots] = {};
};

Model::Model(const ModelConfig& cfg, DType compute, Device dev, int batch, int seq_len,
             bool allocate, bool recompute_layers)
    : cfg_(cfg),
      compute_(compute),
      param_dtype_(acc_dtype(compute)),
      dev_(dev),
      batch_(batch),
      seq_len_(seq_len),
      allocated_(allocate),
      recompute_(recompute_layers),
      table_(build_param_table(cfg)),
      acts_(dev),
      scratch_(dev) {
  for (int l = 0; l < cfg.num_hidden_layers; ++l)
    layer_offsets_.push_back(
        table_.find("model.layers." + std::to_string(l) + ".input_layernorm.weight").offset);
  layer_offsets_.push_back(table_.find("model.norm.weight").offset);
  MOE_CHECK(!allocate || compute_ == param_dtype_ || dev.type == DeviceType::cuda,
            std::string("Model: ") + dtype_name(compute_) + " compute needs a GPU");
  if (allocate) {
    param_buf_ = Buffer(dev, table_.total * dtype_size(param_dtype_));
    grad_buf_ = Buffer(dev, table_.total * dtype_size(param_dtype_));
    if (compute_ != param_dtype_) work_buf_ = Buffer(dev, table_.total * dtype_size(compute_));
  }
  env_ = std::make_unique<LayerEnv>(
      LayerEnv{cfg_, compute_, param_dtype_, *this, scratch_, Tensor(), Tensor(), Tensor(), false});
  const Dims dims{batch, seq_len};
  int moe_index = 0;
  for (int l = 0; l < cfg.num_hidden_layers; ++l) {
    layers_.push_back(make_layer(*env_, l, moe_index, dims));
    if (cfg.is_moe_layer(l)) ++moe_index;
  }
  routing_.expert_load.assign(moe_index, std::vector<double>(cfg.num_local_experts, 0.0));
  plan();  // measure
  Ctx dry{dev, nullptr, nullptr, true};
  if (!allocate) {
    run_layers(dry, true, 1.0);  // measure scratch
    return;
  }
  acts_.allocate();
  plan();                      // place
  run_layers(dry, true, 1.0);  // measure scratch (forward and backward)
  scratch_.allocate();
  if (dev.type == DeviceType::cuda)
    staging_ = std::make_unique<Staging>(static_cast<size_t>(batch) * seq_len);
  Ctx ctx = make_ctx(dev);
  rope_table(ctx, rope_cos_, rope_sin_, cfg.rope_theta);
  std::vector<int32_t> pos(static_cast<size_t>(batch) * seq_len);
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>(i % seq_len);
  copy_from_host(pos_, pos.data());
  reset_stats(ctx);
}

Model::~Model() = default;

void Model::plan() {
  const int64_t n = static_cast<int64_t>(batch_) * seq_len_, d = cfg_.hidden_size;
  const int64_t half = cfg_.resolved_head_dim() / 2;
  const DType dt = compute_, acc = param_dtype_;
  ids_ = acts_.alloc(DType::i32, {n});
  targets_ = acts_.alloc(DType::i32, {n});
  pos_ = acts_.alloc(DType::i32, {n});
  rope_cos_ = acts_.alloc(acc, {cfg_.max_position_embeddings, half});
  rope_sin_ = acts_.alloc(acc, {cfg_.max_position_embeddings, half});
  stats_ = acts_.alloc(DType::f64, {kStats});
  env_->rope_cos = rope_cos_;
  env_->rope_sin = rope_sin_;
  env_->stats = stats_;
  stream_.clear();
  for (int l = 0; l <= cfg_.num_hidden_layers; ++l) stream_.push_back(acts_.alloc(dt, {n, d}));
  dstream_a_ = acts_.alloc(dt, {n, d});
  dstream_b_ = acts_.alloc(dt, {n, d});
  xf_ = acts_.alloc(dt, {n, d});
  rstdf_ = acts_.alloc(acc, {n});
  logits_ = acts_.alloc(dt, {n, cfg_.vocab_size});
  losses_ = acts_.alloc(acc, {n});
  lse_ = acts_.alloc(acc, {n});
  for (auto& layer : layers_) layer->plan_state(acts_);
  // Saved activations: each layer its own, or with recomputation one region all layers share
  // (planned from the same mark; the arena keeps the largest).
  const size_t shared = acts_.mark();
  for (auto& layer : layers_) {
    if (recompute_) acts_.release(shared);
    layer->plan(acts_);
  }
  loads_.clear();
  for (const auto& layer : layers_) layer->collect_loads(loads_);
}

size_t Model::weight_bytes() const {
  size_t per = 2 * dtype_size(param_dtype_);
  if (compute_ != param_dtype_) per += dtype_size(compute_);
  return table_.total * per;
}

Tensor Model::params() const {
  return param_buf_.as(param_dtype_, {static_cast<int64_t>(table_.total)});
}
Tensor Model::grads() const {
  return grad_buf_.as(param_dtype_, {static_cast<int64_t>(table_.total)});
}

static Tensor param_view(const Buffer& buf, bool allocated, DType dt, Device dev,
                         const ParamInfo& p) {
  void* data = allocated ? static_cast<char*>(buf.data()) + p.offset * dtype_size(dt) : nullptr;
  Tensor t(data, dt, dev, {});
  t.ndim = static_cast<int>(p.shape.size()) + (p.stack > 1 ? 1 : 0);
  int i = 0;
  if (p.stack > 1) t.shape[i++] = p.stack;
  for (int64_t s : p.shape) t.shape[i++] = s;
  return t;
}

Tensor Model::param(const ParamInfo& p) const {
  return param_view(param_buf_, allocated_, param_dtype_, dev_, p);
}
Tensor Model::grad(const ParamInfo& p) const {
  return param_view(grad_buf_, allocated_, param_dtype_, dev_, p);
}
Tensor Model::work(const ParamInfo& p) const {
  if (compute_ == param_dtype_) return param(p);
  return param_view(work_buf_, allocated_, compute_, dev_, p);
}

void Model::zero_grads(Ctx& ctx) {
  fill(ctx, grads(), 0.0);
}

void Model::weights_changed(Ctx& ctx) {
  if (compute_ == param_dtype_) return;
  convert(ctx, work_buf_.as(compute_, {static_cast<int64_t>(table_.total)}), params(), false);
}

// Normal(0, initializer_range) for matrices, scaled by 1/sqrt(2L) for residual output
// projections (GPT-2), ones for norms. Each parameter draws from its own stream seeded by its
// name, so the weights do not depend on the layout order.
void Model::init_weights(uint64_t seed) {
  const double std0 = cfg_.initializer_range;
  const double std_res = std0 / std::sqrt(2.0 * cfg_.num_hidden_layers);
  Ctx ctx = make_ctx(dev_);
  for (const auto& p : table_.params) {
    std::vector<double> host(p.numel());
    if (p.kind == ParamKind::norm) {
      std::fill(host.begin(), host.end(), 1.0);
    } else {
      Rng rng(hash_name(p.name, seed));
      const double s = p.kind == ParamKind::residual ? std_res : std0;
      for (auto& v : host) v = s * rng.normal();
    }
    Tensor t = param(p);
    if (param_dtype_ == DType::f64) {
      copy_from_host(t, host.data());
    } else {
      std::vector<float> f(host.begin(), host.end());
      copy_from_host(t, f.data());
    }
  }
  zero_grads(ctx);
  weights_changed(ctx);
}

void Model::reset_stats(Ctx& ctx) {
  fill(ctx, stats_, 0.0);
  for (Tensor l : loads_) fill(ctx, l, 0.0);
  routing_.reset();
  micro_batches_ = 0;
}

void Model::upload_batch(Ctx& ctx, const int32_t* ids, const int32_t* targets) {
  const int64_t n = static_cast<int64_t>(batch_) * seq_len_;
  const int vocab = cfg_.vocab_size;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      throw InputError("token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                       " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  valid_targets_ = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (targets[i] >= vocab)  // negative targets are ignored positions
      throw InputError("target id " + std::to_string(targets[i]) + " at position " +
                       std::to_string(i) + " is outside the vocabulary [0, " +
                       std::to_string(vocab) + ")");
    valid_targets_ += targets[i] >= 0 ? 1 : 0;
  }
  if (!staging_) {
    copy_from_host(ids_, ids);
    copy_from_host(targets_, targets);
    return;
  }
  Staging& st = *staging_;
  const int slot = st.next;
  st.next = (slot + 1) % Staging::kSlots;
  if (st.used[slot]) gpu::event_synchronize(st.event[slot]);  // its previous upload has landed
  std::copy(ids, ids + n, st.host[slot]);
  std::copy(targets, targets + n, st.host[slot] + n);
  const size_t bytes = static_cast<size_t>(n) * sizeof(int32_t);
  gpu::copy_to_device_async(ids_.data, st.host[slot], bytes, ctx.stream);
  gpu::copy_to_device_async(targets_.data, st.host[slot] + n, bytes, ctx.stream);
  gpu::event_record(st.event[slot], ctx.stream);
  st.used[slot] = true;
}

void Model::queue_forward_backward(Ctx& ctx, double grad_scale, const GradientReady& ready) {
  run_layers(ctx, true, grad_scale, ready);
  ++micro_batches_;
}

void Model::queue_forward(Ctx& ctx) {
  run_layers(ctx, false, 0.0);
  ++micro_batches_;
}

Losses Model::forward_backward(Ctx& ctx, const int32_t* ids, const int32_t* targets,
                               double grad_scale) {
  reset_stats(ctx);
  upload_batch(ctx, ids, targets);
  queue_forward_backward(ctx, grad_scale);
  return read_stats(ctx);
}

Losses Model::forward(Ctx& ctx, const int32_t* ids, const int32_t* targets) {
  reset_stats(ctx);
  upload_batch(ctx, ids, targets);
  queue_forward(ctx);
  return read_stats(ctx);
}

Losses Model::read_stats(Ctx& ctx) {
  double sums[kStats];
  copy_to_host(sums, stats_);  // waits for the device
  const double m = micro_batches_ > 0 ? static_cast<double>(micro_batches_) : 1.0;
  Losses l;
  l.lm = sums[kStatLm] / m;
  l.aux = sums[kStatAux] / m;
  l.z = sums[kStatZ] / m;
  l.mod_pred = sums[kStatModPred] / m;
  const std::vector<Tensor>& loads = loads_;
  for (size_t i = 0; i < loads.size(); ++i) {
    auto& out = routing_.expert_load[i];
    if (loads[i].dtype == DType::f64) {
      copy_to_host(out.data(), loads[i]);
    } else {
      host_loads_f32_.resize(out.size());
      copy_to_host(host_loads_f32_.data(), loads[i]);
      out.assign(host_loads_f32_.begin(), host_loads_f32_.end());
    }
  }
  return l;
}

// Embedding -> layers -> final norm -> head -> per-token losses (summed into stats_ as this
// micro-batch's mean), then the backward when asked. Works in dry-run mode too (the planning
// pass that measures the scratch arena).
void Model::run_layers(Ctx& ctx, bool backward_too, double grad_scale, const GradientReady& ready) {
  const auto& embed = table_.find("model.embed_tokens.weight");
  embedding_forward(ctx, stream_[0], ids_, work(embed));
  for (size_t l = 0; l < layers_.size(); ++l)
    layers_[l]->forward(ctx, stream_[l + 1], stream_[l], pos_);
  const auto& normf = table_.find("model.norm.weight");
  const auto& head =
      table_.find(cfg_.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
  rmsnorm_forward(ctx, xf_, rstdf_, stream_.back(), work(normf), cfg_.rms_norm_eps);
  linear_forward(ctx, logits_, xf_, work(head), false);
  cross_entropy_forward(ctx, losses_, lse_, logits_, targets_);
  const double per_valid = valid_targets_ > 0 ? 1.0 / static_cast<double>(valid_targets_) : 0.0;
  accumulate_sum(ctx, stats_.rows(kStatLm, kStatLm + 1), losses_, per_valid);
  if (backward_too) backward(ctx, grad_scale, grad_scale * per_valid, ready);
}

// ce_scale = grad_scale / valid targets: d loss / d logits = (softmax - onehot) / valid.
// The parameter layout is embedding, layers 0..L-1, final norm, head (params.cpp), so the
// backward finishes gradient ranges from the end of the buffer toward its start.
void Model::backward(Ctx& ctx, double grad_scale, double ce_scale, const GradientReady& ready) {
  auto finished = [&](size_t begin, size_t end) {
    if (ready && !ctx.dry_run) ready(ctx, begin, end);
  };
  const size_t num_layers = layers_.size();
  const auto& embed = table_.find("model.embed_tokens.weight");
  const auto& normf = table_.find("model.norm.weight");
  const auto& head =
      table_.find(cfg_.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
  cross_entropy_backward(ctx, logits_, logits_, lse_, targets_, ce_scale);
  linear_backward(ctx, dstream_b_, grad(head), logits_, xf_, work(head), false);
  rmsnorm_backward(ctx, dstream_a_, grad(normf), dstream_b_, stream_.back(), work(normf), rstdf_);
  finished(layer_offsets_[num_layers], table_.total);  // final norm and an untied head
  Tensor dout = dstream_a_, dx = dstream_b_;
  for (size_t l = layers_.size(); l-- > 0;) {
    if (recompute_) {  // rebuild this layer's activations from its saved input
      env_->recomputing = true;
      layers_[l]->forward(ctx, stream_[l + 1], stream_[l], pos_);
      env_->recomputing = false;
    }
    layers_[l]->backward(ctx, dx, dout, stream_[l], pos_, grad_scale);
    finished(layer_offsets_[l], layer_offsets_[l + 1]);
    std::swap(dx, dout);
  }
  embedding_backward(ctx, grad(embed), dout, ids_);
  finished(0, layer_offsets_[0]);  // the embedding (a tied head wrote into it first)
}

std::vector<Tensor> Model::router_biases() const {
  std::vector<Tensor> out;
  for (const auto& layer : layers_) layer->collect_state(out);
  return out;
}

void Model::after_step(Ctx& ctx) {
  for (auto& layer : layers_) layer->after_step(ctx);
}

// maxvio of one layer: max_e load_e / mean_e load_e - 1 (0 when nothing was routed).
static double layer_maxvio(const std::vector<double>& load) {
  double mx = 0, mean = 0;
  for (double v : load) mx = std::max(mx, v), mean += v;
  mean /= static_cast<double>(load.size());
  return mean > 0 ? mx / mean - 1 : 0;
}

double RoutingStats::maxvio_mean() const {
  if (expert_load.empty()) return 0;
  double s = 0;
  for (const auto& load : expert_load) s += layer_maxvio(load);
  return s / static_cast<double>(expert_load.size());
}

double RoutingStats::maxvio_max() const {
  double best = 0;
  for (const auto& load : expert_load) best = std::max(best, layer_maxvio(load));
  return best;
}

void RoutingStats::reset() {
  for (auto& load : expert_load) std::fill(load.begin(), load.end(), 0.0);
  mod_kept = mod_seen = 0;
}

}  // namespace moe
