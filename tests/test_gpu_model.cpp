// The whole model on the GPU (fp32) against the CPU model on the same weights: losses and every
// gradient of one forward/backward, and a short training run whose loss curve tracks the CPU's.
#include <cmath>
#include <sstream>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "test_util.hpp"
#include "moe/model.hpp"
#include "moe/optim.hpp"
#include "moe/rng.hpp"
#include "moe/trainer.hpp"

using namespace moe;
using namespace moe::test;

namespace {

// Dense, MoE with a shared expert and aux-loss-free bias, MoD over a dense and a MoE layer, GQA.
ModelConfig model_config() {
  ModelConfig m;
  m.vocab_size = 61;
  m.hidden_size = 64;
  m.intermediate_size = 48;
  m.dense_intermediate_size = 80;
  m.num_hidden_layers = 6;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.max_position_embeddings = 64;
  m.rope_theta = 10000;
  m.num_local_experts = 8;
  m.num_experts_per_tok = 2;
  m.num_shared_experts = 1;
  m.shared_expert_intermediate_size = 32;
  m.moe_layer_freq = 2;
  m.router_z_loss_coef = 0.001;
  m.mod.enabled = true;
  m.mod.every = 3;
  m.mod.capacity = 0.5;
  m.mod.predictor_hidden_size = 16;
  return m;
}

std::vector<int32_t> tokens(size_t n, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(rng.below(vocab));
  return v;
}

std::vector<float> host_copy(Tensor t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  copy_to_host(v.data(), t);
  return v;
}

}  // namespace

TEST_CASE("gpu model: forward losses and all gradients match the CPU model", "[gpu][model]") {
  const ModelConfig m = model_config();
  const int b = 3, t = 32;
  Model cpu_model(m, DType::f32, Device{}, b, t), gpu_model(m, DType::f32, gpu0(), b, t);
  cpu_model.init_weights(11);
  gpu_model.init_weights(11);
  REQUIRE(host_copy(cpu_model.params()) == host_copy(gpu_model.params()));  // same weights
  const auto ids = tokens(b * t, m.vocab_size, 1), tg = tokens(b * t, m.vocab_size, 2);
  Ctx cpu;
  Ctx gpu = gpu_ctx();
  cpu_model.zero_grads(cpu);
  gpu_model.zero_grads(gpu);
  const Losses lc = cpu_model.forward_backward(cpu, ids.data(), tg.data(), 1.0);
  const Losses lg = gpu_model.forward_backward(gpu, ids.data(), tg.data(), 1.0);
  CHECK(lg.lm == Approx(lc.lm).epsilon(1e-5));
  CHECK(lg.aux == Approx(lc.aux).epsilon(1e-4));
  CHECK(lg.z == Approx(lc.z).epsilon(1e-4));
  CHECK(lg.mod_pred == Approx(lc.mod_pred).epsilon(1e-4));
  // Gradients: per parameter, max |gpu - cpu| relative to that parameter's largest gradient
  // (fp32 sums in a different order; routing and MoD selection are the same on both).
  const auto gc = host_copy(cpu_model.grads()), gg = host_copy(gpu_model.grads());
  for (const auto& p : cpu_model.table().params) {
    double diff = 0, scale = 0;
    for (size_t i = p.offset; i < p.offset + p.numel(); ++i) {
      diff = std::max(diff, std::fabs(static_cast<double>(gg[i]) - gc[i]));
      scale = std::max(scale, std::fabs(static_cast<double>(gc[i])));
    }
    INFO(p.name << ": max diff " << diff << ", max |grad| " << scale);
    CHECK(diff <= 1e-4 * scale + 1e-9);
  }
}

TEST_CASE("gpu model: a training run tracks the CPU run", "[gpu][train]") {
  std::vector<std::string> o = {"train_micro_batch_size_per_gpu=4",
                                "model.vocab_size=61",
                                "model.hidden_size=64",
                                "model.intermediate_size=48",
                                "model.num_hidden_layers=4",
                                "model.num_attention_heads=4",
                                "model.num_key_value_heads=2",
                                "model.max_position_embeddings=64",
                                "model.num_local_experts=8",
                                "model.num_shared_experts=1",
                                "model.moe_layer_freq=2",
                                "model.mod={\"enabled\": true, \"every\": 2, \"capacity\": 0.5}",
                                "data.seq_len=32",
                                "optimizer.params.lr=3e-3",
                                "train.max_steps=30",
                                "train.log_interval=10",
                                "train.eval_batches=1",
                                "train.save_interval=0",
                                "train.keep_checkpoints=1"};
  TempDir cpu_dir, gpu_dir;
  Config c = parse_config("{}", o, "test"), g = c;
  c.train.device = "cpu";
  c.train.out_dir = cpu_dir.path.string();
  g.train.device = "cuda";
  g.train.out_dir = gpu_dir.path.string();
  std::ostringstream log;
  const TrainResult rc = train(c, log), rg = train(g, log);
  REQUIRE(rc.losses.size() == 30);
  REQUIRE(rg.losses.size() == 30);
  double worst = 0;
  for (size_t i = 0; i < 30; ++i)
    worst = std::max(worst, std::fabs(rg.losses[i] - rc.losses[i]) / rc.losses[i]);
  INFO("worst relative loss difference over 30 steps: " << worst);
  CHECK(rc.losses.back() < rc.losses.front() - 0.05);  // it learns (30 steps from ln 61)
  CHECK(worst < 1e-3);  // stated tolerance: 0.1% of the loss at every step
}
