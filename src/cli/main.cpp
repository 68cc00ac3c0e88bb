// moe-train: the command-line entry point. Subcommands parse their flags here and call the
// library; every error surfaces as one message and an exit code: 2 for bad input (config,
// command line, files), 1 for a failure while running; 128 + N for a training run that a signal
// N stopped (gracefully, with a checkpoint).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

#include "cli/commands.hpp"
#include "moe/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{
      "moe-train: a native trainer for Mixture-of-Experts and Mixture-of-Depths language models.\n"
      "Exit codes: 0 success, 1 runtime failure, 2 bad input (config, flags or files),\n"
      "128 + N a training run that signal N (SIGTERM, SIGINT, SIGUSR1) stopped after a step."};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(MOE_VERSION));
  moe::cli::add_train_command(app);
  moe::cli::add_eval_command(app);
  moe::cli::add_sample_command(app);
  moe::cli::add_prepare_command(app);
  moe::cli::add_export_command(app);
  moe::cli::add_info_command(app);
  moe::cli::add_bench_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  try {
    moe::cli::run_selected(app);
  } catch (const moe::cli::StoppedBySignal& e) {
    return 128 + e.signal;
  } catch (const moe::ConfigError& e) {
    std::fprintf(stderr, "error: config %s\n", e.what());
    return 2;
  } catch (const moe::InputError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
