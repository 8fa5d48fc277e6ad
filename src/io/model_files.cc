#include "io/model_files.h"

#include <bit>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "autograd/grad_mode.h"
#include "core/atomic_file.h"
#include "core/checked.h"
#include "io/checksum.h"
#include "io/files.h"
#include "nn/llmc_layout.h"

namespace tally::io {

namespace {
constexpr int32_t kGpt2Magic = 20240326, kLlamaMagic = 20240803;
// Qwen2/Qwen3 in llm.c's LLaMA layout: a magic of tally's own, so that llm.c, which has no
// q/k/v biases or q/k norms, refuses the file instead of misreading it.
constexpr int32_t kQwenMagic = 20261202;
// Header slots llm.c leaves unused (it reads ints 0..15): tally marks the files it writes and
// stores a CRC-32 of the weights' bytes, checked at load, and (with the "tly2" mark) one of
// the header itself, its two checksum slots read as zero: a flipped bit in the head count or
// a LLaMA double changes the model a file describes without changing its size, and the
// weights' checksum does not see it. Files from elsewhere lack the mark; a mark a bit or two
// away from either of tally's is a flipped one (the file is corrupt), not a foreign file.
constexpr int kChecksumMarkSlot = 250, kChecksumSlot = 251, kHeaderChecksumSlot = 252;
constexpr int32_t kChecksumMark = 0x79616C74;        // "tlay": the weights' checksum
constexpr int32_t kHeaderChecksumMark = 0x32796C74;  // "tly2": the weights' and the header's
// LLaMA: the exact values train_llama3.py's int header truncates (see model_files.h).
constexpr int kExactMarkSlot = 230, kFfnSlot = 231, kTiedSlot = 232, kOriginalContextSlot = 233;
constexpr int kEpsSlot = 234, kThetaSlot = 236, kFactorSlot = 238, kLowSlot = 240, kHighSlot = 242,
              kMultiplierSlot = 244;  // doubles: two int32 slots each
constexpr int kFamilySlot = 246, kHeadWidthSlot = 247;  // Qwen files: the family, Qwen3's head width
// Qwen3-MoE's experts: their count, per token, width, sparse-layer step and renormalization.
constexpr int kExpertsSlot = 248, kExpertsPerTokenSlot = 249, kExpertWidthSlot = 253, kSparseStepSlot = 254,
              kNormTopKSlot = 255;
// ... and its mlp_only_layers, one bit a layer (layer l: bit l % 32 of slot 64 + l / 32),
// in slots llm.c does not read: up to 4096 layers.
constexpr int kDenseLayerMaskSlot = 64, kDenseLayerMaskSlots = 128;
constexpr int kRouterLossSlot = 192;  // a double: router_aux_loss_coef (0: no load-balancing loss)
constexpr int32_t kExactMark = 0x33616C6C;  // "lla3"
// GPT-2: its LayerNorm eps (1e-5 in every GPT-2, but a HuggingFace config may say another),
// a double in kEpsSlot, marked so. llm.c's files have neither: 1e-5.
constexpr int32_t kGpt2EpsMark = 0x32657067;  // "gpe2"

struct Header {
  int32_t ints[256];
  float floats[256];     // llm.c's C writer's float block (LLaMA variant), when present
  int64_t data_offset = 1024;
  int64_t file_size = 0;
};

double get_double(const Header& h, int slot) {
  double d;
  std::memcpy(&d, &h.ints[slot], sizeof d);
  return d;
}
void put_double(Header& h, int slot, double d) { std::memcpy(&h.ints[slot], &d, sizeof d); }

// The CRC-32 of a header's 256 ints with its two checksum slots read as zero.
uint32_t header_checksum(const Header& h) {
  int32_t ints[256];
  std::memcpy(ints, h.ints, sizeof ints);
  ints[kChecksumSlot] = ints[kHeaderChecksumSlot] = 0;
  Crc32 crc;
  crc.update(ints, sizeof ints);
  return crc.value();
}

// Opens an llm.c model file and reads its header (and the 1024 bytes after it, which are
// the float block of llm.c's C LLaMA writer or the first weights).
Header read_header(const std::string& path, std::ifstream& in) {
  Header h;
  open_input(path, "model file", in, &h.file_size);
  TALLY_CHECK(h.file_size >= 1024, "model file '", path, "' is ", h.file_size,
              " bytes; an llm.c model needs a 1024-byte header");
  in.read(reinterpret_cast<char*>(h.ints), 1024);
  const int32_t mark = h.ints[kChecksumMarkSlot];
  for (int32_t known : {kChecksumMark, kHeaderChecksumMark})
    TALLY_CHECK(mark == known || std::popcount(static_cast<uint32_t>(mark ^ known)) > 2, "model file '", path,
                "': header slot ", kChecksumMarkSlot, " holds ", static_cast<uint32_t>(mark),
                ", a few bits from tally's checksum mark ", static_cast<uint32_t>(known), ": the header is corrupt");
  if (mark == kHeaderChecksumMark) {
    const uint32_t stored = static_cast<uint32_t>(h.ints[kHeaderChecksumSlot]), computed = header_checksum(h);
    TALLY_CHECK(stored == computed, "model file '", path, "': header checksum mismatch (stored ", stored, ", computed ",
                computed, "): the header (the model's shape and settings) is corrupt");
  }
  std::memset(h.floats, 0, sizeof h.floats);
  if (h.file_size >= 2048) in.read(reinterpret_cast<char*>(h.floats), 1024);
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

int64_t width_of(const Header& h) { return h.ints[1] == 3 ? 4 : 2; }

// The LLaMA FFN width the file's size implies: every tensor but the three MLP ones is
// known from the header, and those hold 3 * L * C * F values.
int64_t ffn_from_size(nn::TransformerConfig c, const Header& h, const std::string& path) {
  c.ffn_hidden = 0;
  const int64_t without_mlp = layout_numel(c, path);
  const int64_t bytes = h.file_size - h.data_offset;
  const int64_t per_f = checked_product({3, c.n_layer, c.n_embd}, "model file '", path, "': header");
  const int64_t width = width_of(h);
  if (bytes % width != 0 || bytes / width <= without_mlp || (bytes / width - without_mlp) % per_f != 0) return 0;
  return (bytes / width - without_mlp) / per_f;
}

nn::TransformerConfig llama_config(Header& h, const std::string& path) {
  using Family = nn::TransformerConfig::Family;
  nn::TransformerConfig c;
  c.family = Family::Llama3;
  if (h.ints[0] == kQwenMagic) {
    const int32_t family = h.ints[kFamilySlot];
    TALLY_CHECK(h.ints[kExactMarkSlot] == kExactMark && family >= static_cast<int32_t>(Family::Qwen2) &&
                    family <= static_cast<int32_t>(Family::Qwen3Moe),
                "model file '", path, "': a Qwen file (magic ", kQwenMagic, ") whose header names family ", family,
                ", expected ", static_cast<int32_t>(Family::Qwen2), " (qwen2), ", static_cast<int32_t>(Family::Qwen3),
                " (qwen3) or ", static_cast<int32_t>(Family::Qwen3Moe), " (qwen3_moe): the file is corrupt");
    c.family = static_cast<Family>(family);
    c.head_width = h.ints[kHeadWidthSlot];
    if (c.family == Family::Qwen3Moe) {
      c.n_experts = h.ints[kExpertsSlot];
      c.experts_per_token = h.ints[kExpertsPerTokenSlot];
      c.moe_ffn_hidden = h.ints[kExpertWidthSlot];
      c.decoder_sparse_step = h.ints[kSparseStepSlot];
      c.norm_topk_prob = h.ints[kNormTopKSlot] != 0;
      c.router_aux_loss_coef = get_double(h, kRouterLossSlot);
      for (int64_t l = 0; l < std::min<int64_t>(c.n_layer, 32 * kDenseLayerMaskSlots); ++l)
        if (static_cast<uint32_t>(h.ints[kDenseLayerMaskSlot + l / 32]) >> (l % 32) & 1u) c.mlp_only_layers.push_back(l);
      TALLY_CHECK(c.n_experts >= 1 && c.n_experts <= (1 << 16) && c.experts_per_token >= 1 &&
                      c.experts_per_token <= c.n_experts && c.moe_ffn_hidden >= 1 && c.decoder_sparse_step >= 1,
                  "model file '", path, "': implausible experts in its header (", c.n_experts, " experts, ",
                  c.experts_per_token, " per token, width ", c.moe_ffn_hidden, ", sparse step ", c.decoder_sparse_step,
                  "): the file is corrupt");
    }
  }
  c.max_seq_len = h.ints[2];
  c.vocab_size = h.ints[3];
  c.n_layer = h.ints[4];
  c.n_head = h.ints[5];
  c.n_kv_head = h.ints[6];
  c.n_embd = h.ints[7];
  TALLY_CHECK(c.max_seq_len > 0 && c.vocab_size > 0 && c.n_layer > 0 && c.n_head > 0 && c.n_kv_head > 0 &&
                  c.n_embd > 0 && c.n_head % c.n_kv_head == 0 && c.n_embd <= (1 << 20) && c.vocab_size <= (1 << 24) &&
                  (c.head_width == 0 ? c.n_embd % c.n_head == 0 : c.head_width > 0 && c.head_width <= (1 << 12)),
              "model file '", path, "': implausible ", c.family_name(), " header (maxT ", c.max_seq_len, ", V ",
              c.vocab_size, ", L ", c.n_layer, ", heads ", c.n_head, ", kv heads ", c.n_kv_head, ", C ", c.n_embd,
              ", head width ", c.head_width, ")");
  c.padded_vocab_size = (c.vocab_size + 127) / 128 * 128;
  c.tie_embeddings = false;  // llm.c's files always hold lm_head
  if (h.ints[kExactMarkSlot] == kExactMark) {
    // Written by tally: the exact values.
    c.ffn_hidden = h.ints[kFfnSlot];
    c.tie_embeddings = h.ints[kTiedSlot] != 0;
    c.rope_original_max_position = h.ints[kOriginalContextSlot];
    c.norm_eps = get_double(h, kEpsSlot);
    c.rope_theta = get_double(h, kThetaSlot);
    c.rope_factor = get_double(h, kFactorSlot);
    c.rope_low_freq_factor = get_double(h, kLowSlot);
    c.rope_high_freq_factor = get_double(h, kHighSlot);
    c.ffn_dim_multiplier = get_double(h, kMultiplierSlot);
    c.multiple_of = h.ints[9];
    return c;
  }
  // llm.c's C writer: ints [8] multiple_of, [9] use_scaled_rope, then floats
  // [0] ffn_dim_multiplier, [1] norm_eps, [2] rope_theta, weights at 2048. Recognised by a
  // plausible float block whose layout the file's size confirms.
  const float* f = h.floats;
  if (h.file_size >= 2048 && std::isfinite(f[1]) && f[1] > 0 && f[1] < 1e-2f && std::isfinite(f[2]) && f[2] >= 1 &&
      (h.ints[9] == 0 || h.ints[9] == 1)) {
    Header probe = h;
    probe.data_offset = 2048;
    if (int64_t F = ffn_from_size(c, probe, path); F > 0) {
      h.data_offset = 2048;
      c.multiple_of = h.ints[8];
      c.ffn_dim_multiplier = f[0];
      c.norm_eps = f[1];
      c.rope_theta = f[2];
      c.rope_factor = h.ints[9] ? 8 : 0;
      c.ffn_hidden = F;
      nn::settle_llama_ffn_rounding(c);
      return c;
    }
  }
  // train_llama3.py: ints [8] int(ffn_dim_multiplier), [9] multiple_of, [10] int(norm_eps),
  // [11] int(rope_theta), [12] use_scaled_rope.
  c.multiple_of = h.ints[9];
  c.ffn_dim_multiplier = h.ints[8];
  c.norm_eps = h.ints[10] > 0 ? h.ints[10] : 1e-5;  // 1e-5 truncates to 0: LLaMA-3's value
  c.rope_theta = h.ints[11] > 0 ? h.ints[11] : 500000.0;
  c.rope_factor = h.ints[12] ? 8 : 0;  // train_llama3.py's apply_scaling hard-codes 8, 1, 4, 8192
  c.ffn_hidden = ffn_from_size(c, h, path);
  TALLY_CHECK(c.ffn_hidden > 0, "model file '", path, "' is ", h.file_size, " bytes, which no FFN width fits for ",
              "its LLaMA header (L ", c.n_layer, ", C ", c.n_embd, ", V ", c.vocab_size, ", ",
              width_of(h) == 4 ? "fp32" : "bf16", "): truncated or not an llm.c LLaMA-3 file");
  // The truncated multiplier rarely gives the width the size did (1.3 -> 1): a pair that
  // does, so that an export writes one its import keeps (llm.c -> HF -> llm.c is the file).
  nn::settle_llama_ffn_rounding(c);
  return c;
}
}  // namespace

nn::TransformerConfig read_llmc_config(const std::string& path) {
  std::ifstream in;
  Header h = read_header(path, in);
  // A safetensors file starts with its header's length (8 bytes) and then '{'.
  const bool safetensors = (h.ints[2] & 0xff) == '{';
  TALLY_CHECK(h.ints[0] == kGpt2Magic || h.ints[0] == kLlamaMagic || h.ints[0] == kQwenMagic, "model file '", path, "': ",
              safetensors ? "a HuggingFace safetensors file, not an llm.c model: give its directory (`tally train "
                            "--init-from DIR`; `tally sample` and `export` take the directory as --model-file)"
                          : "magic " + std::to_string(h.ints[0]) + ", expected " + std::to_string(kGpt2Magic) +
                                " (an llm.c GPT-2 checkpoint), " + std::to_string(kLlamaMagic) + " (LLaMA-3) or " +
                                std::to_string(kQwenMagic) + " (Qwen, as tally writes it)");
  TALLY_CHECK(h.ints[1] == 3 || h.ints[1] == 5, "model file '", path, "': version ", h.ints[1],
              ", expected 3 (fp32) or 5 (bf16)");
  nn::TransformerConfig c;
  if (h.ints[0] == kLlamaMagic || h.ints[0] == kQwenMagic) {
    c = llama_config(h, path);
  } else {
    c.max_seq_len = h.ints[2];
    c.vocab_size = h.ints[3];
    c.n_layer = h.ints[4];
    c.n_head = h.ints[5];
    c.n_kv_head = h.ints[5];
    c.n_embd = h.ints[6];
    c.padded_vocab_size = h.ints[7];
    if (h.ints[kExactMarkSlot] == kGpt2EpsMark) c.norm_eps = get_double(h, kEpsSlot);
    TALLY_CHECK(c.norm_eps > 0 && std::isfinite(c.norm_eps), "model file '", path, "': LayerNorm eps ", c.norm_eps,
                ", expected a positive number");
    TALLY_CHECK(c.max_seq_len > 0 && c.vocab_size > 0 && c.n_layer > 0 && c.n_head > 0 && c.n_embd > 0 &&
                    c.padded_vocab_size >= c.vocab_size && c.n_embd % c.n_head == 0,
                "model file '", path, "': implausible header (maxT ", c.max_seq_len, ", V ", c.vocab_size, ", L ",
                c.n_layer, ", heads ", c.n_head, ", C ", c.n_embd, ", Vp ", c.padded_vocab_size, ")");
  }
  const int64_t width = width_of(h);
  const int64_t expected = checked_add(
      h.data_offset, checked_mul(layout_numel(c, path), width, "model file '", path, "': header's byte count"),
      "model file '", path, "': header's byte count");
  TALLY_CHECK(h.file_size == expected, "model file '", path, "' is ", h.file_size, " bytes but its header (",
              c.describe(), ", ", width == 4 ? "fp32" : "bf16", ") needs ", expected, " bytes");
  return c;
}

uint32_t load_llmc(const std::string& path, nn::Transformer& model) {
  nn::TransformerConfig c = read_llmc_config(path);
  const auto& m = model.config();
  TALLY_CHECK(c.family == m.family && c.head_width == m.head_width && c.n_layer == m.n_layer && c.n_embd == m.n_embd &&
                  c.n_head == m.n_head && c.n_experts == m.n_experts && c.experts_per_token == m.experts_per_token &&
                  c.moe_ffn_hidden == m.moe_ffn_hidden && c.norm_topk_prob == m.norm_topk_prob &&
                  c.decoder_sparse_step == m.decoder_sparse_step && c.mlp_only_layers == m.mlp_only_layers &&
                  c.router_aux_loss_coef == m.router_aux_loss_coef &&
                  c.n_kv_head == m.n_kv_head && c.ffn_dim() == m.ffn_dim() && c.vocab_size == m.vocab_size &&
                  c.padded_vocab_size == m.padded_vocab_size && c.max_seq_len == m.max_seq_len,
              "model file '", path, "' holds ", c.describe(), " but the model is ", m.describe());
  std::ifstream in;
  Header h = read_header(path, in);
  if (h.ints[0] == kLlamaMagic || h.ints[0] == kQwenMagic) llama_config(h, path);  // settles data_offset
  in.seekg(h.data_offset);
  // The file stacks each kind over layers; read each layer's slice straight into its
  // parameter (a whole model's parameters are contiguous; a vocabulary-row tensor fills
  // the first vocab_size rows, also contiguous, and leaves the padding rows zero). A
  // shard reads the parameters it holds no part of through a small buffer: the checksum
  // covers every byte.
  const int64_t width = width_of(h);
  std::vector<char> passed;
  std::vector<uint16_t> raw;
  Crc32 crc;
  nn::fill_whole_parameters(model, [&](const nn::LlmcTensor& t, size_t, const nn::ParameterSpec& spec, const Tensor& target) {
    int64_t n = shape_numel(spec.shape);
    if (t.vocab_rows && spec.shape[0] != m.vocab_size) n = n / spec.shape[0] * m.vocab_size;
    if (!target.defined()) {
      constexpr int64_t kPass = 1 << 20;  // bytes read at a time
      passed.resize(static_cast<size_t>(std::min(n * width, kPass)));
      for (int64_t left = n * width; left > 0 && in.good(); left -= kPass) {
        const int64_t bytes = std::min(left, kPass);
        in.read(passed.data(), bytes);
        crc.update(passed.data(), static_cast<size_t>(bytes));
      }
      return;
    }
    Tensor p = target;
    if (p.numel() != n) {
      p.zero_();
      p = p.slice(0, 0, m.vocab_size);
    }
    if (width == 4) {
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
  });
  TALLY_CHECK(in.good(), "model file '", path, "': read failed");
  const bool has_checksum = h.ints[kChecksumMarkSlot] == kChecksumMark || h.ints[kChecksumMarkSlot] == kHeaderChecksumMark;
  TALLY_CHECK(!has_checksum || static_cast<uint32_t>(h.ints[kChecksumSlot]) == crc.value(),
              "model file '", path, "': checksum mismatch (stored ", static_cast<uint32_t>(h.ints[kChecksumSlot]),
              ", computed ", crc.value(), "): the file is corrupt");
  return crc.value();
}

void save_llmc(const std::string& path, const nn::Transformer& model, bool bf16) {
  save_llmc(path, model, [&](size_t i) { return model.params()[i].detach(); }, bf16);
}

namespace {
// A value for an int32 slot of llm.c's header, refused (naming the file and the field) when
// the slot cannot hold it: truncated, the file would describe another model.
int32_t header_int(const std::string& path, const char* field, double value) {
  TALLY_CHECK(value >= std::numeric_limits<int32_t>::min() && value <= std::numeric_limits<int32_t>::max(),
              "model file '", path, "': ", field, " ", value,
              " does not fit llm.c's header, which holds it as a 32-bit integer; save this model as HuggingFace "
              "safetensors instead");
  return static_cast<int32_t>(value);
}
}  // namespace

void save_llmc(const std::string& path, const nn::Transformer& model, const std::function<Tensor(size_t)>& values,
               bool bf16) {
  const auto& c = model.config();
  Header h;
  std::memset(h.ints, 0, sizeof h.ints);
  h.ints[1] = bf16 ? 5 : 3;
  h.ints[2] = header_int(path, "max_seq_len", static_cast<double>(c.max_seq_len));
  h.ints[3] = header_int(path, "vocab_size", static_cast<double>(c.vocab_size));
  h.ints[4] = header_int(path, "n_layer", static_cast<double>(c.n_layer));
  h.ints[5] = header_int(path, "n_head", static_cast<double>(c.n_head));
  if (c.llama_architecture()) {
    // train_llama3.py's header, truncations included, and the exact values beside it.
    h.ints[0] = c.family == nn::TransformerConfig::Family::Llama3 ? kLlamaMagic : kQwenMagic;
    h.ints[6] = header_int(path, "n_kv_head", static_cast<double>(c.n_kv_head));
    h.ints[7] = header_int(path, "n_embd", static_cast<double>(c.n_embd));
    h.ints[8] = header_int(path, "ffn_dim_multiplier", c.ffn_dim_multiplier);
    h.ints[9] = header_int(path, "multiple_of", static_cast<double>(c.multiple_of));
    h.ints[10] = static_cast<int32_t>(c.norm_eps);
    h.ints[11] = header_int(path, "rope_theta", c.rope_theta);
    h.ints[12] = c.rope_factor > 0 ? 1 : 0;
    h.ints[13] = 4;  // max_gen_batch_size, train_llama3.py's default
    h.ints[14] = 3;  // version "3.1"
    h.ints[15] = 1;
    h.ints[kExactMarkSlot] = kExactMark;
    h.ints[kFfnSlot] = header_int(path, "ffn_hidden", static_cast<double>(c.ffn_hidden));
    h.ints[kTiedSlot] = c.tie_embeddings ? 1 : 0;
    h.ints[kOriginalContextSlot] =
        header_int(path, "rope_original_max_position", static_cast<double>(c.rope_original_max_position));
    put_double(h, kEpsSlot, c.norm_eps);
    put_double(h, kThetaSlot, c.rope_theta);
    put_double(h, kFactorSlot, c.rope_factor);
    put_double(h, kLowSlot, c.rope_low_freq_factor);
    put_double(h, kHighSlot, c.rope_high_freq_factor);
    put_double(h, kMultiplierSlot, c.ffn_dim_multiplier);
    if (h.ints[0] == kQwenMagic) {
      h.ints[kFamilySlot] = static_cast<int32_t>(c.family);
      h.ints[kHeadWidthSlot] = header_int(path, "head_dim", static_cast<double>(c.head_width));
    }
    if (c.n_experts > 0) {
      for (int64_t l : c.mlp_only_layers) {
        TALLY_CHECK(l < 32 * kDenseLayerMaskSlots, "model file '", path, "': mlp_only_layers names layer ", l,
                    "; the header holds layers below ", 32 * kDenseLayerMaskSlots, ": save this model as HuggingFace "
                    "safetensors instead");
        h.ints[kDenseLayerMaskSlot + l / 32] = static_cast<int32_t>(static_cast<uint32_t>(h.ints[kDenseLayerMaskSlot + l / 32]) |
                                                                    (1u << (l % 32)));
      }
      h.ints[kExpertsSlot] = header_int(path, "num_experts", static_cast<double>(c.n_experts));
      h.ints[kExpertsPerTokenSlot] = header_int(path, "num_experts_per_tok", static_cast<double>(c.experts_per_token));
      h.ints[kExpertWidthSlot] = header_int(path, "moe_intermediate_size", static_cast<double>(c.moe_ffn_hidden));
      h.ints[kSparseStepSlot] = header_int(path, "decoder_sparse_step", static_cast<double>(c.decoder_sparse_step));
      h.ints[kNormTopKSlot] = c.norm_topk_prob ? 1 : 0;
      put_double(h, kRouterLossSlot, c.router_aux_loss_coef);
    }
  } else {
    h.ints[0] = kGpt2Magic;
    h.ints[6] = header_int(path, "n_embd", static_cast<double>(c.n_embd));
    h.ints[7] = header_int(path, "padded_vocab_size", static_cast<double>(c.padded_vocab_size));
    h.ints[kExactMarkSlot] = kGpt2EpsMark;
    put_double(h, kEpsSlot, c.norm_eps);
  }
  h.ints[kChecksumMarkSlot] = kHeaderChecksumMark;
  h.ints[kHeaderChecksumSlot] = static_cast<int32_t>(header_checksum(h));
  AtomicFile out(path);
  out.write(h.ints, 1024);  // the checksum is filled in at the end
  std::vector<uint16_t> raw;
  Crc32 crc;
  for (const nn::LlmcTensor& t : nn::llmc_tensors(model)) {
    for (size_t i : t.params) {
      Tensor p = values(i);
      if (t.vocab_rows) p = p.slice(0, 0, c.vocab_size);  // contiguous: the leading rows
      if (!p.device().is_cpu()) {  // a device's parameters are written from a host copy
        Tensor host = Tensor::empty(p.shape(), p.dtype(), Device::cpu(), make_owner(Category::Other, "model_file.write"));
        host.copy_(p);
        p = host;
      }
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

}  // namespace tally::io
