#include "nn/init.h"

#include <cmath>
#include <unordered_set>

#include "core/random.h"
#include "nn/llmc_layout.h"

namespace tally::nn {

void init_weights(Transformer& model, uint64_t seed) {
  const TransformerConfig& c = model.config();
  Rng rng(seed);
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.n_layer));
  std::unordered_set<size_t> drawn;  // a tied head lists wte twice: its numbers are drawn once
  fill_whole_parameters(model, [&](const LlmcTensor&, size_t index, const ParameterSpec& spec, const Tensor& target) {
    if (!drawn.insert(index).second) return;
    const std::string& name = spec.name;
    const int64_t n = shape_numel(spec.shape);
    // The norms' weights (ln_1, ln_2, ln_f; Qwen3's attn.q_norm, attn.k_norm) start at 1.
    const bool is_norm_weight = (name.find("ln_") != std::string::npos || name.find("_norm.") != std::string::npos) &&
                                name.find(".weight") != std::string::npos;
    const bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    if (is_norm_weight || is_bias) {
      if (target.defined()) target.fill_(is_norm_weight ? 1.f : 0.f);
      return;
    }
    if (!target.defined()) {
      rng.discard_normals(n);
      return;
    }
    const bool residual = name.find("c_proj.weight") != std::string::npos;
    const double std = residual ? residual_std : 0.02;
    float* d = target.data<float>();
    for (int64_t j = 0; j < n; ++j) d[j] = static_cast<float>(rng.normal() * std);
    // Padding rows of the embedding (and head) are never looked up or predicted: zero.
    if (name == "wte" || name == "lm_head") target.slice(0, c.vocab_size, c.padded_vocab_size).zero_();
  });
}

}  // namespace tally::nn
