// Gradient reduction, norm and parameter gather for data parallelism (see data_parallel.hpp).
#include "train/data_parallel.hpp"

#include <algorithm>

#include "moe/cuda_runtime.hpp"

namespace moe {

namespace {

Tensor span(const Tensor& flat, size_t begin, size_t end) {
  return flat.rows(static_cast<int64_t>(begin), static_cast<int64_t>(end));
}

}  // namespace

namespace {

template <class T>
double host_sum_squares(const T* x, int64_t n) {
  double sum = 0;
#pragma omp parallel for reduction(+ : sum) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return sum;
}

ZeroPartition partition_for(int stage, const std::vector<size_t>& bounds, const Comm& comm) {
  MOE_CHECK(!bounds.empty(), "DataParallel: no unit bounds");
  if (stage == 3) return ZeroPartition::per_unit(bounds, comm.rank(), comm.world());
  if (stage >= 1) return ZeroPartition::split(bounds.back(), comm.rank(), comm.world());
  return ZeroPartition::whole(bounds.back());
}

}  // namespace

DataParallel::DataParallel(Comm& comm, int zero_stage, const std::vector<size_t>& unit_bounds,
                           size_t bucket_elems, bool host_buckets)
    : comm_(comm), stage_(zero_stage), part_(partition_for(zero_stage, unit_bounds, comm)) {
  MOE_CHECK(zero_stage >= 0 && zero_stage <= 3, "DataParallel: ZeRO stage must be 0 to 3");
  // Stage 3 reduces each unit's gradient as the backward finishes it anyway.
  if (bucket_elems > 0 && (comm.world() > 1 || host_buckets) && zero_stage != 3)
    buckets_ = std::make_unique<GradientBuckets>(
        unit_bounds.back(), bucket_elems,
        [this](size_t begin, size_t end) { reduce_bucket(begin, end); });
}

void DataParallel::reduce_bucket(size_t begin, size_t end) {
  comm_.fork_from_compute();  // after the backward queued so far
  reduce_bucket_parts(begin, end);
  if (host_grads_ == nullptr) return;
  // This rank's (reduced) elements of the bucket to the optimizer's host staging.
  const size_t elem = dtype_size(grads_.dtype);
  for (const ZeroPartition::Range& r : part_.ranges()) {
    const size_t b = std::max(begin, r.global), e = std::min(end, r.global + r.count);
    if (b < e)
      comm_.copy_to_host(static_cast<char*>(host_grads_) + (b - r.global + r.local) * elem,
                         span(grads_, b, e));
  }
  if (landed_) comm_.after_queued([landed = landed_, begin, end] { landed(begin, end); });
}

void DataParallel::reduce_bucket_parts(size_t begin, size_t end) {
  if (!(stage_ == 2 && part_.sharded)) {
    comm_.all_reduce_sum(span(grads_, begin, end));
    return;
  }
  // Each owner's part of the bucket goes to its owner only; every rank issues the same calls.
  for (int owner = 0; owner < world(); ++owner) {
    const size_t b = std::max(begin, part_.chunk * static_cast<size_t>(owner));
    const size_t e = std::min(end, part_.chunk * static_cast<size_t>(owner + 1));
    if (b < e) comm_.reduce_sum(span(grads_, b, e), owner);
  }
  const size_t b = std::max(begin, part_.tail_begin);
  if (b < end) comm_.all_reduce_sum(span(grads_, b, end));  // the tail: every rank updates it
}

Model::GradientReady DataParallel::backward_hook(Model& model, void* host_grads,
                                                 std::function<void(size_t, size_t)> landed) {
  host_grads_ = nullptr;
  landed_ = nullptr;
  if (!buckets_) return nullptr;
  MOE_CHECK(!landed || host_grads, "DataParallel: landed hook without host gradients");
  grads_ = model.grads();
  host_grads_ = host_grads;
  landed_ = std::move(landed);
  return [this](Ctx&, size_t begin, size_t end) { buckets_->ready(begin, end); };
}

void DataParallel::reduce_gradients_and_stats(Model& model) {
  if (buckets_) {  // world 1 too when the buckets go to the host (host_buckets)
    buckets_->flush();
    comm_.join_compute();
  }
  if (world() == 1) return;
  const Tensor g = model.grads();
  if (stage_ == 3 || buckets_) {
    // The backward reduced every unit (stage 3) or bucket already.
  } else if (stage_ == 2 && part_.sharded) {
    // In place: this rank's chunk of the split part receives the sum; the tail (< world
    // elements) is all-reduced since every rank updates it.
    if (part_.chunk > 0)
      comm_.reduce_scatter_sum(span(g, part_.begin, part_.begin + part_.chunk),
                               span(g, 0, part_.split_end()));
    if (part_.tail() > 0) comm_.all_reduce_sum(span(g, part_.tail_begin, part_.total));
  } else {
    comm_.all_reduce_sum(g);
  }
  comm_.all_reduce_sum(model.loss_sums());
  if (!model.expert_loads().empty()) comm_.all_reduce_sum(model.expert_loads());
}

void DataParallel::queue_grad_norm_sq(Ctx& ctx, const Model& model, Tensor acc) {
  if (stage_ == 3) {  // grads() is this rank's chunks (their padding holds zeros)
    const Tensor g = model.grads();
    if (g.device.type == acc.device.type) {
      moe::queue_grad_norm_sq(ctx, model, acc);
    } else {  // parameter offload: host chunks, once their copies from the device have landed
      if (ctx.device.type == DeviceType::cuda) gpu::stream_synchronize(ctx.stream);
      double sum = g.dtype == DType::f32 ? host_sum_squares(g.ptr<float>(), g.numel())
                                         : host_sum_squares(g.ptr<double>(), g.numel());
      copy_from_host(acc, &sum);
    }
    if (world() > 1) comm_.all_reduce_sum(acc);
    return;
  }
  if (!(stage_ == 2 && part_.sharded)) {
    moe::queue_grad_norm_sq(ctx, model, acc);
    return;
  }
  // Each rank holds the reduced gradient of its chunk only; the tail is counted once (rank 0).
  std::vector<ZeroPartition::Range> mine;
  if (part_.chunk > 0) mine.push_back({part_.begin, part_.chunk, 0});
  if (rank() == 0 && part_.tail() > 0) mine.push_back({part_.tail_begin, part_.tail(), 0});
  queue_grad_norm_sq_ranges(ctx, model, acc, mine);
  comm_.all_reduce_sum(acc);
}

void DataParallel::gather_params(Model& model) {
  if (stage_ == 3 || !part_.sharded || part_.chunk == 0) return;
  const Tensor p = model.params();
  comm_.all_gather(span(p, 0, part_.split_end()), span(p, part_.begin, part_.begin + part_.chunk));
}

void DataParallel::all_reduce(Tensor t) {
  if (world() > 1) comm_.all_reduce_sum(t);
}

}  // namespace moe
