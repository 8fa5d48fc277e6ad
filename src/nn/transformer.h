// One decoder-only transformer definition for GPT-2 and LLaMA-3. Both are pre-norm
// residual stacks with a fused qkv projection and causal attention; the family picks
//                 GPT-2                          LLaMA-3
//   positions     learned table (wpe)            rotary (rope_theta, 3.1 scaling)
//   norms         LayerNorm with bias            RMSNorm, no bias
//   attention     n_head heads                   grouped-query: n_kv_head kv heads
//   MLP           GELU(tanh), width 4C, biases   SwiGLU, Meta's width, no biases
//   LM head       tied to wte                    lm_head, or tied (3.2 1B/3B)
// Parameters carry llm.c's names for both (h.L.attn.c_attn.weight ...; LLaMA adds
// h.L.mlp.c_fc2.weight, the gate, and lm_head) and are kept layer by layer
// (parameters.h); llmc_tensors() maps them to llm.c's file layout, which stacks each
// kind of weight over the layers.
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
  // ---- LLaMA-3 only
  int64_t ffn_hidden = 0;          // the SwiGLU width (Meta: llama_ffn_hidden below)
  int64_t multiple_of = 256;       // kept for llm.c's header: how ffn_hidden was rounded
  double ffn_dim_multiplier = 0;   // ditto (0: none)
  double rope_theta = 500000.0;
  // LLaMA-3.1's frequency scaling (factor 0: none): wavelengths above
  // original_max_position / low_freq_factor are divided by `factor`, those below
  // original_max_position / high_freq_factor kept, and the band between interpolated.
  double rope_factor = 0, rope_low_freq_factor = 1, rope_high_freq_factor = 4;
  int64_t rope_original_max_position = 8192;
  bool tie_embeddings = true;      // GPT-2 always; LLaMA-3.2 1B/3B tie, 3.1 8B does not

  bool is_llama() const { return family == Family::Llama3; }
  int64_t head_dim() const { return n_embd / n_head; }
  int64_t kv_dim() const { return n_kv_head * head_dim(); }
  int64_t qkv_dim() const { return n_embd + 2 * kv_dim(); }
  int64_t ffn_dim() const { return is_llama() ? ffn_hidden : 4 * n_embd; }
  std::string describe() const;
  // Checks the shape is buildable; names the field that is not.
  void validate() const;

  // GPT-2: gpt2 (124M), gpt2-medium, gpt2-large, gpt2-xl, and dN depth presets (llm.c's
  // d12 = gpt2): width 64*N, N heads, N layers.
  // LLaMA-3: llama3.2-1b, llama3.2-3b, llama3.1-8b (Meta's shapes), and llama3-dN: N
  // layers of width 64*N, N heads, N/2 kv heads (at least 1), the 128,256-token
  // vocabulary, tied embeddings.
  static TransformerConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
};

// Meta's SwiGLU width: 2/3 of 4C, times ffn_dim_multiplier (when not 0), rounded up to
// multiple_of (int() truncations as in Meta's model.py).
int64_t llama_ffn_hidden(int64_t n_embd, int64_t multiple_of, double ffn_dim_multiplier);
// The rotary inverse frequencies of one head, D/2 of them: theta^(-2i/D), then LLaMA-3.1's
// scaling when rope_factor > 0 (computed in double, as Meta's apply_scaling does in Python).
std::vector<double> rope_inv_freq(const TransformerConfig& c);

// Keys and values of every layer for incremental decoding: (B, capacity, n_kv_head, D)
// per layer, the first `length` positions filled. Owned by the caller; the forward
// appends the new tokens' keys and values and advances `length`.
struct KvCache {
  std::vector<Tensor> k, v;
  int64_t length = 0;
  int64_t capacity() const { return k.empty() ? 0 : k[0].shape()[1]; }
};

// One tensor of an llm.c model file and the parameters it is made of: one, or one per
// layer for the kinds llm.c stacks over layers ("qkvw" is (L, 3C, C)).
struct LlmcTensor {
  std::string name;
  Shape shape;
  std::vector<size_t> params;  // parameter indices, in file order
  // The file holds only the first vocab_size rows of each parameter (LLaMA's files are
  // not padded); the rest are zero in the model.
  bool vocab_rows = false;
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

  // GPT-2's (and llm.c's LLaMA) initialization: N(0, 0.02), residual projections
  // N(0, 0.02/sqrt(2L)), biases 0, norm weights 1; padded embedding rows 0.
  void init_weights(uint64_t seed);

  // tokens (B, T) int32; targets (B, T) int32 or undefined. Records the graph when
  // grad mode is on. With a cache (inference only), the tokens continue the cached
  // sequence: they sit at positions cache->length.. and attend to everything cached.
  ForwardResult forward(const Tensor& tokens, const Tensor& targets, bool return_logits = false,
                        KvCache* cache = nullptr) const;
  // An empty cache for `batch` sequences of up to `capacity` tokens (<= max_seq_len).
  KvCache make_kv_cache(int64_t batch, int64_t capacity) const;
  // The rotary inverse frequencies (D/2), a model constant (LLaMA; undefined for GPT-2).
  const Tensor& inv_freq() const { return inv_freq_; }

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
  // The parameter, or an undefined tensor for a slot this family does not have.
  Tensor param(size_t index) const { return index == kAbsent ? Tensor() : params_[index]; }
  Tensor norm(const Tensor& x, size_t weight, size_t bias) const;

  TransformerConfig config_;
  ParameterStore params_;
  ParameterResidency* residency_ = nullptr;  // non-owning
  Tensor inv_freq_;  // rotary frequencies (LLaMA), in the parameters' dtype
  // Parameter indices (kAbsent where the family has none). Each layer's parameters are
  // one unit of the block (parameters.h); every weight is its own leaf.
  static constexpr size_t kAbsent = static_cast<size_t>(-1);
  size_t wte_ = 0, wpe_ = kAbsent, lnfw_ = 0, lnfb_ = kAbsent, lm_head_ = kAbsent;
  struct Layer {
    size_t ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fc2w, fcprojw, fcprojb;
  };
  std::vector<Layer> layers_;
};

// The llm.c tensor names in file order (wte ... lnfb) and their shapes for a config.
std::vector<std::pair<std::string, Shape>> llmc_tensor_layout(const TransformerConfig& c);

}  // namespace tally::nn
