// The readers over token shards: the shuffled, rank-partitioned training loader and the
// sequential evaluation reader.
//
// ShardLoader cuts each shard into windows of T + 1 tokens: window w of a shard covers tokens
// [w*T, w*T + T + 1), so consecutive windows share one token (like llm.c's B*T + 1 reads) and
// every token after a shard's first is a target exactly once per epoch. Windows never cross a
// shard boundary, so a row never mixes two shards. An epoch is a permutation of all windows
// (Fisher-Yates driven by an Rng derived from (seed, epoch)) dealt round-robin to the ranks. When
// the window count is not a multiple of the world size the order wraps around to the next
// multiple (the first few windows of the permutation are dealt twice), so every rank gets the same
// number of windows per epoch and all ranks change epoch together, even when there are fewer
// windows than ranks. Because the permutation is a pure function of (seed, epoch), the position
// is just (epoch, cursor) and a restored loader rebuilds the same order and continues exactly.
//
// SequentialReader follows llm.c's evaluation reader: each shard is read front to back in
// batches of B*T + 1 tokens that advance by B*T; the tail of a shard too short for another batch
// is skipped and reading moves on to the next shard.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "moe/error.hpp"
#include "moe/rng.hpp"
#include "moe/shards.hpp"

namespace moe {

namespace {

// At most this many files are listed by name in the "no windows" error.
constexpr size_t kMaxFilesInMessage = 5;

std::vector<std::unique_ptr<Shard>> open_shards(const std::vector<std::string>& files) {
  if (files.empty()) throw InputError("no token shard files given");
  std::vector<std::unique_ptr<Shard>> shards;
  shards.reserve(files.size());
  for (const auto& f : files) shards.push_back(std::make_unique<Shard>(f));
  return shards;
}

uint32_t max_token_of(const std::vector<std::unique_ptr<Shard>>& shards) {
  uint32_t most = 0;
  for (const auto& s : shards)
    for (int64_t i = 0; i < s->size(); ++i) most = std::max(most, s->at(i));
  return most;
}

// Windows of T + 1 tokens starting at multiples of T that fit in a shard of `size` tokens.
int64_t windows_in(int64_t size, int seq_len) {
  return size >= seq_len + 1 ? (size - 1) / seq_len : 0;
}

// ids[i] = token[start + i], targets[i] = token[start + i + 1] for i < n.
void copy_shifted(const Shard& shard, int64_t start, int64_t n, int32_t* ids, int32_t* targets) {
  for (int64_t i = 0; i < n; ++i) {
    ids[i] = static_cast<int32_t>(shard.at(start + i));
    targets[i] = static_cast<int32_t>(shard.at(start + i + 1));
  }
}

std::string no_windows_message(const std::vector<std::unique_ptr<Shard>>& shards, int seq_len) {
  std::string msg = "no training windows: every token shard is shorter than seq_len + 1 = " +
                    std::to_string(seq_len + 1) + " tokens (";
  for (size_t i = 0; i < shards.size() && i < kMaxFilesInMessage; ++i)
    msg += (i ? ", " : "") + shards[i]->path() + ": " + std::to_string(shards[i]->size());
  if (shards.size() > kMaxFilesInMessage)
    msg += ", and " + std::to_string(shards.size() - kMaxFilesInMessage) + " more";
  return msg + "); use a shorter data.seq_len or more data";
}

// The epoch's visiting order of the windows 0..total-1: a Fisher-Yates shuffle with its own
// stream, so any epoch's order can be rebuilt from the seed alone.
std::vector<int64_t> shuffled_order(int64_t total, uint64_t seed, uint64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) order[i] = i;
  Rng rng(hash_name("epoch" + std::to_string(epoch), seed));
  for (int64_t i = total - 1; i > 0; --i)
    std::swap(order[i], order[rng.below(static_cast<uint64_t>(i) + 1)]);
  return order;
}

}  // namespace

struct ShardLoader::Impl {
  std::vector<std::unique_ptr<Shard>> shards;
  std::vector<int64_t> first_window;  // [shards + 1]: global index of each shard's first window
  int seq_len = 0, batch = 0, rank = 0, world = 1;
  uint64_t seed = 0;
  bool shuffle = true;
  int64_t total_windows = 0;  // over all ranks
  int64_t per_rank = 0;       // windows of each rank per epoch (the padded order / world)
  uint64_t epoch = 0, cursor = 0;
  std::vector<int64_t> order;  // the permutation of `order_epoch` (shuffle only)
  uint64_t order_epoch = 0;
  bool has_order = false;
  mutable bool max_known = false;
  mutable uint32_t max_token = 0;

  // The global window index at position `pos` of this epoch's (padded) order.
  int64_t window_at(int64_t pos) {
    const int64_t i = pos % total_windows;
    if (!shuffle) return i;
    if (!has_order || order_epoch != epoch) {
      order = shuffled_order(total_windows, seed, epoch);
      order_epoch = epoch;
      has_order = true;
    }
    return order[static_cast<size_t>(i)];
  }

  // Shard and first token of global window `w`.
  std::pair<const Shard*, int64_t> locate(int64_t w) const {
    const auto it = std::upper_bound(first_window.begin(), first_window.end(), w);
    const auto s = static_cast<size_t>(it - first_window.begin()) - 1;
    return {shards[s].get(), (w - first_window[s]) * seq_len};
  }
};

ShardLoader::ShardLoader(const std::vector<std::string>& files, int seq_len, int batch, int rank,
                         int world, uint64_t seed, bool shuffle)
    : impl_(std::make_unique<Impl>()) {
  MOE_CHECK(seq_len >= 1 && batch >= 1, "ShardLoader: seq_len and batch must be positive");
  MOE_CHECK(world >= 1 && rank >= 0 && rank < world, "ShardLoader: rank outside [0, world)");
  Impl& m = *impl_;
  m.shards = open_shards(files);
  m.seq_len = seq_len;
  m.batch = batch;
  m.rank = rank;
  m.world = world;
  m.seed = seed;
  m.shuffle = shuffle;
  m.first_window.push_back(0);
  for (const auto& s : m.shards)
    m.first_window.push_back(m.first_window.back() + windows_in(s->size(), seq_len));
  m.total_windows = m.first_window.back();
  if (m.total_windows == 0) throw InputError(no_windows_message(m.shards, seq_len));
  m.per_rank = (m.total_windows + world - 1) / world;
}

ShardLoader::~ShardLoader() = default;

void ShardLoader::next(int32_t* ids, int32_t* targets) {
  Impl& m = *impl_;
  for (int b = 0; b < m.batch; ++b) {
    if (m.cursor == static_cast<uint64_t>(m.per_rank)) {
      ++m.epoch;
      m.cursor = 0;
    }
    const int64_t pos = static_cast<int64_t>(m.cursor) * m.world + m.rank;
    const auto [shard, start] = m.locate(m.window_at(pos));
    const size_t row = static_cast<size_t>(b) * m.seq_len;
    copy_shifted(*shard, start, m.seq_len, ids + row, targets + row);
    ++m.cursor;
  }
}

LoaderPosition ShardLoader::position() const {
  return {impl_->epoch, impl_->cursor};
}

void ShardLoader::restore(const LoaderPosition& p) {
  Impl& m = *impl_;
  // A cursor equal to the epoch's length is valid: the next batch starts the next epoch.
  if (p.cursor > static_cast<uint64_t>(m.per_rank))
    throw InputError("the saved data position (epoch " + std::to_string(p.epoch) + ", window " +
                     std::to_string(p.cursor) +
                     ") does not fit these shards, which give each "
                     "rank " +
                     std::to_string(m.per_rank) +
                     " windows per epoch (were the shards, data.seq_len or the world size "
                     "changed?)");
  m.epoch = p.epoch;
  m.cursor = p.cursor;
}

int64_t ShardLoader::windows_per_epoch() const {
  return impl_->per_rank;
}

uint32_t ShardLoader::max_token() const {
  Impl& m = *impl_;
  // Computed on first use: it touches every page of every shard.
  if (!m.max_known) {
    m.max_token = max_token_of(m.shards);
    m.max_known = true;
  }
  return m.max_token;
}

struct SequentialReader::Impl {
  std::vector<std::unique_ptr<Shard>> shards;
  int seq_len = 0, batch = 0;
  size_t shard = 0;    // the shard being read
  int64_t offset = 0;  // first token of the next batch in it
};

SequentialReader::SequentialReader(const std::vector<std::string>& files, int seq_len, int batch)
    : impl_(std::make_unique<Impl>()) {
  MOE_CHECK(seq_len >= 1 && batch >= 1, "SequentialReader: seq_len and batch must be positive");
  std::vector<std::string> sorted = files;
  std::sort(sorted.begin(), sorted.end());
  impl_->shards = open_shards(sorted);
  impl_->seq_len = seq_len;
  impl_->batch = batch;
}

SequentialReader::~SequentialReader() = default;

uint32_t SequentialReader::max_token() const {
  return max_token_of(impl_->shards);
}

bool SequentialReader::next(int32_t* ids, int32_t* targets) {
  Impl& m = *impl_;
  const int64_t n = static_cast<int64_t>(m.batch) * m.seq_len;
  for (; m.shard < m.shards.size(); ++m.shard, m.offset = 0) {
    const Shard& s = *m.shards[m.shard];
    if (m.offset + n + 1 > s.size()) continue;
    copy_shifted(s, m.offset, n, ids, targets);
    m.offset += n;
    return true;
  }
  return false;
}

}  // namespace moe
