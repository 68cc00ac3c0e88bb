// Time per op: when on, every op call made through the op seam (MOE_OP) is timed, with CUDA events
// on its stream for GPU ops (so queued work is measured where it runs, without synchronising) and
// a steady clock for CPU ops, and is wrapped in an NVTX range for Nsight Systems. Off by default;
// `moe-train train --profile` or MOE_PROFILE=1 in the environment turns it on.
#pragma once
#include <string>
#include <vector>

#include "moe/tensor.hpp"

namespace moe {
struct Ctx;
}

namespace moe::profile {

// Checked by every op call: a plain flag, so the cost when off is one load and branch.
inline bool g_enabled = false;
inline bool enabled() {
  return g_enabled;
}
void enable(bool on);

// Times one op call from construction to destruction.
class Scope {
 public:
  Scope(const char* op, const Ctx& ctx);  // op: a string literal (kept by pointer)
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  int record_ = -1;
};

struct OpTime {
  std::string op;
  long calls = 0;
  double ms = 0;  // total
};
// Waits for the recorded work, then returns the time per op since the last take(), largest
// first, and starts counting afresh. (Records are folded into totals as they accumulate, so a
// long run holds a bounded number of them.)
std::vector<OpTime> take();
// A table of `times` per step (`steps` steps), with each op's share of the total.
std::string format(const std::vector<OpTime>& times, double steps);

}  // namespace moe::profile
