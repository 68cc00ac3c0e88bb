// The tokenizer directory's files: see tokenizer_files.hpp.
#include "data/tokenizer_files.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "moe/error.hpp"

namespace moe::tokenizer_files {

namespace fs = std::filesystem;

void create_tokenizer_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw InputError(dir + ": cannot create the tokenizer directory: " + ec.message());
}

void write_file_durably(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw InputError(path + ": cannot write: " + std::strerror(errno));
  const char* why = nullptr;
  for (size_t done = 0; done < text.size() && !why;) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n >= 0)
      done += static_cast<size_t>(n);
    else if (errno != EINTR)
      why = std::strerror(errno);
  }
  if (!why && ::fsync(fd) != 0) why = std::strerror(errno);
  if (::close(fd) != 0 && !why) why = std::strerror(errno);
  if (!why && ::rename(tmp.c_str(), path.c_str()) != 0) why = std::strerror(errno);
  if (why) {
    ::unlink(tmp.c_str());
    throw InputError(path + ": cannot write: " + why);
  }
}

void write_tokenizer_json(const std::string& dir, const nlohmann::json& j) {
  write_file_durably((fs::path(dir) / kTokenizerJson).string(), j.dump(2) + "\n");
}

}  // namespace moe::tokenizer_files
