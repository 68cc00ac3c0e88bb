// Append-only JSONL metrics with crash-consistent resume (see include/moe/metrics.hpp).
#include <filesystem>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "moe/error.hpp"
#include "moe/metrics.hpp"

namespace moe {

namespace {

// Drops the trainer's lines past resume_step (objects with an integer "step" above it) and
// unparseable lines (e.g. a half-written last line from a crash); keeps every other line,
// including objects without an integer "step" (a user's or another tool's notes).
void truncate_after(const std::string& path, int64_t resume_step) {
  std::ifstream in(path);
  if (!in) return;
  std::vector<std::string> keep;
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) continue;
    const auto step = j.find("step");
    const bool trainers = step != j.end() && step->is_number_integer();
    if (!trainers || step->get<int64_t>() <= resume_step) keep.push_back(line);
  }
  in.close();
  std::ofstream out(path, std::ios::trunc);
  for (const auto& l : keep) out << l << '\n';
}

}  // namespace

MetricsWriter::MetricsWriter(const std::string& path, int64_t resume_step) : path_(path) {
  const auto parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec) throw InputError(parent.string() + ": cannot create the directory: " + ec.message());
  if (resume_step >= 0)
    truncate_after(path, resume_step);
  else
    std::ofstream(path, std::ios::trunc);
  out_.open(path, std::ios::app);
  if (!out_) throw InputError("cannot open " + path + " for writing");
}

void MetricsWriter::write(const nlohmann::json& line) {
  out_ << line.dump() << '\n';
  out_.flush();
  if (!out_) throw InputError("writing " + path_ + " failed (disk full?)");
}

}  // namespace moe
