// ZeRO stage 3 inside the model: each rank keeps only its chunk of every unit of the parameter
// buffer (ZeroPartition::per_unit over param_unit_bounds: the embedding, each layer, the final
// norm with an untied head), and a unit's weights exist whole only while it runs.
//
// The layers' parameter views point into slots, not into the model's buffers: the embedding and
// the final unit have a slot each (in use at both ends of a step, and a tied head reads the
// embedding's), and the layers alternate between two, so layer l+1 can be gathered into one
// while layer l runs from the other. Each slot holds the unit's gathered fp32 (master dtype)
// weights, their compute-dtype copy (mixed precision) and the unit's gradient.
//
// A step, per micro-batch (Model::run_layers calls these at unit boundaries):
//   forward   acquire(u) waits for unit u's gather (issued by the previous prefetch, else now)
//             and converts it to the compute dtype; prefetch(u + 1) queues the next gather on the
//             comm's side stream (NcclComm::fork_from_compute), behind the work queued so far,
//             so it overlaps unit u's compute; a slot whose unit is already there is not
//             gathered again (the last two layers stay for the backward, the embedding and the
//             final unit for the whole step)
//   backward  the same in reverse, and around each unit's backward: begin_grads(u) zeroes its
//             gradient slot; after grads_done(u) the next prefetch queues the reduce_scatter of it
//             on the side stream (so it overlaps the next unit's backward), and at the join after
//             that its chunk is added into this rank's gradient shard (grads()); so gradients
//             accumulate across micro-batches in the shard, as DeepSpeed's stage 3 does
//   flush()   at the end of the backward: every pending reduction added
// After an optimizer step (Model::weights_changed) every slot is stale. On CPU ranks (MpiComm,
// SingleComm) the collectives complete where they are called: the same order, no overlap.
//
// Parameter offload (zero_optimization.offload_param): the two shards are host memory. A prefetch
// first copies the unit's chunk from the host into this rank's place in the slot (on the side
// stream, Comm::copy_from_host) and gathers in place; a reduced gradient chunk is copied to the
// host right behind its reduction on the side stream (Comm::copy_to_host), straight into the
// gradient shard for the first micro-batch of a step and into a host staging buffer for later
// ones, which flush() adds on the CPU (waiting for the device). The CPU AdamW then updates the
// host weights where they lie (OffloadOptions::in_place), in a thread behind the next forward:
// a prefetch first waits (set_chunk_wait) until the unit's chunk is updated.
#pragma once
#include <functional>
#include <vector>

#include "moe/comm.hpp"
#include "moe/memory.hpp"
#include "moe/model.hpp"
#include "moe/optim.hpp"

namespace moe {

class ShardedParams {
 public:
  // bounds: param_unit_bounds; `part`: ZeroPartition::per_unit over them. With allocate = false
  // nothing is allocated (memory plans) and comm may be null.
  ShardedParams(const std::vector<size_t>& bounds, const ZeroPartition& part, Comm* comm,
                DType master, DType compute, Device dev, bool allocate, bool offload = false,
                bool pin_memory = false);

  int units() const { return static_cast<int>(bounds_.size()) - 1; }
  const ZeroPartition& partition() const { return part_; }
  // The unit holding element `offset` of the (global) parameter buffer.
  int unit_of(size_t offset) const;
  // Views of a parameter in its unit's slot: gathered master weights, compute copy, gradient.
  Tensor master(const ParamInfo& p) const;
  Tensor work(const ParamInfo& p) const;
  Tensor grad(const ParamInfo& p) const;
  // The slot holding unit u's gathered master weights (valid after acquire(u)).
  Tensor unit_master(int unit) const;
  // This rank's chunks (ZeroPartition::local() elements, per_unit layout).
  Tensor master_shard() const;
  Tensor grad_shard() const;

  void prefetch(Ctx& ctx, int unit);
  void acquire(Ctx& ctx, int unit);
  void begin_grads(Ctx& ctx, int unit);
  void grads_done(Ctx& ctx, int unit);
  void flush(Ctx& ctx);
  void invalidate();  // the shards changed (optimizer step, load): every slot is stale
  // The next gradients start a step: the first micro-batch's chunks overwrite the host shard.
  void grads_zeroed() { fresh_grads_ = true; }
  bool offloaded() const { return offload_; }
  // Offload: called with a unit's local end before its host chunk is copied to the GPU (the CPU
  // AdamW may still be updating the chunks behind the forward: AdamW::wait_local).
  void set_chunk_wait(std::function<void(size_t local_end)> wait) { chunk_wait_ = std::move(wait); }

  // Device bytes of the shards (unless offloaded) and the slots.
  size_t device_bytes() const;

 private:
  int slot_of(int unit) const;
  size_t chunk(int unit) const { return unit_chunk(bounds_[unit], bounds_[unit + 1], world_); }
  size_t local_offset(int unit) const { return local_at_[unit]; }
  Tensor slot_view(const Buffer& buf, DType dt, const ParamInfo& p) const;
  void join(Ctx& ctx);  // the compute stream waits for the side stream; pending sums land
  void launch_reductions(Ctx& ctx);  // the deferred units' reduce_scatters, on the side stream
  char* host_at(const Buffer& b, size_t local) const {
    return static_cast<char*>(b.data()) + local * dtype_size(master_dtype_);
  }

  std::vector<size_t> bounds_, local_at_;
  ZeroPartition part_;
  int rank_, world_;
  Comm* comm_;
  DType master_dtype_, compute_dtype_;
  Device dev_;
  bool allocated_, offload_;
  size_t local_elems_;
  Buffer staging_;  // offload, gradient accumulation: later micro-batches' chunks (host)
  std::function<void(size_t)> chunk_wait_;
  bool fresh_grads_ = true, staged_ = false, got_grads_ = false;
  Buffer master_shard_, grad_shard_;
  static constexpr int kSlots = 4;  // two for layers, the embedding's, the final unit's
  size_t slot_elems_[kSlots] = {};
  Buffer slot_master_[kSlots], slot_work_[kSlots], slot_grad_[kSlots];
  int gathered_[kSlots];       // unit whose gather into the slot is queued or done, or -1
  int resident_[kSlots];       // unit gathered, waited for and converted: ready for its ops, or -1
  bool in_flight_ = false;     // collectives queued on the side stream since the last join
  std::vector<int> deferred_;  // units whose gradient is final, reduction not yet launched
  std::vector<int> reducing_;  // units whose reduce_scatter is queued, not yet added to the shard
};

}  // namespace moe
