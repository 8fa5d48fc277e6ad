#include "core/file_target.h"

#include <filesystem>
#include <system_error>

#include "core/error.h"

namespace tally {

namespace {
const char* kind_of(std::filesystem::file_type type) {
  switch (type) {
    case std::filesystem::file_type::directory: return "a directory";
    case std::filesystem::file_type::character: return "a character device";
    case std::filesystem::file_type::block: return "a block device";
    case std::filesystem::file_type::fifo: return "a FIFO";
    case std::filesystem::file_type::socket: return "a socket";
    default: return "not a regular file";
  }
}
}  // namespace

std::string replacement_target(const std::string& path, const char* what) {
  namespace fs = std::filesystem;
  fs::path target = path;
  // Follow links one at a time (a dangling link's target may not exist yet: it is the
  // file to create). 40 is the kernel's own limit on a chain of links.
  for (int depth = 0;; ++depth) {
    std::error_code ec;
    const fs::file_status link = fs::symlink_status(target, ec);
    if (ec || link.type() != fs::file_type::symlink) break;
    TALLY_CHECK(depth < 40, what, " '", path, "': too many levels of symbolic links");
    const fs::path next = fs::read_symlink(target, ec);
    TALLY_CHECK(!ec, what, " '", path, "': cannot read the symbolic link '", target.string(), "': ", ec.message());
    target = next.is_absolute() ? next : target.parent_path() / next;
    // /dev/stdout and the like lead into /proc/<pid>/fd: a descriptor (a pipe, a terminal,
    // a file opened for appending), not a file to replace.
    TALLY_CHECK(target.string().rfind("/proc/", 0) != 0, what, " '", path, "' is a link to a process's file descriptor ('",
                target.string(), "'): expected the path of a regular file to write");
  }
  std::error_code ec;
  const fs::file_status status = fs::status(target, ec);
  if (!ec && status.type() != fs::file_type::regular && status.type() != fs::file_type::not_found)
    TALLY_FAIL(what, " '", path, "'", (target.string() == path ? "" : " (a link to '" + target.string() + "')"),
               " is ", kind_of(status.type()), ": expected the path of a regular file to write");
  return target.string();
}

}  // namespace tally
