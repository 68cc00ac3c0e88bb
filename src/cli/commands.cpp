// The runner registry and the flags every config-reading subcommand shares.
#include "cli/commands.hpp"

#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "moe/error.hpp"

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

CLI::Validator finite_range(double lo, double hi) {
  std::ostringstream range;
  range << lo << " to " << hi;
  const std::string text = range.str();
  return CLI::Validator(
      [lo, hi, text](std::string& in) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(in, v)) return "Value " + in + " is not a number";
        if (!(v >= lo && v <= hi)) return "Value " + in + " not in range " + text;
        return "";
      },
      "FLOAT in [" + text + "]");
}

std::string string_override(const std::string& key, const std::string& value) {
  try {
    return key + "=" + nlohmann::json(value).dump();
  } catch (const nlohmann::json::type_error&) {
    throw ConfigError(key, "is not valid UTF-8 text (the config is printed and saved as JSON)");
  }
}

void run_selected(CLI::App& app) {
  for (CLI::App* sub : app.get_subcommands()) runners().at(sub->get_name())();
}

}  // namespace moe::cli
