// The run directory probe (see run_dir_probe.hpp).
#include "train/run_dir_probe.hpp"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "moe/rng.hpp"

namespace moe {

namespace fs = std::filesystem;

namespace {

constexpr const char* kTokenFile = ".moe-train-ranks-probe";

// A token no earlier run left behind: the random device and the clock.
std::string fresh_token() {
  std::random_device rd;
  const uint64_t now =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const uint64_t v = (uint64_t{rd()} << 32 | rd()) ^ hash_name(std::to_string(now), 7);
  char text[24];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(v));
  return text;
}

// Writes `text` to `path` (replacing it); "" or the error.
std::string write_text(const std::string& path, const std::string& text) {
  errno = 0;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (f) f << text;
  if (f) f.close();
  if (!f) return errno != 0 ? std::strerror(errno) : "write failed";
  return "";
}

}  // namespace

RunDirProbe::RunDirProbe(Comm& comm, const std::string& dir) {
  std::error_code ec;
  fs::path where = fs::absolute(dir, ec);  // (absolute: the messages say which directory)
  if (ec) where = dir;
  const std::string token_path = (where / kTokenFile).string();
  const std::string rank = std::to_string(comm.rank());
  if (comm.rank() == 0) {
    const std::string token = fresh_token();
    if (write_text(token_path, token).empty()) token_file_ = token_path;
  }  // (a failure shows below: rank 0 cannot write its own file either)
  comm.barrier();
  // This rank's own file: can it write here?
  const std::string own = (where / (std::string(kTokenFile) + ".rank" + rank)).string();
  const std::string error = write_text(own, "");
  fs::remove(own, ec);
  if (!error.empty()) {
    seen_ = "not writable by rank " + rank + " (cannot create " + own + ": " + error + ")";
    return;
  }
  // Rank 0's token (a directory of this rank's own holds none, or an earlier run's).
  std::ifstream in(token_path, std::ios::binary);
  std::string token;
  if (!std::getline(in, token))
    seen_ = "not the directory rank 0 wrote into (rank " + rank + " finds no " + token_path + ")";
  else
    seen_ = "the one holding start-up token " + token;
}

RunDirProbe::~RunDirProbe() {
  if (token_file_.empty()) return;
  std::error_code ec;
  fs::remove(token_file_, ec);
}

}  // namespace moe
