// Where an atomic write (a temporary file renamed over the destination) may land.
//
// Renaming over a path replaces whatever directory entry is there. For a symbolic link
// that would turn the link into a file and leave the file it points to stale; for a
// device, FIFO or socket (`-o /dev/full`, `-o /dev/stdout`) it would replace the node
// itself, and as root the write "succeeds" into a new file in /dev. So AtomicFile
// (core/atomic_file.h), through which tally writes every file, asks here first.
#pragma once
#include <string>

namespace tally {

// The path to rename over for a write to `path`: `path` itself, or, when it is a symbolic
// link (to any depth), the file it finally points to, so the link stays a link. Throws,
// naming `what` and `path`, when that target exists and is not a regular file (a
// directory, a device, a FIFO, a socket), when a link leads into /proc (/dev/stdout is a
// process's file descriptor), or when the links loop.
std::string replacement_target(const std::string& path, const char* what);

}  // namespace tally
