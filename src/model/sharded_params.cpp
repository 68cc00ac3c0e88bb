// ZeRO stage 3's gather-before-use and reduce-after-backward of the parameter units (see
// sharded_params.hpp).
#include "model/sharded_params.hpp"

#include <algorithm>

#include "moe/cuda_runtime.hpp"
#include "moe/ops/elementwise.hpp"

namespace moe {

namespace {

template <class T>
void host_accumulate(T* sum, const T* add, int64_t n) {
#pragma omp parallel for if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) sum[i] += add[i];
}

}  // namespace

ShardedParams::ShardedParams(const std::vector<size_t>& bounds, const ZeroPartition& part,
                             Comm* comm, DType master, DType compute, Device dev, bool allocate,
                             bool offload, bool pin_memory)
    : bounds_(bounds),
      part_(part),
      rank_(part.rank),
      world_(part.world),
      comm_(comm),
      master_dtype_(master),
      compute_dtype_(compute),
      dev_(dev),
      allocated_(allocate),
      offload_(offload),
      local_elems_(part.local()) {
  MOE_CHECK(part.local_buffers && part.total == bounds.back(),
            "ShardedParams: the partition must be per_unit over the model's units");
  MOE_CHECK(units() >= 3, "ShardedParams: at least one layer");
  MOE_CHECK(!allocate || (comm != nullptr && comm->world() == world_ && comm->rank() == rank_),
            "ShardedParams: the comm does not match the partition");
  size_t at = 0;
  for (int u = 0; u < units(); ++u) {
    local_at_.push_back(at);
    at += chunk(u);
    const int s = slot_of(u);
    slot_elems_[s] = std::max(slot_elems_[s], chunk(u) * static_cast<size_t>(world_));
  }
  MOE_CHECK(at == local_elems_, "ShardedParams: partition and unit bounds disagree");
  for (int s = 0; s < kSlots; ++s) resident_[s] = gathered_[s] = -1;
  if (!allocate) return;
  const size_t m = dtype_size(master), c = dtype_size(compute);
  if (offload) {  // zeroed host memory
    const bool pinned = pin_memory && dev.type == DeviceType::cuda;
    master_shard_ = Buffer::host(local_elems_ * m, pinned);
    grad_shard_ = Buffer::host(local_elems_ * m, pinned);
  } else {
    master_shard_ = Buffer(dev, local_elems_ * m);
    grad_shard_ = Buffer(dev, local_elems_ * m);
  }
  for (int s = 0; s < kSlots; ++s) {
    slot_master_[s] = Buffer(dev, slot_elems_[s] * m);
    slot_grad_[s] = Buffer(dev, slot_elems_[s] * m);
    if (compute != master) slot_work_[s] = Buffer(dev, slot_elems_[s] * c);
  }
}

size_t ShardedParams::device_bytes() const {
  const size_t m = dtype_size(master_dtype_), c = dtype_size(compute_dtype_);
  size_t bytes = offload_ ? 0 : 2 * local_elems_ * m;
  for (int s = 0; s < kSlots; ++s)
    bytes += slot_elems_[s] * (2 * m + (compute_dtype_ != master_dtype_ ? c : 0));
  return bytes;
}

int ShardedParams::slot_of(int unit) const {
  if (unit == 0) return 2;
  if (unit == units() - 1) return 3;
  return (unit - 1) % 2;
}

int ShardedParams::unit_of(size_t offset) const {
  const auto it = std::upper_bound(bounds_.begin(), bounds_.end(), offset);
  MOE_CHECK(it != bounds_.begin() && it != bounds_.end(), "ShardedParams: offset outside");
  return static_cast<int>(it - bounds_.begin()) - 1;
}

Tensor ShardedParams::slot_view(const Buffer& buf, DType dt, const ParamInfo& p) const {
  const int u = unit_of(p.offset);
  const size_t at = p.offset - bounds_[u];  // within the gathered unit
  void* data = allocated_ ? static_cast<char*>(buf.data()) + at * dtype_size(dt) : nullptr;
  return p.view(data, dt, dev_);
}

Tensor ShardedParams::master(const ParamInfo& p) const {
  return slot_view(slot_master_[slot_of(unit_of(p.offset))], master_dtype_, p);
}
Tensor ShardedParams::work(const ParamInfo& p) const {
  if (compute_dtype_ == master_dtype_) return master(p);
  return slot_view(slot_work_[slot_of(unit_of(p.offset))], compute_dtype_, p);
}
Tensor ShardedParams::grad(const ParamInfo& p) const {
  return slot_view(slot_grad_[slot_of(unit_of(p.offset))], master_dtype_, p);
}

Tensor ShardedParams::unit_master(int unit) const {
  const int s = slot_of(unit);
  return slot_master_[s].as(master_dtype_, {static_cast<int64_t>(slot_elems_[s])});
}

Tensor ShardedParams::master_shard() const {
  return master_shard_.as(master_dtype_, {static_cast<int64_t>(local_elems_)});
}
Tensor ShardedParams::grad_shard() const {
  return grad_shard_.as(master_dtype_, {static_cast<int64_t>(local_elems_)});
}

void ShardedParams::prefetch(Ctx& ctx, int unit) {
  if (ctx.dry_run || !allocated_ || unit < 0 || unit >= units()) return;
  const int s = slot_of(unit);
  launch_reductions(ctx);
  if (gathered_[s] == unit) return;
  const auto c = static_cast<int64_t>(chunk(unit)), at = static_cast<int64_t>(local_at_[unit]);
  comm_->fork_from_compute();  // after the work queued so far (which may still read the slot)
  const Tensor all = slot_master_[s].as(master_dtype_, {c * world_});
  if (offload_) {  // this rank's chunk into its place in the slot, then gathered in place
    const Tensor mine = all.rows(c * rank_, c * (rank_ + 1));
    if (chunk_wait_) chunk_wait_(local_at_[unit] + chunk(unit));
    comm_->copy_from_host(mine, host_at(master_shard_, local_at_[unit]));
    comm_->all_gather(all, mine);
  } else {
    comm_->all_gather(all, master_shard().rows(at, at + c));
  }
  gathered_[s] = unit;
  resident_[s] = -1;
  in_flight_ = true;
}

void ShardedParams::acquire(Ctx& ctx, int unit) {
  if (ctx.dry_run || !allocated_) return;
  const int s = slot_of(unit);
  if (resident_[s] == unit) return;
  // Gathered by an earlier prefetch: only wait for it. (Calling prefetch here would also launch
  // the deferred reductions, which this join would then wait for before the unit's backward.)
  if (gathered_[s] != unit) prefetch(ctx, unit);
  join(ctx);
  if (compute_dtype_ != master_dtype_) {
    const auto n = static_cast<int64_t>(bounds_[unit + 1] - bounds_[unit]);
    convert(ctx, slot_work_[s].as(compute_dtype_, {n}), slot_master_[s].as(master_dtype_, {n}),
            false);
  }
  resident_[s] = unit;
}

void ShardedParams::begin_grads(Ctx& ctx, int unit) {
  if (ctx.dry_run || !allocated_) return;
  const int s = slot_of(unit);
  // A reduction still to read this gradient slot must land first.
  for (const std::vector<int>* list : {&deferred_, &reducing_})
    for (int r : *list)
      if (slot_of(r) == s) {
        launch_reductions(ctx);
        join(ctx);
        break;
      }
  fill(ctx, slot_grad_[s].as(master_dtype_, {static_cast<int64_t>(slot_elems_[s])}), 0.0);
}

// The reduction is launched at the next prefetch (or flush), after the join that waits for the
// previous side-stream work: launched here it would be waited for by that join, before the next
// unit's backward, and overlap nothing.
void ShardedParams::grads_done(Ctx& ctx, int unit) {
  if (ctx.dry_run || !allocated_) return;
  deferred_.push_back(unit);
}

// Offloaded, the reduced chunk goes to the host right behind its reduction on the side stream
// (so that copy overlaps the backward too): into the host gradient chunks for a step's first
// micro-batch, else into the staging buffer that flush() adds.
void ShardedParams::launch_reductions(Ctx&) {
  for (const int unit : deferred_) {
    const auto c = static_cast<int64_t>(chunk(unit));
    const Tensor all = slot_grad_[slot_of(unit)].as(master_dtype_, {c * world_});
    const Tensor reduced = all.rows(c * rank_, c * (rank_ + 1));
    comm_->fork_from_compute();               // after the unit's backward
    comm_->reduce_scatter_sum(reduced, all);  // in place
    if (offload_) {
      if (!fresh_grads_ && staging_.data() == nullptr)
        staging_ = Buffer::host(local_elems_ * dtype_size(master_dtype_), grad_shard_.pinned());
      comm_->copy_to_host(host_at(fresh_grads_ ? grad_shard_ : staging_, local_at_[unit]), reduced);
      staged_ = staged_ || !fresh_grads_;
      got_grads_ = true;
    }
    reducing_.push_back(unit);
    in_flight_ = true;
  }
  deferred_.clear();
}

void ShardedParams::join(Ctx& ctx) {
  if (!in_flight_) return;
  comm_->join_compute();
  in_flight_ = false;
  for (const int unit : reducing_) {
    if (offload_) continue;  // its chunk went to the host on the side stream
    const auto c = static_cast<int64_t>(chunk(unit)), at = static_cast<int64_t>(local_at_[unit]);
    const Tensor sum = slot_grad_[slot_of(unit)].as(master_dtype_, {c * world_});
    const Tensor mine = grad_shard().rows(at, at + c);
    add(ctx, mine, mine, sum.rows(c * rank_, c * (rank_ + 1)));
  }
  reducing_.clear();
}

void ShardedParams::flush(Ctx& ctx) {
  if (ctx.dry_run || !allocated_) return;
  launch_reductions(ctx);
  join(ctx);
  if (offload_ && staged_) {  // a later micro-batch: its chunks are added on the host
    if (dev_.type == DeviceType::cuda) gpu::stream_synchronize(ctx.stream);
    const auto n = static_cast<int64_t>(local_elems_);
    if (master_dtype_ == DType::f32)
      host_accumulate(static_cast<float*>(grad_shard_.data()),
                      static_cast<const float*>(staging_.data()), n);
    else
      host_accumulate(static_cast<double*>(grad_shard_.data()),
                      static_cast<const double*>(staging_.data()), n);
    staged_ = false;
  }
  if (got_grads_) fresh_grads_ = got_grads_ = false;  // (a forward-only pass leaves them)
}

void ShardedParams::invalidate() {
  MOE_CHECK(!in_flight_ && deferred_.empty(),
            "ShardedParams: weights changed while a collective was in flight");
  for (int s = 0; s < kSlots; ++s) resident_[s] = gathered_[s] = -1;
}

}  // namespace moe
