// One decoder-only transformer definition for GPT-2 and (its slots ready) LLaMA-3.
//
// GPT-2 (the family implemented): learned position embeddings, pre-LayerNorm blocks,
// fused qkv projection with bias, causal attention, GELU(tanh) MLP of width 4C, final
// LayerNorm, LM head tied to the token embedding. Parameters are kept layer by layer
// (parameters.h); llmc_tensors() maps them to llm.c's file layout, which stacks each
// kind of weight over the layers.
//
// LLaMA-3 slots: Norm::RMS, Position::Rope, Mlp::SwiGlu and n_kv_head < n_head (GQA)
// are config fields; the attention op already takes grouped kv heads. The forward
// refuses them until their kernels land, rather than computing something else.
#pragma once
#include <string>
#include <vector>

#include "core/random.h"
#include "core/tensor.h"
#include "nn/parameters.h"
#include "nn/residency.h"

namespace tally::nn {

struct TransformerConfig {
  enum class Family { Gpt2, Llama3 };
  Family family = Family::Gpt2;
  int64_t max_seq_len = 1024;
  int64_t vocab_size = 50257;
  int64_t padded_vocab_size = 50304;  // multiple of 128: rows past vocab_size are zero
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_kv_head = 12;
  int64_t n_embd = 768;
  double norm_eps = 1e-5;

  int64_t head_dim() const { return n_embd / n_head; }
  int64_t ffn_dim() const { return 4 * n_embd; }
  std::string describe() const;

  // gpt2 (124M), gpt2-medium, gpt2-large, gpt2-xl, and dN depth presets (llm.c's d12 =
  // gpt2): width 64*N, N heads, N layers.
  static TransformerConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
};

// One tensor of an llm.c model file and the parameters it is made of: one, or one per
// layer for the kinds llm.c stacks over layers ("qkvw" is (L, 3C, C)).
struct LlmcTensor {
  std::string name;
  Shape shape;
  std::vector<size_t> params;  // parameter indices, in file order
};

struct ForwardResult {
  Tensor loss;    // scalar mean cross-entropy (defined when targets were given)
  Tensor logits;  // (B, T, Vp) when asked for (sampling, parity tests)
};

class Transformer {
 public:
  explicit Transformer(const TransformerConfig& config);

  const TransformerConfig& config() const { return config_; }
  ParameterStore& params() { return params_; }
  const ParameterStore& params() const { return params_; }
  int64_t num_parameters() const { return params_.numel(); }

  // GPT-2 initialization: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), biases 0,
  // norm weights 1; padded embedding rows 0.
  void init_weights(uint64_t seed);

  // tokens (B, T) int32; targets (B, T) int32 or undefined. Records the graph when
  // grad mode is on.
  ForwardResult forward(const Tensor& tokens, const Tensor& targets, bool return_logits = false) const;

  // Where the parameters live while the model runs (ZeRO-3 sets one; null: always
  // resident). Not owned.
  void set_residency(ParameterResidency* residency) { residency_ = residency; }
  ParameterResidency* residency() const { return residency_; }
  size_t embed_unit() const { return 0; }
  size_t layer_unit(int64_t layer) const { return static_cast<size_t>(layer) + 1; }
  size_t final_unit() const { return static_cast<size_t>(config_.n_layer) + 1; }

  // The llm.c file layout of this model's parameters (file order).
  std::vector<LlmcTensor> llmc_tensors() const;

  // FLOPs of one training token (forward + backward): 6N + 6*L*C*T (attention), the
  // formula llm.c and the PaLM paper use for MFU.
  double flops_per_token(int64_t seq_len) const;

 private:
  // Unit bookkeeping around a region of the forward (no-ops without a residency).
  void enter(const std::vector<size_t>& units) const;
  void leave(const std::vector<size_t>& units) const;
  Tensor released_in_backward(const Tensor& x, const std::vector<size_t>& units) const;
  Tensor acquired_in_backward(const Tensor& x, const std::vector<size_t>& units) const;
  Tensor border(const Tensor& x, const std::vector<size_t>& units, bool acquire) const;

  TransformerConfig config_;
  ParameterStore params_;
  ParameterResidency* residency_ = nullptr;  // non-owning
  // Parameter indices. Each layer's parameters are one unit of the block (parameters.h);
  // every layer's weight is its own leaf (its own gradient view).
  size_t wte_ = 0, wpe_ = 0, lnfw_ = 0, lnfb_ = 0;
  struct Layer {
    size_t ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb;
  };
  std::vector<Layer> layers_;
};

// The llm.c tensor names in file order (wte ... lnfb) and their shapes for a config.
std::vector<std::pair<std::string, Shape>> llmc_tensor_layout(const TransformerConfig& c);

}  // namespace tally::nn
