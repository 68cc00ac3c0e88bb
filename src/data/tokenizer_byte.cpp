// The byte-level tokenizer and the tokenizer directory format.
//
// Bytes 0-255 are their own ids and id 256 is the end-of-document token, so the vocabulary is
// 257. The extra id lets `prepare` separate documents in the token stream without giving up any
// byte value: text, UTF-8 and binary (\0 included) all round-trip exactly.
//
// A tokenizer directory holds moe_tokenizer.json ({"type": "byte"} or {"type": "spm", "model": ...,
// "vocab_size": N}); load_tokenizer reads it and dispatches to the right implementation.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "data/tokenizer_files.hpp"
#include "moe/error.hpp"
#include "moe/tokenizer.hpp"

namespace moe {

namespace {

namespace fs = std::filesystem;
using tokenizer_files::kTokenizerJson;

constexpr int64_t kByteVocab = 257;
constexpr int64_t kByteEos = 256;

class ByteTokenizer : public Tokenizer {
 public:
  std::vector<uint32_t> encode(const std::string& text) const override {
    std::vector<uint32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  // EOS marks a document boundary and has no text.
  std::string decode(const std::vector<uint32_t>& ids) const override {
    std::string text;
    text.reserve(ids.size());
    for (uint32_t id : ids) {
      if (id == kByteEos) continue;
      if (id > 255)
        throw InputError("byte tokenizer: token id " + std::to_string(id) +
                         " is outside the vocabulary of " + std::to_string(kByteVocab));
      text.push_back(static_cast<char>(id));
    }
    return text;
  }
  int64_t vocab_size() const override { return kByteVocab; }
  int64_t eos_id() const override { return kByteEos; }
  std::string type() const override { return "byte"; }
  void save(const std::string& dir) const override {
    tokenizer_files::create_tokenizer_dir(dir);
    tokenizer_files::write_tokenizer_json(
        dir, {{"type", "byte"}, {"vocab_size", kByteVocab}, {"eos_id", kByteEos}});
  }
};

nlohmann::json read_tokenizer_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot read the tokenizer description (missing?)");
  std::stringstream text;
  text << in.rdbuf();
  try {
    nlohmann::json j = nlohmann::json::parse(text.str());
    if (!j.is_object()) throw InputError(path + ": not a tokenizer description (not an object)");
    return j;
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path + ": not valid JSON: " + e.what());
  }
}

// The value of `key` as T, or InputError naming the file and key.
template <class T>
T field(const nlohmann::json& j, const char* key, const std::string& path) {
  try {
    return j.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    throw InputError(path + ": \"" + key + "\" is missing or has the wrong type");
  }
}

// Loads the spm model named by moe_tokenizer.json and checks it against the recorded vocabulary.
std::unique_ptr<Tokenizer> load_spm_from_json(const nlohmann::json& j, const std::string& dir,
                                              const std::string& path) {
  const std::string model =
      j.contains("model") ? field<std::string>(j, "model", path) : std::string("tokenizer.model");
  auto tok = load_spm_model((fs::path(dir) / model).string());
  if (j.contains("vocab_size") && field<int64_t>(j, "vocab_size", path) != tok->vocab_size())
    throw InputError(path + ": vocab_size " +
                     std::to_string(field<int64_t>(j, "vocab_size", path)) +
                     " disagrees with the model file's " + std::to_string(tok->vocab_size()));
  return tok;
}

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() {
  return std::make_unique<ByteTokenizer>();
}

bool has_tokenizer(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / kTokenizerJson, ec);
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir) {
  const std::string path = (fs::path(dir) / kTokenizerJson).string();
  const nlohmann::json j = read_tokenizer_json(path);
  const std::string type = field<std::string>(j, "type", path);
  if (type == "byte") {
    if (j.contains("vocab_size") && field<int64_t>(j, "vocab_size", path) != kByteVocab)
      throw InputError(path + ": a byte tokenizer has vocab_size " + std::to_string(kByteVocab));
    return make_byte_tokenizer();
  }
  if (type == "spm") return load_spm_from_json(j, dir, path);
  throw InputError(path + ": unknown tokenizer type \"" + type + "\" (expected byte or spm)");
}

}  // namespace moe
