// The documents of `prepare`'s inputs. A plain text file is one document. A JSON Lines file (one
// JSON object a line, as datasets are commonly dumped: {"text": "...", "id": ...}) holds one
// document a non-blank line: the string under the key (default "text"). A file is read as JSON
// Lines when its name ends in .jsonl (format "auto"), or when the format says so for every file.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace moe {

struct DocumentFormat {
  std::string format = "auto";  // auto | text | jsonl
  std::string jsonl_key;        // empty = "text"
};

// Whether `path` is read as JSON Lines under `f`.
bool reads_as_jsonl(const std::string& path, const DocumentFormat& f);

// Calls fn(document) for each document of `path` in order; returns the bytes of text handed to
// fn. InputError naming the file and line for a line that is not a JSON object with a string
// under the key. Empty documents are skipped.
int64_t for_each_document(const std::string& path, const DocumentFormat& f,
                          const std::function<void(const std::string&)>& fn);

// InputError for a format other than auto, text or jsonl, or a jsonl_key that no input uses
// (the run would silently not be the one asked for).
void check_document_format(const DocumentFormat& f, const std::vector<std::string>& inputs);

}  // namespace moe
