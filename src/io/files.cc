#include "io/files.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace tally::io {

void create_directories_for(const std::string& what, const std::string& path, const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TALLY_CHECK(!ec, what, " '", path, "': cannot create the directory '", dir, "': ", ec.message());
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
