// `train` and `info`.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>

#include "cli/commands.hpp"
#include "moe/config.hpp"
#include "moe/model.hpp"
#include "moe/trainer.hpp"

namespace moe::cli {

namespace {

double mib(double bytes) {
  return bytes / 1048576.0;
}

void run_train(const ConfigFlags& f, const std::string& device, const std::string& resume) {
  std::vector<std::string> overrides = f.overrides;
  if (!device.empty()) overrides.push_back("train.device=\"" + device + "\"");
  if (!resume.empty()) overrides.push_back("train.resume=\"" + resume + "\"");
  Config cfg = load_config(f.config_path, overrides);
  std::cout << build_info() << "\nresolved config:\n" << config_to_json(cfg) << "\n" << std::flush;
  TrainResult r = train(cfg, std::cout);
  std::printf("done: %d steps | last train loss %.4f", r.steps, r.last_loss);
  if (std::isfinite(r.eval_loss)) std::printf(" | eval loss %.4f", r.eval_loss);
  if (std::isfinite(r.optimal_loss)) std::printf(" | best achievable %.4f", r.optimal_loss);
  std::printf("\n");
}

void run_info(const ConfigFlags& f) {
  Config cfg = load_config(f.config_path, f.overrides);
  const ModelConfig& m = cfg.model;
  const int b = cfg.train_micro_batch_size_per_gpu, t = cfg.data.seq_len;
  const ParamCounts c = count_params(m, t);
  // fp32 master weights, gradients and both Adam moments; in bf16 / fp16 also a compute copy of
  // the weights, and activations in that dtype.
  const DType compute = cfg.bf16_enabled ? DType::bf16 : cfg.fp16.enabled ? DType::f16 : DType::f32;
  const double copy_bytes = compute == DType::f32 ? 0.0 : c.total * 2;
  const double param_bytes = c.total * 4 + copy_bytes, grad_bytes = c.total * 4;
  const double optim_bytes = c.total * 8;
  Model plan(m, compute, Device{}, b, t, /*allocate=*/false);
  const double act_bytes = static_cast<double>(plan.activation_bytes());
  const double scratch_bytes = static_cast<double>(plan.scratch_bytes());
  std::printf("%s\n", build_info().c_str());
  std::printf("model: %d layers, d %d, %d experts (top-%d), vocab %d, seq_len %d, batch %d\n",
              m.num_hidden_layers, m.hidden_size, m.num_local_experts, m.num_experts_per_tok,
              m.vocab_size, t, b);
  std::printf("parameters:        %14.0f total (%.3fM)\n", c.total, c.total / 1e6);
  std::printf("active per token:  %14.0f (%.3fM)\n", c.active_per_token, c.active_per_token / 1e6);
  std::printf("training FLOPs:    %14.4g per token (%.4g per step of %d tokens)\n",
              c.flops_per_token, c.flops_per_token * b * t * cfg.gradient_accumulation_steps,
              b * t * cfg.gradient_accumulation_steps);
  std::printf("memory (%s compute, per process):\n", dtype_name(compute));
  std::printf("  parameters        %10.1f MiB%s\n", mib(param_bytes),
              copy_bytes > 0 ? " (fp32 master + compute copy)" : "");
  std::printf("  gradients         %10.1f MiB\n", mib(grad_bytes));
  std::printf("  optimizer state   %10.1f MiB (AdamW m, v)\n", mib(optim_bytes));
  std::printf("  activations       %10.1f MiB (saved for backward, micro-batch %d)\n",
              mib(act_bytes), b);
  std::printf("  backward scratch  %10.1f MiB\n", mib(scratch_bytes));
  std::printf("  total             %10.1f MiB\n",
              mib(param_bytes + grad_bytes + optim_bytes + act_bytes + scratch_bytes));
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto flags = std::make_shared<ConfigFlags>();
  auto device = std::make_shared<std::string>();
  auto resume = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("train", "train a model as the config describes");
  add_config_flags(cmd, *flags);
  cmd->add_option("--device", *device, "cpu | cuda | cuda:N | auto (overrides train.device)");
  cmd->add_option("--resume", *resume,
                  "auto (newest complete checkpoint in train.out_dir) or a checkpoint path "
                  "(overrides train.resume)");
  register_runner("train", [flags, device, resume] { run_train(*flags, *device, *resume); });
}

void add_info_command(CLI::App& app) {
  auto flags = std::make_shared<ConfigFlags>();
  CLI::App* cmd = app.add_subcommand(
      "info", "print parameter counts, FLOPs per token and a memory estimate for a config");
  add_config_flags(cmd, *flags);
  register_runner("info", [flags] { run_info(*flags); });
}

}  // namespace moe::cli
