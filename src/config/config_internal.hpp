// Private to src/config. The key schema is the single description of the JSON layout: the reader
// (types, unknown keys), the override checker and the writer all walk it, so a key added here is
// parsed, checked, printed and suggested everywhere at once. Ranges live in config_validate.cpp.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moe/config.hpp"

namespace moe::config_internal {

// One key of the layout: a section (children, no reader) or a leaf bound to one Config field.
struct KeyNode {
  std::string name;
  std::vector<KeyNode> children;
  // Leaf: checks the JSON type and stores the value; throws ConfigError at `path`.
  std::function<void(Config&, const nlohmann::json&, const std::string& path)> read;
  // Leaf: the value to print. Empty for keys that are accepted but ignored (model_type, ...).
  std::function<nlohmann::ordered_json(Config&)> write;

  bool is_section() const { return !read; }
  const KeyNode* find_child(const std::string& key) const;
};

// The root section (name "").
const KeyNode& config_schema();

// "a.b" from "a" and "b"; the root's path is "".
std::string join_path(const std::string& parent, const std::string& key);

// Range and consistency checks (ConfigError at the offending key's path), then fills the derived
// model sizes (head_dim, dense_intermediate_size, shared_expert_intermediate_size) and the
// canonical optimizer name.
void validate_and_resolve(Config& c);

}  // namespace moe::config_internal
