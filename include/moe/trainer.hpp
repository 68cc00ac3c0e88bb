// The training loop: data -> micro-batches (forward + backward) -> gradient reduce (data parallel,
// ZeRO 0-2) -> clip -> AdamW -> parameter gather -> log / eval.
#pragma once
#include <cmath>
#include <iosfwd>
#include <string>
#include <vector>

#include "moe/config.hpp"
#include "moe/tensor.hpp"

namespace moe {

struct TrainResult {
  int steps = 0;               // the step the run ended at (counting resumed steps)
  int resumed_from = 0;        // the checkpoint step it started from (0 = fresh)
  int profiled_steps = 0;      // steps the op profile covers (all but the first, warm-up step)
  std::vector<double> losses;  // LM loss of each step this call ran
  double last_loss = 0;        // LM loss of the last step
  double eval_loss = NAN;      // LM loss on held-out data at the end (NaN: none)
  double optimal_loss = 0;     // the data's best achievable loss (synthetic source)
  double tokens_per_second = 0;
  int skipped_steps = 0;  // fp16 steps skipped on gradient overflow
  // Not 0: the run stopped early on this signal (SIGTERM, SIGINT or SIGUSR1) after `steps`,
  // with a checkpoint of that step when the run saves any (train/stop_signals.hpp).
  int stop_signal = 0;
};

// Picks the device from train.device ("auto" = cuda when built in and present, else cpu).
Device resolve_device(const std::string& spec);

struct TrainOptions {
  // Return after this many steps of the run as if killed (tests of resume); 0 = run to the end.
  int stop_after_step = 0;
};

// Trains per `cfg`, printing progress lines to `out` (rank 0 only). Under mpirun / srun every rank
// calls it: data parallel with ZeRO stage zero_optimization.stage (0-2) over the launched ranks
// (docs/distributed.md); a W-rank run sees the rows of a 1-rank run with W times the gradient
// accumulation. Throws ConfigError / InputError on bad
// input and std::runtime_error when training itself fails (e.g. the loss diverges). While it runs
// the steps, SIGTERM, SIGINT and SIGUSR1 stop it after the step in progress (stop_signal).
TrainResult train(const Config& cfg, std::ostream& out, const TrainOptions& opt = {});

// The activation dtype the config asks for: bf16 or fp16 when enabled, else f32.
DType requested_compute_dtype(const Config& cfg);
// The same, checked against the device: mixed precision needs a GPU, bf16 one of sm_80 or newer
// (ConfigError naming the key otherwise).
DType compute_dtype(const Config& cfg, Device dev);

// What train() would refuse before it starts (train_batch_size against the launched ranks, the
// device, mixed precision on it, the data source), checked without building anything, so a bad
// config fails before the resolved config is printed.
void check_runnable(const Config& cfg);

// One line describing the build: version, CUDA archs compiled in, BLAS, MPI, OpenMP threads.
std::string build_info();

}  // namespace moe
