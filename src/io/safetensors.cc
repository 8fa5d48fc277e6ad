#include "io/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "core/atomic_file.h"
#include "core/json_input.h"
#include "io/files.h"

namespace tally::io {

namespace {
DType parse_dtype(const std::string& s, const std::string& path, const std::string& name) {
  if (s == "F32") return DType::F32;
  if (s == "F64") return DType::F64;
  if (s == "BF16") return DType::BF16;
  if (s == "I32") return DType::I32;
  if (s == "I64") return DType::I64;
  if (s == "U16") return DType::U16;
  TALLY_FAIL("safetensors '", path, "': tensor '", name, "' has dtype ", s,
             ", expected one of F32, F64, BF16, I32, I64, U16");
}

const char* dtype_code(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U16: return "U16";
  }
  return "?";
}
}  // namespace

const Tensor& SafetensorsFile::at(const std::string& name) const {
  auto it = tensors.find(name);
  TALLY_CHECK(it != tensors.end(), "safetensors '", path, "': no tensor named '", name, "'");
  return it->second;
}

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries.find(name);
  TALLY_CHECK(it != entries.end(), "safetensors '", path, "': no tensor named '", name, "'");
  return it->second;
}

void SafetensorsFile::read_bytes(const std::string& name, void* dst) const {
  const Entry& e = entry(name);
  std::ifstream in;
  int64_t size = 0;
  open_input(path, "safetensors file", in, &size);
  in.seekg(data_start + e.begin);
  in.read(static_cast<char*>(dst), e.end - e.begin);
  TALLY_CHECK(in.good(), "safetensors '", path, "': failed reading tensor '", name, "'");
}

Tensor SafetensorsFile::read(const std::string& name, Category category) const {
  const Entry& e = entry(name);
  Tensor t = Tensor::empty(e.shape, e.dtype, Device::cpu(), make_owner(category, name));
  read_bytes(name, t.raw_data());
  t.set_name(name);
  return t;
}

void SafetensorsFile::read_into(const std::string& name, const Tensor& dst) const {
  const Entry& e = entry(name);
  TALLY_CHECK(dst.shape() == e.shape, "safetensors '", path, "': tensor '", name, "' is ", shape_str(e.shape),
              ", read into ", shape_str(dst.shape()));
  if (dst.dtype() != e.dtype || !dst.is_contiguous() || !dst.device().is_cpu()) {
    dst.copy_(read(name, Category::Other));
    return;
  }
  read_bytes(name, dst.raw_data());
}

bool SafetensorsFile::same_tensor(const std::string& name, const SafetensorsFile& other, const std::string& other_name) const {
  const Entry& a = entry(name);
  const Entry& b = other.entry(other_name);
  if (a.dtype != b.dtype || a.shape != b.shape || a.end - a.begin != b.end - b.begin) return false;
  std::ifstream in_a, in_b;
  int64_t size = 0;
  open_input(path, "safetensors file", in_a, &size);
  open_input(other.path, "safetensors file", in_b, &size);
  in_a.seekg(data_start + a.begin);
  in_b.seekg(other.data_start + b.begin);
  constexpr int64_t kChunk = 1 << 20;
  std::vector<char> chunk_a(kChunk), chunk_b(kChunk);
  for (int64_t done = 0; done < a.end - a.begin;) {
    const int64_t n = std::min(kChunk, a.end - a.begin - done);
    in_a.read(chunk_a.data(), n);
    in_b.read(chunk_b.data(), n);
    TALLY_CHECK(in_a.good() && in_b.good(), "safetensors '", path, "': failed reading tensor '", name, "' or '",
                other_name, "' of '", other.path, "'");
    if (std::memcmp(chunk_a.data(), chunk_b.data(), static_cast<size_t>(n)) != 0) return false;
    done += n;
  }
  return true;
}

SafetensorsFile read_safetensors(const std::string& path, Category category) {
  SafetensorsFile f = index_safetensors(path);
  for (const std::string& name : f.order) f.tensors.emplace(name, f.read(name, category));
  return f;
}

SafetensorsFile index_safetensors(const std::string& path) {
  int64_t file_size = 0;
  std::ifstream in;
  open_input(path, "safetensors file", in, &file_size);
  TALLY_CHECK(file_size >= 8, "safetensors '", path, "': file is ", file_size, " bytes, too short for the 8-byte header length");
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  // llm.c model files start with an int32 magic where safetensors has its header length.
  const auto magic = static_cast<int32_t>(header_len & 0xffffffffu);
  TALLY_CHECK(magic != 20240326 && magic != 20240803, "safetensors '", path, "' is an llm.c model file (magic ", magic,
              "), not safetensors: --model-file takes it");
  TALLY_CHECK(header_len <= static_cast<uint64_t>(file_size - 8), "safetensors '", path, "': header length ", header_len,
              " exceeds the file size ", file_size);
  // The format's own bound, checked before the header is read into memory (a large file of
  // another kind would otherwise be read whole as "JSON").
  constexpr uint64_t kMaxHeaderBytes = 100'000'000;
  TALLY_CHECK(header_len <= kMaxHeaderBytes, "safetensors '", path, "': header length ", header_len,
              " is over safetensors' limit of ", kMaxHeaderBytes, " bytes: is it a safetensors file?");
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  const nlohmann::json j = parse_json(header, "safetensors '" + path + "': header");
  TALLY_CHECK(j.is_object(), "safetensors '", path, "': header must be a JSON object");
  const int64_t data_start = 8 + static_cast<int64_t>(header_len);
  const int64_t data_size = file_size - data_start;
  SafetensorsFile f;
  f.path = path;
  f.data_start = data_start;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      TALLY_CHECK(it->is_object(), "safetensors '", path, "': __metadata__ must be an object");
      for (auto m = it->begin(); m != it->end(); ++m)
        f.metadata[m.key()] = m->is_string() ? m->get<std::string>() : m->dump();
      continue;
    }
    const auto& e = it.value();
    TALLY_CHECK(e.is_object() && e.contains("dtype") && e.contains("shape") && e.contains("data_offsets") &&
                    e["dtype"].is_string() && e["shape"].is_array() && e["data_offsets"].is_array(),
                "safetensors '", path, "': entry '", name,
                "' needs a string dtype, an array shape and an array data_offsets");
    DType dt = parse_dtype(e["dtype"].get<std::string>(), path, name);
    // Integers only: get<int64_t>() would truncate 2.9 to 2.
    const auto all_integers = [](const nlohmann::json& a) {
      return std::all_of(a.begin(), a.end(), [](const nlohmann::json& x) { return x.is_number_integer(); });
    };
    bool integers = all_integers(e["shape"]) && all_integers(e["data_offsets"]);
    std::vector<int64_t> dims, offs;
    try {
      if (integers) {
        dims = e["shape"].get<std::vector<int64_t>>();
        offs = e["data_offsets"].get<std::vector<int64_t>>();
      }
    } catch (const std::exception&) {
      integers = false;  // past int64
    }
    TALLY_CHECK(integers, "safetensors '", path, "': tensor '", name, "' has a non-integer shape or data_offsets");
    TALLY_CHECK(dims.size() <= Shape::kMaxDims, "safetensors '", path, "': tensor '", name, "' has ", dims.size(),
                " dimensions; tally supports at most ", Shape::kMaxDims);
    const Shape shape(dims);
    int64_t numel = 1;
    for (int64_t d : shape) numel = checked_mul(numel, d, "safetensors '", path, "': tensor '", name, "' shape");
    TALLY_CHECK(offs.size() == 2 && offs[0] >= 0 && offs[1] >= offs[0] && offs[1] <= data_size, "safetensors '", path,
                "': tensor '", name, "' has data_offsets outside the ", data_size, "-byte data section");
    const int64_t expected = checked_mul(numel, static_cast<int64_t>(dtype_size(dt)), "safetensors '", path,
                                         "': tensor '", name, "' ", shape_str(shape), " bytes");
    TALLY_CHECK(offs[1] - offs[0] == expected, "safetensors '", path, "': tensor '", name, "' ", dtype_name(dt),
                shape_str(shape), " needs ", expected, " bytes but its data range holds ", offs[1] - offs[0]);
    f.entries.emplace(name, SafetensorsFile::Entry{dt, shape, offs[0], offs[1]});
    f.order.push_back(name);
    ranges.emplace_back(offs[0], offs[1]);
  }
  // The ranges must tile the data section: no overlap, no hole, nothing after.
  std::sort(ranges.begin(), ranges.end());
  int64_t cursor = 0;
  for (auto [b, e] : ranges) {
    TALLY_CHECK(b == cursor, "safetensors '", path, "': data ranges overlap or leave a gap at byte ", cursor);
    cursor = e;
  }
  TALLY_CHECK(cursor == data_size, "safetensors '", path, "': ", data_size - cursor, " trailing bytes after the last tensor");
  return f;
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json j = nlohmann::json::object();
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    int64_t bytes = t.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
    j[name] = {{"dtype", dtype_code(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) j["__metadata__"] = metadata;
  std::string header = j.dump();
  while (header.size() % 8) header += ' ';
  AtomicFile out(path);
  uint64_t len = header.size();
  out.write(&len, 8);
  out.write(header.data(), header.size());
  for (const auto& [name, t] : tensors) {
    Tensor c = t.contiguous();
    out.write(c.raw_data(), c.numel() * dtype_size(c.dtype()));
  }
  out.commit();
}

}  // namespace tally::io
