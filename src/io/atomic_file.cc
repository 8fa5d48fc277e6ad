#include "io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/file_target.h"

namespace tally::io {

AtomicFile::AtomicFile(std::string path)
    : path_(std::move(path)), target_(replacement_target(path_, "output file")), tmp_path_(target_ + ".tmp") {
  file_ = std::fopen(tmp_path_.c_str(), "wb");
  TALLY_CHECK(file_, "cannot create '", tmp_path_, "': ", std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (file_) {
    std::fclose(file_);
    std::remove(tmp_path_.c_str());
  }
}

void AtomicFile::write(const void* data, size_t bytes) {
  TALLY_CHECK(file_, "write to '", path_, "' after commit");
  TALLY_CHECK(std::fwrite(data, 1, bytes, file_) == bytes, "failed writing '", tmp_path_, "': ", std::strerror(errno));
}

void AtomicFile::rewrite(int64_t offset, const void* data, size_t bytes) {
  TALLY_CHECK(file_, "write to '", path_, "' after commit");
  const long end = std::ftell(file_);
  TALLY_CHECK(end >= 0 && offset >= 0 && offset + static_cast<int64_t>(bytes) <= end, "rewrite of '", tmp_path_,
              "' outside what was written");
  TALLY_CHECK(std::fseek(file_, static_cast<long>(offset), SEEK_SET) == 0 && std::fwrite(data, 1, bytes, file_) == bytes &&
                  std::fseek(file_, end, SEEK_SET) == 0,
              "failed writing '", tmp_path_, "': ", std::strerror(errno));
}

void AtomicFile::commit() {
  TALLY_CHECK(file_, "commit of '", path_, "' twice");
  TALLY_CHECK(std::fflush(file_) == 0 && fsync(fileno(file_)) == 0, "failed flushing '", tmp_path_, "': ",
              std::strerror(errno));
  const int closed = std::fclose(file_);
  file_ = nullptr;
  if (closed != 0) {
    const std::string err = std::strerror(errno);
    std::remove(tmp_path_.c_str());
    TALLY_FAIL("failed closing '", tmp_path_, "': ", err);
  }
  if (std::rename(tmp_path_.c_str(), target_.c_str()) != 0) {
    const std::string err = std::strerror(errno);
    std::remove(tmp_path_.c_str());
    TALLY_FAIL("cannot rename '", tmp_path_, "' to '", target_, "': ", err);
  }
  const std::string parent = std::filesystem::path(target_).parent_path().string();
  sync_directory(parent.empty() ? "." : parent);
}

void create_directories_for(const std::string& what, const std::string& path, const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TALLY_CHECK(!ec, what, " '", path, "': cannot create the directory '", dir, "': ", ec.message());
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

namespace {
// A directory opens as a stream on Linux and reads as zeros ("magic 0"): say what it is.
void require_regular_file(const std::string& path, const char* what) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  TALLY_CHECK(!ec, "cannot open ", what, " '", path, "': ", ec.message());
  TALLY_CHECK(std::filesystem::is_regular_file(status), what, " '", path, "': expected a regular file, found ",
              std::filesystem::is_directory(status) ? "a directory" : "a special file");
}
}  // namespace

void open_input(const std::string& path, const char* what, std::ifstream& in, int64_t* size) {
  require_regular_file(path, what);
  in.open(path, std::ios::binary);
  TALLY_CHECK(in.good(), "cannot open ", what, " '", path, "': ", std::strerror(errno));
  in.seekg(0, std::ios::end);
  *size = in.tellg();
  in.seekg(0);
}

std::string read_file(const std::string& path) {
  require_regular_file(path, "file");
  std::ifstream in(path, std::ios::binary);
  TALLY_CHECK(in.good(), "cannot open '", path, "': ", std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace tally::io
