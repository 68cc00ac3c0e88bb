// Training data sources. The built-in source is a fixed random order-2 Markov chain over the
// vocabulary: learnable, seeded, and with an exactly known best achievable loss, so a training run
// can be judged against the entropy of its data.
#pragma once
#include <cstdint>
#include <vector>

#include "moe/rng.hpp"

namespace moe {

class MarkovSource {
 public:
  // Each context (a, b) moves to one of `branching` distinct next tokens with random
  // probabilities drawn from the chain seed.
  MarkovSource(int vocab, int branching, uint64_t chain_seed);

  // Fills `batch` rows of `seq_len` inputs and their next tokens (targets), each row a fresh
  // stretch of the chain started from its stationary distribution.
  void sample(Rng& rng, int batch, int seq_len, int32_t* ids, int32_t* targets) const;

  // Entropy (nats) of the next token given both previous tokens, under the stationary
  // distribution: the loss of a perfect model at every position but the first.
  double entropy_rate() const { return entropy_rate_; }
  // The best achievable mean loss over a row of `seq_len` targets (the first target is
  // predicted from one token of context only).
  double optimal_loss(int seq_len) const;

 private:
  int next_index(int a, int b) const { return (a * vocab_ + b) * branching_; }
  int sample_next(Rng& rng, int a, int b) const;
  void compute_stationary();

  int vocab_, branching_;
  std::vector<int32_t> next_token_;  // [V*V*branching]
  std::vector<double> next_prob_;    // [V*V*branching]
  std::vector<double> stationary_;   // [V*V] distribution over contexts (a, b)
  std::vector<double> stationary_cdf_;
  double entropy_rate_ = 0, first_entropy_ = 0;
};

}  // namespace moe
