// The training loop. Each step: zero gradients, run gradient_accumulation_steps micro-batches
// (each scaled by 1/accum so the step sees the mean), clip by global norm, AdamW, then router
// bias updates. Every log_interval steps a progress line and a metrics.jsonl record; every
// eval_interval steps and at the end a held-out evaluation; every save_interval steps and at the
// end a checkpoint. A resumed run restores model, optimizer, RNG and data position and continues
// with bitwise the same losses.
#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ostream>

#include <nlohmann/json.hpp>

#include "moe/checkpoint.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/metrics.hpp"
#include "moe/model.hpp"
#include "moe/optim.hpp"
#include "moe/trainer.hpp"
#include "train/train_data.hpp"

namespace moe {

// "auto": the first GPU when the build has CUDA and one is present, else the CPU. A named GPU
// must exist and this binary must hold code for it (else: which --arch to rebuild with).
Device resolve_device(const std::string& spec) {
  if (spec == "cpu") return Device{DeviceType::cpu, 0};
  const int gpus = gpu::device_count();
  if (spec == "auto") {
    if (gpus == 0 || !gpu::has_code_for(0, nullptr)) return Device{DeviceType::cpu, 0};
    return Device{DeviceType::cuda, 0};
  }
  if (!gpu::built_with_cuda())
    throw ConfigError("train.device", "\"" + spec +
                                          "\" needs the CUDA backend, which this build does not "
                                          "include (rebuild with scripts/build.sh on a machine "
                                          "with nvcc); use \"cpu\" or \"auto\"");
  const int index = spec == "cuda" ? 0 : std::stoi(spec.substr(5));
  if (index >= gpus)
    throw ConfigError("train.device", "\"" + spec + "\": this machine has " +
                                          std::to_string(gpus) + " GPU(s)");
  std::string why;
  if (!gpu::has_code_for(index, &why)) throw ConfigError("train.device", why);
  return Device{DeviceType::cuda, index};
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

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

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux reports KiB
}

// Time spent per phase since the last log line.
struct PhaseTimes {
  double data = 0, forward_backward = 0, optimizer = 0, steps = 0, tokens = 0;
};

// The checkpoint to resume from per train.resume ("" = none).
std::string checkpoint_to_resume(const TrainConfig& t, std::ostream& out) {
  if (t.resume.empty()) return "";
  if (t.resume == "auto") {
    std::string dir = find_latest_checkpoint(t.out_dir, &out);
    if (dir.empty()) out << "resume auto: no complete checkpoint in " << t.out_dir
                         << ", starting fresh\n";
    return dir;
  }
  std::string dir = find_latest_checkpoint(t.resume, &out);
  if (dir.empty()) throw InputError("train.resume: no complete checkpoint in " + t.resume);
  return dir;
}

nlohmann::json train_record(int step, const Losses& l, double lr, double gnorm,
                            const PhaseTimes& ph, Model& model) {
  const RoutingStats& r = model.routing();
  nlohmann::json j = {{"kind", "train"},
                      {"step", step},
                      {"loss", l.lm},
                      {"aux_loss", l.aux},
                      {"z_loss", l.z},
                      {"mod_pred_loss", l.mod_pred},
                      {"lr", lr},
                      {"grad_norm", gnorm},
                      {"tokens_per_s", ph.tokens / std::max(1e-9, ph.data + ph.forward_backward +
                                                                      ph.optimizer)},
                      {"maxvio_mean", r.maxvio_mean()},
                      {"maxvio_max", r.maxvio_max()},
                      {"mod_kept", r.mod_seen > 0 ? r.mod_kept / r.mod_seen : 1.0},
                      {"peak_rss_mib", peak_rss_mib()},
                      {"time_s",
                       {{"data", ph.data / ph.steps},
                        {"forward_backward", ph.forward_backward / ph.steps},
                        {"optimizer", ph.optimizer / ph.steps}}}};
  // Per MoE layer: each expert's share of the routed slots in the logged step.
  nlohmann::json load = nlohmann::json::array();
  for (const auto& layer : r.expert_load) {
    double total = 0;
    for (double v : layer) total += v;
    nlohmann::json row = nlohmann::json::array();
    for (double v : layer) row.push_back(total > 0 ? v / total : 0.0);
    load.push_back(row);
  }
  j["expert_load"] = load;
  return j;
}

}  // namespace

TrainResult train(const Config& cfg, std::ostream& out, const TrainOptions& opt) {
  const Device dev = resolve_device(cfg.train.device);
  Ctx ctx = make_ctx(dev);
  const int b = cfg.train_micro_batch_size_per_gpu, t = cfg.data.seq_len;
  const int accum = cfg.gradient_accumulation_steps;

  std::unique_ptr<Model> model_owner;
  std::unique_ptr<AdamW> optimizer_owner;
  try {
    model_owner = std::make_unique<Model>(cfg.model, DType::f32, dev, b, t);
    optimizer_owner = std::make_unique<AdamW>(cfg.optimizer, *model_owner);
  } catch (const std::runtime_error& e) {
    if (dev.type != DeviceType::cuda) throw;
    // Out of GPU memory at start-up: say what the run needs and what to change.
    Model plan(cfg.model, DType::f32, dev, b, t, /*allocate=*/false);
    const double params = static_cast<double>(plan.table().total) * 4;
    const double need = params * 4 + static_cast<double>(plan.activation_bytes()) +
                        static_cast<double>(plan.scratch_bytes());
    throw std::runtime_error(std::string(e.what()) + "; this run needs about " +
                             std::to_string(static_cast<long>(need / 1048576)) +
                             " MiB (fp32 parameters, gradients, AdamW state, activations): "
                             "lower train_micro_batch_size_per_gpu or data.seq_len, or use a "
                             "smaller model");
  }
  Model& model = *model_owner;
  AdamW& optimizer = *optimizer_owner;
  model.init_weights(cfg.train.seed);
  std::unique_ptr<TrainData> data = make_train_data(cfg, 0, 1);
  Buffer norm_acc(dev, sizeof(double));

  TrainResult result;
  TrainerState state;
  const std::string resume_dir = checkpoint_to_resume(cfg.train, out);
  if (!resume_dir.empty()) {
    load_checkpoint(resume_dir, 0, model, optimizer, state);
    data->restore(state);
    result.resumed_from = static_cast<int>(state.step);
    out << "resumed from " << resume_dir << " at step " << state.step << "\n";
  } else if (!cfg.model.init_from.empty()) {
    init_from_hf(model, cfg.model.init_from);
    out << "initialised weights from " << cfg.model.init_from << "\n";
  }
  MetricsWriter metrics(cfg.train.out_dir + "/metrics.jsonl",
                        resume_dir.empty() ? -1 : state.step);
  SaveOptions save_opt;
  save_opt.run_dir = cfg.train.out_dir;
  save_opt.keep_last = cfg.train.keep_checkpoints;
  save_opt.tokenizer_dir = data->tokenizer_dir();

  result.optimal_loss = data->optimal_loss();
  const ParamCounts counts = count_params(cfg.model, t);
  char line[640];
  std::snprintf(line, sizeof line,
                "model: %.3fM parameters (%.3fM active per token), activations %.1f MiB | device "
                "%s | data: %s | run dir: %s\n",
                counts.total / 1e6, counts.active_per_token / 1e6,
                static_cast<double>(model.activation_bytes() + model.scratch_bytes()) / 1048576.0,
                dev.str().c_str(), data->describe().c_str(), cfg.train.out_dir.c_str());
  out << line << std::flush;

  const size_t n = static_cast<size_t>(b) * t;
  std::vector<int32_t> ids(n), targets(n);
  const auto start = Clock::now();
  const int first_step = static_cast<int>(state.step);
  PhaseTimes phase;
  bool warned_no_eval = false;
  const int max_steps = cfg.train.max_steps;
  for (int step = first_step; step < max_steps; ++step) {
    model.zero_grads(ctx);
    model.routing().reset();
    Losses sum;
    for (int micro = 0; micro < accum; ++micro) {
      auto t0 = Clock::now();
      data->next(ids.data(), targets.data());
      phase.data += seconds_since(t0);
      t0 = Clock::now();
      Losses l = model.forward_backward(ctx, ids.data(), targets.data(), 1.0 / accum);
      phase.forward_backward += seconds_since(t0);
      sum.lm += l.lm / accum;
      sum.aux += l.aux / accum;
      sum.z += l.z / accum;
      sum.mod_pred += l.mod_pred / accum;
    }
    if (!std::isfinite(sum.total()))
      throw std::runtime_error("the loss became non-finite at step " + std::to_string(step + 1) +
                               "; lower optimizer.params.lr or enable gradient_clipping");
    auto t0 = Clock::now();
    const double lr = learning_rate(cfg.scheduler, cfg.optimizer.lr, step, max_steps);
    const double gnorm = global_grad_norm(ctx, model, norm_acc.as(DType::f64, {1}));
    optimizer.step(ctx, model, lr, clip_factor(gnorm, cfg.gradient_clipping));
    model.after_step(ctx);
    phase.optimizer += seconds_since(t0);
    phase.steps += 1;
    phase.tokens += static_cast<double>(n) * accum;
    state.step = step + 1;
    state.tokens_seen += static_cast<int64_t>(n) * accum;
    result.losses.push_back(sum.lm);
    result.last_loss = sum.lm;
    result.steps = step + 1;

    const bool last = step + 1 == max_steps;
    if ((step + 1) % cfg.train.log_interval == 0 || last) {
      nlohmann::json rec = train_record(step + 1, sum, lr, gnorm, phase, model);
      const double tps = rec["tokens_per_s"].get<double>();
      const double eta = seconds_since(start) / (step + 1 - first_step) * (max_steps - step - 1);
      std::snprintf(line, sizeof line,
                    "step %6d/%d | loss %.4f | aux %.4f | z %.4f | mod_pred %.4f | lr %.3e | "
                    "grad_norm %.3f | tok/s %.0f | maxvio %.3f/%.3f | mod_kept %.3f | eta %s\n",
                    step + 1, max_steps, sum.lm, sum.aux, sum.z, sum.mod_pred, lr, gnorm, tps,
                    rec["maxvio_mean"].get<double>(), rec["maxvio_max"].get<double>(),
                    rec["mod_kept"].get<double>(), format_eta(eta).c_str());
      out << line << std::flush;
      metrics.write(rec);
      result.tokens_per_second = tps;
      phase = PhaseTimes{};
    }
    if (last || (cfg.train.eval_interval > 0 && (step + 1) % cfg.train.eval_interval == 0)) {
      const double eval = data->evaluate(ctx, model, cfg.train.eval_batches);
      if (!std::isfinite(eval) && !cfg.data.val_files.empty() && !warned_no_eval) {
        out << "eval skipped: " << cfg.data.val_files << " holds fewer than batch * seq_len + 1 = "
            << n + 1 << " tokens\n";
        warned_no_eval = true;
      }
      if (std::isfinite(eval)) {
        result.eval_loss = eval;
        std::snprintf(line, sizeof line, "eval  step %6d | loss %.4f | ppl %.3f%s\n", step + 1,
                      eval, std::exp(eval),
                      std::isfinite(result.optimal_loss)
                          ? (" | best achievable " + std::to_string(result.optimal_loss)).c_str()
                          : "");
        out << line << std::flush;
        metrics.write({{"kind", "eval"}, {"step", step + 1}, {"loss", eval}, {"ppl", std::exp(eval)}});
      }
    }
    const bool stop_now = opt.stop_after_step > 0 && step + 1 == opt.stop_after_step;
    if (last || (cfg.train.save_interval > 0 && (step + 1) % cfg.train.save_interval == 0)) {
      data->save(state);
      const std::string dir = save_checkpoint(save_opt, cfg, model, optimizer, state);
      out << "saved " << dir << "\n" << std::flush;
    }
    if (stop_now) break;
  }
  return result;
}

}  // namespace moe
