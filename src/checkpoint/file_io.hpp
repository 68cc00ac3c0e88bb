// File I/O for checkpoints, private to src/checkpoint. Writes go through POSIX open / write /
// fsync so that a file is on disk before a directory rename publishes it: std::ofstream cannot
// fsync and hides errno. Every failure becomes an InputError naming the file and strerror (a full
// disk is the user's problem to fix, not a bug). Reads use pread so a reader can check sizes
// before it trusts any length stored inside a file.
#pragma once
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "checkpoint/checksum.hpp"
#include "moe/checkpoint.hpp"
#include "moe/error.hpp"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "checkpoint files are little-endian and written with plain memcpy");

namespace moe::checkpoint_internal {

[[noreturn]] inline void throw_io_error(const std::string& path, const char* what, int err) {
  throw InputError(path + ": " + what + " failed: " + std::strerror(err));
}

// A file being written durably. The hook sees the running byte count after every write call, so a
// test can fail the write partway exactly as a crash or ENOSPC would.
class DurableFile {
 public:
  // Large tensors are written in pieces of this size: bounded syscalls, and the hook runs often.
  static constexpr size_t kMaxWrite = size_t{8} << 20;

  DurableFile(std::string path, WriteHook hook) : path_(std::move(path)), hook_(std::move(hook)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw_io_error(path_, "open for writing", errno);
  }
  // Without commit() (an exception is unwinding) the file is closed as it is: the caller's
  // directory protocol guarantees that a half-written file is never published.
  ~DurableFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;

  void write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = ::write(fd_, p, n < kMaxWrite ? n : kMaxWrite);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) throw_io_error(path_, "write", errno);
      if (w == 0) throw_io_error(path_, "write", EIO);
      if (sum_) sum_->update(p, static_cast<size_t>(w));
      p += w;
      n -= static_cast<size_t>(w);
      written_ += static_cast<size_t>(w);
      if (hook_) hook_(path_, written_);
    }
  }
  // fsync, then close: both can report a full disk or an I/O error on some file systems.
  void commit() {
    if (::fsync(fd_) != 0) throw_io_error(path_, "fsync", errno);
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw_io_error(path_, "close", errno);
  }
  size_t bytes_written() const { return written_; }
  const std::string& path() const { return path_; }
  // From now on every byte written also goes into *sum (model.safetensors: DONE records it).
  void checksum_into(Checksum* sum) { sum_ = sum; }

 private:
  std::string path_;
  WriteHook hook_;
  int fd_ = -1;
  size_t written_ = 0;
  Checksum* sum_ = nullptr;
};

// Makes renames and new entries in `dir` durable (POSIX leaves them in the page cache otherwise).
inline void fsync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_io_error(dir, "open directory", errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) throw_io_error(dir, "fsync directory", err);
}

inline void write_file_durably(const std::string& path, const std::string& contents,
                               const WriteHook& hook) {
  DurableFile f(path, hook);
  f.write(contents.data(), contents.size());
  f.commit();
}

// A file opened for reading with its size known up front.
class InputFile {
 public:
  explicit InputFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw_io_error(path_, "open", errno);
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      int err = errno;
      ::close(fd_);
      throw_io_error(path_, "stat", err);
    }
    if (S_ISDIR(st.st_mode)) {
      ::close(fd_);
      throw InputError(path_ + ": is a directory, expected a file");
    }
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ~InputFile() { ::close(fd_); }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Reads exactly n bytes at `offset`; a short read means the file changed or is truncated.
  void read_at(uint64_t offset, void* dst, size_t n) const {
    char* p = static_cast<char*>(dst);
    while (n > 0) {
      ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw_io_error(path_, "read", errno);
      if (r == 0) throw InputError(path_ + ": truncated (unexpected end of file)");
      p += r;
      n -= static_cast<size_t>(r);
      offset += static_cast<uint64_t>(r);
    }
  }
  std::string read_all() const {
    std::string s(static_cast<size_t>(size_), '\0');
    read_at(0, s.data(), s.size());
    return s;
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

inline std::string read_text_file(const std::string& path) {
  return InputFile(path).read_all();
}

}  // namespace moe::checkpoint_internal
