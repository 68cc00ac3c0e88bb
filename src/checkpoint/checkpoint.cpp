// Checkpoints: save, find and load step_NNNNNNNN/ directories (layout in moe/checkpoint.hpp).
//
// Durability: every file is written into step_NNNNNNNN.tmp/ and fsync'ed, the directory is
// fsync'ed and renamed into place, then DONE is written and fsync'ed. A reader only trusts a
// directory with DONE, so a crash at any point leaves either the old set of checkpoints or the
// old set plus a complete new one. An existing complete directory of the same step is moved
// aside only once its replacement is complete, and put back if publishing the new one fails.
//
// The state files themselves: src/checkpoint/state_file.cpp.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <ostream>
#include <vector>

#include "checkpoint/checkpoint_internal.hpp"
#include "checkpoint/state_file.hpp"

namespace moe {
namespace fs = std::filesystem;
using namespace checkpoint_internal;

namespace {

constexpr const char* kDoneFile = "DONE";

// ---- directories

std::string step_dir_name(int64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "step_%08" PRId64, step);
  return buf;
}

std::string state_file_name(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "rank_%05d.state", rank);
  return buf;
}

// step_<digits> exactly: step_N.tmp is never a checkpoint, and step_N.replaced is one only to
// list_step_dirs(run, true) (a crash's leftover of publish).
bool parse_step_name(const std::string& name, int64_t& step) {
  const std::string prefix = "step_";
  if (name.size() <= prefix.size() || name.size() > prefix.size() + 18 ||
      name.compare(0, prefix.size(), prefix) != 0)
    return false;
  for (size_t i = prefix.size(); i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return false;
  step = std::stoll(name.substr(prefix.size()));
  return true;
}

bool is_complete(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kDoneFile, ec);
}

struct StepDir {
  int64_t step;
  fs::path path;
  bool replaced = false;  // step_N.replaced: a complete step_N that a save of step N moved aside
};

constexpr const char* kReplacedSuffix = ".replaced";

// Step directories of a run, oldest first. with_replaced: also the step_N.replaced ones, each
// just before its step_N (so newest-first readers see step_N first).
std::vector<StepDir> list_step_dirs(const fs::path& run, bool with_replaced = false) {
  std::vector<StepDir> out;
  std::error_code ec;
  const std::string suffix = kReplacedSuffix;
  for (fs::directory_iterator it(run, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    const bool replaced = with_replaced && name.size() > suffix.size() &&
                          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    if (replaced) name.resize(name.size() - suffix.size());
    int64_t step = 0;
    std::error_code type_ec;
    if (parse_step_name(name, step) && it->is_directory(type_ec))
      out.push_back({step, it->path(), replaced});
  }
  if (ec) throw InputError(run.string() + ": cannot list directory: " + ec.message());
  std::sort(out.begin(), out.end(), [](const StepDir& a, const StepDir& b) {
    return a.step != b.step ? a.step < b.step : a.replaced > b.replaced;
  });
  return out;
}

// "run/" and "run" name the same directory; filename() of the first is empty.
fs::path without_trailing_slash(const std::string& p) {
  fs::path path(p);
  return path.has_filename() ? path : path.parent_path();
}

void make_directories(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw InputError(dir.string() + ": cannot create directory: " + ec.message());
}

void remove_tree(const fs::path& dir) {
  std::error_code ec;
  fs::remove_all(dir, ec);
  if (ec) throw InputError(dir.string() + ": cannot remove: " + ec.message());
}

void rename_path(const fs::path& from, const fs::path& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0)
    throw_io_error(from.string(), ("rename to " + to.string()).c_str(), errno);
}

void require_complete(const std::string& step_dir) {
  if (!is_complete(step_dir))
    throw InputError(step_dir + ": not a complete checkpoint (no " + kDoneFile + " marker)");
}

// DONE's line for model.safetensors: its size and checksum (the state files carry their own; the
// weights file, which eval, sample and export read, would otherwise load a flipped bit silently).
constexpr const char* kWeightsFile = "model.safetensors";

std::string weights_line(uint64_t bytes, uint64_t checksum) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016" PRIx64, checksum);
  return std::string(kWeightsFile) + " " + std::to_string(bytes) + " " + hex + "\n";
}

// Rank 0: weights, configs, tokenizer and its state file; other ranks: their state file.
// Returns rank 0's weights line for DONE (empty on the other ranks).
std::string write_step_files(const fs::path& dir, const SaveOptions& opt, const Config& cfg,
                             const Model& model, const AdamW& optimizer,
                             const TrainerState& state) {
  if (opt.rank != 0) {
    write_state_file((dir / state_file_name(opt.rank)).string(), opt.hook, opt, model, optimizer,
                     state);
    fsync_directory(dir.string());
    return "";
  }
  std::string weights;
  {
    DurableFile f((dir / kWeightsFile).string(), opt.hook);
    Checksum sum;
    f.checksum_into(&sum);
    write_safetensors_entries(f, model_safetensors_entries(model), hf_weights_metadata());
    f.commit();
    weights = weights_line(f.bytes_written(), sum.value());
  }
  write_file_durably((dir / "config.json").string(), hf_config_json(model.config()), opt.hook);
  write_file_durably((dir / "trainer_config.json").string(), config_to_json(cfg) + "\n", opt.hook);
  if (!opt.tokenizer_dir.empty()) copy_tokenizer_files(opt.tokenizer_dir, dir.string(), opt.hook);
  write_state_file((dir / state_file_name(opt.rank)).string(), opt.hook, opt, model, optimizer,
                   state);
  fsync_directory(dir.string());
  return weights;
}

// tmp -> final, then DONE ("step N" and `done_lines`). A complete directory already at
// `final_dir` waits aside until DONE is on disk, and comes back if that fails.
void publish(const fs::path& tmp, const fs::path& final_dir, int64_t step,
             const std::string& done_lines, const WriteHook& hook) {
  const fs::path run = final_dir.parent_path();
  const fs::path replaced = final_dir.string() + kReplacedSuffix;
  fs::path aside;  // a copy of this step kept until the new one's DONE is on disk
  std::error_code ec;
  if (fs::exists(final_dir, ec)) {
    if (!is_complete(final_dir) && is_complete(replaced)) {
      remove_tree(final_dir);  // an earlier crash's incomplete step_N: the complete copy stays
    } else {
      remove_tree(replaced);
      rename_path(final_dir, replaced);
    }
    aside = replaced;
  } else if (fs::exists(replaced, ec)) {
    aside = replaced;  // an earlier crash's, between the renames: removed once DONE is written
  }
  try {
    rename_path(tmp, final_dir);
    fsync_directory(run.string());
    write_file_durably((final_dir / kDoneFile).string(),
                       "step " + std::to_string(step) + "\n" + done_lines, hook);
    fsync_directory(final_dir.string());
  } catch (...) {
    // A DONE whose write or fsync failed proves nothing: drop it, and bring back the directory
    // this one was to replace.
    fs::remove(final_dir / kDoneFile, ec);
    if (!aside.empty()) {
      fs::remove_all(final_dir, ec);
      if (std::rename(aside.c_str(), final_dir.c_str()) == 0) aside.clear();
    }
    throw;
  }
  if (!aside.empty()) fs::remove_all(aside, ec);
}

// Keeps the newest `keep_last` complete checkpoints and always the one just written (a resumed
// run can write a step older than ones left by an earlier run). A complete step_N.replaced (a
// crash's, see publish) counts as step N's checkpoint, and goes at once where step_N is complete
// too. A failed removal only costs disk space, so it does not turn a successful save into an
// error.
void apply_retention(const fs::path& run, int keep_last, const fs::path& just_written) {
  std::vector<StepDir> complete;
  std::error_code ec;
  for (const StepDir& s : list_step_dirs(run, /*with_replaced=*/true)) {
    if (!is_complete(s.path)) continue;
    // (step_N.replaced is listed just before step_N)
    if (!s.replaced && !complete.empty() && complete.back().replaced &&
        complete.back().step == s.step) {
      fs::remove_all(complete.back().path, ec);
      complete.pop_back();
    }
    complete.push_back(s);
  }
  if (keep_last <= 0) return;
  const size_t keep = static_cast<size_t>(keep_last);
  for (size_t i = 0; i + keep < complete.size(); ++i) {
    if (complete[i].path == just_written) continue;
    fs::remove_all(complete[i].path, ec);
  }
}

}  // namespace

namespace checkpoint_internal {

void copy_tokenizer_files(const std::string& from_dir, const std::string& to_dir,
                          const WriteHook& hook) {
  const fs::path from(from_dir), to(to_dir);
  std::error_code ec;
  if (!fs::is_regular_file(from / "moe_tokenizer.json", ec))
    throw InputError(from_dir + ": no moe_tokenizer.json to copy");
  for (const char* name : {"moe_tokenizer.json", "tokenizer.model"}) {
    if (!fs::is_regular_file(from / name, ec)) continue;
    write_file_durably((to / name).string(), read_text_file((from / name).string()), hook);
  }
}

}  // namespace checkpoint_internal

// Every rank's outcome of writing its part of a checkpoint, exchanged by all_gather_ints.
enum : int32_t { kWritten = 0, kWriteFailed = 1, kNonFinite = 2 };

// Several ranks: rank 0 prepares step_N.tmp/, every rank writes into it (one shared directory:
// on several nodes the run directory must be on a shared filesystem), then the ranks learn each
// other's outcome: where every rank wrote its part, a barrier, then rank 0 alone publishes it
// and a second barrier keeps the others from going on before it is complete. Where a rank's
// write failed (or, rank 0, met a weight that is not finite), that rank throws its own error and
// every other rank one that names it (a NonFiniteError for a non-finite weight), nothing is
// published and rank 0 removes the partial directory: no rank is left waiting in a barrier until
// the launcher ends the job.
std::string save_checkpoint(const SaveOptions& opt, const Config& cfg, const Model& model,
                            const AdamW& optimizer, const TrainerState& state) {
  MOE_CHECK(state.step >= 0, "save_checkpoint: negative step");
  MOE_CHECK(opt.world >= 1 && opt.rank >= 0 && opt.rank < opt.world, "save_checkpoint: bad rank");
  MOE_CHECK(opt.world == 1 || (opt.comm && opt.comm->world() == opt.world),
            "save_checkpoint: several ranks need the comm (for the barriers)");
  if (opt.run_dir.empty()) throw InputError("save_checkpoint: the run directory name is empty");
  const fs::path run = without_trailing_slash(opt.run_dir);
  const fs::path final_dir = run / step_dir_name(state.step);
  const fs::path tmp = final_dir.string() + ".tmp";
  auto barrier = [&] {
    if (opt.world > 1) opt.comm->barrier();
  };
  if (opt.rank == 0) {
    make_directories(run);
    remove_tree(tmp);  // left by a crash
    make_directories(tmp);
  }
  barrier();
  std::string done_lines;
  std::exception_ptr failure;
  int32_t outcome = kWritten;
  try {
    done_lines = write_step_files(tmp, opt, cfg, model, optimizer, state);
  } catch (const NonFiniteError&) {
    failure = std::current_exception();
    outcome = kNonFinite;
  } catch (...) {
    failure = std::current_exception();
    outcome = kWriteFailed;
  }
  std::vector<int32_t> outcomes(1, outcome);
  if (opt.world > 1) outcomes = all_gather_ints(*opt.comm, {outcome});
  const auto failed =
      std::find_if(outcomes.begin(), outcomes.end(), [](int32_t o) { return o != kWritten; });
  if (failed != outcomes.end()) {
    std::error_code ec;
    if (opt.rank == 0) fs::remove_all(tmp, ec);  // frees the space a full disk needs back
    if (failure) std::rethrow_exception(failure);
    const std::string who =
        "checkpoint " + tmp.string() + ": rank " + std::to_string(failed - outcomes.begin());
    if (*failed == kNonFinite)
      throw NonFiniteError(who + " found a weight that is not finite (NaN or Inf)");
    throw std::runtime_error(who + " could not write its part (its own error says why); " +
                             "nothing was saved");
  }
  barrier();
  if (opt.rank == 0) {
    publish(tmp, final_dir, state.step, done_lines, opt.hook);
    apply_retention(run, opt.keep_last, final_dir);
  }
  barrier();
  return final_dir.string();
}

std::string find_latest_checkpoint(const std::string& run_dir, std::ostream* warn) {
  const fs::path dir = without_trailing_slash(run_dir);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return "";
  if (is_complete(dir)) return dir.string();
  int64_t step = 0;
  if (parse_step_name(dir.filename().string(), step) || fs::exists(dir / "model.safetensors", ec))
    throw InputError(dir.string() + ": incomplete checkpoint (no " + kDoneFile +
                     " marker); pass the run directory to use its newest complete checkpoint");
  // A crash while a save replaced a complete step_N (publish) leaves that copy complete in
  // step_N.replaced and step_N incomplete or missing: it is then that step's checkpoint.
  const std::vector<StepDir> steps = list_step_dirs(dir, /*with_replaced=*/true);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (is_complete(it->path)) return it->path.string();
    if (warn && !it->replaced)
      *warn << "skipping incomplete checkpoint " << it->path.string() << " (no " << kDoneFile
            << " marker)\n";
  }
  return "";
}

// Rank 0's file gives trainer state, router biases and weights (a ZeRO-3 model reads only its
// chunks of them); the moments this rank's partition needs are collected from every writer's
// file (N writers, any M readers).
void load_checkpoint(const std::string& step_dir, int rank, Model& model, AdamW& optimizer,
                     TrainerState& state) {
  require_complete(step_dir);
  const ZeroPartition& part = optimizer.partition();
  MOE_CHECK(part.total == model.table().total,
            "load_checkpoint: the optimizer was built for another model");
  MOE_CHECK(!part.sharded || part.rank == rank, "load_checkpoint: rank differs from the partition");
  const std::string path0 = (fs::path(step_dir) / state_file_name(0)).string();
  InputFile f0(path0);
  const StateLayout l0 = open_state(f0, model, 0);
  if (l0.weight_elems != l0.header.param_count)
    corrupt_state(path0, "rank 0's file holds no weights");
  const int writers = static_cast<int>(l0.header.world);
  if (writers < 1) corrupt_state(path0, "world size 0");

  // Check every file before anything is copied into the model or the optimizer.
  std::vector<std::unique_ptr<InputFile>> files;
  std::vector<StateLayout> layouts;
  uint64_t covered = 0;
  const uint64_t elem = dtype_size(model.dtype());
  struct Copy {
    size_t file;
    uint64_t file_offset;  // of the m element (v: + the file's moment_elems * elem)
    uint64_t global, count;
  };
  std::vector<Copy> copies;
  for (int k = 0; k < writers; ++k) {
    const std::string path = (fs::path(step_dir) / state_file_name(k)).string();
    files.push_back(std::make_unique<InputFile>(path));
    layouts.push_back(k == 0 ? l0 : open_state(*files.back(), model, k));
    const StateLayout& l = layouts.back();
    if (l.header.world != l0.header.world)
      corrupt_state(path, "written by a run of " + std::to_string(l.header.world) +
                              " ranks, rank 0's file says " + std::to_string(writers));
    uint64_t in_file = 0;  // elements before this range in the file's moment block
    for (const StateLayout::Range& r : l.ranges) {
      for (const ZeroPartition::Range& need : part.ranges()) {
        const uint64_t b = std::max<uint64_t>(r.offset, need.global);
        const uint64_t e = std::min<uint64_t>(r.offset + r.count, need.global + need.count);
        if (b >= e) continue;
        copies.push_back(
            {static_cast<size_t>(k), l.moments_at + (in_file + b - r.offset) * elem, b, e - b});
        covered += e - b;
      }
      in_file += r.count;
    }
  }
  if (covered != part.owned())
    throw InputError(step_dir + ": the rank_*.state files of " + std::to_string(writers) +
                     " ranks hold " + std::to_string(covered) + " of the " +
                     std::to_string(part.owned()) +
                     " optimizer moments this rank needs (missing or overlapping shards)");

  StateReader r(f0);
  r.bytes(kHeaderBytes);
  long adam_step = 0;
  const TrainerState loaded = decode_trainer_block(r.bytes(kTrainerBlockBytes), adam_step);
  for (const Tensor& b : model.router_biases()) r.tensor(b);
  if (part.local_buffers) {  // ZeRO-3: only this rank's chunks of the weights, at local places
    for (const ZeroPartition::Range& range : part.ranges()) {
      r.seek(l0.weights_at + range.global * elem);
      const auto at = static_cast<int64_t>(range.local);
      r.tensor(model.params().rows(at, at + static_cast<int64_t>(range.count)));
    }
  } else {
    r.seek(l0.weights_at);
    r.master(model);
  }
  optimizer.params_written();  // an offloaded master copy is taken from the loaded weights
  for (const Copy& c : copies) {
    StateReader cr(*files[c.file]);
    const uint64_t v_shift = layouts[c.file].moment_elems * elem;
    cr.seek(c.file_offset);
    cr.tensor(local_moment_rows(optimizer.moment1(), part, c.global, c.count));
    cr.seek(c.file_offset + v_shift);
    cr.tensor(local_moment_rows(optimizer.moment2(), part, c.global, c.count));
  }
  optimizer.set_steps_taken(adam_step);
  state = loaded;
  Ctx ctx = make_ctx(model.device());
  model.weights_changed(ctx);
}

Config load_checkpoint_config(const std::string& step_dir) {
  require_complete(step_dir);
  const std::string path = (fs::path(step_dir) / "trainer_config.json").string();
  return parse_config(read_text_file(path), {}, path);
}

// The aux-loss-free router biases steer top-K selection, so eval and sampling need them as much
// as the weights; they are training state (not a Hugging Face weight) and live in rank 0's file.
void load_router_biases(const std::string& step_dir, Model& model) {
  if (model.config().router_bias_update_rate <= 0 || model.router_biases().empty()) return;
  const std::string path = (fs::path(step_dir) / state_file_name(0)).string();
  InputFile f(path);
  open_state(f, model, 0);
  StateReader r(f);
  r.bytes(kHeaderBytes);
  r.bytes(kTrainerBlockBytes);
  for (const Tensor& b : model.router_biases()) r.tensor(b);
}

namespace checkpoint_internal {

std::vector<NamedTensor> read_checkpoint_weights(const std::string& step_dir) {
  require_complete(step_dir);
  const std::string path = (fs::path(step_dir) / kWeightsFile).string();
  const std::string done = read_text_file((fs::path(step_dir) / kDoneFile).string());
  const std::string key = std::string(kWeightsFile) + " ";
  const size_t at = done.find("\n" + key);
  if (at == std::string::npos) return read_safetensors(path);  // saved before DONE recorded it
  unsigned long long bytes = 0, want = 0;
  if (std::sscanf(done.c_str() + at + 1 + key.size(), "%llu %llx", &bytes, &want) != 2)
    throw InputError((fs::path(step_dir) / kDoneFile).string() + ": unreadable " + kWeightsFile +
                     " line");
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) throw InputError(path + ": cannot read: " + ec.message());
  if (size != bytes)
    throw InputError(path + ": " + std::to_string(size) + " bytes, but " + std::to_string(bytes) +
                     " were saved (truncated or replaced?)");
  Checksum sum;
  std::vector<NamedTensor> tensors = read_safetensors_summed(path, sum);
  if (sum.value() != want)
    throw InputError(path +
                     ": checksum mismatch: the file changed after it was saved (a disk or copy "
                     "error?)");
  return tensors;
}

}  // namespace checkpoint_internal

void load_checkpoint_weights(const std::string& step_dir, Model& model) {
  const std::string path = (fs::path(step_dir) / kWeightsFile).string();
  const std::vector<NamedTensor> tensors = read_checkpoint_weights(step_dir);
  require_finite_tensors(tensors, path);  // (before the copy: the model stays untouched)
  load_named_tensors(model, tensors, path);
  load_router_biases(step_dir, model);
}

}  // namespace moe
