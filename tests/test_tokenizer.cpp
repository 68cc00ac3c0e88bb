// Tokenizers: the byte tokenizer round-trips any bytes; a SentencePiece BPE model trained on a
// small generated corpus round-trips text exactly (including characters it never saw) and
// survives save/load; tokenizer directories that are missing or corrupt fail with the file named.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "moe/error.hpp"
#include "moe/rng.hpp"
#include "moe/tokenizer.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;
using namespace std::string_literals;
namespace fs = std::filesystem;

namespace {

// English-like lines from small word lists: enough distinct text for a few hundred BPE pieces.
std::string generated_corpus(int lines, uint64_t seed) {
  static const std::vector<std::string> adjectives = {
      "quick", "lazy",   "happy", "silent",   "bright", "ancient", "curious", "gentle",
      "brave", "clever", "tiny",  "enormous", "yellow", "purple",  "wooden",  "frozen"};
  static const std::vector<std::string> nouns = {
      "fox",    "dog",     "teacher", "river",   "mountain", "computer",
      "garden", "village", "painter", "student", "kingdom",  "library",
      "ocean",  "engine",  "window",  "forest",  "question"};
  static const std::vector<std::string> verbs = {"jumps over", "watches",   "remembers", "builds",
                                                 "follows",    "describes", "visits",    "explains",
                                                 "paints",     "discovers", "carries",   "answers"};
  static const std::vector<std::string> endings = {".",
                                                   " quickly.",
                                                   " every morning.",
                                                   " without a word.",
                                                   ", and then sleeps.",
                                                   "!",
                                                   " in the evening.",
                                                   "?"};
  Rng rng(seed);
  auto pick = [&](const std::vector<std::string>& words) { return words[rng.below(words.size())]; };
  std::string text;
  for (int i = 0; i < lines; ++i) {
    std::string line = "The " + pick(adjectives) + " " + pick(nouns) + " " + pick(verbs) + " the " +
                       pick(adjectives) + " " + pick(nouns) + pick(endings);
    text += line + "\n";
  }
  return text;
}

}  // namespace

TEST_CASE("the byte tokenizer round-trips arbitrary bytes", "[tokenizer]") {
  const auto tok = make_byte_tokenizer();
  CHECK(tok->type() == "byte");
  CHECK(tok->vocab_size() == 257);
  CHECK(tok->eos_id() == 256);
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes.push_back(static_cast<char>(b));
  const std::string utf8 = u8"héllo, wörld ✓ 日本語";
  const std::string with_nul("a\0b\0\0c", 6);
  for (const std::string& text : {all_bytes, utf8, with_nul, std::string()}) {
    const auto ids = tok->encode(text);
    REQUIRE(ids.size() == text.size());
    for (size_t i = 0; i < ids.size(); ++i) CHECK(ids[i] == static_cast<unsigned char>(text[i]));
    CHECK(tok->decode(ids) == text);
  }
  CHECK(tok->decode({104, 256, 105}) == "hi");  // EOS has no text
  CHECK_THROWS_AS(tok->decode({257}), InputError);

  TempDir dir;
  const std::string saved = dir.file("tok");
  CHECK(!has_tokenizer(saved));
  tok->save(saved);
  CHECK(has_tokenizer(saved));
  const auto loaded = load_tokenizer(saved);
  CHECK(loaded->type() == "byte");
  CHECK(loaded->vocab_size() == 257);
  CHECK(loaded->encode(utf8) == tok->encode(utf8));
}

TEST_CASE("a trained SentencePiece BPE tokenizer round-trips text", "[tokenizer][spm]") {
  TempDir dir;
  const std::string corpus_a = generated_corpus(300, 1), corpus_b = generated_corpus(200, 2);
  write_text(dir.file("a.txt"), corpus_a);
  write_text(dir.file("b.txt"), corpus_b);
  const int vocab = 400;
  const auto tok =
      train_spm_tokenizer({dir.file("a.txt"), dir.file("b.txt")}, vocab, dir.file("work"));
  CHECK(tok->type() == "spm");
  CHECK(tok->vocab_size() == vocab);
  CHECK(tok->eos_id() == 2);

  // Training text, text with characters it never saw (byte fallback), and whitespace that a
  // normalizing tokenizer would fold.
  const std::string unseen = "Zebra! ünïcode ✓ 日本 \t tab\n\nnew  lines   and spaces \0 end"s;
  for (const std::string& text :
       {corpus_a, corpus_b, unseen, std::string(" leading space"), std::string()}) {
    const auto ids = tok->encode(text);
    for (uint32_t id : ids) REQUIRE(id < static_cast<uint32_t>(vocab));
    CHECK(tok->decode(ids) == text);
  }
  // BPE actually merged: far fewer tokens than bytes on text like its training data.
  CHECK(tok->encode(corpus_a).size() * 2 < corpus_a.size());

  const std::string saved = dir.file("saved");
  tok->save(saved);
  CHECK(fs::exists(dir.file("saved/tokenizer.model")));
  const auto loaded = load_tokenizer(saved);
  CHECK(loaded->type() == "spm");
  CHECK(loaded->vocab_size() == vocab);
  CHECK(loaded->eos_id() == 2);
  CHECK(loaded->encode(corpus_b) == tok->encode(corpus_b));
  CHECK(loaded->encode(unseen) == tok->encode(unseen));
  CHECK(load_spm_model(dir.file("saved/tokenizer.model"))->encode(unseen) == tok->encode(unseen));

  // A vocabulary the corpus cannot fill is the user's mistake, reported as such.
  const std::string msg =
      input_error_of([&] { train_spm_tokenizer({dir.file("a.txt")}, 50000, dir.file("work")); });
  INFO(msg);
  CHECK(contains(msg, dir.file("a.txt")));
}

// SentencePiece skips sentences longer than its max_sentence_length: a corpus of lines longer than
// that (documents without newlines) failed with an internal "!sentences_.empty()". The trainer's
// line reader cuts them (before a space, or between UTF-8 characters where a line has none).
TEST_CASE("SentencePiece trains on lines far longer than its sentence limit", "[tokenizer][spm]") {
  TempDir dir;
  std::string words = generated_corpus(2000, 3);
  for (char& c : words)
    if (c == '\n') c = ' ';
  REQUIRE(words.size() > 50'000);
  std::string cjk;  // 3-byte characters, no space: the cut must fall between characters
  while (cjk.size() < 20'000) cjk += u8"日本語の文章";
  write_text(dir.file("long.txt"), words + "\n" + cjk);
  const auto tok = train_spm_tokenizer({dir.file("long.txt")}, 600, dir.file("work"));
  CHECK(tok->vocab_size() == 600);
  for (const std::string& text : {words, cjk}) {
    const auto ids = tok->encode(text);
    CHECK(tok->decode(ids) == text);
    // Merged from the long lines: far fewer tokens than bytes (the CJK line's pieces were cut
    // between characters, so its characters and their pairs were learned, not byte-fallen back).
    INFO(ids.size() << " tokens for " << text.size() << " bytes");
    CHECK(ids.size() * 3 < text.size());
  }
}

TEST_CASE("missing or corrupt tokenizers throw InputError naming the file", "[tokenizer]") {
  TempDir dir;
  std::string msg, named;
  SECTION("missing directory") {
    named = dir.file("nowhere/moe_tokenizer.json");
    msg = input_error_of([&] { load_tokenizer(dir.file("nowhere")); });
  }
  SECTION("moe_tokenizer.json is not JSON") {
    named = dir.file("moe_tokenizer.json");
    write_text(named, "{\"type\": \"byte\"");
    msg = input_error_of([&] { load_tokenizer(dir.path.string()); });
  }
  SECTION("unknown type") {
    named = dir.file("moe_tokenizer.json");
    write_text(named, "{\"type\": \"wordpiece\"}");
    msg = input_error_of([&] { load_tokenizer(dir.path.string()); });
    CHECK(contains(msg, "wordpiece"));
  }
  SECTION("no type") {
    named = dir.file("moe_tokenizer.json");
    write_text(named, "{\"model\": \"x\"}");
    msg = input_error_of([&] { load_tokenizer(dir.path.string()); });
  }
  SECTION("spm model file missing") {
    write_text(dir.file("moe_tokenizer.json"),
               "{\"type\": \"spm\", \"model\": \"tokenizer.model\"}");
    named = dir.file("tokenizer.model");
    msg = input_error_of([&] { load_tokenizer(dir.path.string()); });
  }
  SECTION("spm model file corrupt") {
    write_text(dir.file("moe_tokenizer.json"),
               "{\"type\": \"spm\", \"model\": \"tokenizer.model\"}");
    named = dir.file("tokenizer.model");
    write_text(named, "this is not a protobuf");
    msg = input_error_of([&] { load_tokenizer(dir.path.string()); });
  }
  SECTION("training input missing") {
    named = dir.file("absent.txt");
    msg = input_error_of([&] { train_spm_tokenizer({named}, 300, dir.path.string()); });
  }
  INFO(msg);
  CHECK(contains(msg, named));
}
