// Typed errors. Library code throws; only main() turns them into a message and an exit code:
// ConfigError / InputError -> exit 2 (the user's input is wrong), everything else -> exit 1.
#pragma once
#include <stdexcept>
#include <string>

namespace moe {

// Bad configuration: `path` is the JSON path of the offending key (e.g. "model.num_local_experts").
struct ConfigError : std::runtime_error {
  std::string path;
  ConfigError(std::string p, const std::string& msg)
      : std::runtime_error(p.empty() ? msg : p + ": " + msg), path(std::move(p)) {}
};

// Bad input other than the config: a missing or corrupt file, an impossible command-line value.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A value an op needs to be finite is not (e.g. the router's logits): the numbers diverged, which
// is neither bad input nor a bug. The trainer reports it as the run's divergence at its step.
struct NonFiniteError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A broken internal invariant (a bug, not bad input).
struct InternalError : std::logic_error {
  using std::logic_error::logic_error;
};

// A number as messages show it: the stream's shortest default form (0.001, 1e+30, 3).
std::string shown(double v);

[[noreturn]] void throw_check_failed(const char* cond, const char* file, int line,
                                     const std::string& msg);

}  // namespace moe

// MOE_CHECK(cond, msg): invariant check that stays on in release builds (shapes, dtypes, devices).
#define MOE_CHECK(cond, msg)                                                  \
  do {                                                                        \
    if (!(cond)) ::moe::throw_check_failed(#cond, __FILE__, __LINE__, (msg)); \
  } while (0)
