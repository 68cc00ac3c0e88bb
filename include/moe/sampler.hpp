// Autoregressive sampling from a trained Model: a Decoder that runs the model one token at a time
// over per-layer key/value caches, and generate(), which feeds a prompt and then draws new tokens
// (greedy, or temperature, top-k and top-p sampling from a seeded Rng, so a seed fixes the
// output).
//
// The Decoder computes the training model's function for each new token, reading the Model's
// parameters in place (and its aux-loss-free router biases when router_bias_update_rate > 0), so
// it must not outlive the Model. Mixture-of-Depths layers cannot use training's top-C selection,
// which needs the scores of future tokens; at sampling time each MoD layer keeps a token when its
// causal predictor says p > 0.5 (MODEL_SPEC), and that layer's cache holds only its kept tokens,
// each rotated at its original position. Without MoD (or where predictor and selection agree) the
// logits equal Model::logits() of a forward over the same tokens.
//
// Batch 1, forward only (no gradients). Every buffer, caches included (max_position_embeddings
// entries per layer), is allocated when the Decoder is built; a token allocates nothing on the
// device.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "moe/memory.hpp"
#include "moe/model.hpp"
#include "moe/rng.hpp"

namespace moe {

struct SampleOptions {
  int max_new_tokens = 64;
  double temperature = 1.0;  // 0 = greedy (argmax, ties to the lowest id)
  int top_k = 0;             // sample among the k most likely tokens; 0 = all
  double top_p = 1.0;        // then among the most likely whose mass reaches top_p; 1 = all
  uint64_t seed = 0;         // seeds the Rng of the draws
  int64_t eos_id = -1;       // >= 0: stop once this token has been generated
  // > 0: draw only ids below this, the tokenizer's vocabulary when the model's vocab_size is
  // larger (padded): the ids past it have no text. 0 = every id of the model.
  int64_t vocab_limit = 0;
};

class DecodeLayer;
struct DecodeEnv;

class Decoder {
 public:
  // Plans and allocates the caches and scratch for the model's config and dtype.
  explicit Decoder(const Model& model);
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // Feeds the token at the next position and returns the logits ([V], as doubles on the host)
  // of the token after it; the reference stays valid until the next step() or reset().
  // InputError for an id outside the vocabulary or a sequence longer than
  // max_position_embeddings.
  const std::vector<double>& step(uint32_t token);
  // Forgets the sequence: empty caches, next token at position 0.
  void reset();

  int64_t position() const { return position_; }  // tokens fed so far
  int64_t max_len() const;                        // max_position_embeddings
  // Entries in layer l's key/value cache: every token fed for a plain block, the tokens its
  // predictor kept for a MoD layer.
  int64_t cached(int layer) const;

 private:
  void plan();

  const Model& model_;
  Ctx ctx_;
  Arena acts_;
  std::unique_ptr<DecodeEnv> env_;
  std::vector<std::unique_ptr<DecodeLayer>> layers_;
  Tensor ids_, pos_;                    // [1] i32: the token and its position
  Tensor stream_a_, stream_b_;          // [1, d] residual stream ping-pong
  Tensor xf_, rstdf_, logits_;          // final norm and the [1, V] head output
  std::vector<double> host_logits_;     // [V]
  std::vector<float> host_logits_f32_;  // [V] read-back of an f32 model's logits
  int64_t position_ = 0;
};

// Picks the next token from logits [V]: temperature 0 is argmax (ties to the lowest id);
// otherwise one draw from softmax(logits / temperature) over the top_k largest logits (0 = all;
// ties ranked by lower id) and, when top_p < 1, over the fewest of those, most likely first,
// whose probabilities sum to at least top_p (nucleus sampling; at least one token), computed in
// double.
uint32_t sample_token(const std::vector<double>& logits, double temperature, int top_k,
                      double top_p, Rng& rng);

// Feeds `prompt` and samples up to opt.max_new_tokens tokens; returns the new tokens only (an
// eos_id token, when generated, is the last one returned). The same options give the same
// tokens. InputError for an empty prompt, an id outside the vocabulary, prompt plus new tokens
// longer than max_position_embeddings, a negative max_new_tokens, temperature or top_k, or a
// top_p outside (0, 1].
std::vector<uint32_t> generate(const Model& model, const std::vector<uint32_t>& prompt,
                               const SampleOptions& opt);

}  // namespace moe
