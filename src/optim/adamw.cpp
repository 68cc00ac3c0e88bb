// AdamW over the parameter buffer in segments of equal decay choice (decided by ParamKind:
// norms are not decayed), global-norm clipping and the learning-rate schedule.
#include <cmath>

#include "moe/ops/elementwise.hpp"
#include "moe/ops/optim.hpp"
#include "moe/optim.hpp"

namespace moe {

double learning_rate(const SchedulerConfig& s, double base_lr, int step, int max_steps) {
  const int warmup = s.warmup_num_steps;
  if (step < warmup) {
    const double frac = static_cast<double>(step + 1) / warmup;
    return base_lr * (s.warmup_min_ratio + (1.0 - s.warmup_min_ratio) * frac);
  }
  if (s.type == "WarmupLR") return base_lr;
  const int total = s.total_num_steps > 0 ? s.total_num_steps : max_steps;
  if (total <= warmup) return base_lr;
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / (total - warmup));
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return base_lr * (s.cos_min_ratio + (1.0 - s.cos_min_ratio) * cosine);
}

void queue_grad_norm_sq(Ctx& ctx, const Model& model, Tensor acc) {
  fill(ctx, acc, 0.0);
  sum_squares(ctx, acc, model.grads());
}

double global_grad_norm(Ctx& ctx, const Model& model, Tensor acc) {
  queue_grad_norm_sq(ctx, model, acc);
  double host = 0;
  copy_to_host(&host, acc);
  return std::sqrt(host);
}

double clip_factor(double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0;
  return max_norm / (norm + 1e-6);
}

AdamW::AdamW(const OptimizerConfig& cfg, const Model& model)
    : cfg_(cfg),
      m_(model.params().device, model.table().total * dtype_size(model.dtype())),
      v_(model.params().device, model.table().total * dtype_size(model.dtype())),
      dtype_(model.dtype()) {
  for (const auto& p : model.table().params) {
    const bool decay = param_kind_decays(p.kind);
    if (!segments_.empty() && segments_.back().decay == decay &&
        segments_.back().offset + segments_.back().numel == p.offset)
      segments_.back().numel += p.numel();
    else
      segments_.push_back({p.offset, p.numel(), decay});
  }
}

Tensor AdamW::moment1() const {
  return m_.as(dtype_, {static_cast<int64_t>(m_.bytes() / dtype_size(dtype_))});
}
Tensor AdamW::moment2() const {
  return v_.as(dtype_, {static_cast<int64_t>(v_.bytes() / dtype_size(dtype_))});
}

void AdamW::step(Ctx& ctx, Model& model, double lr, double grad_scale, Tensor norm_sq,
                 double max_norm) {
  ++step_;
  const int64_t total = static_cast<int64_t>(model.table().total);
  Tensor p = model.params(), g = model.grads();
  Tensor m = m_.as(dtype_, {total}), v = v_.as(dtype_, {total});
  for (const auto& s : segments_) {
    AdamWArgs a;
    a.lr = lr;
    a.beta1 = cfg_.beta1;
    a.beta2 = cfg_.beta2;
    a.eps = cfg_.eps;
    a.weight_decay = s.decay ? cfg_.weight_decay : 0.0;
    a.step = step_;
    a.grad_scale = grad_scale;
    a.norm_sq = norm_sq;
    a.max_norm = max_norm;
    const int64_t b = static_cast<int64_t>(s.offset), e = b + static_cast<int64_t>(s.numel);
    adamw_step(ctx, p.rows(b, e), g.rows(b, e), m.rows(b, e), v.rows(b, e), a);
  }
}

}  // namespace moe
