// File helpers of the io layer: making an output's directories, reading whole files and
// opening inputs, each failure an error naming the file (or the flag) and what was
// expected. Writing goes through core/atomic_file.h.
#pragma once
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace tally::io {

// Creates `dir` and its parents for the path `path` that `what` names (a flag: "--out-dir");
// a failure (a file in the way, no permission) is an error naming both, not the standard
// library's "filesystem error: cannot create directories".
void create_directories_for(const std::string& what, const std::string& path, const std::string& dir);

// Whether `path` names a stream rather than a file: a character device (/dev/null, a
// terminal), a FIFO or a socket, or one of this process's descriptors (/dev/stdout,
// /dev/fd/N, /proc/self/fd/N), whatever that descriptor is open on. A stream is written
// front to back as it is: never read back, replaced atomically or fsync'ed.
bool is_stream(const std::string& path);

// Opens a stream (is_stream) for writing: one of this process's descriptors is duplicated,
// so the writes share its offset (rows written to /dev/stdout redirected into a file follow
// what the process printed before them, and its later output follows them, instead of one
// overwriting the other); any other stream is opened for appending, never truncated.
// Throws naming `flag` and `path` when it cannot.
std::FILE* open_stream(const std::string& flag, const std::string& path);

// What an output may be: only a file (written whole, atomically: a model, a plot, a
// report), or also a stream (a log written row by row).
enum class OutputKind { File, FileOrStream };

// Whether `name`, in the directory of `file`, is a temporary of `file` that no live process
// writes: "<file>.tmp", or "<file>.tmp.<pid>.<n>" / "<file>.tmp.probe.<pid>" (what
// core/atomic_file.h and check_output_file make) of a process that has ended. A live
// writer's is left alone: another run finishing into the same directory may be about to
// rename it into place.
bool abandoned_temporary(const std::string& name, const std::string& file);
// Removes the abandoned temporaries of `path` beside it (a killed run's).
void remove_abandoned_temporaries(const std::string& path);

// Checks the path of a file a command will write, before any work is done, so a bad one
// fails now and not after training. `path` must not name a directory (nor end in '/',
// which only a directory can), an existing special file, a stream unless `kind` takes
// one (a stream is then written as it is, and nothing else is checked), or an input of
// the command: `inputs` are (flag, file) pairs, the files the command reads (writing a log
// over the training data would destroy it). Its directory is created, and must take a
// new file: one is made there and removed.
void check_output_file(const std::string& flag, const std::string& path,
                       const std::vector<std::pair<std::string, std::string>>& inputs,
                       OutputKind kind = OutputKind::File);

// Reads a whole file; throws naming the path when it cannot.
std::string read_file(const std::string& path);

// Opens `in` on `path` for binary reading and reports its size; `what` names the kind of
// file in the error ("safetensors file", "training state", ...). The stream is opened in
// place, never moved: GCC 12 warns (falsely) about moving a std::ifstream.
void open_input(const std::string& path, const char* what, std::ifstream& in, int64_t* size);

}  // namespace tally::io
