// HuggingFace model files, as users have them.
//   GPT-2: a model.safetensors (keys "wte.weight" ... or "transformer.wte.weight" ...;
//     Conv1D weights are (in, out): transposed on the way in and out), with or without a
//     config.json beside it (without one the head count comes from the file's n_head
//     metadata, or GPT-2's 64-wide heads).
//   LLaMA-3: a directory with config.json ("model_type": "llama") and model.safetensors,
//     or shards model-0000k-of-0000n.safetensors listed in model.safetensors.index.json;
//     fp32 or bf16. HF stores q_proj and k_proj with each head's rows permuted (its rotary
//     pairs element i with i + D/2, Meta's and tally's pair 2i with 2i+1): import undoes
//     the permutation and fuses q, k, v into c_attn; export splits and permutes again, so
//     a round trip is bit-exact.
#pragma once
#include <string>
#include <vector>

#include "nn/transformer.h"

namespace tally::io {

// Whether `path` is a HuggingFace model directory (it holds config.json).
bool is_hf_model_dir(const std::string& path);
// The files a load from `path` may read: its config.json (in the directory, or beside a
// single file), model.safetensors.index.json and every .safetensors file in a directory
// (an index names some of them), or a single file and the config.json beside it. It never
// fails, whether or not the files exist (read_hf_config says what is wrong with a path).
std::vector<std::string> hf_files_read(const std::string& path);
// The model's shape from `path`: a model directory or a model.safetensors file.
nn::TransformerConfig read_hf_config(const std::string& path);
// Reads the weights into `model`, built from read_hf_config(path). With `crc_of_each` (CPU
// models): the CRC-32 of each whole parameter as this process filled it, by the whole
// model's parameter index, -1 for those it did not fill (another pipeline stage's), so that
// ranks can check they read the same weights.
void load_hf(const std::string& path, nn::Transformer& model, std::vector<int64_t>* crc_of_each = nullptr);
// Writes `dir`/config.json and `dir`/model.safetensors (fp32, or bf16 rounded to nearest
// even), atomically each; the directory is created when missing. An earlier sharded save
// there (model.safetensors.index.json and the shards it names) is removed afterwards: for
// loaders that read the index first it would shadow the new weights.
void save_hf(const std::string& dir, const nn::Transformer& model, bool bf16 = false);

}  // namespace tally::io
