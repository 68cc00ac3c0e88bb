// Whole-model tests: the analytic gradient of the full model (dense, MoE with shared experts and
// aux/z losses, MoD over a dense and over a MoE layer) against central finite differences in
// f64; the parameter layout; and a tiny model overfitting one fixed batch.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>

#include "test_util.hpp"
#include "moe/memory.hpp"
#include "moe/model.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/optim.hpp"
#include "moe/rng.hpp"

using namespace moe;

namespace {

// 6 layers: MoE at 1, 3, 5 (freq 2); MoD at 2 (dense) and 5 (MoE); GQA 2:1; a shared expert.
ModelConfig gradcheck_config() {
  ModelConfig m;
  m.vocab_size = 11;
  m.hidden_size = 8;
  m.intermediate_size = 6;
  m.dense_intermediate_size = 5;
  m.num_hidden_layers = 6;
  m.num_attention_heads = 2;
  m.num_key_value_heads = 1;
  m.max_position_embeddings = 16;
  m.rope_theta = 100.0;
  m.num_local_experts = 4;
  m.num_experts_per_tok = 2;
  m.num_shared_experts = 1;
  m.shared_expert_intermediate_size = 3;
  m.moe_layer_freq = 2;
  m.router_aux_loss_coef = 0.1;
  m.router_z_loss_coef = 0.05;
  m.mod.enabled = true;
  m.mod.every = 3;
  m.mod.capacity = 0.5;
  m.mod.predictor_hidden_size = 4;
  m.initializer_range = 0.5;  // large weights: every path carries a visible gradient
  return m;
}

struct TokenBatch {
  std::vector<int32_t> ids, targets;
};

TokenBatch random_tokens(int n, int vocab, uint64_t seed) {
  Rng rng(seed);
  TokenBatch d{std::vector<int32_t>(n), std::vector<int32_t>(n)};
  for (int i = 0; i < n; ++i) {
    d.ids[i] = static_cast<int32_t>(rng.below(vocab));
    d.targets[i] = static_cast<int32_t>(rng.below(vocab));
  }
  return d;
}

bool is_predictor(const std::string& name) {
  return name.find("mod.predictor") != std::string::npos;
}

// Checks d(total loss)/d(param) for every element of the parameters `select` picks.
void check_model_gradient(ModelConfig cfg, bool predictor_params, double* checked_out) {
  const int b = 2, t = 8;
  Model model(cfg, DType::f64, Device{}, b, t);
  model.init_weights(3);
  Ctx ctx;
  TokenBatch data = random_tokens(b * t, cfg.vocab_size, 5);
  data.targets[3] = -1;  // an ignored target is excluded from the mean
  model.zero_grads(ctx);
  model.forward_backward(ctx, data.ids.data(), data.targets.data(), 1.0);

  double* p = model.params().ptr<double>();
  const double* g = model.grads().ptr<double>();
  std::vector<double> x, analytic;
  std::vector<size_t> index;
  for (const auto& info : model.table().params) {
    if (is_predictor(info.name) != predictor_params) continue;
    for (size_t i = 0; i < info.numel(); ++i) {
      index.push_back(info.offset + i);
      x.push_back(p[info.offset + i]);
      analytic.push_back(g[info.offset + i]);
    }
  }
  REQUIRE(!index.empty());
  auto loss = [&] {
    for (size_t i = 0; i < index.size(); ++i) p[index[i]] = x[i];
    return model.forward(ctx, data.ids.data(), data.targets.data()).total();
  };
  // f64 end to end: central differences with h = 1e-6 are good to ~1e-8 absolute here.
  test::check_gradient(x, analytic, loss, 1e-6, 1e-5, 1e-7, "whole model");
  *checked_out = static_cast<double>(index.size());
}

}  // namespace

TEST_CASE("parameter table follows the Mixtral names and kinds", "[model]") {
  ModelConfig m = gradcheck_config();
  ParamTable t = build_param_table(m);
  CHECK(t.find("model.layers.1.block_sparse_moe.experts.{j}.w1.weight").stack == 4);
  CHECK(t.find("model.layers.1.block_sparse_moe.experts.{j}.w2.weight").shape ==
        std::vector<int64_t>{8, 6});
  CHECK(t.find("model.layers.0.mlp.gate_proj.weight").shape == std::vector<int64_t>{5, 8});
  CHECK(t.find("model.layers.2.mod.router.weight").shape == std::vector<int64_t>{1, 8});
  CHECK(t.find("model.layers.5.mod.predictor.fc1.weight").shape == std::vector<int64_t>{4, 8});
  CHECK(t.find("model.layers.0.self_attn.k_proj.weight").shape == std::vector<int64_t>{4, 8});
  CHECK(t.find("model.norm.weight").kind == ParamKind::norm);
  CHECK(t.find("model.layers.3.self_attn.o_proj.weight").kind == ParamKind::residual);
  CHECK_FALSE(param_kind_decays(ParamKind::norm));
  CHECK(param_kind_decays(ParamKind::matrix));
  CHECK_THROWS(t.find("model.layers.0.mod.router.weight"));  // layer 0 is not MoD
  // contiguous, non-overlapping, covering the buffer
  size_t next = 0;
  for (const auto& p : t.params) {
    CHECK(p.offset == next);
    next += p.numel();
  }
  CHECK(next == t.total);
  m.tie_word_embeddings = true;
  CHECK_THROWS(build_param_table(m).find("lm_head.weight"));
}

TEST_CASE("whole-model gradient matches finite differences", "[model][gradcheck]") {
  double checked = 0;
  SECTION("every parameter but the MoD predictors (predictor loss off)") {
    ModelConfig m = gradcheck_config();
    m.mod.predictor_loss_coef = 0.0;
    check_model_gradient(m, false, &checked);
    CHECK(checked > 1000);
  }
  SECTION("tied embeddings and unnormalised top-K") {
    ModelConfig m = gradcheck_config();
    m.mod.predictor_loss_coef = 0.0;
    m.tie_word_embeddings = true;
    m.norm_topk_prob = false;
    check_model_gradient(m, false, &checked);
  }
  SECTION("experts wider than the model (F > d: w3's input gradient reuses dgate's buffer)") {
    ModelConfig m = gradcheck_config();
    m.mod.predictor_loss_coef = 0.0;
    m.intermediate_size = 12;
    check_model_gradient(m, false, &checked);
  }
  SECTION("the causal predictors (they see stop-gradient x)") {
    check_model_gradient(gradcheck_config(), true, &checked);
    CHECK(checked == 2 * (4 * 8 + 4));
  }
}

// Large host buffers are mapped pages: zero, writable, movable, and memory only where written
// (the CPU model that holds a ZeRO-3 run's whole weights while it saves never writes its
// gradient buffer). Resident size from /proc/self/statm (Linux); AddressSanitizer builds keep
// heap buffers, which are written when zeroed.
TEST_CASE("host buffers: large ones read zero and cost memory only where written", "[memory]") {
  auto resident_mib = [] {
    std::ifstream f("/proc/self/statm");
    long size = 0, resident = 0;
    f >> size >> resident;
    return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / 1048576.0;
  };
  const size_t bytes = size_t{256} << 20;
  const double before = resident_mib();
  Buffer b(Device{}, bytes);
  auto* p = static_cast<unsigned char*>(b.data());
  CHECK(reinterpret_cast<uintptr_t>(p) % Arena::kAlign == 0);
  CHECK((p[0] == 0 && p[bytes / 2] == 0 && p[bytes - 1] == 0));
#if !defined(__SANITIZE_ADDRESS__)
  CHECK(resident_mib() - before < 16);  // three pages read
#endif
  std::memset(p, 1, bytes / 2);
  CHECK(resident_mib() - before > 100);  // written: 128 MiB
  Buffer moved(std::move(b));
  CHECK(static_cast<unsigned char*>(moved.data())[bytes / 2 - 1] == 1);
  CHECK(static_cast<unsigned char*>(moved.data())[bytes / 2] == 0);
  CHECK(b.data() == nullptr);
  Buffer small(Device{}, 1000);  // below kMapMinBytes: the heap, zeroed
  CHECK(static_cast<unsigned char*>(small.data())[999] == 0);
}

TEST_CASE("the dry-run plan predicts the allocated sizes", "[model]") {
  ModelConfig m = gradcheck_config();
  Model planned(m, DType::f32, Device{}, 3, 8, false);
  Model real(m, DType::f32, Device{}, 3, 8, true);
  CHECK(planned.activation_bytes() == real.activation_bytes());
  CHECK(planned.scratch_bytes() == real.scratch_bytes());
  CHECK(real.scratch_bytes() > 0);
}

TEST_CASE("model: the step statistics hold each MoE layer's loads and the raised step flags",
          "[model]") {
  const ModelConfig m = gradcheck_config();  // MoE at layers 1, 3 and 5 (in a MoD block)
  const int b = 3, t = 8;
  Model model(m, DType::f32, Device{}, b, t);
  model.init_weights(4);
  Ctx ctx;
  const TokenBatch data = random_tokens(b * t, m.vocab_size, 6);
  model.reset_stats(ctx);
  model.upload_batch(ctx, data.ids.data(), data.targets.data());
  model.queue_forward(ctx);
  model.raise_step_flag(ctx, 2);
  const Losses raised = model.read_stats(ctx);
  CHECK(raised.flags[0] == 0);
  CHECK(raised.flags[1] == 0);
  CHECK(raised.flags[2] == 1);
  const auto& loads = model.routing().expert_load;
  REQUIRE(loads.size() == 3);
  const double k = m.num_experts_per_tok;
  const double slots[3] = {b * t * k, b * t * k, b * (t / 2) * k};  // the MoD block keeps half
  for (size_t i = 0; i < loads.size(); ++i) {
    INFO("MoE layer " << i);
    REQUIRE(loads[i].size() == static_cast<size_t>(m.num_local_experts));
    CHECK(std::accumulate(loads[i].begin(), loads[i].end(), 0.0) == slots[i]);
  }
  CHECK(loads[0] != loads[1]);  // each layer its own row
  const Losses next = model.forward(ctx, data.ids.data(), data.targets.data());
  CHECK(next.flags[2] == 0);  // a step's flags are cleared with its losses
  CHECK(next.lm == Approx(raised.lm).epsilon(1e-12));
}

TEST_CASE("model: a forward-only model computes the same losses without a gradient buffer",
          "[model]") {
  const ModelConfig m = gradcheck_config();
  const int b = 2, t = 8;
  MemoryPlan forward_only;
  forward_only.forward_only = true;
  Model full(m, DType::f32, Device{}, b, t),
      eval(m, DType::f32, Device{}, b, t, true, forward_only);
  full.init_weights(7);
  eval.init_weights(7);
  CHECK(eval.grad_bytes() == 0);
  CHECK(full.grad_bytes() > 0);
  CHECK(eval.weight_bytes() + full.grad_bytes() == full.weight_bytes());
  CHECK(eval.scratch_bytes() <= full.scratch_bytes());
  CHECK(eval.grads().empty());
  Ctx ctx;
  const TokenBatch data = random_tokens(b * t, m.vocab_size, 3);
  const Losses lf = full.forward(ctx, data.ids.data(), data.targets.data());
  const Losses le = eval.forward(ctx, data.ids.data(), data.targets.data());
  CHECK(le.lm == lf.lm);
  CHECK(le.aux == lf.aux);
  CHECK(le.mod_pred == lf.mod_pred);
  CHECK(eval.routing().expert_load == full.routing().expert_load);
  CHECK_THROWS_AS(eval.zero_grads(ctx), InternalError);
  CHECK_THROWS_AS(eval.queue_forward_backward(ctx, 1.0), InternalError);
}

TEST_CASE("a tiny model overfits one fixed batch", "[model][train]") {
  ModelConfig m = gradcheck_config();
  m.vocab_size = 16;
  m.hidden_size = 32;
  m.intermediate_size = 32;
  m.dense_intermediate_size = 32;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.initializer_range = 0.02;
  m.num_hidden_layers = 3;
  m.mod.every = 2;
  const int b = 4, t = 16;
  Model model(m, DType::f32, Device{}, b, t);
  model.init_weights(1);
  OptimizerConfig oc;
  oc.lr = 1e-2;
  oc.weight_decay = 0.0;
  AdamW opt(oc, model);
  TokenBatch data = random_tokens(b * t, m.vocab_size, 9);
  Ctx ctx;
  double first = 0, last = 0;
  for (int step = 0; step < 150; ++step) {
    model.zero_grads(ctx);
    Losses l = model.forward_backward(ctx, data.ids.data(), data.targets.data(), 1.0);
    if (step == 0) first = l.lm;
    last = l.lm;
    opt.step(ctx, model, oc.lr, 1.0);
  }
  INFO("first loss " << first << ", last loss " << last);
  CHECK(first > 2.0);  // about ln(16) = 2.77 at init
  // random targets are memorisable only by position and context: a stated bound of 0.1 nats
  CHECK(last < 0.1);
}

// Activation recomputation re-runs each layer's forward from its saved input just before its
// backward (layers), or rebuilds the MoE layers' permuted rows and SwiGLU output (expert inputs)
// or their permuted rows only (expert rows; "gathered": the forward reads x's rows itself,
// MOE_PERMUTE_FUSED=1): the same arithmetic in the same order, so losses and every gradient are
// bitwise those of the stored-activation model, with less activation memory and the losses
// counted once.
TEST_CASE("model: recomputing gives bitwise the same losses and gradients", "[model]") {
  ModelConfig m = gradcheck_config();
  m.router_bias_update_rate = 0.01;  // the step loads feed the bias update: counted once
  const int b = 2, t = 8;
  const std::string which =
      GENERATE(as<std::string>{}, "layers", "expert inputs", "expert rows", "gathered", "both");
  INFO("recompute " << which);
  MemoryPlan recompute;
  recompute.recompute_layers = which == "layers" || which == "both";
  recompute.recompute_expert_inputs = which == "expert inputs" || which == "both";
  recompute.recompute_expert_rows = which == "expert rows" || which == "gathered";
  if (which == "gathered") setenv("MOE_PERMUTE_FUSED", "1", 1);
  Model stored(m, DType::f32, Device{}, b, t),
      recomputed(m, DType::f32, Device{}, b, t, true, recompute);
  REQUIRE(recomputed.recomputes_layers() == recompute.recompute_layers);
  REQUIRE(recomputed.recomputes_expert_inputs() == recompute.recompute_expert_inputs);
  REQUIRE(recomputed.recomputes_expert_rows() == (which != "layers"));
  CHECK(recomputed.activation_bytes() < stored.activation_bytes());
  stored.init_weights(3);
  recomputed.init_weights(3);
  Ctx ctx;
  for (uint64_t seed : {5, 6}) {  // two steps: the router biases move between them
    const TokenBatch data = random_tokens(b * t, m.vocab_size, seed);
    stored.zero_grads(ctx);
    recomputed.zero_grads(ctx);
    const Losses ls = stored.forward_backward(ctx, data.ids.data(), data.targets.data(), 1.0);
    const Losses lr = recomputed.forward_backward(ctx, data.ids.data(), data.targets.data(), 1.0);
    CHECK(lr.lm == ls.lm);
    CHECK(lr.aux == ls.aux);
    CHECK(lr.z == ls.z);
    CHECK(lr.mod_pred == ls.mod_pred);
    CHECK(recomputed.routing().expert_load == stored.routing().expert_load);
    CHECK(recomputed.routing().mod_kept == stored.routing().mod_kept);
    const float* gs = stored.grads().ptr<float>();
    const float* gr = recomputed.grads().ptr<float>();
    size_t differing = 0;
    for (size_t i = 0; i < stored.table().total; ++i) differing += gs[i] != gr[i] ? 1 : 0;
    CHECK(differing == 0);
    stored.after_step(ctx);
    recomputed.after_step(ctx);
    const auto bs = stored.router_biases(), br = recomputed.router_biases();
    REQUIRE(bs.size() == br.size());
    for (size_t i = 0; i < bs.size(); ++i)
      CHECK(std::equal(bs[i].ptr<float>(), bs[i].ptr<float>() + bs[i].numel(), br[i].ptr<float>()));
  }
  unsetenv("MOE_PERMUTE_FUSED");
}

// zero_grads(ctx, true), the trainer's: the expert stacks keep whatever they held (garbage here)
// until the next backward writes them; that backward and a second one that adds (gradient
// accumulation) give bitwise the gradients of a model zeroed in full, and gradient checks still
// see += on every other parameter.
TEST_CASE("model: zero_grads leaving the experts to the backward gives the same gradients",
          "[model]") {
  const ModelConfig m = gradcheck_config();
  const int b = 2, t = 8;
  Model full(m, DType::f32, Device{}, b, t), deferred(m, DType::f32, Device{}, b, t);
  full.init_weights(4);
  deferred.init_weights(4);
  Ctx ctx;
  bool any_stack = false;
  for (const ParamInfo& p : deferred.table().params) any_stack = any_stack || p.stack > 1;
  REQUIRE(any_stack);  // the config has expert stacks
  for (int round = 0; round < 2; ++round) {
    INFO("round " << round);
    fill(ctx, deferred.grads(), std::nan(""));  // garbage the zeroing must not depend on
    full.zero_grads(ctx);
    deferred.zero_grads(ctx, true);
    // Only the expert stacks are left for the backward.
    const float* g = deferred.grads().ptr<float>();
    for (const ParamInfo& p : deferred.table().params) {
      INFO(p.name);
      CHECK(std::isnan(g[p.offset]) == (p.stack > 1));
    }
    for (uint64_t seed : {7, 8}) {  // the second micro-batch adds onto the first
      const TokenBatch data = random_tokens(b * t, m.vocab_size, seed + 2 * round);
      full.forward_backward(ctx, data.ids.data(), data.targets.data(), 0.5);
      deferred.forward_backward(ctx, data.ids.data(), data.targets.data(), 0.5);
    }
    const float* gf = full.grads().ptr<float>();
    size_t differing = 0;
    for (size_t i = 0; i < full.table().total; ++i) differing += gf[i] != g[i] ? 1 : 0;
    CHECK(differing == 0);
  }
}

// train.head_chunk_tokens: the head over chunks (each chunk's backward at once) against the
// whole-batch head, tied and untied, for chunks that divide B*T, do not, are one token, or
// exceed it. The per-token losses are the same rows either way; the head's weight gradient is a
// sum over chunks instead of one product (f64: within rounding).
TEST_CASE("model: the head in chunks gives the whole head's losses and gradients", "[model]") {
  const bool tied = GENERATE(false, true);
  const int64_t chunk = GENERATE(as<int64_t>{}, 1, 5, 8, 100);
  INFO("tied " << tied << " chunk " << chunk);
  ModelConfig m = gradcheck_config();
  m.tie_word_embeddings = tied;
  const int b = 2, t = 8;
  MemoryPlan plan;
  plan.head_chunk_tokens = chunk;
  Model whole(m, DType::f64, Device{}, b, t), chunked(m, DType::f64, Device{}, b, t, true, plan);
  REQUIRE(chunked.logits().size(0) == std::min<int64_t>(chunk, b * t));
  whole.init_weights(3);
  chunked.init_weights(3);
  Ctx ctx;
  TokenBatch data = random_tokens(b * t, m.vocab_size, 5);
  data.targets[3] = -1;  // an ignored target inside a chunk
  whole.zero_grads(ctx);
  chunked.zero_grads(ctx);
  const Losses lw = whole.forward_backward(ctx, data.ids.data(), data.targets.data(), 0.5);
  const Losses lc = chunked.forward_backward(ctx, data.ids.data(), data.targets.data(), 0.5);
  CHECK(lc.lm == Approx(lw.lm).epsilon(1e-14));
  CHECK(lc.total() == Approx(lw.total()).epsilon(1e-14));
  const double* gw = whole.grads().ptr<double>();
  const double* gc = chunked.grads().ptr<double>();
  double worst = 0, scale = 0;
  for (size_t i = 0; i < whole.table().total; ++i) {
    worst = std::max(worst, std::fabs(gw[i] - gc[i]));
    scale = std::max(scale, std::fabs(gw[i]));
  }
  REQUIRE(scale > 0);
  CHECK(worst <= 1e-13 * scale);
  // forward only (evaluation) runs the chunks too
  const Losses ew = whole.forward(ctx, data.ids.data(), data.targets.data());
  const Losses ec = chunked.forward(ctx, data.ids.data(), data.targets.data());
  CHECK(ec.lm == Approx(ew.lm).epsilon(1e-14));
}
