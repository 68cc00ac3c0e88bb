// Where training and evaluation batches come from: the synthetic Markov source or token shards.
// Both save and restore their exact position, so a resumed run sees the same batches.
#pragma once
#include <memory>
#include <string>

#include "moe/checkpoint.hpp"
#include "moe/config.hpp"

namespace moe {

// Evaluation split over data-parallel ranks: rank r runs held-out batches r, r + world, ...;
// the trainer sums `loss_sum` and `batches` over the ranks (mean = sum / batches).
struct EvalSums {
  double loss_sum = 0;
  int batches = 0;
};

// Every rank reads the same global stream (make_train_data ignores the rank for training
// batches): the trainer draws all micro-batches of the global batch on every rank and keeps its
// own, so the data position is the same on every rank and a W-rank run sees exactly the rows of
// a 1-rank run with W times the gradient accumulation.
class TrainData {
 public:
  virtual ~TrainData() = default;
  virtual void next(int32_t* ids, int32_t* targets) = 0;  // [B*T] each
  virtual void save(TrainerState& s) const = 0;
  virtual void restore(const TrainerState& s) = 0;
  // LM losses of `model` on this rank's share of the first `batches` held-out batches (the same
  // batches every call); batches = 0 when there is no held-out data.
  virtual EvalSums evaluate(Ctx& ctx, Model& model, int batches, int rank, int world) = 0;
  virtual std::string describe() const = 0;
  // The best achievable loss when known (synthetic source), else NaN.
  virtual double optimal_loss() const = 0;
  // Directory holding the tokenizer of the data ("" when none).
  virtual std::string tokenizer_dir() const = 0;
};

// Throws ConfigError when cfg.data cannot serve cfg.model (the synthetic source at a vocabulary
// too large for its table), before anything is built.
void check_data_source(const Config& cfg);
// The shard globs of a "shards" source match files whose headers and sizes are sound (InputError
// naming the file otherwise): cheap, no token is read, so a bad file fails before set-up.
void check_data_files(const Config& cfg);

// Builds the source named by cfg.data (the global stream; see TrainData). Throws InputError when
// shard files are missing or corrupt, or hold token ids outside model.vocab_size.
std::unique_ptr<TrainData> make_train_data(const Config& cfg);

}  // namespace moe
