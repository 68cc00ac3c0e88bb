// Tests of the autoregressive Decoder and of sampling. The Decoder must compute the training
// model's function token by token, so its logits at every position are checked against
// Model::logits() of one forward over the whole sequence (f64, to 1e-10):
//   - without MoD: dense + MoE layers, shared experts, GQA, tied and untied embeddings,
//     unnormalised top-K, aux-loss-free router biases, and an f32 model (to 1e-4);
//   - with MoD where the causal predictor and training's top-C selection provably agree:
//     keep-all (capacity 1; fc1 rows in pairs (u, -u) and fc2 = +1 give the predictor logit
//     sum_j a_j tanh(a_j / 2) > 0 for a_j = u_j . x), and keep-some (fc1 = [w_r; -w_r],
//     fc2 = [1, -1] make the predictor logit silu(r) - silu(-r) = r, so it keeps exactly the
//     tokens with r > 0; the capacity is set to their count, so top-C keeps the same ones);
//   - with MoD where the predictor rejects every token (fc2 = -1): the MoD layers are the
//     identity, checked against a model made of the other layers alone.
// Then sampling: a seed fixes the tokens and other seeds change them, greedy is the argmax of the
// Decoder's logits, top_k = 1 is greedy, top_k limits the draws, eos stops, the draw frequencies
// follow softmax(logits / temperature), and the input errors.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "catch.hpp"
#include "moe/model.hpp"
#include "moe/rng.hpp"
#include "moe/sampler.hpp"
#include "test_util.hpp"

using namespace moe;

namespace {

constexpr int kSeqLen = 12;

// 4 layers (MoE at 1 and 3, dense at 0 and 2), GQA 4:2, one shared expert; no MoD.
ModelConfig base_config() {
  ModelConfig m;
  m.vocab_size = 13;
  m.hidden_size = 8;
  m.intermediate_size = 6;
  m.dense_intermediate_size = 5;
  m.num_hidden_layers = 4;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.max_position_embeddings = 16;
  m.rope_theta = 100.0;
  m.num_local_experts = 4;
  m.num_experts_per_tok = 2;
  m.num_shared_experts = 1;
  m.shared_expert_intermediate_size = 3;
  m.moe_layer_freq = 2;
  m.mod.predictor_hidden_size = 4;
  m.initializer_range = 0.5;  // large weights: attention and routing are far from uniform
  return m;
}

std::unique_ptr<Model> make_model(const ModelConfig& cfg, DType dtype, uint64_t seed) {
  auto model = std::make_unique<Model>(cfg, dtype, Device{}, 1, kSeqLen);
  model->init_weights(seed);
  return model;
}

std::vector<uint32_t> random_ids(int n, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<uint32_t>(rng.below(static_cast<uint64_t>(vocab)));
  return ids;
}

// Model::logits() after one forward over ids: [T * V] as doubles.
std::vector<double> forward_logits(Model& model, const std::vector<uint32_t>& ids) {
  std::vector<int32_t> in(ids.begin(), ids.end()), targets(ids.size(), 0);
  Ctx ctx;
  model.forward(ctx, in.data(), targets.data());
  const Tensor l = model.logits();
  if (l.dtype == DType::f64)
    return std::vector<double>(l.ptr<double>(), l.ptr<double>() + l.numel());
  return std::vector<double>(l.ptr<float>(), l.ptr<float>() + l.numel());
}

// The Decoder's logits after each token of ids: [T * V].
std::vector<double> decoder_logits(Decoder& decoder, const std::vector<uint32_t>& ids) {
  std::vector<double> out;
  for (uint32_t id : ids) {
    const std::vector<double>& l = decoder.step(id);
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}

double* param_f64(Model& model, const std::string& name) {
  return model.param(model.table().find(name)).ptr<double>();
}

// Checks the decoder against the full forward on a random sequence; returns the decoder's
// logits.
std::vector<double> check_against_forward(Model& model, double tol, uint64_t seed = 7) {
  const auto ids = random_ids(kSeqLen, model.config().vocab_size, seed);
  const std::vector<double> want = forward_logits(model, ids);
  Decoder decoder(model);
  const std::vector<double> got = decoder_logits(decoder, ids);
  CHECK(max_abs_diff(got, want) < tol);
  CHECK(decoder.position() == kSeqLen);
  return got;
}

// Sets every MoD layer's predictor: fc1 rows (u_0, -u_0, u_1, -u_1) with random u, fc2 = sign.
void set_pair_predictors(Model& model, double sign) {
  const ModelConfig& c = model.config();
  Rng rng(99);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.is_mod_layer(l)) continue;
    const std::string p = "model.layers." + std::to_string(l) + ".mod.predictor.";
    double* fc1 = param_f64(model, p + "fc1.weight");  // [P, d]
    double* fc2 = param_f64(model, p + "fc2.weight");  // [1, P]
    const int64_t d = c.hidden_size, hidden = c.mod.predictor_hidden_size;
    for (int64_t j = 0; j < hidden; j += 2)
      for (int64_t i = 0; i < d; ++i) {
        fc1[j * d + i] = rng.normal();
        fc1[(j + 1) * d + i] = -fc1[j * d + i];
      }
    for (int64_t j = 0; j < hidden; ++j) fc2[j] = sign;
  }
}

// Makes layer l's predictor logit silu(r) - silu(-r) = r, r = x w_r its MoD router score:
// fc1 = [w_r; -w_r; 0; 0], fc2 = [1, -1, 0, 0].
void set_router_predictor(Model& model, int l) {
  const int64_t d = model.config().hidden_size, hidden = model.config().mod.predictor_hidden_size;
  const std::string p = "model.layers." + std::to_string(l) + ".mod.";
  const double* router = param_f64(model, p + "router.weight");
  double* fc1 = param_f64(model, p + "predictor.fc1.weight");
  double* fc2 = param_f64(model, p + "predictor.fc2.weight");
  std::fill(fc1, fc1 + hidden * d, 0.0);
  std::fill(fc2, fc2 + hidden, 0.0);
  for (int64_t i = 0; i < d; ++i) {
    fc1[i] = router[i];
    fc1[d + i] = -router[i];
  }
  fc2[0] = 1.0;
  fc2[1] = -1.0;
}

// The message of the InputError fn throws ("" when it throws none).
template <class Fn>
std::string input_error(Fn&& fn) {
  try {
    fn();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// ---- the Decoder computes the training model's function -----------------------------------------

TEST_CASE("decoder logits equal the full forward without MoD", "[sampler]") {
  ModelConfig cfg = base_config();
  SECTION("untied embeddings") {}
  SECTION("tied embeddings") {
    cfg.tie_word_embeddings = true;
  }
  SECTION("unnormalised top-K, two shared experts, MHA") {
    cfg.norm_topk_prob = false;
    cfg.num_shared_experts = 2;
    cfg.num_key_value_heads = 4;
  }
  SECTION("every layer MoE, one kv head") {
    cfg.moe_layer_freq = 1;
    cfg.num_key_value_heads = 1;
  }
  auto model = make_model(cfg, DType::f64, 3);
  check_against_forward(*model, 1e-10);
}

TEST_CASE("decoder routes with the aux-loss-free router biases", "[sampler]") {
  ModelConfig cfg = base_config();
  cfg.router_bias_update_rate = 0.01;
  auto model = make_model(cfg, DType::f64, 4);
  // Biases as large as the router logits, so they change which experts are picked.
  Rng rng(5);
  for (Tensor bias : model->router_biases()) {
    double* b = bias.ptr<double>();
    for (int64_t e = 0; e < bias.numel(); ++e) b[e] = 2.0 * rng.normal();
  }
  const std::vector<double> with_bias = check_against_forward(*model, 1e-10);
  // And the biases matter: without them the logits differ.
  for (Tensor bias : model->router_biases())
    std::fill(bias.ptr<double>(), bias.ptr<double>() + bias.numel(), 0.0);
  Decoder plain(*model);
  CHECK(max_abs_diff(decoder_logits(plain, random_ids(kSeqLen, cfg.vocab_size, 7)), with_bias) >
        1e-3);
}

TEST_CASE("decoder logits of an f32 model equal the full forward to f32 rounding", "[sampler]") {
  auto model = make_model(base_config(), DType::f32, 6);
  check_against_forward(*model, 1e-4);
}

TEST_CASE("decoder reset starts the sequence over", "[sampler]") {
  auto model = make_model(base_config(), DType::f64, 8);
  const auto ids = random_ids(kSeqLen, model->config().vocab_size, 9);
  Decoder decoder(*model);
  const std::vector<double> first = decoder_logits(decoder, ids);
  decoder.reset();
  CHECK(decoder.position() == 0);
  CHECK(decoder.cached(0) == 0);
  CHECK(decoder_logits(decoder, ids) == first);
}

// ---- Mixture-of-Depths --------------------------------------------------------------------------

TEST_CASE("decoder equals the full forward when the predictor keeps every token",
          "[sampler][mod]") {
  // 6 layers: MoE at 1, 3, 5; MoD at 2 (over a dense block) and 5 (over a MoE block).
  ModelConfig cfg = base_config();
  cfg.num_hidden_layers = 6;
  cfg.mod.enabled = true;
  cfg.mod.every = 3;
  cfg.mod.capacity = 1.0;  // training keeps every token too
  auto model = make_model(cfg, DType::f64, 10);
  set_pair_predictors(*model, +1.0);
  const auto ids = random_ids(kSeqLen, cfg.vocab_size, 11);
  const std::vector<double> want = forward_logits(*model, ids);
  Decoder decoder(*model);
  CHECK(max_abs_diff(decoder_logits(decoder, ids), want) < 1e-10);
  for (int l = 0; l < cfg.num_hidden_layers; ++l) CHECK(decoder.cached(l) == kSeqLen);
}

TEST_CASE("decoder equals the full forward when predictor and top-C keep the same tokens",
          "[sampler][mod]") {
  // 3 layers: MoD at 1 (over a MoE block), then a dense block that sees the mixed stream.
  ModelConfig cfg = base_config();
  cfg.num_hidden_layers = 3;
  cfg.moe_layer_freq = 2;
  cfg.mod.enabled = true;
  cfg.mod.every = 2;
  cfg.mod.capacity = 1.0;
  const int mod_layer = 1;
  const auto ids = random_ids(kSeqLen, cfg.vocab_size, 12);
  // Predictor logit = silu(r) - silu(-r) = r: keep exactly the tokens with r = x w_r > 0. The
  // first weight seed that keeps a real subset (neither almost none nor almost all) is used.
  std::unique_ptr<Model> probe;
  std::unique_ptr<Decoder> decoder;
  std::vector<double> got;
  int64_t kept = 0;
  for (uint64_t seed = 13; seed < 40 && (kept < 3 || kept > kSeqLen - 3); ++seed) {
    probe = make_model(cfg, DType::f64, seed);
    set_router_predictor(*probe, mod_layer);
    decoder = std::make_unique<Decoder>(*probe);
    got = decoder_logits(*decoder, ids);
    kept = decoder->cached(mod_layer);
  }
  INFO("tokens with r > 0: " << kept);
  REQUIRE(kept >= 3);
  REQUIRE(kept <= kSeqLen - 3);
  // The same weights in a model whose top-C keeps `kept` tokens: the ones with the largest r.
  cfg.mod.capacity = static_cast<double>(kept) / kSeqLen;
  auto model = std::make_unique<Model>(cfg, DType::f64, Device{}, 1, kSeqLen);
  std::memcpy(model->params().data, probe->params().data, probe->params().nbytes());
  CHECK(max_abs_diff(got, forward_logits(*model, ids)) < 1e-10);
  CHECK(decoder->cached(0) == kSeqLen);
  CHECK(decoder->cached(2) == kSeqLen);
}

TEST_CASE("MoD layers are the identity when the predictor rejects every token", "[sampler][mod]") {
  // 4 MoE layers with MoD at 1 and 3; rejecting both leaves layers 0 and 2.
  ModelConfig cfg = base_config();
  cfg.moe_layer_freq = 1;
  cfg.mod.enabled = true;
  cfg.mod.every = 2;
  auto model = make_model(cfg, DType::f64, 14);
  set_pair_predictors(*model, -1.0);
  // The reference: a 2-layer model without MoD holding layers 0 and 2 as its layers 0 and 1.
  ModelConfig ref_cfg = cfg;
  ref_cfg.num_hidden_layers = 2;
  ref_cfg.mod.enabled = false;
  Model ref(ref_cfg, DType::f64, Device{}, 1, kSeqLen);
  for (const ParamInfo& info : ref.table().params) {
    std::string name = info.name;
    const std::string from = "model.layers.1.";
    if (name.compare(0, from.size(), from) == 0)
      name = "model.layers.2." + name.substr(from.size());
    const Tensor src = model->param(model->table().find(name));
    const Tensor dst = ref.param(info);
    REQUIRE(src.nbytes() == dst.nbytes());
    std::memcpy(dst.data, src.data, src.nbytes());
  }
  const auto ids = random_ids(kSeqLen, cfg.vocab_size, 15);
  Decoder decoder(*model);
  CHECK(max_abs_diff(decoder_logits(decoder, ids), forward_logits(ref, ids)) < 1e-10);
  CHECK(decoder.cached(0) == kSeqLen);
  CHECK(decoder.cached(1) == 0);
  CHECK(decoder.cached(2) == kSeqLen);
  CHECK(decoder.cached(3) == 0);
}

// ---- sampling -----------------------------------------------------------------------------------

TEST_CASE("generate is deterministic for a seed and differs across seeds", "[sampler][generate]") {
  auto model = make_model(base_config(), DType::f64, 20);
  const std::vector<uint32_t> prompt{1, 2, 3};
  SampleOptions opt;
  opt.max_new_tokens = 12;
  opt.seed = 42;
  const std::vector<uint32_t> a = generate(*model, prompt, opt);
  CHECK(a.size() == 12);
  CHECK(generate(*model, prompt, opt) == a);
  int differing = 0;
  for (uint64_t seed = 0; seed < 5; ++seed) {
    opt.seed = seed;
    differing += generate(*model, prompt, opt) != a ? 1 : 0;
  }
  CHECK(differing == 5);
}

TEST_CASE("greedy generation follows the argmax of the decoder's logits", "[sampler][generate]") {
  auto model = make_model(base_config(), DType::f64, 21);
  const std::vector<uint32_t> prompt{4, 0, 7, 7};
  SampleOptions greedy;
  greedy.max_new_tokens = 10;
  greedy.temperature = 0;
  const std::vector<uint32_t> tokens = generate(*model, prompt, greedy);
  REQUIRE(tokens.size() == 10);
  // Replay: feed the prompt, then each generated token; each must be the argmax so far.
  Decoder decoder(*model);
  const std::vector<double>* logits = nullptr;
  for (uint32_t t : prompt) logits = &decoder.step(t);
  for (uint32_t t : tokens) {
    const auto best = std::max_element(logits->begin(), logits->end()) - logits->begin();
    CHECK(t == static_cast<uint32_t>(best));
    logits = &decoder.step(t);
  }
  SECTION("top_k = 1 at temperature 1 is greedy") {
    SampleOptions top1;
    top1.max_new_tokens = 10;
    top1.top_k = 1;
    top1.seed = 3;
    CHECK(generate(*model, prompt, top1) == tokens);
  }
  SECTION("generation stops after eos_id") {
    greedy.eos_id = tokens[2];
    const std::vector<uint32_t> stopped = generate(*model, prompt, greedy);
    CHECK(stopped.back() == tokens[2]);
    CHECK(stopped.size() <= 3);
    CHECK(std::vector<uint32_t>(tokens.begin(), tokens.begin() + stopped.size()) == stopped);
  }
  SECTION("zero new tokens") {
    greedy.max_new_tokens = 0;
    CHECK(generate(*model, prompt, greedy).empty());
  }
}

TEST_CASE("top_k limits each draw to the k most likely tokens", "[sampler][generate]") {
  auto model = make_model(base_config(), DType::f64, 22);
  const std::vector<uint32_t> prompt{5};
  SampleOptions opt;
  opt.max_new_tokens = 14;
  opt.top_k = 2;
  opt.temperature = 3.0;  // flat enough that the second choice is drawn too
  for (uint64_t seed = 0; seed < 4; ++seed) {
    opt.seed = seed;
    const std::vector<uint32_t> tokens = generate(*model, prompt, opt);
    Decoder decoder(*model);
    const std::vector<double>* logits = &decoder.step(prompt[0]);
    for (uint32_t t : tokens) {
      int above = 0;  // tokens strictly more likely than t
      for (double l : *logits) above += l > (*logits)[t] ? 1 : 0;
      CHECK(above < 2);
      logits = &decoder.step(t);
    }
  }
}

TEST_CASE("vocab_limit keeps every draw below the tokenizer's vocabulary", "[sampler][generate]") {
  // A model trained with a vocab_size padded past its tokenizer's: the extra ids have no text.
  auto model = make_model(base_config(), DType::f64, 23);
  const std::vector<uint32_t> prompt{5};
  SampleOptions opt;
  opt.max_new_tokens = 14;
  opt.temperature = 50.0;  // near uniform: without the limit, high ids come up
  opt.vocab_limit = 3;
  for (uint64_t seed = 0; seed < 4; ++seed) {
    opt.seed = seed;
    for (uint32_t t : generate(*model, prompt, opt)) CHECK(t < 3);
  }
  // Above the model's vocabulary: no limit, the same draws as without one.
  opt.vocab_limit = 1000;
  const std::vector<uint32_t> above = generate(*model, prompt, opt);
  opt.vocab_limit = 0;
  CHECK(above == generate(*model, prompt, opt));
  CHECK(above.size() == 14);
}

TEST_CASE("sample_token draws from softmax(logits / temperature)", "[sampler]") {
  const std::vector<double> logits{0.0, std::log(3.0), -1e300};
  const int draws = 20000;
  for (double temperature : {1.0, 0.5}) {
    Rng rng(1);
    int ones = 0, twos = 0;
    for (int i = 0; i < draws; ++i) {
      const uint32_t t = sample_token(logits, temperature, 0, 1.0, rng);
      ones += t == 1 ? 1 : 0;
      twos += t == 2 ? 1 : 0;
    }
    // p(1) = 3^(1/T) / (1 + 3^(1/T)): 0.75 at T = 1, 0.9 at T = 0.5; 4 sigma ~ 0.012.
    const double p1 = std::pow(3.0, 1 / temperature) / (1 + std::pow(3.0, 1 / temperature));
    CHECK(std::fabs(static_cast<double>(ones) / draws - p1) < 0.013);
    CHECK(twos == 0);
  }
  Rng rng(2);
  CHECK(sample_token({1.0, 2.0, 2.0, 0.5}, 0.0, 0, 1.0, rng) == 1);  // greedy ties: lowest id
  CHECK(sample_token({1.0, 2.0, 2.0, 0.5}, 1.0, 1, 1.0, rng) == 1);  // top-1 ties: lowest id
  CHECK(sample_token({0.0, 1.0}, 1e-300, 0, 1.0, rng) == 1);         // tiny temperature: no NaN
  // A NaN logit is refused before any ranking (its comparisons break the sort's ordering).
  for (double top_p : {1.0, 0.9})
    CHECK_THROWS(sample_token({0.0, std::nan(""), 1.0}, 1.0, 2, top_p, rng));
}

TEST_CASE("top_p draws from the smallest most likely set that reaches it", "[sampler]") {
  // Probabilities 0.05, 0.5, 0.15, 0.3 (ids out of rank order, so the nucleus is no id prefix).
  const std::vector<double> logits{std::log(0.05), std::log(0.5), std::log(0.15), std::log(0.3)};
  const int draws = 20000;
  const auto frequencies = [&](double top_p, int top_k, uint64_t seed) {
    Rng rng(seed);
    std::vector<int> count(4, 0);
    for (int i = 0; i < draws; ++i) ++count[sample_token(logits, 1.0, top_k, top_p, rng)];
    std::vector<double> f(4);
    for (int i = 0; i < 4; ++i) f[i] = static_cast<double>(count[i]) / draws;
    return f;
  };
  // 0.5 + 0.3 = 0.8 >= 0.75: ids 1 and 3, renormalised to 0.625 / 0.375 (4 sigma ~ 0.014).
  std::vector<double> f = frequencies(0.75, 0, 1);
  CHECK(std::fabs(f[1] - 0.625) < 0.015);
  CHECK(std::fabs(f[3] - 0.375) < 0.015);
  CHECK(f[0] == 0);
  CHECK(f[2] == 0);
  // 0.95 < 0.96: all four; at 0.9 the least likely (id 0) is left out.
  f = frequencies(0.96, 0, 2);
  CHECK(f[0] > 0.03);
  f = frequencies(0.9, 0, 3);
  CHECK(f[0] == 0);
  CHECK(std::fabs(f[2] - 0.15 / 0.95) < 0.015);
  // Below the top token's own mass: that token alone.
  CHECK(frequencies(0.3, 0, 4)[1] == 1.0);
  // After top_k = 2 the mass is of the two kept (0.625 / 0.375): 0.7 keeps both, 0.6 one.
  f = frequencies(0.7, 2, 5);
  CHECK(std::fabs(f[3] - 0.375) < 0.015);
  CHECK(frequencies(0.6, 2, 6)[1] == 1.0);
  // Temperature comes first: at T = 0.25 id 1 holds 0.5^4 / (0.5^4 + 0.3^4 + ...) = 0.879 > 0.85.
  Rng rng(7);
  for (int i = 0; i < 200; ++i) CHECK(sample_token(logits, 0.25, 0, 0.85, rng) == 1);
}

TEST_CASE("sampling rejects bad input with InputError", "[sampler][errors]") {
  auto model = make_model(base_config(), DType::f64, 23);  // vocab 13, max positions 16
  SampleOptions opt;
  opt.max_new_tokens = 4;
  CHECK(input_error([&] { generate(*model, {}, opt); }).find("empty") != std::string::npos);
  const std::string vocab = input_error([&] { generate(*model, {1, 13}, opt); });
  CHECK(vocab.find("13") != std::string::npos);
  CHECK(vocab.find("vocabulary") != std::string::npos);
  opt.max_new_tokens = 7;
  const std::string long_msg =
      input_error([&] { generate(*model, std::vector<uint32_t>(10, 1), opt); });
  CHECK(long_msg.find("max_position_embeddings") != std::string::npos);
  opt.max_new_tokens = 6;  // 10 + 6 = 16 fits exactly
  CHECK(generate(*model, std::vector<uint32_t>(10, 1), opt).size() == 6);

  SampleOptions bad;
  bad.max_new_tokens = -1;
  CHECK(input_error([&] { generate(*model, {1}, bad); }).find("max_new_tokens") !=
        std::string::npos);
  bad = SampleOptions{};
  bad.temperature = -0.5;
  CHECK(input_error([&] { generate(*model, {1}, bad); }).find("temperature") != std::string::npos);
  bad = SampleOptions{};
  bad.top_k = -2;
  CHECK(input_error([&] { generate(*model, {1}, bad); }).find("top_k") != std::string::npos);
  for (double top_p : {0.0, -0.1, 1.5, std::nan("")}) {
    bad = SampleOptions{};
    bad.top_p = top_p;
    CHECK(input_error([&] { generate(*model, {1}, bad); }).find("top_p") != std::string::npos);
  }
  bad = SampleOptions{};
  bad.eos_id = 99;
  CHECK(input_error([&] { generate(*model, {1}, bad); }).find("eos_id") != std::string::npos);

  Decoder decoder(*model);
  CHECK(input_error([&] { decoder.step(20); }).find("vocabulary") != std::string::npos);
  for (int i = 0; i < 16; ++i) decoder.step(1);
  CHECK(input_error([&] { decoder.step(1); }).find("max_position_embeddings") != std::string::npos);
}
