// The whole model: embedding -> L layers (Block or ModBlock) -> final norm -> LM head + loss,
// and the backward in reverse. Buffers are planned in the constructor: saved activations by each
// layer's plan(), backward scratch by a dry run of backward (ops skip, the Arena measures).
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "model/layers.hpp"
#include "model/sharded_params.hpp"
#include "moe/model.hpp"
#include "moe/optim.hpp"
#include "common/split_master.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/embedding.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/loss.hpp"
#include "moe/ops/norm.hpp"
#include "moe/ops/optim.hpp"
#include "moe/ops/rope.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/rng.hpp"

namespace moe {

// Page-locked host slots for micro-batch uploads. A slot is rewritten only after the device has
// consumed its previous upload (its event), so the host may run up to kSlots micro-batches
// ahead of the device and never waits for the device to drain.
struct Model::Staging {
  static constexpr int kSlots = 2;
  explicit Staging(size_t tokens) : n(tokens) {
    try {
      for (int i = 0; i < kSlots; ++i) {
        host[i] = static_cast<int32_t*>(gpu::malloc_pinned(2 * n * sizeof(int32_t)));
        event[i] = gpu::event_create();
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~Staging() { release(); }
  // Never throws: it also runs while an error (perhaps a device fault) unwinds the trainer.
  void release() noexcept {
    for (int i = 0; i < kSlots; ++i) {
      try {
        if (used[i]) gpu::event_synchronize(event[i]);  // the copy may still read the slot
      } catch (...) {  // a faulted device: nothing to wait for any more
      }
      gpu::free_pinned(host[i]);
      gpu::event_destroy(event[i]);
      host[i] = nullptr;
      event[i] = nullptr;
    }
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  size_t n;  // tokens per micro-batch (each slot holds ids then targets)
  int next = 0;
  int32_t* host[kSlots] = {};
  void* event[kSlots] = {};
  bool used[kSlots] = {};
};

Model::Model(const ModelConfig& cfg, DType compute, Device dev, int batch, int seq_len,
             bool allocate, MemoryPlan memory, const ParamSharding* sharding)
    : cfg_(cfg),
      compute_(compute),
      param_dtype_(acc_dtype(compute)),
      dev_(dev),
      batch_(batch),
      seq_len_(seq_len),
      allocated_(allocate),
      memory_(memory),
      table_(build_param_table(cfg)),
      acts_(dev),
      scratch_(dev) {
  for (int l = 0; l < cfg.num_hidden_layers; ++l)
    layer_offsets_.push_back(
        table_.find("model.layers." + std::to_string(l) + ".input_layernorm.weight").offset);
  layer_offsets_.push_back(table_.find("model.norm.weight").offset);
  MOE_CHECK(!allocate || compute_ == param_dtype_ || dev.type == DeviceType::cuda,
            std::string("Model: ") + dtype_name(compute_) + " compute needs a GPU");
  MOE_CHECK(!memory_.split_master || (compute_ == DType::bf16 && sharding == nullptr),
            std::string("Model: a split master needs bf16 compute and unsharded weights, got ") +
                dtype_name(compute_) + (sharding != nullptr ? ", ZeRO-3" : ""));
  MOE_CHECK(!memory_.bf16_expert_grads || memory_.split_master,
            "Model: bf16 expert gradients need a split master");
  MOE_CHECK(!memory_.forward_only || sharding == nullptr,
            "Model: a forward-only model is not sharded");
  for (const ParamInfo& p : table_.params) {
    grad_at_.push_back(grad_total_bytes_);
    if (!memory_.forward_only) grad_total_bytes_ += p.numel() * dtype_size(grad_dtype(p));
  }
  if (sharding != nullptr) {
    MOE_CHECK(sharding->partition != nullptr, "Model: sharding without a partition");
    sharded_ = std::make_unique<ShardedParams>(param_unit_bounds(table_, cfg), *sharding->partition,
                                               sharding->comm, param_dtype_, compute_, dev,
                                               allocate, sharding->offload, sharding->pin_memory);
  } else if (allocate) {
    if (!memory_.split_master) param_buf_ = Buffer(dev, table_.total * dtype_size(param_dtype_));
    grad_buf_ = Buffer(dev, grad_total_bytes_);
    if (compute_ != param_dtype_) work_buf_ = Buffer(dev, table_.total * dtype_size(compute_));
  }
  if (memory_.split_master) {
    for (const ParamInfo& p : table_.params) {
      fp32_slot_.push_back(fp32_copy_elems_);
      if (p.fp32_reads) fp32_copy_elems_ += p.numel();
    }
    if (allocate) {
      low_buf_ = Buffer(dev, table_.total * dtype_size(DType::u16));
      fp32_copy_buf_ = Buffer(dev, fp32_copy_elems_ * dtype_size(param_dtype_));
    }
  }
  env_ = std::make_unique<LayerEnv>(LayerEnv{cfg_, compute_, param_dtype_, *this, scratch_,
                                             Tensor(), Tensor(), Tensor(), Tensor(), false});
  const Dims dims{batch, seq_len};
  int moe_index = 0;
  for (int l = 0; l < cfg.num_hidden_layers; ++l) {
    layers_.push_back(make_layer(*env_, l, moe_index, dims));
    if (cfg.is_moe_layer(l)) ++moe_index;
  }
  routing_.expert_load.assign(moe_index, std::vector<double>(cfg.num_local_experts, 0.0));
  plan();  // measure
  Ctx dry{dev, nullptr, nullptr, true};
  if (!allocate) {
    run_layers(dry, !memory_.forward_only, 1.0);  // measure scratch
    return;
  }
  acts_.allocate();
  plan();                                       // place
  run_layers(dry, !memory_.forward_only, 1.0);  // measure scratch (forward and backward)
  scratch_.allocate();
  if (dev.type == DeviceType::cuda)
    staging_ = std::make_unique<Staging>(static_cast<size_t>(batch) * seq_len);
  Ctx ctx = make_ctx(dev);
  rope_table(ctx, rope_cos_, rope_sin_, cfg.rope_theta);
  std::vector<int32_t> pos(static_cast<size_t>(batch) * seq_len);
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>(i % seq_len);
  copy_from_host(pos_, pos.data());
  // The chunks' padding is gathered, never read (offloaded chunks are zeroed host memory).
  if (sharded_ && !sharded_->offloaded()) fill(ctx, params(), 0.0);
  reset_stats(ctx);
}

Model::~Model() = default;

void Model::plan() {
  const int64_t n = static_cast<int64_t>(batch_) * seq_len_, d = cfg_.hidden_size;
  const int64_t half = cfg_.resolved_head_dim() / 2;
  const DType dt = compute_, acc = param_dtype_;
  ids_ = acts_.alloc(DType::i32, {n});
  targets_ = acts_.alloc(DType::i32, {n});
  pos_ = acts_.alloc(DType::i32, {n});
  rope_cos_ = acts_.alloc(acc, {cfg_.max_position_embeddings, half});
  rope_sin_ = acts_.alloc(acc, {cfg_.max_position_embeddings, half});
  stats_ = acts_.alloc(DType::f64, {kStats});
  env_->rope_cos = rope_cos_;
  env_->rope_sin = rope_sin_;
  env_->stats = stats_;
  const auto moe_layers = static_cast<int64_t>(routing_.expert_load.size());
  loads_ = moe_layers > 0 ? acts_.alloc(env_->acc, {moe_layers, cfg_.num_local_experts}) : Tensor();
  env_->loads = loads_;
  stream_.clear();
  for (int l = 0; l <= cfg_.num_hidden_layers; ++l) stream_.push_back(acts_.alloc(dt, {n, d}));
  dstream_a_ = acts_.alloc(dt, {n, d});
  dstream_b_ = acts_.alloc(dt, {n, d});
  xf_ = acts_.alloc(dt, {n, d});
  rstdf_ = acts_.alloc(acc, {n});
  const int64_t chunk =
      memory_.head_chunk_tokens > 0 ? std::min<int64_t>(n, memory_.head_chunk_tokens) : n;
  logits_ = acts_.alloc(dt, {chunk, cfg_.vocab_size});
  losses_ = acts_.alloc(acc, {n});
  lse_ = acts_.alloc(acc, {n});
  for (auto& layer : layers_) layer->plan_state(acts_);
  // Saved activations: each layer its own, or with recomputation one region all layers share
  // (planned from the same mark; the arena keeps the largest).
  const size_t shared = acts_.mark();
  for (auto& layer : layers_) {
    if (memory_.recompute_layers) acts_.release(shared);
    layer->plan(acts_);
  }
}

size_t Model::weight_bytes() const {
  if (sharded_) return sharded_->device_bytes();
  // master (fp32, or split: the low halves beside the compute copy), gradient, compute copy, and
  // a split master's decoded fp32_reads parameters
  size_t per = memory_.split_master ? dtype_size(DType::u16) : dtype_size(param_dtype_);
  if (compute_ != param_dtype_) per += dtype_size(compute_);
  return table_.total * per + grad_total_bytes_ + fp32_copy_elems_ * dtype_size(param_dtype_);
}

size_t Model::grad_bytes() const {
  return grad_total_bytes_;
}

DType Model::grad_dtype(const ParamInfo& p) const {
  return memory_.bf16_expert_grads && p.stack > 1 ? DType::bf16 : param_dtype_;
}

Tensor Model::params() const {
  if (sharded_) return sharded_->master_shard();
  MOE_CHECK(!memory_.split_master,
            "Model::params: the master is split (bf16 compute copy + low halves); use "
            "master_to_host / master_from_host");
  return param_buf_.as(param_dtype_, {static_cast<int64_t>(table_.total)});
}
Tensor Model::master_low() const {
  if (!memory_.split_master || !allocated_) return Tensor();
  return low_buf_.as(DType::u16, {static_cast<int64_t>(table_.total)});
}
Tensor Model::grads() const {
  if (sharded_) return sharded_->grad_shard();
  MOE_CHECK(!memory_.bf16_expert_grads,
            "Model::grads: the gradients are f32 and bf16 (train.bf16_expert_grads); use "
            "grad_spans");
  if (memory_.forward_only) return Tensor();
  return grad_buf_.as(param_dtype_, {static_cast<int64_t>(table_.total)});
}

std::vector<Model::GradSpan> Model::grad_spans(size_t begin, size_t end) const {
  MOE_CHECK(begin <= end && end <= table_.total, "Model::grad_spans: range out of bounds");
  if (!memory_.bf16_expert_grads)
    return {{begin, grads().rows(static_cast<int64_t>(begin), static_cast<int64_t>(end))}};
  // Adjacent parameters of one dtype are adjacent in grad_buf_ too: one run.
  std::vector<GradSpan> spans;
  for (size_t i = 0; i < table_.params.size(); ++i) {
    const ParamInfo& p = table_.params[i];
    const size_t b = std::max(begin, p.offset), e = std::min(end, p.offset + p.numel());
    if (b >= e) continue;
    const DType dt = grad_dtype(p);
    if (!spans.empty() && spans.back().g.dtype == dt &&
        spans.back().begin + static_cast<size_t>(spans.back().g.numel()) == b) {
      Tensor& g = spans.back().g;
      g = Tensor(g.data, dt, dev_, {g.numel() + static_cast<int64_t>(e - b)});
      continue;
    }
    char* at = grad_buf_.data() != nullptr ? static_cast<char*>(grad_buf_.data()) + grad_at_[i] +
                                                 (b - p.offset) * dtype_size(dt)
                                           : nullptr;
    spans.push_back({b, Tensor(at, dt, dev_, {static_cast<int64_t>(e - b)})});
  }
  return spans;
}
Tensor Model::compute_params() const {
  if (sharded_ || compute_ == param_dtype_ || !allocated_) return Tensor();
  return work_buf_.as(compute_, {static_cast<int64_t>(table_.total)});
}

static Tensor param_view(const Buffer& buf, bool allocated, DType dt, Device dev,
                         const ParamInfo& p) {
  void* data = allocated ? static_cast<char*>(buf.data()) + p.offset * dtype_size(dt) : nullptr;
  return p.view(data, dt, dev);
}

Tensor Model::param(const ParamInfo& p) const {
  if (sharded_) return sharded_->master(p);
  if (memory_.split_master) {
    // Only the fp32_reads parameters have an fp32 copy; the others' master views are never read
    // (the layers read work()), so they get no storage: a null view.
    if (!p.fp32_reads || !allocated_) return p.view(nullptr, param_dtype_, dev_);
    const size_t index = static_cast<size_t>(&p - table_.params.data());
    return p.view(
        static_cast<char*>(fp32_copy_buf_.data()) + fp32_slot_.at(index) * dtype_size(param_dtype_),
        param_dtype_, dev_);
  }
  return param_view(param_buf_, allocated_, param_dtype_, dev_, p);
}
Tensor Model::grad(const ParamInfo& p) const {
  if (sharded_) return sharded_->grad(p);
  // (p may come from another table of the same layout: found by its offset)
  const auto at =
      std::lower_bound(table_.params.begin(), table_.params.end(), p.offset,
                       [](const ParamInfo& q, size_t offset) { return q.offset < offset; });
  MOE_CHECK(at != table_.params.end() && at->offset == p.offset && at->numel() == p.numel(),
            "Model::grad: " + p.name + " is not a parameter of this model's layout");
  const size_t index = static_cast<size_t>(at - table_.params.begin());
  void* data = grad_buf_.data() != nullptr ? static_cast<char*>(grad_buf_.data()) + grad_at_[index]
                                           : nullptr;
  return p.view(data, grad_dtype(p), dev_);
}
Tensor Model::work(const ParamInfo& p) const {
  if (sharded_) return sharded_->work(p);
  if (compute_ == param_dtype_) return param(p);
  return param_view(work_buf_, allocated_, compute_, dev_, p);
}

void Model::zero_grads(Ctx& ctx, bool experts_by_backward) {
  MOE_CHECK(!memory_.forward_only, "Model::zero_grads: the model is forward-only");
  experts_overwrite_ = false;
  if (sharded_ && sharded_->offloaded()) {
    // Host chunks: the step's first backward overwrites them (no pass over host memory here).
    sharded_->grads_zeroed();
    return;
  }
  if (sharded_) {
    fill(ctx, grads(), 0.0);
    return;
  }
  if (!experts_by_backward) {
    for (const GradSpan& s : grad_spans()) fill(ctx, s.g, 0.0);
    return;
  }
  // Everything but the expert stacks (the only parameters with stack > 1), in runs of adjacent
  // parameters.
  size_t begin = 0;
  auto clear = [&](size_t end) {
    if (end > begin)
      for (const GradSpan& s : grad_spans(begin, end)) fill(ctx, s.g, 0.0);
  };
  for (const ParamInfo& p : table_.params) {
    if (p.stack == 1) continue;
    clear(p.offset);
    begin = p.offset + p.numel();
  }
  clear(table_.total);
  experts_overwrite_ = true;
}

void Model::weights_changed(Ctx& ctx, bool compute_copy_current) {
  if (sharded_) {  // the next use of each unit gathers (and converts) it again
    sharded_->invalidate();
    return;
  }
  weights_changed(ctx, compute_copy_current, 0, table_.total);
}

void Model::weights_changed(Ctx& ctx, bool compute_copy_current, size_t begin, size_t end) {
  MOE_CHECK(!sharded_, "Model::weights_changed: a range of ZeRO-3 parameters");
  MOE_CHECK(begin <= end && end <= table_.total, "Model::weights_changed: range out of bounds");
  if (memory_.split_master) {  // the compute copy is the master's high half: always current
    const Tensor hi = compute_params(), lo = master_low();
    for (const ParamInfo& p : table_.params) {
      if (!p.fp32_reads || p.offset < begin || p.offset + p.numel() > end) continue;
      const auto b = static_cast<int64_t>(p.offset), e = b + static_cast<int64_t>(p.numel());
      split_master_decode(ctx, param(p).view({e - b}), hi.rows(b, e), lo.rows(b, e));
    }
    return;
  }
  const Tensor compute = compute_params();
  if (compute.empty() || compute_copy_current || begin == end) return;
  const auto b = static_cast<int64_t>(begin), e = static_cast<int64_t>(end);
  convert(ctx, compute.rows(b, e), params().rows(b, e), false);
}

namespace {

// A split master's elements [begin, end) to / from host fp32, through bounded host staging.
constexpr size_t kSplitPiece = size_t{1} << 22;

void split_master_to_host(const Tensor& hi, const Tensor& lo, size_t begin, size_t end,
                          float* out) {
  std::vector<uint16_t> h(std::min(kSplitPiece, end - begin)), l(h.size());
  for (size_t b = begin; b < end; b += kSplitPiece) {
    const size_t e = std::min(end, b + kSplitPiece);
    const auto rb = static_cast<int64_t>(b), re = static_cast<int64_t>(e);
    copy_to_host(h.data(), hi.rows(rb, re));
    copy_to_host(l.data(), lo.rows(rb, re));
    for (size_t i = 0; i < e - b; ++i) out[b - begin + i] = split_master_decode_one(h[i], l[i]);
  }
}

void split_master_from_host(const Tensor& hi, const Tensor& lo, size_t begin, size_t end,
                            const float* in) {
  std::vector<uint16_t> h(std::min(kSplitPiece, end - begin)), l(h.size());
  for (size_t b = begin; b < end; b += kSplitPiece) {
    const size_t e = std::min(end, b + kSplitPiece);
    for (size_t i = 0; i < e - b; ++i) split_master_encode_one(in[b - begin + i], &h[i], &l[i]);
    const auto rb = static_cast<int64_t>(b), re = static_cast<int64_t>(e);
    copy_from_host(hi.rows(rb, re), h.data());
    copy_from_host(lo.rows(rb, re), l.data());
  }
}

}  // namespace

void Model::master_to_host(size_t begin, size_t end, void* host) const {
  MOE_CHECK(!sharded_ && begin <= end && end <= table_.total,
            "Model::master_to_host: elements [" + std::to_string(begin) + ", " +
                std::to_string(end) + ") of " + std::to_string(table_.total) +
                (sharded_ ? " (ZeRO-3: gather_params)" : ""));
  if (begin == end) return;
  if (memory_.split_master)
    return split_master_to_host(compute_params(), master_low(), begin, end,
                                static_cast<float*>(host));
  copy_to_host(host, params().rows(static_cast<int64_t>(begin), static_cast<int64_t>(end)));
}

void Model::master_from_host(size_t begin, size_t end, const void* host) {
  MOE_CHECK(!sharded_ && begin <= end && end <= table_.total,
            "Model::master_from_host: elements [" + std::to_string(begin) + ", " +
                std::to_string(end) + ") of " + std::to_string(table_.total) +
                (sharded_ ? " (ZeRO-3: scatter_params)" : ""));
  if (memory_.split_master)
    split_master_from_host(compute_params(), master_low(), begin, end,
                           static_cast<const float*>(host));
  else if (begin < end)
    copy_from_host(params().rows(static_cast<int64_t>(begin), static_cast<int64_t>(end)), host);
}

// Normal(0, initializer_range) for matrices, scaled by 1/sqrt(2L) for residual output
// projections (GPT-2), ones for norms. Each parameter draws from its own stream seeded by its
// name, so the weights do not depend on the layout order, and the parameters of a batch are drawn
// in parallel (a billion-parameter model would take minutes one at a time); a batch holds at
// most 2^30 values (or one larger parameter), which bounds the host memory.
void Model::init_weights(uint64_t seed) {
  const double std0 = cfg_.initializer_range;
  const double std_res = std0 / std::sqrt(2.0 * cfg_.num_hidden_layers);
  Ctx ctx = make_ctx(dev_);
  const std::vector<ParamInfo>& ps = table_.params;
  const size_t budget = size_t{1} << 30;
  for (size_t first = 0; first < ps.size();) {
    size_t last = first, elems = 0;
    while (last < ps.size() && (last == first || elems + ps[last].numel() <= budget))
      elems += ps[last++].numel();
    std::vector<std::vector<double>> f64(param_dtype_ == DType::f64 ? last - first : 0);
    std::vector<std::vector<float>> f32(param_dtype_ == DType::f64 ? 0 : last - first);
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t i = first; i < last; ++i) {
      const ParamInfo& p = ps[i];
      auto draw = [&](auto& host) {
        host.resize(p.numel());
        if (p.kind == ParamKind::norm) {
          std::fill(host.begin(), host.end(), 1.0f);
          return;
        }
        Rng rng(hash_name(p.name, seed));
        const double s = p.kind == ParamKind::residual ? std_res : std0;
        using T = typename std::decay_t<decltype(host)>::value_type;
        for (auto& v : host) v = static_cast<T>(s * rng.normal());
      };
      if (f64.empty())
        draw(f32[i - first]);
      else
        draw(f64[i - first]);
    }
    for (size_t i = first; i < last; ++i)
      write_param(ps[i], f64.empty() ? static_cast<const void*>(f32[i - first].data())
                                     : static_cast<const void*>(f64[i - first].data()));
    first = last;
  }
  if (!memory_.forward_only) zero_grads(ctx);
  weights_changed(ctx);
}

// ZeRO-3: only the elements of this rank's chunks are stored. `host`: p.numel() values of the
// master dtype.
void Model::write_param(const ParamInfo& p, const void* host) {
  const size_t elem = dtype_size(param_dtype_);
  auto put = [&](const Tensor& dst, size_t from) {  // dst <- host[from, from + dst.numel())
    copy_from_host(dst, static_cast<const char*>(host) + from * elem);
  };
  if (memory_.split_master) {
    split_master_from_host(compute_params(), master_low(), p.offset, p.offset + p.numel(),
                           static_cast<const float*>(host));
    return;
  }
  if (!sharded_) {
    put(param(p), 0);
    return;
  }
  for (const ZeroPartition::Range& r : sharded_->partition().ranges()) {
    const size_t b = std::max(r.global, p.offset);
    const size_t e = std::min(r.global + r.count, p.offset + p.numel());
    if (b >= e) continue;
    const auto at = static_cast<int64_t>(r.local + (b - r.global));
    put(params().rows(at, at + static_cast<int64_t>(e - b)), b - p.offset);
  }
}

void Model::gather_params(Ctx& ctx, void* host) {
  MOE_CHECK(sharded_ != nullptr, "Model::gather_params: the parameters are not sharded");
  const size_t elem = dtype_size(param_dtype_);
  const std::vector<size_t> bounds = param_unit_bounds(table_, cfg_);
  for (int u = 0; u + 1 < static_cast<int>(bounds.size()); ++u) {
    sharded_->acquire(ctx, u);
    if (host == nullptr) continue;
    const auto n = static_cast<int64_t>(bounds[u + 1] - bounds[u]);
    copy_to_host(static_cast<char*>(host) + bounds[u] * elem, sharded_->unit_master(u).rows(0, n));
  }
}

void Model::set_chunk_wait(std::function<void(size_t local_end)> wait) {
  MOE_CHECK(sharded_ != nullptr, "Model::set_chunk_wait: the parameters are not sharded");
  sharded_->set_chunk_wait(std::move(wait));
}

void Model::scatter_params(Ctx& ctx, const void* host) {
  MOE_CHECK(sharded_ != nullptr, "Model::scatter_params: the parameters are not sharded");
  const size_t elem = dtype_size(param_dtype_);
  for (const ZeroPartition::Range& r : sharded_->partition().ranges()) {
    const auto at = static_cast<int64_t>(r.local);
    copy_from_host(params().rows(at, at + static_cast<int64_t>(r.count)),
                   static_cast<const char*>(host) + r.global * elem);
  }
  weights_changed(ctx);
}

void Model::reset_stats(Ctx& ctx) {
  fill(ctx, stats_, 0.0);
  if (!loads_.empty()) fill(ctx, loads_, 0.0);
  routing_.reset();
  micro_batches_ = 0;
}

void Model::upload_batch(Ctx& ctx, const int32_t* ids, const int32_t* targets) {
  const int64_t n = static_cast<int64_t>(batch_) * seq_len_;
  const int vocab = cfg_.vocab_size;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      throw InputError("token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                       " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  valid_targets_ = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (targets[i] >= vocab)  // negative targets are ignored positions
      throw InputError("target id " + std::to_string(targets[i]) + " at position " +
                       std::to_string(i) + " is outside the vocabulary [0, " +
                       std::to_string(vocab) + ")");
    valid_targets_ += targets[i] >= 0 ? 1 : 0;
  }
  if (!staging_) {
    copy_from_host(ids_, ids);
    copy_from_host(targets_, targets);
    return;
  }
  Staging& st = *staging_;
  const int slot = st.next;
  st.next = (slot + 1) % Staging::kSlots;
  if (st.used[slot]) gpu::event_synchronize(st.event[slot]);  // its previous upload has landed
  std::copy(ids, ids + n, st.host[slot]);
  std::copy(targets, targets + n, st.host[slot] + n);
  const size_t bytes = static_cast<size_t>(n) * sizeof(int32_t);
  gpu::copy_to_device_async(ids_.data, st.host[slot], bytes, ctx.stream);
  gpu::copy_to_device_async(targets_.data, st.host[slot] + n, bytes, ctx.stream);
  gpu::event_record(st.event[slot], ctx.stream);
  st.used[slot] = true;
}

void Model::queue_forward_backward(Ctx& ctx, double grad_scale, const GradientReady& ready) {
  MOE_CHECK(!memory_.forward_only, "Model::queue_forward_backward: the model is forward-only");
  run_layers(ctx, true, grad_scale, ready);
  ++micro_batches_;
}

void Model::queue_forward(Ctx& ctx) {
  run_layers(ctx, false, 0.0);
  ++micro_batches_;
}

Losses Model::forward_backward(Ctx& ctx, const int32_t* ids, const int32_t* targets,
                               double grad_scale) {
  reset_stats(ctx);
  upload_batch(ctx, ids, targets);
  queue_forward_backward(ctx, grad_scale);
  return read_stats(ctx);
}

Losses Model::forward(Ctx& ctx, const int32_t* ids, const int32_t* targets) {
  reset_stats(ctx);
  upload_batch(ctx, ids, targets);
  queue_forward(ctx);
  return read_stats(ctx);
}

void Model::raise_step_flag(Ctx& ctx, int flag) {
  MOE_CHECK(0 <= flag && flag < kStepFlags, "step flag " + std::to_string(flag));
  fill(ctx, stats_.rows(kStatFlags + flag, kStatFlags + flag + 1), 1.0);
}

Losses Model::read_stats(Ctx& ctx) {
  double sums[kStats];
  copy_to_host(ctx, sums, stats_);  // waits for ctx's stream
  const double m = micro_batches_ > 0 ? static_cast<double>(micro_batches_) : 1.0;
  Losses l;
  l.lm = sums[kStatLm] / m;
  l.aux = sums[kStatAux] / m;
  l.z = sums[kStatZ] / m;
  l.mod_pred = sums[kStatModPred] / m;
  for (int i = 0; i < kStepFlags; ++i) l.flags[i] = sums[kStatFlags + i];
  if (loads_.empty()) return l;
  // One read of every MoE layer's loads (a copy a layer waited on the device once each).
  const auto e = static_cast<size_t>(loads_.size(1));
  if (loads_.dtype == DType::f64) {
    host_loads_.resize(loads_.numel());
    copy_to_host(ctx, host_loads_.data(), loads_);
    for (size_t i = 0; i < routing_.expert_load.size(); ++i)
      routing_.expert_load[i].assign(host_loads_.begin() + i * e,
                                     host_loads_.begin() + (i + 1) * e);
  } else {
    host_loads_f32_.resize(loads_.numel());
    copy_to_host(ctx, host_loads_f32_.data(), loads_);
    for (size_t i = 0; i < routing_.expert_load.size(); ++i)
      routing_.expert_load[i].assign(host_loads_f32_.begin() + i * e,
                                     host_loads_f32_.begin() + (i + 1) * e);
  }
  return l;
}

// Embedding -> layers -> final norm -> head -> per-token losses (summed into stats_ as this
// micro-batch's mean), then the backward when asked. Works in dry-run mode too (the planning
// pass that measures the scratch arena).
// ZeRO-3 (sharded_): unit 0 is the embedding, unit l + 1 layer l, the last the final norm and
// head; each is gathered before it runs, the next one while it runs (ShardedParams).
void Model::run_layers(Ctx& ctx, bool backward_too, double grad_scale, const GradientReady& ready) {
  const int last_unit = static_cast<int>(layers_.size()) + 1;
  acquire_unit(ctx, 0);
  const auto& embed = table_.find("model.embed_tokens.weight");
  embedding_forward(ctx, stream_[0], ids_, work(embed));
  for (size_t l = 0; l < layers_.size(); ++l) {
    acquire_unit(ctx, static_cast<int>(l) + 1);
    layers_[l]->forward(ctx, stream_[l + 1], stream_[l], pos_);
  }
  acquire_unit(ctx, last_unit);
  const auto& normf = table_.find("model.norm.weight");
  rmsnorm_forward(ctx, xf_, rstdf_, stream_.back(), work(normf), cfg_.rms_norm_eps);
  const double per_valid = valid_targets_ > 0 ? 1.0 / static_cast<double>(valid_targets_) : 0.0;
  if (backward_too) {  // the head's forward runs chunk by chunk with its backward
    // The first backward after zero_grads(ctx, true) writes the experts' weight gradients (a dry
    // run, which measures scratch, leaves that to the real one).
    backward(ctx, grad_scale, grad_scale * per_valid, ready);
    if (!ctx.dry_run) experts_overwrite_ = false;
  } else {
    head_chunks(ctx, false, 0.0);
    if (sharded_) sharded_->flush(ctx);
  }
  accumulate_sum(ctx, stats_.rows(kStatLm, kStatLm + 1), losses_, per_valid);
}

// Chunk c covers tokens [c0, c0 + rows) of xf_ and its logits the first `rows` rows of logits_
// (the whole buffer, or less for the last chunk).
void Model::head_chunks(Ctx& ctx, bool backward_too, double ce_scale) {
  const auto& head =
      table_.find(cfg_.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
  const int64_t n = xf_.size(0), chunk = logits_.size(0);
  for (int64_t c0 = 0; c0 < n; c0 += chunk) {
    const int64_t c1 = std::min(n, c0 + chunk);
    Tensor logits = logits_.rows(0, c1 - c0), xf = xf_.rows(c0, c1);
    Tensor targets = targets_.rows(c0, c1);
    linear_forward(ctx, logits, xf, work(head), false);
    if (!backward_too) {
      cross_entropy_forward(ctx, losses_.rows(c0, c1), lse_.rows(c0, c1), logits, targets);
      continue;
    }
    // the loss and its gradient over the logits in place, from one read of them
    cross_entropy_forward_backward(ctx, losses_.rows(c0, c1), lse_.rows(c0, c1), logits, logits,
                                   targets, ce_scale);
    linear_backward(ctx, dstream_b_.rows(c0, c1), grad(head), logits, xf, work(head), false);
  }
}

void Model::acquire_unit(Ctx& ctx, int unit) {
  if (unit_wait_ && !ctx.dry_run) unit_wait_(ctx, unit);
  if (!sharded_) return;
  sharded_->acquire(ctx, unit);
  sharded_->prefetch(ctx, unit + 1);
}

// ce_scale = grad_scale / valid targets: d loss / d logits = (softmax - onehot) / valid.
// The parameter layout is embedding, layers 0..L-1, final norm, head (params.cpp), so the
// backward finishes gradient ranges from the end of the buffer toward its start.
void Model::backward(Ctx& ctx, double grad_scale, double ce_scale, const GradientReady& ready) {
  auto finished = [&](int unit, size_t begin, size_t end) {
    if (sharded_) sharded_->grads_done(ctx, unit);
    if (ready && !ctx.dry_run) ready(ctx, begin, end);
  };
  const size_t num_layers = layers_.size();
  const auto& embed = table_.find("model.embed_tokens.weight");
  const auto& normf = table_.find("model.norm.weight");
  const int last_unit = static_cast<int>(num_layers) + 1;
  if (sharded_) {  // a tied head writes into the embedding's gradient
    sharded_->begin_grads(ctx, last_unit);
    sharded_->begin_grads(ctx, 0);
  }
  head_chunks(ctx, true, ce_scale);  // the head's forward and backward, chunk by chunk
  rmsnorm_backward(ctx, dstream_a_, grad(normf), dstream_b_, stream_.back(), work(normf), rstdf_);
  finished(last_unit, layer_offsets_[num_layers], table_.total);  // final norm, untied head
  Tensor dout = dstream_a_, dx = dstream_b_;
  for (size_t l = layers_.size(); l-- > 0;) {
    const int unit = static_cast<int>(l) + 1;
    if (sharded_) {
      sharded_->acquire(ctx, unit);
      sharded_->begin_grads(ctx, unit);
      sharded_->prefetch(ctx, unit - 1);
    }
    if (memory_.recompute_layers) {  // rebuild this layer's activations from its saved input
      env_->recomputing = true;
      layers_[l]->forward(ctx, stream_[l + 1], stream_[l], pos_);
      env_->recomputing = false;
    }
    layers_[l]->backward(ctx, dx, dout, stream_[l], pos_, grad_scale);
    finished(unit, layer_offsets_[l], layer_offsets_[l + 1]);
    if (!layers_[l]->backward_in_place()) std::swap(dx, dout);
  }
  embedding_backward(ctx, grad(embed), dout, ids_);
  finished(0, 0, layer_offsets_[0]);  // the embedding (a tied head wrote into it first)
  if (sharded_) sharded_->flush(ctx);
}

std::vector<Tensor> Model::router_biases() const {
  std::vector<Tensor> out;
  for (const auto& layer : layers_) layer->collect_state(out);
  return out;
}

void Model::after_step(Ctx& ctx) {
  for (auto& layer : layers_) layer->after_step(ctx);
}

// maxvio of one layer: max_e load_e / mean_e load_e - 1 (0 when nothing was routed).
static double layer_maxvio(const std::vector<double>& load) {
  double mx = 0, mean = 0;
  for (double v : load) mx = std::max(mx, v), mean += v;
  mean /= static_cast<double>(load.size());
  return mean > 0 ? mx / mean - 1 : 0;
}

double RoutingStats::maxvio_mean() const {
  if (expert_load.empty()) return 0;
  double s = 0;
  for (const auto& load : expert_load) s += layer_maxvio(load);
  return s / static_cast<double>(expert_load.size());
}

double RoutingStats::maxvio_max() const {
  double best = 0;
  for (const auto& load : expert_load) best = std::max(best, layer_maxvio(load));
  return best;
}

void RoutingStats::reset() {
  for (auto& load : expert_load) std::fill(load.begin(), load.end(), 0.0);
  mod_kept = mod_seen = 0;
}

}  // namespace moe
