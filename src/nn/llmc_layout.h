// llm.c's file layout of a model's parameters, and filling a model (whole or a shard)
// from a source of the whole model's values in that order.
//
// llm.c's files stack each kind of weight over the layers ("qkvw" is (L, 3C, C)); tally
// keeps the parameters layer by layer (nn/parameters.h). Every source of a whole model's
// values (an llm.c file, a HuggingFace file, a checkpoint, the initializer) is read in
// llm.c's order, so a seed draws the same weights whatever order the block keeps them in,
// and a shard takes the values the whole model would hold there.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "nn/transformer.h"

namespace tally::nn {

// One tensor of an llm.c model file and the parameters it is made of: one, or one per
// layer for the kinds llm.c stacks over layers.
struct LlmcTensor {
  std::string name;
  Shape shape;
  std::vector<size_t> params;  // parameter indices of the whole model, in file order
  // The file holds only the first vocab_size rows of each parameter (LLaMA's files are
  // not padded); the rest are zero in the model.
  bool vocab_rows = false;
};

// The llm.c tensor names in file order (wte ... lnfb) and their shapes for a config.
std::vector<std::pair<std::string, Shape>> llmc_tensor_layout(const TransformerConfig& c);
// The llm.c file layout of a whole model's parameters (file order).
std::vector<LlmcTensor> llmc_tensors(const Transformer& whole_model);

// Fills `model`, whole or a shard, from a source of the whole model's parameters. The
// source is visited in llm.c file order (each kind over the layers, parameter by
// parameter; a tied head's wte twice) with `fill(file_tensor, index, spec, target)`:
// parameter `index` of the whole model's layout (`spec` its name and whole shape) is to
// be written into `target`, a tensor of that whole shape, or, when `target` is undefined
// (no part of it is this shard's), only passed over (a file reads past it, an initializer
// draws and drops its numbers; so is a tied head's wte the second time the file lists it).
// A whole model's targets are its own parameters, as are a shard's parameters that it
// holds whole (replicated, or not split); a split one is filled through a scratch tensor
// of its whole shape, then cut: set-up holds one whole parameter beside the shard, never
// the whole model. So is every parameter of a model whose residency holds the values
// (ZeRO-3), then handed to ParameterResidency::store.
using WholeParameterFill =
    std::function<void(const LlmcTensor& file_tensor, size_t index, const ParameterSpec& spec, const Tensor& target)>;
void fill_whole_parameters(Transformer& model, const WholeParameterFill& fill);
// The bytes fill_whole_parameters holds beside the model: the largest whole parameter the
// shard holds split (0 for a whole model, or a pipeline shard without --tp). (Under a
// residency that holds the values, ZeRO-3's, it is the largest parameter.)
int64_t whole_parameter_scratch_bytes(const Transformer& model);
// Copies `model`'s parameters (a shard) out of the whole model `full` (same config).
void load_shard_from(Transformer& model, const Transformer& full);

}  // namespace tally::nn
