// The runner registry and the flags every config-reading subcommand shares.
#include "cli/commands.hpp"

#include <map>

namespace moe::cli {

namespace {
std::map<std::string, std::function<void()>>& runners() {
  static std::map<std::string, std::function<void()>> r;
  return r;
}
}  // namespace

void register_runner(const std::string& name, std::function<void()> run) {
  runners()[name] = std::move(run);
}

void add_config_flags(CLI::App* cmd, ConfigFlags& f) {
  cmd->add_option("-c,--config", f.config_path, "JSON config file (see docs/config.md)")
      ->required();
  cmd->add_option("--set", f.overrides,
                  "override a config key, e.g. --set optimizer.params.lr=1e-3 (repeatable)")
      ->take_all()
      ->allow_extra_args(false);
}

void run_selected(CLI::App& app) {
  for (CLI::App* sub : app.get_subcommands()) runners().at(sub->get_name())();
}

}  // namespace moe::cli
