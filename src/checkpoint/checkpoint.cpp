// Checkpoints: save, find and load step_NNNNNNNN/ directories (layout in moe/checkpoint.hpp).
//
// Durability: every file is written into step_NNNNNNNN.tmp/ and fsync'ed, the directory is
// fsync'ed and renamed into place, then DONE is written and fsync'ed. A reader only trusts a
// directory with DONE, so a crash at any point leaves either the old set of checkpoints or the
// old set plus a complete new one. An existing complete directory of the same step is moved
// aside only once its replacement is complete, and put back if publishing the new one fails.
//
// rank_NNNNN.state (all little-endian):
//   header (56 bytes)  u32 magic "MOEC", u32 version, u64 parameter count, u32 dtype (DType),
//                      u32 experts per MoE layer, u32 MoE layers, u32 world size, u32 rank,
//                      u32 zero, u64 parameter-table hash (names, stacks, shapes),
//                      u64 payload bytes
//   payload            TrainerState (i64 step, u64 rng state, u64 loader epoch, u64 loader
//                      cursor, f64 loss scale, i64 tokens seen), i64 AdamW step,
//                      router biases [MoE layers][E], AdamW m [P], AdamW v [P], weights [P]
//                      (tensors in the model's dtype)
//   checksum (8 bytes) over header + payload (see Checksum)
// The header alone decides whether a file fits the model; the size and the checksum catch a
// truncated or corrupted file before anything is copied into the model.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <ostream>

#include "checkpoint/checkpoint_internal.hpp"

namespace moe {
namespace fs = std::filesystem;
using namespace checkpoint_internal;

namespace {

constexpr size_t kChunkBytes = size_t{64} << 20;
constexpr uint64_t kHeaderBytes = 56, kTrainerBlockBytes = 56, kChecksumBytes = 8;
constexpr const char* kDoneFile = "DONE";
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ULL, kFnvPrime = 0x100000001b3ULL;

// ---- checksums

uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnvPrime;
  return h;
}

// FNV-1a 64 taken over 8-byte little-endian words instead of bytes (the tail zero-padded, the
// length mixed in last): eight times faster on multi-gigabyte optimizer state, and each step
// (h ^ w) * prime is a bijection of h, so a single corrupted word always changes the result.
class Checksum {
 public:
  void update(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    length_ += n;
    while (n > 0 && tail_n_ > 0) {
      tail_[tail_n_++] = *p++;
      --n;
      if (tail_n_ == 8) flush_tail();
    }
    for (; n >= 8; p += 8, n -= 8) {
      uint64_t w;
      std::memcpy(&w, p, 8);
      mix(w);
    }
    while (n-- > 0) tail_[tail_n_++] = *p++;
  }
  uint64_t value() const {
    Checksum c = *this;
    if (c.tail_n_ > 0) {
      while (c.tail_n_ < 8) c.tail_[c.tail_n_++] = 0;
      c.flush_tail();
    }
    c.mix(length_);
    return c.h_;
  }

 private:
  void mix(uint64_t w) { h_ = (h_ ^ w) * kFnvPrime; }
  void flush_tail() {
    uint64_t w;
    std::memcpy(&w, tail_, 8);
    mix(w);
    tail_n_ = 0;
  }
  uint64_t h_ = kFnvOffset, length_ = 0;
  uint8_t tail_[8] = {};
  size_t tail_n_ = 0;
};

uint64_t param_table_hash(const ParamTable& t) {
  uint64_t h = kFnvOffset;
  for (const ParamInfo& p : t.params) {
    h = fnv1a(h, p.name.c_str(), p.name.size() + 1);  // with the '\0', so names cannot run together
    const int64_t stack = p.stack, ndim = static_cast<int64_t>(p.shape.size());
    h = fnv1a(h, &stack, 8);
    h = fnv1a(h, &ndim, 8);
    h = fnv1a(h, p.shape.data(), p.shape.size() * 8);
  }
  return h;
}

// ---- the state file

struct StateHeader {
  uint32_t magic = kStateMagic, version = kStateVersion;
  uint64_t param_count = 0;
  uint32_t dtype = 0, num_experts = 0, num_moe_layers = 0, world = 1, rank = 0;
  uint64_t table_hash = 0, payload_bytes = 0;
};

template <class T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <class T>
T get(const std::string& in, size_t& at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof(T));
  at += sizeof(T);
  return v;
}

std::string encode_header(const StateHeader& h) {
  std::string s;
  put(s, h.magic), put(s, h.version), put(s, h.param_count), put(s, h.dtype);
  put(s, h.num_experts), put(s, h.num_moe_layers), put(s, h.world), put(s, h.rank);
  put(s, uint32_t{0}), put(s, h.table_hash), put(s, h.payload_bytes);
  return s;
}

StateHeader decode_header(const std::string& s) {
  StateHeader h;
  size_t at = 0;
  h.magic = get<uint32_t>(s, at), h.version = get<uint32_t>(s, at);
  h.param_count = get<uint64_t>(s, at), h.dtype = get<uint32_t>(s, at);
  h.num_experts = get<uint32_t>(s, at), h.num_moe_layers = get<uint32_t>(s, at);
  h.world = get<uint32_t>(s, at), h.rank = get<uint32_t>(s, at);
  get<uint32_t>(s, at);
  h.table_hash = get<uint64_t>(s, at), h.payload_bytes = get<uint64_t>(s, at);
  return h;
}

std::string encode_trainer_block(const TrainerState& st, long adam_step) {
  std::string s;
  put(s, int64_t{st.step}), put(s, st.rng_state), put(s, uint64_t{st.data.epoch});
  put(s, uint64_t{st.data.cursor}), put(s, st.loss_scale), put(s, int64_t{st.tokens_seen});
  put(s, int64_t{adam_step});
  return s;
}

TrainerState decode_trainer_block(const std::string& s, long& adam_step) {
  TrainerState st;
  size_t at = 0;
  st.step = get<int64_t>(s, at), st.rng_state = get<uint64_t>(s, at);
  st.data.epoch = get<uint64_t>(s, at), st.data.cursor = get<uint64_t>(s, at);
  st.loss_scale = get<double>(s, at), st.tokens_seen = get<int64_t>(s, at);
  adam_step = static_cast<long>(get<int64_t>(s, at));
  return st;
}

// Payload bytes the header's counts imply; false when they overflow (a corrupt header).
bool implied_payload(const StateHeader& h, uint64_t& out) {
  if (h.dtype > static_cast<uint32_t>(DType::i32)) return false;
  const uint64_t elem = dtype_size(static_cast<DType>(h.dtype));
  uint64_t biases = 0, params = 0;
  if (__builtin_mul_overflow(uint64_t{h.num_moe_layers} * h.num_experts, elem, &biases) ||
      __builtin_mul_overflow(h.param_count, 3 * elem, &params) ||
      __builtin_add_overflow(kTrainerBlockBytes + biases, params, &out))
    return false;
  return true;
}

StateHeader header_for(const Model& model, int rank, int world) {
  StateHeader h;
  h.param_count = model.table().total;
  h.dtype = static_cast<uint32_t>(model.dtype());
  h.num_experts = static_cast<uint32_t>(model.config().num_local_experts);
  h.num_moe_layers = static_cast<uint32_t>(model.router_biases().size());
  h.world = static_cast<uint32_t>(world);
  h.rank = static_cast<uint32_t>(rank);
  h.table_hash = param_table_hash(model.table());
  MOE_CHECK(implied_payload(h, h.payload_bytes), "state payload size overflows");
  return h;
}

// Writes through to the file and the checksum at once.
class StateWriter {
 public:
  StateWriter(const std::string& path, const WriteHook& hook) : file_(path, hook) {}
  void bytes(const void* p, size_t n) {
    sum_.update(p, n);
    file_.write(p, n);
  }
  void bytes(const std::string& s) { bytes(s.data(), s.size()); }
  void tensor(const Tensor& t) {
    tensor_to_host_chunks(t, kChunkBytes, [this](const void* p, size_t n) { bytes(p, n); });
  }
  void finish() {
    const uint64_t c = sum_.value();
    file_.write(&c, 8);
    file_.commit();
  }

 private:
  DurableFile file_;
  Checksum sum_;
};

void write_state_file(const std::string& path, const WriteHook& hook, const SaveOptions& opt,
                      const Model& model, const AdamW& optimizer, const TrainerState& state) {
  const StateHeader h = header_for(model, opt.rank, opt.world);
  StateWriter w(path, hook);
  w.bytes(encode_header(h));
  w.bytes(encode_trainer_block(state, optimizer.steps_taken()));
  for (const Tensor& b : model.router_biases()) w.tensor(b);
  w.tensor(optimizer.moment1());
  w.tensor(optimizer.moment2());
  w.tensor(model.params());
  w.finish();
}

[[noreturn]] void corrupt_state(const std::string& path, const std::string& what) {
  throw InputError(path + ": corrupt checkpoint state: " + what);
}

// Reads the header and proves the whole file intact (size, then checksum) before any use.
StateHeader verified_state_header(const InputFile& f) {
  const std::string& path = f.path();
  if (f.size() < kHeaderBytes + kChecksumBytes)
    corrupt_state(path, "only " + std::to_string(f.size()) + " bytes (truncated)");
  std::string raw(kHeaderBytes, '\0');
  f.read_at(0, raw.data(), raw.size());
  const StateHeader h = decode_header(raw);
  if (h.magic != kStateMagic) corrupt_state(path, "bad magic (not a moe-train state file)");
  if (h.version != kStateVersion)
    throw InputError(path + ": state file version " + std::to_string(h.version) +
                     ", this build reads version " + std::to_string(kStateVersion));
  if (h.payload_bytes > f.size() || f.size() != kHeaderBytes + h.payload_bytes + kChecksumBytes)
    corrupt_state(path, "file has " + std::to_string(f.size()) + " bytes, its header says " +
                            std::to_string(kHeaderBytes + h.payload_bytes + kChecksumBytes) +
                            " (truncated?)");
  Checksum sum;
  std::vector<uint8_t> buf(std::min<uint64_t>(kChunkBytes, f.size()));
  const uint64_t end = f.size() - kChecksumBytes;
  for (uint64_t at = 0; at < end;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), end - at));
    f.read_at(at, buf.data(), n);
    sum.update(buf.data(), n);
    at += n;
  }
  uint64_t stored = 0;
  f.read_at(end, &stored, 8);
  if (stored != sum.value()) corrupt_state(path, "checksum mismatch");
  uint64_t implied = 0;
  if (!implied_payload(h, implied) || implied != h.payload_bytes)
    corrupt_state(path, "header counts disagree with the payload size");
  return h;
}

void check_same_model(const StateHeader& h, const Model& model, int rank, const std::string& path) {
  const StateHeader want = header_for(model, rank, 1);
  if (h.table_hash != want.table_hash || h.param_count != want.param_count ||
      h.dtype != want.dtype || h.num_experts != want.num_experts ||
      h.num_moe_layers != want.num_moe_layers) {
    char hashes[64];
    std::snprintf(hashes, sizeof hashes, "%016" PRIx64 " vs %016" PRIx64, h.table_hash,
                  want.table_hash);
    throw InputError(path + ": checkpoint was written for a different model (" +
                     std::to_string(h.param_count) + " " + dtype_name(static_cast<DType>(h.dtype)) +
                     " parameters, " + std::to_string(h.num_moe_layers) + " MoE layers of " +
                     std::to_string(h.num_experts) + " experts; this model has " +
                     std::to_string(want.param_count) + " " + dtype_name(model.dtype()) +
                     " parameters, " + std::to_string(want.num_moe_layers) + " MoE layers of " +
                     std::to_string(want.num_experts) + " experts; parameter table hash " + hashes +
                     ")");
  }
  if (h.rank != static_cast<uint32_t>(rank))
    corrupt_state(path, "written by rank " + std::to_string(h.rank) + ", loaded as rank " +
                            std::to_string(rank));
}

// Sequential reads from a verified state file.
class StateReader {
 public:
  explicit StateReader(const InputFile& f) : f_(f) {}
  std::string bytes(size_t n) {
    std::string s(n, '\0');
    f_.read_at(at_, s.data(), n);
    at_ += n;
    return s;
  }
  void tensor(const Tensor& t) {
    tensor_from_host_chunks(t, kChunkBytes, [this](void* p, size_t n) {
      f_.read_at(at_, p, n);
      at_ += n;
    });
  }

 private:
  const InputFile& f_;
  uint64_t at_ = 0;
};

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

// step_<digits> exactly: step_N.tmp and step_N.replaced are never checkpoints.
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
};

// Step directories of a run, oldest first.
std::vector<StepDir> list_step_dirs(const fs::path& run) {
  std::vector<StepDir> out;
  std::error_code ec;
  for (fs::directory_iterator it(run, ec), end; !ec && it != end; it.increment(ec)) {
    int64_t step = 0;
    std::error_code type_ec;
    if (parse_step_name(it->path().filename().string(), step) && it->is_directory(type_ec))
      out.push_back({step, it->path()});
  }
  if (ec) throw InputError(run.string() + ": cannot list directory: " + ec.message());
  std::sort(out.begin(), out.end(),
            [](const StepDir& a, const StepDir& b) { return a.step < b.step; });
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

void write_step_files(const fs::path& dir, const SaveOptions& opt, const Config& cfg,
                      const Model& model, const AdamW& optimizer, const TrainerState& state) {
  {
    DurableFile f((dir / "model.safetensors").string(), opt.hook);
    write_safetensors_entries(f, model_safetensors_entries(model), hf_weights_metadata());
    f.commit();
  }
  write_file_durably((dir / "config.json").string(), hf_config_json(model.config()), opt.hook);
  write_file_durably((dir / "trainer_config.json").string(), config_to_json(cfg) + "\n", opt.hook);
  if (!opt.tokenizer_dir.empty()) copy_tokenizer_files(opt.tokenizer_dir, dir.string(), opt.hook);
  write_state_file((dir / state_file_name(opt.rank)).string(), opt.hook, opt, model, optimizer,
                   state);
  fsync_directory(dir.string());
}

// tmp -> final, then DONE. A complete directory already at `final_dir` waits aside until DONE is
// on disk, and comes back if that fails.
void publish(const fs::path& tmp, const fs::path& final_dir, int64_t step, const WriteHook& hook) {
  const fs::path run = final_dir.parent_path();
  fs::path aside;
  std::error_code ec;
  if (fs::exists(final_dir, ec)) {
    aside = final_dir.string() + ".replaced";
    remove_tree(aside);
    rename_path(final_dir, aside);
  }
  try {
    rename_path(tmp, final_dir);
    fsync_directory(run.string());
    write_file_durably((final_dir / kDoneFile).string(), "step " + std::to_string(step) + "\n",
                       hook);
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
// run can write a step older than ones left by an earlier run). A failed removal only costs disk
// space, so it does not turn a successful save into an error.
void apply_retention(const fs::path& run, int keep_last, const fs::path& just_written) {
  if (keep_last <= 0) return;
  std::vector<StepDir> complete;
  for (const StepDir& s : list_step_dirs(run))
    if (is_complete(s.path)) complete.push_back(s);
  const size_t keep = static_cast<size_t>(keep_last);
  for (size_t i = 0; i + keep < complete.size(); ++i) {
    if (complete[i].path == just_written) continue;
    std::error_code ec;
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

std::string save_checkpoint(const SaveOptions& opt, const Config& cfg, const Model& model,
                            const AdamW& optimizer, const TrainerState& state) {
  MOE_CHECK(state.step >= 0, "save_checkpoint: negative step");
  // Several ranks would each write their state file and then need a barrier before rank 0's
  // rename; SaveOptions carries no communicator for that yet.
  MOE_CHECK(opt.world == 1 && opt.rank == 0,
            "save_checkpoint: world > 1 needs a barrier before the rename, which SaveOptions does "
            "not carry");
  if (opt.run_dir.empty()) throw InputError("save_checkpoint: the run directory name is empty");
  const fs::path run = without_trailing_slash(opt.run_dir);
  make_directories(run);
  const fs::path final_dir = run / step_dir_name(state.step);
  const fs::path tmp = final_dir.string() + ".tmp";
  remove_tree(tmp);  // left by a crash
  make_directories(tmp);
  try {
    write_step_files(tmp, opt, cfg, model, optimizer, state);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);  // frees the space a full disk needs back
    throw;
  }
  publish(tmp, final_dir, state.step, opt.hook);
  apply_retention(run, opt.keep_last, final_dir);
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
  const std::vector<StepDir> steps = list_step_dirs(dir);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (is_complete(it->path)) return it->path.string();
    if (warn)
      *warn << "skipping incomplete checkpoint " << it->path.string() << " (no " << kDoneFile
            << " marker)\n";
  }
  return "";
}

void load_checkpoint(const std::string& step_dir, int rank, Model& model, AdamW& optimizer,
                     TrainerState& state) {
  require_complete(step_dir);
  const std::string path = (fs::path(step_dir) / state_file_name(rank)).string();
  InputFile f(path);
  const StateHeader h = verified_state_header(f);
  check_same_model(h, model, rank, path);
  MOE_CHECK(optimizer.moment1().numel() == static_cast<int64_t>(h.param_count),
            "load_checkpoint: the optimizer was built for another model");
  StateReader r(f);
  r.bytes(kHeaderBytes);
  long adam_step = 0;
  const TrainerState loaded = decode_trainer_block(r.bytes(kTrainerBlockBytes), adam_step);
  for (const Tensor& b : model.router_biases()) r.tensor(b);
  r.tensor(optimizer.moment1());
  r.tensor(optimizer.moment2());
  r.tensor(model.params());
  optimizer.set_steps_taken(adam_step);
  state = loaded;
  Ctx ctx = make_ctx(model.params().device);
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
  const StateHeader h = verified_state_header(f);
  check_same_model(h, model, 0, path);
  StateReader r(f);
  r.bytes(kHeaderBytes);
  r.bytes(kTrainerBlockBytes);
  for (const Tensor& b : model.router_biases()) r.tensor(b);
}

void load_checkpoint_weights(const std::string& step_dir, Model& model) {
  require_complete(step_dir);
  const std::string path = (fs::path(step_dir) / "model.safetensors").string();
  load_named_tensors(model, read_safetensors(path), path);
  load_router_biases(step_dir, model);
}

}  // namespace moe
