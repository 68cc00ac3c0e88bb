#include "train/stop_signals.hpp"

#include <atomic>

#include "moe/model.hpp"

namespace moe {

namespace {

// In the order agreed() prefers them; a signal's index is its step flag.
constexpr int kSignals[3] = {SIGTERM, SIGINT, SIGUSR1};
static_assert(kStepFlags >= 3, "a step flag for each stop signal");

// Written by the handler: a lock-free atomic is async-signal-safe.
std::atomic<int> g_received{0};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void on_stop_signal(int signal) {
  int none = 0;
  g_received.compare_exchange_strong(none, signal);  // the first one is the one reported
  // Ctrl-C on `moe-train train | tee log` ends the reader too: the next progress line would then
  // end the process by SIGPIPE before its save. From here a write to a closed pipe only fails.
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ignore, nullptr);  // (async-signal-safe)
}

}  // namespace

StopSignals::StopSignals() {
  g_received = 0;
  struct sigaction act {};
  act.sa_handler = on_stop_signal;
  sigemptyset(&act.sa_mask);
  // SA_RESTART: a read or write that the signal interrupts goes on (a save, the data);
  // SA_RESETHAND: the next signal of the kind takes the default action, ending the process.
  act.sa_flags = SA_RESTART | SA_RESETHAND;
  sigaction(SIGPIPE, nullptr, &old_pipe_);
  for (int i = 0; i < 3; ++i) {
    sigaction(kSignals[i], nullptr, &old_[i]);
    // A signal the process was started with ignored stays ignored (a shell script's background
    // job ignores SIGINT, so the Ctrl-C meant for the script does not stop the run).
    if (old_[i].sa_handler != SIG_IGN) sigaction(kSignals[i], &act, nullptr);
  }
}

StopSignals::~StopSignals() {
  for (int i = 0; i < 3; ++i) sigaction(kSignals[i], &old_[i], nullptr);
  // After a stop the process goes on to print its summary and exit 128 + N: a closed pipe must
  // not end it there either.
  if (received() == 0) sigaction(SIGPIPE, &old_pipe_, nullptr);
}

int StopSignals::received() const {
  return g_received.load();
}

int StopSignals::flag() const {
  const int mine = received();
  for (int i = 0; i < 3; ++i)
    if (mine == kSignals[i]) return i;
  return -1;
}

int StopSignals::agreed(const double* flags) {
  for (int i = 0; i < 3; ++i)
    if (flags[i] > 0) return kSignals[i];
  return 0;
}

const char* StopSignals::name(int signal) {
  switch (signal) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    case SIGUSR1:
      return "SIGUSR1";
    default:
      return "a signal";
  }
}

}  // namespace moe
