// The optimizer side of a step: AdamW state over the contiguous parameter buffer, the learning
// rate schedule and global-norm gradient clipping.
#pragma once
#include <vector>

#include "moe/config.hpp"
#include "moe/memory.hpp"
#include "moe/model.hpp"

namespace moe {

// lr at optimizer step `step` (0-based): linear warmup from warmup_min_ratio * lr to lr over
// warmup_num_steps, then constant (WarmupLR) or cosine down to cos_min_ratio * lr at
// total_num_steps (WarmupCosineLR; 0 = max_steps), constant after.
double learning_rate(const SchedulerConfig& s, double base_lr, int step, int max_steps);

// Queues acc[0] = sum of squared gradients over the whole gradient buffer; `acc` is a 1-element
// f64 tensor on the model's device (kept by the caller, so a step allocates nothing). Nothing is
// read back: AdamW::step clips from it on the device.
void queue_grad_norm_sq(Ctx& ctx, const Model& model, Tensor acc);
// sqrt(sum of squared gradients), read back (waits for the device).
double global_grad_norm(Ctx& ctx, const Model& model, Tensor acc);
// The factor that brings `norm` down to `max_norm` (1 when clipping is off or not needed).
double clip_factor(double norm, double max_norm);

class AdamW {
 public:
  AdamW(const OptimizerConfig& cfg, const Model& model);
  // One update with learning rate `lr`; gradients are multiplied by grad_scale first. With
  // `norm_sq` (from queue_grad_norm_sq) the device computes the norm of the scaled gradients,
  // clips it to max_norm (0 = off) and skips the update when it is not finite (fp16 overflow),
  // so the host reads nothing. A skipped step must be reported with undo_step().
  void step(Ctx& ctx, Model& model, double lr, double grad_scale, Tensor norm_sq = Tensor(),
            double max_norm = 0);
  // The last step() was skipped on the device: its bias-correction count is taken back.
  void undo_step() { --step_; }
  long steps_taken() const { return step_; }
  // The moments, laid out like the parameter buffer (for checkpoints).
  Tensor moment1() const;
  Tensor moment2() const;
  void set_steps_taken(long s) { step_ = s; }

 private:
  // A run of adjacent parameters sharing one weight-decay choice: one fused update each.
  struct Segment {
    size_t offset, numel;
    bool decay;
  };
  OptimizerConfig cfg_;
  std::vector<Segment> segments_;
  Buffer m_, v_;
  DType dtype_;
  long step_ = 0;
};

}  // namespace moe
