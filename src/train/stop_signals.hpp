// A graceful stop: SIGTERM (`kill`, Slurm at the time limit or on preemption), SIGINT (Ctrl-C)
// and SIGUSR1 (Slurm's `--signal=USR1@SECONDS` warning) ask the run to stop after the step in
// progress, with a checkpoint, instead of ending the process mid-step and losing the steps since
// the last save. A second signal of the same kind ends the process at once (the handler is
// installed for one delivery); the last complete checkpoint is never touched by that (saves go
// to step_N.tmp/ and are renamed into place). A signal during the last step, its evaluation or
// its save changes nothing: the run ends as finished.
//
// With several ranks every rank must stop after the same step (the save is collective), but a
// signal reaches the ranks at different times, or only some of them: each rank raises its step
// flag (Model::raise_step_flag), which the step's all-reduce of the losses sums across ranks (no
// collective of its own), and agreed() reads the sums, the same on every rank. So with several
// ranks a signal that comes after the step's flags were raised (during its update, evaluation or
// save) stops the run one step later than with one rank.
#pragma once
#include <csignal>

namespace moe {

class StopSignals {
 public:
  // Installs the handlers (not for a signal the process ignores); the destructor puts the
  // previous ones back. Once a stop signal came SIGPIPE is ignored, to the process's end (.cpp).
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The first stop signal this process received since construction (0: none).
  int received() const;
  // The step flag of the signal received (SIGTERM 0, SIGINT 1, SIGUSR1 2); -1 for none.
  int flag() const;
  // The stop signal that some rank received, from the step flags summed over the ranks
  // (Losses::flags): SIGTERM if some rank got one, else SIGINT, else SIGUSR1; 0 for none.
  static int agreed(const double* flags);

  // "SIGTERM", "SIGINT", "SIGUSR1", else "a signal".
  static const char* name(int signal);

 private:
  struct sigaction old_[3];
  struct sigaction old_pipe_;
};

}  // namespace moe
