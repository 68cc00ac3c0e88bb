// The ranks' start-up agreement (see rank_agreement.hpp).
#include "train/rank_agreement.hpp"

#include <cstdio>
#include <cstring>
#include <map>

#include <nlohmann/json.hpp>

#include "moe/checkpoint.hpp"
#include "moe/error.hpp"
#include "moe/memory.hpp"
#include "moe/rng.hpp"

namespace moe {

namespace {

void flatten(const nlohmann::json& j, const std::string& path, RankFacts& out) {
  if (j.is_object() && !j.empty()) {
    for (auto it = j.begin(); it != j.end(); ++it)
      flatten(it.value(), path.empty() ? it.key() : path + "." + it.key(), out);
    return;
  }
  out.emplace_back(path, j.dump());  // one line: dump() escapes control characters
}

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\t') c = ' ';
  return s;
}

// "key\tvalue\n" per fact.
std::string encode(const RankFacts& facts) {
  std::string text;
  for (const auto& [key, value] : facts) text += key + '\t' + value + '\n';
  return text;
}

RankFacts decode(const std::string& text) {
  RankFacts facts;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(at, end - at);
    const size_t tab = line.find('\t');
    if (tab != std::string::npos) facts.emplace_back(line.substr(0, tab), line.substr(tab + 1));
    at = end + 1;
  }
  return facts;
}

// i32 elements on the comm's device: the dtype every comm moves.
struct Ints {
  Buffer buffer;
  Tensor t;
  Ints(Device dev, int64_t n)
      : buffer(dev, static_cast<size_t>(n) * sizeof(int32_t)), t(buffer.as(DType::i32, {n})) {}
};

// `text` of rank `root` (its byte count known to every rank) on every rank.
std::string broadcast_text(Comm& comm, const std::string& text, size_t bytes, int root) {
  const int64_t n = static_cast<int64_t>((bytes + 3) / 4);
  if (n == 0) return "";
  Ints ints(comm.device(), n);
  std::vector<char> host(static_cast<size_t>(n) * 4, '\0');
  if (comm.rank() == root) std::memcpy(host.data(), text.data(), bytes);
  copy_from_host(ints.t, host.data());
  comm.broadcast(ints.t, root);
  copy_to_host(host.data(), ints.t);
  return std::string(host.data(), bytes);
}

}  // namespace

RankFacts run_facts(const Config& cfg, Device dev, const std::string& resume_dir,
                    const std::string& run_dir_seen, TrainData& data) {
  RankFacts facts;
  flatten(config_to_json_value(cfg), "", facts);
  for (auto it = facts.begin(); it != facts.end();) {
    if (it->first == "train.gpu_memory_limit_gib") {
      it = facts.erase(it);
      continue;
    }
    if (it->first == "train.device")
      it->second = dev.type == DeviceType::cuda ? "a GPU" : "the CPU";
    if (it->first == "train.resume")
      it->second = resume_dir.empty() ? "no checkpoint (a fresh start)" : one_line(resume_dir);
    ++it;
  }
  // (after the config's keys, so a config that differs is named first)
  facts.emplace_back("train.out_dir (as each rank sees it)", one_line(run_dir_seen));
  // The first micro-batch, drawn and put back.
  const size_t n = static_cast<size_t>(cfg.train_micro_batch_size_per_gpu) * cfg.data.seq_len;
  std::vector<int32_t> ids(n), targets(n);
  TrainerState position;
  data.save(position);
  data.next(ids.data(), targets.data());
  data.restore(position);
  std::string tokens(reinterpret_cast<const char*>(targets.data()), n * sizeof(int32_t));
  tokens.append(reinterpret_cast<const char*>(ids.data()), n * sizeof(int32_t));
  char hash[24];
  std::snprintf(hash, sizeof hash, "%016llx",
                static_cast<unsigned long long>(hash_name(tokens, 0)));
  // (after the config's keys, so a config that differs is named first)
  facts.emplace_back("data", "as read: " + one_line(data.describe()) + ", first batch " + hash);
  return facts;
}

void check_same_on_all_ranks(Comm& comm, const RankFacts& facts) {
  const int world = comm.world();
  if (world == 1) return;
  const std::string text = encode(facts);
  const uint64_t hash = hash_name(text, 0);
  // [hash low, hash high, byte count] of every rank
  std::vector<int32_t> mine(3);
  std::memcpy(mine.data(), &hash, sizeof hash);
  mine[2] = static_cast<int32_t>(text.size());
  const std::vector<int32_t> table = all_gather_ints(comm, mine);
  int first = -1, differing = 0;
  for (int r = 1; r < world; ++r) {
    const int32_t* row = &table[3 * static_cast<size_t>(r)];
    if (std::memcmp(row, table.data(), 3 * sizeof(int32_t)) == 0) continue;
    ++differing;
    if (first < 0) first = r;
  }
  if (first < 0) return;
  // Every rank learns both texts, so every rank throws the same error.
  const RankFacts zero = decode(broadcast_text(comm, text, static_cast<size_t>(table[2]), 0));
  const RankFacts other = decode(broadcast_text(
      comm, text, static_cast<size_t>(table[3 * static_cast<size_t>(first) + 2]), first));
  // The keys that differ, in rank 0's order, then those only the other rank has.
  const std::map<std::string, std::string> theirs(other.begin(), other.end());
  const std::map<std::string, std::string> ours(zero.begin(), zero.end());
  std::vector<std::string> keys;
  for (const auto& [k, v] : zero) {
    const auto it = theirs.find(k);
    if (it == theirs.end() || it->second != v) keys.push_back(k);
  }
  for (const auto& [k, v] : other)
    if (!ours.count(k)) keys.push_back(k);
  const auto value = [](const std::map<std::string, std::string>& m, const std::string& k) {
    const auto it = m.find(k);
    return it == m.end() ? std::string("(absent)") : it->second;
  };
  // (two texts with the same hash and size but other facts: not met in practice)
  const std::string key = keys.empty() ? "" : keys.front();
  std::string also;
  for (size_t i = 1; i < keys.size() && i <= 5; ++i) also += (i > 1 ? ", " : "") + keys[i];
  if (keys.size() > 6) also += ", ...";
  throw ConfigError(
      key, "differs between the data-parallel ranks: " + value(ours, key) + " on rank 0, " +
               value(theirs, key) + " on rank " + std::to_string(first) +
               (differing > 1 ? " (" + std::to_string(differing) + " of the " +
                                    std::to_string(world - 1) + " other ranks differ from rank 0)"
                              : "") +
               (also.empty() ? "" : "; also differ: " + also) +
               "; every rank must get the same config and overrides, the same data files and "
               "the same run directory (train.out_dir on a shared filesystem)");
}

}  // namespace moe
