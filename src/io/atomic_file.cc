#include "io/atomic_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace tally::io {

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), tmp_path_(path_ + ".tmp") {
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

void AtomicFile::commit() {
  TALLY_CHECK(std::fflush(file_) == 0 && fsync(fileno(file_)) == 0, "failed flushing '", tmp_path_, "': ",
              std::strerror(errno));
  std::fclose(file_);
  file_ = nullptr;
  TALLY_CHECK(std::rename(tmp_path_.c_str(), path_.c_str()) == 0, "cannot rename '", tmp_path_, "' to '", path_,
              "': ", std::strerror(errno));
}

void open_input(const std::string& path, const char* what, std::ifstream& in, int64_t* size) {
  in.open(path, std::ios::binary);
  TALLY_CHECK(in.good(), "cannot open ", what, " '", path, "'");
  in.seekg(0, std::ios::end);
  *size = in.tellg();
  in.seekg(0);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TALLY_CHECK(in.good(), "cannot open '", path, "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace tally::io
