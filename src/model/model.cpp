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
#include "moe/rng.hpp"

namespace moe {

Model::Model(const ModelConfig& cfg, DType dtype, Device dev, int batch, int seq_len,
             bool allocate)
    : cfg_(cfg),
      dtype_(dtype),
      dev_(dev),
      batch_(batch),
      seq_len_(seq_len),
      allocated_(allocate),
      table_(build_param_table(cfg)),
      acts_(dev),
      scratch_(dev) {
  if (allocate) {
    param_buf_ = Buffer(dev, table_.total * dtype_size(dtype));
    grad_buf_ = Buffer(dev, table_.total * dtype_size(dtype));
  }
  env_ = std::make_unique<LayerEnv>(LayerEnv{cfg_, dtype_, *this, scratch_, Tensor(), Tensor()});
  const Dims dims{batch, seq_len};
  int moe_index = 0;
  for (int l = 0; l < cfg.num_hidden_layers; ++l) {
    layers_.push_back(make_layer(*env_, l, moe_index, dims));
    if (cfg.is_moe_layer(l)) ++moe_index;
  }
  routing_.expert_load.assign(moe_index, std::vector<double>(cfg.num_local_experts, 0.0));
  plan();  // measure
  if (!allocate) {
    Ctx dry{dev, nullptr, nullptr, true};
    backward(dry, 1.0, 1);
    return;
  }
  acts_.allocate();
  plan();  // place
  Ctx ctx = make_ctx(dev);
  rope_table(ctx, rope_cos_, rope_sin_, cfg.rope_theta);
  std::vector<int32_t> pos(static_cast<size_t>(batch) * seq_len);
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>(i % seq_len);
  copy_from_host(pos_, pos.data());
  Ctx dry{dev, nullptr, nullptr, true};
  backward(dry, 1.0, 1);  // measure scratch
  scratch_.allocate();
}

Model::~Model() = default;

void Model::plan() {
  const int64_t n = static_cast<int64_t>(batch_) * seq_len_, d = cfg_.hidden_size;
  const int64_t half = cfg_.resolved_head_dim() / 2;
  ids_ = acts_.alloc(DType::i32, {n});
  targets_ = acts_.alloc(DType::i32, {n});
  pos_ = acts_.alloc(DType::i32, {n});
  rope_cos_ = acts_.alloc(dtype_, {cfg_.max_position_embeddings, half});
  rope_sin_ = acts_.alloc(dtype_, {cfg_.max_position_embeddings, half});
  env_->rope_cos = rope_cos_;
  env_->rope_sin = rope_sin_;
  stream_.clear();
  for (int l = 0; l <= cfg_.num_hidden_layers; ++l) stream_.push_back(acts_.alloc(dtype_, {n, d}));
  dstream_a_ = acts_.alloc(dtype_, {n, d});
  dstream_b_ = acts_.alloc(dtype_, {n, d});
  xf_ = acts_.alloc(dtype_, {n, d});
  rstdf_ = acts_.alloc(dtype_, {n});
  logits_ = acts_.alloc(dtype_, {n, cfg_.vocab_size});
  losses_ = acts_.alloc(dtype_, {n});
  lse_ = acts_.alloc(dtype_, {n});
  for (auto& layer : layers_) layer->plan(acts_);
}

Tensor Model::params() const { return param_buf_.as(dtype_, {static_cast<int64_t>(table_.total)}); }
Tensor Model::grads() const { return grad_buf_.as(dtype_, {static_cast<int64_t>(table_.total)}); }

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
  return param_view(param_buf_, allocated_, dtype_, dev_, p);
}
Tensor Model::grad(const ParamInfo& p) const {
  return param_view(grad_buf_, allocated_, dtype_, dev_, p);
}

void Model::zero_grads(Ctx& ctx) { fill(ctx, grads(), 0.0); }

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
    if (dtype_ == DType::f64) {
      copy_from_host(t, host.data());
    } else {
      std::vector<float> f(host.begin(), host.end());
      copy_from_host(t, f.data());
    }
  }
  zero_grads(ctx);
}

Losses Model::forward_backward(Ctx& ctx, const int32_t* ids, const int32_t* targets,
                               double grad_scale) {
  return run(ctx, ids, targets, true, grad_scale);
}

Losses Model::forward(Ctx& ctx, const int32_t* ids, const int32_t* targets) {
  return run(ctx, ids, targets, false, 0.0);
}

Losses Model::run(Ctx& ctx, const int32_t* ids, const int32_t* targets, bool backward_too,
                  double grad_scale) {
  const int64_t n = static_cast<int64_t>(batch_) * seq_len_;
  const int vocab = cfg_.vocab_size;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      throw InputError("token id " + std::to_string(ids[i]) + " at position " +
                       std::to_string(i) + " is outside the vocabulary [0, " +
                       std::to_string(vocab) + ")");
  int64_t valid = 0;
  for (int64_t i = 0; i < n; ++i) valid += targets[i] >= 0 ? 1 : 0;
  copy_from_host(ids_, ids);
  copy_from_host(targets_, targets);

  Losses losses;
  const auto& embed = table_.find("model.embed_tokens.weight");
  embedding_forward(ctx, stream_[0], ids_, param(embed));
  for (size_t l = 0; l < layers_.size(); ++l)
    layers_[l]->forward(ctx, stream_[l + 1], stream_[l], pos_, losses);
  const auto& normf = table_.find("model.norm.weight");
  const auto& head = table_.find(cfg_.tie_word_embeddings ? "model.embed_tokens.weight"
                                                          : "lm_head.weight");
  rmsnorm_forward(ctx, xf_, rstdf_, stream_.back(), param(normf), cfg_.rms_norm_eps);
  linear_forward(ctx, logits_, xf_, param(head), false);
  cross_entropy_forward(ctx, losses_, lse_, logits_, targets_);

  double sum = 0;
  if (dtype_ == DType::f64) {
    host_losses_f64_.resize(static_cast<size_t>(n));
    copy_to_host(host_losses_f64_.data(), losses_);
    for (double v : host_losses_f64_) sum += v;
  } else {
    host_losses_f32_.resize(static_cast<size_t>(n));
    copy_to_host(host_losses_f32_.data(), losses_);
    for (float v : host_losses_f32_) sum += v;
  }
  losses.lm = valid > 0 ? sum / static_cast<double>(valid) : 0.0;
  if (backward_too) backward(ctx, grad_scale, valid);
  return losses;
}

void Model::backward(Ctx& ctx, double grad_scale, int64_t valid) {
  const auto& embed = table_.find("model.embed_tokens.weight");
  const auto& normf = table_.find("model.norm.weight");
  const auto& head = table_.find(cfg_.tie_word_embeddings ? "model.embed_tokens.weight"
                                                          : "lm_head.weight");
  // loss = mean over valid targets: d loss / d logits = (softmax - onehot) / valid
  const double ce_scale = valid > 0 ? grad_scale / static_cast<double>(valid) : 0.0;
  cross_entropy_backward(ctx, logits_, logits_, lse_, targets_, ce_scale);
  linear_backward(ctx, dstream_b_, grad(head), logits_, xf_, param(head), false);
  rmsnorm_backward(ctx, dstream_a_, grad(normf), dstream_b_, stream_.back(), param(normf),
                   rstdf_);
  Tensor dout = dstream_a_, dx = dstream_b_;
  for (size_t l = layers_.size(); l-- > 0;) {
    layers_[l]->backward(ctx, dx, dout, stream_[l], pos_, grad_scale);
    std::swap(dx, dout);
  }
  embedding_backward(ctx, grad(embed), dout, ids_);
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
