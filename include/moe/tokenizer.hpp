// Tokenizers: byte-level (built in: ids 0-255 are the bytes and 256 is EOS, so vocab 257) and
// SentencePiece BPE (the system's library; unk 0, bos 1, eos 2 when trained here).
// A tokenizer lives in a directory as `moe_tokenizer.json` (our small description: {"type": "byte"}
// or {"type": "spm", "model": "tokenizer.model", "vocab_size": N}) plus, for spm, the
// SentencePiece model file `tokenizer.model`.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moe {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<uint32_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<uint32_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  // End-of-document token appended after each input document by `prepare` (-1 = none).
  virtual int64_t eos_id() const = 0;
  virtual std::string type() const = 0;
  // Writes moe_tokenizer.json (+ tokenizer.model for spm) into `dir` (created if needed).
  virtual void save(const std::string& dir) const = 0;
};

// Loads the tokenizer saved in `dir`; throws InputError naming the file when missing or corrupt.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir);
// True when `dir` holds a moe_tokenizer.json.
bool has_tokenizer(const std::string& dir);
std::unique_ptr<Tokenizer> make_byte_tokenizer();
// Trains a SentencePiece BPE model of `vocab_size` on the text files (read line by line, at most
// 2M lines sampled); leaves tokenizer.model and tokenizer.vocab in `work_dir`. Text round-trips
// exactly (identity normalization, byte fallback). Throws InputError for unreadable inputs or a
// vocabulary the corpus cannot fill.
std::unique_ptr<Tokenizer> train_spm_tokenizer(const std::vector<std::string>& inputs,
                                               int vocab_size, const std::string& work_dir);
// Loads an existing SentencePiece model file.
std::unique_ptr<Tokenizer> load_spm_model(const std::string& model_path);

// `moe-train prepare`: tokenizes the input files' documents (a text file is one document, a JSON
// Lines file one a line: src/data/documents.hpp), each followed by EOS when the tokenizer has
// one, and writes DIR/train_NNNNNN.bin and DIR/val_NNNNNN.bin shards of at
// most shard_tokens tokens (the last val_fraction of the token stream goes to val, at least 2
// tokens in each split) plus the tokenizer. Shards of an earlier run in DIR are replaced. Throws
// InputError naming an unreadable input, or when the corpus is too small for both splits.
// Prints a one-line summary to `log`.
struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string tokenizer = "byte";  // byte | spm
  std::string spm_model;           // existing SentencePiece model for spm (empty = train one)
  int vocab_size = 0;              // spm only (0 = 8000)
  std::string out_dir;
  double val_fraction = 0.05;
  int64_t shard_tokens = 100'000'000;
  std::string format = "auto";  // auto (.jsonl files as JSON Lines) | text | jsonl
  std::string jsonl_key;        // the JSON Lines key of each document's text (empty = "text")
};
struct PrepareResult {
  int64_t train_tokens = 0, val_tokens = 0;
  int train_shards = 0, val_shards = 0;
  int64_t vocab_size = 0;
};
PrepareResult prepare_dataset(const PrepareOptions& opt, std::ostream& log);

}  // namespace moe
