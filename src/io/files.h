// File helpers of the io layer: making an output's directories, reading whole files and
// opening inputs, each failure an error naming the file (or the flag) and what was
// expected. Writing goes through core/atomic_file.h.
#pragma once
#include <cstdint>
#include <fstream>
#include <string>

namespace tally::io {

// Creates `dir` and its parents for the path `path` that `what` names (a flag: "--out-dir");
// a failure (a file in the way, no permission) is an error naming both, not the standard
// library's "filesystem error: cannot create directories".
void create_directories_for(const std::string& what, const std::string& path, const std::string& dir);

// Reads a whole file; throws naming the path when it cannot.
std::string read_file(const std::string& path);

// Opens `in` on `path` for binary reading and reports its size; `what` names the kind of
// file in the error ("safetensors file", "training state", ...). The stream is opened in
// place, never moved: GCC 12 warns (falsely) about moving a std::ifstream.
void open_input(const std::string& path, const char* what, std::ifstream& in, int64_t* size);

}  // namespace tally::io
