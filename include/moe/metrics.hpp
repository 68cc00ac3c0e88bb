// metrics.jsonl: one JSON object per line, appended and flushed as the run goes, so a crash
// loses nothing already logged. Lines carry "kind": "train" (a logged step) or "eval".
#pragma once
#include <cstdint>
#include <fstream>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace moe {

class MetricsWriter {
 public:
  // Opens `path` for appending. When resuming from `resume_step`, lines of later steps (written
  // by the interrupted run after its last checkpoint) are dropped first; resume_step < 0 starts
  // a fresh file.
  MetricsWriter(const std::string& path, int64_t resume_step);
  void write(const nlohmann::json& line);

 private:
  std::string path_;
  std::ofstream out_;
};

}  // namespace moe
