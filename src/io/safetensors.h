// HuggingFace safetensors: an 8-byte little-endian header length N, N bytes of JSON
// ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}),
// then the raw little-endian tensor data.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tally::io {

struct SafetensorsFile {
  // What the header says of one tensor: its dtype, shape and bytes [begin, end) of the
  // data section.
  struct Entry {
    DType dtype = DType::F32;
    Shape shape;
    int64_t begin = 0, end = 0;
  };
  std::map<std::string, Entry> entries;           // every tensor the header lists
  std::map<std::string, Tensor> tensors;          // CPU tensors, in file dtypes (read_safetensors)
  std::map<std::string, std::string> metadata;
  std::vector<std::string> order;                 // names in file order
  int64_t data_start = 0;                         // the data section's first byte in the file

  const Tensor& at(const std::string& name) const;  // a tensor read_safetensors read; throws naming the file and tensor
  const Entry& entry(const std::string& name) const;  // throws likewise
  bool has(const std::string& name) const { return entries.count(name) > 0; }
  // Reads one tensor from the file (CPU, its file dtype), owned by `category`.
  Tensor read(const std::string& name, Category category = Category::Data) const;
  // Reads one tensor into `dst` (its shape; any float dtype): straight into it when it is
  // contiguous and of the file's dtype, else through one tensor of the file's, converted.
  void read_into(const std::string& name, const Tensor& dst) const;
  // Whether tensor `name` holds the same dtype, shape and bytes as tensor `other_name` of
  // `other` (this file or another), compared 1 MiB at a time: nothing tensor-sized is held.
  bool same_tensor(const std::string& name, const SafetensorsFile& other, const std::string& other_name) const;
  std::string path;

 private:
  void read_bytes(const std::string& name, void* dst) const;  // the tensor's bytes as the file holds them
};

// Reads and validates the header (JSON, dtypes, shapes against byte ranges, ranges inside
// the file and tiling the data section), not the data: tensors are then read one at a
// time (SafetensorsFile::read, read_into), so a loader holds one (or none, read straight
// into its parameter) beside the model, never the file.
// Errors name the file and the problem.
SafetensorsFile index_safetensors(const std::string& path);
// The header and every tensor.
SafetensorsFile read_safetensors(const std::string& path, Category category = Category::Data);

// Writes tensors atomically (temporary file, then rename).
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace tally::io
