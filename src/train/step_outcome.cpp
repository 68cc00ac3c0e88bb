#include "train/step_outcome.hpp"

#include <cmath>
#include <stdexcept>
#include <string>

namespace moe {

void throw_diverged(int step, const std::string& detail, const char* what) {
  throw std::runtime_error(std::string(what) + " became non-finite at step " +
                           std::to_string(step) + (detail.empty() ? "" : " (" + detail + ")") +
                           "; lower optimizer.params.lr or enable gradient_clipping");
}

bool finish_step(Ctx& ctx, Model& model, double gnorm, double loss_total, bool loss_scaling,
                 int step) {
  const bool overflow = !std::isfinite(gnorm);
  if ((overflow && !loss_scaling) || (!overflow && !std::isfinite(loss_total)))
    throw_diverged(step);
  if (!overflow) model.after_step(ctx);
  return overflow;
}

}  // namespace moe
