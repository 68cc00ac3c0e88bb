// Data parallelism with ZeRO stages 0-3: what happens between the backward of a step's
// micro-batches and the optimizer, and after it. Every rank runs the same calls in the same order;
// on GPUs the collectives are queued on the model's stream (no host wait).
//
//   stage 0  all_reduce(gradients); every rank updates every parameter (full AdamW state)
//   stage 1  all_reduce(gradients); each rank updates its ZeroPartition chunk; all_gather(params)
//   stage 2  reduce_scatter(gradients) into each rank's chunk (+ all_reduce of the short tail);
//            gradient norm = all_reduce of the per-rank chunk sums of squares; update; all_gather
// The 1/world of the gradient mean is folded into the micro-batches' grad_scale by the trainer.
//   stage 3  the parameters themselves are sharded (ZeroPartition::per_unit): the model gathers
//            each unit before use and reduce-scatters its gradient into this rank's chunk during
//            the backward (src/model/sharded_params.hpp); here only the statistics are summed,
//            the norm is the all_reduce of the chunk sums of squares, and nothing is gathered
//            after the update (the next forward gathers the new weights)
// World 1: every call here is a no-op, so a single-rank run is bitwise what it was without DP
// (stage 3 at world 1 gathers and reduces by copying).
//
// With overlap (zero_optimization.overlap_comm) the gradients are not reduced after the backward
// but during the last micro-batch's: backward_hook() gathers the ranges the model finishes into
// buckets (GradientBuckets) and reduces each full one at once, on the comm's side stream on
// GPUs (fork_from_compute), so it runs while the backward of earlier layers goes on. Stages 0
// and 1 all-reduce each bucket; stage 2 reduces each part of a bucket to the rank whose chunk it
// lies in (reduce_sum; the shared tail is all-reduced), which moves what the reduce-scatter does:
// the chunks do not line up with buckets, so one reduce_scatter per bucket cannot.
#pragma once
#include <functional>
#include <memory>

#include "moe/comm.hpp"
#include "moe/memory.hpp"
#include "moe/model.hpp"
#include "moe/optim.hpp"
#include "train/grad_buckets.hpp"

namespace moe {

class DataParallel {
 public:
  // bucket_elems > 0: overlap the gradient reduction with the backward in buckets of at least
  // that many elements; 0: one reduction after the backward.
  // unit_bounds: param_unit_bounds of the model (ZeRO-3's units; the last entry is P).
  // host_buckets: the optimizer is offloaded, so buckets are kept at world 1 too (at stages
  // 0-2): their reduction is nothing there, but each still goes to the host during the backward.
  DataParallel(Comm& comm, int zero_stage, const std::vector<size_t>& unit_bounds,
               size_t bucket_elems = 0, bool host_buckets = false);
  bool overlaps() const { return buckets_ != nullptr; }
  // For the last micro-batch's queue_forward_backward: reduces the gradient buckets as the
  // backward finishes them (empty when not overlapping: nothing to do during the backward).
  // host_grads (optimizer offload: AdamW::host_gradients(), this rank's elements in the
  // partition's local layout): each bucket's owned part is also copied there, right behind its
  // reduction on the comm's stream, so the copy to the host overlaps the backward too; then
  // gradients_on_host() is true after reduce_gradients_and_stats. landed(begin, end), when
  // given, is called (Comm::after_queued: on a driver thread on GPUs) once a bucket's copy is on
  // the host: the overlapped CPU AdamW (AdamW::landing_hook) updates it during the backward.
  Model::GradientReady backward_hook(Model& model, void* host_grads = nullptr,
                                     std::function<void(size_t, size_t)> landed = nullptr);
  bool gradients_on_host() const { return host_grads_ != nullptr; }
  int rank() const { return comm_.rank(); }
  int world() const { return comm_.world(); }
  int stage() const { return stage_; }
  Comm& comm() { return comm_; }
  // The optimizer state this rank keeps (whole buffer for stage 0 or world 1).
  const ZeroPartition& partition() const { return part_; }
  // Stage 3: what the model is built with (the partition and this comm).
  ParamSharding sharding(bool offload = false, bool pin_memory = false) {
    return ParamSharding{&part_, &comm_, offload, pin_memory};
  }
  bool shards_params() const { return stage_ == 3; }

  // After the last micro-batch: sums gradients (stage 0/1 everywhere, stage 2 this rank's
  // chunk and the tail; overlapping: the last bucket, then the compute stream waits for the
  // buckets), loss sums and expert loads over the ranks.
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
  void reduce_bucket(size_t begin, size_t end);
  void reduce_bucket_parts(size_t begin, size_t end);  // the collectives of one bucket
  Tensor grads_;                // the model's gradient buffer, while a backward hook is in use
  void* host_grads_ = nullptr;  // where owned parts of buckets go (see backward_hook)
  std::function<void(size_t, size_t)> landed_;
  std::unique_ptr<GradientBuckets> buckets_;
};

}  // namespace moe
