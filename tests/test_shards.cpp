// Token shards and their readers: the llm.c file layout (both widths) and its validation, glob
// expansion, the shuffled rank-partitioned training loader (coverage, ordering, exact resume)
// and the sequential evaluation reader.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "catch.hpp"
#include "moe/error.hpp"
#include "moe/shards.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;
namespace fs = std::filesystem;

namespace {

// A file with a hand-made header (magic, version, count) and `payload` bytes after it.
void write_raw(const std::string& path, int32_t magic, int32_t version, int32_t count,
               size_t payload_bytes) {
  std::vector<int32_t> header(kShardHeaderInts, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), header.size() * sizeof(int32_t));
  std::vector<char> payload(payload_bytes, 7);
  out.write(payload.data(), static_cast<std::streamsize>(payload.size()));
}

std::vector<uint32_t> read_all(const Shard& s) {
  std::vector<uint32_t> out(static_cast<size_t>(s.size()));
  for (int64_t i = 0; i < s.size(); ++i) out[i] = s.at(i);
  return out;
}

// Tokens k*1000 + i: every window is identified by its first token, and a window whose tokens
// are not consecutive would have crossed a shard boundary.
std::vector<std::string> numbered_shards(const TempDir& dir, const std::vector<int>& sizes) {
  std::vector<std::string> files;
  for (size_t k = 0; k < sizes.size(); ++k) {
    std::vector<uint32_t> tokens(sizes[k]);
    for (int i = 0; i < sizes[k]; ++i) tokens[i] = static_cast<uint32_t>(k * 1000 + i);
    char name[32];
    std::snprintf(name, sizeof name, "train_%06zu.bin", k);
    files.push_back(dir.file(name));
    write_shard(files.back(), tokens, 65536);
  }
  return files;
}

// Runs `batches` batches and returns each row's first token (the window's id), checking that
// every row is T consecutive tokens and its targets are the inputs shifted by one.
std::vector<int32_t> take_windows(ShardLoader& loader, int batches, int seq_len, int batch) {
  std::vector<int32_t> ids(static_cast<size_t>(seq_len) * batch), targets(ids.size());
  std::vector<int32_t> firsts;
  for (int i = 0; i < batches; ++i) {
    loader.next(ids.data(), targets.data());
    for (int b = 0; b < batch; ++b) {
      const int32_t* row = ids.data() + static_cast<size_t>(b) * seq_len;
      const int32_t* next = targets.data() + static_cast<size_t>(b) * seq_len;
      for (int t = 0; t < seq_len; ++t) {
        REQUIRE(row[t] == row[0] + t);
        REQUIRE(next[t] == row[t] + 1);
      }
      firsts.push_back(row[0]);
    }
  }
  return firsts;
}

// The first tokens of all windows of numbered shards of these sizes.
std::vector<int32_t> all_windows(const std::vector<int>& sizes, int seq_len) {
  std::vector<int32_t> firsts;
  for (size_t k = 0; k < sizes.size(); ++k)
    for (int start = 0; start + seq_len + 1 <= sizes[k]; start += seq_len)
      firsts.push_back(static_cast<int32_t>(k * 1000 + start));
  return firsts;
}

std::vector<int32_t> sorted(std::vector<int32_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("shards round-trip uint16 and uint32 tokens", "[shards]") {
  TempDir dir;
  SECTION("uint16 up to vocab 65536") {
    std::vector<uint32_t> tokens = {0, 1, 65535, 300, 7, 65534, 12345};
    write_shard(dir.file("a.bin"), tokens, 65536);
    CHECK(fs::file_size(dir.file("a.bin")) == 1024 + 2 * tokens.size());
    CHECK(!fs::exists(dir.file("a.bin.tmp")));
    Shard s(dir.file("a.bin"));
    CHECK(s.size() == static_cast<int64_t>(tokens.size()));
    CHECK(read_all(s) == tokens);
    CHECK(s.path() == dir.file("a.bin"));
  }
  SECTION("uint32 beyond vocab 65536") {
    std::vector<uint32_t> tokens = {0, 65536, 99999, 1, 70000, 65535};
    write_shard(dir.file("b.bin"), tokens, 100000);
    CHECK(fs::file_size(dir.file("b.bin")) == 1024 + 4 * tokens.size());
    Shard s(dir.file("b.bin"));
    CHECK(read_all(s) == tokens);
  }
  SECTION("an empty shard") {
    write_shard(dir.file("c.bin"), {}, 100);
    CHECK(Shard(dir.file("c.bin")).size() == 0);
  }
  SECTION("a token outside the vocabulary is a bug") {
    CHECK_THROWS_AS(write_shard(dir.file("d.bin"), {5, 100}, 100), InternalError);
  }
}

TEST_CASE("shards use llm.c's exact header", "[shards]") {
  TempDir dir;
  write_shard(dir.file("a.bin"), {10, 20, 30}, 50257);
  std::ifstream in(dir.file("a.bin"), std::ios::binary);
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), {});
  REQUIRE(bytes.size() == 1024 + 6);
  auto le32 = [&](size_t at) {
    return bytes[at] | bytes[at + 1] << 8 | bytes[at + 2] << 16 | bytes[at + 3] << 24;
  };
  CHECK(le32(0) == 20240520);
  CHECK(le32(4) == 1);
  CHECK(le32(8) == 3);
  for (size_t at = 12; at < 1024; ++at) CHECK(bytes[at] == 0);
  CHECK(bytes[1024] == 10);
  CHECK(bytes[1025] == 0);
  CHECK(bytes[1028] == 30);

  // And a hand-made uint32 shard as llm.c's newer scripts write it.
  write_raw(dir.file("w.bin"), 20240801, 7, 2, 8);
  Shard w(dir.file("w.bin"));
  CHECK(w.size() == 2);
  CHECK(w.at(0) == 0x07070707u);
}

TEST_CASE("corrupt shards throw InputError naming the file", "[shards]") {
  TempDir dir;
  const std::string f = dir.file("bad.bin");
  std::string msg;
  SECTION("missing") {
    msg = input_error_of([&] { Shard s(f); });
  }
  SECTION("shorter than the header") {
    std::ofstream(f) << "tiny";
    msg = input_error_of([&] { Shard s(f); });
    CHECK(contains(msg, "truncated"));
  }
  SECTION("truncated data") {
    write_shard(f, {1, 2, 3, 4, 5}, 100);
    fs::resize_file(f, 1024 + 7);
    msg = input_error_of([&] { Shard s(f); });
    CHECK(contains(msg, "truncated: header says 5 tokens (1034 bytes) but the file has 1031"));
  }
  SECTION("header count larger than the data") {
    write_raw(f, kShardMagicU32, kShardVersionU32, 100, 4 * 50);
    msg = input_error_of([&] { Shard s(f); });
    CHECK(contains(msg, "truncated: header says 100 tokens"));
  }
  SECTION("trailing data") {
    write_raw(f, kShardMagicU16, kShardVersionU16, 2, 6);
    msg = input_error_of([&] { Shard s(f); });
    CHECK(contains(msg, "header says 2 tokens (1028 bytes) but the file has 1030 bytes"));
  }
  SECTION("wrong magic") {
    write_raw(f, 12345, 1, 0, 0);
    msg = input_error_of([&] { Shard s(f); });
    CHECK(contains(msg, "not a token shard (magic 12345, expected 20240520 or 20240801)"));
  }
  SECTION("wrong version") {
    write_raw(f, kShardMagicU16, 7, 0, 0);
    msg = input_error_of([&] { Shard s(f); });
    CHECK(contains(msg, "version 7"));
  }
  SECTION("negative count") {
    write_raw(f, kShardMagicU16, kShardVersionU16, -3, 0);
    msg = input_error_of([&] { Shard s(f); });
    CHECK(contains(msg, "negative"));
  }
  SECTION("a directory") {
    fs::create_directories(f);
    msg = input_error_of([&] { Shard s(f); });
  }
  INFO(msg);
  CHECK(contains(msg, f));
}

TEST_CASE("expand_glob sorts its matches and rejects a pattern without any", "[shards]") {
  TempDir dir;
  for (const char* name : {"train_000002.bin", "train_000000.bin", "train_000001.bin", "x.txt"})
    std::ofstream(dir.file(name)) << "x";
  CHECK(expand_glob(dir.file("train_*.bin")) ==
        std::vector<std::string>{dir.file("train_000000.bin"), dir.file("train_000001.bin"),
                                 dir.file("train_000002.bin")});
  const std::string pattern = dir.file("val_*.bin");
  const std::string msg = input_error_of([&] { expand_glob(pattern); });
  INFO(msg);
  CHECK(contains(msg, pattern));
}

TEST_CASE("the loader visits every window once per epoch", "[loader]") {
  TempDir dir;
  const int T = 4;
  // 9 + 3 (no window) + 4 windows; 3 tokens are too few for a window of T + 1 = 5.
  const std::vector<int> sizes = {37, 3, 20};
  const auto files = numbered_shards(dir, sizes);
  const auto expected = all_windows(sizes, T);
  REQUIRE(expected.size() == 13);
  for (bool shuffle : {true, false}) {
    for (int batch : {1, 3}) {
      ShardLoader loader(files, T, batch, 0, 1, 42, shuffle);
      REQUIRE(loader.windows_per_epoch() == 13);
      // 13 * 3 windows: three whole epochs, with epoch boundaries inside batches when batch = 3.
      const auto seen = take_windows(loader, 39 / batch, T, batch);
      for (int epoch = 0; epoch < 3; ++epoch) {
        std::vector<int32_t> one(seen.begin() + 13 * epoch, seen.begin() + 13 * (epoch + 1));
        CHECK(sorted(one) == expected);
        if (!shuffle) CHECK(one == expected);  // file order
      }
      if (shuffle) CHECK(std::vector<int32_t>(seen.begin(), seen.begin() + 13) != expected);
      CHECK(loader.position().epoch == 2);
      CHECK(loader.position().cursor == 13);
    }
  }
  CHECK(ShardLoader(files, T, 1, 0, 1, 0, true).max_token() == 2019);
}

TEST_CASE("the loader's order depends on the seed and the epoch", "[loader]") {
  TempDir dir;
  const auto files = numbered_shards(dir, {401});  // 100 windows
  auto epoch_orders = [&](uint64_t seed) {
    ShardLoader loader(files, 4, 10, 0, 1, seed, true);
    return take_windows(loader, 20, 4, 10);  // two epochs
  };
  const auto a = epoch_orders(1), a2 = epoch_orders(1), b = epoch_orders(2);
  CHECK(a == a2);
  CHECK(a != b);
  CHECK(std::vector<int32_t>(a.begin(), a.begin() + 100) !=
        std::vector<int32_t>(a.begin() + 100, a.end()));
}

TEST_CASE("two ranks partition the windows", "[loader]") {
  TempDir dir;
  const int T = 5;
  const std::vector<int> sizes = {41, 20};  // 8 + 3 = 11 windows, or 12 with the third shard
  SECTION("an even number of windows: disjoint, and together all of them") {
    auto files = numbered_shards(dir, {41, 20, 6});
    const auto expected = all_windows({41, 20, 6}, T);
    REQUIRE(expected.size() == 12);
    ShardLoader r0(files, T, 2, 0, 2, 9, true), r1(files, T, 2, 1, 2, 9, true);
    CHECK(r0.windows_per_epoch() == 6);
    const auto w0 = take_windows(r0, 3, T, 2), w1 = take_windows(r1, 3, T, 2);
    std::set<int32_t> s0(w0.begin(), w0.end()), s1(w1.begin(), w1.end());
    CHECK(s0.size() == 6);
    CHECK(s1.size() == 6);
    std::vector<int32_t> both;
    std::set_intersection(s0.begin(), s0.end(), s1.begin(), s1.end(), std::back_inserter(both));
    CHECK(both.empty());
    std::vector<int32_t> all(w0);
    all.insert(all.end(), w1.begin(), w1.end());
    CHECK(sorted(all) == expected);
  }
  SECTION("an odd number: the order wraps, so each rank gets the same count") {
    auto files = numbered_shards(dir, sizes);
    ShardLoader r0(files, T, 1, 0, 2, 9, true), r1(files, T, 1, 1, 2, 9, true);
    CHECK(r0.windows_per_epoch() == 6);
    CHECK(r1.windows_per_epoch() == 6);
    auto w0 = take_windows(r0, 6, T, 1), w1 = take_windows(r1, 6, T, 1);
    std::vector<int32_t> all(w0);
    all.insert(all.end(), w1.begin(), w1.end());
    std::set<int32_t> distinct(all.begin(), all.end());
    CHECK(distinct.size() == 11);  // all windows; exactly one of them twice
    CHECK(r0.position().epoch == r1.position().epoch);
  }
  SECTION("more ranks than windows still gives every rank data") {
    auto files = numbered_shards(dir, {11});  // 2 windows
    for (int rank = 0; rank < 3; ++rank) {
      ShardLoader r(files, T, 2, rank, 3, 9, true);
      CHECK(r.windows_per_epoch() == 1);
      CHECK(take_windows(r, 2, T, 2).size() == 4);
    }
  }
}

TEST_CASE("a restored loader continues with exactly the same batches", "[loader]") {
  TempDir dir;
  const int T = 3, B = 4;
  const auto files = numbered_shards(dir, {31, 17, 23});  // 10 + 5 + 7 = 22 windows
  for (int world : {1, 2}) {
    const int rank = world - 1;
    ShardLoader probe(files, T, B, rank, world, 5, true);
    const int64_t per_epoch = probe.windows_per_epoch();
    // Saved mid-epoch, just before an epoch boundary inside the next batch, exactly at an
    // epoch's end, and deep in a later epoch.
    for (int before : {1, 2, 5, 11}) {
      ShardLoader run(files, T, B, rank, world, 5, true);
      take_windows(run, before, T, B);
      const LoaderPosition saved = run.position();
      const auto expected = take_windows(run, 8, T, B);
      ShardLoader resumed(files, T, B, rank, world, 5, true);
      resumed.restore(saved);
      INFO("world " << world << ", saved at epoch " << saved.epoch << " cursor " << saved.cursor
                    << " of " << per_epoch);
      CHECK(take_windows(resumed, 8, T, B) == expected);
      CHECK(resumed.position().epoch == run.position().epoch);
      CHECK(resumed.position().cursor == run.position().cursor);
    }
  }
  ShardLoader loader(files, T, B, 0, 1, 5, true);
  LoaderPosition beyond;
  beyond.cursor = 23;
  const std::string msg = input_error_of([&] { loader.restore(beyond); });
  CHECK(contains(msg, "22 windows per epoch"));
}

TEST_CASE("the loader rejects shards too short for one window", "[loader]") {
  TempDir dir;
  const auto files = numbered_shards(dir, {4, 5});
  const std::string msg = input_error_of([&] { ShardLoader loader(files, 5, 1, 0, 1, 0, true); });
  INFO(msg);
  CHECK(contains(msg, "seq_len + 1 = 6 tokens"));
  CHECK(contains(msg, files[0]));
  CHECK(contains(msg, files[1]));
  CHECK_THROWS_AS(ShardLoader({}, 5, 1, 0, 1, 0, true), InputError);
}

TEST_CASE("the sequential reader follows llm.c's convention", "[loader]") {
  TempDir dir;
  std::vector<uint32_t> a(21), b(8);
  for (uint32_t i = 0; i < 21; ++i) a[i] = i;
  for (uint32_t i = 0; i < 8; ++i) b[i] = 100 + i;
  write_shard(dir.file("val_000000.bin"), a, 200);
  write_shard(dir.file("val_000001.bin"), b, 200);
  // Given out of order: the reader sorts them.
  SequentialReader reader({dir.file("val_000001.bin"), dir.file("val_000000.bin")}, 3, 2);
  std::vector<int32_t> ids(6), targets(6);
  // B*T = 6: batches start at 0, 6, 12 and read 7 tokens; at 18 only 3 remain, so on to the
  // second shard, which holds one batch.
  const std::vector<std::vector<int32_t>> want_ids = {{0, 1, 2, 3, 4, 5},
                                                      {6, 7, 8, 9, 10, 11},
                                                      {12, 13, 14, 15, 16, 17},
                                                      {100, 101, 102, 103, 104, 105}};
  for (const auto& want : want_ids) {
    REQUIRE(reader.next(ids.data(), targets.data()));
    CHECK(ids == want);
    std::vector<int32_t> shifted(want);
    for (auto& t : shifted) ++t;
    CHECK(targets == shifted);
  }
  CHECK(!reader.next(ids.data(), targets.data()));
  CHECK(!reader.next(ids.data(), targets.data()));
}
