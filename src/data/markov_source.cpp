// The synthetic order-2 Markov source and the exact entropy of what it emits.
#include <algorithm>
#include <cmath>

#include "moe/data.hpp"
#include "moe/error.hpp"

namespace moe {

MarkovSource::MarkovSource(int vocab, int branching, uint64_t chain_seed)
    : vocab_(vocab), branching_(branching) {
  MOE_CHECK(vocab >= 2 && branching >= 1 && branching <= vocab, "MarkovSource: bad sizes");
  const size_t contexts = static_cast<size_t>(vocab) * vocab;
  next_token_.resize(contexts * branching);
  next_prob_.resize(contexts * branching);
  Rng rng(chain_seed);
  std::vector<int32_t> pool(vocab);
  for (size_t c = 0; c < contexts; ++c) {
    // distinct next tokens: a partial Fisher-Yates shuffle
    for (int i = 0; i < vocab; ++i) pool[i] = i;
    double total = 0;
    for (int j = 0; j < branching; ++j) {
      int pick = j + static_cast<int>(rng.below(vocab - j));
      std::swap(pool[j], pool[pick]);
      next_token_[c * branching + j] = pool[j];
      // Dirichlet(1) weights squared: skewed, so the chain is clearly better than uniform
      double w = -std::log(1.0 - rng.uniform());
      next_prob_[c * branching + j] = w * w;
      total += w * w;
    }
    for (int j = 0; j < branching; ++j) next_prob_[c * branching + j] /= total;
  }
  compute_stationary();
}

// Power iteration on the distribution over contexts (a, b) -> (b, c), from uniform; mixed with
// a small restart so the limit exists even for periodic chains. Then the exact entropies.
void MarkovSource::compute_stationary() {
  const size_t contexts = static_cast<size_t>(vocab_) * vocab_;
  std::vector<double> pi(contexts, 1.0 / static_cast<double>(contexts)), next(contexts);
  for (int iter = 0; iter < 2000; ++iter) {
    std::fill(next.begin(), next.end(), 0.0);
    for (int a = 0; a < vocab_; ++a)
      for (int b = 0; b < vocab_; ++b) {
        const double p = pi[static_cast<size_t>(a) * vocab_ + b];
        if (p == 0) continue;
        for (int j = 0; j < branching_; ++j) {
          const int i = next_index(a, b) + j;
          next[static_cast<size_t>(b) * vocab_ + next_token_[i]] += p * next_prob_[i];
        }
      }
    double diff = 0;
    for (size_t c = 0; c < contexts; ++c) {
      next[c] = 0.5 * next[c] + 0.5 * pi[c];  // lazy chain: same stationary law, aperiodic
      diff += std::fabs(next[c] - pi[c]);
    }
    pi.swap(next);
    if (diff < 1e-13) break;
  }
  stationary_ = pi;
  stationary_cdf_.resize(contexts);
  double acc = 0;
  for (size_t c = 0; c < contexts; ++c) stationary_cdf_[c] = (acc += pi[c]);

  // H(next | a, b) averaged over pi
  entropy_rate_ = 0;
  for (size_t c = 0; c < contexts; ++c)
    for (int j = 0; j < branching_; ++j) {
      const double p = next_prob_[c * branching_ + j];
      if (p > 0) entropy_rate_ -= pi[c] * p * std::log(p);
    }
  // H(b | a) with (a, b) ~ pi: the first target of a row sees one token of context
  std::vector<double> marg_a(vocab_, 0.0);
  for (int a = 0; a < vocab_; ++a)
    for (int b = 0; b < vocab_; ++b) marg_a[a] += pi[static_cast<size_t>(a) * vocab_ + b];
  first_entropy_ = 0;
  for (int a = 0; a < vocab_; ++a)
    for (int b = 0; b < vocab_; ++b) {
      const double joint = pi[static_cast<size_t>(a) * vocab_ + b];
      if (joint > 0) first_entropy_ -= joint * std::log(joint / marg_a[a]);
    }
}

double MarkovSource::optimal_loss(int seq_len) const {
  return (first_entropy_ + (seq_len - 1) * entropy_rate_) / seq_len;
}

int MarkovSource::sample_next(Rng& rng, int a, int b) const {
  double u = rng.uniform();
  const int base = next_index(a, b);
  for (int j = 0; j < branching_ - 1; ++j) {
    u -= next_prob_[base + j];
    if (u < 0) return next_token_[base + j];
  }
  return next_token_[base + branching_ - 1];
}

void MarkovSource::sample(Rng& rng, int batch, int seq_len, int32_t* ids, int32_t* targets) const {
  for (int r = 0; r < batch; ++r) {
    const double u = rng.uniform();
    size_t c = static_cast<size_t>(
        std::lower_bound(stationary_cdf_.begin(), stationary_cdf_.end(), u) -
        stationary_cdf_.begin());
    c = std::min(c, stationary_cdf_.size() - 1);
    int a = static_cast<int>(c / vocab_), b = static_cast<int>(c % vocab_);
    int32_t* row_ids = ids + static_cast<size_t>(r) * seq_len;
    int32_t* row_tgt = targets + static_cast<size_t>(r) * seq_len;
    row_ids[0] = a;
    row_tgt[0] = b;
    for (int t = 1; t < seq_len; ++t) {
      row_ids[t] = b;
      const int next = sample_next(rng, a, b);
      row_tgt[t] = next;
      a = b;
      b = next;
    }
  }
}

}  // namespace moe
