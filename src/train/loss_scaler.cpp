// DeepSpeed's DynamicLossScaler (runtime/fp16/loss_scaler.py) restated: the same scale sequence
// for the same overflow pattern, so runs and their resumes compare across the two.
#include "train/loss_scaler.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace moe {

LossScaler::LossScaler(const Fp16Config& cfg) : cfg_(cfg), enabled_(cfg.enabled) {
  state_.scale = cfg.loss_scale > 0 ? cfg.loss_scale : std::ldexp(1.0, cfg.initial_scale_power);
  state_.hysteresis_left = std::max(1, cfg.hysteresis);
}

void LossScaler::update(bool overflow) {
  if (!enabled_) return;
  const bool dynamic = cfg_.loss_scale <= 0;
  if (overflow && dynamic) {
    if (state_.hysteresis_left <= 1) {
      if (state_.scale <= cfg_.min_loss_scale)
        throw std::runtime_error(
            "fp16 gradients overflow at the minimum loss scale (fp16.min_loss_scale = " +
            std::to_string(cfg_.min_loss_scale) +
            "): the model diverged; lower optimizer.params.lr or train in bf16");
      state_.scale = std::max(state_.scale / 2, cfg_.min_loss_scale);
    } else {
      --state_.hysteresis_left;
    }
    state_.last_overflow = state_.iteration;
  } else if (dynamic && !overflow) {
    if ((state_.iteration - state_.last_overflow) % cfg_.loss_scale_window == 0) {
      state_.hysteresis_left = std::max(1, cfg_.hysteresis);
      state_.scale *= 2;
    }
  }
  ++state_.iteration;
}

}  // namespace moe
