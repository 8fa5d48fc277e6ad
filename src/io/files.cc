#include "io/files.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include "core/error.h"

namespace tally::io {

void create_directories_for(const std::string& what, const std::string& path, const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TALLY_CHECK(!ec, what, " '", path, "': cannot create the directory '", dir, "': ", ec.message());
}

namespace {
// The descriptor of this process that `path` names, or -1: /proc/self/fd/N, /dev/fd/N (a
// link to that directory), or a link to one of them (/dev/stdout). Each link of a chain is
// followed in turn, and at each the directory holding it is resolved: the descriptor's own
// entry is a link too (to the file it is open on), which must not be followed.
int process_descriptor(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path own = "/proc/" + std::to_string(::getpid()) + "/fd";
  fs::path target = path;
  for (int depth = 0; depth < 40; ++depth) {  // the kernel's own limit on a chain of links
    std::error_code ec;
    const fs::path dir = fs::canonical(target.has_parent_path() ? target.parent_path() : fs::path("."), ec);
    const std::string name = target.filename().string();
    if (!ec && dir == own && !name.empty() && name.size() < 10 && name.find_first_not_of("0123456789") == std::string::npos)
      return std::stoi(name);
    if (fs::symlink_status(target, ec).type() != fs::file_type::symlink || ec) return -1;
    const fs::path next = fs::read_symlink(target, ec);
    if (ec) return -1;
    target = next.is_absolute() ? next : target.parent_path() / next;
  }
  return -1;
}
}  // namespace

bool is_stream(const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) return false;
  if (process_descriptor(path) >= 0) return true;
  std::error_code ec;
  const auto status = fs::status(path, ec);
  return !ec && (fs::is_character_file(status) || fs::is_fifo(status) || fs::is_socket(status));
}

std::FILE* open_stream(const std::string& flag, const std::string& path) {
  const int descriptor = process_descriptor(path);
  std::FILE* file = nullptr;
  if (descriptor >= 0) {
    const int copy = ::dup(descriptor);
    if (copy >= 0 && !(file = ::fdopen(copy, "a"))) ::close(copy);
  } else {
    file = std::fopen(path.c_str(), "a");
  }
  TALLY_CHECK(file, flag, ": cannot write the stream '", path, "': ", std::strerror(errno));
  return file;
}

bool abandoned_temporary(const std::string& name, const std::string& file) {
  const std::string prefix = file + ".tmp";
  if (!name.starts_with(prefix)) return false;
  if (name.size() == prefix.size()) return true;
  if (name[prefix.size()] != '.') return false;
  const char* pid_text = name.c_str() + prefix.size() + 1;
  const bool probe = std::strncmp(pid_text, "probe.", 6) == 0;
  if (probe) pid_text += 6;
  char* end = nullptr;
  const long pid = std::strtol(pid_text, &end, 10);
  if (pid <= 0 || *end != (probe ? '\0' : '.')) return true;  // not a name tally makes: a leftover
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

void remove_abandoned_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string file = target.filename().string();
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name != file && abandoned_temporary(name, file) && it->is_regular_file(ec)) fs::remove(it->path(), ec);
  }
}

void check_output_file(const std::string& flag, const std::string& path,
                       const std::vector<std::pair<std::string, std::string>>& inputs, OutputKind kind) {
  namespace fs = std::filesystem;
  TALLY_CHECK(!path.empty(), flag, " is empty, expected a file path");
  TALLY_CHECK(path.back() != '/', flag, " '", path, "' ends in '/', which names a directory: expected a file path");
  std::error_code ec;
  const auto status = fs::status(path, ec);
  TALLY_CHECK(!fs::is_directory(status), flag, " '", path, "' is a directory, expected a file path");
  // A stream (/dev/stdout, a pipe) is written as it is: nothing to create or replace. An
  // output written whole and then renamed into place cannot be one.
  if (is_stream(path)) {
    TALLY_CHECK(kind == OutputKind::FileOrStream, flag, " '", path, "' is a stream (a device, a pipe or a descriptor of ",
                "this process): ", flag, " is written whole and renamed into place, expected a file path");
    return;
  }
  TALLY_CHECK(!fs::exists(status) || fs::is_regular_file(status), flag, " '", path,
              "' exists and is not a regular file, expected a file path");
  if (fs::exists(status))
    for (const auto& [input_flag, input] : inputs)
      TALLY_CHECK(!(fs::equivalent(path, input, ec) && !ec), flag, " '", path, "' is ", input_flag, " '", input,
                  "': writing it would destroy the input; choose another path");
  const std::string dir = fs::path(path).parent_path().string();
  create_directories_for(flag, path, dir);
  remove_abandoned_temporaries(path);
  // A file this process can make beside it (a temporary, as core/atomic_file.h makes one).
  const std::string probe = path + ".tmp.probe." + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  TALLY_CHECK(fd >= 0, flag, " '", path, "': cannot write in '", dir.empty() ? "." : dir, "': ", std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
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
