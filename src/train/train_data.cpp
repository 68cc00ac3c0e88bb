// The two training data sources behind TrainData.
#include "train/train_data.hpp"

#include <cmath>
#include <filesystem>
#include <limits>
#include <vector>

#include "moe/data.hpp"
#include "moe/model.hpp"
#include "moe/shards.hpp"
#include "moe/tokenizer.hpp"

namespace moe {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Draws up to `batches` batches with `fill` and runs a forward pass over those of this rank
// (index i with i % world == rank), summing their LM losses. A ZeRO-3 forward gathers each unit
// from every rank, so there every rank runs the same number of forwards: a rank with fewer
// batches of its own repeats its last one and does not count it.
template <class Fill>
EvalSums loss_sums(Ctx& ctx, Model& model, int batches, int rank, int world, Fill&& fill) {
  const size_t n = static_cast<size_t>(model.batch()) * model.seq_len();
  std::vector<int32_t> ids(n), targets(n);
  EvalSums s;
  int drawn = 0;
  for (int i = 0; i < batches; ++i) {
    if (!fill(ids.data(), targets.data())) break;
    ++drawn;
    if (i % world != rank) continue;
    s.loss_sum += model.forward(ctx, ids.data(), targets.data()).lm;
    ++s.batches;
  }
  if (model.params_sharded())
    for (int64_t k = s.batches; k < (drawn + world - 1) / world; ++k)
      model.forward(ctx, ids.data(), targets.data());
  return s;
}

// The Markov source keeps vocab_size^2 contexts (262k at 512) and iterates over them to find its
// exact entropy; beyond this size "random" is the synthetic choice.
constexpr int kMaxSyntheticVocab = 512;

const Config& checked_for_synthetic(const Config& cfg) {
  check_data_source(cfg);
  return cfg;
}

class SyntheticData : public TrainData {
 public:
  explicit SyntheticData(const Config& cfg)
      : cfg_(checked_for_synthetic(cfg)),
        source_(cfg.model.vocab_size, cfg.data.synthetic.branching,
                static_cast<uint64_t>(cfg.data.synthetic.seed)),
        rng_(hash_name("train-rank0", cfg.train.seed)) {}  // the name of the 1-rank stream

  void next(int32_t* ids, int32_t* targets) override {
    source_.sample(rng_, cfg_.train_micro_batch_size_per_gpu, cfg_.data.seq_len, ids, targets);
  }
  void save(TrainerState& s) const override { s.rng_state = rng_.state(); }
  void restore(const TrainerState& s) override { rng_ = Rng(s.rng_state); }
  EvalSums evaluate(Ctx& ctx, Model& model, int batches, int rank, int world) override {
    Rng rng(hash_name("eval", cfg_.train.seed));  // the same held-out stream every time
    return loss_sums(ctx, model, batches, rank, world, [&](int32_t* ids, int32_t* targets) {
      source_.sample(rng, model.batch(), model.seq_len(), ids, targets);
      return true;
    });
  }
  std::string describe() const override {
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "synthetic order-2 Markov source, best achievable loss %.4f (uniform %.4f)",
                  optimal_loss(), std::log(static_cast<double>(cfg_.model.vocab_size)));
    return buf;
  }
  double optimal_loss() const override { return source_.optimal_loss(cfg_.data.seq_len); }
  std::string tokenizer_dir() const override { return ""; }

 private:
  const Config& cfg_;
  MarkovSource source_;
  Rng rng_;
};

// Independent uniform tokens: nothing to learn (the best loss is log V), no set-up cost at any
// vocabulary size; what the PyTorch peers train on when measuring speed.
class RandomData : public TrainData {
 public:
  explicit RandomData(const Config& cfg)
      : cfg_(cfg), rng_(hash_name("random-rank0", cfg.train.seed)) {}

  void next(int32_t* ids, int32_t* targets) override { sample(rng_, ids, targets); }
  void save(TrainerState& s) const override { s.rng_state = rng_.state(); }
  void restore(const TrainerState& s) override { rng_ = Rng(s.rng_state); }
  EvalSums evaluate(Ctx& ctx, Model& model, int batches, int rank, int world) override {
    Rng rng(hash_name("random-eval", cfg_.train.seed));
    return loss_sums(ctx, model, batches, rank, world, [&](int32_t* ids, int32_t* targets) {
      sample(rng, ids, targets);
      return true;
    });
  }
  std::string describe() const override { return "uniform random tokens (for benchmarks)"; }
  double optimal_loss() const override {
    return std::log(static_cast<double>(cfg_.model.vocab_size));
  }
  std::string tokenizer_dir() const override { return ""; }

 private:
  // Each row is T+1 tokens: ids = the first T, targets = the last T (next-token prediction).
  void sample(Rng& rng, int32_t* ids, int32_t* targets) const {
    const int b = cfg_.train_micro_batch_size_per_gpu, t = cfg_.data.seq_len;
    const auto v = static_cast<uint64_t>(cfg_.model.vocab_size);
    for (int r = 0; r < b; ++r) {
      int32_t prev = static_cast<int32_t>(rng.below(v));
      for (int i = 0; i < t; ++i) {
        const int32_t next = static_cast<int32_t>(rng.below(v));
        ids[r * t + i] = prev;
        targets[r * t + i] = next;
        prev = next;
      }
    }
  }

  const Config& cfg_;
  Rng rng_;
};

class ShardData : public TrainData {
 public:
  explicit ShardData(const Config& cfg)
      : cfg_(cfg),
        files_(expand_glob(cfg.data.train_files)),
        loader_(files_, cfg.data.seq_len, cfg.train_micro_batch_size_per_gpu, 0, 1, cfg.train.seed,
                cfg.data.shuffle) {
    check_vocab(loader_.max_token(), cfg.data.train_files);
    if (!cfg.data.val_files.empty()) {
      val_files_ = expand_glob(cfg.data.val_files);
      // Checked now, not at the first evaluation: the last one runs before the final checkpoint
      // is saved, so a bad held-out shard found then would cost the run's last steps.
      const SequentialReader val(val_files_, cfg.data.seq_len, cfg.train_micro_batch_size_per_gpu);
      check_vocab(val.max_token(), cfg.data.val_files);
    }
    const std::string dir = std::filesystem::path(files_.front()).parent_path().string();
    if (has_tokenizer(dir)) tokenizer_dir_ = dir;
  }

  void next(int32_t* ids, int32_t* targets) override { loader_.next(ids, targets); }
  void save(TrainerState& s) const override { s.data = loader_.position(); }
  void restore(const TrainerState& s) override { loader_.restore(s.data); }
  EvalSums evaluate(Ctx& ctx, Model& model, int batches, int rank, int world) override {
    if (val_files_.empty()) return {};
    SequentialReader reader(val_files_, model.seq_len(), model.batch());
    return loss_sums(ctx, model, batches, rank, world,
                     [&](int32_t* ids, int32_t* targets) { return reader.next(ids, targets); });
  }
  std::string describe() const override {
    return std::to_string(files_.size()) + " shard(s) " + cfg_.data.train_files + ", " +
           std::to_string(loader_.windows_per_epoch()) + " windows per epoch";
  }
  double optimal_loss() const override { return kNaN; }
  std::string tokenizer_dir() const override { return tokenizer_dir_; }

 private:
  void check_vocab(uint32_t max_token, const std::string& pattern) const {
    if (max_token >= static_cast<uint32_t>(cfg_.model.vocab_size))
      throw InputError(pattern + ": token id " + std::to_string(max_token) +
                       " does not fit model.vocab_size " + std::to_string(cfg_.model.vocab_size) +
                       " (set model.vocab_size to the tokenizer's vocabulary)");
  }

  const Config& cfg_;
  std::vector<std::string> files_, val_files_;
  ShardLoader loader_;
  std::string tokenizer_dir_;
};

}  // namespace

void check_data_source(const Config& cfg) {
  if (cfg.data.source == "synthetic" && cfg.model.vocab_size > kMaxSyntheticVocab)
    throw ConfigError("data.source",
                      "the synthetic Markov source keeps a table over vocab_size^2 contexts and "
                      "allows model.vocab_size <= " +
                          std::to_string(kMaxSyntheticVocab) + " (got " +
                          std::to_string(cfg.model.vocab_size) + "); use \"random\" or \"shards\"");
}

void check_data_files(const Config& cfg) {
  if (cfg.data.source != "shards") return;
  for (const std::string* pattern : {&cfg.data.train_files, &cfg.data.val_files})
    if (!pattern->empty())
      for (const std::string& file : expand_glob(*pattern)) const Shard opened(file);
}

std::unique_ptr<TrainData> make_train_data(const Config& cfg) {
  if (cfg.data.source == "shards") return std::make_unique<ShardData>(cfg);
  if (cfg.data.source == "random") return std::make_unique<RandomData>(cfg);
  return std::make_unique<SyntheticData>(cfg);
}

}  // namespace moe
