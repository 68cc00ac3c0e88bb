// AdamW behind the next forward (AdamW::overlap_forward): the update on the device's side
// stream, unit by unit, with an event per unit for the forward to wait on.
//
// Why: the update is memory-bound (28 bytes per parameter with a split master: 8.2 ms of a 64 ms
// moe-fine step on an H200) and runs in line after the backward, while the forward that follows
// leaves SMs idle in its launch gaps, grid tails and small kernels. On the side stream (the
// greatest priority: its blocks are placed first whenever an SM frees) the update fills those,
// and a layer's forward starts as soon as its own unit is updated instead of after all of them.
// It cannot share an SM with the tensor-core kernels, whose CTAs hold the whole register file;
// so giving it SMs of its own was measured too: 68 GB/s per SM, 16 SMs ~1.1 TB/s (docs/perf.md,
// 13th session), slower than in line.
#include <string>

#include "optim/adamw_overlap.hpp"

#include "moe/cuda_runtime.hpp"
#include "moe/ops/elementwise.hpp"

namespace moe {

void AdamW::overlap_forward(const Model& model) {
  MOE_CHECK(model.device().type == DeviceType::cuda && updates_whole_on_device(),
            "AdamW: overlapping the update with the forward needs an unsharded model on a GPU "
            "and the optimizer state on it");
  auto o = std::make_unique<Overlap>();
  o->bounds = param_unit_bounds(model.table(), model.config());
  o->side = gpu::side_stream(model.device().index);
  o->fork = gpu::event_create();
  for (size_t u = 0; u + 1 < o->bounds.size(); ++u) o->ready.push_back(gpu::event_create());
  overlap_ = std::move(o);
}

void AdamW::step_overlapped(Ctx& ctx, Model& model, double lr, double grad_scale, Tensor norm_sq,
                            double max_norm, Tensor norm_out) {
  Overlap& o = *overlap_;
  gpu::event_record(o.fork, ctx.stream);
  gpu::stream_wait_event(o.side, o.fork);
  Ctx side = ctx;  // ctx's cuBLAS handle stays on ctx's stream: none of these ops use it
  side.stream = o.side;
  const bool current = writes_compute_copy(model);
  if (!norm_out.empty()) fill(side, norm_out, 0.0);
  const size_t units = o.ready.size();
  for (size_t u = 0; u < units; ++u) {
    queue_update(side, model, lr, grad_scale, norm_sq, max_norm, norm_out, o.bounds[u],
                 o.bounds[u + 1]);
    model.weights_changed(side, current, o.bounds[u], o.bounds[u + 1]);
    if (u + 1 < units) gpu::event_record(o.ready[u], o.side);
  }
  // The next step's zeroing, after every read of this step's gradients (the next backward, the
  // first writer, starts after the forward has waited for the last unit).
  model.zero_grads(side, /*experts_by_backward=*/true);
  gpu::event_record(o.ready.back(), o.side);
}

void AdamW::wait_unit(Ctx& ctx, int unit) {
  if (!overlap_) return;
  const std::vector<void*>& ready = overlap_->ready;
  MOE_CHECK(unit >= 0 && static_cast<size_t>(unit) < ready.size(),
            "AdamW::wait_unit: no unit " + std::to_string(unit));
  // An event never recorded (before the first step) is passed at once.
  gpu::stream_wait_event(ctx.stream, ready[static_cast<size_t>(unit)]);
}

void AdamW::join(Ctx& ctx) {
  if (overlap_) wait_unit(ctx, static_cast<int>(overlap_->ready.size()) - 1);
}

}  // namespace moe
