// The op profiler behind include/moe/profiler.hpp. Records are kept in order of the calls; GPU
// records hold a pair of timing events from a pool of at most kFoldEvery pairs, reused after
// each fold into the per-op totals.
#include "moe/profiler.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>

#include "moe/cuda_runtime.hpp"
#include "moe/ops/common.hpp"

#if defined(MOE_WITH_CUDA) && __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define MOE_HAVE_NVTX 1
#endif

namespace moe::profile {
namespace {

using Clock = std::chrono::steady_clock;

struct Record {
  const char* op = nullptr;
  bool gpu = false;
  void* start = nullptr;  // events (GPU) from the pool
  void* stop = nullptr;
  void* stream = nullptr;
  Clock::time_point t0, t1;  // CPU
};

struct State {
  std::mutex mutex;
  std::vector<Record> records;                // not yet folded into `totals`
  std::vector<std::pair<void*, void*>> pool;  // event pairs, reused after each fold
  size_t pool_used = 0;
  int open = 0;  // scopes not yet closed (an op may call another op): no fold while any is open
  std::map<std::string, OpTime> totals;
};

// Records are folded into per-op totals once this many are pending (and by take()), so a long
// run keeps a bounded number of records and events. A fold waits for the pending events: with
// 4096 of them (~10 steps of a small model) that is rare.
constexpr size_t kFoldEvery = 4096;

// Adds the pending records to the totals and frees their events for reuse. Caller holds the lock.
void fold(State& s) {
  for (const Record& r : s.records) {
    OpTime& t = s.totals[r.op];
    t.op = r.op;
    ++t.calls;
    if (r.gpu) {
      gpu::event_synchronize(r.stop);
      t.ms += gpu::event_elapsed_ms(r.start, r.stop);
    } else {
      t.ms += std::chrono::duration<double, std::milli>(r.t1 - r.t0).count();
    }
  }
  s.records.clear();
  s.pool_used = 0;
}

State& state() {
  static State s;
  return s;
}

// MOE_PROFILE=1 in the environment turns profiling on before main runs.
const bool g_from_env = [] {
  const char* v = std::getenv("MOE_PROFILE");
  if (v && *v && std::string(v) != "0") g_enabled = true;
  return true;
}();

}  // namespace

void enable(bool on) {
  g_enabled = on;
}

Scope::Scope(const char* op, const Ctx& ctx) {
#ifdef MOE_HAVE_NVTX
  nvtxRangePushA(op);
#endif
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.records.size() >= kFoldEvery && s.open == 0) fold(s);
  ++s.open;
  Record r;
  r.op = op;
  r.gpu = ctx.device.type == DeviceType::cuda;
  if (r.gpu) {
    if (s.pool_used == s.pool.size())
      s.pool.emplace_back(gpu::event_create_timed(), gpu::event_create_timed());
    r.start = s.pool[s.pool_used].first;
    r.stop = s.pool[s.pool_used].second;
    r.stream = ctx.stream;
    ++s.pool_used;
    gpu::event_record(r.start, r.stream);
  } else {
    r.t0 = Clock::now();
  }
  record_ = static_cast<int>(s.records.size());
  s.records.push_back(r);
}

Scope::~Scope() {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    --s.open;
    Record& r = s.records[static_cast<size_t>(record_)];
    try {  // a destructor must not throw (it may run while a device error unwinds)
      if (r.gpu)
        gpu::event_record(r.stop, r.stream);
      else
        r.t1 = Clock::now();
    } catch (...) {
      r.gpu = false;  // the op's time is lost; the record stays well formed
      r.t1 = r.t0 = Clock::now();
    }
  }
#ifdef MOE_HAVE_NVTX
  nvtxRangePop();
#endif
}

std::vector<OpTime> take() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  fold(s);
  std::vector<OpTime> out;
  for (auto& [name, t] : s.totals) out.push_back(t);
  s.totals.clear();
  std::sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.ms > b.ms; });
  return out;
}

std::string format(const std::vector<OpTime>& times, double steps) {
  double total = 0;
  for (const OpTime& t : times) total += t.ms;
  std::string out = "profile: time per step by op (device time for GPU ops)\n";
  char line[160];
  std::snprintf(line, sizeof line, "  %-28s %10s %8s %7s\n", "op", "ms/step", "calls", "share");
  out += line;
  for (const OpTime& t : times) {
    std::snprintf(line, sizeof line, "  %-28s %10.3f %8.1f %6.1f%%\n", t.op.c_str(), t.ms / steps,
                  t.calls / steps, total > 0 ? 100.0 * t.ms / total : 0.0);
    out += line;
  }
  std::snprintf(line, sizeof line, "  %-28s %10.3f\n", "total", total / steps);
  out += line;
  return out;
}

}  // namespace moe::profile
