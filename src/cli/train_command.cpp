// `train` and `info`.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <iostream>
#include <memory>

#include "cli/commands.hpp"
#include "moe/comm.hpp"
#include "moe/config.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/model.hpp"
#include "moe/optim.hpp"
#include "moe/profiler.hpp"
#include "moe/trainer.hpp"

namespace moe::cli {

namespace {

double mib(double bytes) {
  return bytes / 1048576.0;
}

// What rank 0 prints once train() returns.
void print_summary(const TrainResult& r, const Config& cfg) {
  if (r.losses.empty()) {  // resumed at train.max_steps or past it: no loss to report
    std::printf("done: nothing to train: resumed at step %d, train.max_steps is %d\n",
                r.resumed_from, cfg.train.max_steps);
    return;
  }
  if (profile::enabled() && r.profiled_steps > 0)
    std::cout << profile::format(profile::take(), r.profiled_steps) << std::flush;
  std::printf("%s: %d steps | last train loss %.4f", r.stop_signal != 0 ? "stopped" : "done",
              r.steps, r.last_loss);
  if (std::isfinite(r.eval_loss)) std::printf(" | eval loss %.4f", r.eval_loss);
  if (std::isfinite(r.optimal_loss)) std::printf(" | best achievable %.4f", r.optimal_loss);
  std::printf("\n");
}

void run_train(const ConfigFlags& f, const std::string& device, const std::string& resume,
               double memory_limit_gib) {
  std::vector<std::string> overrides = f.overrides;
  if (!device.empty()) overrides.push_back(string_override("train.device", device));
  if (!resume.empty()) overrides.push_back(string_override("train.resume", resume));
  if (memory_limit_gib >= 0) {
    // %.17g, not std::to_string's 6 decimals: a small cap must not round to 0 (no cap).
    char text[40];
    std::snprintf(text, sizeof text, "%.17g", memory_limit_gib);
    overrides.push_back(std::string("train.gpu_memory_limit_gib=") + text);
  }
  Config cfg = load_config(f.config_path, overrides);
  check_runnable(cfg);  // refusals before the config is printed: one message, nothing else
  const bool first_rank = detect_ranks().rank == 0;  // the other data-parallel ranks train quietly
  if (first_rank)
    std::cout << build_info() << "\nresolved config:\n"
              << config_to_json(cfg) << "\n"
              << std::flush;
  const TrainResult r = train(cfg, std::cout);
  if (first_rank) print_summary(r, cfg);
  // Stopped by a signal: every rank exits with that signal's usual status (128 + its number),
  // so scripts can tell an interrupted run from a finished one.
  if (r.stop_signal != 0) {
    std::fflush(stdout);
    throw StoppedBySignal{r.stop_signal};
  }
}

// The parameters of the largest decoder layer (ZeRO-3 gathers one layer at a time).
// Data-parallel ranks for the per-rank table: --world, else train_batch_size / (micro * accum)
// when the config states it, else the ranks this process was launched with.
int info_world(const Config& cfg, int flag) {
  if (flag > 0) return flag;
  const int64_t per_rank =  // 64 bits: the product of two 32-bit keys
      int64_t{cfg.train_micro_batch_size_per_gpu} * cfg.gradient_accumulation_steps;
  if (cfg.train_batch_size > 0) return static_cast<int>(cfg.train_batch_size / per_rank);
  return detect_ranks().world;
}

void run_info(const ConfigFlags& f, int world_flag) {
  Config cfg = load_config(f.config_path, f.overrides);
  const ModelConfig& m = cfg.model;
  const int b = cfg.train_micro_batch_size_per_gpu, t = cfg.data.seq_len;
  const ParamCounts c = count_params(m, t);
  // fp32 master weights, gradients and both Adam moments; in bf16 / fp16 also a compute copy of
  // the weights, and activations in that dtype.
  const DType compute = requested_compute_dtype(cfg);
  // (train.split_master: the master is the compute copy plus 2-byte low halves, and the fp32
  // copies of the routers' weights; the model's own count.)
  const double copy_bytes = compute == DType::f32 ? 0.0 : c.total * 2;
  Model plan(m, compute, Device{}, b, t, /*allocate=*/false, memory_plan_of(cfg.train));
  const double grad_bytes = static_cast<double>(plan.grad_bytes());  // bf16 expert stacks: less
  const double param_bytes = static_cast<double>(plan.weight_bytes()) - grad_bytes;
  const double optim_bytes = c.total * 8;
  const double act_bytes = static_cast<double>(plan.activation_bytes());
  const double scratch_bytes = static_cast<double>(plan.scratch_bytes());
  std::printf("%s\n", build_info().c_str());
  std::printf("model: %d layers, d %d, %d experts (top-%d), vocab %d, seq_len %d, batch %d\n",
              m.num_hidden_layers, m.hidden_size, m.num_local_experts, m.num_experts_per_tok,
              m.vocab_size, t, b);
  std::printf("parameters:        %14.0f total (%.3fM)\n", c.total, c.total / 1e6);
  std::printf("active per token:  %14.0f (%.3fM)\n", c.active_per_token, c.active_per_token / 1e6);
  // In 64 bits: micro-batch x seq_len x accumulation passes 2^31 for large configs.
  const int64_t step_tokens = int64_t{b} * t * cfg.gradient_accumulation_steps;
  std::printf("training FLOPs:    %14.4g per token (%.4g per step of %lld tokens)\n",
              c.flops_per_token, c.flops_per_token * static_cast<double>(step_tokens),
              static_cast<long long>(step_tokens));
  std::printf("memory (%s compute, per process):\n", dtype_name(compute));
  std::printf("  parameters        %10.1f MiB%s\n", mib(param_bytes),
              plan.splits_master() ? " (split fp32 master: compute copy + low halves)"
              : copy_bytes > 0     ? " (fp32 master + compute copy)"
                                   : "");
  std::printf("  gradients         %10.1f MiB%s\n", mib(grad_bytes),
              cfg.train.bf16_expert_grads ? " (expert stacks in bf16)" : "");
  std::printf("  optimizer state   %10.1f MiB (AdamW m, v)\n", mib(optim_bytes));
  std::printf("  activations       %10.1f MiB (saved for backward, micro-batch %d%s)\n",
              mib(act_bytes), b,
              cfg.train.recompute_layers          ? ", layers recomputed"
              : cfg.train.recompute_expert_inputs ? ", expert inputs recomputed"
              : cfg.train.recompute_expert_rows   ? ", expert rows recomputed"
                                                  : "");
  std::printf("  backward scratch  %10.1f MiB\n", mib(scratch_bytes));
  std::printf("  total             %10.1f MiB\n",
              mib(param_bytes + grad_bytes + optim_bytes + act_bytes + scratch_bytes));
  // Off sm_90 (A100, L40; or MOE_GROUPED_SM90=0) the grouped dw products sum a bf16 expert
  // stack's gradient in fp32 before rounding it, in one buffer per GPU of the largest stack's
  // size (kernels/cuda/grouped_mma.cu, bf16_dw_sums), which the plan above, made for the sm_90
  // kernel, leaves out. The stacks are the table's parameters with stack > 1.
  size_t largest_stack = 0;
  for (const ParamInfo& p : plan.table().params)
    if (p.stack > 1) largest_stack = std::max(largest_stack, p.numel());
  if (cfg.train.bf16_expert_grads && largest_stack > 0)
    std::printf("  (GPUs other than sm_90: + %.1f MiB, the bf16 expert gradients' fp32 sums)\n",
                mib(4.0 * static_cast<double>(largest_stack)));

  // Per rank (per GPU) under data parallelism, as DeepSpeed's estimate_zero*_model_states_mem_needs
  // count it, with this trainer's buffers: P parameters, N ranks, c = compute-copy bytes per
  // parameter (0 in f32, 2 in bf16 / fp16), L = the largest layer's parameters, A = activations
  // + scratch (not sharded).
  //   stage 0            (4 + c) P + 4 P + 8 P                   + A
  //   stage 1            (4 + c) P + 4 P + 8 P / N               + A
  //   stage 2            as stage 1 here: the gradient buffer stays full-size (it accumulates
  //                      across micro-batches); DeepSpeed's figure 4 P / N for it is the ideal
  //   stage 3            4 P / N + 4 P / N + 8 P / N + (8 + c) (2 L + E + H) + A: the fp32
  //                      chunks of the weights and the gradients, the moments, and the slots a
  //                      unit is gathered into (fp32 weights, compute copy, gradient): two for
  //                      the layers (the current one and the next, prefetched), one each for
  //                      the embedding (E) and the final norm + head (H); P / N and the slots
  //                      rounded up to whole chunks (src/model/sharded_params.hpp)
  //   1 or 2 + offload   GPU: (4 + c) P + 4 P + A: the model keeps its fp32 weights and its
  //                      gradient buffer on the device (its ops and collectives use them), the
  //                      optimizer state is gone from it;
  //                      CPU: 16 P / N per rank (fp32 master of the partition, m, v, and the
  //                      staging buffer its gradients are copied into), 28 P / N when the
  //                      update overlaps the backward (overlap_comm: a second master, m, v).
  //                      DeepSpeed's offload also drops the fp32 weights from the GPU (c P
  //                      there); not done here.
  //   3 + offload        stage 3's GPU figures without the moments; CPU as above
  //   3 + offload_param  GPU: the slots alone (+ A); CPU: 16 P / N (the weight and gradient
  //                      chunks, m, v; the CPU AdamW updates the chunks in place), and 4 P / N
  //                      more with gradient accumulation (the later micro-batches' staging)
  const int world = info_world(cfg, world_flag);
  const double n = std::max(1, world), p = c.total, cb = copy_bytes / std::max(1.0, c.total);
  const double a = act_bytes + scratch_bytes;
  // Stage 3 as rank 0 holds it (the largest chunks): the sharded model's own plan.
  const ZeroPartition part3 =
      ZeroPartition::per_unit(param_unit_bounds(plan.table(), m), 0, static_cast<int>(n));
  const ParamSharding sharding{&part3, nullptr};
  MemoryPlan memory3 = memory_plan_of(cfg.train);
  memory3.split_master = false;  // stage 0 only (the other rows are what-ifs)
  memory3.bf16_expert_grads = false;
  const Model plan3(m, compute, Device{}, b, t, /*allocate=*/false, memory3, &sharding);
  const double shard = static_cast<double>(part3.local());
  const double slots = static_cast<double>(plan3.weight_bytes()) - 8 * shard;
  // The offloaded update overlapped with the backward keeps a second copy of its state (the
  // config's own choice; stages 1-2 with overlap_comm).
  ZeroConfig z12 = cfg.zero_optimization;
  z12.stage = 2;
  z12.offload_optimizer.device = "cpu";
  const bool overlapped = z12.overlaps_offloaded_step();
  struct Row {
    const char* name;
    double weights, grads, optim, gathered, cpu;
    const char* note;
  };
  const Row rows[] = {
      {"0", param_bytes, grad_bytes, 8 * p, 0, 0,
       cfg.train.bf16_expert_grads ? "split master, bf16 expert gradients"
       : plan.splits_master()      ? "split master"
                                   : ""},
      {"1", (4 + cb) * p, 4 * p, 8 * p / n, 0, 0, ""},
      {"2", (4 + cb) * p, 4 * p, 8 * p / n, 0, 0,
       "full gradient buffer (DeepSpeed ideal: grads / N)"},
      {"3", 4 * shard, 4 * shard, 8 * shard, slots, 0,
       "gathered: the slots of the units in use (weights, compute copy, gradients)"},
      {"2+offload", (4 + cb) * p, 4 * p, 0, 0, (overlapped ? 28 : 16) * p / n,
       overlapped ? "stage 1 alike; CPU: master, m, v, gradient staging, 2nd master, m, v"
                  : "stage 1 + offload alike; CPU: master, m, v, gradient staging"},
      {"3+offload", 4 * shard, 4 * shard, 0, slots, 16 * shard,
       "CPU: master, m, v, gradient staging"},
      {"3+param", 0, 0, 0, slots, (cfg.gradient_accumulation_steps > 1 ? 20 : 16) * shard,
       "+ offload_param; CPU: weight and gradient chunks, m, v"},
  };
  std::printf("per rank with %d data-parallel rank(s) (--world N; MiB):\n", world);
  std::printf("  %-10s %10s %10s %10s %10s %10s %10s  %s\n", "ZeRO", "weights", "gradients",
              "optimizer", "gathered", "act+scr", "GPU total", "CPU (offload)");
  // The row this config trains with is marked with "*".
  const int stage = cfg.zero_optimization.stage;
  const std::string mine = cfg.zero_optimization.offloads_optimizer()
                               ? (stage < 3                                 ? "2+offload"
                                  : cfg.zero_optimization.offloads_params() ? "3+param"
                                                                            : "3+offload")
                               : std::to_string(stage);
  for (const Row& r : rows) {
    const double gpu = r.weights + r.grads + r.optim + r.gathered + a;
    std::printf("%c %-10s %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f  %10.1f %s\n",
                mine == r.name ? '*' : ' ', r.name, mib(r.weights), mib(r.grads), mib(r.optim),
                mib(r.gathered), mib(a), mib(gpu), mib(r.cpu), r.note);
  }
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto flags = std::make_shared<ConfigFlags>();
  auto device = std::make_shared<std::string>();
  auto resume = std::make_shared<std::string>();
  auto profile = std::make_shared<bool>(false);
  auto memory_limit = std::make_shared<double>(-1.0);  // not given: the config's key
  CLI::App* cmd = app.add_subcommand("train", "train a model as the config describes");
  add_config_flags(cmd, *flags);
  cmd->add_option("--device", *device, "cpu | cuda | cuda:N | auto (overrides train.device)");
  cmd->add_option("--resume", *resume,
                  "auto (newest complete checkpoint in train.out_dir) or a checkpoint path "
                  "(overrides train.resume)");
  cmd->add_flag("--profile", *profile,
                "time every op (CUDA events on the GPU, NVTX ranges for Nsight Systems) and print "
                "the time per step of each op at the end (also MOE_PROFILE=1)");
  cmd->add_option("--gpu-memory-limit", *memory_limit,
                  "GiB the trainer may allocate on the GPU (0 = all of it): check that a run fits "
                  "a smaller card, e.g. 16 for a T4 (overrides train.gpu_memory_limit_gib)")
      ->check(finite_range(0.0, 1e6));
  register_runner("train", [flags, device, resume, profile, memory_limit] {
    if (*profile) profile::enable(true);
    run_train(*flags, *device, *resume, *memory_limit);
  });
}

void add_info_command(CLI::App& app) {
  auto flags = std::make_shared<ConfigFlags>();
  auto world = std::make_shared<int>(0);
  CLI::App* cmd = app.add_subcommand(
      "info", "print parameter counts, FLOPs per token and a memory estimate for a config");
  add_config_flags(cmd, *flags);
  cmd->add_option("--world", *world,
                  "data-parallel ranks for the per-rank ZeRO table (default: train_batch_size / "
                  "(micro * accumulation), else the launched ranks)")
      ->check(CLI::Range(1, 1 << 20));
  register_runner("info", [flags, world] { run_info(*flags, *world); });
}

}  // namespace moe::cli
