// `prepare`: text files become train/val shards that hold exactly the encoded documents (each
// followed by EOS) in order, split at the val fraction, with the tokenizer saved beside them.
// The fortunes case (hidden: run with "[fortunes]") times the README's default corpus.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch.hpp"
#include "moe/error.hpp"
#include "moe/rng.hpp"
#include "moe/shards.hpp"
#include "moe/tokenizer.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;
namespace fs = std::filesystem;

namespace {

// English-like lines from small word lists (as in test_tokenizer.cpp).
std::string generated_corpus(int lines, uint64_t seed) {
  static const std::vector<std::string> words = {
      "the",      "quick",    "lazy",      "fox",     "dog",      "teacher", "river",
      "mountain", "computer", "garden",    "village", "painter",  "student", "remembers",
      "builds",   "follows",  "describes", "visits",  "explains", "every",   "morning",
      "without",  "a",        "word",      "and",     "then",     "sleeps",  "ocean"};
  Rng rng(seed);
  std::string text;
  for (int i = 0; i < lines; ++i) {
    std::string line = "The";
    const int n = 5 + static_cast<int>(rng.below(8));
    for (int w = 0; w < n; ++w) line += " " + words[rng.below(words.size())];
    text += line + (rng.below(2) ? ".\n" : "!\n");
  }
  return text;
}

// All tokens of the shards a glob names, in file order.
std::vector<uint32_t> read_split(const std::string& pattern, int expect_shards) {
  const auto files = expand_glob(pattern);
  CHECK(static_cast<int>(files.size()) == expect_shards);
  std::vector<uint32_t> tokens;
  for (const auto& f : files) {
    Shard s(f);
    for (int64_t i = 0; i < s.size(); ++i) tokens.push_back(s.at(i));
  }
  return tokens;
}

// The stream prepare should produce: each document encoded, then EOS.
std::vector<uint32_t> expected_stream(const Tokenizer& tok, const std::vector<std::string>& docs) {
  std::vector<uint32_t> stream;
  for (const auto& d : docs) {
    const auto ids = tok.encode(d);
    stream.insert(stream.end(), ids.begin(), ids.end());
    stream.push_back(static_cast<uint32_t>(tok.eos_id()));
  }
  return stream;
}

// Checks the shards in `out` against the expected stream and the reported counts.
void check_output(const std::string& out, const PrepareResult& r,
                  const std::vector<uint32_t>& expected) {
  const auto train = read_split(out + "/train_*.bin", r.train_shards);
  const auto val = read_split(out + "/val_*.bin", r.val_shards);
  CHECK(static_cast<int64_t>(train.size()) == r.train_tokens);
  CHECK(static_cast<int64_t>(val.size()) == r.val_tokens);
  CHECK(r.train_tokens + r.val_tokens == static_cast<int64_t>(expected.size()));
  std::vector<uint32_t> all(train);
  all.insert(all.end(), val.begin(), val.end());
  CHECK(all == expected);
}

}  // namespace

TEST_CASE("prepare with the byte tokenizer", "[prepare]") {
  TempDir dir;
  const std::vector<std::string> docs = {"first document\n", "second, with ünïcode ✓\n",
                                         std::string("third\0binary", 12)};
  std::vector<std::string> inputs;
  for (size_t i = 0; i < docs.size(); ++i) {
    inputs.push_back(dir.file("doc" + std::to_string(i) + ".txt"));
    write_text(inputs.back(), docs[i]);
  }
  PrepareOptions opt;
  opt.inputs = inputs;
  opt.out_dir = dir.file("out");
  opt.val_fraction = 0.2;
  opt.shard_tokens = 16;
  std::ostringstream log;
  const PrepareResult r = prepare_dataset(opt, log);
  INFO(log.str());
  CHECK(contains(log.str(), "prepare:"));
  CHECK(r.vocab_size == 257);
  const auto tok = load_tokenizer(opt.out_dir);
  CHECK(tok->type() == "byte");
  const auto expected = expected_stream(*tok, docs);
  const int64_t total = static_cast<int64_t>(docs[0].size() + docs[1].size() + docs[2].size()) + 3;
  REQUIRE(static_cast<int64_t>(expected.size()) == total);
  CHECK(r.val_tokens == std::llround(0.2 * static_cast<double>(total)));
  CHECK(r.train_shards == static_cast<int>((r.train_tokens + 15) / 16));
  CHECK(r.train_shards > 1);
  CHECK(r.val_shards == 1);
  check_output(opt.out_dir, r, expected);

  // A second run into the same directory replaces the shards instead of mixing old ones in.
  opt.shard_tokens = 1000;
  const PrepareResult again = prepare_dataset(opt, log);
  CHECK(again.train_shards == 1);
  check_output(opt.out_dir, again, expected);
}

TEST_CASE("prepare with a trained SentencePiece tokenizer", "[prepare][spm]") {
  TempDir dir;
  const std::vector<std::string> docs = {generated_corpus(250, 1), generated_corpus(150, 2)};
  const std::vector<std::string> inputs = {dir.file("a.txt"), dir.file("b.txt")};
  write_text(inputs[0], docs[0]);
  write_text(inputs[1], docs[1]);
  PrepareOptions opt;
  opt.inputs = inputs;
  opt.tokenizer = "spm";
  opt.vocab_size = 320;
  opt.out_dir = dir.file("out");
  opt.val_fraction = 0.1;
  opt.shard_tokens = 2000;
  std::ostringstream log;
  const PrepareResult r = prepare_dataset(opt, log);
  INFO(log.str());
  CHECK(r.vocab_size == 320);
  REQUIRE(has_tokenizer(opt.out_dir));
  const auto tok = load_tokenizer(opt.out_dir);
  CHECK(tok->type() == "spm");
  CHECK(tok->vocab_size() == 320);
  const auto expected = expected_stream(*tok, docs);
  CHECK(r.train_shards == static_cast<int>((r.train_tokens + 1999) / 2000));
  check_output(opt.out_dir, r, expected);
  for (const auto& d : docs) CHECK(tok->decode(tok->encode(d)) == d);

  // An existing model is used as is: the same tokens again.
  PrepareOptions reuse = opt;
  reuse.spm_model = opt.out_dir + "/tokenizer.model";
  reuse.out_dir = dir.file("reuse");
  const PrepareResult r2 = prepare_dataset(reuse, log);
  check_output(reuse.out_dir, r2, expected);
}

TEST_CASE("prepare rejects bad inputs with a clear message", "[prepare]") {
  TempDir dir;
  write_text(dir.file("ok.txt"), "some text that is long enough");
  PrepareOptions opt;
  opt.out_dir = dir.file("out");
  std::ostringstream log;
  SECTION("an unreadable input names the file") {
    opt.inputs = {dir.file("ok.txt"), dir.file("missing.txt")};
    const std::string msg = input_error_of([&] { prepare_dataset(opt, log); });
    CHECK(contains(msg, dir.file("missing.txt")));
  }
  SECTION("a corpus too small for train and val") {
    write_text(dir.file("one.txt"), "x");  // 1 byte + EOS
    opt.inputs = {dir.file("one.txt")};
    const std::string msg = input_error_of([&] { prepare_dataset(opt, log); });
    CHECK(contains(msg, "too small"));
  }
  SECTION("bad options") {
    opt.inputs = {dir.file("ok.txt")};
    opt.tokenizer = "wordpiece";
    CHECK_THROWS_AS(prepare_dataset(opt, log), InputError);
    opt.tokenizer = "byte";
    opt.val_fraction = 0;
    CHECK_THROWS_AS(prepare_dataset(opt, log), InputError);
    opt.val_fraction = 0.5;
    opt.inputs.clear();
    CHECK_THROWS_AS(prepare_dataset(opt, log), InputError);
  }
}

TEST_CASE("prepare reads JSON Lines files: one document a line", "[prepare]") {
  TempDir dir;
  // Escapes, non-ASCII text, a blank line, an empty document (skipped), other keys, CRLF.
  const std::string jsonl =
      "{\"text\": \"first line\\nsecond line\", \"id\": 1}\n"
      "\n"
      "{\"id\": 2, \"text\": \"ünïcode ✓ \\\"quoted\\\"\"}\r\n"
      "{\"text\": \"\"}\n"
      "  {\"text\": \"last\"}";
  const std::vector<std::string> jsonl_docs = {"first line\nsecond line", "ünïcode ✓ \"quoted\"",
                                               "last"};
  write_text(dir.file("a.jsonl"), jsonl);
  write_text(dir.file("b.txt"), "a plain text file\n");
  PrepareOptions opt;
  opt.inputs = {dir.file("a.jsonl"), dir.file("b.txt")};
  opt.out_dir = dir.file("out");
  opt.val_fraction = 0.2;
  std::ostringstream log;
  PrepareResult r = prepare_dataset(opt, log);
  INFO(log.str());
  CHECK(contains(log.str(), "2 file(s), 4 document(s)"));
  const auto tok = load_tokenizer(opt.out_dir);
  std::vector<std::string> docs = jsonl_docs;
  docs.push_back("a plain text file\n");
  check_output(opt.out_dir, r, expected_stream(*tok, docs));

  SECTION("--format text reads the .jsonl file whole, as one document") {
    opt.format = "text";
    r = prepare_dataset(opt, log);
    check_output(opt.out_dir, r, expected_stream(*tok, {jsonl, "a plain text file\n"}));
  }
  SECTION("--format jsonl reads every input as JSON Lines, under another key") {
    write_text(dir.file("c.txt"), "{\"content\": \"x y z\"}\n{\"content\": \"w\"}\n");
    opt.inputs = {dir.file("c.txt")};
    opt.format = "jsonl";
    opt.jsonl_key = "content";
    r = prepare_dataset(opt, log);
    check_output(opt.out_dir, r, expected_stream(*tok, {"x y z", "w"}));
  }
}

TEST_CASE("prepare trains SentencePiece on the text of JSON Lines documents", "[prepare][spm]") {
  TempDir dir;
  std::vector<std::string> docs;
  std::string jsonl;
  for (int i = 0; i < 60; ++i) {
    docs.push_back(generated_corpus(5, 100 + static_cast<uint64_t>(i)));
    jsonl += nlohmann::json{{"id", i}, {"text", docs.back()}}.dump() + "\n";
  }
  write_text(dir.file("docs.jsonl"), jsonl);
  PrepareOptions opt;
  opt.inputs = {dir.file("docs.jsonl")};
  opt.tokenizer = "spm";
  opt.vocab_size = 300;
  opt.out_dir = dir.file("out");
  opt.val_fraction = 0.1;
  std::ostringstream log;
  const PrepareResult r = prepare_dataset(opt, log);
  INFO(log.str());
  const auto tok = load_tokenizer(opt.out_dir);
  check_output(opt.out_dir, r, expected_stream(*tok, docs));
  for (const auto& d : docs) CHECK(tok->decode(tok->encode(d)) == d);
  // Trained on the documents, not on the JSON around them: the documents hold no quote, brace or
  // colon, so no learned piece (longer than the one byte of a byte-fallback piece) does; trained
  // on the raw lines, pieces such as "text": would.
  int json_pieces = 0;
  for (int64_t id = 0; id < tok->vocab_size(); ++id) {
    const std::string piece = tok->decode({static_cast<uint32_t>(id)});
    if (piece.size() > 1 && piece.find_first_of("\"{}:") != std::string::npos) ++json_pieces;
  }
  CHECK(json_pieces == 0);
  CHECK(tok->encode("\"text\":").size() > 2);  // (holds either way; the count above decides)
  // The text handed to SentencePiece is gone.
  CHECK_FALSE(fs::exists(opt.out_dir + "/.prepare_spm_text.txt"));
}

TEST_CASE("prepare names the file and line of a bad JSON line", "[prepare]") {
  TempDir dir;
  PrepareOptions opt;
  opt.out_dir = dir.file("out");
  std::ostringstream log;
  const std::string path = dir.file("bad.jsonl");
  const auto error_for = [&](const std::string& second_line) {
    write_text(path, "{\"text\": \"fine\"}\n" + second_line + "\n");
    opt.inputs = {path};
    return input_error_of([&] { prepare_dataset(opt, log); });
  };
  CHECK(contains(error_for("{\"text\": \"cut"), path + ":2: not a JSON line"));
  CHECK(contains(error_for("[\"text\"]"), path + ":2: not a JSON object"));
  CHECK(contains(error_for("{\"body\": \"x\"}"), path + ":2: no \"text\""));
  CHECK(contains(error_for("{\"text\": 7}"), path + ":2: \"text\" is not a string"));
  // Documents without text, for SentencePiece to train on: said so, naming the input.
  write_text(path, "{\"text\": \"\"}\n\n{\"text\": \"\"}\n");
  opt.inputs = {path};
  opt.tokenizer = "spm";
  CHECK(contains(input_error_of([&] { prepare_dataset(opt, log); }), path + ") hold no text"));
  opt.tokenizer = "byte";
  opt.jsonl_key = "body";  // the key asked for, named
  CHECK(contains(error_for("{\"text\": \"x\"}"), path + ":1: no \"body\""));
  // A key or format that no input would use is refused, not ignored.
  write_text(dir.file("plain.txt"), "some text that is long enough");
  opt.inputs = {dir.file("plain.txt")};
  CHECK(contains(input_error_of([&] { prepare_dataset(opt, log); }), "--jsonl-key"));
  opt.jsonl_key.clear();
  opt.format = "csv";
  CHECK(contains(input_error_of([&] { prepare_dataset(opt, log); }), "csv"));
}

// The README's default corpus: every plain-text fortune file, SentencePiece vocab 4000.
TEST_CASE("prepare the fortunes corpus with spm 4000", "[.][fortunes]") {
  const std::string root = "/usr/share/games/fortunes";
  if (!fs::is_directory(root)) return;
  std::vector<std::string> inputs;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().string();
    if (e.is_regular_file() && !e.is_symlink() && e.path().extension() != ".dat" &&
        e.path().extension() != ".u8")
      inputs.push_back(name);
  }
  std::sort(inputs.begin(), inputs.end());
  TempDir dir;
  PrepareOptions opt;
  opt.inputs = inputs;
  opt.tokenizer = "spm";
  opt.vocab_size = 4000;
  opt.out_dir = dir.file("fortunes");
  const auto start = std::chrono::steady_clock::now();
  const PrepareResult r = prepare_dataset(opt, std::cout);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  std::cout << inputs.size() << " files, " << took.count() << " s\n";
  CHECK(r.vocab_size == 4000);
  CHECK(took.count() < 60);
}
