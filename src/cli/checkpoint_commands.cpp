// `eval`, `sample` and `export`: the commands that read a checkpoint.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "moe/checkpoint.hpp"
#include "moe/sampler.hpp"
#include "moe/shards.hpp"
#include "moe/tokenizer.hpp"
#include "moe/trainer.hpp"

namespace moe::cli {

namespace {

// The complete step directory a --checkpoint flag names (a step or a run directory).
std::string resolve_checkpoint(const std::string& path) {
  std::string dir = find_latest_checkpoint(path, &std::cerr);
  if (dir.empty()) throw InputError(path + ": no complete checkpoint (step_*/ with a DONE marker)");
  return dir;
}

struct EvalFlags {
  std::string checkpoint, data, logits_out, device = "auto";
  int batches = 0, batch_size = 0, seq_len = 0;
};

// Where `eval` and `sample` run a checkpoint, and in which dtype: on a GPU in the dtype the run
// trained in (bf16 falls back to f32 on a GPU without bf16 arithmetic), on the CPU in f32.
// `exact`: f32 wherever it runs (--logits-out compares logits with other implementations; the
// sampler's Decoder reads routing weights and logits on the host as f32).
// --device's values: train.device's grammar.
CLI::Validator device_name() {
  return CLI::Validator(
      [](std::string& v) {
        return is_device_name(v) ? std::string() : "must be auto, cpu, cuda or cuda:N";
      },
      "DEVICE");
}

struct RunOn {
  Device dev;
  DType dtype;
};
RunOn run_on(const std::string& device, const Config& cfg, bool exact) {
  Device dev;
  try {
    dev = resolve_device(device);
  } catch (const ConfigError& e) {  // it speaks of train.device: here the flag is meant
    const std::string what = e.what();
    throw InputError("--device " + what.substr(e.path.empty() ? 0 : e.path.size() + 2));
  }
  if (dev.type != DeviceType::cuda || exact) return {dev, DType::f32};
  try {
    return {dev, compute_dtype(cfg, dev)};
  } catch (const ConfigError&) {  // bf16 on a GPU without bf16 arithmetic
    return {dev, DType::f32};
  }
}

// The checkpoint's model for B rows of T tokens where `on` says, forward-only (no gradient
// buffer): a GPU without room for it is told apart, with the way out.
std::unique_ptr<Model> make_model(const Config& cfg, const RunOn& on, int b, int t,
                                  const char* command) {
  try {
    MemoryPlan forward_only;
    forward_only.forward_only = true;  // no gradients to keep
    return std::make_unique<Model>(cfg.model, on.dtype, on.dev, b, t, true, forward_only);
  } catch (const InputError&) {
    throw;
  } catch (const ConfigError&) {
    throw;
  } catch (const std::runtime_error& e) {
    if (on.dev.type != DeviceType::cuda) throw;
    throw std::runtime_error(std::string(e.what()) + "; " + command + " builds the model on " +
                             on.dev.str() + ": pass --device cpu to run it on the CPU" +
                             (b * t > 1 ? ", or a smaller --batch-size or --seq-len" : ""));
  }
}

// The first batch's logits as raw little-endian float32 [B*T, V], for comparisons with other
// implementations (scripts/check_hf_export.py).
void write_logits(const std::string& path, Tensor logits) {
  std::vector<float> host(static_cast<size_t>(logits.numel()));
  copy_to_host(host.data(), logits);
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(host.data()),
            static_cast<std::streamsize>(host.size() * sizeof(float)));
  if (!out) throw InputError("cannot write " + path);
}

void run_eval(const EvalFlags& f) {
  const std::string dir = resolve_checkpoint(f.checkpoint);
  Config cfg = load_checkpoint_config(dir);
  const int b = f.batch_size > 0 ? f.batch_size : cfg.train_micro_batch_size_per_gpu;
  const int t = f.seq_len > 0 ? f.seq_len : cfg.data.seq_len;
  if (t > cfg.model.max_position_embeddings)
    throw InputError("--seq-len " + std::to_string(t) + " exceeds the model's " +
                     "max_position_embeddings " +
                     std::to_string(cfg.model.max_position_embeddings));
  const RunOn on = run_on(f.device, cfg, !f.logits_out.empty());
  const std::unique_ptr<Model> owner = make_model(cfg, on, b, t, "eval");
  Model& model = *owner;
  load_checkpoint_weights(dir, model);
  SequentialReader reader(expand_glob(f.data), t, b);
  const size_t n = static_cast<size_t>(b) * t;
  std::vector<int32_t> ids(n), targets(n);
  Ctx ctx = make_ctx(on.dev);
  double sum = 0;
  int done = 0;
  while ((f.batches <= 0 || done < f.batches) && reader.next(ids.data(), targets.data())) {
    // Shards of another tokenizer: named here, in the batches as they are read (no pass of its
    // own over the shards), not as a bare token id in the model's embedding.
    uint32_t most = 0;  // (the shards' ids are unsigned)
    for (size_t i = 0; i < n; ++i)
      most = std::max({most, static_cast<uint32_t>(ids[i]), static_cast<uint32_t>(targets[i])});
    if (most >= static_cast<uint32_t>(cfg.model.vocab_size))
      throw InputError(f.data + ": token id " + std::to_string(most) +
                       " does not fit the model's vocab_size " +
                       std::to_string(cfg.model.vocab_size) + " (shards of another tokenizer?)");
    sum += model.forward(ctx, ids.data(), targets.data()).lm;
    if (done == 0 && !f.logits_out.empty()) write_logits(f.logits_out, model.logits());
    ++done;
  }
  if (done == 0)
    throw InputError(f.data + ": fewer than batch_size * seq_len + 1 = " + std::to_string(n + 1) +
                     " tokens; nothing to evaluate");
  const double loss = sum / done;
  nlohmann::json j = {{"loss", loss},    {"ppl", std::exp(loss)},  {"tokens", done * n},
                      {"batches", done}, {"checkpoint", dir},      {"batch_size", b},
                      {"seq_len", t},    {"device", on.dev.str()}, {"dtype", dtype_name(on.dtype)}};
  std::cout << j.dump() << std::endl;
}

struct SampleFlags {
  std::string checkpoint, prompt, prompt_ids, device = "auto";
  bool ids_given = false;  // --prompt-ids was passed (an empty list is then an empty prompt)
  SampleOptions opt;
};

std::vector<uint32_t> parse_ids(const std::string& text) {
  std::vector<uint32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      const long long v = std::stoll(item, &used);
      // Past 2^32 - 1 the id would wrap to another token.
      if (used != item.size() || v < 0 || v > UINT32_MAX) throw std::invalid_argument(item);
      ids.push_back(static_cast<uint32_t>(v));
    } catch (const std::exception&) {
      throw InputError("--prompt-ids: \"" + item + "\" is not a token id");
    }
  }
  return ids;
}

void run_sample(SampleFlags f) {
  const std::string dir = resolve_checkpoint(f.checkpoint);
  Config cfg = load_checkpoint_config(dir);
  const RunOn on = run_on(f.device, cfg, /*exact=*/true);
  const std::unique_ptr<Model> owner = make_model(cfg, on, 1, 1, "sample");
  const Model& model = *owner;
  load_checkpoint_weights(dir, *owner);
  std::unique_ptr<Tokenizer> tok;
  if (has_tokenizer(dir)) tok = load_tokenizer(dir);
  std::vector<uint32_t> prompt;
  if (f.ids_given) {
    prompt = parse_ids(f.prompt_ids);
  } else {
    if (!tok)
      throw InputError(dir + " has no tokenizer (the run used the synthetic source): give the " +
                       "prompt as --prompt-ids 1,2,3");
    prompt = tok->encode(f.prompt);
  }
  if (tok) {
    f.opt.eos_id = tok->eos_id();
    f.opt.vocab_limit = tok->vocab_size();  // a padded model's extra ids have no text
  }
  std::vector<uint32_t> out = generate(model, prompt, f.opt);
  if (tok) {
    std::cout << tok->decode(prompt) << tok->decode(out) << std::endl;
  } else {
    for (size_t i = 0; i < out.size(); ++i) std::cout << (i ? "," : "") << out[i];
    std::cout << std::endl;
  }
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto f = std::make_shared<EvalFlags>();
  CLI::App* cmd = app.add_subcommand(
      "eval", "LM loss of a checkpoint on token shards, read in order (prints one JSON line)");
  cmd->add_option("--checkpoint", f->checkpoint, "a step directory or a run directory (newest)")
      ->required();
  cmd->add_option("--data", f->data, "glob of token shards")->required();
  cmd->add_option("--batches", f->batches, "batches to evaluate (default: all the data)")
      ->check(CLI::Range(0, INT_MAX));
  cmd->add_option("--batch-size", f->batch_size,
                  "rows per batch (default: the training micro-batch)")
      ->check(CLI::Range(1, INT_MAX));
  cmd->add_option("--seq-len", f->seq_len, "tokens per row (default: the training seq_len)")
      ->check(CLI::Range(1, INT_MAX));
  cmd->add_option("--logits-out", f->logits_out,
                  "write the first batch's logits (float32 [B*T, V]) to this file (runs in f32)");
  cmd->add_option("--device", f->device,
                  "cpu, cuda[:N] or auto (default: a GPU when there is one, in the run's dtype)")
      ->check(device_name());
  register_runner("eval", [f] { run_eval(*f); });
}

void add_sample_command(CLI::App& app) {
  auto f = std::make_shared<SampleFlags>();
  CLI::App* cmd = app.add_subcommand(
      "sample", "generate text from a checkpoint (KV cache; MoD layers use their predictor)");
  cmd->add_option("--checkpoint", f->checkpoint, "a step directory or a run directory (newest)")
      ->required();
  auto* text = cmd->add_option("--prompt", f->prompt, "prompt text (needs the run's tokenizer)");
  auto* ids = cmd->add_option("--prompt-ids", f->prompt_ids, "prompt as token ids: 1,2,3");
  text->excludes(ids);
  cmd->add_option("--max-new-tokens", f->opt.max_new_tokens, "tokens to generate (default 64)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", f->opt.temperature, "0 = greedy (default 1)")
      ->check(finite_range(0.0, 100.0));
  cmd->add_option("--top-k", f->opt.top_k, "sample among the k most likely (0 = all)")
      ->check(CLI::Range(0, INT_MAX));
  cmd->add_option("--top-p", f->opt.top_p,
                  "then among the most likely tokens whose probabilities sum to this (default 1 "
                  "= all)")
      ->check(finite_range(0.0, 1.0));
  cmd->add_option("--seed", f->opt.seed, "random seed (the same seed gives the same text)");
  cmd->add_option("--device", f->device,
                  "cpu, cuda[:N] or auto (default: a GPU when there is one; f32 on either)")
      ->check(device_name());
  cmd->callback([f, text, ids] {
    if (text->count() == 0 && ids->count() == 0)
      throw CLI::RequiredError("--prompt or --prompt-ids");
    f->ids_given = ids->count() > 0;
  });
  register_runner("sample", [f] { run_sample(*f); });
}

void add_export_command(CLI::App& app) {
  auto checkpoint = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "export", "write a Hugging Face directory (safetensors, config.json, tokenizer files)");
  cmd->add_option("--checkpoint", *checkpoint, "a step directory or a run directory (newest)")
      ->required();
  cmd->add_option("--out", *out, "output directory")->required();
  register_runner("export", [checkpoint, out] {
    export_hf(*checkpoint, *out);
    std::cout << "exported " << resolve_checkpoint(*checkpoint) << " to " << *out << std::endl;
  });
}

}  // namespace moe::cli
