// The trainer as a tool, end to end in-process: a run interrupted after a checkpoint and resumed
// gives bitwise the losses of an uninterrupted run (synthetic source and token shards), resume
// skips an incomplete newer checkpoint, metrics.jsonl holds each step once, and export ->
// init_from gives the identical model.
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "catch.hpp"
#include "moe/checkpoint.hpp"
#include "moe/config.hpp"
#include "moe/rng.hpp"
#include "moe/shards.hpp"
#include "moe/trainer.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;
namespace fs = std::filesystem;

namespace {

Config small_run(const fs::path& out_dir, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> o = {
      "train_micro_batch_size_per_gpu=2",
      "model.vocab_size=40",
      "model.hidden_size=16",
      "model.intermediate_size=16",
      "model.num_hidden_layers=4",
      "model.num_attention_heads=2",
      "model.num_key_value_heads=1",
      "model.max_position_embeddings=32",
      "model.num_local_experts=4",
      "model.num_experts_per_tok=2",
      "model.num_shared_experts=1",
      "model.moe_layer_freq=2",
      "model.router_bias_update_rate=0.01",
      "model.mod={\"enabled\": true, \"every\": 2, \"capacity\": 0.5}",
      "data.seq_len=16",
      "optimizer.params.lr=0.01",
      "train.max_steps=6",
      "train.log_interval=1",
      "train.eval_interval=0",
      "train.eval_batches=1",
      "train.save_interval=3",
      "train.out_dir=\"" + out_dir.string() + "\"",
  };
  o.insert(o.end(), extra.begin(), extra.end());
  return parse_config("{}", o, "test");
}

int count_train_lines(const fs::path& metrics, int step) {
  std::ifstream in(metrics);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train" && j["step"] == step) ++n;
  }
  return n;
}

void write_random_shards(const fs::path& dir, int vocab) {
  fs::create_directories(dir);
  Rng rng(17);
  for (int s = 0; s < 2; ++s) {
    std::vector<uint32_t> tokens(700);
    for (auto& t : tokens) t = static_cast<uint32_t>(rng.below(vocab));
    write_shard((dir / ("train_00000" + std::to_string(s) + ".bin")).string(), tokens, vocab);
  }
  std::vector<uint32_t> val(300);
  for (auto& t : val) t = static_cast<uint32_t>(rng.below(vocab));
  write_shard((dir / "val_000000.bin").string(), val, vocab);
}

void check_resume_is_bitwise(const std::vector<std::string>& extra) {
  TempDir a, b;
  std::ostringstream log;
  TrainResult whole = train(small_run(a.path, extra), log);
  REQUIRE(whole.losses.size() == 6);

  TrainOptions stop;
  stop.stop_after_step = 3;  // "killed" right after the step-3 checkpoint
  TrainResult first = train(small_run(b.path, extra), log, stop);
  REQUIRE(first.losses.size() == 3);
  TrainResult rest = train(small_run(b.path, extra), log);  // no resume: starts over
  CHECK(rest.resumed_from == 0);

  // now really resume: a fresh out_dir, interrupted, then --resume auto
  TempDir c;
  train(small_run(c.path, extra), log, stop);
  auto resumed_cfg = small_run(c.path, extra);
  resumed_cfg.train.resume = "auto";
  TrainResult resumed = train(resumed_cfg, log);
  CHECK(resumed.resumed_from == 3);
  REQUIRE(resumed.losses.size() == 3);
  for (int i = 0; i < 3; ++i) {
    INFO("step " << i + 4);
    CHECK(resumed.losses[i] == whole.losses[i + 3]);  // bitwise
    CHECK(first.losses[i] == whole.losses[i]);
  }
  for (int step = 1; step <= 6; ++step)
    CHECK(count_train_lines(c.path / "metrics.jsonl", step) == 1);
}

}  // namespace

TEST_CASE("resume is bitwise identical: synthetic source", "[e2e][resume]") {
  check_resume_is_bitwise({});
}

TEST_CASE("resume is bitwise identical: token shards", "[e2e][resume]") {
  TempDir data;
  write_random_shards(data.path, 40);
  check_resume_is_bitwise({"data.source=shards",
                           "data.train_files=\"" + (data.path / "train_*.bin").string() + "\"",
                           "data.val_files=\"" + (data.path / "val_*.bin").string() + "\""});
}

TEST_CASE("resume skips an incomplete newer checkpoint", "[e2e][resume]") {
  TempDir run;
  std::ostringstream log;
  TrainOptions stop;
  stop.stop_after_step = 3;
  train(small_run(run.path), log, stop);
  // a later save that died before its DONE marker
  fs::create_directories(run.path / "step_00000005");
  std::ofstream(run.path / "step_00000005" / "model.safetensors") << "partial";
  auto cfg = small_run(run.path);
  cfg.train.resume = "auto";
  std::ostringstream log2;
  TrainResult r = train(cfg, log2);
  CHECK(r.resumed_from == 3);
  CHECK(log2.str().find("step_00000005") != std::string::npos);  // warned about it
  CHECK(r.steps == 6);
}

TEST_CASE("a checkpoint of another model shape is refused with the file named", "[e2e][resume]") {
  TempDir run;
  std::ostringstream log;
  train(small_run(run.path, {"train.max_steps=3"}), log);
  auto cfg = small_run(run.path, {"model.hidden_size=24"});
  cfg.train.resume = "auto";
  try {
    train(cfg, log);
    FAIL("expected InputError");
  } catch (const InputError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("rank_00000.state") != std::string::npos);
  }
}

TEST_CASE("export -> init_from gives the identical model and eval loss", "[e2e][export]") {
  TempDir run, hf;
  std::ostringstream log;
  // Mixtral-compatible: every layer MoE, no shared experts, no MoD
  std::vector<std::string> mixtral = {"model.moe_layer_freq=1", "model.num_shared_experts=0",
                                      "model.mod.enabled=false", "model.router_bias_update_rate=0",
                                      "train.max_steps=3"};
  Config cfg = small_run(run.path, mixtral);
  train(cfg, log);
  export_hf(run.path.string(), hf.path.string());
  CHECK(fs::exists(hf.path / "model.safetensors"));
  CHECK(fs::exists(hf.path / "config.json"));

  const std::string step = find_latest_checkpoint(run.path.string(), nullptr);
  Model a(cfg.model, DType::f32, Device{}, 2, 16), b(cfg.model, DType::f32, Device{}, 2, 16);
  load_checkpoint_weights(step, a);
  b.init_weights(999);  // different start, fully overwritten below
  init_from_hf(b, hf.path.string());
  const float* pa = a.params().ptr<float>();
  const float* pb = b.params().ptr<float>();
  bool same = true;
  for (int64_t i = 0; i < a.params().numel(); ++i) same = same && pa[i] == pb[i];
  CHECK(same);
  Rng rng(3);
  std::vector<int32_t> ids(32), tg(32);
  for (int i = 0; i < 32; ++i)
    ids[i] = static_cast<int32_t>(rng.below(40)), tg[i] = static_cast<int32_t>(rng.below(40));
  Ctx ctx;
  CHECK(a.forward(ctx, ids.data(), tg.data()).lm == b.forward(ctx, ids.data(), tg.data()).lm);
}

TEST_CASE("eval and sampling see the trained router biases", "[e2e][resume]") {
  TempDir run;
  std::ostringstream log;
  Config cfg = small_run(run.path, {"train.max_steps=3"});  // router_bias_update_rate 0.01
  train(cfg, log);
  const std::string step = find_latest_checkpoint(run.path.string(), nullptr);
  Model full(cfg.model, DType::f32, Device{}, 2, 16), weights(cfg.model, DType::f32, Device{}, 2, 16);
  AdamW opt(cfg.optimizer, full);
  TrainerState st;
  load_checkpoint(step, 0, full, opt, st);
  load_checkpoint_weights(step, weights);
  const auto a = full.router_biases(), b = weights.router_biases();
  REQUIRE(a.size() == b.size());
  REQUIRE(!a.empty());
  bool nonzero = false, same = true;
  for (size_t l = 0; l < a.size(); ++l)
    for (int64_t e = 0; e < a[l].numel(); ++e) {
      nonzero = nonzero || a[l].ptr<float>()[e] != 0.0f;
      same = same && a[l].ptr<float>()[e] == b[l].ptr<float>()[e];
    }
  CHECK(nonzero);  // three steps of sign updates moved them
  CHECK(same);
}
