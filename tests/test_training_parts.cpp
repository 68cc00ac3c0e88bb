// The pieces of a training step around the model: LR schedule, clipping, gradient accumulation,
// AdamW's decay choice by parameter kind, the synthetic source's exact entropy, the
// aux-loss-free router bias, and the warning for a build without the GPU's faster kernels.
#include <algorithm>
#include <csignal>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch.hpp"
#include "test_util.hpp"
#include "optim/host_adamw.hpp"
#include "moe/ops/optim.hpp"
#include "train/code_arch_note.hpp"
#include "train/grad_buckets.hpp"
#include "train/loss_scaler.hpp"
#include "train/run_dir_probe.hpp"
#include "train/step_outcome.hpp"
#include "train/stop_signals.hpp"
#include "moe/comm.hpp"
#include "moe/data.hpp"
#include "moe/model.hpp"
#include "moe/optim.hpp"
#include "moe/trainer.hpp"

using namespace moe;
using moe::test::tokens;

TEST_CASE("learning-rate schedules", "[optim]") {
  SchedulerConfig s;
  s.type = "WarmupCosineLR";
  s.warmup_num_steps = 10;
  s.warmup_min_ratio = 0.0;
  s.cos_min_ratio = 0.1;
  const double lr = 1.0;
  CHECK(learning_rate(s, lr, 0, 110) == Approx(0.1));               // (0+1)/10
  CHECK(learning_rate(s, lr, 9, 110) == Approx(1.0));               // end of warmup
  CHECK(learning_rate(s, lr, 10, 110) == Approx(1.0));              // cosine starts at the peak
  CHECK(learning_rate(s, lr, 60, 110) == Approx(0.1 + 0.9 * 0.5));  // halfway
  CHECK(learning_rate(s, lr, 110, 110) == Approx(0.1));
  CHECK(learning_rate(s, lr, 500, 110) == Approx(0.1));  // constant after the end
  s.total_num_steps = 20;                                // explicit horizon overrides max_steps
  CHECK(learning_rate(s, lr, 20, 110) == Approx(0.1));
  s.type = "WarmupLR";
  CHECK(learning_rate(s, lr, 4, 110) == Approx(0.5));
  CHECK(learning_rate(s, lr, 80, 110) == Approx(1.0));
  s.warmup_min_ratio = 0.5;
  CHECK(learning_rate(s, lr, 0, 110) == Approx(0.55));
}

TEST_CASE("global-norm clipping factor", "[optim]") {
  CHECK(clip_factor(0.5, 1.0) == 1.0);
  CHECK(clip_factor(4.0, 1.0) == Approx(0.25).epsilon(1e-5));
  CHECK(clip_factor(4.0, 0.0) == 1.0);  // clipping off
  CHECK(clip_factor(NAN, 1.0) == 1.0);  // non-finite norms are caught by the trainer instead
}

namespace {

ModelConfig small_config() {
  ModelConfig m;
  m.vocab_size = 13;
  m.hidden_size = 16;
  m.intermediate_size = 8;
  m.num_hidden_layers = 2;
  m.num_attention_heads = 2;
  m.num_key_value_heads = 2;
  m.max_position_embeddings = 16;
  m.num_local_experts = 4;
  m.num_experts_per_tok = 2;
  m.moe_layer_freq = 2;
  m.mod.enabled = true;
  m.mod.every = 2;
  m.mod.capacity = 0.5;
  return m;
}

}  // namespace

TEST_CASE("gradient accumulation equals one large batch", "[train]") {
  // aux loss off: its f_e is a per-micro-batch statistic, so only the rest is batch-separable.
  ModelConfig m = small_config();
  m.router_aux_loss_coef = 0;
  m.router_z_loss_coef = 0.01;
  const int t = 8;
  auto ids = tokens(4 * t, m.vocab_size, 1), tg = tokens(4 * t, m.vocab_size, 2);
  Ctx ctx;
  Model big(m, DType::f64, Device{}, 4, t), small(m, DType::f64, Device{}, 2, t);
  big.init_weights(7);
  small.init_weights(7);
  big.zero_grads(ctx);
  small.zero_grads(ctx);
  big.forward_backward(ctx, ids.data(), tg.data(), 1.0);
  small.forward_backward(ctx, ids.data(), tg.data(), 0.5);
  small.forward_backward(ctx, ids.data() + 2 * t, tg.data() + 2 * t, 0.5);
  const double* a = big.grads().ptr<double>();
  const double* b = small.grads().ptr<double>();
  double worst = 0, norm = 0;
  for (int64_t i = 0; i < big.grads().numel(); ++i) {
    worst = std::max(worst, std::fabs(a[i] - b[i]));
    norm = std::max(norm, std::fabs(a[i]));
  }
  INFO("max |diff| " << worst << " max |grad| " << norm);
  CHECK(norm > 1e-3);
  CHECK(worst < 1e-12 * std::max(1.0, norm) * 1e3);
}

TEST_CASE("AdamW skips weight decay on norms by kind", "[optim]") {
  ModelConfig m = small_config();
  Model model(m, DType::f64, Device{}, 1, 4);
  model.init_weights(3);
  OptimizerConfig oc;
  oc.lr = 0.1;
  oc.weight_decay = 0.5;
  AdamW opt(oc, model);
  Ctx ctx;
  model.zero_grads(ctx);  // zero gradients: only decay moves parameters
  std::vector<double> before(model.params().ptr<double>(),
                             model.params().ptr<double>() + model.params().numel());
  opt.step(ctx, model, oc.lr, 1.0);
  const double* after = model.params().ptr<double>();
  for (const auto& p : model.table().params) {
    const size_t i = p.offset;  // first element of each parameter
    if (p.kind == ParamKind::norm)
      CHECK(after[i] == before[i]);
    else
      CHECK(after[i] == Approx(before[i] * (1 - 0.1 * 0.5)));
  }
}

TEST_CASE("Markov source: the exact entropy matches the empirical loss of the true chain",
          "[data]") {
  const int vocab = 6;
  MarkovSource src(vocab, 3, 11);
  CHECK(src.entropy_rate() > 0.1);
  CHECK(src.entropy_rate() < std::log(3.0) + 1e-12);  // at most uniform over 3 successors
  // Empirical conditional entropy from counts of (a, b) -> c over a long sample.
  Rng rng(5);
  const int rows = 400, t = 256;
  std::vector<int32_t> ids(rows * t), tg(rows * t);
  src.sample(rng, rows, t, ids.data(), tg.data());
  std::map<std::pair<int, int>, std::map<int, double>> counts;
  double n = 0;
  for (int r = 0; r < rows; ++r)
    for (int i = 1; i < t; ++i) {
      counts[{ids[r * t + i - 1], ids[r * t + i]}][tg[r * t + i]] += 1;
      n += 1;
    }
  double h = 0;
  for (auto& [ctx, next] : counts) {
    double total = 0;
    for (auto& [c, k] : next) total += k;
    for (auto& [c, k] : next) h -= k / n * std::log(k / total);
  }
  CHECK(h == Approx(src.entropy_rate()).margin(0.01));
  // targets are the next inputs
  for (int i = 0; i + 1 < t; ++i) CHECK(tg[i] == ids[i + 1]);
  CHECK(src.optimal_loss(t) >= src.entropy_rate());
}

TEST_CASE("aux-loss-free bias moves toward balance", "[train]") {
  ModelConfig m = small_config();
  m.mod.enabled = false;
  m.moe_layer_freq = 1;
  m.router_aux_loss_coef = 0;
  m.router_bias_update_rate = 0.05;
  const int t = 8;
  Model model(m, DType::f32, Device{}, 4, t);
  model.init_weights(1);
  // Skew the router: expert 0's gate row aligned with every token's features gets most slots.
  Ctx ctx;
  auto ids = tokens(4 * t, m.vocab_size, 3), tg = tokens(4 * t, m.vocab_size, 4);
  auto& gate = model.table().find("model.layers.0.block_sparse_moe.gate.weight");
  float* g = model.param(gate).ptr<float>();
  for (int j = 0; j < m.hidden_size; ++j) g[j] += 0.3f;  // expert 0
  double first = -1, last = 0;
  for (int step = 0; step < 100; ++step) {
    model.forward(ctx, ids.data(), tg.data());
    const double v = model.routing().maxvio_max();
    if (step == 0) first = v;
    if (step >= 80) last += v / 20;  // sign updates oscillate: average the tail

    model.after_step(ctx);
  }
  INFO("maxvio first " << first << ", mean of the last 20 steps " << last);
  CHECK(first > 0.5);
  CHECK(last < 0.8 * first);  // without updates it would stay exactly at `first`
}

// A step the device skipped (non-finite gradient norm: fp16 overflow) leaves the router biases
// alone, as AdamW leaves the weights; a step that was not skipped updates them; a non-finite
// norm without loss scaling, or a non-finite loss, is divergence.
TEST_CASE("finish_step: router biases follow the device's skip decision", "[train][fp16]") {
  ModelConfig m = small_config();
  m.mod.enabled = false;
  m.moe_layer_freq = 1;
  m.router_bias_update_rate = 0.05;
  const int t = 8;
  Model model(m, DType::f32, Device{}, 2, t);
  model.init_weights(1);
  Ctx ctx;
  auto ids = tokens(2 * t, m.vocab_size, 3), tg = tokens(2 * t, m.vocab_size, 4);
  model.zero_grads(ctx);
  model.reset_stats(ctx);
  model.forward_backward(ctx, ids.data(), tg.data(), 1.0);  // the step's expert loads
  auto biases = [&] {
    std::vector<float> all;
    for (const Tensor& b : model.router_biases())
      all.insert(all.end(), b.ptr<float>(), b.ptr<float>() + b.numel());
    return all;
  };
  const std::vector<float> before = biases();
  CHECK(finish_step(ctx, model, INFINITY, 2.0, /*loss_scaling=*/true, 1));
  CHECK(finish_step(ctx, model, NAN, 2.0, true, 1));
  CHECK(biases() == before);
  CHECK_FALSE(finish_step(ctx, model, 0.5, 2.0, true, 1));
  CHECK(biases() != before);
  CHECK_THROWS_WITH(finish_step(ctx, model, INFINITY, 2.0, false, 7),
                    Catch::Contains("non-finite at step 7"));
  CHECK_THROWS_WITH(finish_step(ctx, model, 0.5, NAN, true, 7),
                    Catch::Contains("non-finite at step 7"));
}

// DeepSpeed's DynamicLossScaler, step by step: doubling after loss_scale_window clean steps,
// `hysteresis` overflows tolerated before halving, the window counted from the last overflow.
TEST_CASE("loss scaler: DeepSpeed's dynamic schedule", "[train][fp16]") {
  Fp16Config f;
  f.enabled = true;
  f.initial_scale_power = 4;
  f.loss_scale_window = 3;
  f.hysteresis = 2;
  f.min_loss_scale = 1;
  LossScaler s(f);
  std::vector<double> seen;
  for (bool overflow : {false, false, false, true, true, false, false, false, true}) {
    s.update(overflow);
    seen.push_back(s.scale());
  }
  // clean x3 -> 32; overflow (tolerated), overflow -> 16; clean x3 -> 32; overflow (tolerated)
  CHECK(seen == std::vector<double>{16, 16, 32, 32, 16, 16, 16, 32, 32});
  CHECK(s.state().hysteresis_left == 1);
  CHECK(s.state().last_overflow == 8);
  // a restored scaler continues the same sequence
  LossScaler t(f);
  t.restore(s.state());
  s.update(true);
  t.update(true);
  CHECK(t.scale() == s.scale());
  CHECK(t.scale() == 16);
}

TEST_CASE("loss scaler: static scale, disabled scaler and the minimum", "[train][fp16]") {
  Fp16Config f;
  f.enabled = true;
  f.loss_scale = 128;  // static
  LossScaler fixed(f);
  for (int i = 0; i < 5; ++i) fixed.update(i % 2 == 0);
  CHECK(fixed.scale() == 128);
  f.loss_scale = 0;
  f.enabled = false;
  LossScaler off(f);
  off.update(true);
  CHECK(off.scale() == 1);
  CHECK_FALSE(off.enabled());
  f.enabled = true;
  f.initial_scale_power = 1;  // 2
  f.hysteresis = 1;
  f.min_loss_scale = 1;
  LossScaler low(f);
  low.update(true);  // 2 -> 1
  CHECK(low.scale() == 1);
  CHECK_THROWS_WITH(low.update(true), Catch::Contains("min_loss_scale"));
}

TEST_CASE("ZeRO partition: chunks and the shared tail cover the buffer once", "[optim][zero]") {
  for (int world : {1, 2, 3, 4, 7}) {
    const size_t total = 1001;
    std::vector<int> owners(total, 0);
    for (int r = 0; r < world; ++r) {
      const ZeroPartition p = ZeroPartition::split(total, r, world);
      size_t local = 0;
      for (const auto& range : p.ranges()) {
        CHECK(range.local == local);
        local += range.count;
        for (size_t i = range.global; i < range.global + range.count; ++i)
          owners[i] += i >= p.tail_begin ? 0 : 1;  // the tail belongs to every rank
      }
      CHECK(local == p.local());
      CHECK(p.total - p.tail_begin < static_cast<size_t>(world));
    }
    const ZeroPartition p0 = ZeroPartition::split(total, 0, world);
    for (size_t i = 0; i < p0.tail_begin; ++i) CHECK(owners[i] == 1);
  }
}

TEST_CASE("ZeRO-3 partition: every unit in equal padded chunks, each element owned once",
          "[optim][zero]") {
  const std::vector<size_t> bounds{0, 10, 10, 33, 34, 101};  // an empty unit, a 1-element one
  for (int world : {1, 2, 3, 4, 7}) {
    std::vector<int> owners(bounds.back(), 0);
    for (int r = 0; r < world; ++r) {
      const ZeroPartition p = ZeroPartition::per_unit(bounds, r, world);
      CHECK(p.local_buffers);
      size_t padded = 0, owned = 0;
      for (size_t u = 0; u + 1 < bounds.size(); ++u) {
        const size_t c = unit_chunk(bounds[u], bounds[u + 1], world);
        CHECK(c * static_cast<size_t>(world) >= bounds[u + 1] - bounds[u]);
        CHECK(c * static_cast<size_t>(world) < bounds[u + 1] - bounds[u] + world);
        for (const auto& range : p.ranges())
          if (range.global >= bounds[u] && range.global < bounds[u + 1]) {
            CHECK(range.global == bounds[u] + c * static_cast<size_t>(r));  // chunk r of the unit
            CHECK(range.local == padded);  // at the unit's padded slot in the local buffers
            CHECK(range.global + range.count <= bounds[u + 1]);
          }
        padded += c;
      }
      for (const auto& range : p.ranges()) {
        owned += range.count;
        for (size_t i = range.global; i < range.global + range.count; ++i) ++owners[i];
      }
      CHECK(p.local() == padded);
      CHECK(p.owned() == owned);
    }
    for (int o : owners) CHECK(o == 1);
  }
}

TEST_CASE("ZeRO-3 model on one rank: the gathered units give the unsharded step", "[model][zero]") {
  // World 1 still runs every gather, gradient slot and reduction (as copies), so this checks the
  // slot bookkeeping: which unit is where, zeroed gradient slots, the shard accumulating across
  // micro-batches, the tied embedding's two gradient contributions.
  for (bool tied : {false, true}) {
    ModelConfig m = small_config();
    m.tie_word_embeddings = tied;
    const ParamTable table = build_param_table(m);
    const std::unique_ptr<Comm> comm = make_comm(RankInfo{}, Device{}, 0);
    const ZeroPartition part = ZeroPartition::per_unit(param_unit_bounds(table, m), 0, 1);
    const ParamSharding sharding{&part, comm.get()};
    Model plain(m, DType::f64, Device{}, 2, 8);
    Model sharded(m, DType::f64, Device{}, 2, 8, true, MemoryPlan{}, &sharding);
    REQUIRE(sharded.params_sharded());
    plain.init_weights(11);
    sharded.init_weights(11);
    Rng rng(3);
    std::vector<int32_t> ids(16), targets(16);
    auto draw = [&] {
      for (size_t i = 0; i < ids.size(); ++i) {
        ids[i] = static_cast<int32_t>(rng.below(m.vocab_size));
        targets[i] = static_cast<int32_t>(rng.below(m.vocab_size));
      }
    };
    // One rank: the local layout is the global one (no padding). worst relative difference:
    auto grad_difference = [&] {
      const double* ga = plain.grads().ptr<double>();
      const double* gb = sharded.grads().ptr<double>();
      double worst = 0;
      for (int64_t i = 0; i < plain.grads().numel(); ++i)
        worst = std::max(worst, std::abs(ga[i] - gb[i]) / std::max(1e-30, std::abs(ga[i])));
      return worst;
    };
    REQUIRE(sharded.grads().numel() == plain.grads().numel());
    Ctx ctx;
    for (Model* model : {&plain, &sharded}) model->zero_grads(ctx);
    draw();
    Losses a = plain.forward_backward(ctx, ids.data(), targets.data(), 0.5);
    Losses b = sharded.forward_backward(ctx, ids.data(), targets.data(), 0.5);
    CHECK(a.lm == b.lm);
    CHECK(a.aux == b.aux);
    CHECK(grad_difference() == 0);  // one micro-batch: the same sums in the same order
    CHECK(std::abs(plain.grads().ptr<double>()[7]) > 0);  // (a gradient that could differ)
    // An update from bitwise equal gradients, then the whole weights gathered back.
    OptimizerConfig oc;
    AdamW opt_a(oc, plain), opt_b(oc, sharded, part);
    opt_a.step(ctx, plain, 1e-2, 1.0);
    opt_b.step(ctx, sharded, 1e-2, 1.0);
    plain.weights_changed(ctx);
    sharded.weights_changed(ctx);
    std::vector<double> whole(table.total, NAN);
    sharded.gather_params(ctx, whole.data());
    const double* pa = plain.params().ptr<double>();
    size_t same = 0;
    for (size_t i = 0; i < table.total; ++i) same += whole[i] == pa[i] ? 1 : 0;
    CHECK(same == table.total);
    a = plain.forward(ctx, ids.data(), targets.data());
    b = sharded.forward(ctx, ids.data(), targets.data());
    CHECK(a.lm == b.lm);
    // Two micro-batches: the shard adds each micro-batch's unit gradient (summed from zero in
    // its slot) where the plain buffer adds every contribution in turn, so an embedding row
    // hit by several tokens may round differently.
    for (Model* model : {&plain, &sharded}) model->zero_grads(ctx);
    for (int micro = 0; micro < 2; ++micro) {
      draw();
      a = plain.forward_backward(ctx, ids.data(), targets.data(), 0.5);
      b = sharded.forward_backward(ctx, ids.data(), targets.data(), 0.5);
      CHECK(a.lm == b.lm);
    }
    CHECK(grad_difference() < 1e-12);
  }
}

// Seeded weights and a fixed, non-trivial gradient: the same starting point for every optimizer
// that the ZeRO and offload tests compare.
static void with_sine_gradient(Model& model) {
  model.init_weights(5);
  double* g = model.grads().ptr<double>();
  for (int64_t i = 0; i < model.grads().numel(); ++i) g[i] = std::sin(0.37 * i);
}

TEST_CASE("ZeRO: AdamW on each rank's shard reassembles the full update bitwise", "[optim][zero]") {
  ModelConfig m = small_config();
  OptimizerConfig oc;
  oc.lr = 0.05;
  oc.weight_decay = 0.1;
  Ctx ctx;
  // Every "rank" starts from the same weights and the same (reduced) gradient.
  Model full(m, DType::f64, Device{}, 1, 4);
  with_sine_gradient(full);
  AdamW full_opt(oc, full);
  for (int s = 0; s < 2; ++s) full_opt.step(ctx, full, oc.lr, 0.5);
  const size_t total = full.table().total;
  for (int world : {2, 3}) {
    std::vector<double> assembled(total, NAN);
    for (int r = 0; r < world; ++r) {
      Model model(m, DType::f64, Device{}, 1, 4);
      with_sine_gradient(model);
      AdamW opt(oc, model, ZeroPartition::split(total, r, world));
      CHECK(opt.moment1().numel() == static_cast<int64_t>(opt.partition().local()));
      for (int s = 0; s < 2; ++s) opt.step(ctx, model, oc.lr, 0.5);
      for (const auto& range : opt.partition().ranges())
        for (size_t i = range.global; i < range.global + range.count; ++i)
          assembled[i] = model.params().ptr<double>()[i];
    }
    const double* want = full.params().ptr<double>();
    size_t same = 0;
    for (size_t i = 0; i < total; ++i) same += assembled[i] == want[i] ? 1 : 0;
    CHECK(same == total);
  }
}

// The offload CPU AdamW against the adamw_step op on random inputs: the same arithmetic, so the
// same bits, in place and out of place, for f32 and f64 storage, with weight decay, grad_scale,
// clipping by a norm (active and not) and the skip on a non-finite norm; sizes above and below the
// parallel threshold.
template <class T>
void compare_host_adamw_with_op() {
  const DType dt = std::is_same<T, float>::value ? DType::f32 : DType::f64;
  Ctx ctx;
  Rng rng(11);
  for (const size_t n : {size_t{37}, size_t{10000}}) {
    std::vector<T> p(n), g(n), m(n), v(n);
    for (size_t i = 0; i < n; ++i) {
      p[i] = static_cast<T>(rng.normal());
      g[i] = static_cast<T>(rng.normal() * 100);
      m[i] = static_cast<T>(rng.normal() * 0.1);
      v[i] = static_cast<T>(rng.uniform());
    }
    struct Case {
      double weight_decay, grad_scale, norm_sq, max_norm;
    };
    // (no norm), clipped, below the clip threshold, overflow (skipped)
    for (const Case c : {Case{0.1, 0.25, -1, 0}, Case{0.0, 0.5, 4e6, 1.0},
                         Case{0.01, 1e-3, 4e6, 10.0}, Case{0.1, 1.0, INFINITY, 1.0}}) {
      std::vector<T> op_p = p, op_m = m, op_v = v, host_p = p, host_m = m, host_v = v;
      std::vector<double> norm_sq = {c.norm_sq};
      AdamWArgs a;
      a.lr = 3e-3;
      a.beta1 = 0.8;
      a.beta2 = 0.95;
      a.eps = 1e-7;
      a.weight_decay = c.weight_decay;
      a.step = 3;
      a.grad_scale = c.grad_scale;
      a.max_norm = c.max_norm;
      if (c.norm_sq >= 0 || !std::isfinite(c.norm_sq))
        a.norm_sq = Tensor(norm_sq.data(), DType::f64, Device{}, {1});
      const auto len = static_cast<int64_t>(n);
      adamw_step(ctx, Tensor(op_p.data(), dt, Device{}, {len}),
                 Tensor(g.data(), dt, Device{}, {len}), Tensor(op_m.data(), dt, Device{}, {len}),
                 Tensor(op_v.data(), dt, Device{}, {len}), a);
      double scale = 0;
      const bool run = host_adamw_scale(a, c.norm_sq, &scale);
      CHECK(run == std::isfinite(c.norm_sq));
      if (run)
        host_adamw_update(host_p.data(), g.data(), host_m.data(), host_v.data(), n,
                          host_adamw_step(a, scale));
      INFO("n " << n << " norm_sq " << c.norm_sq << " max_norm " << c.max_norm);
      CHECK(host_p == op_p);
      CHECK(host_m == op_m);
      CHECK(host_v == op_v);
      // Out of place (the overlapped offload step; f32 with streaming stores), into outputs
      // starting at each offset from a 16-byte boundary: the same bits, the input untouched.
      for (size_t shift = 0; shift < 4 && run; ++shift) {
        std::vector<T> out_p(n + 4), out_m(n + 4), out_v(n + 4), in_p = p, in_m = m, in_v = v;
        host_adamw_update(
            HostAdamWState<T>{in_p.data(), in_m.data(), in_v.data()}, g.data(),
            HostAdamWState<T>{out_p.data() + shift, out_m.data() + shift, out_v.data() + shift}, n,
            host_adamw_step(a, scale));
        CHECK(std::equal(op_p.begin(), op_p.end(), out_p.begin() + shift));
        CHECK(std::equal(op_m.begin(), op_m.end(), out_m.begin() + shift));
        CHECK(std::equal(op_v.begin(), op_v.end(), out_v.begin() + shift));
        CHECK((in_p == p && in_m == m && in_v == v));
      }
      CHECK((host_p != p) == run);  // the update did something exactly when not skipped
    }
  }
}

TEST_CASE("offload: the CPU AdamW gives the adamw_step op's bits", "[optim][offload]") {
  compare_host_adamw_with_op<float>();
  compare_host_adamw_with_op<double>();
}

// An offloaded AdamW and the one on the model's device (here both the CPU) side by side: f64
// models from the same weights and gradient, rank world - 1 of a `world`-way ZeRO split (with a
// shared tail at world 3), decay segments, and a host norm_sq the steps read.
struct OffloadPair {
  static OptimizerConfig optimizer() {
    OptimizerConfig oc;
    oc.lr = 0.05;
    oc.weight_decay = 0.1;
    return oc;
  }
  OffloadPair(int world, OffloadOptions offload)
      : part(ZeroPartition::split(build_param_table(m).total, world - 1, world)),
        dev_model(m, DType::f64, Device{}, 1, 4),
        host_model(m, DType::f64, Device{}, 1, 4),
        on_device(oc, dev_model, part),
        on_host(oc, host_model, part, offload) {
    // (the offloaded AdamW takes its master copy at its first step)
    with_sine_gradient(dev_model);
    with_sine_gradient(host_model);
  }
  // Both take a step with learning rate oc.lr, gradient scale 0.5 and max_norm 1 (f hooks the
  // offloaded one's step: the overlapped step starts before it).
  template <class F>
  void step(double nsq, F&& before_host_step) {
    norm_sq[0] = nsq;
    on_device.step(ctx, dev_model, oc.lr, 0.5, norm_sq_t, 1.0);
    before_host_step();
    on_host.step(ctx, host_model, oc.lr, 0.5, norm_sq_t, 1.0);
    if (!std::isfinite(nsq)) on_device.undo_step(), on_host.undo_step();
  }
  static bool same_bits(const Tensor& a, const Tensor& b) {
    REQUIRE(a.numel() == b.numel());
    return std::equal(a.ptr<double>(), a.ptr<double>() + a.numel(), b.ptr<double>());
  }
  void check_same() {
    CHECK(same_bits(on_host.moment1(), on_device.moment1()));
    CHECK(same_bits(on_host.moment2(), on_device.moment2()));
    CHECK(same_bits(host_model.params(), dev_model.params()));
  }

  ModelConfig m = small_config();
  OptimizerConfig oc = optimizer();
  Ctx ctx;
  std::vector<double> norm_sq = {0};
  Tensor norm_sq_t{norm_sq.data(), DType::f64, Device{}, {1}};
  ZeroPartition part;
  Model dev_model, host_model;
  AdamW on_device, on_host;
};

// The offloaded AdamW (host master, moments and gradient staging) gives the device one's
// weights and moments bit for bit after clipped steps and a skipped one; params_written() makes
// it take the master copy from the model again.
TEST_CASE("offload: AdamW with the state on the host updates like the device one",
          "[optim][offload]") {
  for (int world : {1, 3}) {
    OffloadOptions offload;
    offload.enabled = true;
    OffloadPair t(world, offload);
    CHECK(t.on_host.offloaded());
    CHECK(t.on_host.moment1().data != nullptr);
    for (double nsq : {1e6, 1.0, double(INFINITY), 4.0}) t.step(nsq, [] {});
    t.check_same();
    // Outside writes reach the host master only through params_written().
    t.host_model.init_weights(9);
    t.dev_model.init_weights(9);
    t.on_host.params_written();
    t.on_device.step(t.ctx, t.dev_model, t.oc.lr, 0.5);
    t.on_host.step(t.ctx, t.host_model, t.oc.lr, 0.5);
    CHECK(OffloadPair::same_bits(t.host_model.params(), t.dev_model.params()));
  }
}

// The offloaded update overlapped with the backward (OffloadOptions::overlap): the gradient
// ranges land on the host in backward order, reported from another thread as the buckets'
// copies would be, and the thread updates them at once into the second copy of the state,
// guessing no clip and no skip. The weights and moments equal the device AdamW's bit for bit
// whether the guess held (norm below max_norm), was redone (clipped: every range was updated
// with the guess first) or was dropped (skipped); in the last round the step decides while
// ranges may still be waiting. A step whose ranges did not all land is refused.
TEST_CASE("offload: the AdamW overlapped with the backward gives the device one's bits",
          "[optim][offload]") {
  for (int world : {1, 3}) {
    OffloadOptions offload;
    offload.enabled = true;
    offload.overlap = true;
    OffloadPair t(world, offload);
    AdamW& overlapped = t.on_host;
    REQUIRE(overlapped.overlaps_backward());
    const size_t total = t.part.total;
    // The backward's buckets: 1000 elements each, from the end of the buffer down.
    auto land = [&](bool all) {
      auto* staging = static_cast<double*>(overlapped.host_gradients());
      const double* g = t.host_model.grads().ptr<double>();
      for (const auto& r : t.part.ranges())
        std::copy(g + r.global, g + r.global + r.count, staging + r.local);
      const auto hook = overlapped.landing_hook();
      std::thread backward([&] {
        for (size_t end = all ? total : total - 1000; end > 0;) {
          const size_t begin = end > 1000 ? end - 1000 : 0;
          hook(begin, end);
          end = begin;
        }
      });
      backward.join();
      overlapped.gradients_on_host();
    };
    // kept (0.5 * 1 <= 1), clipped (redone), skipped (dropped), kept (0.5 * 2 == 1, not above)
    int round = 0;
    for (double nsq : {1.0, 1e6, double(INFINITY), 4.0}) {
      ++round;
      t.step(nsq, [&] {
        overlapped.begin_overlapped_step(t.host_model, t.oc.lr, 0.5);
        land(true);
        // Every range updated with the guess before the step decides (else the decision may
        // come first and the guess be made for none: the clipped step would test no redo).
        if (round < 3) overlapped.wait_overlapped_idle();
      });
      for (auto* model : {&t.dev_model, &t.host_model}) {  // the next step's gradient
        double* g = model->grads().ptr<double>();
        for (int64_t i = 0; i < model->grads().numel(); ++i) g[i] = std::cos(0.11 * i + round);
      }
    }
    t.check_same();
    // The last 1000 elements (this rank's) never landed: the step cannot be the whole update.
    t.norm_sq[0] = 1.0;
    overlapped.begin_overlapped_step(t.host_model, t.oc.lr, 0.5);
    land(false);
    CHECK_THROWS_WITH(overlapped.step(t.ctx, t.host_model, t.oc.lr, 0.5, t.norm_sq_t, 1.0),
                      Catch::Contains("owned elements"));
  }
}

// ZeRO-3 parameter offload: the CPU AdamW updates the model's host chunks in place, in a thread,
// range by range; wait_local(end) returns only once every range below `end` is updated (checked
// right after step() returns, while the thread is still working on a 1M-element embedding: a
// wait that returned early would show stale weights) and finish() once all are. The result is the
// device op's, bit for bit, after clipped and skipped steps.
TEST_CASE("offload: the in-place AdamW behind the forward waits range by range",
          "[optim][offload][zero]") {
  ModelConfig m = small_config();
  m.vocab_size = 4096;
  m.hidden_size = 256;
  m.max_position_embeddings = 16;
  OptimizerConfig oc;
  oc.lr = 0.05;
  oc.weight_decay = 0.1;
  Ctx ctx;
  std::vector<double> norm_sq = {0};
  const Tensor norm_sq_t(norm_sq.data(), DType::f64, Device{}, {1});
  const ParamTable table = build_param_table(m);
  const std::unique_ptr<Comm> comm = make_comm(RankInfo{}, Device{}, 0);
  const ZeroPartition part = ZeroPartition::per_unit(param_unit_bounds(table, m), 0, 1);
  ParamSharding sharding{&part, comm.get(), /*offload=*/true};
  Model ref(m, DType::f64, Device{}, 1, 4);
  Model host(m, DType::f64, Device{}, 1, 4, true, MemoryPlan{}, &sharding);
  with_sine_gradient(ref);
  host.init_weights(5);
  // One rank: the local layout is the global one.
  std::copy(ref.grads().ptr<double>(), ref.grads().ptr<double>() + ref.grads().numel(),
            host.grads().ptr<double>());
  AdamW on_device(oc, ref, part);
  OffloadOptions offload;
  offload.enabled = true;
  offload.in_place = true;
  AdamW in_place(oc, host, part, offload);
  const std::vector<ZeroPartition::Range> ranges = part.ranges();
  REQUIRE(ranges.size() >= 3);
  auto same_rows = [](const Tensor& a, const Tensor& b, size_t begin, size_t end) {
    return std::equal(a.ptr<double>() + begin, a.ptr<double>() + end, b.ptr<double>() + begin);
  };
  for (double nsq : {1e6, double(INFINITY), 4.0}) {
    norm_sq[0] = nsq;
    on_device.step(ctx, ref, oc.lr, 0.5, norm_sq_t, 1.0);
    in_place.step(ctx, host, oc.lr, 0.5, norm_sq_t, 1.0);
    if (!std::isfinite(nsq)) {
      on_device.undo_step(), in_place.undo_step();
      continue;
    }
    in_place.wait_local(ranges[0].local + ranges[0].count);  // the embedding
    CHECK(same_rows(host.params(), ref.params(), 0, ranges[0].count));
    in_place.wait_local(ranges[1].local + ranges[1].count);
    CHECK(
        same_rows(host.params(), ref.params(), ranges[1].local, ranges[1].local + ranges[1].count));
    in_place.finish();
    CHECK(same_rows(host.params(), ref.params(), 0, table.total));
  }
  CHECK(std::equal(in_place.moment1().ptr<double>(),
                   in_place.moment1().ptr<double>() + in_place.moment1().numel(),
                   on_device.moment1().ptr<double>()));
}

// The backward's gradient-ready ranges: adjacent, descending, covering the buffer once, and each
// reported only when its gradient is final (a snapshot taken at the report equals the gradient
// after the whole backward), for a tied head (whose gradient lands in the embedding first), an
// untied one, MoD and MoE layers, and with layers recomputed.
TEST_CASE("Model: the backward reports each gradient range once it is final", "[train][overlap]") {
  for (const bool tied : {false, true})
    for (const bool recompute : {false, true}) {
      ModelConfig m = small_config();
      m.tie_word_embeddings = tied;
      const int t = 8;
      Model model(m, DType::f64, Device{}, 2, t, true, MemoryPlan{recompute, false});
      model.init_weights(3);
      Ctx ctx;
      auto ids = tokens(2 * t, m.vocab_size, 5), tg = tokens(2 * t, m.vocab_size, 6);
      model.zero_grads(ctx);
      model.upload_batch(ctx, ids.data(), tg.data());
      model.queue_forward_backward(ctx, 1.0);  // a first micro-batch: gradients accumulate
      model.upload_batch(ctx, tg.data(), ids.data());
      struct Report {
        size_t begin, end;
        std::vector<double> grads;
      };
      std::vector<Report> reports;
      const double* g = model.grads().ptr<double>();
      model.queue_forward_backward(ctx, 0.5, [&](Ctx&, size_t begin, size_t end) {
        reports.push_back({begin, end, std::vector<double>(g + begin, g + end)});
      });
      INFO("tied " << tied << " recompute " << recompute);
      REQUIRE(reports.size() == static_cast<size_t>(m.num_hidden_layers) + 2);
      size_t expect_end = model.table().total;
      for (const Report& r : reports) {
        CHECK(r.end == expect_end);
        CHECK(r.begin < r.end);
        CHECK(std::equal(r.grads.begin(), r.grads.end(), g + r.begin));
        expect_end = r.begin;
      }
      CHECK(expect_end == 0);
      // The embedding is last, and (tied) also holds the head's gradient.
      CHECK(reports.back().end ==
            model.table().find("model.layers.0.input_layernorm.weight").offset);
    }
}

TEST_CASE("GradientBuckets: adjacent ranges become buckets of at least the bucket size",
          "[train][overlap]") {
  std::vector<std::pair<size_t, size_t>> launched;
  GradientBuckets b(100, 25, [&](size_t lo, size_t hi) { launched.emplace_back(lo, hi); });
  for (int step = 0; step < 2; ++step) {  // flush starts over for the next step
    launched.clear();
    b.ready(90, 100);  // 10: pending
    CHECK(launched.empty());
    b.ready(60, 90);  // 40 >= 25: launched
    b.ready(50, 60);
    b.ready(20, 50);  // 40: launched
    b.ready(20, 20);  // an empty range is fine
    b.ready(0, 20);   // 20 < 25: waits for flush
    CHECK(launched.size() == 2);
    b.flush();
    const std::vector<std::pair<size_t, size_t>> want = {{60, 100}, {20, 60}, {0, 20}};
    CHECK(launched == want);
  }
  CHECK_THROWS_AS(b.ready(0, 50), InternalError);  // does not end at 100
  GradientBuckets c(10, 4, [](size_t, size_t) {});
  c.ready(5, 10);
  CHECK_THROWS_AS(c.flush(), InternalError);  // [0, 5) never reported
  GradientBuckets whole(10, 1000, [&](size_t lo, size_t hi) { launched.emplace_back(lo, hi); });
  launched.clear();
  whole.ready(3, 10);
  whole.ready(0, 3);
  whole.flush();
  CHECK(launched == std::vector<std::pair<size_t, size_t>>{{0, 10}});  // one bucket
}

// train.recompute_layers, train.recompute_expert_inputs and train.recompute_expert_rows change
// where activations live, not the arithmetic: a short run (MoE, shared expert, MoD, router-bias
// updates) gives bitwise the same per-step losses.
TEST_CASE("train: recomputation gives bitwise the same run", "[train][recompute]") {
  const std::vector<std::string> base = {
      "train_micro_batch_size_per_gpu=2",
      "gradient_accumulation_steps=2",
      "model.vocab_size=29",
      "model.hidden_size=16",
      "model.intermediate_size=12",
      "model.num_hidden_layers=4",
      "model.num_attention_heads=2",
      "model.num_key_value_heads=1",
      "model.max_position_embeddings=16",
      "model.num_local_experts=4",
      "model.num_shared_experts=1",
      "model.moe_layer_freq=2",
      "model.router_bias_update_rate=0.01",
      "model.mod={\"enabled\": true, \"every\": 2, \"capacity\": 0.5}",
      "data.seq_len=16",
      "train.max_steps=6",
      "train.log_interval=3",
      "train.eval_batches=1",
      "train.save_at_end=false",
      "train.device=\"cpu\""};
  std::vector<std::vector<double>> losses;
  for (const char* recompute :
       {"", "train.recompute_layers=true", "train.recompute_expert_inputs=true",
        "train.recompute_expert_rows=true"}) {
    moe::test::TempDir dir;
    std::vector<std::string> o = base;
    if (*recompute) o.push_back(recompute);
    o.push_back("train.out_dir=\"" + dir.path.string() + "\"");
    std::ostringstream log;
    losses.push_back(train(parse_config("{}", o, "test"), log).losses);
  }
  REQUIRE(losses[0].size() == 6);
  CHECK(losses[1] == losses[0]);
  CHECK(losses[2] == losses[0]);
  CHECK(losses[3] == losses[0]);
}

// The gradient norm from the update's own read of the gradients (no clipping, no loss scale):
// the run is bitwise the one that computes the norm first and never clips (max_norm out of
// reach), and the logged norms agree but for the last bits (another summation order).
TEST_CASE("train: without clipping the norm comes from the update, the same run", "[train]") {
  const std::vector<std::string> base = {"train_micro_batch_size_per_gpu=2",
                                         "model.vocab_size=29",
                                         "model.hidden_size=16",
                                         "model.intermediate_size=12",
                                         "model.num_hidden_layers=2",
                                         "model.num_attention_heads=2",
                                         "model.num_key_value_heads=1",
                                         "model.max_position_embeddings=16",
                                         "model.num_local_experts=4",
                                         "data.seq_len=16",
                                         "optimizer.params.weight_decay=0.1",
                                         "train.max_steps=5",
                                         "train.log_interval=2",
                                         "train.eval_batches=1",
                                         "train.save_at_end=false",
                                         "train.device=\"cpu\""};
  std::vector<std::vector<double>> losses, norms;
  for (const char* clip : {"gradient_clipping=1e30", "gradient_clipping=0"}) {
    moe::test::TempDir dir;
    std::vector<std::string> o = base;
    o.push_back(clip);
    o.push_back("train.out_dir=\"" + dir.path.string() + "\"");
    std::ostringstream log;
    losses.push_back(train(parse_config("{}", o, "test"), log).losses);
    std::vector<double> n;  // the logged steps' grad_norm (steps 2, 4, 5)
    std::ifstream metrics(dir.path / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j["kind"] == "train") n.push_back(j["grad_norm"].get<double>());
    }
    norms.push_back(n);
  }
  REQUIRE(losses[0].size() == 5);
  CHECK(losses[1] == losses[0]);
  REQUIRE(norms[0].size() == 3);
  REQUIRE(norms[1].size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(norms[0][i] > 0);
    CHECK(norms[1][i] == Approx(norms[0][i]).epsilon(1e-12));
  }
}

// The probe on one rank (tests/mpi/dp_train.sh runs it on two, in directories that differ). Root
// may write anywhere, so the directory this rank "cannot write into" holds a directory where the
// probe's files go: opening it for writing fails for every user.
TEST_CASE("RunDirProbe: a rank sees its own token, or names the file it could not create",
          "[train]") {
  std::unique_ptr<Comm> comm = make_comm(RankInfo{}, Device{}, 5.0);
  test::TempDir dir;
  const std::string token = dir.file(".moe-train-ranks-probe");
  {
    const RunDirProbe probe(*comm, dir.path.string());
    CHECK_THAT(probe.seen(),
               Catch::Matchers::Matches("the one holding start-up token [0-9a-f]{16}"));
    CHECK(std::filesystem::exists(token));  // until the ranks have compared
  }
  CHECK_FALSE(std::filesystem::exists(token));  // removed with the probe
  // Two probes see two tokens (a fresh one per start-up, never an earlier run's).
  std::string first, second;
  { first = RunDirProbe(*comm, dir.path.string()).seen(); }
  { second = RunDirProbe(*comm, dir.path.string()).seen(); }
  CHECK(first != second);
  // This rank's own file cannot be created: the message names it and why.
  const std::string own = token + ".rank0";
  std::filesystem::create_directories(own);
  {
    const RunDirProbe probe(*comm, dir.path.string());
    CHECK_THAT(probe.seen(),
               Catch::Matchers::StartsWith("not writable by rank 0 (cannot create " + own + ": "));
  }
  // Rank 0's token cannot be written either (the directory is in the token's place): the same
  // message, and nothing of the probe's is removed that it did not make.
  std::filesystem::create_directories(own);
  std::filesystem::create_directories(token);
  {
    const RunDirProbe probe(*comm, dir.path.string());
    CHECK_THAT(probe.seen(), Catch::Matchers::StartsWith("not writable by rank 0"));
  }
  CHECK(std::filesystem::is_directory(token));
}

TEST_CASE("code_arch_note: a warning only where the binary lacks the device's faster kernels") {
  const std::string h100 = "NVIDIA H100 80GB HBM3";
  // The best code there is for each device: no warning.
  CHECK(code_arch_note(h100, 9, 0, 90, true).empty());
  CHECK(code_arch_note("NVIDIA A100", 8, 0, 80, false).empty());
  CHECK(code_arch_note("NVIDIA L40S", 8, 9, 80, true).empty());  // sm_80 code is sm_89's best
  CHECK(code_arch_note("Tesla T4", 7, 5, 75, false).empty());
  CHECK(code_arch_note("Tesla V100", 7, 0, 70, false).empty());
  // A T4 build on an H100, an A100 build on an H100, a 90-virtual build on an H100, a T4 build on
  // an A100: each names what is missing and the flag that fixes it.
  const std::string t4_on_h100 = code_arch_note(h100, 9, 0, 75, false);
  CHECK(t4_on_h100.rfind("warning: ", 0) == 0);
  CHECK(t4_on_h100.find("sm_75") != std::string::npos);
  CHECK(t4_on_h100.find("wgmma") != std::string::npos);
  CHECK(t4_on_h100.find("--arch sm_90") != std::string::npos);
  CHECK(t4_on_h100.find(h100) != std::string::npos);
  CHECK(t4_on_h100.back() == '\n');
  const std::string a100_on_h100 = code_arch_note(h100, 9, 0, 80, true);
  CHECK(a100_on_h100.find("sm_80, so") != std::string::npos);
  CHECK(a100_on_h100.find("-DMOE_CUDA_ARCHS=90") != std::string::npos);
  CHECK(code_arch_note(h100, 9, 0, 90, false).find("90-virtual") != std::string::npos);
  const std::string t4_on_a100 = code_arch_note("NVIDIA A100", 8, 0, 75, false);
  CHECK(t4_on_a100.find("bf16 tensor cores") != std::string::npos);
  CHECK(t4_on_a100.find("--arch sm_80") != std::string::npos);
}

TEST_CASE(
    "StopSignals: the first stop signal is kept, a second of its kind takes the default "
    "action, an ignored one stays ignored, and the handlers before come back",
    "[train]") {
  const auto handler_of = [](int signal) {
    struct sigaction now {};
    sigaction(signal, nullptr, &now);
    return now.sa_handler;
  };
  // A known start, whatever the test runner left: SIGUSR1 ignored, the others at their default.
  const int touched[4] = {SIGUSR1, SIGINT, SIGTERM, SIGPIPE};
  struct sigaction saved[4];
  for (int i = 0; i < 4; ++i) {
    struct sigaction start {};
    start.sa_handler = i == 0 ? SIG_IGN : SIG_DFL;
    sigemptyset(&start.sa_mask);
    sigaction(touched[i], &start, &saved[i]);
  }
  {
    const StopSignals stop;
    CHECK(stop.received() == 0);
    CHECK(handler_of(SIGUSR1) == SIG_IGN);  // ignored when the process started: left so
    std::raise(SIGUSR1);
    CHECK(stop.received() == 0);
    CHECK(handler_of(SIGINT) != SIG_DFL);
    std::raise(SIGINT);
    CHECK(stop.received() == SIGINT);
    CHECK(stop.flag() == 1);
    CHECK(handler_of(SIGINT) == SIG_DFL);   // a second SIGINT would end the process
    CHECK(handler_of(SIGPIPE) == SIG_IGN);  // a closed pipe no longer ends it before its save
    CHECK(handler_of(SIGTERM) != SIG_DFL);  // the others still stop gracefully
    std::raise(SIGTERM);
    CHECK(stop.received() == SIGINT);  // the first one is the one reported
    CHECK(std::string(StopSignals::name(SIGUSR1)) == "SIGUSR1");
  }
  CHECK(handler_of(SIGUSR1) == SIG_IGN);  // the handlers before, back
  CHECK(handler_of(SIGINT) == SIG_DFL);
  CHECK(handler_of(SIGTERM) == SIG_DFL);
  CHECK(handler_of(SIGPIPE) == SIG_IGN);  // but not SIGPIPE's: the process is stopping
  std::signal(SIGPIPE, SIG_DFL);
  {  // A new StopSignals starts with nothing received, and without a stop restores SIGPIPE too.
    const StopSignals fresh;
    CHECK(fresh.received() == 0);
    CHECK(fresh.flag() == -1);
  }
  CHECK(handler_of(SIGPIPE) == SIG_DFL);
  for (int i = 0; i < 4; ++i) sigaction(touched[i], &saved[i], nullptr);
}

TEST_CASE("StopSignals::agreed: the ranks' summed flags name SIGTERM before SIGINT before SIGUSR1",
          "[train]") {
  const double none[3] = {0, 0, 0}, usr1[3] = {0, 0, 3}, int_usr1[3] = {0, 2, 1},
               all[3] = {1, 1, 1};
  CHECK(StopSignals::agreed(none) == 0);
  CHECK(StopSignals::agreed(usr1) == SIGUSR1);
  CHECK(StopSignals::agreed(int_usr1) == SIGINT);
  CHECK(StopSignals::agreed(all) == SIGTERM);
}
