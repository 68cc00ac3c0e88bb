#include "data/documents.hpp"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "moe/error.hpp"

namespace moe {

namespace {

const std::string& key_of(const DocumentFormat& f) {
  static const std::string kDefault = "text";
  return f.jsonl_key.empty() ? kDefault : f.jsonl_key;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

bool blank(const std::string& line) {
  return line.find_first_not_of(" \t\r") == std::string::npos;
}

}  // namespace

bool reads_as_jsonl(const std::string& path, const DocumentFormat& f) {
  if (f.format == "jsonl") return true;
  if (f.format == "text") return false;
  return ends_with(path, ".jsonl");
}

int64_t for_each_document(const std::string& path, const DocumentFormat& f,
                          const std::function<void(const std::string&)>& fn) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot read");
  if (!reads_as_jsonl(path, f)) {
    std::stringstream text;
    text << in.rdbuf();
    if (in.bad()) throw InputError(path + ": read error");
    const std::string doc = text.str();
    if (!doc.empty()) fn(doc);
    return static_cast<int64_t>(doc.size());
  }
  const std::string& key = key_of(f);
  int64_t bytes = 0;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (blank(line)) continue;
    const std::string where = path + ":" + std::to_string(number);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw InputError(where + ": not a JSON line (" + e.what() + ")");
    }
    if (!j.is_object()) throw InputError(where + ": not a JSON object");
    const auto it = j.find(key);
    if (it == j.end())
      throw InputError(where + ": no \"" + key +
                       "\" (the key that holds each document's text: --jsonl-key)");
    if (!it->is_string()) throw InputError(where + ": \"" + key + "\" is not a string");
    const std::string& doc = it->get_ref<const std::string&>();
    bytes += static_cast<int64_t>(doc.size());
    if (!doc.empty()) fn(doc);
  }
  if (in.bad()) throw InputError(path + ": read error");
  return bytes;
}

void check_document_format(const DocumentFormat& f, const std::vector<std::string>& inputs) {
  if (f.format != "auto" && f.format != "text" && f.format != "jsonl")
    throw InputError("prepare: unknown input format \"" + f.format +
                     "\" (expected auto, text or jsonl)");
  if (f.jsonl_key.empty()) return;
  for (const auto& path : inputs)
    if (reads_as_jsonl(path, f)) return;
  throw InputError(
      "prepare: --jsonl-key applies to JSON Lines inputs (.jsonl, or --format "
      "jsonl); none of the inputs is one");
}

}  // namespace moe
