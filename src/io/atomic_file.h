// Writes a file atomically: data goes to "<path>.tmp", is flushed and fsync'ed, then
// renamed over <path>, and the directory is fsync'ed. A crash leaves either the old file or
// the new one, never half. A <path> that is a symbolic link is written through (the file it
// points to is replaced; the link stays); one that is a directory, device, FIFO or socket is
// refused (core/file_target.h). Every write and the close are checked (a full disk is an error
// naming the file, never a truncated file).
#pragma once
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

namespace tally::io {

class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();  // removes the temporary file if commit() was not reached
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t bytes);
  // Overwrites bytes already written (a header whose checksum is known only at the end).
  void rewrite(int64_t offset, const void* data, size_t bytes);
  void commit();

 private:
  std::string path_;    // as given, for messages
  std::string target_;  // the file replaced: path_, or what its links point to
  std::string tmp_path_;
  std::FILE* file_ = nullptr;
};

// Creates `dir` and its parents for the path `path` that `what` names (a flag: "--out-dir");
// a failure (a file in the way, no permission) is an error naming both, not the standard
// library's "filesystem error: cannot create directories".
void create_directories_for(const std::string& what, const std::string& path, const std::string& dir);

// fsync of a directory, so the renames inside it survive a power loss. Best effort: some
// filesystems refuse fsync on directories.
void sync_directory(const std::string& dir);

// Reads a whole file; throws naming the path when it cannot.
std::string read_file(const std::string& path);

// Opens `in` on `path` for binary reading and reports its size; `what` names the kind of
// file in the error ("safetensors file", "training state", ...). The stream is opened in
// place, never moved: GCC 12 warns (falsely) about moving a std::ifstream.
void open_input(const std::string& path, const char* what, std::ifstream& in, int64_t* size);

}  // namespace tally::io
