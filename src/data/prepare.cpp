// `moe-train prepare`: text or JSON Lines files in, token shards and a tokenizer out.
//
// Each document (a text file whole, or a line of a JSON Lines file: data/documents.hpp) is encoded
// and followed by the tokenizer's EOS, so the model sees where documents end. The token stream is
// then split once, the last val_fraction going to validation, so validation text is never trained
// on (a per-document split would need many documents; a tail split works for a single file too).
// The stream is held in memory (4 bytes a token), which keeps the split exact and the code simple;
// corpora far beyond memory should be prepared in parts.
//
// Shards from an earlier run in the same directory (train_NNNNNN.bin / val_NNNNNN.bin) are
// removed first: a glob such as train_*.bin would otherwise pick up stale ones.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <ostream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "data/documents.hpp"
#include "moe/error.hpp"
#include "moe/shards.hpp"
#include "moe/tokenizer.hpp"

namespace moe {

namespace {

namespace fs = std::filesystem;

constexpr int kDefaultSpmVocab = 8000;
// Each split needs at least one input token and its target.
constexpr int64_t kMinSplitTokens = 2;

// How the inputs hold their documents.
DocumentFormat document_format(const PrepareOptions& opt) {
  return DocumentFormat{opt.format, opt.jsonl_key};
}

void validate(const PrepareOptions& opt) {
  if (opt.inputs.empty()) throw InputError("prepare: no input text files given");
  if (opt.out_dir.empty()) throw InputError("prepare: no output directory given");
  if (opt.tokenizer != "byte" && opt.tokenizer != "spm")
    throw InputError("prepare: unknown tokenizer \"" + opt.tokenizer + "\" (expected byte or spm)");
  if (!(opt.val_fraction > 0.0 && opt.val_fraction < 1.0))
    throw InputError("prepare: val_fraction must be in (0, 1), got " +
                     std::to_string(opt.val_fraction));
  if (opt.shard_tokens < 1 || opt.shard_tokens > INT32_MAX)
    throw InputError("prepare: shard_tokens must be in [1, 2^31 - 1], got " +
                     std::to_string(opt.shard_tokens));
  if (opt.vocab_size < 0)
    throw InputError("prepare: vocab_size must be >= 0 (0 = " + std::to_string(kDefaultSpmVocab) +
                     "), got " + std::to_string(opt.vocab_size));
  check_document_format(document_format(opt), opt.inputs);
  // Options the chosen tokenizer would ignore: the run would silently not be the one asked for.
  if (opt.tokenizer == "byte" && (opt.vocab_size != 0 || !opt.spm_model.empty()))
    throw InputError(std::string("prepare: --") +
                     (opt.vocab_size != 0 ? "vocab-size" : "spm-model") +
                     " applies to --tokenizer spm; the byte tokenizer has a fixed vocabulary of "
                     "257");
}

// Fails before any slow work (tokenizer training) when an input cannot be read.
void check_inputs(const std::vector<std::string>& inputs) {
  uintmax_t bytes = 0;
  for (const auto& f : inputs) {
    std::error_code ec;
    if (!fs::exists(f, ec)) throw InputError(f + ": cannot read: no such file");
    if (!fs::is_regular_file(f, ec)) throw InputError(f + ": cannot read: not a regular file");
    if (!std::ifstream(f, std::ios::binary)) throw InputError(f + ": cannot read (permissions?)");
    bytes += fs::file_size(f, ec);
  }
  // (SentencePiece's own message for this names neither the files nor the cause.)
  if (bytes == 0)
    throw InputError("prepare: the input files (first: " + inputs.front() + ") are all empty");
}

void make_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw InputError(dir + ": cannot create the directory: " + ec.message());
}

// SentencePiece trains on text files line by line; JSON Lines inputs are given to it as their
// documents' text, in a file of the output directory removed once the model is trained.
class SpmTrainingText {
 public:
  explicit SpmTrainingText(const PrepareOptions& opt) : files_(opt.inputs) {
    const DocumentFormat format = document_format(opt);
    bool any_jsonl = false;
    for (const auto& f : opt.inputs) any_jsonl = any_jsonl || reads_as_jsonl(f, format);
    if (!any_jsonl) return;
    temp_ = (fs::path(opt.out_dir) / ".prepare_spm_text.txt").string();
    std::ofstream out(temp_, std::ios::binary | std::ios::trunc);
    int64_t bytes = 0;
    for (const auto& f : opt.inputs)
      bytes += for_each_document(f, format, [&](const std::string& doc) { out << doc << '\n'; });
    out.close();
    if (!out) throw InputError(temp_ + ": cannot write the text for SentencePiece training");
    // (SentencePiece's own message for this names neither the files nor the cause.)
    if (bytes == 0)
      throw InputError("prepare: the inputs' documents (first: " + opt.inputs.front() +
                       ") hold no text");
    files_ = {temp_};
  }
  ~SpmTrainingText() {
    std::error_code ec;
    if (!temp_.empty()) fs::remove(temp_, ec);
  }
  SpmTrainingText(const SpmTrainingText&) = delete;
  SpmTrainingText& operator=(const SpmTrainingText&) = delete;
  const std::vector<std::string>& files() const { return files_; }

 private:
  std::vector<std::string> files_;
  std::string temp_;
};

std::unique_ptr<Tokenizer> make_tokenizer(const PrepareOptions& opt) {
  if (opt.tokenizer == "byte") return make_byte_tokenizer();
  if (!opt.spm_model.empty()) {
    std::unique_ptr<Tokenizer> tok = load_spm_model(opt.spm_model);
    if (opt.vocab_size != 0 && tok->vocab_size() != opt.vocab_size)
      throw InputError(opt.spm_model + ": the SentencePiece model has a vocabulary of " +
                       std::to_string(tok->vocab_size()) + ", not the --vocab-size " +
                       std::to_string(opt.vocab_size) + " asked for");
    return tok;
  }
  const int vocab = opt.vocab_size > 0 ? opt.vocab_size : kDefaultSpmVocab;
  const SpmTrainingText text(opt);
  return train_spm_tokenizer(text.files(), vocab, opt.out_dir);
}

// The whole corpus as one token stream, each document followed by EOS (when there is one).
std::vector<uint32_t> encode_inputs(const PrepareOptions& opt, const Tokenizer& tok,
                                    int64_t& text_bytes, int64_t& documents) {
  std::vector<uint32_t> stream;
  text_bytes = 0;
  documents = 0;
  const DocumentFormat format = document_format(opt);
  for (const auto& f : opt.inputs)
    text_bytes += for_each_document(f, format, [&](const std::string& doc) {
      const std::vector<uint32_t> ids = tok.encode(doc);
      stream.insert(stream.end(), ids.begin(), ids.end());
      if (tok.eos_id() >= 0) stream.push_back(static_cast<uint32_t>(tok.eos_id()));
      ++documents;
    });
  return stream;
}

// Tokens that go to validation: the requested fraction, but at least kMinSplitTokens in each
// split.
int64_t val_token_count(int64_t total, double val_fraction) {
  if (total < 2 * kMinSplitTokens)
    throw InputError("prepare: the corpus is too small: " + std::to_string(total) +
                     " tokens, but train and val need at least " + std::to_string(kMinSplitTokens) +
                     " tokens each");
  const auto wanted = static_cast<int64_t>(std::llround(static_cast<double>(total) * val_fraction));
  return std::min(std::max(wanted, kMinSplitTokens), total - kMinSplitTokens);
}

void remove_stale_shards(const std::string& dir) {
  static const std::regex kShardName(R"((train|val)_[0-9]{6}\.bin)");
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (!entry.is_regular_file() || !std::regex_match(entry.path().filename().string(), kShardName))
      continue;
    if (!fs::remove(entry.path(), ec) || ec)
      throw InputError(entry.path().string() + ": cannot remove the old shard: " + ec.message());
  }
}

std::string shard_path(const std::string& dir, const std::string& split, int index) {
  char name[32];
  std::snprintf(name, sizeof name, "%s_%06d.bin", split.c_str(), index);
  return (fs::path(dir) / name).string();
}

// Writes tokens [begin, end) of the stream as `split` shards; returns how many.
int write_split(const std::vector<uint32_t>& stream, int64_t begin, int64_t end,
                const PrepareOptions& opt, const std::string& split, int64_t vocab) {
  int shards = 0;
  for (int64_t at = begin; at < end; at += opt.shard_tokens, ++shards) {
    const int64_t stop = std::min(end, at + opt.shard_tokens);
    const std::vector<uint32_t> part(stream.begin() + at, stream.begin() + stop);
    write_shard(shard_path(opt.out_dir, split, shards), part, vocab);
  }
  return shards;
}

std::string summary(const PrepareOptions& opt, const PrepareResult& r, size_t files,
                    int64_t documents, int64_t text_bytes, double seconds) {
  std::ostringstream s;
  s << "prepare: " << files << " file(s), " << documents << " document(s), " << text_bytes
    << " bytes -> " << r.train_tokens + r.val_tokens << " tokens (" << opt.tokenizer << ", vocab "
    << r.vocab_size << "): train " << r.train_tokens << " tokens in " << r.train_shards
    << " shard(s), val " << r.val_tokens << " tokens in " << r.val_shards << " shard(s) -> "
    << opt.out_dir << " (" << std::fixed;
  s.precision(1);
  s << seconds << " s)";
  return s.str();
}

}  // namespace

PrepareResult prepare_dataset(const PrepareOptions& opt, std::ostream& log) {
  const auto start = std::chrono::steady_clock::now();
  validate(opt);
  check_inputs(opt.inputs);
  make_dir(opt.out_dir);
  const std::unique_ptr<Tokenizer> tok = make_tokenizer(opt);

  int64_t text_bytes = 0, documents = 0;
  const std::vector<uint32_t> stream = encode_inputs(opt, *tok, text_bytes, documents);
  const auto total = static_cast<int64_t>(stream.size());
  const int64_t val = val_token_count(total, opt.val_fraction);

  PrepareResult r;
  r.vocab_size = tok->vocab_size();
  r.train_tokens = total - val;
  r.val_tokens = val;
  remove_stale_shards(opt.out_dir);
  r.train_shards = write_split(stream, 0, r.train_tokens, opt, "train", r.vocab_size);
  r.val_shards = write_split(stream, r.train_tokens, total, opt, "val", r.vocab_size);
  tok->save(opt.out_dir);

  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  log << summary(opt, r, opt.inputs.size(), documents, text_bytes, took.count()) << std::endl;
  return r;
}

}  // namespace moe
