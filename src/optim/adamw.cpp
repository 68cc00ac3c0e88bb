// AdamW over the parameter buffer in segments of equal decay choice (decided by ParamKind:
// norms are not decayed), on the model's device or offloaded to the host (optim/host_adamw.hpp),
// global-norm clipping and the learning-rate schedule.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include <omp.h>

#include "moe/cuda_runtime.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/optim.hpp"
#include "moe/optim.hpp"
#include "optim/adamw_overlap.hpp"
#include "optim/host_adamw.hpp"

namespace moe {

double learning_rate(const SchedulerConfig& s, double base_lr, int step, int max_steps) {
  const int warmup = s.warmup_num_steps;
  if (step < warmup) {
    const double frac = static_cast<double>(step + 1) / warmup;
    return base_lr * (s.warmup_min_ratio + (1.0 - s.warmup_min_ratio) * frac);
  }
  if (s.type == "WarmupLR") return base_lr;
  const int total = s.total_num_steps > 0 ? s.total_num_steps : max_steps;
  if (total <= warmup) return base_lr;
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / (total - warmup));
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return base_lr * (s.cos_min_ratio + (1.0 - s.cos_min_ratio) * cosine);
}

ZeroPartition ZeroPartition::whole(size_t total) {
  ZeroPartition p;
  p.total = total;
  p.chunk = total;
  p.tail_begin = total;
  return p;
}

ZeroPartition ZeroPartition::split(size_t total, int rank, int world) {
  MOE_CHECK(world >= 1 && rank >= 0 && rank < world, "ZeroPartition: bad rank / world");
  if (world == 1) return whole(total);
  ZeroPartition p;
  p.total = total;
  p.rank = rank;
  p.world = world;
  p.sharded = true;
  p.chunk = total / static_cast<size_t>(world);
  p.begin = p.chunk * static_cast<size_t>(rank);
  p.tail_begin = p.chunk * static_cast<size_t>(world);
  return p;
}

ZeroPartition ZeroPartition::per_unit(const std::vector<size_t>& bounds, int rank, int world) {
  MOE_CHECK(world >= 1 && rank >= 0 && rank < world, "ZeroPartition: bad rank / world");
  MOE_CHECK(bounds.size() >= 2 && bounds.front() == 0, "ZeroPartition: bad unit bounds");
  ZeroPartition p;
  p.total = bounds.back();
  p.rank = rank;
  p.world = world;
  p.sharded = true;
  p.local_buffers = true;
  p.tail_begin = p.total;  // no shared tail: every element has one owner
  for (size_t u = 0; u + 1 < bounds.size(); ++u) {
    MOE_CHECK(bounds[u] <= bounds[u + 1], "ZeroPartition: unit bounds must not decrease");
    const size_t c = unit_chunk(bounds[u], bounds[u + 1], world);
    const size_t first = bounds[u] + c * static_cast<size_t>(rank);
    if (first < bounds[u + 1])
      p.unit_ranges_.push_back({first, std::min(c, bounds[u + 1] - first), p.local_elems_});
    p.local_elems_ += c;
  }
  return p;
}

size_t ZeroPartition::owned() const {
  size_t n = 0;
  for (const Range& r : ranges()) n += r.count;
  return n;
}

std::vector<ZeroPartition::Range> ZeroPartition::ranges() const {
  if (local_buffers) return unit_ranges_;
  std::vector<Range> r;
  if (chunk > 0) r.push_back({begin, chunk, 0});
  if (tail() > 0) r.push_back({tail_begin, tail(), chunk});
  return r;
}

void queue_grad_norm_sq_ranges(Ctx& ctx, const Model& model, Tensor acc,
                               const std::vector<ZeroPartition::Range>& ranges) {
  fill(ctx, acc, 0.0);
  const Tensor g = model.grads();
  for (const auto& r : ranges)
    sum_squares(ctx, acc,
                g.rows(static_cast<int64_t>(r.global), static_cast<int64_t>(r.global + r.count)));
}

void queue_grad_norm_sq(Ctx& ctx, const Model& model, Tensor acc) {
  fill(ctx, acc, 0.0);
  if (model.params_sharded()) return sum_squares(ctx, acc, model.grads());
  for (const Model::GradSpan& s : model.grad_spans()) sum_squares(ctx, acc, s.g);
}

double global_grad_norm(Ctx& ctx, const Model& model, Tensor acc) {
  queue_grad_norm_sq(ctx, model, acc);
  double host = 0;
  copy_to_host(&host, acc);
  return std::sqrt(host);
}

double clip_factor(double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0;
  return max_norm / (norm + 1e-6);
}

AdamW::AdamW(const OptimizerConfig& cfg, const Model& model)
    : AdamW(cfg, model, ZeroPartition::whole(model.table().total)) {}

namespace {

// The optimizer state buffer of `elems` elements: on the model's device, or on the host.
Buffer state_buffer(const Model& model, size_t elems, const OffloadOptions& offload) {
  const size_t bytes = elems * dtype_size(model.dtype());
  if (!offload.enabled) return Buffer(model.device(), bytes);
  const bool pinned = offload.pin_memory && model.device().type == DeviceType::cuda;
  return Buffer::host(bytes, pinned);
}

}  // namespace

AdamW::AdamW(const OptimizerConfig& cfg, const Model& model, const ZeroPartition& part,
             OffloadOptions offload)
    : cfg_(cfg),
      part_(part),
      m_(state_buffer(model, part.local(), offload)),
      v_(state_buffer(model, part.local(), offload)),
      dtype_(model.dtype()),
      offload_(offload),
      background_(std::make_unique<Background>()) {
  MOE_CHECK(part.total == model.table().total, "AdamW: partition of another parameter buffer");
  MOE_CHECK(dtype_ == DType::f32 || dtype_ == DType::f64,
            "AdamW: master weights must be f32 or f64");
  MOE_CHECK(!model.splits_master() || (!offload_.enabled && !part.sharded),
            "AdamW: a split master is updated in place on the device, unsharded (ZeRO stage 0)");
  MOE_CHECK(!offload_.in_place || (offload_.enabled && part.local_buffers &&
                                   model.params().device.type == DeviceType::cpu &&
                                   model.params().numel() == static_cast<int64_t>(part.local())),
            "AdamW: in-place offload needs the model's own host chunks (ZeRO-3 offload_param)");
  MOE_CHECK(!offload_.overlap || (offload_.enabled && !offload_.in_place),
            "AdamW: overlapping the update with the backward needs the offloaded (not in-place) "
            "state");
  if (offload_.enabled && !offload_.in_place) {
    master_ = state_buffer(model, part.local(), offload);
    grads_ = state_buffer(model, part.local(), offload);
  }
  if (offload_.overlap) {
    next_master_ = state_buffer(model, part.local(), offload);
    next_m_ = state_buffer(model, part.local(), offload);
    next_v_ = state_buffer(model, part.local(), offload);
    spec_ = std::make_shared<Speculation>();
  }
  for (const auto& p : model.table().params) {
    const bool decay = param_kind_decays(p.kind);
    if (!segments_.empty() && segments_.back().decay == decay &&
        segments_.back().offset + segments_.back().numel == p.offset)
      segments_.back().numel += p.numel();
    else
      segments_.push_back({p.offset, p.numel(), decay});
  }
}

Tensor AdamW::local(const Buffer& b) const {
  return b.as(dtype_, {static_cast<int64_t>(part_.local())});
}
// The in-place offloaded update running in a thread behind the next forward (step_offloaded).
struct AdamW::Background {
  std::thread worker;
  std::mutex mu;
  std::condition_variable cv;
  size_t done_below = SIZE_MAX;  // local offset below which every owned element is updated
};

// The overlapped update (OffloadOptions::overlap): a thread that updates each range of
// gradients as the landing hook reports it, while the backward goes on.
struct AdamW::Speculation {
  using Range = std::pair<size_t, size_t>;  // global [begin, end)
  std::thread worker;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Range> landed;  // ranges to update (with `scale`)
  // Ranges updated, with the scale each used: once the step's real scale is known (decide()),
  // those that used another go back into `landed`.
  std::vector<std::pair<Range, double>> done;
  bool closing = false;  // no more ranges come: drain them and stop
  bool dropped = false;  // the step is skipped: stop without finishing
  bool busy = false;     // a range is being updated
  size_t updated = 0;    // owned elements updated with the current `scale`
  std::exception_ptr error;
  double lr = 0, scale = 0;  // the step's learning rate; the gradient scale (a guess until decided)
  long step = 0;
};

struct AdamW::Item {
  size_t at, n;  // byte offset in the host buffers, elements
  HostAdamWStep hs;
};

namespace {

// The host arrays one update reads or writes (the weights, gradients and moments).
struct HostBases {
  char *w, *g, *m, *v;
};

// Runs `items` reading `in` (and in.g) and writing `out` (the same bases for an update in place).
void run_items(const std::vector<AdamW::Item>& items, HostBases in, HostBases out, DType dt);

}  // namespace

void* AdamW::host_gradients() const {
  return offload_.enabled && !offload_.in_place ? grads_.data() : nullptr;
}

Tensor AdamW::moment1() const {
  finish();
  return local(m_);
}
Tensor AdamW::moment2() const {
  finish();
  return local(v_);
}

void AdamW::step(Ctx& ctx, Model& model, double lr, double grad_scale, Tensor norm_sq,
                 double max_norm, Tensor norm_out) {
  MOE_CHECK(norm_out.empty() || (updates_whole_on_device() && norm_sq.empty()),
            "AdamW::step: the norm from the update needs the whole update on the device and no "
            "norm_sq");
  ++step_;
  if (offload_.enabled) {
    step_offloaded(ctx, model, lr, grad_scale, norm_sq, max_norm);
    return;
  }
  if (overlap_) {
    step_overlapped(ctx, model, lr, grad_scale, norm_sq, max_norm, norm_out);
    return;
  }
  if (!norm_out.empty()) fill(ctx, norm_out, 0.0);
  queue_update(ctx, model, lr, grad_scale, norm_sq, max_norm, norm_out, 0, part_.total);
}

void AdamW::queue_update(Ctx& ctx, Model& model, double lr, double grad_scale, Tensor norm_sq,
                         double max_norm, Tensor norm_out, size_t begin, size_t end) {
  // A split master: its high halves are the compute copy, updated in place with the low ones.
  const bool split = model.splits_master();
  // (a split master is unsharded: its gradients come as runs of one dtype, grad_spans, since
  // bf16 expert gradients need one)
  Tensor p = split ? model.compute_params() : model.params(), g = split ? Tensor() : model.grads();
  const Tensor low = model.master_low();
  Tensor m = local(m_), v = local(v_);
  // Unsharded, the updates cover the whole buffer, so they also write the 16-bit compute copy
  // (the model then skips its convert: writes_compute_copy). ZeRO-1/2 keep the model's convert:
  // the other ranks' chunks arrive after the step, by the fp32 all_gather of the master weights.
  const Tensor compute = writes_compute_copy(model) && !split ? model.compute_params() : Tensor();
  // Every (owned range x decay segment) intersection within [begin, end) is one fused update.
  for (const auto& r : part_.ranges())
    for (const auto& s : segments_) {
      const size_t b = std::max({r.global, s.offset, begin});
      const size_t e = std::min({r.global + r.count, s.offset + s.numel, end});
      if (b >= e) continue;
      AdamWArgs a;
      a.lr = lr;
      a.beta1 = cfg_.beta1;
      a.beta2 = cfg_.beta2;
      a.eps = cfg_.eps;
      a.weight_decay = s.decay ? cfg_.weight_decay : 0.0;
      a.step = step_;
      a.grad_scale = grad_scale;
      a.norm_sq = norm_sq;
      a.max_norm = max_norm;
      a.grad_sq_out = norm_out;
      // The moments are local; the weights and gradients local too under ZeRO-3.
      const auto n = static_cast<int64_t>(e - b);
      const auto lb = static_cast<int64_t>(b - r.global + r.local), le = lb + n;
      const auto pb = static_cast<int64_t>(b - r.global + part_.model_offset(r)), pe = pb + n;
      if (!compute.empty()) a.compute_out = compute.rows(pb, pe);
      if (split)
        for (const Model::GradSpan& gs :
             model.grad_spans(static_cast<size_t>(pb), static_cast<size_t>(pe))) {
          const auto sb = static_cast<int64_t>(gs.begin), se = sb + gs.g.numel();
          adamw_step_split(ctx, p.rows(sb, se), low.rows(sb, se), gs.g,
                           m.rows(lb + sb - pb, lb + se - pb), v.rows(lb + sb - pb, lb + se - pb),
                           a);
        }
      else
        adamw_step(ctx, p.rows(pb, pe), g.rows(pb, pe), m.rows(lb, le), v.rows(lb, le), a);
    }
}

AdamWArgs AdamW::host_args(double lr, long step, double grad_scale) const {
  AdamWArgs a;
  a.lr = lr;
  a.beta1 = cfg_.beta1;
  a.beta2 = cfg_.beta2;
  a.eps = cfg_.eps;
  a.step = step;
  a.grad_scale = grad_scale;
  return a;
}

std::vector<AdamW::Item> AdamW::items_within(size_t begin, size_t end, AdamWArgs a,
                                             double scale) const {
  std::vector<Item> items;
  const size_t elem = dtype_size(dtype_);
  for (const auto& r : part_.ranges())
    for (const auto& s : segments_) {
      const size_t b = std::max({begin, r.global, s.offset});
      const size_t e = std::min({end, r.global + r.count, s.offset + s.numel});
      if (b >= e) continue;
      a.weight_decay = s.decay ? cfg_.weight_decay : 0.0;
      items.push_back({(b - r.global + r.local) * elem, e - b, host_adamw_step(a, scale)});
    }
  return items;
}

namespace {

template <class T>
HostAdamWState<T> state_at(const HostBases& b, size_t at) {
  return {reinterpret_cast<T*>(b.w + at), reinterpret_cast<T*>(b.m + at),
          reinterpret_cast<T*>(b.v + at)};
}

void run_items(const std::vector<AdamW::Item>& items, HostBases in, HostBases out, DType dt) {
  for (const AdamW::Item& it : items) {
    if (dt == DType::f32)
      host_adamw_update(state_at<float>(in, it.at), reinterpret_cast<const float*>(in.g + it.at),
                        state_at<float>(out, it.at), it.n, it.hs);
    else
      host_adamw_update(state_at<double>(in, it.at), reinterpret_cast<const double*>(in.g + it.at),
                        state_at<double>(out, it.at), it.n, it.hs);
  }
}

size_t count_elems(const std::vector<AdamW::Item>& items) {
  size_t n = 0;
  for (const AdamW::Item& it : items) n += it.n;
  return n;
}

}  // namespace

void AdamW::take_master(const Model& model) {
  if (master_current_) return;
  const Tensor p = model.params(), master = local(master_);
  for (const auto& r : part_.ranges())
    copy_to_host(
        master.rows(static_cast<int64_t>(r.local), static_cast<int64_t>(r.local + r.count)).data,
        p.rows(static_cast<int64_t>(part_.model_offset(r)),
               static_cast<int64_t>(part_.model_offset(r) + r.count)));
  master_current_ = true;
}

void AdamW::begin_overlapped_step(const Model& model, double lr, double grad_scale) {
  MOE_CHECK(offload_.overlap, "AdamW: begin_overlapped_step without OffloadOptions::overlap");
  Speculation& sp = *spec_;
  MOE_CHECK(!sp.worker.joinable(), "AdamW: an overlapped step is already running");
  take_master(model);
  sp.landed.clear();
  sp.done.clear();
  sp.closing = sp.dropped = sp.busy = false;
  sp.updated = 0;
  sp.error = nullptr;
  sp.lr = lr;
  sp.scale = grad_scale;  // the guess: no clipping, no skip
  sp.step = step_ + 1;
  const HostBases in{static_cast<char*>(master_.data()), static_cast<char*>(grads_.data()),
                     static_cast<char*>(m_.data()), static_cast<char*>(v_.data())};
  const HostBases out{static_cast<char*>(next_master_.data()), nullptr,
                      static_cast<char*>(next_m_.data()), static_cast<char*>(next_v_.data())};
  const AdamWArgs a = host_args(lr, sp.step, grad_scale);
  // The thread's OpenMP team leaves a core to the thread that launches the backward's kernels:
  // a full team competes with it, and a team member it pre-empts stalls every parallel loop.
  const int team = std::max(1, omp_get_max_threads() - 1);
  sp.worker = std::thread([this, &sp, in, out, a, team] {
    omp_set_num_threads(team);
    for (;;) {
      Speculation::Range range;
      double scale;
      {
        std::unique_lock<std::mutex> lock(sp.mu);
        sp.cv.wait(lock, [&] { return !sp.landed.empty() || sp.closing || sp.dropped; });
        if (sp.dropped || sp.landed.empty()) return;
        range = sp.landed.front();
        sp.landed.pop_front();
        scale = sp.scale;
        sp.busy = true;
      }
      size_t n = 0;
      try {
        const std::vector<Item> items = items_within(range.first, range.second, a, scale);
        run_items(items, in, out, dtype_);
        n = count_elems(items);
      } catch (...) {
        std::lock_guard<std::mutex> lock(sp.mu);
        sp.error = std::current_exception();
        return;
      }
      std::lock_guard<std::mutex> lock(sp.mu);
      sp.busy = false;
      if (scale == sp.scale) {
        sp.updated += n;
        sp.done.push_back({range, scale});
      } else {  // decided while this range ran with the guess: again, with the real scale
        sp.landed.push_back(range);
      }
      sp.cv.notify_all();  // (wait_overlapped_idle)
    }
  });
}

std::function<void(size_t, size_t)> AdamW::landing_hook() const {
  MOE_CHECK(offload_.overlap, "AdamW: landing_hook without OffloadOptions::overlap");
  std::shared_ptr<Speculation> sp = spec_;
  return [sp](size_t begin, size_t end) {
    std::lock_guard<std::mutex> lock(sp->mu);
    sp->landed.emplace_back(begin, end);
    sp->cv.notify_all();
  };
}

void AdamW::wait_overlapped_idle() const {
  Speculation& sp = *spec_;
  std::unique_lock<std::mutex> lock(sp.mu);
  sp.cv.wait(lock, [&] { return (sp.landed.empty() && !sp.busy) || sp.error; });
}

void AdamW::decide_overlapped(bool skipped, double scale) {
  Speculation& sp = *spec_;
  std::lock_guard<std::mutex> lock(sp.mu);
  sp.closing = true;  // every range has landed by now
  if (skipped) {
    sp.dropped = true;
  } else if (scale != sp.scale) {
    // Clipped: the ranges not yet updated go on with the real scale; those updated with the guess
    // are made again from the first copy, which the guess left as it was.
    sp.scale = scale;
    for (const auto& [range, used] : sp.done) sp.landed.push_back(range);
    sp.done.clear();
    sp.updated = 0;
  }
  sp.cv.notify_all();
}

void AdamW::finish_overlapped() {
  if (!spec_ || !spec_->worker.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(spec_->mu);
    spec_->closing = true;
    spec_->cv.notify_all();
  }
  spec_->worker.join();
}

// The offloaded step. Each copy between the model's buffers and the host covers one owned range
// (this rank's chunk, then the shared tail); on a GPU the copies to the host wait for the device
// (the step's reduction and norm), which is why offload trades step time for device memory,
// unless the update already ran during the backward (OffloadOptions::overlap).
void AdamW::step_offloaded(Ctx& ctx, Model& model, double lr, double grad_scale, Tensor norm_sq,
                           double max_norm) {
  finish();  // the previous in-place update (normally done long ago)
  const Tensor p = model.params(), g = model.grads();
  auto owned = [](const Tensor& flat, size_t begin, size_t count) {
    return flat.rows(static_cast<int64_t>(begin), static_cast<int64_t>(begin + count));
  };
  const std::vector<ZeroPartition::Range> ranges = part_.ranges();
  const bool overlapped = spec_ && spec_->worker.joinable();

  MOE_CHECK(!overlapped || grads_on_host_,
            "AdamW: an overlapped step needs the gradients copied to the host during the backward");
  // In place (ZeRO-3 parameter offload) the model's host chunks are the master and the
  // gradients, at the same local offsets; else this rank's ranges are copied in and out.
  char* master_base = static_cast<char*>(offload_.in_place ? p.data : master_.data());
  char* grads_base = static_cast<char*>(offload_.in_place ? g.data : grads_.data());
  if (!offload_.in_place) {
    take_master(model);
    const Tensor grads = local(grads_);
    if (!grads_on_host_)
      for (const auto& r : ranges)
        copy_to_host(owned(grads, r.local, r.count).data, owned(g, part_.model_offset(r), r.count));
    else if (ctx.device.type == DeviceType::cuda)  // copies queued during the backward (and the
      gpu::stream_synchronize(ctx.stream);         // landing hooks queued behind them)
  }
  grads_on_host_ = false;

  AdamWArgs a = host_args(lr, step_, grad_scale);
  a.norm_sq = norm_sq;
  a.max_norm = max_norm;
  double host_norm_sq = 0;
  if (!norm_sq.empty()) copy_to_host(&host_norm_sq, norm_sq);
  double scale = grad_scale;
  // Not finite: skipped, as on a device (an overlapped update is dropped).
  const bool run = host_adamw_scale(a, host_norm_sq, &scale);
  guess_failed_ = !run || scale != grad_scale;
  if (overlapped) {
    decide_overlapped(!run, scale);
    finish_overlapped();
    const Speculation& sp = *spec_;
    if (sp.error) std::rethrow_exception(sp.error);
    MOE_CHECK(!run || (sp.updated == part_.owned() && sp.step == step_ && sp.lr == lr),
              "AdamW: the overlapped update covered " + std::to_string(sp.updated) + " of " +
                  std::to_string(part_.owned()) + " owned elements, or another step");
  }
  if (!run) return;

  char* m_base = static_cast<char*>(m_.data());
  char* v_base = static_cast<char*>(v_.data());
  const HostBases state{master_base, grads_base, m_base, v_base};
  if (overlapped) {  // the second copy holds the update: it becomes the state
    std::swap(master_, next_master_);
    std::swap(m_, next_m_);
    std::swap(v_, next_v_);
  } else {
    // Range by range in local order: one update per (range x weight-decay segment).
    std::vector<std::vector<Item>> work;
    for (const auto& r : ranges)
      work.push_back(items_within(r.global, r.global + r.count, a, scale));
    if (offload_.in_place) {
      // Behind the next forward: the model's gather of a unit waits for that unit's update only
      // (wait_local), so the CPU updates unit u + 1 while the GPU runs unit u.
      Background& bg = *background_;
      bg.done_below = 0;
      const DType dt = dtype_;
      bg.worker = std::thread([&bg, state, dt, work = std::move(work), ranges] {
        for (size_t i = 0; i < work.size(); ++i) {
          run_items(work[i], state, state, dt);
          std::lock_guard<std::mutex> lock(bg.mu);
          bg.done_below = i + 1 < ranges.size() ? ranges[i + 1].local : SIZE_MAX;
          bg.cv.notify_all();
        }
        std::lock_guard<std::mutex> lock(bg.mu);
        bg.done_below = SIZE_MAX;
        bg.cv.notify_all();
      });
      return;
    }
    for (const auto& items : work) run_items(items, state, state, dtype_);
  }
  // Back into the model's weights. Pinned: queued on the step's stream (the next step's copies to
  // the host wait for the device, so the host buffer is not rewritten before this copy is done).
  const Tensor master = local(master_);
  for (const auto& r : ranges) {
    const Tensor dst = owned(p, part_.model_offset(r), r.count);
    const Tensor src = owned(master, r.local, r.count);
    if (master_.pinned())
      gpu::copy_to_device_async(dst.data, src.data, dst.nbytes(), ctx.stream);
    else
      copy_from_host(dst, src.data);
  }
}

void AdamW::wait_local(size_t end) const {
  Background& bg = *background_;
  std::unique_lock<std::mutex> lock(bg.mu);
  bg.cv.wait(lock, [&] { return bg.done_below >= end; });
}

void AdamW::finish() const {
  Background& bg = *background_;
  if (bg.worker.joinable()) bg.worker.join();
}

AdamW::~AdamW() {
  finish();
  finish_overlapped();
}

}  // namespace moe
