// fp16 loss scaling with DeepSpeed's semantics (fp16.loss_scale, initial_scale_power,
// loss_scale_window, hysteresis, min_loss_scale). The loss gradient is multiplied by scale()
// so small fp16 activation gradients do not flush to zero; a step whose gradients overflow
// (non-finite norm) is skipped. Dynamic scaling (loss_scale 0) halves the scale on an overflow,
// after `hysteresis` overflows in a row have been tolerated, and doubles it after
// loss_scale_window steps without one. A static scale (loss_scale > 0) never changes.
#pragma once
#include <cstdint>

#include "moe/config.hpp"

namespace moe {

struct LossScalerState {
  double scale = 1;
  int hysteresis_left = 1;     // overflows still tolerated before the scale drops
  int64_t iteration = 0;       // steps seen (taken or skipped)
  int64_t last_overflow = -1;  // iteration of the last overflow
};

class LossScaler {
 public:
  // Disabled (scale 1, never skips) unless fp16 is on.
  explicit LossScaler(const Fp16Config& cfg);
  double scale() const { return enabled_ ? state_.scale : 1.0; }
  bool enabled() const { return enabled_; }
  // After a step: `overflow` = the gradients were not finite (the step was skipped). Throws
  // std::runtime_error when a dynamic scale is already at min_loss_scale and overflows again.
  void update(bool overflow);
  const LossScalerState& state() const { return state_; }
  void restore(const LossScalerState& s) { state_ = s; }

 private:
  Fp16Config cfg_;
  bool enabled_;
  LossScalerState state_;
};

}  // namespace moe
