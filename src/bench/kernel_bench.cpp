// The kernel benchmark behind `moe-train bench` (see kernel_bench.hpp). Each family runs the
// trainer's own ops on buffers shaped like one micro-batch of the config; bytes and FLOPs are
// counted from the shapes (the minimum traffic: every input read once, every output written once).
#include "bench/kernel_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <utility>

#include "moe/cuda_runtime.hpp"
#include "moe/memory.hpp"
#include "moe/ops/attention.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/embedding.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/loss.hpp"
#include "moe/ops/mod.hpp"
#include "moe/ops/norm.hpp"
#include "moe/ops/optim.hpp"
#include "moe/ops/permute.hpp"
#include "moe/ops/router.hpp"
#include "moe/ops/swiglu.hpp"

namespace moe {
namespace {

// Device buffers that own their memory, filled with random values.
class Pool {
 public:
  Pool(Ctx& ctx, uint64_t seed) : ctx_(ctx), rng_(seed) {}

  Tensor zeros(DType t, std::initializer_list<int64_t> dims) {
    Tensor shape(nullptr, t, ctx_.device, dims);
    buffers_.push_back(std::make_unique<Buffer>(ctx_.device, shape.nbytes()));
    shape.data = buffers_.back()->data();
    return shape;
  }
  // Uniform in [lo, hi), never exactly zero, in any float dtype. Drawn in chunks of 1 Mi values
  // on the host's threads, each chunk from a generator of its own seeded from one draw of the
  // pool's: the same values for any thread count (drawn on one thread, moe-fine's ~1.5 G input
  // values kept the GPU waiting: no moe-fine bench run finished within 25 s).
  Tensor random(DType t, std::initializer_list<int64_t> dims, float lo = -1, float hi = 1) {
    Tensor out = zeros(t, dims);
    const int64_t count = out.numel();
    std::vector<float> host(static_cast<size_t>(count));
    constexpr int64_t kChunk = int64_t{1} << 20;
    const uint64_t base = rng_();
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < (count + kChunk - 1) / kChunk; ++c) {
      std::mt19937_64 gen(base + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(c + 1));
      std::uniform_real_distribution<float> u(lo, hi);
      for (int64_t i = c * kChunk; i < std::min(count, (c + 1) * kChunk); ++i) {
        const float v = u(gen);
        host[static_cast<size_t>(i)] = v == 0 ? 0.25f * hi : v;
      }
    }
    if (t == DType::f32) {
      copy_from_host(out, host.data());
    } else {
      Buffer staging(ctx_.device, host.size() * sizeof(float));
      Tensor f = staging.as(DType::f32, {out.numel()});
      copy_from_host(f, host.data());
      convert(ctx_, out.view({out.numel()}), f, false);
      gpu_sync();
    }
    return out;
  }
  Tensor ints(std::initializer_list<int64_t> dims, const std::vector<int32_t>& values) {
    Tensor out = zeros(DType::i32, dims);
    copy_from_host(out, values.data());
    return out;
  }
  std::mt19937_64& rng() {
    return rng_;
  }

 private:
  void gpu_sync() {
    if (ctx_.device.type == DeviceType::cuda) gpu::stream_synchronize(ctx_.stream);
  }
  Ctx& ctx_;
  std::mt19937_64 rng_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
};

// Samples of an op's time per call: CUDA events on the op stream on a GPU (device time, no host
// overhead), a steady clock on the CPU. On a GPU a sample times `reps` back-to-back calls and
// divides: a kernel of a few microseconds timed alone would also count the gap while the host
// enqueues it after the start event, which it does not cost inside a training step, where
// launches queue ahead of the GPU. prepare() makes a sample last about a millisecond (1 to 64
// calls), from one call timed alone after a warm-up call.
class Sampler {
 public:
  explicit Sampler(Ctx& ctx) : ctx_(ctx), gpu_(ctx.device.type == DeviceType::cuda) {
    if (!gpu_) return;
    start_ = gpu::event_create_timed();
    stop_ = gpu::event_create_timed();
  }
  ~Sampler() {
    if (!gpu_) return;
    gpu::event_destroy(start_);
    gpu::event_destroy(stop_);
  }
  Sampler(const Sampler&) = delete;
  Sampler& operator=(const Sampler&) = delete;

  // The calls per sample of fn (after its warm-up call).
  int prepare(const std::function<void()>& fn) {
    fn();
    if (!gpu_) return 1;
    const double alone = sample(fn, 1);
    return static_cast<int>(std::clamp(std::lround(1.0 / std::max(alone, 1e-3)), 1L, 64L));
  }
  // Milliseconds per call over one sample of `reps` calls.
  double sample(const std::function<void()>& fn, int reps) {
    if (!gpu_) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) fn();
      const auto t1 = std::chrono::steady_clock::now();
      return std::chrono::duration<double, std::milli>(t1 - t0).count() / reps;
    }
    gpu::event_record(start_, ctx_.stream);
    for (int r = 0; r < reps; ++r) fn();
    gpu::event_record(stop_, ctx_.stream);
    gpu::event_synchronize(stop_);
    return gpu::event_elapsed_ms(start_, stop_) / reps;
  }

 private:
  Ctx& ctx_;
  bool gpu_;
  void* start_ = nullptr;
  void* stop_ = nullptr;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median time per call of fn over `iters` samples.
double median_ms(Ctx& ctx, int iters, const std::function<void()>& fn) {
  Sampler s(ctx);
  const int reps = s.prepare(fn);
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) times.push_back(s.sample(fn, reps));
  return median(times);
}

// Median times per call of fn and of ref over `iters` samples each, taken in turn (fn, ref, fn,
// ...): a GPU's clocks move with its power and temperature over a run, and a reference timed
// once at its start would set rows timed later against other clocks than theirs.
std::pair<double, double> paired_median_ms(Ctx& ctx, int iters, const std::function<void()>& fn,
                                           const std::function<void()>& ref) {
  Sampler s(ctx);
  const int reps = s.prepare(fn), ref_reps = s.prepare(ref);
  std::vector<double> times, ref_times;
  for (int i = 0; i < iters; ++i) {
    times.push_back(s.sample(fn, reps));
    ref_times.push_back(s.sample(ref, ref_reps));
  }
  return {median(times), median(ref_times)};
}

// Expert offsets [E+1] for R rows with the given maxvio: expert 0 takes (1 + maxvio) times the
// mean (at most all R), the others share the rest evenly.
std::vector<int32_t> skewed_offsets(int64_t rows, int64_t experts, double maxvio) {
  const double mean = static_cast<double>(rows) / static_cast<double>(experts);
  const int64_t top = std::min<int64_t>(rows, std::llround((1 + maxvio) * mean));
  std::vector<int32_t> off(static_cast<size_t>(experts) + 1, 0);
  int64_t rest = rows - top, at = top;
  off[1] = static_cast<int32_t>(top);
  for (int64_t e = 1; e < experts; ++e) {
    const int64_t share = rest / (experts - e);
    at += share;
    rest -= share;
    off[static_cast<size_t>(e) + 1] = static_cast<int32_t>(at);
  }
  return off;
}

std::string shape(std::initializer_list<int64_t> dims) {
  std::string s;
  for (int64_t v : dims) s += (s.empty() ? "" : "x") + std::to_string(v);
  return s;
}

// Whether `family` is one of the rows asked for (see BenchOptions::families). A family missing
// from bench_families() is a bug here: --family is checked against that list.
bool selected(const std::string& family, const std::vector<std::string>& families) {
  const auto& all = bench_families();
  if (std::find(all.begin(), all.end(), family) == all.end())
    throw std::logic_error("bench family \"" + family + "\" is not in bench_families()");
  if (families.empty() || family == "copy" || family.rfind("dense_gemm", 0) == 0) return true;
  for (const std::string& f : families)
    if (family.rfind(f, 0) == 0) return true;
  return false;
}

}  // namespace

const std::vector<std::string>& bench_families() {
  // clang-format off
  static const std::vector<std::string> families = {
      "copy", "dense_gemm", "dense_gemm_bwd", "router_topk", "router", "permute", "combine",
      "combine_add", "grouped_gemm", "grouped_gemm_bwd", "adamw_split", "adamw_split_norm",
      "adamw_rider", "grouped_swiglu", "grouped_swiglu_gathered", "overlap_serial", "overlap_side",
      "grouped_swiglu_bwd", "swiglu_weighted_bwd", "linear_proj", "linear_proj_bwd", "linear_qkv",
      "linear_qkv_bwd", "lm_head", "lm_head_bwd", "router_linear", "router_linear_bwd",
      "router_logits", "router_logits_bwd", "swiglu", "rmsnorm", "add_rmsnorm", "rmsnorm_bwd_add",
      "attention_fwd", "attention_bwd", "mod_select_scores", "mod_select", "mod_select_2op",
      "mod_gather", "mod_scatter", "residual_add", "embedding_bwd", "cross_entropy_fwd",
      "cross_entropy_bwd", "cross_entropy_fused", "adamw", "zero_grads"};
  // clang-format on
  return families;
}

bool names_a_family(const std::string& prefix) {
  for (const std::string& f : bench_families())
    if (f.rfind(prefix, 0) == 0) return true;
  return false;
}

std::vector<BenchRow> run_kernel_bench(const ModelConfig& m, int batch, int seq_len, DType dt,
                                       Device dev, const BenchOptions& opt) {
  Ctx ctx = make_ctx(dev);
  Pool pool(ctx, 7);
  const DType acc = acc_dtype(dt);
  const int64_t n = int64_t(batch) * seq_len, d = m.hidden_size, e = m.num_local_experts;
  const int64_t k = m.num_experts_per_tok, f = m.intermediate_size, r = n * k;
  const int64_t es = static_cast<int64_t>(dtype_size(dt)),
                as = static_cast<int64_t>(dtype_size(acc));
  const int iters = std::max(1, opt.iters);
  std::vector<BenchRow> rows;
  auto add = [&](std::string family, std::string detail, double work, bool flops, double roof,
                 double target, const std::function<void()>& fn) {
    if (!selected(family, opt.families)) return BenchRow{};
    BenchRow row{
        std::move(family), std::move(detail), median_ms(ctx, iters, fn), work, flops, roof, target};
    rows.push_back(row);
    return row;
  };
  // A matmul row set against a reference GEMM of ref_flops timed in turn with it (see
  // paired_median_ms): its roofline is the reference's rate over the same stretch of the run.
  auto add_against = [&](std::string family, std::string detail, double flops, double target,
                         double ref_flops, const std::function<void()>& ref,
                         const std::function<void()>& fn) {
    if (!selected(family, opt.families)) return;
    const auto [ms, ref_ms] = paired_median_ms(ctx, iters, fn, ref);
    rows.push_back(BenchRow{std::move(family), std::move(detail), ms, flops, true,
                            ref_flops / (ref_ms * 1e-3), target});
  };

  // ---- references: copy bandwidth, dense GEMM rate at the expert GEMM's shape ----
  // The copy moves at least 2 x 256 MiB, several times the L2 (50 MiB on an H200): a smaller one
  // (moe-t4's 2 x 16 MiB) ran from L2 at 5.2 TB/s and understated every row's share of DRAM's rate.
  const int64_t copy_elems = std::max<int64_t>(r * d, (int64_t{256} << 20) / es);
  Tensor src = pool.random(dt, {copy_elems}), dst = pool.zeros(dt, {copy_elems});
  const double copy_bytes = 2.0 * static_cast<double>(copy_elems * es);
  BenchRow copy_row = add("copy", shape({copy_elems}) + " " + dtype_name(dt), copy_bytes, false, 0,
                          0, [&] { copy(ctx, dst, src); });
  const double bw = copy_bytes / (copy_row.ms * 1e-3);
  rows.back().roofline = bw;

  Tensor x = pool.random(dt, {r, d}), w = pool.random(dt, {e, f, d}, -0.05f, 0.05f);
  Tensor y = pool.zeros(dt, {r, f});
  Tensor w0 = w.rows(0, 1).view({f, d});
  const double gemm_flops = 2.0 * double(r) * double(d) * double(f);
  auto dense_fwd = [&] { linear_forward(ctx, y, x, w0, false); };
  add("dense_gemm", shape({r, d}) + " x " + shape({f, d}) + "^T", gemm_flops, true, 0, 0,
      dense_fwd);
  const double gemm_rate = gemm_flops / (rows.back().ms * 1e-3);
  rows.back().roofline = gemm_rate;
  Tensor dy = pool.random(dt, {r, f}), dx = pool.zeros(dt, {r, d});
  Tensor dw0 = pool.zeros(acc, {f, d}), dw = pool.zeros(acc, {e, f, d});
  auto dense_bwd = [&] { linear_backward(ctx, dx, dw0, dy, x, w0, false); };
  add("dense_gemm_bwd", "dx and dw of the above", 2 * gemm_flops, true, 0, 0, dense_bwd);
  const double gemm_bwd_rate = 2 * gemm_flops / (rows.back().ms * 1e-3);
  rows.back().roofline = gemm_bwd_rate;

  // ---- router: softmax + top-K + renormalisation + counts in one launch ----
  Tensor logits = pool.random(acc, {n, e}, -3, 3), probs = pool.zeros(acc, {n, e});
  Tensor topk_idx = pool.zeros(DType::i32, {n, k}), topk_w = pool.zeros(acc, {n, k});
  Tensor counts = pool.zeros(DType::i32, {e});
  add("router_topk", shape({n, e}) + " top-" + std::to_string(k) + " from logits",
      double(n * e * as * 2 + n * k * (4 + as) + e * 4), false, bw, 0,
      [&] { router_topk_forward(ctx, probs, topk_idx, topk_w, counts, logits, Tensor(), true); });
  // The router as the model runs it (router_forward): from the layer's input x to the routing, the
  // gate's product included (the bytes: x and w read, the logits, probabilities and picks
  // written). The row above is its second half alone, a pass over [N, E] values too short for any
  // share of the copy rate. Up to 8 experts it is one launch, bound by the read of x; past that
  // the fp32-exact product (N d E FMAs, or three bf16 GEMM passes) bounds it: no copy target.
  Tensor tokens = pool.random(dt, {n, d}), gate_w = pool.random(acc, {e, d}, -0.05f, 0.05f);
  Tensor gate_logits = pool.zeros(acc, {n, e});
  add("router", shape({n, d}) + " x " + shape({e, d}) + "^T top-" + std::to_string(k),
      double(n * d * es + e * d * as + 2 * n * e * as + n * k * (4 + as) + e * 4), false, bw,
      e <= 8 ? 0.6 : 0, [&] {
        router_forward(ctx, gate_logits, probs, topk_idx, topk_w, counts, tokens, gate_w, Tensor(),
                       true);
      });

  // ---- permute and combine over the router's real plan ----
  Tensor offsets = pool.zeros(DType::i32, {e + 1}), row_token = pool.zeros(DType::i32, {r});
  Tensor slot_row = pool.zeros(DType::i32, {r});
  moe_permute_plan(ctx, offsets, row_token, slot_row, topk_idx);
  add("permute", shape({n, d}) + " -> " + shape({r, d}), double(2 * r * d * es + r * 4), false, bw,
      0.6, [&] { permute_forward(ctx, x, tokens, row_token); });
  // The combine is the plain gather-sum of permute_backward (the routing weights act in the
  // experts' SwiGLU); its backward is the permute row's gather.
  Tensor yp = pool.random(dt, {r, d}), combined = pool.zeros(dt, {n, d});
  add("combine", shape({r, d}) + " -> " + shape({n, d}), double(r * d * es + n * d * es + r * 4),
      false, bw, 0.6, [&] { permute_backward(ctx, combined, yp, Tensor(), slot_row); });
  // The block's combine: the residual h read in the same pass (permute_backward_add), n d
  // elements more than the combine, where a separate add moved 3 n d (h and y read, out written).
  Tensor combine_base = pool.random(dt, {n, d});
  add("combine_add", shape({r, d}) + " + " + shape({n, d}),
      double(r * d * es + 2 * n * d * es + r * 4), false, bw, 0.6,
      [&] { permute_backward_add(ctx, combined, combine_base, yp, slot_row); });

  // ---- grouped expert GEMM at several skews, against the dense GEMM at the same FLOPs ----
  for (double skew : opt.skews) {
    const double capped = std::min(skew, double(e - 1));
    Tensor off = pool.ints({e + 1}, skewed_offsets(r, e, capped));
    char detail[96];
    std::snprintf(detail, sizeof detail, "%s x [%lld, %lld, %lld]^T maxvio %.3g",
                  shape({r, d}).c_str(), static_cast<long long>(e), static_cast<long long>(f),
                  static_cast<long long>(d), capped);
    add_against("grouped_gemm", detail, gemm_flops, 0.75, gemm_flops, dense_fwd,
                [&] { grouped_linear_forward(ctx, y, x, w, off); });
    add_against("grouped_gemm_bwd", std::string(detail) + " (dx, dw)", 2 * gemm_flops, 0.75,
                2 * gemm_flops, dense_bwd,
                [&] { grouped_linear_backward(ctx, dx, dw, dy, x, w, off); });
  }

  // ---- AdamW over a split master (the bf16 trainer's update), alone and with the norm ----
  const int64_t slab = std::min<int64_t>(int64_t{1} << 26, std::max<int64_t>(r * d, 1 << 20));
  Tensor shi = pool.random(DType::bf16, {slab}), slo = pool.zeros(DType::u16, {slab});
  Tensor sg = pool.random(DType::f32, {slab}, -1e-3f, 1e-3f);
  Tensor sm = pool.zeros(DType::f32, {slab}), sv = pool.zeros(DType::f32, {slab});
  const double split_bytes = double(slab * (2 * 4 + 4 + 2 * 8));  // hi, lo, m, v in and out; g in
  auto split_adamw = [&](Ctx& on) { adamw_step_split(on, shi, slo, sg, sm, sv, AdamWArgs{}); };
  add("adamw_split", shape({slab}) + " bf16 hi + u16 lo", split_bytes, false, bw, 0,
      [&] { split_adamw(ctx); });
  // the same with the gradients' sum of squares from its read of them (no clipping)
  Tensor grad_sq = pool.zeros(DType::f64, {1});
  add("adamw_split_norm", shape({slab}) + " + sum g^2", split_bytes, false, bw, 0, [&] {
    AdamWArgs na;
    na.grad_sq_out = grad_sq;
    adamw_step_split(ctx, shi, slo, sg, sm, sv, na);
  });

  // ---- AdamW carried by a grouped GEMM's spare warps (grouped_linear_forward_adamw) against
  // the two in turn, over a quarter of the slab (the riders can finish it within the product)
  // and the whole of it (the finishing kernel does the rest) ----
  {
    Tensor off = pool.ints({e + 1}, skewed_offsets(r, e, 0));
    for (const int64_t part : {slab / 4 / 4 * 4, slab}) {
      Tensor hi = shi.rows(0, part), lo = slo.rows(0, part), g = sg.rows(0, part);
      Tensor m1 = sm.rows(0, part), v1 = sv.rows(0, part);
      const std::string what = "grouped_gemm maxvio 0 + adamw_split " + shape({part});
      add("adamw_rider", what + ", in turn", 0, false, 0, 0, [&] {
        grouped_linear_forward(ctx, y, x, w, off);
        adamw_step_split(ctx, hi, lo, g, m1, v1, AdamWArgs{});
      });
      add("adamw_rider", what + ", carried", 0, false, 0, 0,
          [&] { grouped_linear_forward_adamw(ctx, y, x, w, off, hi, lo, g, m1, v1, AdamWArgs{}); });
    }
  }

  // ---- the experts' gate and up GEMMs with SwiGLU (fused on sm_90), even routing ----
  {
    Tensor off = pool.ints({e + 1}, skewed_offsets(r, e, 0));
    Tensor w3 = pool.random(dt, {e, f, d}, -0.05f, 0.05f);
    Tensor up = pool.zeros(dt, {r, f}), act = pool.zeros(dt, {r, f});
    Tensor row_w = pool.random(acc, {r}, 0.0f, 1.0f), drow_w = pool.zeros(acc, {r});
    add_against("grouped_swiglu",
                shape({r, d}) + " x 2 [" + std::to_string(e) + ", " + std::to_string(f) + ", " +
                    std::to_string(d) + "]^T",
                2 * gemm_flops, 0, gemm_flops, dense_fwd,
                [&] { grouped_swiglu_forward(ctx, y, up, act, x, w, w3, row_w, off); });
    // The same with the permute fused in: x's rows gathered by the router's plan above (the
    // sum of this row's time and the permute's is the unfused pair).
    add_against("grouped_swiglu_gathered",
                shape({n, d}) + " gathered to " + shape({r, d}) + ", x 2 [" + std::to_string(e) +
                    ", " + std::to_string(f) + ", " + std::to_string(d) + "]^T",
                2 * gemm_flops, 0, gemm_flops, dense_fwd, [&] {
                  grouped_swiglu_forward_gathered(ctx, y, up, act, tokens, row_token, w, w3, row_w,
                                                  off);
                });
    // The optimizer's update behind the next forward (train.overlap_optimizer): the split AdamW
    // on the side stream beside three of the GEMMs above, against the two one after the other
    // (the tensor-core CTAs hold whole SMs, so only their tails and gaps are shared).
    auto gemms = [&] {
      for (int i = 0; i < 3; ++i) grouped_swiglu_forward(ctx, y, up, act, x, w, w3, row_w, off);
    };
    if (dev.type == DeviceType::cuda) {
      Ctx side = ctx;
      side.stream = gpu::side_stream(dev.index);
      void* fork = gpu::event_create();
      void* join = gpu::event_create();
      add("overlap_serial", "adamw_split, then 3 grouped_swiglu", 0, false, 0, 0, [&] {
        split_adamw(ctx);
        gemms();
      });
      add("overlap_side", "adamw_split on the side stream beside them", 0, false, 0, 0, [&] {
        gpu::event_record(fork, ctx.stream);
        gpu::stream_wait_event(side.stream, fork);
        split_adamw(side);
        gpu::event_record(join, side.stream);
        gemms();
        gpu::stream_wait_event(ctx.stream, join);
      });
      gpu::stream_synchronize(side.stream);
      gpu::event_destroy(fork);
      gpu::event_destroy(join);
    }
    // The down projection's backward with the weighted SwiGLU's (dh kept in dgate): dh and dw2.
    Tensor w2 = pool.random(dt, {e, d, f}, -0.05f, 0.05f), dyd = pool.random(dt, {r, d});
    Tensor dgate = pool.zeros(dt, {r, f}), dup = pool.zeros(dt, {r, f});
    Tensor dw2 = pool.zeros(acc, {e, d, f});
    add_against("grouped_swiglu_bwd",
                shape({r, d}) + " x [" + std::to_string(e) + ", " + std::to_string(d) + ", " +
                    std::to_string(f) + "] (dh, dw)",
                2 * gemm_flops, 0, 2 * gemm_flops, dense_bwd, [&] {
                  grouped_swiglu_down_backward(ctx, dgate, dup, drow_w, dw2, dyd, act, w2, y, up,
                                               row_w, off);
                });
    // Its elementwise part alone (the SwiGLU backward over dh, the product's output; here from
    // a buffer of its own, where the op runs it in place over the same bytes): dh, gate and up
    // read, dgate and dup written, the weights' gradient.
    Tensor dh = pool.random(dt, {r, f});
    add("swiglu_weighted_bwd", shape({r, f}) + " (dgate, dup, drow_w)",
        double(5 * r * f * es + 2 * r * as), false, bw, 0,
        [&] { swiglu_weighted_backward(ctx, dgate, dup, drow_w, dh, y, up, row_w); });
  }

  // ---- the model's dense linears (cuBLAS): attention projection, LM head, fp32 router ----
  auto linear_rows = [&](const std::string& name, DType t, int64_t in, int64_t out) {
    Tensor lx = pool.random(t, {n, in}), lw = pool.random(t, {out, in}, -0.05f, 0.05f);
    Tensor ly = pool.zeros(t, {n, out}), ldy = pool.random(t, {n, out}),
           ldx = pool.zeros(t, {n, in});
    Tensor ldw = pool.zeros(acc_dtype(t), {out, in});
    const double fl = 2.0 * double(n) * double(in) * double(out);
    const std::string det = shape({n, in}) + " x " + shape({out, in}) + "^T " + dtype_name(t);
    add(name, det, fl, true, gemm_rate, 0, [&] { linear_forward(ctx, ly, lx, lw, false); });
    add(name + "_bwd", det + " (dx, dw)", 2 * fl, true, gemm_bwd_rate, 0,
        [&] { linear_backward(ctx, ldx, ldw, ldy, lx, lw, false); });
  };
  linear_rows("linear_proj", dt, d, d);
  // The attention's q, k and v projections as the model issues them with as many key / value
  // heads as query heads: one batched product over the shared input (linear_*_batched).
  {
    Tensor qx = pool.random(dt, {n, d}), qw = pool.random(dt, {3, d, d}, -0.05f, 0.05f);
    Tensor qy = pool.zeros(dt, {3, n, d}), qdy = pool.random(dt, {3, n, d});
    Tensor qdx = pool.zeros(dt, {n, d}), qdw = pool.zeros(acc, {3, d, d});
    const double fl = 3 * 2.0 * double(n) * double(d) * double(d);
    const std::string det = shape({n, d}) + " x 3 x " + shape({d, d}) + "^T " + dtype_name(dt);
    add("linear_qkv", det, fl, true, gemm_rate, 0,
        [&] { linear_forward_batched(ctx, qy, qx, qw); });
    add("linear_qkv_bwd", det + " (dx, dw)", 2 * fl, true, gemm_bwd_rate, 0,
        [&] { linear_backward_batched(ctx, qdx, qdw, qdy, qx, qw, false); });
  }
  linear_rows("lm_head", dt, d, m.vocab_size);
  linear_rows("router_linear", acc, d, e);

  // ---- the router's gate matmul, fused: x in its storage dtype, fp32 gate weights and logits ----
  // Bytes: the minimum traffic. Past E = 16 the passes are compute bound (N d E FMAs each): no
  // target against the copy roofline there.
  {
    Tensor rx = pool.random(dt, {n, d}), rw = pool.random(acc, {e, d}, -0.05f, 0.05f);
    Tensor rlogits = pool.zeros(acc, {n, e}), rdl = pool.random(acc, {n, e});
    Tensor rdx = pool.random(dt, {n, d}), rdw = pool.zeros(acc, {e, d});
    const double rl_target = e <= 16 ? 0.6 : 0;
    const std::string rl_det = shape({n, d}) + " x " + shape({e, d}) + "^T " + dtype_name(dt);
    add("router_logits", rl_det, double(n * d * es + e * d * as + n * e * as), false, bw, rl_target,
        [&] { router_logits_forward(ctx, rlogits, rx, rw); });
    add("router_logits_bwd", rl_det + " (dx, dw)",
        double(3 * n * d * es + n * e * as + 2 * e * d * as), false, bw, rl_target,
        [&] { router_logits_backward(ctx, rdx, rdw, rdl, rx, rw); });
  }

  // ---- SwiGLU, RMSNorm ----
  Tensor gate = pool.random(dt, {r, f}), up = pool.random(dt, {r, f}), act = pool.zeros(dt, {r, f});
  add("swiglu", shape({r, f}), double(3 * r * f * es), false, bw, 0,
      [&] { swiglu_forward(ctx, act, gate, up); });
  Tensor gain = pool.random(dt, {d}, 0.5f, 1.5f), normed = pool.zeros(dt, {n, d});
  Tensor rstd = pool.zeros(acc, {n});
  add("rmsnorm", shape({n, d}), double(2 * n * d * es + n * as), false, bw, 0,
      [&] { rmsnorm_forward(ctx, normed, rstd, tokens, gain, m.rms_norm_eps); });
  // The block's fused residual norms. Bytes: the tensors each must touch once (x, r in, h, y out;
  // dy, x, residual in, dx out); the backward's dw pass reads dy and x a second time.
  Tensor resid = pool.random(dt, {n, d}), hsum = pool.zeros(dt, {n, d});
  add("add_rmsnorm", shape({n, d}), double(4 * n * d * es + n * as), false, bw, 0,
      [&] { add_rmsnorm_forward(ctx, hsum, normed, rstd, tokens, resid, gain, m.rms_norm_eps); });
  Tensor ndy = pool.random(dt, {n, d}), ndx = pool.zeros(dt, {n, d}), ndw = pool.zeros(acc, {d});
  add("rmsnorm_bwd_add", shape({n, d}) + " (dx, dw)", double(4 * n * d * es + n * as), false, bw, 0,
      [&] { rmsnorm_backward_add(ctx, ndx, ndw, ndy, tokens, gain, rstd, resid); });

  // ---- attention forward + backward (causal; FLOPs of the unmasked half) ----
  const int64_t nh = m.num_attention_heads, nkv = m.num_key_value_heads;
  const int64_t hd = m.resolved_head_dim(), b = batch, t = seq_len;
  Tensor q = pool.random(dt, {b, t, nh, hd}), kk = pool.random(dt, {b, t, nkv, hd});
  Tensor v = pool.random(dt, {b, t, nkv, hd}), att = pool.zeros(dt, {b, t, nh, hd});
  Tensor lse = pool.zeros(acc, {b, nh, t});
  const double att_flops = 2.0 * double(b * nh) * double(t) * double(t) * double(hd);
  add("attention_fwd", shape({b, t, nh, hd}) + " kv " + std::to_string(nkv), att_flops, true,
      gemm_rate, 0, [&] { attention_forward(ctx, att, lse, q, kk, v); });
  Tensor datt = pool.random(dt, {b, t, nh, hd}), dq = pool.zeros(dt, {b, t, nh, hd});
  Tensor dk = pool.zeros(dt, {b, t, nkv, hd}), dv = pool.zeros(dt, {b, t, nkv, hd});
  // the dq scratch where the model gives it (SelfAttention::backward)
  const Tensor dq_acc = attention_backward_wants_dq_acc(ctx, dt, b, t, nh, nkv, hd)
                            ? pool.zeros(DType::f32, {b, nh, t, hd})
                            : Tensor();
  add("attention_bwd", shape({b, t, nh, hd}) + " kv " + std::to_string(nkv), 2.5 * att_flops, true,
      gemm_bwd_rate, 0,
      [&] { attention_backward(ctx, dq, dk, dv, datt, q, kk, v, att, lse, dq_acc); });

  // ---- MoD: per-sequence top-C selection, gather and gated scatter ----
  const int64_t keep = std::max<int64_t>(
      1, std::min<int64_t>(t, static_cast<int64_t>(std::ceil(m.mod.capacity * double(t) - 1e-9))));
  Tensor scores = pool.random(acc, {b, t}), sel = pool.zeros(DType::i32, {b, keep});
  Tensor mask = pool.zeros(acc, {b, t});
  add("mod_select_scores", shape({b, t}) + " keep " + std::to_string(keep) + " from scores",
      double(b * t * as * 2 + b * keep * 4), false, bw, 0,
      [&] { mod_select(ctx, sel, mask, scores); });
  // The selection as the model runs it (mod_route): from the block's input x, the router's
  // product included (one launch where it is fused); the row above is its second half alone.
  Tensor mod_w = pool.random(acc, {1, d}, -0.05f, 0.05f);
  const double mod_select_bytes = double(n * d * es + d * as + b * t * as * 2 + b * keep * 4);
  add("mod_select", shape({n, d}) + " x " + shape({1, d}) + "^T keep " + std::to_string(keep),
      mod_select_bytes, false, bw, 0.6, [&] { mod_route(ctx, scores, sel, mask, tokens, mod_w); });
  // The same as its two ops (the product, then the selection by a block per sequence of its own):
  // whether one launch, whose selections by the blocks that finish each sequence's scores are its
  // tail, beats the second launch's wider selection. Same bits (test_gpu_router_fused).
  add("mod_select_2op", shape({n, d}) + " x " + shape({1, d}) + "^T, then select", mod_select_bytes,
      false, bw, 0, [&] {
        router_logits_forward(ctx, scores.view({b * t, 1}), tokens, mod_w);
        mod_select(ctx, sel, mask, scores);
      });
  Tensor xs = pool.zeros(dt, {b * keep, d}), ys = pool.random(dt, {b * keep, d});
  Tensor scattered = pool.zeros(dt, {n, d});
  add("mod_gather", shape({b * keep, d}), double(2 * b * keep * d * es), false, bw, 0.6,
      [&] { mod_gather_forward(ctx, xs, tokens, sel); });
  add("mod_scatter", shape({n, d}) + " from " + shape({b * keep, d}),
      double(2 * n * d * es + b * keep * d * es), false, bw, 0.6,
      [&] { mod_scatter_forward(ctx, scattered, tokens, ys, scores, sel); });

  // ---- the blocks' residual add (out = h + ffn_y), the gradients' zeroing ----
  Tensor residual = pool.random(dt, {n, d}), sum = pool.zeros(dt, {n, d});
  add("residual_add", shape({n, d}) + " " + dtype_name(dt), double(3 * n * d * es), false, bw, 0,
      [&] { moe::add(ctx, sum, tokens, residual); });

  // ---- cross-entropy over the vocabulary, AdamW over a parameter slab ----
  const int64_t vocab = m.vocab_size;
  Tensor head = pool.random(dt, {n, vocab}, -4, 4), losses = pool.zeros(acc, {n});
  Tensor ce_lse = pool.zeros(acc, {n});
  std::vector<int32_t> tg(static_cast<size_t>(n));
  for (auto& id : tg) id = static_cast<int32_t>(pool.rng()() % static_cast<uint64_t>(vocab));
  Tensor targets = pool.ints({n}, tg);
  // The token embedding's backward: dout's rows (the random token rows above) added into the fp32
  // table's rows of their ids (the random targets: ids of the same vocabulary). Bytes: dout read,
  // the rows read and written.
  Tensor table_grad = pool.zeros(acc, {vocab, d});
  add("embedding_bwd", shape({n, d}) + " into " + shape({vocab, d}) + " " + dtype_name(acc),
      double(n * d * (es + 2 * as)), false, bw, 0,
      [&] { embedding_backward(ctx, table_grad, tokens, targets); });
  add("cross_entropy_fwd", shape({n, vocab}), double(n * vocab * es + n * (4 + 2 * as)), false, bw,
      0, [&] { cross_entropy_forward(ctx, losses, ce_lse, head, targets); });
  add("cross_entropy_bwd", shape({n, vocab}) + " in place", double(2 * n * vocab * es), false, bw,
      0, [&] { cross_entropy_backward(ctx, head, head, ce_lse, targets, 1.0 / double(n)); });
  // the training step's LM head: both from one read of the logits (in place; the first call
  // turns them into gradients, which later calls read as logits: the same traffic)
  add("cross_entropy_fused", shape({n, vocab}) + " fwd + bwd in place", double(2 * n * vocab * es),
      false, bw, 0, [&] {
        cross_entropy_forward_backward(ctx, losses, ce_lse, head, head, targets, 1.0 / double(n));
      });
  Tensor p = pool.random(DType::f32, {slab}), g = pool.random(DType::f32, {slab});
  Tensor m1 = pool.zeros(DType::f32, {slab}), m2 = pool.zeros(DType::f32, {slab});
  AdamWArgs a;
  add("adamw", shape({slab}) + " f32", double(slab * 4 * 7), false, bw, 0,
      [&] { adamw_step(ctx, p, g, m1, m2, a); });
  add("zero_grads", shape({slab}) + " f32", double(slab * 4), false, bw, 0,
      [&] { fill(ctx, g, 0.0); });
  return rows;
}

std::string format_bench(const std::vector<BenchRow>& rows) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "%-18s %-44s %10s %12s %9s %7s\n", "family", "shape", "time us",
                "achieved", "roofline", "target");
  out += line;
  for (const BenchRow& r : rows) {
    const double rate = r.work / (r.ms * 1e-3);
    char achieved[32], target[16] = "";
    if (r.flops)
      std::snprintf(achieved, sizeof achieved, "%.1f TFLOP/s", rate / 1e12);
    else
      std::snprintf(achieved, sizeof achieved, "%.1f GB/s", rate / 1e9);
    if (r.target > 0) std::snprintf(target, sizeof target, ">= %.0f%%", 100 * r.target);
    std::snprintf(line, sizeof line, "%-18s %-44s %10.1f %12s %8.1f%% %7s%s\n", r.family.c_str(),
                  r.detail.substr(0, 44).c_str(), r.ms * 1e3, achieved, 100 * r.fraction(), target,
                  r.target > 0 && r.fraction() < r.target ? "  below target" : "");
    out += line;
  }
  out +=
      "roofline: copy rows against the measured copy bandwidth, GEMM-like rows against the "
      "measured dense GEMM rate (dense_gemm / dense_gemm_bwd) at the same FLOPs and dtype; the "
      "grouped rows against that GEMM timed in turn with them (alternate samples)\n";
  return out;
}

}  // namespace moe
