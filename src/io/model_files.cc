#include "io/model_files.h"

#include <cstring>
#include <fstream>

#include "autograd/grad_mode.h"
#include "core/checked.h"
#include "io/atomic_file.h"
#include "io/checksum.h"
#include "io/safetensors.h"

namespace tally::io {

namespace {
constexpr int32_t kGpt2Magic = 20240326;
// Header slots llm.c leaves unused (it reads ints 0..7): tally marks the files it writes and
// stores a CRC-32 of the weights' bytes, checked at load. Files from elsewhere lack the mark.
constexpr int kChecksumMarkSlot = 250, kChecksumSlot = 251;
constexpr int32_t kChecksumMark = 0x79616C74;  // "tlay"

struct Header {
  int32_t ints[256];
};

// Opens an llm.c model file positioned after its header.
Header read_header(const std::string& path, std::ifstream& in, int64_t* file_size) {
  open_input(path, "model file", in, file_size);
  TALLY_CHECK(*file_size >= 1024, "model file '", path, "' is ", *file_size, " bytes; an llm.c model needs a 1024-byte header");
  Header h;
  in.read(reinterpret_cast<char*>(h.ints), 1024);
  return h;
}

// Parameters the header describes. Every product and sum is checked: the header's fields
// are int32, and e.g. L x 3C x C of a corrupt header wraps int64 (a wrapped count could
// match the file's size and pass the size check).
int64_t layout_numel(const nn::TransformerConfig& c, const std::string& path) {
  int64_t n = 0;
  for (auto& [name, shape] : nn::llmc_tensor_layout(c)) {
    int64_t numel = 1;
    for (int64_t d : shape) numel = checked_mul(numel, d, "model file '", path, "': header's tensor ", name);
    n = checked_add(n, numel, "model file '", path, "': header's parameter count");
  }
  return n;
}
}  // namespace

nn::TransformerConfig read_llmc_gpt2_config(const std::string& path) {
  std::ifstream in;
  int64_t file_size = 0;
  Header h = read_header(path, in, &file_size);
  TALLY_CHECK(h.ints[0] == kGpt2Magic, "model file '", path, "': magic ", h.ints[0], ", expected ", kGpt2Magic,
              " (an llm.c GPT-2 checkpoint)");
  TALLY_CHECK(h.ints[1] == 3 || h.ints[1] == 5, "model file '", path, "': version ", h.ints[1],
              ", expected 3 (fp32) or 5 (bf16)");
  nn::TransformerConfig c;
  c.max_seq_len = h.ints[2];
  c.vocab_size = h.ints[3];
  c.n_layer = h.ints[4];
  c.n_head = h.ints[5];
  c.n_kv_head = h.ints[5];
  c.n_embd = h.ints[6];
  c.padded_vocab_size = h.ints[7];
  TALLY_CHECK(c.max_seq_len > 0 && c.vocab_size > 0 && c.n_layer > 0 && c.n_head > 0 && c.n_embd > 0 &&
                  c.padded_vocab_size >= c.vocab_size && c.n_embd % c.n_head == 0,
              "model file '", path, "': implausible header (maxT ", c.max_seq_len, ", V ", c.vocab_size, ", L ",
              c.n_layer, ", heads ", c.n_head, ", C ", c.n_embd, ", Vp ", c.padded_vocab_size, ")");
  const int64_t width = h.ints[1] == 3 ? 4 : 2;
  const int64_t expected =
      checked_add(1024, checked_mul(layout_numel(c, path), width, "model file '", path, "': header's byte count"),
                  "model file '", path, "': header's byte count");
  TALLY_CHECK(file_size == expected, "model file '", path, "' is ", file_size, " bytes but its header (",
              c.describe(), ", ", width == 4 ? "fp32" : "bf16", ") needs ", expected, " bytes");
  return c;
}

void load_llmc_gpt2(const std::string& path, nn::Transformer& model) {
  nn::TransformerConfig c = read_llmc_gpt2_config(path);
  const auto& m = model.config();
  TALLY_CHECK(c.n_layer == m.n_layer && c.n_embd == m.n_embd && c.n_head == m.n_head &&
                  c.padded_vocab_size == m.padded_vocab_size && c.max_seq_len == m.max_seq_len,
              "model file '", path, "' holds ", c.describe(), " but the model is ", m.describe());
  std::ifstream in;
  int64_t file_size = 0;
  Header h = read_header(path, in, &file_size);
  // The file stacks each kind over layers; read each layer's slice straight into its
  // parameter (the parameters are contiguous views).
  std::vector<uint16_t> raw;
  Crc32 crc;
  for (const nn::LlmcTensor& t : model.llmc_tensors()) {
    for (size_t i : t.params) {
      const Tensor& p = model.params()[i];
      const int64_t n = p.numel();
      if (h.ints[1] == 3) {
        in.read(static_cast<char*>(p.raw_data()), n * 4);
        crc.update(p.raw_data(), static_cast<size_t>(n) * 4);
      } else {
        raw.resize(static_cast<size_t>(n));
        in.read(reinterpret_cast<char*>(raw.data()), n * 2);
        crc.update(raw.data(), static_cast<size_t>(n) * 2);
        float* d = p.data<float>();
        for (int64_t j = 0; j < n; ++j) {
          BFloat16 b;
          b.bits = raw[j];
          d[j] = static_cast<float>(b);
        }
      }
      p.storage().bump_version();
    }
  }
  TALLY_CHECK(in.good(), "model file '", path, "': read failed");
  TALLY_CHECK(h.ints[kChecksumMarkSlot] != kChecksumMark || static_cast<uint32_t>(h.ints[kChecksumSlot]) == crc.value(),
              "model file '", path, "': checksum mismatch (stored ", static_cast<uint32_t>(h.ints[kChecksumSlot]),
              ", computed ", crc.value(), "): the file is corrupt");
}

void save_llmc_gpt2(const std::string& path, const nn::Transformer& model, bool bf16) {
  const auto& c = model.config();
  Header h;
  std::memset(h.ints, 0, sizeof h.ints);
  h.ints[0] = kGpt2Magic;
  h.ints[1] = bf16 ? 5 : 3;
  h.ints[2] = static_cast<int32_t>(c.max_seq_len);
  h.ints[3] = static_cast<int32_t>(c.vocab_size);
  h.ints[4] = static_cast<int32_t>(c.n_layer);
  h.ints[5] = static_cast<int32_t>(c.n_head);
  h.ints[6] = static_cast<int32_t>(c.n_embd);
  h.ints[7] = static_cast<int32_t>(c.padded_vocab_size);
  h.ints[kChecksumMarkSlot] = kChecksumMark;
  AtomicFile out(path);
  out.write(h.ints, 1024);  // the checksum is filled in at the end
  std::vector<uint16_t> raw;
  Crc32 crc;
  for (const nn::LlmcTensor& t : model.llmc_tensors()) {
    for (size_t i : t.params) {
      const Tensor& p = model.params()[i];
      if (!bf16) {
        out.write(p.raw_data(), static_cast<size_t>(p.numel()) * 4);
        crc.update(p.raw_data(), static_cast<size_t>(p.numel()) * 4);
      } else {
        const float* d = p.data<float>();
        raw.resize(static_cast<size_t>(p.numel()));
        for (size_t j = 0; j < raw.size(); ++j) raw[j] = BFloat16(d[j]).bits;
        out.write(raw.data(), raw.size() * 2);
        crc.update(raw.data(), raw.size() * 2);
      }
    }
  }
  h.ints[kChecksumSlot] = static_cast<int32_t>(crc.value());
  out.rewrite(0, h.ints, 1024);
  out.commit();
}

namespace {
std::string hf_key(const SafetensorsFile& f, const std::string& name) {
  if (f.has(name)) return name;
  if (f.has("transformer." + name)) return "transformer." + name;
  TALLY_FAIL("HuggingFace GPT-2 file '", f.path, "': missing tensor '", name, "'");
}
}  // namespace

nn::TransformerConfig read_hf_gpt2_config(const std::string& path) {
  SafetensorsFile f = read_safetensors(path, Category::Other);
  const Tensor& wte = f.at(hf_key(f, "wte.weight"));
  const Tensor& wpe = f.at(hf_key(f, "wpe.weight"));
  TALLY_CHECK(wte.dim() == 2 && wpe.dim() == 2 && wte.shape()[1] == wpe.shape()[1], "HuggingFace GPT-2 file '", path,
              "': wte.weight ", shape_str(wte.shape()), " and wpe.weight ", shape_str(wpe.shape()),
              " must be 2-D with the same width");
  nn::TransformerConfig c;
  c.vocab_size = wte.shape()[0];
  c.padded_vocab_size = (c.vocab_size + 127) / 128 * 128;
  c.n_embd = wte.shape()[1];
  c.max_seq_len = wpe.shape()[0];
  int64_t L = 0;
  while (f.has("h." + std::to_string(L) + ".ln_1.weight") || f.has("transformer.h." + std::to_string(L) + ".ln_1.weight")) ++L;
  TALLY_CHECK(L > 0, "HuggingFace GPT-2 file '", path, "': no layers (h.0.ln_1.weight) found");
  c.n_layer = L;
  // The head count is not in the weights. It is read from the metadata when present;
  // otherwise GPT-2's 64-wide heads are assumed (true of gpt2, -medium, -large and -xl).
  auto it = f.metadata.find("n_head");
  if (it != f.metadata.end()) {
    try {
      c.n_head = std::stoll(it->second);
    } catch (const std::exception&) {
      TALLY_FAIL("HuggingFace GPT-2 file '", path, "': metadata n_head '", it->second, "' is not a number");
    }
  } else {
    TALLY_CHECK(c.n_embd % 64 == 0, "HuggingFace GPT-2 file '", path, "': width ", c.n_embd,
                " is not a multiple of GPT-2's 64-wide heads and the file has no n_head metadata");
    c.n_head = c.n_embd / 64;
  }
  TALLY_CHECK(c.n_head > 0 && c.n_embd % c.n_head == 0, "HuggingFace GPT-2 file '", path, "': ", c.n_head,
              " heads do not divide the width ", c.n_embd);
  c.n_kv_head = c.n_head;
  return c;
}

void load_hf_gpt2(const std::string& path, nn::Transformer& model) {
  SafetensorsFile f = read_safetensors(path, Category::Other);
  auto& params = model.params();
  const auto& c = model.config();
  autograd::NoGradGuard ng;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params.spec(i).name;
    const Tensor& dst = params[i];
    const std::string hf_name = (name == "wte" || name == "wpe") ? name + ".weight" : name;
    const Tensor& src = f.at(hf_key(f, hf_name));
    // Integer tensors would be converted value by value into weights: refuse them.
    TALLY_CHECK(src.dtype() == DType::F32 || src.dtype() == DType::BF16 || src.dtype() == DType::F64, "'", path,
                "': ", hf_name, " is ", dtype_name(src.dtype()), ", expected a float weight (F32, BF16 or F64)");
    bool conv1d = name.find(".weight") != std::string::npos && name.find("ln_") == std::string::npos && name != "wte" &&
                  name.rfind("h.", 0) == 0;
    if (name == "wte") {
      TALLY_CHECK(src.shape() == Shape({c.vocab_size, c.n_embd}), "'", path, "': wte.weight is ", shape_str(src.shape()));
      dst.zero_();
      dst.slice(0, 0, c.vocab_size).detach().copy_(src);
    } else if (conv1d) {
      Shape want = {dst.shape()[1], dst.shape()[0]};
      TALLY_CHECK(src.shape() == want, "'", path, "': ", name, " is ", shape_str(src.shape()), ", expected ",
                  shape_str(want), " (Conv1D layout: in, out)");
      dst.copy_(src.transpose(0, 1));
    } else {
      TALLY_CHECK(src.shape() == dst.shape(), "'", path, "': ", name, " is ", shape_str(src.shape()), ", expected ",
                  shape_str(dst.shape()));
      dst.copy_(src);
    }
  }
}

}  // namespace tally::io
