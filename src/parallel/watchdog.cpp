#include "parallel/watchdog.hpp"

#include <unistd.h>

#include <cstdio>

namespace moe::dist {

namespace {

// How often the poll hook runs, and how long the abort action may take before _exit.
constexpr auto kPollInterval = std::chrono::milliseconds(100);
constexpr auto kAbortGrace = std::chrono::seconds(10);

// One write(2), so lines of several ranks sharing a terminal do not interleave.
void write_line(const std::string& line) {
  std::string s = line + "\n";
  ssize_t ignored = ::write(STDERR_FILENO, s.data(), s.size());
  (void)ignored;
}

}  // namespace

std::string timeout_line(int rank, const std::string& op, double timeout_s) {
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%g", timeout_s);
  return "moe-train: rank " + std::to_string(rank) + ": " + op + " did not complete within " +
         seconds + " s (a peer rank died or hangs); aborting";
}

Watchdog::Watchdog(int rank, double timeout_s, AbortFn abort, PollFn poll)
    : rank_(rank), timeout_s_(timeout_s), abort_(std::move(abort)), poll_(std::move(poll)) {
  if (timeout_s_ > 0 || poll_) thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Watchdog::Guard Watchdog::watch(const char* op) {
  if (timeout_s_ <= 0) return Guard(nullptr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    op_ = op;
    armed_at_ = Clock::now();
  }
  cv_.notify_all();
  return Guard(this);
}

void Watchdog::disarm() {
  std::lock_guard<std::mutex> lock(mu_);
  op_ = nullptr;
  // No notify: the thread wakes at the old deadline, sees nothing armed and sleeps again.
}

void Watchdog::fire(const std::string& line) {
  write_line(line);
  // If the abort action hangs (an MPI or NCCL call stuck behind the dead peer), end anyway.
  std::thread([] {
    std::this_thread::sleep_for(kAbortGrace);
    _exit(kCommAbortExitCode);
  }).detach();
  if (abort_) abort_();
  _exit(kCommAbortExitCode);
}

void Watchdog::run() {
  const auto timeout = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(timeout_s_ > 0 ? timeout_s_ : 0));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const bool armed = op_ != nullptr && timeout_s_ > 0;
    const Clock::time_point now = Clock::now();
    if (armed && now - armed_at_ >= timeout) {
      std::string line = timeout_line(rank_, op_, timeout_s_);
      lock.unlock();
      fire(line);
    }
    if (poll_) {
      lock.unlock();
      std::string line = poll_();
      if (!line.empty()) fire(line);
      lock.lock();
      if (stop_) break;
      cv_.wait_for(lock, kPollInterval);
    } else if (armed) {
      cv_.wait_until(lock, armed_at_ + timeout);
    } else {
      cv_.wait(lock);
    }
  }
}

}  // namespace moe::dist
