// safetensors I/O: a round trip of every dtype the trainer uses, the exact byte layout (length
// prefix, space padding to 8 bytes, contiguous offsets), a file written by hand from the format
// description (so we read what others write, not only what we write), and one case per kind of
// corruption, each of which must be an InputError that names the file. A real full disk
// (/dev/full) must surface as an InputError with strerror too.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch.hpp"
#include "moe/checkpoint.hpp"
#include "moe/error.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;
namespace fs = std::filesystem;

namespace {

template <class T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// A file in the format from its parts: length prefix `n` (default: the header's size).
std::string raw_safetensors(const std::string& header, const std::string& data, int64_t n = -1) {
  uint64_t len = n < 0 ? header.size() : static_cast<uint64_t>(n);
  std::string out(8, '\0');
  std::memcpy(out.data(), &len, 8);
  return out + header + data;
}

// Runs f and expects an InputError whose message names `path` and contains `what`.
void require_input_error(const std::function<void()>& f, const std::string& path,
                         const std::string& what) {
  try {
    f();
    FAIL("expected an InputError mentioning \"" << what << "\"");
  } catch (const InputError& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find(what) != std::string::npos);
  }
}

std::vector<NamedTensor> sample_tensors() {
  // BF16 of 1.0, -2.5, 0.15625, 3.0 (all exact in BF16).
  const std::vector<uint16_t> bf16 = {0x3F80, 0xC020, 0x3E20, 0x4040};
  return {
      {"weights.f32", "F32", {2, 3}, as_bytes(std::vector<float>{1.5f, -2, 3, 4e-30f, 5, -0.f})},
      {"a.f64", "F64", {3}, as_bytes(std::vector<double>{1e300, -1, 0.1})},
      {"ids.i32", "I32", {2, 2}, as_bytes(std::vector<int32_t>{-7, 0, 1 << 30, 42})},
      {"half.bf16", "BF16", {4}, as_bytes(bf16)},
      {"scalar", "F32", {}, as_bytes(std::vector<float>{7})},
      {"empty", "F32", {0, 5}, {}},
  };
}

}  // namespace

TEST_CASE("safetensors round trip keeps names, dtypes, shapes and bytes", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("t.safetensors");
  const std::vector<NamedTensor> in = sample_tensors();
  write_safetensors(path, in, {{"format", "pt"}, {"note", "hello"}});
  const std::vector<NamedTensor> out = read_safetensors(path);
  REQUIRE(out.size() == in.size());
  for (const NamedTensor& t : in) {
    INFO(t.name);
    auto it = std::find_if(out.begin(), out.end(),
                           [&](const NamedTensor& o) { return o.name == t.name; });
    REQUIRE(it != out.end());
    CHECK(it->dtype == t.dtype);
    CHECK(it->shape == t.shape);
    CHECK(it->bytes == t.bytes);
  }
  // BF16 stays BF16 bytes on read: 0x3F80 is 1.0.
  auto bf =
      std::find_if(out.begin(), out.end(), [](const NamedTensor& o) { return o.dtype == "BF16"; });
  REQUIRE(bf != out.end());
  uint16_t first = 0;
  std::memcpy(&first, bf->bytes.data(), 2);
  CHECK(first == 0x3F80);
}

TEST_CASE("safetensors layout: length prefix, space padding, contiguous sorted offsets",
          "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("t.safetensors");
  const std::vector<NamedTensor> in = sample_tensors();
  write_safetensors(path, in, {{"format", "pt"}});
  const std::string bytes = read_text(path);
  REQUIRE(bytes.size() >= 8);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);  // the data section starts 8-byte aligned
  size_t data_bytes = 0;
  for (const auto& t : in) data_bytes += t.bytes.size();
  CHECK(bytes.size() == 8 + n + data_bytes);

  const std::string header = bytes.substr(8, n);
  const size_t json_end = header.find_last_not_of(' ') + 1;
  CHECK(header.size() - json_end < 8);  // only the padding follows the JSON
  CHECK(header[json_end - 1] == '}');
  const nlohmann::json h = nlohmann::json::parse(header);
  CHECK(h["__metadata__"]["format"] == "pt");

  // Offsets tile the data section in name order.
  std::vector<std::string> names;
  for (const auto& t : in) names.push_back(t.name);
  std::sort(names.begin(), names.end());
  uint64_t expected = 0;
  for (const auto& name : names) {
    INFO(name);
    const auto& offsets = h[name]["data_offsets"];
    CHECK(offsets[0].get<uint64_t>() == expected);
    expected = offsets[1].get<uint64_t>();
  }
  CHECK(expected == data_bytes);
  CHECK(h["weights.f32"]["shape"] == nlohmann::json({2, 3}));
  CHECK(h["scalar"]["shape"] == nlohmann::json::array());
}

TEST_CASE("safetensors written by hand from the format description is read", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("hand.safetensors");
  // Unpadded header, metadata after the tensors, tensor order in the file differs from names.
  const std::string header =
      R"({"b":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]},)"
      R"("a":{"dtype":"F16","shape":[2],"data_offsets":[16,20]},"__metadata__":{"k":"v"}})";
  std::vector<int32_t> ints = {1, 2, 3, 4};
  std::string data(20, '\0');
  std::memcpy(data.data(), ints.data(), 16);
  const uint16_t halfs[2] = {0x3C00, 0xC000};  // 1.0, -2.0
  std::memcpy(data.data() + 16, halfs, 4);
  write_text(path, raw_safetensors(header, data));
  const std::vector<NamedTensor> t = read_safetensors(path);
  REQUIRE(t.size() == 2);
  CHECK(t[0].name == "b");  // file order
  CHECK(t[0].shape == std::vector<int64_t>{2, 2});
  CHECK(t[0].bytes == as_bytes(ints));
  CHECK(t[1].name == "a");
  CHECK(t[1].dtype == "F16");
  CHECK(t[1].bytes.size() == 4);
}

TEST_CASE("corrupt safetensors files are InputErrors naming the file", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string one = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string eight(8, 'd');
  auto read = [&] { read_safetensors(path); };

  SECTION("missing file") {
    require_input_error(read, path, "No such file");
  }
  SECTION("shorter than the length prefix") {
    write_text(path, "abc");
    require_input_error(read, path, "less than the 8-byte header");
  }
  SECTION("header length beyond the file size") {
    write_text(path, raw_safetensors(one, eight, 1000));
    require_input_error(read, path, "exceeds the file size");
  }
  SECTION("header is not JSON") {
    write_text(path, raw_safetensors("{not json", eight));
    require_input_error(read, path, "header is not JSON");
  }
  SECTION("truncated data") {
    write_text(path, raw_safetensors(one, eight.substr(0, 5)));
    require_input_error(read, path, "outside the 5-byte data section");
  }
  SECTION("truncated copy of a real file") {
    write_safetensors(path, sample_tensors());
    fs::resize_file(path, fs::file_size(path) - 3);
    require_input_error(read, path, "outside");
  }
  SECTION("offsets out of range") {
    write_text(
        path, raw_safetensors(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,80]}})", eight));
    require_input_error(read, path, "outside");
  }
  SECTION("offsets disagree with dtype x shape") {
    write_text(path,
               raw_safetensors(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight));
    require_input_error(read, path, "needs 12 bytes");
  }
  SECTION("a gap between tensors") {
    write_text(path, raw_safetensors(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                     R"("y":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                                     std::string(12, 'd')));
    require_input_error(read, path, "contiguous");
  }
  SECTION("unknown dtype") {
    write_text(path,
               raw_safetensors(R"({"x":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", eight));
    require_input_error(read, path, "unknown dtype \"F33\"");
  }
  SECTION("negative shape") {
    write_text(
        path, raw_safetensors(R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight));
    require_input_error(read, path, "shape");
  }
  SECTION("metadata that is not string -> string") {
    write_text(path, raw_safetensors(R"({"__metadata__":{"n":3}})", ""));
    require_input_error(read, path, "__metadata__");
  }
}

TEST_CASE("a full disk while writing safetensors is an InputError with strerror", "[safetensors]") {
  if (!fs::exists("/dev/full")) return;  // Linux only
  require_input_error([] { write_safetensors("/dev/full", sample_tensors()); }, "/dev/full",
                      std::strerror(ENOSPC));
}
