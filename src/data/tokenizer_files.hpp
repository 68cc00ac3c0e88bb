// The files of a tokenizer directory, private to src/data: what tokenizer_byte.cpp and
// tokenizer_spm.cpp both write when a tokenizer is saved.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace moe::tokenizer_files {

// The description every tokenizer directory holds; load_tokenizer reads it first.
constexpr const char* kTokenizerJson = "moe_tokenizer.json";

// Creates `dir` (and its parents) if missing, or throws InputError naming it.
void create_tokenizer_dir(const std::string& dir);

// Writes `text` to a temporary name, syncs it and renames it into place: a checkpoint that copies
// the tokenizer relies on the file being durable once save() returns.
void write_file_durably(const std::string& path, const std::string& text);

// Writes `j` (indented, newline-terminated) as dir/moe_tokenizer.json, durably.
void write_tokenizer_json(const std::string& dir, const nlohmann::json& j);

}  // namespace moe::tokenizer_files
