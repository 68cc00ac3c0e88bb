// The watchdog that turns a hung collective into one clear line and a dead job, instead of every
// rank waiting forever on a peer that died or hangs.
//
// A comm arms it around each call that can block (`auto guard = watchdog.watch("all_reduce_sum")`);
// a thread waits for the deadline and, when the call has not returned by then, prints
//   moe-train: rank R: <op> did not complete within N s (a peer rank died or hangs); aborting
// and runs the comm's abort action (MPI_Abort; ncclCommAbort first for NCCL). An optional poll
// hook, called about every 100 ms, lets NcclComm report asynchronous failures
// (ncclCommGetAsyncError, a GPU-side collective past its deadline) the same way.
//
// This is the one place below main() that ends the process (the blocked thread cannot be woken to
// throw). If the abort action returns or itself hangs, the process _exits after a grace period.
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace moe::dist {

// Exit code of a rank the watchdog ends (main's code for a runtime failure).
constexpr int kCommAbortExitCode = 1;

// The line printed when `op` exceeds `timeout_s` on `rank` (no trailing newline).
std::string timeout_line(int rank, const std::string& op, double timeout_s);

class Watchdog {
 public:
  using AbortFn = std::function<void()>;
  // Returns "" while all is well, else the line to print before aborting.
  using PollFn = std::function<std::string()>;

  // timeout_s = 0: no deadline (the thread runs only when there is a poll hook).
  Watchdog(int rank, double timeout_s, AbortFn abort, PollFn poll = {});
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Disarms on destruction (also when the watched call throws).
  class Guard {
   public:
    explicit Guard(Watchdog* w) : w_(w) {}
    Guard(Guard&& o) noexcept : w_(o.w_) { o.w_ = nullptr; }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    ~Guard() {
      if (w_) w_->disarm();
    }

   private:
    Watchdog* w_;
  };
  // Arms the deadline for `op` (a string literal: kept by pointer).
  [[nodiscard]] Guard watch(const char* op);

  // Prints `line`, aborts the job and never returns.
  [[noreturn]] void fire(const std::string& line);

 private:
  void disarm();
  void run();

  using Clock = std::chrono::steady_clock;
  int rank_;
  double timeout_s_;
  AbortFn abort_;
  PollFn poll_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  const char* op_ = nullptr;  // the armed op, nullptr when disarmed
  Clock::time_point armed_at_;
  std::thread thread_;
};

}  // namespace moe::dist
