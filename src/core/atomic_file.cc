#include "core/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/file_target.h"

namespace tally {

namespace {
// "<target>.tmp.<pid>.<n>": each writer its own temporary, so two writers of one file at
// once (two runs finishing into one directory, two threads) never write into or rename
// away each other's; the last commit wins, whole. Leftovers of a killed process all start
// with "<target>.tmp" (io::recover_out_dir removes those of an --out-dir).
std::string temporary_for(const std::string& target) {
  static std::atomic<uint64_t> next{0};
  return target + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(next.fetch_add(1));
}
}  // namespace

AtomicFile::AtomicFile(std::string path, const char* what)
    : path_(std::move(path)), what_(what), target_(replacement_target(path_, what)), tmp_path_(temporary_for(target_)) {
  file_ = std::fopen(tmp_path_.c_str(), "wb");
  TALLY_CHECK(file_, what_, " '", path_, "': cannot create '", tmp_path_, "': ", std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (file_) {
    std::fclose(file_);
    std::remove(tmp_path_.c_str());
  }
}

void AtomicFile::fail(const char* action, int error) {
  if (file_) std::fclose(file_);
  file_ = nullptr;
  std::remove(tmp_path_.c_str());
  TALLY_FAIL(what_, " '", path_, "': ", action, " '", tmp_path_, "' failed: ", std::strerror(error));
}

void AtomicFile::write(const void* data, size_t bytes) {
  TALLY_CHECK(file_, what_, " '", path_, "': written after commit");
  if (bytes == 0) return;  // an empty vector's data() may be null, which fwrite must not see
  if (std::fwrite(data, 1, bytes, file_) != bytes) fail("writing", errno);
}

void AtomicFile::rewrite(int64_t offset, const void* data, size_t bytes) {
  TALLY_CHECK(file_, what_, " '", path_, "': written after commit");
  const long end = std::ftell(file_);
  TALLY_CHECK(end >= 0 && offset >= 0 && offset + static_cast<int64_t>(bytes) <= end, what_, " '", path_,
              "': rewrite of '", tmp_path_, "' outside what was written");
  if (bytes == 0) return;
  if (std::fseek(file_, static_cast<long>(offset), SEEK_SET) != 0 || std::fwrite(data, 1, bytes, file_) != bytes ||
      std::fseek(file_, end, SEEK_SET) != 0)
    fail("writing", errno);
}

void AtomicFile::commit() {
  TALLY_CHECK(file_, what_, " '", path_, "': committed twice");
  if (std::fflush(file_) != 0 || fsync(fileno(file_)) != 0) fail("flushing", errno);
  const int closed = std::fclose(file_);
  file_ = nullptr;
  if (closed != 0) fail("closing", errno);
  if (std::rename(tmp_path_.c_str(), target_.c_str()) != 0) {
    const int error = errno;
    std::remove(tmp_path_.c_str());
    TALLY_FAIL(what_, " '", path_, "': renaming '", tmp_path_, "' to '", target_, "' failed: ", std::strerror(error));
  }
  const std::string parent = std::filesystem::path(target_).parent_path().string();
  sync_directory(parent.empty() ? "." : parent);
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

}  // namespace tally
