// The kernel and path switches read from the environment (MOE_ATTENTION_SM90=0 and the like;
// docs/usage.md lists them), for A/B runs and for tests that compare the paths. Read at every
// call, so a test can change one between calls.
#pragma once
#include <cstdlib>
#include <cstring>

namespace moe {

// Switch `name`: "0" off, "1" on, unset or anything else `by_default`.
inline bool env_switch(const char* name, bool by_default) {
  const char* v = std::getenv(name);
  if (v == nullptr) return by_default;
  if (std::strcmp(v, "0") == 0) return false;
  if (std::strcmp(v, "1") == 0) return true;
  return by_default;
}

}  // namespace moe
