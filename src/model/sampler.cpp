// The Decoder (embedding -> decode layers -> final norm -> LM head for one token) and sampling on
// top of it. The layers live in decoder.cpp; this file owns the residual stream, the position,
// the input checks and the choice of the next token.
//
// Sampling is deterministic for a seed: every draw takes exactly one uniform from the Rng, and
// candidates are visited in a fixed order (token id for the full vocabulary, rank for top-k), so
// the result does not depend on thread counts or library versions.
#include "moe/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "model/decoder_layers.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/embedding.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/norm.hpp"
#include "moe/ops/rope.hpp"

namespace moe {

// ---- Decoder ------------------------------------------------------------------------------------

Decoder::Decoder(const Model& model)
    : model_(model), ctx_(make_ctx(model.params().device)), acts_(model.params().device) {
  MOE_CHECK(model.params().data != nullptr,
            "Decoder: the model was planned without allocating its parameters");
  const ModelConfig& c = model.config();
  env_ = std::make_unique<DecodeEnv>(
      DecodeEnv{c, model.dtype(), model, c.max_position_embeddings, Tensor(), Tensor()});
  // Biases steer routing only when aux-loss-free balancing is on (as in MoeFfn::forward).
  const std::vector<Tensor> biases = model.router_biases();
  int moe_index = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    Tensor bias;
    if (c.is_moe_layer(l) && c.router_bias_update_rate > 0) bias = biases.at(moe_index);
    if (c.is_moe_layer(l)) ++moe_index;
    layers_.push_back(make_decode_layer(*env_, l, bias));
  }
  plan();  // measure
  acts_.allocate();
  plan();  // place
  rope_table(ctx_, env_->rope_cos, env_->rope_sin, c.rope_theta);
  host_logits_.resize(static_cast<size_t>(c.vocab_size));
}

Decoder::~Decoder() = default;

void Decoder::plan() {
  const ModelConfig& c = model_.config();
  const DType dt = model_.dtype();
  const int64_t d = c.hidden_size, half = c.resolved_head_dim() / 2;
  env_->rope_cos = acts_.alloc(dt, {env_->max_len, half});
  env_->rope_sin = acts_.alloc(dt, {env_->max_len, half});
  ids_ = acts_.alloc(DType::i32, {1});
  pos_ = acts_.alloc(DType::i32, {1});
  stream_a_ = acts_.alloc(dt, {1, d});
  stream_b_ = acts_.alloc(dt, {1, d});
  xf_ = acts_.alloc(dt, {1, d});
  rstdf_ = acts_.alloc(dt, {1});
  logits_ = acts_.alloc(dt, {1, c.vocab_size});
  for (auto& layer : layers_) layer->plan(acts_);
}

int64_t Decoder::max_len() const {
  return env_->max_len;
}

int64_t Decoder::cached(int layer) const {
  MOE_CHECK(layer >= 0 && layer < static_cast<int>(layers_.size()),
            "Decoder::cached: no layer " + std::to_string(layer));
  return layers_[layer]->cached();
}

void Decoder::reset() {
  for (auto& layer : layers_) layer->reset();
  position_ = 0;
}

const std::vector<double>& Decoder::step(uint32_t token) {
  const ModelConfig& c = model_.config();
  if (token >= static_cast<uint32_t>(c.vocab_size))
    throw InputError("token id " + std::to_string(token) + " is outside the vocabulary [0, " +
                     std::to_string(c.vocab_size) + ")");
  if (position_ >= env_->max_len)
    throw InputError("the sequence would exceed max_position_embeddings = " +
                     std::to_string(env_->max_len) + " tokens");
  const int32_t id = static_cast<int32_t>(token), pos = static_cast<int32_t>(position_);
  copy_from_host(ids_, &id);
  copy_from_host(pos_, &pos);

  const ParamTable& t = model_.table();
  embedding_forward(ctx_, stream_a_, ids_, model_.param(t.find("model.embed_tokens.weight")));
  Tensor x = stream_a_, out = stream_b_;
  for (auto& layer : layers_) {
    layer->forward(ctx_, out, x, pos_);
    std::swap(x, out);
  }
  const auto& head = t.find(c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
  rmsnorm_forward(ctx_, xf_, rstdf_, x, model_.param(t.find("model.norm.weight")), c.rms_norm_eps);
  linear_forward(ctx_, logits_, xf_, model_.param(head), false);
  ++position_;

  if (logits_.dtype == DType::f64) {
    copy_to_host(host_logits_.data(), logits_);
  } else {
    host_logits_f32_.resize(host_logits_.size());
    copy_to_host(host_logits_f32_.data(), logits_);
    std::copy(host_logits_f32_.begin(), host_logits_f32_.end(), host_logits_.begin());
  }
  return host_logits_;
}

// ---- choosing a token ---------------------------------------------------------------------------

namespace {

// Lowest id among the largest logits.
uint32_t argmax(const std::vector<double>& logits) {
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  return static_cast<uint32_t>(best);
}

// The ids a draw may pick: all of them in id order, or by (logit desc, id asc) the top_k of them
// when top_k cuts, all of them when `ranked` (top-p needs the order).
std::vector<uint32_t> candidates(const std::vector<double>& logits, int top_k, bool ranked) {
  std::vector<uint32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0u);
  const bool cut = top_k > 0 && static_cast<size_t>(top_k) < ids.size();
  if (!cut && !ranked) return ids;
  const size_t k = cut ? static_cast<size_t>(top_k) : ids.size();
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(),
                    [&](uint32_t a, uint32_t b) {
                      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                    });
  ids.resize(k);
  return ids;
}

}  // namespace

uint32_t sample_token(const std::vector<double>& logits, double temperature, int top_k,
                      double top_p, Rng& rng) {
  MOE_CHECK(!logits.empty(), "sample_token: no logits");
  // (Before the ranking: a NaN breaks the sort's ordering.)
  MOE_CHECK(std::none_of(logits.begin(), logits.end(), [](double l) { return std::isnan(l); }),
            "sample_token: the logits hold a NaN");
  if (temperature == 0) return argmax(logits);
  const bool nucleus = top_p < 1;
  std::vector<uint32_t> ids = candidates(logits, top_k, nucleus);
  double max_l = -std::numeric_limits<double>::infinity();
  for (uint32_t i : ids) max_l = std::max(max_l, logits[i]);
  // Shift before dividing: a tiny temperature then sends the others to exp(-inf) = 0, not NaN.
  std::vector<double> weight(ids.size());
  double sum = 0;
  for (size_t j = 0; j < ids.size(); ++j)
    sum += weight[j] = std::exp((logits[ids[j]] - max_l) / temperature);
  MOE_CHECK(std::isfinite(sum) && sum > 0, "sample_token: the logits are not finite");
  if (nucleus) {
    // The most likely tokens whose probabilities (after temperature and top_k) first reach
    // top_p; ids are in that order, so the nucleus is a prefix. At least one token stays.
    double kept = 0;
    size_t n = 0;
    while (n < ids.size() && (n == 0 || kept < top_p * sum)) kept += weight[n++];
    ids.resize(n);
    weight.resize(n);
    sum = kept;
  }
  const double u = rng.uniform() * sum;
  double acc = 0;
  for (size_t j = 0; j < ids.size(); ++j) {
    acc += weight[j];
    if (u < acc) return ids[j];
  }
  // Rounding can leave u a hair above the running sum: take the last token with any weight.
  for (size_t j = ids.size(); j-- > 0;)
    if (weight[j] > 0) return ids[j];
  return ids.back();
}

// ---- generate -----------------------------------------------------------------------------------

namespace {

void check_sample_input(const ModelConfig& c, const std::vector<uint32_t>& prompt,
                        const SampleOptions& opt) {
  if (prompt.empty()) throw InputError("sample: the prompt is empty (give at least one token)");
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] >= static_cast<uint32_t>(c.vocab_size))
      throw InputError("sample: prompt token " + std::to_string(prompt[i]) + " at position " +
                       std::to_string(i) + " is outside the vocabulary [0, " +
                       std::to_string(c.vocab_size) + ")");
  if (opt.max_new_tokens < 0)
    throw InputError("sample: max_new_tokens must be >= 0, got " +
                     std::to_string(opt.max_new_tokens));
  if (!(opt.temperature >= 0) || !std::isfinite(opt.temperature))
    throw InputError("sample: temperature must be a finite number >= 0, got " +
                     shown(opt.temperature));
  if (opt.top_k < 0)
    throw InputError("sample: top_k must be >= 0 (0 = all tokens), got " +
                     std::to_string(opt.top_k));
  if (!(opt.top_p > 0 && opt.top_p <= 1))
    throw InputError("sample: top_p must be in (0, 1] (1 = no nucleus cut), got " +
                     shown(opt.top_p));
  if (opt.vocab_limit < 0)
    throw InputError("sample: vocab_limit must be >= 0 (0 = the model's vocabulary), got " +
                     std::to_string(opt.vocab_limit));
  if (opt.eos_id >= c.vocab_size)
    throw InputError("sample: eos_id " + std::to_string(opt.eos_id) +
                     " is outside the vocabulary [0, " + std::to_string(c.vocab_size) + ")");
  const int64_t total = static_cast<int64_t>(prompt.size()) + opt.max_new_tokens;
  if (total > c.max_position_embeddings)
    throw InputError(
        "sample: " + std::to_string(prompt.size()) + " prompt tokens + " +
        std::to_string(opt.max_new_tokens) + " new tokens = " + std::to_string(total) +
        " exceed max_position_embeddings = " + std::to_string(c.max_position_embeddings));
}

}  // namespace

std::vector<uint32_t> generate(const Model& model, const std::vector<uint32_t>& prompt,
                               const SampleOptions& opt) {
  check_sample_input(model.config(), prompt, opt);
  Decoder decoder(model);
  Rng rng(opt.seed);
  const std::vector<double>* logits = nullptr;
  for (uint32_t token : prompt) logits = &decoder.step(token);
  std::vector<uint32_t> out;
  out.reserve(static_cast<size_t>(opt.max_new_tokens));
  const auto vocab = static_cast<size_t>(model.config().vocab_size);
  const size_t drawable =
      opt.vocab_limit > 0 ? std::min(vocab, static_cast<size_t>(opt.vocab_limit)) : vocab;
  std::vector<double> head;  // the drawable logits, when fewer than the model's
  for (int i = 0; i < opt.max_new_tokens; ++i) {
    if (drawable < vocab) head.assign(logits->begin(), logits->begin() + drawable);
    const uint32_t next =
        sample_token(drawable < vocab ? head : *logits, opt.temperature, opt.top_k, opt.top_p, rng);
    out.push_back(next);
    if (opt.eos_id >= 0 && next == static_cast<uint64_t>(opt.eos_id)) break;
    if (i + 1 < opt.max_new_tokens) logits = &decoder.step(next);  // the last one needs no logits
  }
  return out;
}

}  // namespace moe
