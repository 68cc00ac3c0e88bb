// Data parallelism with ZeRO stages 0-2: what happens between the backward of a step's
// micro-batches and the optimizer, and after it. Every rank runs the same calls in the same order;
// on GPUs the collectives are queued on the model's stream (no host wait).
//
//   stage 0  all_reduce(gradients); every rank updates every parameter (full AdamW state)
//   stage 1  all_reduce(gradients); each rank updates its ZeroPartition chunk; all_gather(params)
//   stage 2  reduce_scatter(gradients) into each rank's chunk (+ all_reduce of the short tail);
//            gradient norm = all_reduce of the per-rank chunk sums of squares; update; all_gather
// The 1/world of the gradient mean is folded into the micro-batches' grad_scale by the trainer.
// World 1: every call here is a no-op, so a single-rank run is bitwise what it was without DP.
#pragma once
#include "moe/comm.hpp"
#include "moe/memory.hpp"
#include "moe/model.hpp"
#include "moe/optim.hpp"

namespace moe {

class DataParallel {
 public:
  DataParallel(Comm& comm, int zero_stage, size_t param_count);
  int rank() const { return comm_.rank(); }
  int world() const { return comm_.world(); }
  int stage() const { return stage_; }
  Comm& comm() { return comm_; }
  // The optimizer state this rank keeps (whole buffer for stage 0 or world 1).
  const ZeroPartition& partition() const { return part_; }

  // After the last micro-batch: sums gradients (stage 0/1 everywhere, stage 2 this rank's
  // chunk and the tail), loss sums and expert loads over the ranks.
  void reduce_gradients_and_stats(Model& model);
  // acc[0] = sum of squares of the whole (reduced) gradient, identical on every rank.
  void queue_grad_norm_sq(Ctx& ctx, const Model& model, Tensor acc);
  // After the optimizer step (stages 1, 2): every rank's chunk of the weights to every rank.
  void gather_params(Model& model);
  // Sums a small f64 tensor over the ranks (evaluation sums).
  void all_reduce(Tensor t);

 private:
  Comm& comm_;
  int stage_;
  ZeroPartition part_;
};

}  // namespace moe
