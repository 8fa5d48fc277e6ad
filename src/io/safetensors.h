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
  std::map<std::string, Tensor> tensors;          // CPU tensors, in file dtypes
  std::map<std::string, std::string> metadata;
  std::vector<std::string> order;                 // names in file order

  const Tensor& at(const std::string& name) const;  // throws naming the file and tensor
  bool has(const std::string& name) const { return tensors.count(name) > 0; }
  std::string path;
};

// Reads and validates the whole file (header JSON, dtypes, shapes vs byte ranges, ranges
// inside the file and tiling the data section). Errors name the file and the problem.
SafetensorsFile read_safetensors(const std::string& path, Category category = Category::Data);

// Writes tensors atomically (temporary file, then rename).
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace tally::io
