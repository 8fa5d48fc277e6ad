// Model files tally reads and writes.
//   llm.c GPT-2 (.bin): 256 x int32 header (magic 20240326, version 3 = fp32, 5 = bf16),
//     then the 16 stacked tensors in llm.c order. Read and written.
//   llm.c LLaMA-3 (.bin): magic 20240803, as llm.c's train_llama3.py writes it: one
//     int32 header whose float fields are truncated (ffn_dim_multiplier 1.3 -> 1,
//     norm_eps 1e-5 -> 0), then wte, ln1w, qkvw, attprojw, ln2w, fcw (up), fcw2 (gate),
//     fcprojw, lnfw, lm_head, each stacked over layers, embedding and head unpadded.
//     Reading recovers what the header lost: the FFN width from the file size, norm_eps
//     1e-5 (LLaMA-3's), and, when use_scaled_rope is set, the 3.1 scaling train_llama3.py
//     hard-codes (factor 8, low 1, high 4, original context 8192). llm.c's C writer's
//     variant (a 256 x float32 block after the ints holding ffn_dim_multiplier, norm_eps
//     and rope_theta; weights at byte 2048) is recognised too. Files tally writes carry
//     the exact values in header slots llm.c leaves unused (230..245), so its own files
//     read back exactly (tied head included). A GPT-2 file tally writes carries its
//     LayerNorm eps there too (llm.c's: 1e-5, GPT-2's own).
//   Qwen2 / Qwen3 (.bin, tally's own): magic 20261202 (llm.c has no such model and refuses
//     it), LLaMA-3's header with the exact values, the family (slot 246: 2 = qwen2,
//     3 = qwen3) and Qwen3's head width (slot 247); LLaMA-3's tensors with Qwen2's q/k/v
//     biases (qkvb, (L, qkv rows)) after qkvw, or Qwen3's q and k norms (qnormw, knormw,
//     (L, head width)) there. Qwen3-MoE (family 4) adds its experts' shape in slots 248, 249
//     and 253..255 (count, per token, width, sparse-layer step, renormalization) and its
//     sparse layers' routerw (Ls, E, C) and expfcw, expfcw2, expfcprojw (Ls, E, ...) after
//     ln2w (the dense layers' MLP kinds stacked over those layers only); mlp_only_layers is a
//     bit mask in slots 64..191, router_aux_loss_coef a double in slots 192..193.
//   HuggingFace files: io/hf_files.h.
#pragma once
#include <functional>
#include <string>

#include "nn/transformer.h"

namespace tally::io {

// Reads the header of an llm.c model file (either family) into a config, validating
// magic, version, sizes and the file length against the header.
nn::TransformerConfig read_llmc_config(const std::string& path);
// Reads the weights into `model` (whose config must match the file's). Returns the CRC-32
// of the weight bytes, all of them also when `model` is a shard (what ranks compare).
uint32_t load_llmc(const std::string& path, nn::Transformer& model);
// Writes the model atomically; bf16 = version 5 (round to nearest even), else version 3.
void save_llmc(const std::string& path, const nn::Transformer& model, bool bf16 = false);
// The same file for `model`'s layout (a model, or Transformer::layout_only), each
// parameter's values (its whole shape) from `values(index)`, asked in file order (a tied
// head's wte twice), one at a time: a writer that gathers them from other ranks needs one
// whole parameter at once, not the whole model.
void save_llmc(const std::string& path, const nn::Transformer& model, const std::function<Tensor(size_t)>& values,
               bool bf16 = false);

}  // namespace tally::io
