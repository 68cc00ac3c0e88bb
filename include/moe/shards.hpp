// Token shards in the llm.c layout and the loaders that read them.
//
// File: a header of 256 int32 (little-endian): [0] magic, [1] version, [2] token count, rest 0;
// then the tokens. magic 20240520 + version 1 = uint16 tokens; magic 20240801 + version 7 =
// uint32 tokens. Shards are read through mmap.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moe {

constexpr int32_t kShardMagicU16 = 20240520, kShardVersionU16 = 1;
constexpr int32_t kShardMagicU32 = 20240801, kShardVersionU32 = 7;
constexpr int kShardHeaderInts = 256;

// Writes a shard atomically (temporary name, fsync, rename): uint16 tokens when every token
// fits (vocab_size <= 65536), else uint32. Throws InputError naming the file on I/O failure.
void write_shard(const std::string& path, const std::vector<uint32_t>& tokens, int64_t vocab_size);

// A read-only memory-mapped shard. Throws InputError naming the file when it is missing,
// truncated (file size disagrees with the header's count), or has a wrong magic / version.
class Shard {
 public:
  explicit Shard(const std::string& path);
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;
  int64_t size() const { return count_; }
  uint32_t at(int64_t i) const { return wide_ ? data32_[i] : data16_[i]; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  int64_t count_ = 0;
  bool wide_ = false;
  const uint16_t* data16_ = nullptr;
  const uint32_t* data32_ = nullptr;
};

// The files a glob pattern names, sorted. Throws InputError naming the pattern when none match.
std::vector<std::string> expand_glob(const std::string& pattern);

// Where a shuffled loader stands: restoring it continues with exactly the same batches.
struct LoaderPosition {
  uint64_t epoch = 0;
  uint64_t cursor = 0;  // windows of this rank already consumed in this epoch
};

// Training loader: the shards are cut into windows of seq_len + 1 tokens (never crossing a shard
// boundary; window w of a shard is tokens [w*T, w*T + T + 1), so neighbours share one token);
// each epoch visits every window once in an order shuffled from (seed, epoch) (file order when
// !shuffle); rank r of `world` takes the windows whose position in that order is r mod world.
// When the window count is not a multiple of world, the order wraps around to the next multiple,
// so every rank gets windows_per_epoch() windows and the ranks change epoch together. A batch is
// `batch` windows: ids = window[0..T), targets = window[1..T]; batches continue into the next
// epoch. Throws InputError naming the files when no shard holds T + 1 tokens.
class ShardLoader {
 public:
  ShardLoader(const std::vector<std::string>& files, int seq_len, int batch, int rank, int world,
              uint64_t seed, bool shuffle);
  ~ShardLoader();
  void next(int32_t* ids, int32_t* targets);  // [batch * seq_len] each
  LoaderPosition position() const;
  // Throws InputError when `p` does not fit these shards (other data, seq_len or world size).
  void restore(const LoaderPosition& p);
  int64_t windows_per_epoch() const;  // for this rank
  uint32_t max_token() const;         // largest token id in the shards (vocab checks)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Evaluation reader (the llm.c convention): the files in sorted order, each read sequentially
// without shuffling; within a shard, batch i uses tokens [i*B*T, i*B*T + B*T + 1) as B rows of T
// inputs and their next tokens. A shard's tail shorter than B*T + 1 tokens is skipped and reading
// continues with the next shard. Returns false when no shard has a batch left.
class SequentialReader {
 public:
  SequentialReader(const std::vector<std::string>& files, int seq_len, int batch);
  ~SequentialReader();
  bool next(int32_t* ids, int32_t* targets);
  uint32_t max_token() const;  // largest token id in the shards (vocab checks)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
