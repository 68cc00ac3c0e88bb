// Config I/O: the key schema, JSON -> Config (overrides, unknown keys, types), Config -> JSON.
// Ranges and consistency are checked afterwards in config_validate.cpp.
#include "moe/config.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "config/config_internal.hpp"
#include "moe/error.hpp"

namespace moe {
namespace config_internal {

using nlohmann::json;
using nlohmann::ordered_json;

// ---- typed reads of one JSON value
// ---------------------------------------------------------------

namespace {

// Whether j nests no deeper than `levels`: json::dump recurses once per level, so a value nested
// thousands deep (a corrupt or hostile file) must not be dumped.
bool nests_within(const json& j, int levels) {
  if (!j.is_structured()) return true;
  if (levels == 0) return false;
  return std::all_of(j.begin(), j.end(),
                     [&](const json& e) { return nests_within(e, levels - 1); });
}

// `number 2.5`, `string "8"`: the JSON type and the value, shortened so a stray object stays
// readable. Text that is not UTF-8 (an override's raw bytes) shows with replacement characters.
std::string describe(const json& j) {
  if (j.is_null()) return "null";
  constexpr int kMaxShownLevels = 8;
  std::string text = nests_within(j, kMaxShownLevels)
                         ? j.dump(-1, ' ', false, json::error_handler_t::replace)
                         : "(nested too deep to show)";
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return std::string(j.type_name()) + " " + text;
}

[[noreturn]] void wrong_type(const std::string& path, const char* expected, const json& j) {
  throw ConfigError(path, std::string("wrong type: expected ") + expected + ", got " + describe(j));
}

template <class T>
T read_value(const json& j, const std::string& path);

// Integers must be JSON integers: 2.5 or "8" in a size is a mistake worth stopping for.
template <>
int read_value<int>(const json& j, const std::string& path) {
  if (!j.is_number_integer()) wrong_type(path, "an integer", j);
  bool fits = j.is_number_unsigned() ? j.get<uint64_t>() <= static_cast<uint64_t>(INT_MAX)
                                     : j.get<int64_t>() >= INT_MIN && j.get<int64_t>() <= INT_MAX;
  if (!fits) throw ConfigError(path, "integer " + j.dump() + " is out of the 32-bit range");
  return static_cast<int>(j.get<int64_t>());
}

template <>
uint64_t read_value<uint64_t>(const json& j, const std::string& path) {
  if (!j.is_number_integer()) wrong_type(path, "a non-negative integer", j);
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  int64_t v = j.get<int64_t>();
  if (v < 0) throw ConfigError(path, "must be >= 0, got " + j.dump());
  return static_cast<uint64_t>(v);
}

// Float keys accept integers too ("lr": 1 is unambiguous).
template <>
double read_value<double>(const json& j, const std::string& path) {
  if (!j.is_number()) wrong_type(path, "a number", j);
  double v = j.get<double>();
  if (!std::isfinite(v)) throw ConfigError(path, "must be a finite number, got " + j.dump());
  return v;
}

template <>
bool read_value<bool>(const json& j, const std::string& path) {
  if (!j.is_boolean()) wrong_type(path, "a boolean (true or false)", j);
  return j.get<bool>();
}

template <>
std::string read_value<std::string>(const json& j, const std::string& path) {
  if (!j.is_string()) wrong_type(path, "a string", j);
  std::string s = j.get<std::string>();
  // A NUL would cut a path short where it reaches the system (another directory, silently).
  if (s.find('\0') != std::string::npos)
    throw ConfigError(path, "must not contain a NUL character (\\u0000)");
  // The config is printed and saved as JSON, which holds UTF-8 only (an override's raw text is
  // taken as it comes).
  try {
    (void)j.dump();
  } catch (const json::type_error&) {
    throw ConfigError(path, "is not valid UTF-8 text, got " + describe(j));
  }
  return s;
}

// ---- schema builders
// -----------------------------------------------------------------------------

KeyNode section(std::string name, std::vector<KeyNode> children) {
  KeyNode n;
  n.name = std::move(name);
  n.children = std::move(children);
  return n;
}

// A leaf bound to the Config field that `at` returns; its C++ type picks the JSON type.
template <class Access>
KeyNode leaf(std::string name, Access at) {
  using T = std::decay_t<decltype(at(std::declval<Config&>()))>;
  KeyNode n;
  n.name = std::move(name);
  n.read = [at](Config& c, const json& j, const std::string& path) {
    at(c) = read_value<T>(j, path);
  };
  n.write = [at](Config& c) { return ordered_json(at(c)); };
  return n;
}

// DeepSpeed's "betas": [beta1, beta2] maps onto two scalar fields.
KeyNode betas_key() {
  KeyNode n;
  n.name = "betas";
  n.read = [](Config& c, const json& j, const std::string& path) {
    if (!j.is_array() || j.size() != 2 || !j[0].is_number() || !j[1].is_number())
      wrong_type(path, "an array of 2 numbers", j);
    c.optimizer.beta1 = read_value<double>(j[0], path);
    c.optimizer.beta2 = read_value<double>(j[1], path);
  };
  n.write = [](Config& c) { return ordered_json::array({c.optimizer.beta1, c.optimizer.beta2}); };
  return n;
}

// Hugging Face config.json keys accepted so a MixtralConfig's fields can be pasted under "model".
KeyNode model_type_key() {
  KeyNode n;
  n.name = "model_type";
  n.read = [](Config&, const json& j, const std::string& path) {
    std::string type = read_value<std::string>(j, path);
    if (type != "mixtral")
      throw ConfigError(path, "model_type \"" + type +
                                  "\" is not supported: this trainer builds Mixtral-family models "
                                  "(use \"mixtral\" or leave the key out)");
  };
  return n;
}

KeyNode architectures_key() {
  KeyNode n;
  n.name = "architectures";
  n.read = [](Config&, const json& j, const std::string& path) {
    bool ok = j.is_array() &&
              std::all_of(j.begin(), j.end(), [](const json& e) { return e.is_string(); });
    if (!ok) wrong_type(path, "an array of strings", j);
  };
  return n;
}

// Field accessors for leaf(): AT(model.vocab_size) reads and writes c.model.vocab_size.
// clang-format off
#define AT(member) [](Config& c) -> auto& { return c.member; }
// clang-format on

KeyNode optimizer_section() {
  return section(
      "optimizer",
      {leaf("type", AT(optimizer.type)),
       section("params", {leaf("lr", AT(optimizer.lr)), betas_key(), leaf("eps", AT(optimizer.eps)),
                          leaf("weight_decay", AT(optimizer.weight_decay))})});
}

KeyNode scheduler_section() {
  return section("scheduler",
                 {leaf("type", AT(scheduler.type)),
                  section("params", {leaf("warmup_num_steps", AT(scheduler.warmup_num_steps)),
                                     leaf("warmup_min_ratio", AT(scheduler.warmup_min_ratio)),
                                     leaf("total_num_steps", AT(scheduler.total_num_steps)),
                                     leaf("cos_min_ratio", AT(scheduler.cos_min_ratio))})});
}

KeyNode fp16_section() {
  return section(
      "fp16",
      {leaf("enabled", AT(fp16.enabled)), leaf("loss_scale", AT(fp16.loss_scale)),
       leaf("initial_scale_power", AT(fp16.initial_scale_power)),
       leaf("loss_scale_window", AT(fp16.loss_scale_window)),
       leaf("hysteresis", AT(fp16.hysteresis)), leaf("min_loss_scale", AT(fp16.min_loss_scale))});
}

KeyNode mod_section() {
  return section("mod",
                 {leaf("enabled", AT(model.mod.enabled)), leaf("capacity", AT(model.mod.capacity)),
                  leaf("every", AT(model.mod.every)),
                  leaf("predictor_hidden_size", AT(model.mod.predictor_hidden_size)),
                  leaf("predictor_loss_coef", AT(model.mod.predictor_loss_coef))});
}

// Hugging Face MixtralConfig order first, then the keys MODEL_SPEC adds.
KeyNode model_section() {
  return section(
      "model", {model_type_key(),
                architectures_key(),
                leaf("vocab_size", AT(model.vocab_size)),
                leaf("hidden_size", AT(model.hidden_size)),
                leaf("intermediate_size", AT(model.intermediate_size)),
                leaf("num_hidden_layers", AT(model.num_hidden_layers)),
                leaf("num_attention_heads", AT(model.num_attention_heads)),
                leaf("num_key_value_heads", AT(model.num_key_value_heads)),
                leaf("head_dim", AT(model.head_dim)),
                leaf("rms_norm_eps", AT(model.rms_norm_eps)),
                leaf("rope_theta", AT(model.rope_theta)),
                leaf("max_position_embeddings", AT(model.max_position_embeddings)),
                leaf("num_local_experts", AT(model.num_local_experts)),
                leaf("num_experts_per_tok", AT(model.num_experts_per_tok)),
                leaf("router_aux_loss_coef", AT(model.router_aux_loss_coef)),
                leaf("router_z_loss_coef", AT(model.router_z_loss_coef)),
                leaf("router_bias_update_rate", AT(model.router_bias_update_rate)),
                leaf("tie_word_embeddings", AT(model.tie_word_embeddings)),
                leaf("moe_layer_freq", AT(model.moe_layer_freq)),
                leaf("dense_intermediate_size", AT(model.dense_intermediate_size)),
                leaf("norm_topk_prob", AT(model.norm_topk_prob)),
                leaf("num_shared_experts", AT(model.num_shared_experts)),
                leaf("shared_expert_intermediate_size", AT(model.shared_expert_intermediate_size)),
                leaf("initializer_range", AT(model.initializer_range)),
                leaf("init_from", AT(model.init_from)),
                mod_section()});
}

KeyNode data_section() {
  return section("data", {leaf("source", AT(data.source)), leaf("seq_len", AT(data.seq_len)),
                          leaf("train_files", AT(data.train_files)),
                          leaf("val_files", AT(data.val_files)), leaf("shuffle", AT(data.shuffle)),
                          section("synthetic", {leaf("seed", AT(data.synthetic.seed)),
                                                leaf("branching", AT(data.synthetic.branching))})});
}

KeyNode train_section() {
  return section("train", {leaf("max_steps", AT(train.max_steps)),
                           leaf("log_interval", AT(train.log_interval)),
                           leaf("eval_interval", AT(train.eval_interval)),
                           leaf("eval_batches", AT(train.eval_batches)),
                           leaf("seed", AT(train.seed)),
                           leaf("device", AT(train.device)),
                           leaf("out_dir", AT(train.out_dir)),
                           leaf("save_interval", AT(train.save_interval)),
                           leaf("save_at_end", AT(train.save_at_end)),
                           leaf("keep_checkpoints", AT(train.keep_checkpoints)),
                           leaf("resume", AT(train.resume)),
                           leaf("comm_timeout_s", AT(train.comm_timeout_s)),
                           leaf("recompute_layers", AT(train.recompute_layers)),
                           leaf("recompute_expert_inputs", AT(train.recompute_expert_inputs)),
                           leaf("recompute_expert_rows", AT(train.recompute_expert_rows)),
                           leaf("split_master", AT(train.split_master)),
                           leaf("bf16_expert_grads", AT(train.bf16_expert_grads)),
                           leaf("head_chunk_tokens", AT(train.head_chunk_tokens)),
                           leaf("overlap_optimizer", AT(train.overlap_optimizer)),
                           leaf("gpu_memory_limit_gib", AT(train.gpu_memory_limit_gib))});
}

// DeepSpeed's zero_optimization, with its offload_optimizer and offload_param blocks.
KeyNode zero_section() {
  return section("zero_optimization",
                 {leaf("stage", AT(zero_optimization.stage)),
                  leaf("overlap_comm", AT(zero_optimization.overlap_comm)),
                  leaf("reduce_bucket_size", AT(zero_optimization.reduce_bucket_size)),
                  section("offload_optimizer",
                          {leaf("device", AT(zero_optimization.offload_optimizer.device)),
                           leaf("pin_memory", AT(zero_optimization.offload_optimizer.pin_memory)),
                           leaf("overlap_backward",
                                AT(zero_optimization.offload_optimizer.overlap_backward))}),
                  section("offload_param",
                          {leaf("device", AT(zero_optimization.offload_param.device)),
                           leaf("pin_memory", AT(zero_optimization.offload_param.pin_memory))})});
}

KeyNode build_schema() {
  return section("", {leaf("train_micro_batch_size_per_gpu", AT(train_micro_batch_size_per_gpu)),
                      leaf("gradient_accumulation_steps", AT(gradient_accumulation_steps)),
                      leaf("train_batch_size", AT(train_batch_size)),
                      leaf("gradient_clipping", AT(gradient_clipping)), optimizer_section(),
                      scheduler_section(), fp16_section(),
                      section("bf16", {leaf("enabled", AT(bf16_enabled))}), zero_section(),
                      model_section(), data_section(), train_section()});
}

#undef AT

}  // namespace

const KeyNode* KeyNode::find_child(const std::string& key) const {
  for (const KeyNode& c : children)
    if (c.name == key) return &c;
  return nullptr;
}

const KeyNode& config_schema() {
  static const KeyNode root = build_schema();
  return root;
}

std::string join_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

// ---- unknown keys
// --------------------------------------------------------------------------------

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      size_t substitute = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      row[j] = std::min({above + 1, row[j - 1] + 1, substitute});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

// The closest sibling within max(2, len/3) edits (case-insensitive), or "" when none is close.
std::string closest_key(const KeyNode& section, const std::string& key) {
  size_t limit = std::max<size_t>(2, key.size() / 3);
  std::string best;
  size_t best_distance = limit + 1;
  for (const KeyNode& c : section.children) {
    size_t d = edit_distance(lower(key), lower(c.name));
    if (d < best_distance) best = c.name, best_distance = d;
  }
  return best;
}

// `context` (e.g. the override's text) is appended so the user can find the key's origin.
ConfigError unknown_key_error(const KeyNode& section, const std::string& key,
                              const std::string& parent_path, const std::string& context = "") {
  std::string where = parent_path.empty() ? "at the top level" : "in \"" + parent_path + "\"";
  std::string msg = "unknown key \"" + key + "\" " + where;
  std::string suggestion = closest_key(section, key);
  if (!suggestion.empty()) {
    msg += "; did you mean \"" + suggestion + "\"?";
  } else {
    msg += "; valid keys:";
    for (size_t i = 0; i < section.children.size(); ++i)
      msg += (i ? ", " : " ") + section.children[i].name;
  }
  return ConfigError(join_path(parent_path, key), msg + context);
}

// ---- JSON -> Config
// ------------------------------------------------------------------------------

void read_section(const KeyNode& node, const json& j, const std::string& path, Config& c) {
  if (!j.is_object()) wrong_type(path, "an object", j);
  for (const auto& item : j.items()) {
    const KeyNode* child = node.find_child(item.key());
    if (child == nullptr) throw unknown_key_error(node, item.key(), path);
    std::string child_path = join_path(path, item.key());
    if (child->is_section())
      read_section(*child, item.value(), child_path, c);
    else
      child->read(c, item.value(), child_path);
  }
}

// A key given twice in one object: JSON parsers keep the last value and drop the other silently,
// so a copy-pasted section would quietly override the one the user reads. The callback sees the
// parse events in order; each open object keeps the keys seen so far, each array a placeholder.
class DuplicateKeyCheck {
 public:
  // base: the JSON path of the text's root (an override's key), prefixed to the error's path.
  explicit DuplicateKeyCheck(std::string source, std::string base = "")
      : source_(std::move(source)), base_(std::move(base)) {}
  bool operator()(int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        open_.push_back({event == json::parse_event_t::object_start, {}, ""});
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!open_.empty()) open_.pop_back();
        break;
      case json::parse_event_t::key: {
        Open& o = open_.back();
        o.key = parsed.get<std::string>();
        if (!o.keys.insert(o.key).second)
          throw ConfigError(path(), "given twice in the same object of " + source_ +
                                        " (only one value can count); remove one of them");
        break;
      }
      case json::parse_event_t::value:
        break;
    }
    return true;
  }

 private:
  struct Open {
    bool object;
    std::set<std::string> keys;
    std::string key;  // the latest key of an object
  };
  std::string path() const {
    std::string p = base_;
    for (const Open& o : open_)
      if (o.object) p = join_path(p, o.key);
    return p;
  }
  std::string source_, base_;
  std::vector<Open> open_;
};

json parse_json_text(const std::string& text, const std::string& source) {
  try {
    // Comments are allowed so shipped configs can explain their choices.
    return json::parse(text, DuplicateKeyCheck(source), /*allow_exceptions=*/true,
                       /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    // e.what() reads "[json.exception.parse_error.101] parse error at line 3, column 5: ...".
    std::string detail = e.what();
    size_t bracket = detail.find("] ");
    if (detail.rfind("[json.exception", 0) == 0 && bracket != std::string::npos)
      detail = detail.substr(bracket + 2);
    throw ConfigError(
        "", source + ": malformed JSON at byte " + std::to_string(e.byte) + ": " + detail);
  }
}

// ---- overrides "a.b.c=value"
// ---------------------------------------------------------------------

std::string trim(const std::string& s) {
  size_t begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  size_t end = s.find_last_not_of(" \t");
  return s.substr(begin, end - begin + 1);
}

[[noreturn]] void bad_override(const std::string& text, const std::string& why) {
  throw ConfigError("", "override \"" + text + "\" " + why +
                            " (expected a.b.c=value, e.g. model.num_local_experts=4)");
}

std::vector<std::string> split_key(const std::string& key, const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream in(key);
  std::string part;
  while (std::getline(in, part, '.')) parts.push_back(part);
  if (key.empty() || key.back() == '.' ||
      std::any_of(parts.begin(), parts.end(), [](const std::string& p) { return p.empty(); }))
    bad_override(text, "has an empty key name");
  return parts;
}

// The value is JSON when it parses as JSON (8, 1e-3, true, [0.9,0.95], "x"), else the raw text,
// so `train.device=cpu` needs no quotes. A key given twice in an object value is an error at its
// path below `path`, as in a config file.
json override_value(const std::string& value_text, const std::string& path,
                    const std::string& text) {
  json v = json::parse(value_text, DuplicateKeyCheck("override \"" + text + "\"", path),
                       /*allow_exceptions=*/false);
  return v.is_discarded() ? json(value_text) : v;
}

void apply_override(json& doc, const std::string& text) {
  size_t eq = text.find('=');
  if (eq == std::string::npos) bad_override(text, "has no '='");
  std::vector<std::string> parts = split_key(trim(text.substr(0, eq)), text);
  const KeyNode* node = &config_schema();
  json* at = &doc;
  std::string path;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!node->is_section())
      throw ConfigError(
          join_path(path, parts[i]),
          "unknown key: \"" + path + "\" is a value, not a section (override \"" + text + "\")");
    const KeyNode* child = node->find_child(parts[i]);
    if (child == nullptr)
      throw unknown_key_error(*node, parts[i], path, " (override \"" + text + "\")");
    path = join_path(path, parts[i]);
    json& slot = (*at)[parts[i]];
    if (i + 1 == parts.size()) {
      slot = override_value(trim(text.substr(eq + 1)), path, text);
    } else {
      if (slot.is_null()) slot = json::object();  // the override creates missing sections
      if (!slot.is_object()) wrong_type(path, "an object", slot);
      at = &slot;
    }
    node = child;
  }
}

// ---- Config -> JSON
// ------------------------------------------------------------------------------

ordered_json write_section(const KeyNode& node, Config& c) {
  ordered_json out = ordered_json::object();
  for (const KeyNode& child : node.children) {
    if (child.is_section())
      out[child.name] = write_section(child, c);
    else if (child.write)
      out[child.name] = child.write(c);
  }
  return out;
}

// Copies between nlohmann's two object flavours (ordered for printing, sorted for the API).
json to_sorted(const ordered_json& v) {
  using nlohmann::detail::value_t;
  switch (v.type()) {
    case value_t::object: {
      json out = json::object();
      for (const auto& item : v.items()) out[item.key()] = to_sorted(item.value());
      return out;
    }
    case value_t::array: {
      json out = json::array();
      for (const auto& e : v) out.push_back(to_sorted(e));
      return out;
    }
    case value_t::number_integer:
      return v.get<int64_t>();
    case value_t::number_unsigned:
      return v.get<uint64_t>();
    case value_t::number_float:
      return v.get<double>();
    case value_t::boolean:
      return v.get<bool>();
    case value_t::string:
      return v.get<std::string>();
    default:
      return nullptr;
  }
}

ordered_json to_ordered_json(const Config& c) {
  Config copy = c;  // the leaf accessors hand out mutable references
  return write_section(config_schema(), copy);
}

}  // namespace
}  // namespace config_internal

// ---- public API
// ----------------------------------------------------------------------------------

Config parse_config(const std::string& json_text, const std::vector<std::string>& overrides,
                    const std::string& source) {
  using namespace config_internal;
  nlohmann::json doc = parse_json_text(json_text, source);
  if (!doc.is_object())
    throw ConfigError("", source + ": the config must be a JSON object ({...}), got " +
                              std::string(doc.type_name()));
  for (const std::string& o : overrides) apply_override(doc, o);
  Config c;
  read_section(config_schema(), doc, "", c);
  validate_and_resolve(c);
  return c;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError("", "cannot read config file \"" + path + "\": it is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw ConfigError("", "cannot open config file \"" + path + "\": " + std::strerror(errno));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw ConfigError("", "cannot read config file \"" + path + "\"");
  return parse_config(text.str(), overrides, path);
}

nlohmann::json config_to_json_value(const Config& c) {
  return config_internal::to_sorted(config_internal::to_ordered_json(c));
}

// Printed in schema order (DeepSpeed keys first, model keys in MixtralConfig order) for people.
std::string config_to_json(const Config& c, int indent) {
  return config_internal::to_ordered_json(c).dump(indent);
}

}  // namespace moe
