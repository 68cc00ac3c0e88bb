// safetensors, the Hugging Face weight format: an 8-byte little-endian header length N, N bytes
// of JSON {name: {"dtype", "shape", "data_offsets": [begin, end)}, "__metadata__": {str: str}}
// (padded with spaces so the data starts 8-byte aligned), then the data, offsets relative to its
// start. The reader trusts nothing it has not checked against the file size: a file from outside
// (a download, a half-copied shard) fails with an InputError naming it, never with a bad read.
#include <algorithm>
#include <numeric>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_internal.hpp"

namespace moe {
namespace checkpoint_internal {

namespace {

// The safetensors crate refuses larger headers too; a bigger length means a corrupt file.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

struct DtypeSize {
  const char* name;
  size_t size;
};
constexpr DtypeSize kDtypes[] = {{"BOOL", 1},    {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1},
                                 {"F8_E5M2", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
                                 {"BF16", 2},    {"I32", 4}, {"U32", 4}, {"F32", 4},
                                 {"I64", 8},     {"U64", 8}, {"F64", 8}};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Bytes of a tensor; false on overflow (a corrupt shape must not wrap around to a small size).
bool tensor_bytes(const std::vector<int64_t>& shape, size_t elem, uint64_t& out) {
  uint64_t n = elem;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  out = n;
  return true;
}

std::string header_text(const std::vector<SafetensorsEntry>& entries, const Metadata& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) m[key] = value;
    h["__metadata__"] = std::move(m);
  }
  uint64_t offset = 0;
  for (const auto& e : entries) {
    nlohmann::ordered_json t = nlohmann::ordered_json::object();
    t["dtype"] = e.dtype;
    t["shape"] = e.shape;
    t["data_offsets"] = {offset, offset + e.nbytes};
    h[e.name] = std::move(t);
    offset += e.nbytes;
  }
  std::string text = h.dump();
  // Padding to a multiple of 8 keeps the data aligned for readers that mmap and cast.
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

void check_entries(const std::vector<SafetensorsEntry>& entries, const std::string& path) {
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    MOE_CHECK(e.name != "__metadata__" && !e.name.empty(), path + ": bad tensor name");
    MOE_CHECK(i == 0 || entries[i - 1].name != e.name, path + ": duplicate tensor " + e.name);
    uint64_t bytes = 0;
    const size_t elem = safetensors_dtype_size(e.dtype);
    MOE_CHECK(elem > 0, path + ": tensor " + e.name + " has unknown dtype " + e.dtype);
    MOE_CHECK(tensor_bytes(e.shape, elem, bytes) && bytes == e.nbytes,
              path + ": tensor " + e.name + " has " + std::to_string(e.nbytes) +
                  " bytes, its dtype and shape " + shape_text(e.shape) + " need " +
                  std::to_string(bytes));
  }
}

// ---- reading

struct HeaderEntry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  throw InputError(path + ": not a valid safetensors file: " + what);
}

std::vector<int64_t> parse_shape(const nlohmann::json& j, const std::string& path,
                                 const std::string& name) {
  if (!j.is_array()) corrupt(path, "tensor " + name + ": \"shape\" is not an array");
  std::vector<int64_t> shape;
  for (const auto& d : j) {
    if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0))
      corrupt(path, "tensor " + name + ": \"shape\" holds " + std::string(d.type_name()) +
                        ", not only non-negative integers");  // no dump: it may nest deep
    shape.push_back(d.get<int64_t>());
  }
  return shape;
}

HeaderEntry parse_entry(const std::string& name, const nlohmann::json& j, const std::string& path) {
  if (!j.is_object()) corrupt(path, "tensor " + name + ": entry is not an object");
  HeaderEntry e;
  e.name = name;
  auto dtype = j.find("dtype");
  if (dtype == j.end() || !dtype->is_string())
    corrupt(path, "tensor " + name + ": \"dtype\" is missing or not a string");
  e.dtype = dtype->get<std::string>();
  if (safetensors_dtype_size(e.dtype) == 0)
    corrupt(path, "tensor " + name + ": unknown dtype \"" + e.dtype + "\"");
  auto shape = j.find("shape");
  if (shape == j.end()) corrupt(path, "tensor " + name + ": \"shape\" is missing");
  e.shape = parse_shape(*shape, path, name);
  auto offsets = j.find("data_offsets");
  if (offsets == j.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned())
    corrupt(path, "tensor " + name + ": \"data_offsets\" is not [begin, end]");
  e.begin = (*offsets)[0].get<uint64_t>();
  e.end = (*offsets)[1].get<uint64_t>();
  return e;
}

void check_metadata(const nlohmann::json& m, const std::string& path) {
  if (!m.is_object()) corrupt(path, "\"__metadata__\" is not an object");
  for (const auto& item : m.items())
    if (!item.value().is_string())
      corrupt(path, "\"__metadata__\" value of \"" + item.key() + "\" is not a string");
}

// Offsets must lie in the data section, match dtype x shape, and tile the data section exactly
// (no gaps, no overlaps): the same rules as the reference implementation.
void check_layout(std::vector<HeaderEntry>& entries, uint64_t data_bytes, const std::string& path) {
  std::sort(entries.begin(), entries.end(),
            [](const HeaderEntry& a, const HeaderEntry& b) { return a.begin < b.begin; });
  uint64_t expected_begin = 0;
  for (const auto& e : entries) {
    if (e.begin > e.end || e.end > data_bytes)
      corrupt(path, "tensor " + e.name + ": data_offsets [" + std::to_string(e.begin) + ", " +
                        std::to_string(e.end) + ") outside the " + std::to_string(data_bytes) +
                        "-byte data section (truncated file?)");
    uint64_t bytes = 0;
    if (!tensor_bytes(e.shape, safetensors_dtype_size(e.dtype), bytes) || bytes != e.end - e.begin)
      corrupt(path, "tensor " + e.name + ": " + e.dtype + " " + shape_text(e.shape) + " needs " +
                        std::to_string(bytes) + " bytes, data_offsets give " +
                        std::to_string(e.end - e.begin));
    if (e.begin != expected_begin)
      corrupt(path, "tensor " + e.name + ": data starts at " + std::to_string(e.begin) +
                        ", expected " + std::to_string(expected_begin) +
                        " (tensors must be contiguous)");
    expected_begin = e.end;
  }
  if (expected_begin != data_bytes)
    corrupt(path, "the tensors cover " + std::to_string(expected_begin) + " bytes of the " +
                      std::to_string(data_bytes) + "-byte data section");
}

std::vector<HeaderEntry> parse_header(const std::string& text, uint64_t data_bytes,
                                      const std::string& path) {
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    corrupt(path, std::string("header is not JSON (") + e.what() + ")");
  }
  if (!h.is_object()) corrupt(path, "header is not a JSON object");
  std::vector<HeaderEntry> entries;
  for (const auto& item : h.items()) {
    if (item.key() == "__metadata__")
      check_metadata(item.value(), path);
    else
      entries.push_back(parse_entry(item.key(), item.value(), path));
  }
  check_layout(entries, data_bytes, path);
  return entries;
}

uint64_t read_header_length(const InputFile& f) {
  if (f.size() < 8)
    corrupt(f.path(), "only " + std::to_string(f.size()) + " bytes, less than the 8-byte header");
  uint64_t n = 0;
  f.read_at(0, &n, 8);
  if (n > f.size() - 8)
    corrupt(f.path(), "header length " + std::to_string(n) + " exceeds the file size (" +
                          std::to_string(f.size()) + " bytes; truncated?)");
  if (n > kMaxHeaderBytes)
    corrupt(f.path(), "header length " + std::to_string(n) + " is too large");
  if (n < 2) corrupt(f.path(), "header length " + std::to_string(n) + " is too small");
  return n;
}

}  // namespace

size_t safetensors_dtype_size(const std::string& dtype) {
  for (const auto& d : kDtypes)
    if (dtype == d.name) return d.size;
  return 0;
}

void write_safetensors_entries(DurableFile& f, std::vector<SafetensorsEntry> entries,
                               const Metadata& metadata) {
  std::sort(entries.begin(), entries.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) { return a.name < b.name; });
  check_entries(entries, f.path());
  const std::string header = header_text(entries, metadata);
  const uint64_t n = header.size();
  f.write(&n, 8);
  f.write(header.data(), header.size());
  for (const auto& e : entries) {
    const size_t before = f.bytes_written();
    e.write_data(f);
    MOE_CHECK(f.bytes_written() - before == e.nbytes,
              f.path() + ": tensor " + e.name + " wrote the wrong number of bytes");
  }
}

}  // namespace checkpoint_internal

using namespace checkpoint_internal;

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(tensors.size());
  for (const auto& t : tensors) {
    SafetensorsEntry e{t.name, t.dtype, t.shape, t.bytes.size(), nullptr};
    const std::vector<uint8_t>* bytes = &t.bytes;
    e.write_data = [bytes](DurableFile& f) { f.write(bytes->data(), bytes->size()); };
    entries.push_back(std::move(e));
  }
  DurableFile f(path, nullptr);
  write_safetensors_entries(f, std::move(entries), metadata);
  f.commit();
}

namespace {

// sum (when given) takes the length, the header and the tensors' bytes in offset order: the whole
// file's bytes in order when the tensors tile the data section, as this writer lays them out.
std::vector<NamedTensor> read_safetensors_impl(const std::string& path, Checksum* sum) {
  InputFile f(path);
  const uint64_t n = read_header_length(f);
  std::string text(static_cast<size_t>(n), '\0');
  f.read_at(8, text.data(), text.size());
  const uint64_t data_start = 8 + n;
  std::vector<HeaderEntry> entries = parse_header(text, f.size() - data_start, path);
  std::vector<size_t> order(entries.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return entries[a].begin < entries[b].begin; });
  if (sum) {
    sum->update(&n, 8);
    sum->update(text.data(), text.size());
  }
  std::vector<NamedTensor> out(entries.size());  // (in the header's order)
  for (size_t i : order) {
    HeaderEntry& e = entries[i];
    NamedTensor& t = out[i];
    t = NamedTensor{std::move(e.name), std::move(e.dtype), std::move(e.shape), {}};
    t.bytes.resize(static_cast<size_t>(e.end - e.begin));
    f.read_at(data_start + e.begin, t.bytes.data(), t.bytes.size());
    if (sum) sum->update(t.bytes.data(), t.bytes.size());
  }
  return out;
}

}  // namespace

std::vector<NamedTensor> read_safetensors(const std::string& path) {
  return read_safetensors_impl(path, nullptr);
}

namespace checkpoint_internal {

std::vector<NamedTensor> read_safetensors_summed(const std::string& path, Checksum& sum) {
  return read_safetensors_impl(path, &sum);
}

}  // namespace checkpoint_internal

}  // namespace moe
