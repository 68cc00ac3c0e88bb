// Whether every data-parallel rank writes into the same run directory. Each rank writes its own
// state file into rank 0's step directory at a save, so on several nodes train.out_dir must be
// on a filesystem they share; a rank that sees a directory of its own (a node-local path, a
// relative path from another working directory) or cannot write there made every checkpoint
// incomplete or failed at the first save, hours in. At start-up rank 0 writes a token file
// into the directory, a barrier, then every rank creates and removes a file of its own there
// and reads rank 0's token back: what it found is one of the facts the ranks compare
// (rank_agreement.hpp), the same text on every rank exactly when all can write and all see
// rank 0's token.
#pragma once
#include <string>

#include "moe/comm.hpp"

namespace moe {

class RunDirProbe {
 public:
  // A collective (one barrier); `dir` exists (check_runnable made it).
  RunDirProbe(Comm& comm, const std::string& dir);
  ~RunDirProbe();  // rank 0 removes its token file (after the ranks compared what they saw)
  RunDirProbe(const RunDirProbe&) = delete;
  RunDirProbe& operator=(const RunDirProbe&) = delete;

  // "the one holding start-up token T" (the token rank 0 wrote, where this rank sees rank 0's
  // directory), or what this rank found instead.
  const std::string& seen() const { return seen_; }

 private:
  std::string token_file_;  // rank 0's (empty on the others)
  std::string seen_;
};

}  // namespace moe
