#include "io/hf_files.h"

#include <charconv>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "autograd/grad_mode.h"
#include "core/atomic_file.h"
#include "core/json_input.h"
#include "data/tokenizer.h"
#include "io/checksum.h"
#include "io/files.h"
#include "io/safetensors.h"
#include "nn/llmc_layout.h"

namespace tally::io {

namespace {
namespace fs = std::filesystem;
using json = nlohmann::json;

// Where a model's pieces are: its config.json (empty when there is none) and its
// safetensors files.
struct HfSource {
  std::string config_path;
  std::vector<std::string> shards;
  std::string index_path;                              // the index, when sharded
  std::map<std::string, std::string> file_of_tensor;  // the index's weight_map: tensor -> shard path
};

// Whether `p` is there, a link included: a link to nothing is there and broken, not absent
// (the model would otherwise be read without the config it names).
bool present(const fs::path& p, const char* what) {
  std::error_code ec;
  const fs::file_status link = fs::symlink_status(p, ec);
  if (!fs::exists(link)) return false;
  TALLY_CHECK(!fs::is_symlink(link) || fs::exists(p, ec), what, " '", p.string(), "' is a link to '",
              fs::read_symlink(p, ec).string(), "', which does not exist");
  return true;
}

// The shards a model.safetensors.index.json names, and where it says each tensor is.
void read_index(const fs::path& index, HfSource& src) {
  const fs::path dir = index.parent_path();
  src.index_path = index.string();
  const json j = parse_json(read_file(index.string()), "HuggingFace index '" + index.string() + "'");
  TALLY_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "HuggingFace index '", index.string(),
              "' has no weight_map object");
  std::set<std::string> files;
  for (auto& [name, file] : j["weight_map"].items()) {
    TALLY_CHECK(file.is_string() && file.get<std::string>().find('/') == std::string::npos, "HuggingFace index '",
                index.string(), "': tensor '", name, "' maps to ", file.dump(), ", expected a file name beside it");
    files.insert(file.get<std::string>());
    src.file_of_tensor.emplace(name, (dir / file.get<std::string>()).string());
  }
  for (const std::string& f : files) src.shards.push_back((dir / f).string());
}

HfSource locate(const std::string& path) {
  HfSource src;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    if (present(dir / "config.json", "HuggingFace config")) src.config_path = (dir / "config.json").string();
    const fs::path index = dir / "model.safetensors.index.json";
    const bool single = present(dir / "model.safetensors", "HuggingFace model");
    if (present(index, "HuggingFace index")) {
      TALLY_CHECK(!single, "HuggingFace model directory '", path, "' has both model.safetensors and "
                  "model.safetensors.index.json: which one is the model is not said; remove the other");
      read_index(index, src);
    } else if (single) {
      src.shards.push_back((dir / "model.safetensors").string());
    }
    TALLY_CHECK(!src.shards.empty(), "HuggingFace model directory '", path,
                "' has neither model.safetensors nor model.safetensors.index.json");
  } else {
    TALLY_CHECK(fs::is_regular_file(path, ec), "HuggingFace model '", path,
                "' does not exist (expected a model directory or a model.safetensors file)");
    const fs::path beside = fs::path(path).parent_path() / "config.json";
    if (present(beside, "HuggingFace config")) src.config_path = beside.string();
    src.shards.push_back(path);
  }
  return src;
}

json read_config(const std::string& path) {
  json j = parse_json(read_file(path), "HuggingFace config '" + path + "'");
  TALLY_CHECK(j.is_object(), "HuggingFace config '", path, "' is not a JSON object");
  return j;
}

// A numeric field of config.json; `fallback` when absent (NaN: required).
double number(const json& j, const char* key, const std::string& path, double fallback = NAN) {
  if (!j.contains(key) || j[key].is_null()) {
    TALLY_CHECK(!std::isnan(fallback), "HuggingFace config '", path, "' lacks \"", key, "\"");
    return fallback;
  }
  TALLY_CHECK(j[key].is_number(), "HuggingFace config '", path, "': \"", key, "\" is ", j[key].dump(), ", expected a number");
  return j[key].get<double>();
}
int64_t integer(const json& j, const char* key, const std::string& path, double fallback = NAN) {
  const double v = number(j, key, path, fallback);
  TALLY_CHECK(v == std::floor(v) && v >= 0 && v < 1e12, "HuggingFace config '", path, "': \"", key, "\" is ", v,
              ", expected a non-negative integer");
  return static_cast<int64_t>(v);
}

// A field that must be a positive finite number (epsilons); `fallback` when absent.
double positive(const json& j, const char* key, const std::string& path, double fallback) {
  const double v = number(j, key, path, fallback);
  TALLY_CHECK(std::isfinite(v) && v > 0, "HuggingFace config '", path, "': \"", key, "\" is ", v,
              ", expected a positive number");
  return v;
}

// The model's own checks (TransformerConfig::validate), their message naming the config.
void validate_from(const nn::TransformerConfig& c, const std::string& path) {
  try {
    c.validate();
  } catch (const Error& e) {
    std::string what = e.what();
    if (what.rfind("tally: ", 0) == 0) what.erase(0, 7);
    TALLY_FAIL("HuggingFace config '", path, "': ", what);
  }
}

std::string model_type(const HfSource& src) {
  if (src.config_path.empty()) {
    // A bare model.safetensors is GPT-2's, whose shape is all in its weights. LLaMA's heads,
    // rotary and norms are not: its weights without a config.json are refused as LLaMA's,
    // not read as a GPT-2 (whose loader would only say 'wte.weight' is missing).
    for (const std::string& shard : src.shards)
      TALLY_CHECK(!index_safetensors(shard).has("model.embed_tokens.weight"), "HuggingFace model '", shard,
                  "' holds LLaMA's tensors (model.embed_tokens.weight) but no config.json beside it: LLaMA's heads, "
                  "rotary embedding and norms are not in its weights");
    return "gpt2";
  }
  json j = read_config(src.config_path);
  TALLY_CHECK(j.contains("model_type") && j["model_type"].is_string(), "HuggingFace config '", src.config_path,
              "' has no \"model_type\"");
  const std::string type = j["model_type"].get<std::string>();
  TALLY_CHECK(type == "gpt2" || type == "llama" || type == "qwen2" || type == "qwen3" || type == "qwen3_moe",
              "HuggingFace config '", src.config_path, "': model_type '", type,
              "' is not supported (expected gpt2, llama, qwen2, qwen3 or qwen3_moe)");
  return type;
}

// Qwen3-MoE's experts from its config.json (HuggingFace's Qwen3MoeConfig defaults where a
// key is absent: norm_topk_prob false, decoder_sparse_step 1, no mlp_only_layers).
void moe_config(const json& j, const std::string& path, nn::TransformerConfig& c) {
  c.n_experts = integer(j, "num_experts", path);
  c.experts_per_token = integer(j, "num_experts_per_tok", path);
  c.moe_ffn_hidden = integer(j, "moe_intermediate_size", path);
  c.decoder_sparse_step = integer(j, "decoder_sparse_step", path, 1);
  const auto flag = [&](const char* key, bool fallback) {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    TALLY_CHECK(j[key].is_boolean(), "HuggingFace config '", path, "': \"", key, "\" is ", j[key].dump(),
                ", expected true or false");
    return j[key].get<bool>();
  };
  c.norm_topk_prob = flag("norm_topk_prob", false);
  // output_router_logits: HuggingFace adds its load-balancing loss, times the coefficient.
  if (flag("output_router_logits", false)) c.router_aux_loss_coef = number(j, "router_aux_loss_coef", path, 0.001);
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
    TALLY_CHECK(j["mlp_only_layers"].is_array(), "HuggingFace config '", path, "': mlp_only_layers is ",
                j["mlp_only_layers"].dump(), ", expected a list of layer indices");
    for (const json& l : j["mlp_only_layers"]) {
      TALLY_CHECK(l.is_number_integer(), "HuggingFace config '", path, "': mlp_only_layers holds ", l.dump(),
                  ", expected layer indices");
      c.mlp_only_layers.push_back(l.get<int64_t>());
    }
    // A set of layers: kept sorted, once each, as the model files store it.
    std::sort(c.mlp_only_layers.begin(), c.mlp_only_layers.end());
    c.mlp_only_layers.erase(std::unique(c.mlp_only_layers.begin(), c.mlp_only_layers.end()), c.mlp_only_layers.end());
  }
}

// LLaMA's architecture as config.json describes it: LLaMA-3 ("llama"), Qwen2.5 ("qwen2":
// biases on q, k and v, always) or Qwen3 ("qwen3": q/k norms, an explicit head_dim).
nn::TransformerConfig llama_config(const std::string& path, const std::string& type) {
  using Family = nn::TransformerConfig::Family;
  json j = read_config(path);
  nn::TransformerConfig c;
  c.family = type == "qwen2"       ? Family::Qwen2
             : type == "qwen3"     ? Family::Qwen3
             : type == "qwen3_moe" ? Family::Qwen3Moe
                                   : Family::Llama3;
  c.n_embd = integer(j, "hidden_size", path);
  c.ffn_hidden = integer(j, "intermediate_size", path);
  c.n_layer = integer(j, "num_hidden_layers", path);
  c.n_head = integer(j, "num_attention_heads", path);
  c.n_kv_head = integer(j, "num_key_value_heads", path, static_cast<double>(c.n_head));
  c.vocab_size = integer(j, "vocab_size", path);
  c.padded_vocab_size = (c.vocab_size + 127) / 128 * 128;
  c.max_seq_len = integer(j, "max_position_embeddings", path);
  c.norm_eps = positive(j, "rms_norm_eps", path, 1e-6);
  if (j.contains("hidden_act") && !j["hidden_act"].is_null())
    TALLY_CHECK(j["hidden_act"] == "silu", "HuggingFace config '", path, "': hidden_act ",
                j["hidden_act"].is_string() ? "'" + j["hidden_act"].get<std::string>() + "'" : j["hidden_act"].dump(),
                " is not supported (LLaMA's SwiGLU uses silu, as tally's model does)");
  c.rope_theta = number(j, "rope_theta", path, 10000.0);
  c.tie_embeddings = j.contains("tie_word_embeddings") && j["tie_word_embeddings"].is_boolean() &&
                     j["tie_word_embeddings"].get<bool>();
  const bool has_head_dim = j.contains("head_dim") && !j["head_dim"].is_null();
  if (c.has_qk_norm()) {
    // Qwen3's heads are head_dim wide whatever hidden_size / num_attention_heads is.
    TALLY_CHECK(c.n_head > 0 && (has_head_dim || c.n_embd % c.n_head == 0), "HuggingFace config '", path,
                "': no head_dim and ", c.n_head, " heads do not divide hidden_size ", c.n_embd);
    c.head_width = has_head_dim ? integer(j, "head_dim", path) : c.n_embd / c.n_head;
  } else {
    TALLY_CHECK(c.n_head > 0 && c.n_embd % c.n_head == 0, "HuggingFace config '", path, "': ", c.n_head,
                " heads do not divide hidden_size ", c.n_embd);
    if (has_head_dim)
      TALLY_CHECK(integer(j, "head_dim", path) == c.n_embd / c.n_head, "HuggingFace config '", path, "': head_dim ",
                  j["head_dim"].dump(), " differs from hidden_size / num_attention_heads = ", c.n_embd / c.n_head,
                  " (", type, "'s heads are hidden_size / num_attention_heads wide)");
  }
  // Qwen2's q/k/v biases are its architecture's, whatever the config says; LLaMA-3 and
  // Qwen3 have none.
  for (const char* bias : {"attention_bias", "mlp_bias"})
    TALLY_CHECK(c.family == Family::Qwen2 || !j.contains(bias) || !j[bias].is_boolean() || !j[bias].get<bool>(),
                "HuggingFace config '", path, "': ", bias, " is true; ", type,
                " as tally builds it (and as published) has no such biases");
  if (c.family == Family::Qwen3Moe) moe_config(j, path, c);
  TALLY_CHECK(!j.contains("use_sliding_window") || !j["use_sliding_window"].is_boolean() ||
                  !j["use_sliding_window"].get<bool>(),
              "HuggingFace config '", path, "': use_sliding_window is true; tally's attention is full causal attention");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    TALLY_CHECK(c.family == Family::Llama3, "HuggingFace config '", path, "': rope_scaling ", j["rope_scaling"].dump(),
                " is not supported for ", type, " (tally scales rotary frequencies as LLaMA-3.1 does only)");
    const json& r = j["rope_scaling"];
    // rope_type is the newer key; type the older one.
    TALLY_CHECK(r.is_object(), "HuggingFace config '", path, "': rope_scaling is ", r.dump(), ", expected an object");
    const char* key = r.contains("rope_type") ? "rope_type" : "type";
    TALLY_CHECK(!r.contains(key) || r[key].is_string(), "HuggingFace config '", path, "': rope_scaling's ", key, " is ",
                r[key].dump(), ", expected a string");
    const std::string type = r.contains(key) ? r[key].get<std::string>() : "";
    TALLY_CHECK(type == "llama3", "HuggingFace config '", path, "': rope_scaling type '", type,
                "' is not supported (LLaMA-3.1's \"llama3\" is)");
    c.rope_factor = number(r, "factor", path);
    c.rope_low_freq_factor = number(r, "low_freq_factor", path);
    c.rope_high_freq_factor = number(r, "high_freq_factor", path);
    c.rope_original_max_position = integer(r, "original_max_position_embeddings", path);
  }
  // tally's exports carry Meta's rounding of the FFN width (which llm.c's header keeps and
  // HuggingFace's config has no field for); other files get the first usual pair.
  const bool has_rounding = j.contains("multiple_of") && j["multiple_of"].is_number_integer() &&
                            j.contains("ffn_dim_multiplier") && j["ffn_dim_multiplier"].is_number();
  c.multiple_of = has_rounding ? j["multiple_of"].get<int64_t>() : 0;  // 0: none, the first usual pair
  c.ffn_dim_multiplier = has_rounding ? j["ffn_dim_multiplier"].get<double>() : 0.0;
  nn::settle_llama_ffn_rounding(c);
  validate_from(c, path);
  return c;
}

// GPT-2's HuggingFace names: tally's parameter names, with ".weight" on the two tables.
std::string gpt2_hf_name(const std::string& name) { return name == "wte" || name == "wpe" ? name + ".weight" : name; }
// HF's Conv1D layers store their weights (in, out): the 2-D weights inside the blocks.
bool gpt2_conv1d(const std::string& name) {
  return name.rfind("h.", 0) == 0 && name.find(".weight") != std::string::npos && name.find("ln_") == std::string::npos;
}
// A model's safetensors files (one, or the shards an index names) by their headers: which
// file holds each tensor. Only the headers are read here; weights are read tensor by tensor.
struct SafetensorsShards {
  std::vector<SafetensorsFile> files;
  std::map<std::string, size_t> file_of;  // tensor name -> files index
  std::string path;                       // the first file's, for errors that name the model

  explicit SafetensorsShards(const HfSource& src) {
    for (const std::string& shard : src.shards) {
      files.push_back(index_safetensors(shard));  // the header: shapes, no weights
      // One tensor in two files is refused: whichever copy a loader took, the other would
      // be passed over without a word.
      for (const std::string& name : files.back().order) {
        const auto [it, first] = file_of.emplace(name, files.size() - 1);
        TALLY_CHECK(first, "HuggingFace model: tensor '", name, "' is in both '", files[it->second].path, "' and '",
                    shard, "'");
      }
    }
    path = src.shards.at(0) + (src.shards.size() > 1 ? " (and " + std::to_string(src.shards.size() - 1) + " more shards)" : "");
    if (!src.index_path.empty()) check_against_index(src);
  }
  // The index says where each tensor is: a tensor in another shard than it names, or in no
  // entry of it, means the index and the shards are of different saves.
  void check_against_index(const HfSource& src) const {
    for (const auto& [name, file] : src.file_of_tensor) {
      const auto it = file_of.find(name);
      TALLY_CHECK(it != file_of.end(), "HuggingFace index '", src.index_path, "' maps tensor '", name, "' to '", file,
                  "', which does not hold it");
      TALLY_CHECK(files[it->second].path == file, "HuggingFace index '", src.index_path, "' maps tensor '", name,
                  "' to '", file, "', but it is in '", files[it->second].path, "'");
    }
    for (const auto& [name, index] : file_of)
      TALLY_CHECK(src.file_of_tensor.count(name), "HuggingFace index '", src.index_path, "' does not list tensor '",
                  name, "' of '", files[index].path, "'");
  }
  const SafetensorsFile& file(const std::string& key) const { return files.at(file_of.at(key)); }
  const SafetensorsFile::Entry& entry(const std::string& key) const { return file(key).entry(key); }
};

// The key of GPT-2's `hf_name` in its files, which may carry a "transformer." prefix;
// empty when no file has it.
std::string gpt2_key(const SafetensorsShards& f, const std::string& hf_name) {
  if (f.file_of.count(hf_name)) return hf_name;
  if (f.file_of.count("transformer." + hf_name)) return "transformer." + hf_name;
  return "";
}

nn::TransformerConfig gpt2_config(const HfSource& src) {
  const SafetensorsShards f(src);
  auto key = [&](const std::string& name) {
    const std::string k = gpt2_key(f, name);
    TALLY_CHECK(!k.empty(), "HuggingFace GPT-2 file '", f.path, "': missing tensor '", name, "'");
    return k;
  };
  const Shape& wte = f.entry(key("wte.weight")).shape;
  const Shape& wpe = f.entry(key("wpe.weight")).shape;
  TALLY_CHECK(wte.size() == 2 && wpe.size() == 2 && wte[1] == wpe[1], "HuggingFace GPT-2 file '",
              f.path, "': wte.weight ", shape_str(wte), " and wpe.weight ", shape_str(wpe),
              " must be 2-D with the same width");
  nn::TransformerConfig c;
  c.vocab_size = wte[0];
  c.padded_vocab_size = (c.vocab_size + 127) / 128 * 128;
  c.n_embd = wte[1];
  c.max_seq_len = wpe[0];
  int64_t L = 0;
  while (!gpt2_key(f, "h." + std::to_string(L) + ".ln_1.weight").empty()) ++L;
  TALLY_CHECK(L > 0, "HuggingFace GPT-2 file '", f.path, "': no layers (h.0.ln_1.weight) found");
  c.n_layer = L;
  // The head count is not in the weights: config.json's n_head, the file's n_head
  // metadata, or GPT-2's 64-wide heads (true of gpt2, -medium, -large and -xl).
  const std::map<std::string, std::string>& metadata = f.files.front().metadata;
  auto it = metadata.find("n_head");
  if (!src.config_path.empty()) {
    c.n_head = integer(read_config(src.config_path), "n_head", src.config_path);
  } else if (it != metadata.end()) {
    // The whole string: std::stoll reads "4abc" as 4.
    const std::string& text = it->second;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), c.n_head);
    TALLY_CHECK(error == std::errc() && end == text.data() + text.size() && c.n_head > 0, "HuggingFace GPT-2 file '",
                f.path, "': metadata n_head '", text, "' is not a positive integer");
  } else {
    TALLY_CHECK(c.n_embd % 64 == 0, "HuggingFace GPT-2 file '", f.path, "': width ", c.n_embd,
                " is not a multiple of GPT-2's 64-wide heads and the file has no n_head metadata");
    c.n_head = c.n_embd / 64;
    // A guess that changes the model's function if wrong: say so, once per file.
    static std::set<std::string> warned;
    if (warned.insert(f.path).second)
      std::fprintf(stderr, "tally: warning: HuggingFace GPT-2 file '%s' has no config.json beside it and no n_head "
                   "metadata: assuming GPT-2's 64-wide heads, %lld heads for the width %lld; put a config.json with n_head "
                   "beside it if the model has others\n", f.path.c_str(), static_cast<long long>(c.n_head),
                   static_cast<long long>(c.n_embd));
  }
  TALLY_CHECK(c.n_head > 0 && c.n_embd % c.n_head == 0, "HuggingFace GPT-2 file '", f.path, "': ", c.n_head,
              " heads do not divide the width ", c.n_embd);
  c.n_kv_head = c.n_head;
  if (!src.config_path.empty()) {
    // The shape comes from the weights; a config.json beside them that says otherwise
    // belongs to another model (or the weights do): refused rather than half believed.
    const std::string& path = src.config_path;
    const json j = read_config(path);
    auto agrees = [&](const char* key, int64_t from_weights, const char* unit) {
      if (!j.contains(key) || j[key].is_null()) return;
      const int64_t v = integer(j, key, path);
      TALLY_CHECK(v == from_weights, "HuggingFace config '", path, "': \"", key, "\" is ", v, " but the weights have ",
                  from_weights, " ", unit);
    };
    agrees("n_layer", c.n_layer, "layers");
    agrees("n_embd", c.n_embd, "channels");
    agrees("vocab_size", c.vocab_size, "tokens");
    agrees("n_positions", c.max_seq_len, "positions");
    // tally's GPT-2 predicts with its token embedding, as GPT-2 does; a head of its own
    // would be read past, and the model would predict with another matrix than HF's.
    TALLY_CHECK(!j.contains("tie_word_embeddings") || !j["tie_word_embeddings"].is_boolean() ||
                    j["tie_word_embeddings"].get<bool>(),
                "HuggingFace config '", path, "': tie_word_embeddings is false, but tally's GPT-2 ties its head to the "
                "token embedding (wte); a GPT-2 with a head of its own is not supported");
    c.norm_eps = positive(j, "layer_norm_epsilon", path, c.norm_eps);
    if (j.contains("activation_function") && !j["activation_function"].is_null()) {
      const json& act = j["activation_function"];
      TALLY_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh", "HuggingFace config '", path,
                  "': activation_function ", act.is_string() ? "'" + act.get<std::string>() + "'" : act.dump(),
                  " is not supported (GPT-2's is gelu_new, the tanh approximation tally's model computes)");
    }
    // Attention scalings HF's GPT2Attention has and tally's does not: scores divided by
    // layer_idx + 1 (Stanford CRFM's GPT-2s), or not divided by sqrt(head_dim).
    // (reorder_and_upcast_attn only changes precision: tally's attention sums in fp32.)
    for (const auto& [key, unsupported] : {std::pair{"scale_attn_by_inverse_layer_idx", true},
                                           std::pair{"scale_attn_weights", false}})
      TALLY_CHECK(!j.contains(key) || !j[key].is_boolean() || j[key].get<bool>() != unsupported, "HuggingFace config '",
                  path, "': ", key, " is ", unsupported ? "true" : "false",
                  ", an attention scaling tally's GPT-2 does not have (it divides the scores by sqrt(head_dim) only)");
    validate_from(c, path);
  }
  return c;
}

// A tensor's header entry, checked before any weight is read: a float dtype (integer
// tensors would be converted value by value into weights) and the shape the model needs.
void require_weight(const SafetensorsFile::Entry& src, const Shape& want, const std::string& file,
                    const std::string& name) {
  TALLY_CHECK(src.dtype == DType::F32 || src.dtype == DType::BF16 || src.dtype == DType::F64, "'", file, "': ", name,
              " is ", dtype_name(src.dtype), ", expected a float weight (F32, BF16 or F64)");
  TALLY_CHECK(src.shape == want, "'", file, "': ", name, " is ", shape_str(src.shape), ", expected ", shape_str(want));
}

// What one HF LLaMA tensor becomes: rows [row0, row0 + rows) of parameter `param`, with
// HF's rotary permutation over `heads` heads undone (heads 0: no permutation).
struct LlamaTarget {
  size_t param;
  int64_t row0, rows;
  int64_t heads = 0;
};

std::map<std::string, LlamaTarget> llama_targets(const nn::Transformer& model) {
  const auto& c = model.config();
  const auto& p = model.params();
  const int64_t C = c.n_embd, KVD = c.kv_dim(), V = c.vocab_size, F = c.ffn_dim();
  const int64_t Q = c.q_dim(), D = c.head_dim();
  std::map<std::string, LlamaTarget> t;
  t["model.embed_tokens.weight"] = {p.index_of("wte"), 0, V};
  if (!c.tie_embeddings) t["lm_head.weight"] = {p.index_of("lm_head"), 0, V};
  t["model.norm.weight"] = {p.index_of("ln_f.weight"), 0, C};
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string hf = "model.layers." + std::to_string(l) + ".", h = "h." + std::to_string(l) + ".";
    const size_t qkv = p.index_of(h + "attn.c_attn.weight");
    t[hf + "input_layernorm.weight"] = {p.index_of(h + "ln_1.weight"), 0, C};
    t[hf + "self_attn.q_proj.weight"] = {qkv, 0, Q, c.n_head};
    t[hf + "self_attn.k_proj.weight"] = {qkv, Q, KVD, c.n_kv_head};
    t[hf + "self_attn.v_proj.weight"] = {qkv, Q + KVD, KVD};
    if (c.has_qkv_bias()) {
      const size_t qkvb = p.index_of(h + "attn.c_attn.bias");
      t[hf + "self_attn.q_proj.bias"] = {qkvb, 0, Q, c.n_head};
      t[hf + "self_attn.k_proj.bias"] = {qkvb, Q, KVD, c.n_kv_head};
      t[hf + "self_attn.v_proj.bias"] = {qkvb, Q + KVD, KVD};
    }
    if (c.has_qk_norm()) {
      // One weight over a head's D channels, which rotary pairs as q's and k's are.
      t[hf + "self_attn.q_norm.weight"] = {p.index_of(h + "attn.q_norm.weight"), 0, D, 1};
      t[hf + "self_attn.k_norm.weight"] = {p.index_of(h + "attn.k_norm.weight"), 0, D, 1};
    }
    t[hf + "self_attn.o_proj.weight"] = {p.index_of(h + "attn.c_proj.weight"), 0, C};
    t[hf + "post_attention_layernorm.weight"] = {p.index_of(h + "ln_2.weight"), 0, C};
    if (c.sparse_layer(l)) {
      // Qwen3-MoE: the router is HF's mlp.gate, each expert a dense MLP's three projections.
      t[hf + "mlp.gate.weight"] = {p.index_of(h + "mlp.router.weight"), 0, c.n_experts};
      for (int64_t e = 0; e < c.n_experts; ++e) {
        const std::string x = "mlp.experts." + std::to_string(e) + ".";
        t[hf + x + "gate_proj.weight"] = {p.index_of(h + x + "c_fc2.weight"), 0, c.moe_ffn_hidden};
        t[hf + x + "up_proj.weight"] = {p.index_of(h + x + "c_fc.weight"), 0, c.moe_ffn_hidden};
        t[hf + x + "down_proj.weight"] = {p.index_of(h + x + "c_proj.weight"), 0, C};
      }
      continue;
    }
    t[hf + "mlp.gate_proj.weight"] = {p.index_of(h + "mlp.c_fc2.weight"), 0, F};
    t[hf + "mlp.up_proj.weight"] = {p.index_of(h + "mlp.c_fc.weight"), 0, F};
    t[hf + "mlp.down_proj.weight"] = {p.index_of(h + "mlp.c_proj.weight"), 0, C};
  }
  return t;
}

// The rows of a tensor laid out along the heads ((heads * D, C) weights, (heads * D)
// biases and norm weights) in Meta's order read from HF's: head h's row 2i + r is HF's
// row r * D/2 + i; and back.
Tensor meta_rows_from_hf(const Tensor& hf, int64_t heads) {
  const int64_t rows = hf.shape()[0], cols = hf.dim() == 2 ? hf.shape()[1] : 1, half = rows / heads / 2;
  return hf.view({heads, 2, half, cols}).transpose(1, 2).reshape(hf.shape());
}
Tensor hf_rows_from_meta(const Tensor& meta, int64_t heads) {
  const int64_t rows = meta.shape()[0], cols = meta.dim() == 2 ? meta.shape()[1] : 1, half = rows / heads / 2;
  return meta.view({heads, half, 2, cols}).transpose(1, 2).reshape(meta.shape());
}

// Called with each whole parameter once it is filled (load_hf's checksums).
using WholeParameterRecord = std::function<void(size_t whole_index, const Tensor& filled)>;

// Both loaders check every tensor's header entry first, then fill the model (whole, or a
// tensor/pipeline shard) one whole parameter at a time, reading only the tensors it keeps
// a part of (nn::fill_whole_parameters): a load holds at most one file tensor
// beside the model (and LLaMA's q and k rows re-ordered once more; none where a tensor is
// read straight into its parameter), never the file. Each filled parameter goes to `record`.
void load_llama(const HfSource& src, nn::Transformer& model, const WholeParameterRecord& record) {
  const auto& c = model.config();
  const nn::Transformer whole = nn::Transformer::layout_only(c);
  const auto targets = llama_targets(whole);
  const SafetensorsShards f(src);
  std::map<size_t, std::vector<std::pair<std::string, size_t>>> sources;  // whole parameter -> (tensor, file)
  std::set<std::string> found;
  for (size_t file = 0; file < f.files.size(); ++file) {
    const SafetensorsFile& shard = f.files[file];
    for (const std::string& name : shard.order) {
      auto it = targets.find(name);
      if (it == targets.end()) {
        // Old exports carry the rotary frequencies as a buffer; a tied model may still
        // store its head. Anything else is a tensor this config does not explain.
        if (name.find("rotary_emb.inv_freq") != std::string::npos || (name == "lm_head.weight" && c.tie_embeddings))
          continue;
        TALLY_FAIL("HuggingFace ", c.family_name(), " file '", shard.path, "': unexpected tensor '", name, "' for ", c.describe(),
                   " (config.json and the weights disagree)");
      }
      const LlamaTarget& t = it->second;
      Shape want = whole.params().spec(t.param).shape;
      want[0] = t.rows;
      require_weight(shard.entry(name), want, shard.path, name);
      sources[t.param].emplace_back(name, file);
      found.insert(name);
    }
  }
  for (const auto& [name, t] : targets)
    TALLY_CHECK(found.count(name), "HuggingFace ", c.family_name(), " model '", f.path, "': tensor '", name, "' is missing");
  nn::fill_whole_parameters(model, [&](const nn::LlmcTensor&, size_t index, const nn::ParameterSpec& spec, const Tensor& target) {
    if (!target.defined()) return;
    // The files hold the first vocab_size rows of the embedding and head; the padding rows
    // are never looked up or predicted: zero.
    if (spec.name == "wte" || spec.name == "lm_head") target.slice(0, c.vocab_size, c.padded_vocab_size).zero_();
    for (const auto& [name, file] : sources[index]) {
      const LlamaTarget& t = targets.at(name);
      const Tensor rows = target.slice(0, t.row0, t.row0 + t.rows);
      if (t.heads) rows.copy_(meta_rows_from_hf(f.files[file].read(name, Category::Other), t.heads));
      else f.files[file].read_into(name, rows);
    }
    record(index, target);
  });
}

void load_gpt2(const HfSource& src, nn::Transformer& model, const WholeParameterRecord& record) {
  const SafetensorsShards f(src);
  const std::string& path = f.path;
  const auto& c = model.config();
  const nn::Transformer whole = nn::Transformer::layout_only(c);
  std::vector<std::string> keys;  // the file's name of each whole parameter
  std::set<std::string> used;
  for (size_t i = 0; i < whole.params().size(); ++i) {
    const std::string& name = whole.params().spec(i).name;
    const Shape& shape = whole.params().spec(i).shape;
    const std::string hf_name = gpt2_hf_name(name);
    keys.push_back(gpt2_key(f, hf_name));
    TALLY_CHECK(!keys.back().empty(), "HuggingFace GPT-2 file '", path, "': missing tensor '", hf_name, "'");
    used.insert(keys.back());
    if (name == "wte") require_weight(f.entry(keys.back()), {c.vocab_size, c.n_embd}, path, "wte.weight");
    else if (gpt2_conv1d(name)) require_weight(f.entry(keys.back()), {shape[1], shape[0]}, path, name + " (Conv1D layout: in, out)");
    else require_weight(f.entry(keys.back()), shape, path, name);
  }
  // Every other tensor must be one GPT-2 files are known to carry beside the weights: the
  // tied head (the same matrix as wte; HF predicts with wte too) and old saves' attention
  // mask buffers. Anything else (a layer beyond the model's) is a file this model is not.
  for (const auto& [name, file] : f.file_of) {
    if (used.count(name)) continue;
    const std::string bare = name.rfind("transformer.", 0) == 0 ? name.substr(12) : name;
    const bool mask = bare.rfind("h.", 0) == 0 && (bare.ends_with(".attn.bias") || bare.ends_with(".attn.masked_bias"));
    TALLY_CHECK(mask || bare == "lm_head.weight", "HuggingFace GPT-2 file '", f.files[file].path, "': unexpected tensor '",
                name, "' for ", c.describe(), " (a file of another model, or config.json and the weights disagree)");
    if (mask) continue;
    // A stored head must be what a tied model stores: wte itself. One of its own (a
    // fine-tune that untied it) would be dropped and the model would predict with wte.
    const std::string& wte_key = keys[whole.params().index_of("wte")];
    const SafetensorsFile::Entry& head = f.entry(name);
    TALLY_CHECK(head.shape == f.entry(wte_key).shape, "HuggingFace GPT-2 file '", f.files[file].path, "': ", name,
                " is ", shape_str(head.shape), ", expected wte's ", shape_str(f.entry(wte_key).shape),
                " (tally's GPT-2 ties its head to wte)");
    TALLY_CHECK(f.files[file].same_tensor(name, f.file(wte_key), wte_key), "HuggingFace GPT-2 file '", f.files[file].path,
                "': ", name, " differs from wte (", wte_key, "): an untied head, which tally's GPT-2 (tied, as ",
                "HuggingFace's GPT-2 is) cannot hold");
  }
  nn::fill_whole_parameters(model, [&](const nn::LlmcTensor&, size_t index, const nn::ParameterSpec& spec, const Tensor& target) {
    if (!target.defined()) return;
    const SafetensorsFile& file = f.file(keys[index]);
    if (spec.name == "wte") {
      target.zero_();
      file.read_into(keys[index], target.slice(0, 0, c.vocab_size));
    } else if (gpt2_conv1d(spec.name)) {
      target.copy_(file.read(keys[index], Category::Other).transpose(0, 1));
    } else {
      file.read_into(keys[index], target);
    }
    record(index, target);
  });
}
}  // namespace

bool is_hf_model_dir(const std::string& path) {
  std::error_code ec;
  // config.json, or a bare GPT-2 save (its weights alone: the shape is in them).
  return fs::is_directory(path, ec) &&
         (fs::exists(fs::path(path) / "config.json", ec) || fs::exists(fs::path(path) / "model.safetensors", ec) ||
          fs::exists(fs::path(path) / "model.safetensors.index.json", ec));
}

std::vector<std::string> hf_files_read(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return {(fs::path(path).parent_path() / "config.json").string(), path};
  std::vector<std::string> files = {(fs::path(path) / "config.json").string(),
                                    (fs::path(path) / "model.safetensors.index.json").string()};
  for (const auto& entry : fs::directory_iterator(path, ec))
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  return files;
}

// LLaMA's config.json against its weights' headers, before a model is built from it: the
// layer count, vocabulary and width are the config's alone, so another model's config
// would build that model, and find its tensors missing only once built (slowly, when large).
void check_llama_config_against_weights(const nn::TransformerConfig& c, const HfSource& src) {
  const SafetensorsShards f(src);
  const std::string& path = src.config_path;
  int64_t L = 0;
  while (f.file_of.count("model.layers." + std::to_string(L) + ".input_layernorm.weight")) ++L;
  TALLY_CHECK(c.n_layer == L, "HuggingFace config '", path, "': \"num_hidden_layers\" is ", c.n_layer,
              " but the weights have ", L, " layers (model.layers.N.input_layernorm.weight)");
  TALLY_CHECK(f.file_of.count("model.embed_tokens.weight"), "HuggingFace config '", path,
              "' is a ", c.family_name(), " config, but its weights ('", f.path, "') have no model.embed_tokens.weight");
  const Shape& embed = f.entry("model.embed_tokens.weight").shape;
  TALLY_CHECK(embed == Shape({c.vocab_size, c.n_embd}), "HuggingFace config '", path, "': \"vocab_size\" ",
              c.vocab_size, " and \"hidden_size\" ", c.n_embd, " but model.embed_tokens.weight is ", shape_str(embed));
}

nn::TransformerConfig read_hf_config(const std::string& path) {
  HfSource src = locate(path);
  const std::string type = model_type(src);
  if (type == "gpt2") return gpt2_config(src);
  const nn::TransformerConfig c = llama_config(src.config_path, type);
  check_llama_config_against_weights(c, src);
  return c;
}

void load_hf(const std::string& path, nn::Transformer& model, std::vector<int64_t>* crc_of_each) {
  HfSource src = locate(path);
  const std::string type = model_type(src);
  const bool llama = type != "gpt2";
  const std::string family = type == "llama" ? "llama3" : type;
  TALLY_CHECK(family == model.config().family_name(), "HuggingFace model '", path, "' is ", type, " but the model is ",
              model.config().describe());
  autograd::NoGradGuard no_grad;
  if (crc_of_each) crc_of_each->assign(nn::Transformer::layout_only(model.config()).params().size(), -1);
  const WholeParameterRecord record = [&](size_t index, const Tensor& filled) {
    if (!crc_of_each) return;
    TALLY_CHECK(filled.device().is_cpu() && filled.is_contiguous(), "internal: weights' checksums are taken on the CPU");
    Crc32 crc;
    crc.update(filled.data<float>(), static_cast<size_t>(filled.numel()) * sizeof(float));
    (*crc_of_each)[index] = crc.value();
  };
  llama ? load_llama(src, model, record) : load_gpt2(src, model, record);
}

void save_hf(const std::string& dir, const nn::Transformer& model, bool bf16) {
  const auto& c = model.config();
  const auto& p = model.params();
  create_directories_for("export", dir, dir);
  autograd::NoGradGuard no_grad;
  std::vector<std::pair<std::string, Tensor>> tensors;
  auto add = [&](const std::string& name, const Tensor& t) {
    tensors.emplace_back(name, bf16 ? t.to(DType::BF16) : t.contiguous());
  };
  json config;
  if (c.llama_architecture()) {
    // The inverse of load_llama, tensor for tensor.
    for (const auto& [name, t] : llama_targets(model)) {
      Tensor rows = p[t.param].slice(0, t.row0, t.row0 + t.rows).detach();
      add(name, t.heads ? hf_rows_from_meta(rows, t.heads) : rows);
    }
    using Family = nn::TransformerConfig::Family;
    const bool llama3 = c.family == Family::Llama3;
    const char* architecture = llama3                       ? "LlamaForCausalLM"
                               : c.family == Family::Qwen2    ? "Qwen2ForCausalLM"
                               : c.family == Family::Qwen3    ? "Qwen3ForCausalLM"
                                                              : "Qwen3MoeForCausalLM";
    config = {{"architectures", {architecture}},
              {"model_type", llama3 ? "llama" : c.family_name()},
              {"hidden_act", "silu"},
              {"hidden_size", c.n_embd},
              {"intermediate_size", c.ffn_hidden},
              {"num_attention_heads", c.n_head},
              {"num_key_value_heads", c.n_kv_head},
              {"num_hidden_layers", c.n_layer},
              {"head_dim", c.head_dim()},
              {"vocab_size", c.vocab_size},
              {"max_position_embeddings", c.max_seq_len},
              {"rms_norm_eps", c.norm_eps},
              {"rope_theta", c.rope_theta},
              {"rope_scaling", nullptr},
              {"tie_word_embeddings", c.tie_embeddings},
              {"torch_dtype", bf16 ? "bfloat16" : "float32"}};
    if (c.family == Family::Qwen2) {
      config["use_sliding_window"] = false;  // Qwen2's q/k/v biases are implied by its model_type
    } else {
      config["attention_bias"] = false;
      config["mlp_bias"] = false;
    }
    if (c.has_qk_norm()) config["use_sliding_window"] = false;
    if (c.n_experts > 0) {
      config["num_experts"] = c.n_experts;
      config["num_experts_per_tok"] = c.experts_per_token;
      config["moe_intermediate_size"] = c.moe_ffn_hidden;
      config["norm_topk_prob"] = c.norm_topk_prob;
      config["decoder_sparse_step"] = c.decoder_sparse_step;
      config["mlp_only_layers"] = c.mlp_only_layers;
      config["output_router_logits"] = c.router_aux_loss_coef > 0;
      if (c.router_aux_loss_coef > 0) config["router_aux_loss_coef"] = c.router_aux_loss_coef;
    }
    // Meta's names (params.json): how intermediate_size was rounded, for llm.c's header.
    if (llama3) {
      config["multiple_of"] = c.multiple_of;
      config["ffn_dim_multiplier"] = c.ffn_dim_multiplier;
    }
    // Qwen's base models begin and end a document with <|endoftext|>.
    if (!llama3 && c.vocab_size > data::kQwenEndOfText)
      config["bos_token_id"] = config["eos_token_id"] = data::kQwenEndOfText;
    // LLaMA-3's tokenizer (the one tally's LLaMA models read) begins and ends a text with
    // <|begin_of_text|> and <|end_of_text|>; without these transformers' generate() falls
    // back to LlamaConfig's defaults, 1 and 2, ordinary tokens of this vocabulary.
    if (llama3 && c.vocab_size > data::kLlama3EndOfText) {
      config["bos_token_id"] = data::kLlama3BeginOfText;
      config["eos_token_id"] = data::kLlama3EndOfText;
    }
    if (c.rope_factor > 0)
      config["rope_scaling"] = {{"rope_type", "llama3"},
                                {"factor", c.rope_factor},
                                {"low_freq_factor", c.rope_low_freq_factor},
                                {"high_freq_factor", c.rope_high_freq_factor},
                                {"original_max_position_embeddings", c.rope_original_max_position}};
  } else {
    for (size_t i = 0; i < p.size(); ++i) {
      const std::string& name = p.spec(i).name;
      Tensor t = p[i].detach();
      if (name == "wte") t = t.slice(0, 0, c.vocab_size);
      add(gpt2_hf_name(name), gpt2_conv1d(name) ? t.transpose(0, 1) : t);
    }
    config = {{"architectures", {"GPT2LMHeadModel"}},
              {"model_type", "gpt2"},
              {"n_embd", c.n_embd},
              {"n_layer", c.n_layer},
              {"n_head", c.n_head},
              {"n_positions", c.max_seq_len},
              {"n_ctx", c.max_seq_len},
              {"vocab_size", c.vocab_size},
              {"layer_norm_epsilon", c.norm_eps},
              {"activation_function", "gelu_new"},
              {"tie_word_embeddings", true},
              {"torch_dtype", bf16 ? "bfloat16" : "float32"}};
  }
  write_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  const std::string text = config.dump(2) + "\n";
  AtomicFile out((fs::path(dir) / "config.json").string());
  out.write(text.data(), text.size());
  out.commit();
  // An earlier sharded save here (an index and its shards) would shadow the new file for
  // loaders that read the index first (tally's among them) and leave two models in one
  // directory: removed once the new weights and config are in place.
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index)) {
    std::vector<std::string> shards;
    try {
      HfSource earlier;
      read_index(index, earlier);
      shards = earlier.shards;
    } catch (const Error&) {
      // An unreadable index: it names nothing to remove, but still shadows the new file.
    }
    for (const std::string& shard : shards)
      if (fs::path(shard).filename() != "model.safetensors") fs::remove(shard);
    fs::remove(index);
  }
  sync_directory(dir);
}

}  // namespace tally::io
