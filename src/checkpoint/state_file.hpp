// The rank_NNNNN.state file of a checkpoint (format in state_file.cpp), private to
// src/checkpoint.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_internal.hpp"
#include "checkpoint/file_io.hpp"
#include "moe/checkpoint.hpp"
#include "moe/optim.hpp"

namespace moe::checkpoint_internal {

constexpr size_t kChunkBytes = size_t{64} << 20;
constexpr uint64_t kHeaderBytes = 56, kTrainerBlockBytes = 80, kChecksumBytes = 8;

struct StateHeader {
  uint32_t magic = kStateMagic, version = kStateVersion;
  uint64_t param_count = 0;
  uint32_t dtype = 0, num_experts = 0, num_moe_layers = 0, world = 1, rank = 0, zero_stage = 0;
  uint64_t table_hash = 0, payload_bytes = 0;
};

// Where a verified state file keeps its parts.
struct StateLayout {
  StateHeader header;
  struct Range {
    uint64_t offset, count;
  };
  std::vector<Range> ranges;  // moments held, in file order
  uint64_t moments_at = 0;    // file offset of m (v follows after every range's m)
  uint64_t moment_elems = 0;  // sum of the range counts
  uint64_t weights_at = 0, weight_elems = 0;
};

// Writes this rank's state file (the moments opt.rank holds; weights on rank 0), durably.
void write_state_file(const std::string& path, const WriteHook& hook, const SaveOptions& opt,
                      const Model& model, const AdamW& optimizer, const TrainerState& state);

// Proves the file intact (size, checksum, range table) and written for this model by `rank`;
// InputError naming the file otherwise.
StateLayout open_state(const InputFile& f, const Model& model, int rank);

[[noreturn]] void corrupt_state(const std::string& path, const std::string& what);
TrainerState decode_trainer_block(const std::string& s, long& adam_step);

// The local rows of the optimizer's moments that hold global range [offset, offset + count)
// (which lies inside one of the partition's ranges).
Tensor local_moment_rows(const Tensor& moment, const ZeroPartition& part, uint64_t offset,
                         uint64_t count);

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
  void master(Model& model) {
    master_from_host_chunks(model, 0, model.table().total, kChunkBytes, [this](void* p, size_t n) {
      f_.read_at(at_, p, n);
      at_ += n;
    });
  }
  void seek(uint64_t at) { at_ = at; }

 private:
  const InputFile& f_;
  uint64_t at_ = 0;
};

}  // namespace moe::checkpoint_internal
