// The host's part of the end of a step, once it has read the step's statistics (the one wait
// per step): follow the device's skip decision.
//
// AdamW::step skipped the update on the device exactly when the gradient norm was not finite
// (fp16 overflow). Everything else that changes training state must skip with it, and the host
// learns the decision only at that read. So the router-bias update (Model::after_step) is queued
// here, after the read, instead of before it: it reads the step's expert loads, which nothing
// changes between the end of the backward and the next step's reset_stats, so a step that is
// not skipped computes bitwise what it did before, and the update costs no extra wait.
#pragma once
#include <string>

#include "moe/model.hpp"

namespace moe {

// gnorm: the step's gradient norm as read back (after the loss scale is divided out);
// loss_total: its mean total loss; loss_scaling: fp16 with a loss scaler.
// Returns true when the device skipped the step (an overflow): the caller takes back the
// optimizer's step count and tells the scaler; nothing else changed. Otherwise queues the
// router-bias update and returns false. A non-finite norm without loss scaling, or a non-finite
// loss, means the run diverged: throws std::runtime_error naming the step (1-based `step`).
bool finish_step(Ctx& ctx, Model& model, double gnorm, double loss_total, bool loss_scaling,
                 int step);

// The run diverged at (1-based) `step`: std::runtime_error saying that `what` (the loss, or the
// weights) became non-finite and what to change, with `detail` (what was found) when given.
[[noreturn]] void throw_diverged(int step, const std::string& detail = "",
                                 const char* what = "the loss");

}  // namespace moe
