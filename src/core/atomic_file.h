// Writes a file atomically: data goes to "<path>.tmp.<pid>.<n>" (each writer its own), is
// flushed and fsync'ed, then renamed over <path>, and the directory is fsync'ed. A crash
// leaves either the old file or the new one, never half. A <path> that is a symbolic link
// is written through (the file it points to is replaced; the link stays); one that is a
// directory, device, FIFO or socket is refused (core/file_target.h). Every write and the
// close are checked: a full disk is an error naming the file, never a truncated file left
// behind as if complete.
//
// Every file tally writes goes through here: checkpoints and model files (io), token shards
// (data), memory reports (memory), logs and plots (train).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

namespace tally {

class AtomicFile {
 public:
  // `what` names the kind of file in errors ("token shard", "memory report").
  explicit AtomicFile(std::string path, const char* what = "output file");
  ~AtomicFile();  // removes the temporary file if commit() was not reached
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t bytes);
  // Overwrites bytes already written (a header whose checksum is known only at the end).
  void rewrite(int64_t offset, const void* data, size_t bytes);
  void commit();

 private:
  // Throws "<what> '<path>': <action> '<tmp>' failed: <errno text>", the temporary removed.
  [[noreturn]] void fail(const char* action, int error);

  std::string path_;    // as given, for messages
  const char* what_;
  std::string target_;  // the file replaced: path_, or what its links point to
  std::string tmp_path_;
  std::FILE* file_ = nullptr;
};

// fsync of a directory, so the renames inside it survive a power loss. Best effort: some
// filesystems refuse fsync on directories.
void sync_directory(const std::string& dir);

}  // namespace tally
