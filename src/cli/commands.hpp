// The subcommands of moe-train: each registers its flags on the app and a runner that executes
// when it is selected. Shared pieces (config flags, the runner registry) live in commands.cpp.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace moe::cli {

void add_train_command(CLI::App& app);
void add_info_command(CLI::App& app);
void add_prepare_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_sample_command(CLI::App& app);
void add_export_command(CLI::App& app);
void add_bench_command(CLI::App& app);
// Runs whichever subcommand the command line selected.
void run_selected(CLI::App& app);
// Thrown by `train` after a run stopped early on a signal (its summary printed): main exits
// with 128 + signal.
struct StoppedBySignal {
  int signal;
};

// ---- shared by the command files ----
struct ConfigFlags {
  std::string config_path;
  std::vector<std::string> overrides;
};
void add_config_flags(CLI::App* cmd, ConfigFlags& f);
void register_runner(const std::string& name, std::function<void()> run);
// A number flag in [lo, hi]. CLI::Range alone lets "nan" through (every comparison with NaN is
// false), and CLI::PositiveNumber's message prints the largest double in full.
CLI::Validator finite_range(double lo, double hi);
// The --set override "key=<value as a JSON string>": a flag's value stays verbatim (quotes and
// backslashes included) instead of being read as JSON. ConfigError for text that is not UTF-8.
std::string string_override(const std::string& key, const std::string& value);

}  // namespace moe::cli
