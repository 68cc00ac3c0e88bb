// The subcommands of moe-train: each registers its flags on the app and runs when selected.
#pragma once
#include <CLI/CLI.hpp>

namespace moe::cli {

void add_train_command(CLI::App& app);
void add_info_command(CLI::App& app);
// Runs whichever subcommand the command line selected.
void run_selected(CLI::App& app);

}  // namespace moe::cli
