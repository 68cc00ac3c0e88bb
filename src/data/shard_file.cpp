// Token shard files in the llm.c layout: writing them atomically, mapping them read-only, and
// expanding the glob patterns that name them.
//
// A shard is a 1024-byte header (256 little-endian int32: magic, version, token count, zeros)
// followed by the tokens, uint16 (magic 20240520, version 1) or uint32 (magic 20240801,
// version 7). Keeping llm.c's exact layout means shards written by its data scripts load here and
// ours load there. The header is validated strictly (file size must equal header + count * width)
// because a half-written or foreign file would otherwise train silently on garbage.
//
// Reading goes through mmap: a shard can be far larger than what one epoch's windows need at a
// time, and the page cache then serves every rank on the host from one copy.
#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "moe/error.hpp"
#include "moe/shards.hpp"

// The tokens are used in place from the mapping, which is only right on a little-endian host.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "token shards are little-endian and are read in place: big-endian hosts are not supported"
#endif

namespace moe {

namespace {

constexpr size_t kHeaderBytes = kShardHeaderInts * sizeof(int32_t);
// Tokens converted and written per write(2) call: bounded memory for any shard size.
constexpr size_t kWriteChunkTokens = 1 << 20;

std::string errno_text() {
  return std::strerror(errno);
}

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw InputError(path + ": cannot write shard: " + errno_text());
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void put_le32(unsigned char* out, int32_t v) {
  const auto u = static_cast<uint32_t>(v);
  for (int b = 0; b < 4; ++b) out[b] = static_cast<unsigned char>(u >> (8 * b));
}

// The tokens in the shard's width, little-endian, one chunk at a time.
void write_tokens(int fd, const std::vector<uint32_t>& tokens, bool wide, const std::string& path) {
  const size_t width = wide ? 4 : 2;
  std::vector<unsigned char> buf(std::min(tokens.size(), kWriteChunkTokens) * width);
  for (size_t begin = 0; begin < tokens.size(); begin += kWriteChunkTokens) {
    const size_t end = std::min(tokens.size(), begin + kWriteChunkTokens);
    unsigned char* out = buf.data();
    for (size_t i = begin; i < end; ++i)
      for (size_t b = 0; b < width; ++b) *out++ = static_cast<unsigned char>(tokens[i] >> (8 * b));
    write_all(fd, buf.data(), (end - begin) * width, path);
  }
}

// Makes the rename itself durable: without this a crash can leave the old directory entry.
void fsync_parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: the data itself is already on disk
  ::fsync(fd);
  ::close(fd);
}

int32_t get_le32(const unsigned char* p) {
  uint32_t u = 0;
  for (int b = 0; b < 4; ++b) u |= static_cast<uint32_t>(p[b]) << (8 * b);
  return static_cast<int32_t>(u);
}

}  // namespace

void write_shard(const std::string& path, const std::vector<uint32_t>& tokens, int64_t vocab_size) {
  MOE_CHECK(vocab_size > 0, "write_shard: vocab_size must be positive");
  for (uint32_t t : tokens)
    MOE_CHECK(static_cast<int64_t>(t) < vocab_size, "write_shard: token " + std::to_string(t) +
                                                        " is outside the vocabulary of " +
                                                        std::to_string(vocab_size));
  const bool wide = vocab_size > 65536;

  unsigned char header[kHeaderBytes] = {};
  put_le32(header, wide ? kShardMagicU32 : kShardMagicU16);
  put_le32(header + 4, wide ? kShardVersionU32 : kShardVersionU16);
  MOE_CHECK(tokens.size() <= static_cast<size_t>(INT32_MAX),
            "write_shard: more tokens than the header's int32 count can hold");
  put_le32(header + 8, static_cast<int32_t>(tokens.size()));

  // Readers never see a partial shard: the data goes to a temporary name and is renamed into
  // place only once it is on disk.
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw InputError(path + ": cannot create shard: " + errno_text());
  try {
    write_all(fd, header, kHeaderBytes, path);
    write_tokens(fd, tokens, wide, path);
    if (::fsync(fd) != 0) throw InputError(path + ": cannot sync shard: " + errno_text());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw InputError(path + ": cannot write shard: " + errno_text());
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw InputError(path + ": cannot rename " + tmp + " into place: " + why);
  }
  fsync_parent_dir(path);
}

Shard::Shard(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError(path + ": cannot open token shard: " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(path + ": not a regular file");
  }
  const auto file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes < kHeaderBytes) {
    ::close(fd);
    throw InputError(path + ": truncated: " + std::to_string(file_bytes) +
                     " bytes, shorter than the " + std::to_string(kHeaderBytes) +
                     "-byte shard header");
  }
  map_ = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the file alive
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw InputError(path + ": cannot map token shard: " + errno_text());
  }
  map_bytes_ = file_bytes;

  // From here on a failure must unmap: the destructor does not run for a throwing constructor.
  const auto* header = static_cast<const unsigned char*>(map_);
  const int32_t magic = get_le32(header), version = get_le32(header + 4);
  const int32_t count = get_le32(header + 8);
  std::string problem;
  if (magic != kShardMagicU16 && magic != kShardMagicU32) {
    problem = "not a token shard (magic " + std::to_string(magic) + ", expected " +
              std::to_string(kShardMagicU16) + " or " + std::to_string(kShardMagicU32) + ")";
  } else if (const int32_t want = magic == kShardMagicU16 ? kShardVersionU16 : kShardVersionU32;
             version != want) {
    problem = "unsupported shard version " + std::to_string(version) + " for magic " +
              std::to_string(magic) + " (expected " + std::to_string(want) + ")";
  } else if (count < 0) {
    problem = "corrupt header: negative token count " + std::to_string(count);
  } else {
    wide_ = magic == kShardMagicU32;
    const size_t want_bytes = kHeaderBytes + static_cast<size_t>(count) * (wide_ ? 4 : 2);
    if (file_bytes != want_bytes)
      problem = std::string(file_bytes < want_bytes ? "truncated" : "size mismatch") +
                ": header says " + std::to_string(count) + " tokens (" +
                std::to_string(want_bytes) + " bytes) but the file has " +
                std::to_string(file_bytes) + " bytes";
  }
  if (!problem.empty()) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw InputError(path + ": " + problem);
  }
  count_ = count;
  const void* data = header + kHeaderBytes;
  if (wide_)
    data32_ = static_cast<const uint32_t*>(data);
  else
    data16_ = static_cast<const uint16_t*>(data);
}

Shard::~Shard() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

namespace {

// The directory glob(3) could not open and why, for the GLOB_ABORTED message (a missing
// directory in the pattern, not only an unreadable one, aborts it).
thread_local std::string glob_failed_dir;
thread_local int glob_failed_errno = 0;

int note_glob_error(const char* dir, int error) {
  glob_failed_dir = dir;
  glob_failed_errno = error;
  return 1;  // stop, as GLOB_ERR does
}

}  // namespace

std::vector<std::string> expand_glob(const std::string& pattern) {
  glob_t g{};
  glob_failed_dir.clear();
  const int rc = ::glob(pattern.c_str(), GLOB_ERR, note_glob_error, &g);
  std::vector<std::string> files;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  if (rc == GLOB_NOMATCH || (rc == 0 && files.empty()))
    throw InputError(pattern + ": no files match this pattern");
  if (rc == GLOB_ABORTED)
    throw InputError(pattern + ": cannot expand: " +
                     (glob_failed_dir.empty()
                          ? std::string("a directory is unreadable")
                          : glob_failed_dir + ": " + std::strerror(glob_failed_errno)));
  if (rc != 0) throw InputError(pattern + ": cannot expand: out of memory");
  // glob(3) sorts by the locale's collation; byte order is the same on every machine.
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace moe
