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

// ---- shared by the command files ----
struct ConfigFlags {
  std::string config_path;
  std::vector<std::string> overrides;
};
void add_config_flags(CLI::App* cmd, ConfigFlags& f);
void register_runner(const std::string& name, std::function<void()> run);

}  // namespace moe::cli
