// The training loop. Each step: zero gradients, run gradient_accumulation_steps micro-batches
// (each scaled by 1/accum so the step sees the mean), clip by global norm, AdamW, then router
// bias updates; progress lines every log_interval steps and held-out evaluation every
// eval_interval steps and at the end.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <sstream>

#include "moe/data.hpp"
#include "moe/model.hpp"
#include "moe/optim.hpp"
#include "moe/trainer.hpp"

namespace moe {

Device resolve_device(const std::string& spec) {
  if (spec == "auto" || spec == "cpu") return Device{DeviceType::cpu, 0};
  // CUDA device strings are validated by the config; this build runs the CPU backend only.
  throw ConfigError("train.device", "\"" + spec +
                                        "\" needs the CUDA backend, which this build does not "
                                        "include; use \"cpu\" or \"auto\"");
}

namespace {

struct Batch {
  std::vector<int32_t> ids, targets;
  Batch(int b, int t) : ids(static_cast<size_t>(b) * t), targets(static_cast<size_t>(b) * t) {}
};

std::string format_eta(double seconds) {
  char buf[32];
  if (seconds >= 3600)
    std::snprintf(buf, sizeof buf, "%dh%02dm", static_cast<int>(seconds / 3600),
                  static_cast<int>(std::fmod(seconds, 3600) / 60));
  else if (seconds >= 60)
    std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(seconds / 60),
                  static_cast<int>(std::fmod(seconds, 60)));
  else
    std::snprintf(buf, sizeof buf, "%.0fs", seconds);
  return buf;
}

// Mean LM loss over `batches` micro-batches of the held-out stream (the same batches each time).
double evaluate(Ctx& ctx, Model& model, const MarkovSource& source, uint64_t seed, int batches) {
  Rng rng(seed);
  Batch batch(model.batch(), model.seq_len());
  double sum = 0;
  for (int i = 0; i < batches; ++i) {
    source.sample(rng, model.batch(), model.seq_len(), batch.ids.data(), batch.targets.data());
    sum += model.forward(ctx, batch.ids.data(), batch.targets.data()).lm;
  }
  return sum / batches;
}

}  // namespace

TrainResult train(const Config& cfg, std::ostream& out) {
  const Device dev = resolve_device(cfg.train.device);
  Ctx ctx{dev};
  const int b = cfg.train_micro_batch_size_per_gpu, t = cfg.data.seq_len;
  const int accum = cfg.gradient_accumulation_steps;

  Model model(cfg.model, DType::f32, dev, b, t);
  model.init_weights(cfg.train.seed);
  AdamW optimizer(cfg.optimizer, model);
  const MarkovSource source(cfg.model.vocab_size, cfg.data.synthetic.branching,
                            static_cast<uint64_t>(cfg.data.synthetic.seed));
  Rng train_rng(hash_name("train", cfg.train.seed));
  const uint64_t eval_seed = hash_name("eval", cfg.train.seed);
  Buffer norm_acc(dev, sizeof(double));

  TrainResult result;
  result.optimal_loss = source.optimal_loss(t);
  const ParamCounts counts = count_params(cfg.model, t);
  char line[512];
  std::snprintf(line, sizeof line,
                "model: %.3fM parameters (%.3fM active per token), activations %.1f MiB | data: "
                "order-2 Markov source, best achievable loss %.4f (uniform %.4f)\n",
                counts.total / 1e6, counts.active_per_token / 1e6,
                static_cast<double>(model.activation_bytes() + model.scratch_bytes()) / 1048576.0,
                result.optimal_loss, std::log(static_cast<double>(cfg.model.vocab_size)));
  out << line << std::flush;

  Batch batch(b, t);
  const auto start = std::chrono::steady_clock::now();
  auto window_start = start;
  double window_tokens = 0;
  const double tokens_per_step = static_cast<double>(b) * t * accum;
  for (int step = 0; step < cfg.train.max_steps; ++step) {
    model.zero_grads(ctx);
    model.routing().reset();
    Losses sum;
    for (int micro = 0; micro < accum; ++micro) {
      source.sample(train_rng, b, t, batch.ids.data(), batch.targets.data());
      Losses l = model.forward_backward(ctx, batch.ids.data(), batch.targets.data(), 1.0 / accum);
      sum.lm += l.lm / accum;
      sum.aux += l.aux / accum;
      sum.z += l.z / accum;
      sum.mod_pred += l.mod_pred / accum;
    }
    if (!std::isfinite(sum.total()))
      throw std::runtime_error("the loss became non-finite at step " + std::to_string(step + 1) +
                               "; lower optimizer.params.lr or enable gradient_clipping");
    const double lr = learning_rate(cfg.scheduler, cfg.optimizer.lr, step, cfg.train.max_steps);
    const double gnorm = global_grad_norm(ctx, model, norm_acc.as(DType::f64, {1}));
    optimizer.step(ctx, model, lr, clip_factor(gnorm, cfg.gradient_clipping));
    model.after_step(ctx);
    window_tokens += tokens_per_step;
    result.last_loss = sum.lm;
    result.steps = step + 1;

    const bool last = step + 1 == cfg.train.max_steps;
    if ((step + 1) % cfg.train.log_interval == 0 || last) {
      const auto now = std::chrono::steady_clock::now();
      const double window = std::chrono::duration<double>(now - window_start).count();
      const double elapsed = std::chrono::duration<double>(now - start).count();
      const double tps = window > 0 ? window_tokens / window : 0;
      const double eta = elapsed / (step + 1) * (cfg.train.max_steps - step - 1);
      const RoutingStats& r = model.routing();
      const double kept = r.mod_seen > 0 ? r.mod_kept / r.mod_seen : 1.0;
      std::snprintf(line, sizeof line,
                    "step %6d/%d | loss %.4f | aux %.4f | z %.4f | mod_pred %.4f | lr %.3e | "
                    "grad_norm %.3f | tok/s %.0f | maxvio %.3f/%.3f | mod_kept %.3f | eta %s\n",
                    step + 1, cfg.train.max_steps, sum.lm, sum.aux, sum.z, sum.mod_pred, lr, gnorm,
                    tps, r.maxvio_mean(), r.maxvio_max(), kept, format_eta(eta).c_str());
      out << line << std::flush;
      result.tokens_per_second = tps;
      window_start = now;
      window_tokens = 0;
    }
    const bool eval_now =
        last || (cfg.train.eval_interval > 0 && (step + 1) % cfg.train.eval_interval == 0);
    if (eval_now) {
      result.eval_loss = evaluate(ctx, model, source, eval_seed, cfg.train.eval_batches);
      std::snprintf(line, sizeof line, "eval  step %6d | loss %.4f | best achievable %.4f\n",
                    step + 1, result.eval_loss, result.optimal_loss);
      out << line << std::flush;
    }
  }
  return result;
}

}  // namespace moe
