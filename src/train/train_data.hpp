// Where training and evaluation batches come from: the synthetic Markov source or token shards.
// Both save and restore their exact position, so a resumed run sees the same batches.
#pragma once
#include <memory>
#include <string>

#include "moe/checkpoint.hpp"
#include "moe/config.hpp"

namespace moe {

class TrainData {
 public:
  virtual ~TrainData() = default;
  virtual void next(int32_t* ids, int32_t* targets) = 0;  // [B*T] each
  virtual void save(TrainerState& s) const = 0;
  virtual void restore(const TrainerState& s) = 0;
  // Mean LM loss of `model` on held-out data (the same batches every call); NaN when there is none.
  virtual double evaluate(Ctx& ctx, Model& model, int batches) = 0;
  virtual std::string describe() const = 0;
  // The best achievable loss when known (synthetic source), else NaN.
  virtual double optimal_loss() const = 0;
  // Directory holding the tokenizer of the data ("" when none).
  virtual std::string tokenizer_dir() const = 0;
};

// Builds the source named by cfg.data for one data-parallel rank. Throws InputError when shard
// files are missing or corrupt, or hold token ids outside model.vocab_size.
std::unique_ptr<TrainData> make_train_data(const Config& cfg, int rank, int world);

}  // namespace moe
