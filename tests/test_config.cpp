// Config parsing: defaults, the full layout, round trips, overrides, and one table of bad configs
// that each must fail at the right JSON path with a message a user can act on; docs/config.md has
// a row for every key.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "catch.hpp"
#include "config/config_internal.hpp"
#include "moe/config.hpp"
#include "moe/error.hpp"

using moe::Config;
using moe::ConfigError;
using nlohmann::json;

namespace {

Config parse(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return moe::parse_config(text, overrides, "test.json");
}

// The ConfigError that parsing throws, or nothing (any other exception fails the test).
std::optional<ConfigError> config_error(const std::string& text,
                                        const std::vector<std::string>& overrides = {}) {
  try {
    parse(text, overrides);
  } catch (const ConfigError& e) {
    return e;
  }
  return std::nullopt;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Every key set to a non-default value (only the HF keys that are never printed are left out;
// train.split_master and train.bf16_expert_grads keep their defaults, as true needs bf16 and
// ZeRO stage 0 (and one micro-batch): the bad and fixed cases below set them).
const char* kFullConfig = R"({
  "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "train_batch_size": 12,
  "gradient_clipping": 0.5,
  "optimizer": {"type": "AdamW",
                "params": {"lr": 0.001, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.05}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_min_ratio": 0.1,
                                               "total_num_steps": 50, "cos_min_ratio": 0.2}},
  "fp16": {"enabled": false, "loss_scale": 128.0, "initial_scale_power": 12,
           "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 0.5},
  "bf16": {"enabled": false},
  "zero_optimization": {"stage": 2, "overlap_comm": true, "reduce_bucket_size": 1000000.0,
                        "offload_optimizer": {"device": "cpu", "pin_memory": true,
                                              "overlap_backward": true},
                        "offload_param": {"device": "none", "pin_memory": true}},
  "model": {"vocab_size": 512, "hidden_size": 96, "intermediate_size": 160,
            "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
            "head_dim": 24, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 128, "num_local_experts": 6, "num_experts_per_tok": 3,
            "router_aux_loss_coef": 0.02, "router_z_loss_coef": 0.001,
            "router_bias_update_rate": 0.003, "tie_word_embeddings": true, "moe_layer_freq": 2,
            "dense_intermediate_size": 200, "norm_topk_prob": false, "num_shared_experts": 1,
            "shared_expert_intermediate_size": 80, "initializer_range": 0.01,
            "init_from": "hf/mixtral",
            "mod": {"enabled": true, "capacity": 0.5, "every": 3, "predictor_hidden_size": 16,
                    "predictor_loss_coef": 0.5}},
  "data": {"source": "shards", "seq_len": 64, "train_files": "data/train_*.bin",
           "val_files": "data/val_*.bin", "shuffle": false,
           "synthetic": {"seed": 7, "branching": 3}},
  "train": {"max_steps": 20, "log_interval": 5, "eval_interval": 10, "eval_batches": 2,
            "seed": 18446744073709551615, "device": "cuda:1", "out_dir": "runs/x",
            "save_interval": 5, "save_at_end": false, "keep_checkpoints": 2, "resume": "auto",
            "comm_timeout_s": 30.5, "recompute_layers": true,
            "recompute_expert_inputs": true, "recompute_expert_rows": true,
            "head_chunk_tokens": 512, "split_master": false, "bf16_expert_grads": false,
            "overlap_optimizer": false,
            "gpu_memory_limit_gib": 15.5}
})";

}  // namespace

TEST_CASE("config: an empty object gives the struct defaults, with derived sizes filled") {
  Config c = parse("{}");
  Config expected;
  CHECK(c.model.head_dim == 1024 / 16);
  CHECK(c.model.dense_intermediate_size == expected.model.intermediate_size);
  CHECK(c.model.shared_expert_intermediate_size == expected.model.intermediate_size);
  expected.model.head_dim = 64;
  expected.model.dense_intermediate_size = 2816;
  expected.model.shared_expert_intermediate_size = 2816;
  CHECK(moe::config_to_json_value(c) == moe::config_to_json_value(expected));
  CHECK(c.train_micro_batch_size_per_gpu == 8);
  CHECK(c.optimizer.beta2 == 0.95);
  CHECK(c.model.num_experts_per_tok == 2);
  CHECK(c.data.seq_len == 256);
  CHECK(c.train.device == "auto");
}

TEST_CASE("config: every key of a full config is read into its field") {
  Config c = parse(kFullConfig);
  CHECK(c.train_micro_batch_size_per_gpu == 4);
  CHECK(c.gradient_accumulation_steps == 3);
  CHECK(c.train_batch_size == 12);
  CHECK(c.train.comm_timeout_s == 30.5);
  CHECK(c.zero_optimization.stage == 2);
  CHECK(c.zero_optimization.overlap_comm);
  CHECK(c.zero_optimization.reduce_bucket_size == 1e6);
  CHECK(c.zero_optimization.offload_optimizer.device == "cpu");
  CHECK(c.zero_optimization.offload_optimizer.overlap_backward);
  CHECK(c.zero_optimization.offload_optimizer.pin_memory);
  CHECK(c.zero_optimization.offload_param.device == "none");
  CHECK(c.zero_optimization.offload_param.pin_memory);
  CHECK(c.zero_optimization.offloads_optimizer());
  CHECK(c.gradient_clipping == 0.5);
  CHECK(c.optimizer.lr == 0.001);
  CHECK(c.optimizer.beta1 == 0.8);
  CHECK(c.optimizer.beta2 == 0.99);
  CHECK(c.optimizer.eps == 1e-6);
  CHECK(c.optimizer.weight_decay == 0.05);
  CHECK(c.scheduler.type == "WarmupLR");
  CHECK(c.scheduler.warmup_num_steps == 10);
  CHECK(c.scheduler.warmup_min_ratio == 0.1);
  CHECK(c.scheduler.total_num_steps == 50);
  CHECK(c.scheduler.cos_min_ratio == 0.2);
  CHECK(c.fp16.loss_scale == 128.0);
  CHECK(c.fp16.initial_scale_power == 12);
  CHECK(c.fp16.loss_scale_window == 500);
  CHECK(c.fp16.hysteresis == 3);
  CHECK(c.fp16.min_loss_scale == 0.5);
  const moe::ModelConfig& m = c.model;
  CHECK(m.vocab_size == 512);
  CHECK(m.hidden_size == 96);
  CHECK(m.intermediate_size == 160);
  CHECK(m.num_hidden_layers == 3);
  CHECK(m.num_attention_heads == 6);
  CHECK(m.num_key_value_heads == 2);
  CHECK(m.head_dim == 24);
  CHECK(m.rms_norm_eps == 1e-6);
  CHECK(m.rope_theta == 10000.0);
  CHECK(m.max_position_embeddings == 128);
  CHECK(m.num_local_experts == 6);
  CHECK(m.num_experts_per_tok == 3);
  CHECK(m.router_aux_loss_coef == 0.02);
  CHECK(m.router_z_loss_coef == 0.001);
  CHECK(m.router_bias_update_rate == 0.003);
  CHECK(m.tie_word_embeddings);
  CHECK(m.moe_layer_freq == 2);
  CHECK(m.dense_intermediate_size == 200);
  CHECK_FALSE(m.norm_topk_prob);
  CHECK(m.num_shared_experts == 1);
  CHECK(m.shared_expert_intermediate_size == 80);
  CHECK(m.initializer_range == 0.01);
  CHECK(m.mod.enabled);
  CHECK(m.mod.capacity == 0.5);
  CHECK(m.mod.every == 3);
  CHECK(m.mod.predictor_hidden_size == 16);
  CHECK(m.mod.predictor_loss_coef == 0.5);
  CHECK(c.data.seq_len == 64);
  CHECK(c.data.synthetic.seed == 7);
  CHECK(c.data.synthetic.branching == 3);
  CHECK(c.train.max_steps == 20);
  CHECK(c.train.log_interval == 5);
  CHECK(c.train.eval_interval == 10);
  CHECK(c.train.eval_batches == 2);
  CHECK(c.train.seed == 18446744073709551615ull);
  CHECK(c.train.device == "cuda:1");
  CHECK(m.init_from == "hf/mixtral");
  CHECK(c.data.source == "shards");
  CHECK(c.data.train_files == "data/train_*.bin");
  CHECK(c.data.val_files == "data/val_*.bin");
  CHECK_FALSE(c.data.shuffle);
  CHECK(c.train.out_dir == "runs/x");
  CHECK(c.train.save_interval == 5);
  CHECK_FALSE(c.train.save_at_end);
  CHECK(c.train.gpu_memory_limit_gib == 15.5);
  CHECK(c.train.recompute_layers);
  CHECK(c.train.recompute_expert_inputs);
  CHECK(c.train.recompute_expert_rows);
  CHECK(c.train.head_chunk_tokens == 512);
  CHECK(!c.train.overlap_optimizer);
  CHECK(c.train.keep_checkpoints == 2);
  CHECK(c.train.resume == "auto");
}

TEST_CASE("config: the printed config is the input layout, key for key") {
  // Proves the writer covers every key the reader knows (and writes the same types back).
  CHECK(moe::config_to_json_value(parse(kFullConfig)) == json::parse(kFullConfig));
}

TEST_CASE("config: print -> parse round trip gives an equal config") {
  for (const char* text : {"{}", kFullConfig}) {
    INFO(text);
    Config a = parse(text);
    std::string printed = moe::config_to_json(a);
    Config b = parse(printed);
    CHECK(moe::config_to_json_value(b) == moe::config_to_json_value(a));
    CHECK(moe::config_to_json(b) == printed);
    CHECK(b.optimizer.beta1 == a.optimizer.beta1);
    CHECK(b.model.rms_norm_eps == a.model.rms_norm_eps);
    CHECK(b.train.seed == a.train.seed);
    // Compact output parses too.
    CHECK(moe::config_to_json_value(parse(moe::config_to_json(a, -1))) ==
          moe::config_to_json_value(a));
  }
}

TEST_CASE("config: printed in schema order, DeepSpeed keys first") {
  std::string printed = moe::config_to_json(parse("{}"));
  CHECK(printed.find("\"train_micro_batch_size_per_gpu\"") < printed.find("\"model\""));
  CHECK(printed.find("\"vocab_size\"") < printed.find("\"num_local_experts\""));
}

TEST_CASE("config: Hugging Face model keys can be pasted") {
  Config c = parse(R"({"model": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                                 "hidden_size": 256, "num_attention_heads": 4,
                                 "num_key_value_heads": 2}})");
  CHECK(c.model.hidden_size == 256);
  CHECK(c.model.head_dim == 64);
  CHECK_FALSE(moe::config_to_json_value(c)["model"].contains("model_type"));
}

TEST_CASE("config: small conveniences") {
  SECTION("float keys accept integers") {
    CHECK(parse(R"({"optimizer":{"params":{"lr":1}}})").optimizer.lr == 1.0);
  }
  SECTION("optimizer type is case-insensitive and normalised") {
    CHECK(parse(R"({"optimizer":{"type":"adamw"}})").optimizer.type == "AdamW");
  }
  SECTION("comments are allowed") {
    CHECK(parse("{\n// a note\n\"train\": {\"max_steps\": 3}}").train.max_steps == 3);
  }
  SECTION("total_num_steps 0 follows train.max_steps and stays 0") {
    CHECK(parse(R"({"scheduler":{"params":{"warmup_num_steps":500}}})").scheduler.total_num_steps ==
          0);
  }
  SECTION("train_batch_size may state micro * accumulation") {
    CHECK(parse(R"({"train_batch_size":16,"gradient_accumulation_steps":2})").train_batch_size ==
          16);
  }
}

TEST_CASE("config: overrides set and create nested values before validation") {
  SECTION("creates missing sections") {
    Config c = parse("{}", {"model.mod.enabled=true", "model.mod.capacity=0.25"});
    CHECK(c.model.mod.enabled);
    CHECK(c.model.mod.capacity == 0.25);
  }
  SECTION("replaces a value from the file; later overrides win") {
    Config c = parse(R"({"model": {"num_local_experts": 8}})",
                     {"model.num_local_experts=4", "model.num_local_experts = 6"});
    CHECK(c.model.num_local_experts == 6);
  }
  SECTION("values are JSON when they parse, else strings") {
    Config c = parse("{}", {"train.device=cpu", "optimizer.params.betas=[0.5, 0.6]",
                            "optimizer.params.lr=1e-3", "data.source=\"synthetic\""});
    CHECK(c.train.device == "cpu");
    CHECK(c.optimizer.beta1 == 0.5);
    CHECK(c.optimizer.lr == 1e-3);
  }
  SECTION("a whole section can be set") {
    Config c = parse("{}", {R"(model.mod={"enabled": true, "every": 4})"});
    CHECK(c.model.mod.every == 4);
    CHECK(c.model.mod.capacity == 0.125);
  }
  SECTION("an override makes a bad file value good (validation runs after)") {
    CHECK(parse(R"({"model": {"num_experts_per_tok": 9}})", {"model.num_experts_per_tok=1"})
              .model.num_experts_per_tok == 1);
  }
}

TEST_CASE("config: malformed JSON names the source, byte and line") {
  auto e = config_error("{\n  \"model\": {\"hidden_size\": 8,}\n}");
  REQUIRE(e);
  INFO(e->what());
  CHECK(e->path.empty());
  CHECK(contains(e->what(), "test.json"));
  CHECK(contains(e->what(), "malformed JSON"));
  CHECK(contains(e->what(), "byte"));
  CHECK(contains(e->what(), "line 2"));
}

TEST_CASE("config: unknown keys far from every sibling list the valid keys") {
  auto e = config_error(R"({"model": {"zzzzzzzz": 1}})");
  REQUIRE(e);
  INFO(e->what());
  CHECK(e->path == "model.zzzzzzzz");
  CHECK(contains(e->what(), "valid keys:"));
  CHECK(contains(e->what(), "num_local_experts"));
  CHECK_FALSE(contains(e->what(), "did you mean"));
}

TEST_CASE("config: load_config reads a file and names it in errors") {
  SECTION("missing file") {
    try {
      moe::load_config("/nonexistent/dir/cfg.json", {});
      FAIL("no error");
    } catch (const ConfigError& e) {
      CHECK(e.path.empty());
      CHECK(contains(e.what(), "/nonexistent/dir/cfg.json"));
    }
  }
  SECTION("a directory") {
    CHECK_THROWS_AS(moe::load_config("/tmp", {}), ConfigError);
  }
  SECTION("a real file, with overrides, and a broken one") {
    std::string path = "test_config_tmp_" + std::to_string(::getpid()) + ".json";
    {
      std::ofstream out(path);
      out << R"({"train": {"max_steps": 5}})";
    }
    CHECK(moe::load_config(path, {"train.log_interval=2"}).train.log_interval == 2);
    CHECK(moe::load_config(path, {}).train.max_steps == 5);
    {
      std::ofstream out(path);
      out << "{\"train\": ";
    }
    try {
      moe::load_config(path, {});
      FAIL("no error");
    } catch (const ConfigError& e) {
      CHECK(contains(e.what(), path));
    }
    std::remove(path.c_str());
  }
}

namespace {

struct BadCase {
  const char* what;
  std::string json;
  std::vector<std::string> overrides;
  std::string path;                // the expected ConfigError::path
  std::vector<std::string> words;  // each must appear in the message
};

std::string model(const std::string& body) {
  return R"({"model": {)" + body + "}}";
}

const std::vector<BadCase>& bad_cases() {
  static const std::vector<BadCase> cases = {
      // unknown keys
      {"top-level typo",
       R"({"optimiser": {}})",
       {},
       "optimiser",
       {"unknown key", "did you mean \"optimizer\"?"}},
      {"model typo",
       model(R"("num_local_expert": 4)"),
       {},
       "model.num_local_expert",
       {"unknown key", "did you mean \"num_local_experts\"?"}},
      {"nested typo",
       model(R"("mod": {"capcity": 0.5})"),
       {},
       "model.mod.capcity",
       {"unknown key", "did you mean \"capacity\"?"}},
      {"params typo",
       R"({"optimizer": {"params": {"learning_rate": 1}}})",
       {},
       "optimizer.params.learning_rate",
       {"unknown key", "valid keys:", "lr"}},
      {"override of an unknown key",
       "{}",
       {"model.num_local_expert=4"},
       "model.num_local_expert",
       {"unknown key", "did you mean \"num_local_experts\"?", "override"}},
      {"override of an unknown section",
       "{}",
       {"modle.hidden_size=4"},
       "modle",
       {"unknown key", "did you mean \"model\"?"}},
      {"override below a value",
       "{}",
       {"optimizer.params.lr.x=1"},
       "optimizer.params.lr.x",
       {"unknown key", "not a section"}},
      {"override without '='", "{}", {"model.hidden_size"}, "", {"model.hidden_size", "'='"}},
      {"override with an empty name", "{}", {"model..hidden_size=3"}, "", {"empty key"}},
      // types
      {"int given float",
       model(R"("hidden_size": 2.5)"),
       {},
       "model.hidden_size",
       {"expected an integer", "2.5"}},
      {"int given string",
       model(R"("hidden_size": "8")"),
       {},
       "model.hidden_size",
       {"expected an integer", "\"8\""}},
      {"override int given string",
       "{}",
       {"model.hidden_size=big"},
       "model.hidden_size",
       {"expected an integer"}},
      {"float given string",
       R"({"optimizer": {"params": {"lr": "3e-4"}}})",
       {},
       "optimizer.params.lr",
       {"expected a number"}},
      {"bool given int", R"({"bf16": {"enabled": 1}})", {}, "bf16.enabled", {"expected a boolean"}},
      {"string given number",
       R"({"train": {"device": 0}})",
       {},
       "train.device",
       {"expected a string"}},
      {"section given array", R"({"model": []})", {}, "model", {"expected an object"}},
      {"betas of one",
       R"({"optimizer": {"params": {"betas": [0.9]}}})",
       {},
       "optimizer.params.betas",
       {"array of 2 numbers"}},
      {"betas of strings",
       R"({"optimizer": {"params": {"betas": ["a", "b"]}}})",
       {},
       "optimizer.params.betas",
       {"array of 2 numbers"}},
      {"int out of range",
       model(R"("vocab_size": 3000000000)"),
       {},
       "model.vocab_size",
       {"32-bit"}},
      {"negative seed", R"({"train": {"seed": -1}})", {}, "train.seed", {">= 0"}},
      {"architectures not strings",
       model(R"("architectures": [1])"),
       {},
       "model.architectures",
       {"array of strings"}},
      {"top level not an object", "[1, 2]", {}, "", {"JSON object"}},
      // model shape
      {"other model_type",
       model(R"("model_type": "llama")"),
       {},
       "model.model_type",
       {"llama", "mixtral"}},
      {"vocab 1", model(R"("vocab_size": 1)"), {}, "model.vocab_size", {">= 2"}},
      {"hidden 0", model(R"("hidden_size": 0)"), {}, "model.hidden_size", {">= 1"}},
      {"layers 0", model(R"("num_hidden_layers": 0)"), {}, "model.num_hidden_layers", {">= 1"}},
      {"nh % nkv",
       model(R"("num_attention_heads": 16, "num_key_value_heads": 5)"),
       {},
       "model.num_key_value_heads",
       {"divisible", "16", "5"}},
      {"hidden % nh",
       model(R"("hidden_size": 1000, "num_attention_heads": 16)"),
       {},
       "model.num_attention_heads",
       {"divisible", "head_dim"}},
      {"odd derived head_dim",
       model(R"("hidden_size": 1000, "num_attention_heads": 8, "num_key_value_heads": 8)"),
       {},
       "model.head_dim",
       {"even", "125"}},
      {"odd head_dim", model(R"("head_dim": 33)"), {}, "model.head_dim", {"even", "33"}},
      {"negative head_dim", model(R"("head_dim": -2)"), {}, "model.head_dim", {">= 0"}},
      {"K > E",
       model(R"("num_local_experts": 4, "num_experts_per_tok": 5)"),
       {},
       "model.num_experts_per_tok",
       {"[1, num_local_experts = 4]", "5"}},
      {"K 0", model(R"("num_experts_per_tok": 0)"), {}, "model.num_experts_per_tok", {"[1,"}},
      {"moe_layer_freq 0", model(R"("moe_layer_freq": 0)"), {}, "model.moe_layer_freq", {">= 1"}},
      {"shared experts negative",
       model(R"("num_shared_experts": -1)"),
       {},
       "model.num_shared_experts",
       {">= 0"}},
      {"dense size negative",
       model(R"("dense_intermediate_size": -1)"),
       {},
       "model.dense_intermediate_size",
       {">= 0"}},
      {"rms_norm_eps 0", model(R"("rms_norm_eps": 0)"), {}, "model.rms_norm_eps", {"> 0"}},
      {"rope_theta negative", model(R"("rope_theta": -1)"), {}, "model.rope_theta", {"> 0"}},
      {"initializer_range 0",
       model(R"("initializer_range": 0.0)"),
       {},
       "model.initializer_range",
       {"> 0"}},
      {"aux coef negative",
       model(R"("router_aux_loss_coef": -0.1)"),
       {},
       "model.router_aux_loss_coef",
       {">= 0"}},
      {"capacity 0", model(R"("mod": {"capacity": 0})"), {}, "model.mod.capacity", {"(0, 1]"}},
      {"capacity 1.5",
       model(R"("mod": {"capacity": 1.5})"),
       {},
       "model.mod.capacity",
       {"(0, 1]", "1.5"}},
      {"mod every 0", model(R"("mod": {"every": 0})"), {}, "model.mod.every", {">= 1"}},
      {"mod every past the depth",
       model(R"("num_hidden_layers": 3, "mod": {"enabled": true, "every": 4})"),
       {},
       "model.mod.every",
       {"is 4", "3 layers", "no layer"}},
      {"predictor hidden 0",
       model(R"("mod": {"predictor_hidden_size": 0})"),
       {},
       "model.mod.predictor_hidden_size",
       {">= 1"}},
      {"predictor hidden past the head's limit",
       model(R"("mod": {"predictor_hidden_size": 4097})"),
       {},
       "model.mod.predictor_hidden_size",
       {"<= 4096", "4097"}},
      {"predictor partials past the head's limit",
       model(R"("mod": {"enabled": true, "predictor_hidden_size": 4096})"),
       {"train_micro_batch_size_per_gpu=1024", "data.seq_len=1024",
        "model.max_position_embeddings=1024"},
       "model.mod.predictor_hidden_size",
       {"1048576 tokens", "524288"}},
      {"predictor coef negative",
       model(R"("mod": {"predictor_loss_coef": -1})"),
       {},
       "model.mod.predictor_loss_coef",
       {">= 0"}},
      // optimisation
      {"optimizer SGD",
       R"({"optimizer": {"type": "SGD"}})",
       {},
       "optimizer.type",
       {"SGD", "AdamW"}},
      {"lr 0", R"({"optimizer": {"params": {"lr": 0}}})", {}, "optimizer.params.lr", {"> 0"}},
      {"beta 1",
       R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})",
       {},
       "optimizer.params.betas",
       {"[0, 1)"}},
      {"eps 0", R"({"optimizer": {"params": {"eps": 0}}})", {}, "optimizer.params.eps", {"> 0"}},
      {"weight decay negative",
       R"({"optimizer": {"params": {"weight_decay": -1}}})",
       {},
       "optimizer.params.weight_decay",
       {">= 0"}},
      {"clipping negative", R"({"gradient_clipping": -1})", {}, "gradient_clipping", {">= 0"}},
      {"micro batch 0",
       R"({"train_micro_batch_size_per_gpu": 0})",
       {},
       "train_micro_batch_size_per_gpu",
       {">= 1"}},
      {"accumulation 0",
       R"({"gradient_accumulation_steps": 0})",
       {},
       "gradient_accumulation_steps",
       {">= 1"}},
      {"train_batch_size mismatch",
       R"({"train_batch_size": 12})",
       {},
       "train_batch_size",
       {"= 8", "12"}},
      {"scheduler type",
       R"({"scheduler": {"type": "Cosine"}})",
       {},
       "scheduler.type",
       {"WarmupCosineLR", "WarmupLR"}},
      {"warmup negative",
       R"({"scheduler": {"params": {"warmup_num_steps": -1}}})",
       {},
       "scheduler.params.warmup_num_steps",
       {">= 0"}},
      {"warmup ratio 1.5",
       R"({"scheduler": {"params": {"warmup_min_ratio": 1.5}}})",
       {},
       "scheduler.params.warmup_min_ratio",
       {"[0, 1]"}},
      {"cos ratio negative",
       R"({"scheduler": {"params": {"cos_min_ratio": -0.1}}})",
       {},
       "scheduler.params.cos_min_ratio",
       {"[0, 1]"}},
      {"total < warmup",
       R"({"scheduler": {"params": {"warmup_num_steps": 10, "total_num_steps": 5}}})",
       {},
       "scheduler.params.total_num_steps",
       {"warmup_num_steps"}},
      {"fp16 min scale above the initial scale",
       R"({"fp16": {"initial_scale_power": 4, "min_loss_scale": 32}})",
       {},
       "fp16.min_loss_scale",
       {"2^initial_scale_power = 16"}},
      {"fp16 window 0",
       R"({"fp16": {"loss_scale_window": 0}})",
       {},
       "fp16.loss_scale_window",
       {">= 1"}},
      {"fp16 and bf16",
       R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})",
       {},
       "bf16.enabled",
       {"both true", "at most one"}},
      {"parameter offload below stage 3",
       R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
           "offload_param": {"device": "cpu"}}})",
       {},
       "zero_optimization.offload_param.device",
       {"needs zero_optimization.stage 3", "got stage 2"}},
      {"parameter offload without optimizer offload",
       R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})",
       {},
       "zero_optimization.offload_param.device",
       {"offload_optimizer.device \"cpu\" too"}},
      {"parameter offload to nvme",
       R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
       {},
       "zero_optimization.offload_param.device",
       {"not available"}},
      {"parameter offload pin_memory mistyped",
       R"({"zero_optimization": {"offload_param": {"pin_memory": "yes"}}})",
       {},
       "zero_optimization.offload_param.pin_memory",
       {}},
      {"ZeRO stage 4",
       R"({"zero_optimization": {"stage": 4}})",
       {},
       "zero_optimization.stage",
       {"must be 0, 1, 2 or 3", "got 4"}},
      {"comm timeout negative",
       R"({"train": {"comm_timeout_s": -1}})",
       {},
       "train.comm_timeout_s",
       {">= 0"}},
      {"GPU memory cap negative",
       R"({"train": {"gpu_memory_limit_gib": -2}})",
       {},
       "train.gpu_memory_limit_gib",
       {">= 0", "got -2"}},
      {"GPU memory cap too large",
       R"({"train": {"gpu_memory_limit_gib": 1e9}})",
       {},
       "train.gpu_memory_limit_gib",
       {"at most 1e6 GiB"}},
      {"bucket size zero",
       R"({"zero_optimization": {"reduce_bucket_size": 0}})",
       {},
       "zero_optimization.reduce_bucket_size",
       {"whole number of elements >= 1", "got 0"}},
      {"bucket size fractional",
       R"({"zero_optimization": {"reduce_bucket_size": 2.5}})",
       {},
       "zero_optimization.reduce_bucket_size",
       {"whole number", "got 2.5"}},
      {"offload without ZeRO",
       R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})",
       {},
       "zero_optimization.offload_optimizer.device",
       {"needs zero_optimization.stage 1, 2 or 3", "got stage 0"}},
      {"offload to nvme",
       R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})",
       {},
       "zero_optimization.offload_optimizer.device",
       {"nvme", "not available", "\"cpu\""}},
      {"offload to a bad device",
       R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "gpu"}}})",
       {},
       "zero_optimization.offload_optimizer.device",
       {"\"none\" or \"cpu\"", "got \"gpu\""}},
      {"ZeRO stage 5",
       R"({"zero_optimization": {"stage": 5}})",
       {},
       "zero_optimization.stage",
       {"0, 1, 2 or 3"}},
      {"shards without files",
       R"({"data": {"source": "shards"}})",
       {},
       "data.train_files",
       {"needs a glob", "prepare"}},
      {"unknown data source",
       R"({"data": {"source": "webdataset"}})",
       {},
       "data.source",
       {"\"synthetic\", \"random\" or \"shards\""}},
      {"negative save interval",
       R"({"train": {"save_interval": -1}})",
       {},
       "train.save_interval",
       {">= 0"}},
      // data and run
      {"seq_len > max positions",
       R"({"data": {"seq_len": 8192}})",
       {},
       "data.seq_len",
       {"max_position_embeddings", "4096", "8192"}},
      {"seq_len 0", R"({"data": {"seq_len": 0}})", {}, "data.seq_len", {">= 1"}},
      {"branching 0",
       R"({"data": {"synthetic": {"branching": 0}}})",
       {},
       "data.synthetic.branching",
       {"[1, model.vocab_size"}},
      {"branching > vocab",
       R"({"model": {"vocab_size": 4}, "data": {"synthetic": {"branching": 5}}})",
       {},
       "data.synthetic.branching",
       {"[1, model.vocab_size = 4]"}},
      {"max_steps 0", R"({"train": {"max_steps": 0}})", {}, "train.max_steps", {">= 1"}},
      {"log_interval 0", R"({"train": {"log_interval": 0}})", {}, "train.log_interval", {">= 1"}},
      {"head_chunk_tokens negative",
       R"({"train": {"head_chunk_tokens": -1}})",
       {},
       "train.head_chunk_tokens",
       {">= 0"}},
      {"eval_interval negative",
       R"({"train": {"eval_interval": -1}})",
       {},
       "train.eval_interval",
       {">= 0"}},
      {"eval_batches 0", R"({"train": {"eval_batches": 0}})", {}, "train.eval_batches", {">= 1"}},
      {"device gpu", R"({"train": {"device": "gpu"}})", {}, "train.device", {"cuda:N", "gpu"}},
      {"device cuda:x", R"({"train": {"device": "cuda:x"}})", {}, "train.device", {"cuda:N"}},
      {"split master without bf16",
       R"({"train": {"split_master": true}})",
       {},
       "train.split_master",
       {"bf16.enabled"}},
      {"split master with ZeRO",
       R"({"bf16": {"enabled": true}, "train": {"split_master": true},
          "zero_optimization": {"stage": 1}})",
       {},
       "train.split_master",
       {"stage 0", "stage 1"}},
      {"bf16 expert gradients without a split master",
       R"({"bf16": {"enabled": true}, "train": {"bf16_expert_grads": true}})",
       {},
       "train.bf16_expert_grads",
       {"train.split_master"}},
      {"bf16 expert gradients over micro-batches",
       R"({"bf16": {"enabled": true}, "gradient_accumulation_steps": 2,
          "train": {"split_master": true, "bf16_expert_grads": true}})",
       {},
       "train.bf16_expert_grads",
       {"gradient_accumulation_steps 1", "got 2"}},
      // Robustness: values that once crashed, hung or ran silently wrong.
      {"a key given twice",
       R"({"train": {"max_steps": 5, "max_steps": 7}})",
       {},
       "train.max_steps",
       {"twice", "test.json"}},
      {"a key given twice in an override's object value",
       "{}",
       {R"(model.mod={"enabled": true, "capacity": 0.5, "capacity": 0.25})"},
       "model.mod.capacity",
       {"twice", "override"}},
      {"a NUL in a path",
       R"({"train": {"out_dir": "runs/a\u0000b"}})",
       {},
       "train.out_dir",
       {"NUL"}},
      {"an override that is not UTF-8",
       "{}",
       {"train.out_dir=runs/\xff"},
       "train.out_dir",
       {"UTF-8"}},
      {"a wrong type that is not UTF-8",
       "{}",
       {"model.hidden_size=\xff"},
       "model.hidden_size",
       {"expected an integer"}},
      {"a wrong type nested too deep to print",
       R"({"model": )" + std::string(100000, '[') + std::string(100000, ']') + "}",
       {},
       "model",
       {"nested too deep"}},
      {"more layers than set-up handles",
       R"({"model": {"num_hidden_layers": 2000}})",
       {},
       "model.num_hidden_layers",
       {"<= 1024"}},
      {"sizes whose product wraps 64 bits",
       R"({"model": {"hidden_size": 2147483644, "num_attention_heads": 2,
          "num_key_value_heads": 2}})",
       {},
       "model",
       {"2^40", "hidden_size"}},
  };
  return cases;
}

}  // namespace

TEST_CASE("config: each bad config fails at its JSON path with a useful message") {
  for (const BadCase& bad : bad_cases()) {
    INFO("case: " << bad.what << "\njson: " << bad.json);
    auto e = config_error(bad.json, bad.overrides);
    REQUIRE(e);
    INFO("message: " << e->what());
    CHECK(e->path == bad.path);
    for (const std::string& word : bad.words) CHECK(contains(e->what(), word));
    CHECK_FALSE(contains(e->what(), "not implemented"));
    // The path leads the message, so the user sees where to look first.
    if (!bad.path.empty()) CHECK(std::string(e->what()).rfind(bad.path + ": ", 0) == 0);
  }
}

TEST_CASE("config: the bad cases are good once the offending value is fixed") {
  // Guards the table: a case must fail for its stated reason, not an unrelated one.
  CHECK_NOTHROW(parse(model(R"("num_attention_heads": 16, "num_key_value_heads": 4)")));
  CHECK_NOTHROW(parse(model(R"("num_local_experts": 4, "num_experts_per_tok": 4)")));
  CHECK_NOTHROW(parse(model(R"("mod": {"capacity": 1})")));
  CHECK_NOTHROW(parse(R"({"data": {"seq_len": 4096}})"));
  CHECK_NOTHROW(parse(R"({"train_batch_size": 8})"));
  CHECK_NOTHROW(parse(R"({"train_batch_size": 32})"));  // 4 ranks: checked by train()
  CHECK_NOTHROW(parse(R"({"zero_optimization": {"stage": 2}})"));
  CHECK_NOTHROW(
      parse(R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})"));
  CHECK_NOTHROW(
      parse(R"({"zero_optimization": {"overlap_comm": true, "reduce_bucket_size": 5e8}})"));
  CHECK_NOTHROW(parse(R"({"zero_optimization": {"reduce_bucket_size": 1}})"));
  CHECK_NOTHROW(parse(R"({"zero_optimization": {"stage": 2, "offload_optimizer":
                          {"device": "cpu", "pin_memory": true}}})"));
  CHECK_NOTHROW(parse(R"({"train": {"comm_timeout_s": 0}})"));
  CHECK_NOTHROW(parse(R"({"train": {"device": "cuda:12"}})"));
  CHECK_NOTHROW(parse(R"({"bf16": {"enabled": true}, "train": {"split_master": true}})"));
  CHECK_NOTHROW(parse(
      R"({"bf16": {"enabled": true}, "train": {"split_master": true, "bf16_expert_grads": true}})"));
  CHECK_NOTHROW(parse(model(R"("hidden_size": 1000, "num_attention_heads": 8,
                               "num_key_value_heads": 8, "head_dim": 124)")));
  CHECK_NOTHROW(parse(R"({"train": {"max_steps": 5}, "model": {"mod": {"every": 2}}})"));
  CHECK_NOTHROW(parse(R"({"model": {"num_hidden_layers": 1024, "hidden_size": 64,
                          "num_attention_heads": 4, "num_key_value_heads": 4}})"));
}

TEST_CASE("config: the shipped configs load and round-trip") {
  // __FILE__ is absolute under CMake, so this finds configs/ from any working directory.
  std::filesystem::path dir =
      std::filesystem::path(__FILE__).parent_path().parent_path() / "configs";
  if (!std::filesystem::is_directory(dir)) {
    WARN("no configs/ directory next to tests/");
    return;
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    INFO(entry.path().string());
    Config c = moe::load_config(entry.path().string(), {});
    CHECK(moe::config_to_json_value(parse(moe::config_to_json(c))) == moe::config_to_json_value(c));
  }
}

// docs/config.md is the config reference: a table row per key ("| `a.b.c` | type | default |
// range | meaning |"). Every key of the schema has its row, and every row names a key of the
// schema, so a key added or removed without its documentation fails here.
TEST_CASE("config: docs/config.md has a row for every key, and only for keys") {
  std::vector<std::string> leaves;
  std::function<void(const moe::config_internal::KeyNode&, const std::string&)> walk =
      [&](const moe::config_internal::KeyNode& node, const std::string& path) {
        if (!node.is_section()) {
          leaves.push_back(path);
          return;
        }
        for (const auto& child : node.children)
          walk(child, moe::config_internal::join_path(path, child.name));
      };
  walk(moe::config_internal::config_schema(), "");
  REQUIRE(leaves.size() > 50);
  std::ifstream in(std::string(MOE_SOURCE_DIR) + "/docs/config.md");
  REQUIRE(in.good());
  std::vector<std::string> rows;  // the first cell of each table row, when it is one `key`
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("| `", 0) != 0) continue;
    const size_t end = line.find("` |", 3);
    if (end != std::string::npos) rows.push_back(line.substr(3, end - 3));
  }
  for (const std::string& key : leaves) {
    INFO("schema key " << key);
    CHECK(std::count(rows.begin(), rows.end(), key) == 1);
  }
  for (const std::string& row : rows) {
    INFO("docs/config.md row " << row);
    CHECK(std::find(leaves.begin(), leaves.end(), row) != leaves.end());
  }
}
