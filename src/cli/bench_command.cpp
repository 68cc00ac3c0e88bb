// `bench`: the kernel benchmark of src/bench at a config's shapes (one micro-batch).
#include <cstdio>
#include <iostream>
#include <memory>

#include "bench/kernel_bench.hpp"
#include "cli/commands.hpp"
#include "moe/config.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/trainer.hpp"
#include "train/code_arch_note.hpp"

namespace moe::cli {

namespace {

struct BenchFlags {
  ConfigFlags config;
  std::string device;
  int iters = 20;
  std::vector<double> skews;
  std::vector<std::string> families;
};

void run_bench(const BenchFlags& f) {
  std::vector<std::string> overrides = f.config.overrides;
  if (!f.device.empty()) overrides.push_back(string_override("train.device", f.device));
  const Config cfg = load_config(f.config.config_path, overrides);
  const Device dev = resolve_device(cfg.train.device);
  // The activation dtype the trainer would use; the CPU backend computes in f32 only.
  const DType dt = dev.type == DeviceType::cuda ? compute_dtype(cfg, dev) : DType::f32;
  BenchOptions opt;
  opt.iters = f.iters;
  if (!f.skews.empty()) opt.skews = f.skews;
  opt.families = f.families;
  std::printf("%s\nbench: %s, %s, micro-batch %d x %d tokens, median of %d\n", build_info().c_str(),
              dev.str().c_str(), dtype_name(dt), cfg.train_micro_batch_size_per_gpu,
              cfg.data.seq_len, opt.iters);
  std::fputs(code_arch_note(dev).c_str(), stdout);
  std::fflush(stdout);
  const auto rows = run_kernel_bench(cfg.model, cfg.train_micro_batch_size_per_gpu,
                                     cfg.data.seq_len, dt, dev, opt);
  std::cout << format_bench(rows) << std::flush;
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto flags = std::make_shared<BenchFlags>();
  CLI::App* cmd = app.add_subcommand(
      "bench", "time each kernel family at a config's shapes against the measured roofline");
  add_config_flags(cmd, flags->config);
  cmd->add_option("--device", flags->device, "cpu | cuda | cuda:N | auto (overrides train.device)");
  cmd->add_option("--iters", flags->iters, "timed calls per family (median reported)")
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--skew", flags->skews,
                  "expert-load skews (maxvio) for the grouped GEMM rows (default 0 1 10)")
      ->check(finite_range(0.0, 1e6));
  cmd->add_option("--family", flags->families,
                  "time only the families starting with these names (e.g. attention grouped_gemm); "
                  "the copy and dense_gemm references always run")
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {
            if (names_a_family(in)) return "";
            std::string list;
            for (const std::string& f : bench_families()) list += (list.empty() ? "" : " ") + f;
            return "\"" + in + "\" starts no family; the families are: " + list;
          },
          "FAMILY"));
  register_runner("bench", [flags] { run_bench(*flags); });
}

}  // namespace moe::cli
