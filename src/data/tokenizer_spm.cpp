// The SentencePiece BPE tokenizer: training one on text files, loading a model file, and the
// Tokenizer interface over sentencepiece::SentencePieceProcessor.
//
// Training choices, and why:
// - identity normalization and no whitespace collapsing, so decode(encode(text)) == text exactly
//   (the default NFKC rule rewrites characters and folds runs of spaces and newlines);
// - byte_fallback with full character coverage: characters never seen in training (and the
//   newlines, which training never sees because it reads line by line) become byte pieces
//   instead of <unk>, so every input is representable;
// - whitespace-only pieces allowed, so indentation and ASCII art do not cost one token a space;
// - unk 0, bos 1, eos 2, no pad: EOS is what `prepare` appends after each document;
// - at most kMaxTrainingLines lines, sampled uniformly, which bounds training time on big corpora;
// - lines longer than kMaxPieceBytes cut into pieces of at most that (before a space where the
//   window's second half has one): SentencePiece skips longer sentences, so a corpus of long
//   paragraphs (or of documents without newlines) trained on a fraction of its text, or failed
//   with an internal "!sentences_.empty()" when every line was longer.
// Training leaves tokenizer.model and tokenizer.vocab in its work directory; the model is then
// kept in memory as its serialized proto, which is what save() writes.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "data/tokenizer_files.hpp"
#include "moe/error.hpp"
#include "moe/tokenizer.hpp"

namespace moe {

namespace {

namespace fs = std::filesystem;

constexpr int kMaxTrainingLines = 2'000'000;
constexpr int kTrainThreads = 2;
// The longest training sentence, passed as SentencePiece's max_sentence_length (default 4192).
constexpr size_t kMaxPieceBytes = 4096;
// Training writes <prefix>.model (the same bytes save() writes) and <prefix>.vocab, the pieces
// with their scores, which is worth keeping for inspection.
constexpr const char* kModelPrefix = "tokenizer";
constexpr const char* kModelFile = "tokenizer.model";
// SentencePiece's own log level while training: 2 keeps errors, drops its INFO/WARNING chatter.
constexpr const char* kQuietLogLevel = "2";

class SpmTokenizer : public Tokenizer {
 public:
  // `source` names where the model came from, for error messages.
  SpmTokenizer(std::string serialized, const std::string& source)
      : serialized_(std::move(serialized)) {
    const auto status = sp_.LoadFromSerializedProto(serialized_);
    if (!status.ok())
      throw InputError(source + ": not a SentencePiece model: " + status.ToString());
  }
  std::vector<uint32_t> encode(const std::string& text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    if (!status.ok()) throw InputError("SentencePiece encode failed: " + status.ToString());
    return std::vector<uint32_t>(ids.begin(), ids.end());
  }
  std::string decode(const std::vector<uint32_t>& ids) const override {
    std::vector<int> sp_ids(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] >= static_cast<uint32_t>(vocab_size()))
        throw InputError("SentencePiece tokenizer: token id " + std::to_string(ids[i]) +
                         " is outside the vocabulary of " + std::to_string(vocab_size()));
      sp_ids[i] = static_cast<int>(ids[i]);
    }
    std::string text;
    const auto status = sp_.Decode(sp_ids, &text);
    if (!status.ok()) throw InputError("SentencePiece decode failed: " + status.ToString());
    return text;
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  int64_t eos_id() const override { return sp_.eos_id(); }  // -1 when the model has none
  std::string type() const override { return "spm"; }
  void save(const std::string& dir) const override {
    tokenizer_files::create_tokenizer_dir(dir);
    tokenizer_files::write_file_durably((fs::path(dir) / kModelFile).string(), serialized_);
    tokenizer_files::write_tokenizer_json(
        dir, {{"type", "spm"}, {"model", kModelFile}, {"vocab_size", vocab_size()}});
  }

 private:
  std::string serialized_;
  sentencepiece::SentencePieceProcessor sp_;
};

// Feeds the training text to SentencePiece line by line, one file after another, without
// holding the corpus in memory; a line longer than kMaxPieceBytes goes in pieces.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::vector<std::string>& files) : files_(files) { advance(); }
  bool done() const override { return done_; }
  void Next() override { advance(); }
  const std::string& value() const override { return piece_; }
  sentencepiece::util::Status status() const override { return status_; }

 private:
  void advance() {
    while (!done_) {
      if (taken_ < line_.size()) {
        take_piece();
        return;
      }
      if (in_.is_open() && std::getline(in_, line_)) {
        taken_ = 0;  // an empty line is skipped by the loop
        continue;
      }
      if (in_.is_open() && in_.bad()) {
        fail(files_[next_file_ - 1]);
        return;
      }
      in_.close();
      if (next_file_ == files_.size()) {
        done_ = true;
        return;
      }
      in_.open(files_[next_file_++], std::ios::binary);
      if (!in_) fail(files_[next_file_ - 1]);
    }
  }
  // The next piece of the line: the rest when it fits, else a cut before the window's last space
  // (SentencePiece joins a space to the word after it) when that keeps half the window, else
  // before a UTF-8 lead byte so no character is split.
  void take_piece() {
    size_t n = std::min(kMaxPieceBytes, line_.size() - taken_);
    if (taken_ + n < line_.size()) {
      const size_t space = line_.rfind(' ', taken_ + n - 1);
      if (space != std::string::npos && space >= taken_ + n / 2)
        n = space - taken_;
      else
        while (n > 1 && (static_cast<unsigned char>(line_[taken_ + n]) & 0xC0) == 0x80) --n;
    }
    piece_.assign(line_, taken_, n);
    taken_ += n;
  }
  void fail(const std::string& file) {
    status_ = sentencepiece::util::Status(sentencepiece::util::StatusCode::kInternal,
                                          file + ": cannot read");
    done_ = true;
  }

  const std::vector<std::string>& files_;
  size_t next_file_ = 0;
  std::ifstream in_;
  std::string line_;   // the current line
  size_t taken_ = 0;   // its bytes already given out
  std::string piece_;  // the value() now
  bool done_ = false;
  sentencepiece::util::Status status_;
};

std::unordered_map<std::string, std::string> trainer_args(int vocab_size,
                                                          const std::string& work_dir) {
  return {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(vocab_size)},
      {"model_prefix", (fs::path(work_dir) / kModelPrefix).string()},
      {"byte_fallback", "true"},
      {"character_coverage", "1.0"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"input_sentence_size", std::to_string(kMaxTrainingLines)},
      {"max_sentence_length", std::to_string(kMaxPieceBytes)},
      {"shuffle_input_sentence", "true"},
      {"num_threads", std::to_string(kTrainThreads)},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"minloglevel", kQuietLogLevel},
  };
}

void check_readable(const std::vector<std::string>& files) {
  if (files.empty()) throw InputError("SentencePiece training needs at least one text file");
  for (const auto& f : files) {
    std::error_code ec;
    if (!fs::exists(f, ec)) throw InputError(f + ": cannot read: no such file");
    if (!fs::is_regular_file(f, ec)) throw InputError(f + ": cannot read: not a regular file");
    if (!std::ifstream(f, std::ios::binary)) throw InputError(f + ": cannot read (permissions?)");
  }
}

}  // namespace

std::unique_ptr<Tokenizer> train_spm_tokenizer(const std::vector<std::string>& inputs,
                                               int vocab_size, const std::string& work_dir) {
  check_readable(inputs);
  std::error_code ec;
  fs::create_directories(work_dir, ec);
  if (ec) throw InputError(work_dir + ": cannot create the directory: " + ec.message());
  LineIterator lines(inputs);
  const auto status =
      sentencepiece::SentencePieceTrainer::Train(trainer_args(vocab_size, work_dir), &lines);
  if (!status.ok())
    throw InputError("SentencePiece training on " + std::to_string(inputs.size()) +
                     " file(s) (first: " + inputs.front() + ") failed: " + status.ToString());
  return load_spm_model((fs::path(work_dir) / kModelFile).string());
}

std::unique_ptr<Tokenizer> load_spm_model(const std::string& model_path) {
  std::ifstream in(model_path, std::ios::binary);
  if (!in) throw InputError(model_path + ": cannot read the SentencePiece model (missing?)");
  std::stringstream bytes;
  bytes << in.rdbuf();
  return std::make_unique<SpmTokenizer>(bytes.str(), model_path);
}

}  // namespace moe
