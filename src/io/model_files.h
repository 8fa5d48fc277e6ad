// Model files tally reads and writes.
//   llm.c GPT-2 (.bin): 256 x int32 header (magic 20240326, version 3 = fp32, 5 = bf16),
//     then the 16 stacked tensors in llm.c order. Read and written.
//   HuggingFace GPT-2 model.safetensors: read (Conv1D weights are (in, out): transposed).
#pragma once
#include <string>

#include "nn/transformer.h"

namespace tally::io {

// Reads the header of an llm.c GPT-2 file into a config (validates magic, version, sizes
// and the file length against the header).
nn::TransformerConfig read_llmc_gpt2_config(const std::string& path);
// Reads the weights into `model` (whose config must match the file's).
void load_llmc_gpt2(const std::string& path, nn::Transformer& model);
// Writes the model atomically; bf16 = version 5 (round to nearest even), else version 3.
void save_llmc_gpt2(const std::string& path, const nn::Transformer& model, bool bf16 = false);

// Reads HuggingFace GPT-2 weights ("wte.weight" or "transformer.wte.weight", ...) into a
// model built from the file's shapes. vocab is padded to a multiple of 128.
nn::TransformerConfig read_hf_gpt2_config(const std::string& path);
void load_hf_gpt2(const std::string& path, nn::Transformer& model);

}  // namespace tally::io
