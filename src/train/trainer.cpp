// The training loop. Each step: zero gradients, run gradient_accumulation_steps micro-batches
// (each scaled by 1/(accum * world) so the step sees the mean), reduce gradients, loss sums and
// expert loads over the data-parallel ranks (ZeRO 0-3, train/data_parallel.hpp; at stage 3 the
// gradients are reduced per unit during the backward), clip by global norm, AdamW (on this rank's
// shard, then gather the weights; stage 3 gathers them per unit as the model runs), then, once the
// host has read the step's statistics and knows the step was not skipped (fp16 overflow), router
// bias updates. Every log_interval steps a progress line and a metrics.jsonl record; every
// eval_interval steps and at the end a held-out evaluation; every save_interval steps and at the
// end a checkpoint. A resumed run restores model, optimizer, RNG and data position and continues
// with bitwise the same losses.
#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <ostream>
#include <streambuf>

#include <nlohmann/json.hpp>

#include "moe/checkpoint.hpp"
#include "moe/comm.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/metrics.hpp"
#include "moe/model.hpp"
#include "moe/optim.hpp"
#include "moe/profiler.hpp"
#include "moe/trainer.hpp"
#include "train/code_arch_note.hpp"
#include "train/data_parallel.hpp"
#include "train/loss_scaler.hpp"
#include "train/rank_agreement.hpp"
#include "train/run_dir_probe.hpp"
#include "train/step_outcome.hpp"
#include "train/stop_signals.hpp"
#include "train/train_data.hpp"
#include "train/whole_weights.hpp"

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
    throw ConfigError("train.device",
                      "\"" + spec + "\": this machine has " + std::to_string(gpus) + " GPU(s)");
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
    if (dir.empty())
      out << "resume auto: no complete checkpoint in " << t.out_dir << ", starting fresh\n";
    return dir;
  }
  std::string dir = find_latest_checkpoint(t.resume, &out);
  if (dir.empty()) throw InputError("train.resume: no complete checkpoint in " + t.resume);
  return dir;
}

// wall: seconds since the previous log line (the device has finished every step in it, since
// each step ends by reading its statistics), so tokens / wall is the true throughput.
nlohmann::json train_record(int step, const Losses& l, double lr, double gnorm,
                            const PhaseTimes& ph, double wall, const Model& model) {
  const RoutingStats& r = model.routing();
  nlohmann::json j = {
      {"kind", "train"},
      {"step", step},
      {"loss", l.lm},
      {"aux_loss", l.aux},
      {"z_loss", l.z},
      {"mod_pred_loss", l.mod_pred},
      {"lr", lr},
      {"grad_norm", gnorm},
      {"tokens_per_s", ph.tokens / std::max(1e-9, wall)},
      {"maxvio_mean", r.maxvio_mean()},
      {"maxvio_max", r.maxvio_max()},
      {"mod_kept", r.mod_seen > 0 ? r.mod_kept / r.mod_seen : 1.0},
      {"peak_rss_mib", peak_rss_mib()},
      {"peak_gpu_mib", static_cast<double>(gpu::peak_allocated_bytes()) / 1048576.0},
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

// Mean held-out LM loss: each rank evaluates its share of the batches, the sums are reduced.
double evaluate(Ctx& ctx, TrainData& data, Model& model, DataParallel& dp, int batches,
                Tensor sums) {
  const EvalSums mine = data.evaluate(ctx, model, batches, dp.rank(), dp.world());
  double host[2] = {mine.loss_sum, static_cast<double>(mine.batches)};
  if (dp.world() > 1) {
    copy_from_host(sums, host);
    dp.all_reduce(sums);
    copy_to_host(host, sums);
  }
  return host[1] > 0 ? host[0] / host[1] : NAN;
}

}  // namespace

DType requested_compute_dtype(const Config& cfg) {
  return cfg.bf16_enabled ? DType::bf16 : cfg.fp16.enabled ? DType::f16 : DType::f32;
}

DType compute_dtype(const Config& cfg, Device dev) {
  const DType requested = requested_compute_dtype(cfg);
  if (requested == DType::f32) return requested;
  const char* key = cfg.bf16_enabled ? "bf16.enabled" : "fp16.enabled";
  if (dev.type != DeviceType::cuda)
    throw ConfigError(key,
                      "mixed precision runs on a GPU only; this run uses the CPU "
                      "(train.device): set it to false or train on a GPU");
  if (requested == DType::bf16) {
    const gpu::DeviceInfo info = gpu::device_info(dev.index);
    if (info.major < 8)
      throw ConfigError(key, info.name + " (sm_" + std::to_string(info.major) +
                                 std::to_string(info.minor) +
                                 ") has no bf16 arithmetic: use fp16.enabled instead");
  }
  return requested;
}

namespace {

// A stream that drops everything: the progress output of ranks other than 0.
class NullBuffer : public std::streambuf {
 protected:
  int overflow(int c) override { return traits_type::not_eof(c); }
  std::streamsize xsputn(const char*, std::streamsize n) override { return n; }
};

// The device of this rank: train.device, except that with several ranks on GPUs each rank takes
// the GPU pick_local_gpu gives it.
Device rank_device(const Config& cfg, const RankInfo& ranks) {
  Device dev = resolve_device(cfg.train.device);
  if (dev.type == DeviceType::cuda && ranks.world > 1)
    dev.index = pick_local_gpu(ranks, gpu::device_count());
  return dev;
}

void check_global_batch(const Config& cfg, int world) {
  const int64_t per_rank =
      int64_t{cfg.train_micro_batch_size_per_gpu} * cfg.gradient_accumulation_steps;
  if (cfg.train_batch_size != 0 && cfg.train_batch_size != per_rank * world)
    throw ConfigError("train_batch_size",
                      "must be 0 (derived) or train_micro_batch_size_per_gpu * "
                      "gradient_accumulation_steps * world size = " +
                          std::to_string(cfg.train_micro_batch_size_per_gpu) + " * " +
                          std::to_string(cfg.gradient_accumulation_steps) + " * " +
                          std::to_string(world) + " = " + std::to_string(per_rank * world) +
                          ", got " + std::to_string(cfg.train_batch_size) +
                          " (the world size is the number of launched ranks)");
}

// Options that hold for one process only, checked once the launched world size is known.
void check_world_options(const Config& cfg, int world) {
  if (cfg.train.bf16_expert_grads && world > 1)
    throw ConfigError("train.bf16_expert_grads",
                      "needs one process (the data-parallel reductions sum fp32 gradients), got " +
                          std::to_string(world) + " ranks");
}

}  // namespace

void check_runnable(const Config& cfg) {
  const RankInfo ranks = detect_ranks();
  check_global_batch(cfg, ranks.world);
  check_world_options(cfg, ranks.world);
  compute_dtype(cfg, rank_device(cfg, ranks));
  check_data_source(cfg);
  check_data_files(cfg);
  NullBuffer null_buffer;  // train() reports the skipped incomplete checkpoints
  std::ostream null_out(&null_buffer);
  // Weights to start from are found before the model is built (a resume takes their place).
  if (checkpoint_to_resume(cfg.train, null_out).empty() && !cfg.model.init_from.empty())
    find_hf_weights(cfg.model.init_from);
  // The run directory is made here: a path that cannot be one fails before the model is built.
  std::error_code ec;
  std::filesystem::create_directories(cfg.train.out_dir, ec);
  if (ec)
    throw ConfigError("train.out_dir", "cannot create the run directory \"" + cfg.train.out_dir +
                                           "\": " + ec.message());
}

// Dense bf16/fp16 tensor-core peak of the GPU, for MFU: the datasheet figures the PyTorch peers'
// MFU uses (989 TFLOP/s for H100/H200 SXM); 0 when the GPU is not in the table (MFU not shown).
double peak_flops(Device dev) {
  if (dev.type != DeviceType::cuda) return 0;
  const std::string name = gpu::device_info(dev.index).name;
  const std::pair<const char*, double> table[] = {
      {"H100 PCIe", 756e12}, {"H100", 989e12}, {"H200", 989e12}, {"H800", 989e12},
      {"A100", 312e12},      {"A800", 312e12}, {"L40S", 362e12}, {"L4", 121e12},
      {"A10", 125e12},       {"V100", 125e12}, {"T4", 65e12}};
  for (const auto& [key, flops] : table)
    if (name.find(key) != std::string::npos) return flops;
  return 0;
}

// Inside a catch of `e`: bad input met while building the model or optimizer is rethrown as it
// is (the out-of-memory wrapping below is for the rest).
static void rethrow_if_bad_input(const std::runtime_error& e) {
  if (dynamic_cast<const InputError*>(&e) || dynamic_cast<const ConfigError*>(&e)) throw;
}

TrainResult train(const Config& cfg, std::ostream& rank_out, const TrainOptions& opt) {
  const RankInfo ranks = detect_ranks();
  check_global_batch(cfg, ranks.world);
  check_world_options(cfg, ranks.world);
  const Device dev = rank_device(cfg, ranks);
  const DType compute = compute_dtype(cfg, dev);
  // Before anything is allocated on the device (ignored on the CPU: there is no GPU budget).
  if (dev.type == DeviceType::cuda)
    gpu::set_memory_limit(static_cast<size_t>(cfg.train.gpu_memory_limit_gib * 1073741824.0));
  Ctx ctx = make_ctx(dev);
  // Kept in this scope, so an exception that leaves train() also ends the comm (see comm.hpp).
  const std::unique_ptr<Comm> comm = make_comm(ranks, dev, cfg.train.comm_timeout_s);
  comm->set_stream(ctx.stream);
  NullBuffer null_buffer;
  std::ostream null_out(&null_buffer);
  std::ostream& out = ranks.rank == 0 ? rank_out : null_out;  // only rank 0 reports
  const int b = cfg.train_micro_batch_size_per_gpu, t = cfg.data.seq_len;
  const int accum = cfg.gradient_accumulation_steps;
  const int world = ranks.world;

  std::unique_ptr<Model> model_owner;
  std::unique_ptr<DataParallel> dp_owner;
  std::unique_ptr<AdamW> optimizer_owner;
  // Out of memory at start-up (the GPU's, or the host's on the CPU): say what the run needs and
  // what to change.
  const auto out_of_memory = [&](const std::runtime_error& e) {
    const ZeroPartition part =
        dp_owner ? dp_owner->partition() : ZeroPartition::whole(build_param_table(cfg.model).total);
    const ParamSharding sharding{&part, nullptr, cfg.zero_optimization.offloads_params()};
    const bool sharded = cfg.zero_optimization.stage == 3 && dp_owner;
    Model plan(cfg.model, compute, dev, b, t, /*allocate=*/false, memory_plan_of(cfg.train),
               sharded ? &sharding : nullptr);
    const double state_elems = static_cast<double>(part.local());
    const double optimizer_bytes = cfg.zero_optimization.offloads_optimizer() ? 0 : state_elems * 8;
    const double need = static_cast<double>(plan.weight_bytes()) + optimizer_bytes +
                        static_cast<double>(plan.activation_bytes()) +
                        static_cast<double>(plan.scratch_bytes());
    // With parameter offload the chunks are host memory: either may have run out.
    const std::string host =
        cfg.zero_optimization.offloads_params()
            ? " on the GPU, and zero_optimization.offload_param keeps about " +
                  std::to_string(static_cast<long>(state_elems * 8 / 1048576)) +
                  " MiB of weight and gradient chunks in host memory (pinned memory is limited "
                  "by `ulimit -l`)"
            : "";
    return std::runtime_error(std::string(e.what()) + "; this run needs about " +
                              std::to_string(static_cast<long>(need / 1048576)) +
                              " MiB (weights, gradients, AdamW state, activations)" + host +
                              ": lower train_micro_batch_size_per_gpu or data.seq_len, or use a "
                              "smaller model");
  };
  try {
    const size_t bucket_elems = cfg.zero_optimization.overlap_comm
                                    ? static_cast<size_t>(cfg.zero_optimization.reduce_bucket_size)
                                    : 0;
    dp_owner = std::make_unique<DataParallel>(
        *comm, cfg.zero_optimization.stage,
        param_unit_bounds(build_param_table(cfg.model), cfg.model), bucket_elems,
        /*host_buckets=*/cfg.zero_optimization.overlaps_offloaded_step());
    const ParamSharding sharding = dp_owner->sharding(
        cfg.zero_optimization.offloads_params(), cfg.zero_optimization.offload_param.pin_memory);
    model_owner =
        std::make_unique<Model>(cfg.model, compute, dev, b, t, true, memory_plan_of(cfg.train),
                                dp_owner->shards_params() ? &sharding : nullptr);
  } catch (const std::runtime_error& e) {
    rethrow_if_bad_input(e);
    throw out_of_memory(e);
  }
  OffloadOptions offload;
  offload.enabled = cfg.zero_optimization.offloads_optimizer();
  offload.pin_memory = cfg.zero_optimization.offload_optimizer.pin_memory;
  offload.in_place = cfg.zero_optimization.offloads_params();
  offload.overlap = cfg.zero_optimization.overlaps_offloaded_step();
  try {
    optimizer_owner =
        std::make_unique<AdamW>(cfg.optimizer, *model_owner, dp_owner->partition(), offload);
  } catch (const std::runtime_error& e) {
    rethrow_if_bad_input(e);
    if (!offload.enabled) throw out_of_memory(e);
    // The offloaded state lives in host memory: a failure here is the host's, not the GPU's.
    // m, v, master, grads (+ the second m, v and master of the overlapped update)
    const double bytes =
        static_cast<double>(dp_owner->partition().local()) * (offload.overlap ? 28 : 16);
    throw std::runtime_error(
        std::string(e.what()) + "; zero_optimization.offload_optimizer keeps this rank's AdamW " +
        "state and fp32 master weights in host memory (about " +
        std::to_string(static_cast<long>(bytes / 1048576)) +
        " MiB): free host memory, use more ranks, or set pin_memory to false (page-locked memory " +
        "is limited by `ulimit -l`)");
  }
  Model& model = *model_owner;
  DataParallel& dp = *dp_owner;
  AdamW& optimizer = *optimizer_owner;
  // Parameter offload: the CPU AdamW runs behind the next forward, which waits unit by unit.
  if (offload.in_place)
    model.set_chunk_wait([&optimizer](size_t end) { optimizer.wait_local(end); });
  // The on-device update behind the next forward, which waits unit by unit
  // (train.overlap_optimizer). --profile times the update in line, as its own op. One rank only
  // for now: beside NCCL's kernels it has not been run on several GPUs.
  if (cfg.train.overlap_optimizer && dev.type == DeviceType::cuda &&
      optimizer.updates_whole_on_device() && world == 1 && !profile::enabled()) {
    optimizer.overlap_forward(model);
    model.set_unit_wait([&optimizer](Ctx& c, int unit) { optimizer.wait_unit(c, unit); });
  }
  model.init_weights(cfg.train.seed);  // the same seed on every rank: the same weights
  optimizer.params_written();
  std::unique_ptr<TrainData> data = make_train_data(cfg);
  Buffer norm_sq(dev, sizeof(double));
  const Tensor norm_sq_t = norm_sq.as(DType::f64, {1});
  Buffer eval_sums(dev, 2 * sizeof(double));
  const Tensor eval_sums_t = eval_sums.as(DType::f64, {2});
  LossScaler scaler(cfg.fp16);

  TrainResult result;
  TrainerState state;
  const std::string resume_dir = checkpoint_to_resume(cfg.train, out);
  // Before the first collective whose sizes or order depend on what each rank was given (so far
  // each rank has only built its own model and data): the ranks must run the same job.
  if (world > 1) {
    const RunDirProbe run_dir(*comm, cfg.train.out_dir);
    check_same_on_all_ranks(*comm, run_facts(cfg, dev, resume_dir, run_dir.seen(), *data));
  }
  // ZeRO-3: saving and imports go through the whole weights on the host (whole_weights.hpp); a
  // resume reads this rank's chunks of them only.
  std::unique_ptr<Model> whole;
  if (!resume_dir.empty()) {
    load_checkpoint(resume_dir, ranks.rank, model, optimizer, state);
    data->restore(state);
    if (scaler.enabled())
      scaler.restore({state.loss_scale, static_cast<int>(state.loss_scale_hysteresis),
                      state.loss_scale_iteration, state.loss_scale_last_overflow});
    result.resumed_from = static_cast<int>(state.step);
    out << "resumed from " << resume_dir << " at step " << state.step << "\n";
  } else if (!cfg.model.init_from.empty()) {
    if (model.params_sharded()) {
      whole = make_whole_copy(model);
      init_from_hf(*whole, cfg.model.init_from);
      scatter_whole(ctx, *whole, model);
    } else {
      init_from_hf(model, cfg.model.init_from);
    }
    optimizer.params_written();
    out << "initialised weights from " << cfg.model.init_from << "\n";
  }
  whole.reset();  // host memory of the size of the weights, needed again only to save
  std::unique_ptr<MetricsWriter> metrics;
  if (ranks.rank == 0)
    metrics = std::make_unique<MetricsWriter>(cfg.train.out_dir + "/metrics.jsonl",
                                              resume_dir.empty() ? -1 : state.step);
  SaveOptions save_opt;
  save_opt.run_dir = cfg.train.out_dir;
  save_opt.keep_last = cfg.train.keep_checkpoints;
  save_opt.tokenizer_dir = data->tokenizer_dir();
  save_opt.rank = ranks.rank;
  save_opt.world = world;
  save_opt.zero_stage = cfg.zero_optimization.stage;
  save_opt.comm = comm.get();

  result.optimal_loss = data->optimal_loss();
  const ParamCounts counts = count_params(cfg.model, t);
  const double peak = peak_flops(dev);
  char line[640];
  std::snprintf(line, sizeof line,
                "model: %.3fM parameters (%.3fM active per token), activations %.1f MiB | device "
                "%s %s | data: %s | run dir: %s\n",
                counts.total / 1e6, counts.active_per_token / 1e6,
                static_cast<double>(model.activation_bytes() + model.scratch_bytes()) / 1048576.0,
                dev.str().c_str(), dtype_name(compute), data->describe().c_str(),
                cfg.train.out_dir.c_str());
  out << line;
  out << code_arch_note(dev);
  if (world > 1)
    out << "data parallel: " << world << " ranks (" << comm->backend() << ", " << ranks.launcher
        << "), ZeRO stage " << cfg.zero_optimization.stage << ", global batch "
        << int64_t{b} * accum * world << " sequences"
        << (dp.overlaps() ? ", gradients reduced in buckets during the backward" : "")
        << (dp.shards_params() ? ", each unit gathered before use and its gradient "
                                 "reduce-scattered during the backward"
                               : "")
        << (dp.shards_params() && cfg.zero_optimization.overlap_comm
                ? " (overlap_comm: nothing more to overlap at stage 3)"
                : "")
        << "\n";
  if (cfg.zero_optimization.offloads_params())
    out << "parameter offload: this rank's chunks of the weights and gradients in "
        << (cfg.zero_optimization.offload_param.pin_memory && dev.type == DeviceType::cuda
                ? "pinned "
                : "")
        << "host memory, each unit streamed in before use\n";
  if (optimizer.offloaded())
    out << "optimizer offload: AdamW state of this rank's partition in "
        << (cfg.zero_optimization.offload_optimizer.pin_memory && dev.type == DeviceType::cuda
                ? "pinned "
                : "")
        << "host memory, updated on the CPU"
        << (optimizer.overlaps_backward() ? " as each gradient bucket lands during the backward"
                                          : "")
        << "\n";
  if (optimizer.overlaps_forward())
    out << "optimizer: AdamW on the GPU's side stream behind the next forward, layer by layer\n";
  MOE_CHECK(!optimizer.overlaps_backward() || dp.overlaps(),
            "trainer: the overlapped offload step needs gradient buckets");
  out << std::flush;

  const size_t n = static_cast<size_t>(b) * t;
  std::vector<int32_t> ids(n), targets(n);
  const auto start = Clock::now();
  auto last_log = start;
  const int first_step = static_cast<int>(state.step);
  PhaseTimes phase;
  int skipped = 0;  // fp16 overflow steps since the last log line
  bool warned_no_eval = false;
  const int max_steps = cfg.train.max_steps;
  // Nothing clipped or skipped (no clipping, no loss scale) and the whole update on the device:
  // the gradient norm, then only logged, comes out of the update's own read of the gradients
  // (AdamW::step's norm_out) instead of a pass of its own, at log steps only, where it is read
  // (the update without the norm's sums moves its bytes ~6% faster: docs/perf.md, 40th session).
  // A non-finite gradient then shows as a non-finite loss at the next step.
  const bool norm_from_update =
      cfg.gradient_clipping <= 0 && !scaler.enabled() && optimizer.updates_whole_on_device();
  // From here a stop signal ends the run after the step in progress, with a checkpoint.
  const StopSignals stop_signals;
  const bool saves = cfg.train.save_at_end || cfg.train.save_interval > 0;
  if (profile::enabled()) profile::take();  // the profile covers the steps, not the set-up
  for (int step = first_step; step < max_steps; ++step) {
    // The step is queued without reading anything back; its statistics are read once at the
    // end (one wait per optimizer step, after all of its work is queued).
    // The step's first backward writes the experts' gradients. An overlapped update zeroed the
    // rest after it read them (AdamW::overlap_forward).
    if (!optimizer.overlaps_forward() || step == first_step)
      model.zero_grads(ctx, /*experts_by_backward=*/true);
    model.reset_stats(ctx);
    const double loss_scale = scaler.scale();
    const double lr = learning_rate(cfg.scheduler, cfg.optimizer.lr, step, max_steps);
    // Every rank draws the global batch's accum * world micro-batches in order and trains on
    // its own run of `accum` of them (rank r: r * accum ..); 1/world of the mean is folded into
    // the gradient scale, so the reduced gradient is the global batch's mean.
    for (int micro = 0; micro < accum * world; ++micro) {
      auto t0 = Clock::now();
      data->next(ids.data(), targets.data());
      phase.data += seconds_since(t0);
      if (micro / accum != ranks.rank) continue;
      t0 = Clock::now();
      model.upload_batch(ctx, ids.data(), targets.data());
      // The last micro-batch's backward reduces its gradient buckets as it goes (overlap_comm).
      const bool last_micro = micro % accum == accum - 1;
      Model::GradientReady hook;
      if (last_micro && optimizer.worth_overlapping()) {
        // The CPU AdamW updates each bucket as it lands on the host (AdamW::landing_hook).
        optimizer.begin_overlapped_step(model, lr, 1.0 / loss_scale);
        hook = dp.backward_hook(model, optimizer.host_gradients(), optimizer.landing_hook());
      } else if (last_micro) {
        hook = dp.backward_hook(model, optimizer.host_gradients());
      }
      try {
        model.queue_forward_backward(ctx, loss_scale / (static_cast<double>(accum) * world), hook);
      } catch (const NonFiniteError& e) {  // the CPU ops meet what a GPU run sees as a NaN loss
        throw_diverged(step + 1, e.what());
      }
      phase.forward_backward += seconds_since(t0);
    }
    auto t0 = Clock::now();
    // With several ranks a stop request rides with the losses' sum (StopSignals::agreed).
    const int stop_flag = world > 1 ? stop_signals.flag() : -1;
    if (stop_flag >= 0) model.raise_step_flag(ctx, stop_flag);
    dp.reduce_gradients_and_stats(model);
    if (dp.gradients_on_host()) optimizer.gradients_on_host();
    const bool last = step + 1 == max_steps;
    const bool log_now = (step + 1) % cfg.train.log_interval == 0 || last;
    if (norm_from_update) {
      optimizer.step(ctx, model, lr, 1.0 / loss_scale, Tensor(), 0, log_now ? norm_sq_t : Tensor());
    } else {
      dp.queue_grad_norm_sq(ctx, model, norm_sq_t);
      optimizer.step(ctx, model, lr, 1.0 / loss_scale, norm_sq_t, cfg.gradient_clipping);
    }
    dp.gather_params(model);
    // Unsharded mixed precision: the AdamW op wrote the compute copy as it updated (no convert).
    // An overlapped update refreshes the rest unit by unit itself.
    if (!optimizer.overlaps_forward())
      model.weights_changed(ctx, optimizer.writes_compute_copy(model));
    Losses sum = model.read_stats(ctx);  // waits for the step (an overlapped update goes on)
    if (world > 1) {  // read_stats divided by this rank's micro-batches; the sums cover all ranks
      sum.lm /= world, sum.aux /= world, sum.z /= world, sum.mod_pred /= world;
    }
    double gnorm_sq = 0;  // from the update: read at log steps only (0 between them)
    if (!norm_from_update || log_now) {
      if (norm_from_update) optimizer.join(ctx);  // an overlapped update writes it
      copy_to_host(ctx, &gnorm_sq, norm_sq_t);
    }
    const double gnorm = std::sqrt(gnorm_sq) / loss_scale;
    phase.optimizer += seconds_since(t0);
    // The device skipped the update exactly when the gradient norm was not finite; the host
    // follows that decision (fp16: an overflow; otherwise the run has diverged), and queues the
    // router-bias update only for a step that was not skipped. (A norm from the update skips
    // nothing: a non-finite one, at a log step, stops the run as divergence.)
    const bool overflow = finish_step(ctx, model, gnorm, sum.total(), scaler.enabled(), step + 1);
    if (overflow) {
      optimizer.undo_step();  // the bias-correction count of the skipped update
      ++skipped;
    }
    scaler.update(overflow);
    // The first step loads kernels and picks cuBLAS algorithms: the profile leaves it out
    // (when there are more steps to measure).
    if (profile::enabled()) {
      if (step == first_step && step + 1 < max_steps)
        profile::take();
      else
        ++result.profiled_steps;
    }
    phase.steps += 1;
    phase.tokens += static_cast<double>(n) * accum * world;
    state.step = step + 1;
    state.tokens_seen += static_cast<int64_t>(n) * accum * world;
    state.loss_scale = scaler.state().scale;
    state.loss_scale_hysteresis = scaler.state().hysteresis_left;
    state.loss_scale_iteration = scaler.state().iteration;
    state.loss_scale_last_overflow = scaler.state().last_overflow;
    result.losses.push_back(sum.lm);
    result.last_loss = sum.lm;
    result.steps = step + 1;
    result.skipped_steps += overflow ? 1 : 0;

    if (log_now) {
      const double wall = seconds_since(last_log);
      last_log = Clock::now();
      nlohmann::json rec = train_record(step + 1, sum, lr, gnorm, phase, wall, model);
      std::string extra;
      if (peak > 0) {  // model FLOPs per token (as `info` counts them) at the measured rate
        const double mfu =
            counts.flops_per_token * rec["tokens_per_s"].get<double>() / world / peak;
        rec["mfu"] = mfu;
        char buf[32];
        std::snprintf(buf, sizeof buf, " | mfu %.1f%%", 100 * mfu);
        extra += buf;
      }
      if (dev.type == DeviceType::cuda)
        extra += " | gpu " + std::to_string(static_cast<long>(rec["peak_gpu_mib"].get<double>())) +
                 " MiB";
      if (scaler.enabled()) {
        rec["loss_scale"] = scaler.scale();
        rec["skipped_steps"] = skipped;
        extra += " | scale " + std::to_string(static_cast<long long>(scaler.scale())) +
                 " skipped " + std::to_string(skipped);
      }
      const double tps = rec["tokens_per_s"].get<double>();
      const double eta = seconds_since(start) / (step + 1 - first_step) * (max_steps - step - 1);
      std::snprintf(line, sizeof line,
                    "step %6d/%d | loss %.4f | aux %.4f | z %.4f | mod_pred %.4f | lr %.3e | "
                    "grad_norm %.3f | tok/s %.0f | maxvio %.3f/%.3f | mod_kept %.3f%s | eta %s\n",
                    step + 1, max_steps, sum.lm, sum.aux, sum.z, sum.mod_pred, lr, gnorm, tps,
                    rec["maxvio_mean"].get<double>(), rec["maxvio_max"].get<double>(),
                    rec["mod_kept"].get<double>(), extra.c_str(), format_eta(eta).c_str());
      out << line << std::flush;
      if (metrics) metrics->write(rec);
      result.tokens_per_second = tps;
      phase = PhaseTimes{};
      skipped = 0;
    }
    if (last || (cfg.train.eval_interval > 0 && (step + 1) % cfg.train.eval_interval == 0)) {
      const double eval = evaluate(ctx, *data, model, dp, cfg.train.eval_batches, eval_sums_t);
      if (!std::isfinite(eval) && !cfg.data.val_files.empty() && !warned_no_eval) {
        out << "eval skipped: " << cfg.data.val_files
            << " holds fewer than batch * seq_len + 1 = " << n + 1 << " tokens\n";
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
        if (metrics)
          metrics->write(
              {{"kind", "eval"}, {"step", step + 1}, {"loss", eval}, {"ppl", std::exp(eval)}});
      }
      last_log = Clock::now();  // evaluation time is not training throughput
    }
    const bool stop_now = opt.stop_after_step > 0 && step + 1 == opt.stop_after_step;
    // Every rank stops after the same step: with several ranks, the one whose summed flags name
    // a signal (a signal that came after this step's flags were raised counts at the next).
    const int stop_signal = last        ? 0
                            : world > 1 ? StopSignals::agreed(sum.flags)
                                        : stop_signals.received();
    std::string saved_dir;  // this step's checkpoint, when it saves one
    if ((last && cfg.train.save_at_end) ||
        (cfg.train.save_interval > 0 && (step + 1) % cfg.train.save_interval == 0) ||
        (stop_signal != 0 && saves)) {
      optimizer.join(ctx);  // the weights and moments as this step left them
      data->save(state);
      Model* saved = &model;
      if (model.params_sharded()) {  // rank 0 writes the whole weights
        if (ranks.rank == 0) whole = make_whole_copy(model);
        gather_whole(ctx, model, whole.get());
        if (whole) saved = whole.get();
      }
      try {
        saved_dir = save_checkpoint(save_opt, cfg, *saved, optimizer, state);
      } catch (const NonFiniteError& e) {
        // The update made a weight NaN or Inf (without clipping the norm is read at log steps
        // only, and the loss shows it a step later): stopped as divergence, the checkpoint not
        // published, the earlier ones kept. (With several ranks, rank 0 writes the weights and
        // meets it; the others learn it from the save's exchange of outcomes and stop too.)
        throw_diverged(step + 1, std::string(e.what()) + "; this step's checkpoint was not saved",
                       "the weights");
      }
      whole.reset();
      out << "saved " << saved_dir << "\n" << std::flush;
      last_log = Clock::now();
    }
    if (stop_signal != 0) {
      result.stop_signal = stop_signal;
      out << "stopped by " << StopSignals::name(stop_signal) << " after step " << step + 1
          << " (loss " << sum.lm << ")"
          << (saves ? "" : ": no checkpoint saved (train.save_interval 0, save_at_end false)")
          << "\n"
          << std::flush;
      if (metrics) {  // a reader of the metrics learns why the records end here
        nlohmann::json rec = {
            {"kind", "stop"}, {"step", step + 1}, {"signal", StopSignals::name(stop_signal)}};
        rec["checkpoint"] = saved_dir.empty() ? nlohmann::json() : nlohmann::json(saved_dir);
        metrics->write(rec);
      }
      break;
    }
    if (stop_now) break;
  }
  optimizer.join(ctx);
  return result;
}

}  // namespace moe
