// The rank_NNNNN.state file of a checkpoint: encoding, writing and verification.
//
// rank_NNNNN.state (all little-endian), one per data-parallel rank:
//   header (56 bytes)  u32 magic "MOEC", u32 version, u64 parameter count, u32 dtype (DType),
//                      u32 experts per MoE layer, u32 MoE layers, u32 world size, u32 rank,
//                      u32 ZeRO stage, u64 parameter-table hash (names, stacks, shapes),
//                      u64 payload bytes
//   payload            TrainerState (i64 step, u64 rng state, u64 loader epoch, u64 loader
//                      cursor, f64 loss scale, i64 tokens seen, i64 loss-scale hysteresis
//                      left, i64 loss-scale iteration, i64 last overflow), i64 AdamW step,
//                      router biases [MoE layers][E],
//                      u64 R, R x (u64 offset, u64 count): the ranges of the flat parameter
//                      buffer whose AdamW moments this file holds, then m of those ranges
//                      (concatenated), v of those ranges,
//                      u64 W (P or 0), weights [W]
//                      (tensors in the model's dtype)
//   checksum (8 bytes) over header + payload (see Checksum)
// Every rank's file holds the same trainer state and router biases (they are identical on every
// rank). Rank 0's file alone holds the fp32 master weights. The moments are split by ranges:
// unsharded (ZeRO 0, or one rank) rank 0 holds [0, P) and the others none; sharded (ZeRO 1, 2)
// rank r holds its ZeroPartition chunk and rank 0 also the tail. A reader on any number of
// ranks takes, from each file, the parts of the ranges its own partition needs, so a checkpoint
// written by N ranks resumes on M. The header alone decides whether a file fits the model; the
// size and the checksum catch a truncated or corrupted file before anything is copied.
#include "checkpoint/state_file.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>

namespace moe::checkpoint_internal {

namespace {

constexpr uint64_t kMaxRanges = 1 << 20;  // a sanity bound on R (a corrupt count)

// ---- checksums

uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnvPrime;
  return h;
}

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
  put(s, h.zero_stage), put(s, h.table_hash), put(s, h.payload_bytes);
  return s;
}

StateHeader decode_header(const std::string& s) {
  StateHeader h;
  size_t at = 0;
  h.magic = get<uint32_t>(s, at), h.version = get<uint32_t>(s, at);
  h.param_count = get<uint64_t>(s, at), h.dtype = get<uint32_t>(s, at);
  h.num_experts = get<uint32_t>(s, at), h.num_moe_layers = get<uint32_t>(s, at);
  h.world = get<uint32_t>(s, at), h.rank = get<uint32_t>(s, at);
  h.zero_stage = get<uint32_t>(s, at);
  h.table_hash = get<uint64_t>(s, at), h.payload_bytes = get<uint64_t>(s, at);
  return h;
}

std::string encode_trainer_block(const TrainerState& st, long adam_step) {
  std::string s;
  put(s, int64_t{st.step}), put(s, st.rng_state), put(s, uint64_t{st.data.epoch});
  put(s, uint64_t{st.data.cursor}), put(s, st.loss_scale), put(s, int64_t{st.tokens_seen});
  put(s, int64_t{st.loss_scale_hysteresis}), put(s, int64_t{st.loss_scale_iteration});
  put(s, int64_t{st.loss_scale_last_overflow});
  put(s, int64_t{adam_step});
  return s;
}

}  // namespace

TrainerState decode_trainer_block(const std::string& s, long& adam_step) {
  TrainerState st;
  size_t at = 0;
  st.step = get<int64_t>(s, at), st.rng_state = get<uint64_t>(s, at);
  st.data.epoch = get<uint64_t>(s, at), st.data.cursor = get<uint64_t>(s, at);
  st.loss_scale = get<double>(s, at), st.tokens_seen = get<int64_t>(s, at);
  st.loss_scale_hysteresis = get<int64_t>(s, at), st.loss_scale_iteration = get<int64_t>(s, at);
  st.loss_scale_last_overflow = get<int64_t>(s, at);
  adam_step = static_cast<long>(get<int64_t>(s, at));
  return st;
}

namespace {

// Bytes of the fixed part of the payload (trainer block and router biases); false on overflow.
bool fixed_payload(const StateHeader& h, uint64_t& out) {
  if (h.dtype > static_cast<uint32_t>(DType::i32)) return false;
  const uint64_t elem = dtype_size(static_cast<DType>(h.dtype));
  uint64_t biases = 0;
  if (__builtin_mul_overflow(uint64_t{h.num_moe_layers} * h.num_experts, elem, &biases) ||
      __builtin_add_overflow(kTrainerBlockBytes, biases, &out))
    return false;
  return true;
}

// The moment ranges a rank writes: its partition's, except the shared tail (rank 0 only).
std::vector<StateLayout::Range> ranges_to_write(const ZeroPartition& part, int rank) {
  std::vector<StateLayout::Range> out;
  if (!part.sharded) {
    if (rank == 0) out.push_back({0, part.total});
    return out;
  }
  for (const ZeroPartition::Range& r : part.ranges())
    if (r.global < part.tail_begin || rank == 0) out.push_back({r.global, r.count});
  return out;
}

StateHeader header_for(const Model& model, int rank, int world, int zero_stage,
                       const std::vector<StateLayout::Range>& ranges, bool weights) {
  StateHeader h;
  h.param_count = model.table().total;
  h.dtype = static_cast<uint32_t>(model.dtype());
  h.num_experts = static_cast<uint32_t>(model.config().num_local_experts);
  h.num_moe_layers = static_cast<uint32_t>(model.router_biases().size());
  h.world = static_cast<uint32_t>(world);
  h.rank = static_cast<uint32_t>(rank);
  h.zero_stage = static_cast<uint32_t>(zero_stage);
  h.table_hash = param_table_hash(model.table());
  MOE_CHECK(fixed_payload(h, h.payload_bytes), "state payload size overflows");
  uint64_t elems = 0;
  for (const auto& r : ranges) elems += r.count;
  const uint64_t elem = dtype_size(model.dtype());
  h.payload_bytes +=
      8 + 16 * ranges.size() + 2 * elems * elem + 8 + (weights ? h.param_count * elem : 0);
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
  void master(const Model& model) {
    master_to_host_chunks(model, 0, model.table().total, kChunkBytes,
                          [this](const void* p, size_t n) { bytes(p, n); });
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

}  // namespace

// The local rows of the optimizer's moments that hold global range [offset, offset + count)
// (which lies inside one of the partition's ranges).
Tensor local_moment_rows(const Tensor& moment, const ZeroPartition& part, uint64_t offset,
                         uint64_t count) {
  for (const ZeroPartition::Range& r : part.ranges())
    if (offset >= r.global && offset + count <= r.global + r.count) {
      const auto b = static_cast<int64_t>(offset - r.global + r.local);
      return moment.rows(b, b + static_cast<int64_t>(count));
    }
  throw InternalError("checkpoint: range outside this rank's optimizer partition");
}

void write_state_file(const std::string& path, const WriteHook& hook, const SaveOptions& opt,
                      const Model& model, const AdamW& optimizer, const TrainerState& state) {
  const ZeroPartition& part = optimizer.partition();
  const std::vector<StateLayout::Range> ranges = ranges_to_write(part, opt.rank);
  const bool weights = opt.rank == 0;
  const StateHeader h = header_for(model, opt.rank, opt.world, opt.zero_stage, ranges, weights);
  StateWriter w(path, hook);
  w.bytes(encode_header(h));
  w.bytes(encode_trainer_block(state, optimizer.steps_taken()));
  for (const Tensor& b : model.router_biases()) w.tensor(b);
  std::string table;
  put(table, uint64_t{ranges.size()});
  for (const auto& r : ranges) put(table, r.offset), put(table, r.count);
  w.bytes(table);
  for (const Tensor& m : {optimizer.moment1(), optimizer.moment2()})
    for (const auto& r : ranges) w.tensor(local_moment_rows(m, part, r.offset, r.count));
  std::string count;
  put(count, uint64_t{weights ? h.param_count : 0});
  w.bytes(count);
  if (weights) w.master(model);
  w.finish();
}

[[noreturn]] void corrupt_state(const std::string& path, const std::string& what) {
  throw InputError(path + ": corrupt checkpoint state: " + what);
}

namespace {

// Reads the header and proves the whole file intact (size, then checksum, then the range table
// against the payload size) before any use.
StateLayout verified_state_layout(const InputFile& f) {
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
  StateLayout l;
  l.header = h;
  uint64_t at = 0;  // payload bytes so far
  if (!fixed_payload(h, at) || at + 8 > h.payload_bytes)
    corrupt_state(path, "header counts disagree with the payload size");
  auto read_u64 = [&](uint64_t payload_at) {
    uint64_t v = 0;
    f.read_at(kHeaderBytes + payload_at, &v, 8);
    return v;
  };
  const uint64_t count = read_u64(at);
  at += 8;
  if (count > kMaxRanges || at + 16 * count + 8 > h.payload_bytes)
    corrupt_state(path, "moment range table disagrees with the payload size");
  for (uint64_t i = 0; i < count; ++i, at += 16) {
    const StateLayout::Range r{read_u64(at), read_u64(at + 8)};
    if (r.offset > h.param_count || r.count > h.param_count - r.offset)
      corrupt_state(path, "moment range outside the parameter buffer");
    l.ranges.push_back(r);
    l.moment_elems += r.count;
  }
  const uint64_t elem = dtype_size(static_cast<DType>(h.dtype));
  l.moments_at = kHeaderBytes + at;
  if (l.moment_elems > h.payload_bytes / elem / 2 + 1)
    corrupt_state(path, "moment ranges disagree with the payload size");
  at += 2 * l.moment_elems * elem;
  if (at + 8 > h.payload_bytes) corrupt_state(path, "moment ranges disagree with the payload size");
  l.weight_elems = read_u64(at);
  at += 8;
  l.weights_at = kHeaderBytes + at;
  if ((l.weight_elems != 0 && l.weight_elems != h.param_count) ||
      at + l.weight_elems * elem != h.payload_bytes)
    corrupt_state(path, "header counts disagree with the payload size");
  return l;
}

void check_same_model(const StateHeader& h, const Model& model, int rank, const std::string& path) {
  const StateHeader want = header_for(model, rank, 1, 0, {}, false);
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

}  // namespace

StateLayout open_state(const InputFile& f, const Model& model, int rank) {
  const StateLayout l = verified_state_layout(f);
  check_same_model(l.header, model, rank, f.path());
  return l;
}

}  // namespace moe::checkpoint_internal
