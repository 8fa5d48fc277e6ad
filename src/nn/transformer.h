// One decoder-only transformer definition for GPT-2, LLaMA-3, Qwen2 (Qwen2.5) and Qwen3.
// All are pre-norm residual stacks with a fused qkv projection and causal attention; the
// family picks
//                 GPT-2                          LLaMA's architecture (LLaMA-3, Qwen2, Qwen3)
//   positions     learned table (wpe)            rotary (rope_theta; LLaMA-3.1's scaling)
//   norms         LayerNorm with bias            RMSNorm, no bias
//   attention     n_head heads                   grouped-query: n_kv_head kv heads
//   MLP           GELU(tanh), width 4C, biases   SwiGLU of ffn_hidden, no biases
//   LM head       tied to wte                    lm_head, or tied
// and the Qwen families add to LLaMA's:
//   Qwen2         biases on the q, k and v projections (c_attn.bias)
//   Qwen3         RMSNorm over each head's D channels of q and of k (attn.q_norm.weight,
//                 attn.k_norm.weight, D each, shared by the heads) before rotary; a head
//                 width of its own (head_width), so that H*D may differ from C
// Parameters carry llm.c's names for all (h.L.attn.c_attn.weight ...; LLaMA adds
// h.L.mlp.c_fc2.weight, the gate, and lm_head) and are kept layer by layer
// (parameters.h). The model is its parameters and its forward: the llm.c file layout
// (and filling a shard in its order) is nn/llmc_layout.h's, the initialization
// nn/init.h's.
#pragma once
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/context_parallel.h"
#include "nn/expert_parallel.h"
#include "nn/parameters.h"
#include "nn/residency.h"
#include "nn/tensor_parallel.h"

namespace tally::nn {

struct TransformerConfig {
  enum class Family { Gpt2 = 0, Llama3 = 1, Qwen2 = 2, Qwen3 = 3, Qwen3Moe = 4 };  // the values are stored in model files
  Family family = Family::Gpt2;
  int64_t max_seq_len = 1024;
  int64_t vocab_size = 50257;
  int64_t padded_vocab_size = 50304;  // multiple of 128: rows past vocab_size are zero
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_kv_head = 12;
  int64_t n_embd = 768;
  double norm_eps = 1e-5;
  // A head's width D; 0: n_embd / n_head. Only Qwen3 sets its own (Qwen3-0.6B: 16 heads of
  // 128 over a width of 1024).
  int64_t head_width = 0;
  // ---- LLaMA's architecture only
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
  // ---- Qwen3-MoE's sparse MLP (n_experts 0: every layer's MLP is dense)
  int64_t n_experts = 0;            // num_experts
  int64_t experts_per_token = 0;    // num_experts_per_tok (top-k)
  int64_t moe_ffn_hidden = 0;       // moe_intermediate_size: each expert's SwiGLU width
  bool norm_topk_prob = true;       // the k routing weights renormalized to sum to 1
  int64_t decoder_sparse_step = 1;  // layer l is sparse when (l + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... and it is not listed here
  // HuggingFace's load-balancing loss (output_router_logits), times this, added to the
  // objective; 0: none. Over all sparse layers' tokens together:
  //   aux = E * sum_e f_e P_e, f_e = the share of the R*k choices that picked e,
  //   P_e = the mean over the R rows of e's probability (R = sparse layers x tokens).
  double router_aux_loss_coef = 0;

  // LLaMA's architecture (rotary, RMSNorm, SwiGLU), which the Qwen families build on.
  bool llama_architecture() const { return family != Family::Gpt2; }
  bool has_qkv_bias() const { return family == Family::Gpt2 || family == Family::Qwen2; }
  bool has_qk_norm() const { return family == Family::Qwen3 || family == Family::Qwen3Moe; }
  // Whether layer l's MLP is the experts' (HuggingFace's Qwen3-MoE rule).
  bool sparse_layer(int64_t l) const;
  // The sparse layers among layers 0 .. l-1 (a sparse layer's index among them), and all
  // of them.
  int64_t sparse_layers_before(int64_t l) const;
  int64_t sparse_layer_count() const { return sparse_layers_before(n_layer); }
  const char* family_name() const;  // "gpt2", "llama3", "qwen2", "qwen3", "qwen3_moe"
  int64_t head_dim() const { return head_width > 0 ? head_width : n_embd / n_head; }
  int64_t q_dim() const { return n_head * head_dim(); }
  int64_t kv_dim() const { return n_kv_head * head_dim(); }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
  int64_t ffn_dim() const { return llama_architecture() ? ffn_hidden : 4 * n_embd; }
  std::string describe() const;
  // Checks the shape is buildable; names the field that is not.
  void validate() const;

  // GPT-2: gpt2 (124M), gpt2-medium, gpt2-large, gpt2-xl, and dN depth presets (llm.c's
  // d12 = gpt2): width 64*N, N heads, N layers.
  // LLaMA-3: llama3.2-1b, llama3.2-3b, llama3.1-8b (Meta's shapes), and llama3-dN: N
  // layers of width 64*N, N heads, N/2 kv heads (at least 1), the 128,256-token
  // vocabulary, tied embeddings.
  // Qwen: qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, qwen3-0.6b, qwen3-8b (the hub's
  // config.json shapes), and qwen2.5-dN / qwen3-dN: llama3-dN's layers, heads, kv heads
  // and width 64*N with Qwen's 151,936-token vocabulary, an MLP 3x the width (Qwen3's
  // ratio), theta 1e6, eps 1e-6, tied embeddings; qwen3-dN's heads are 128 wide, twice
  // 64*N / N, as Qwen3-0.6B's are twice its hidden_size / num_attention_heads.
  static TransformerConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
};

// Meta's SwiGLU width: 2/3 of 4C, times ffn_dim_multiplier (when not 0), rounded up to
// multiple_of (int() truncations as in Meta's model.py).
int64_t llama_ffn_hidden(int64_t n_embd, int64_t multiple_of, double ffn_dim_multiplier);
// Keeps c's (multiple_of, ffn_dim_multiplier) when they give c.ffn_hidden, else sets the
// first usual pair that does (the width itself as multiple_of if none): what llm.c's header
// and tally's config.json carry, so that a file read back gives the same pair.
void settle_llama_ffn_rounding(TransformerConfig& c);
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

struct ForwardResult {
  Tensor loss;    // scalar mean cross-entropy (defined when targets were given), plus the router's loss
  Tensor aux_loss;  // the load-balancing loss (before its coefficient), when the model adds one
  Tensor logits;  // (B, T, Vp) when asked for (sampling, parity tests)
  Tensor hidden;  // a pipeline chunk that is not the model's last: its output (B, T', C)
};

// The part of the model one rank holds and runs (dist/ derives it from the layout).
//
// Pipeline: the rank runs one or more chunks (interleaved 1F1B gives it V), each a range
// of consecutive layers; the model's first chunk adds the embeddings, its last the final
// norm, the head and the loss. With a tied head, the last chunk holds its own copy of wte
// (named wte, like the first's), whose gradient the trainer sums with the first's.
// Tensor parallel: the heads (q and kv), the MLP width and the padded vocabulary are
// split `tp` ways (each must divide); norms, biases of row-parallel projections and the
// position table are replicated.
// Expert parallel: each sparse layer's experts are split `ep` ways (n_experts must
// divide); rank ep_rank holds experts ep_rank * El .. ep_rank * El + El - 1 under their
// global names, and everything else whole.
struct ModelShard {
  struct Chunk {
    int64_t first_layer = 0, end_layer = 0;  // layers [first_layer, end_layer)
    bool embed = false, head = false;
  };
  std::vector<Chunk> chunks;  // empty: the whole model as one chunk
  int tp = 1, tp_rank = 0;
  int ep = 1, ep_rank = 0;
  bool whole() const { return chunks.size() == 1 && chunks[0].embed && chunks[0].head && tp == 1 && ep == 1; }
};

// Activation recomputation (Megatron's): none; selective, the attention core of each
// layer (its output and log-sum-exp are not kept but recomputed from q, k, v in
// backward); full, each layer keeps only its input and is recomputed in backward.
enum class Recompute { None, Selective, Full };
Recompute parse_recompute(const std::string& text);  // "none" | "selective" | "full"
const char* recompute_name(Recompute r);

// How a parameter of a tensor-parallel shard is cut from the whole model's.
enum class TpSplit {
  Replicated,  // every rank holds all of it (norms, row-parallel biases, wpe)
  Rows,        // rows tp_rank*n/tp .. : column-parallel weights and biases, vocabulary
  Columns,     // columns likewise: row-parallel weights
  QkvRows,     // the fused qkv: this rank's block of q rows, of k rows and of v rows
  // Every rank holds all of it, but its gradient is a sum over work the ranks split:
  // summed over the tensor-parallel group (Qwen3's q_norm and k_norm, shared by the heads;
  // a sparse layer's router, whose weights meet every expert's slices).
  SharedBySlices,
};

class Transformer {
 public:
  // The whole model, or a shard of it (pipeline chunks, tensor-parallel slices), with the
  // blocks `blocks` names (nn/parameters.h): both for training with the model's own
  // gradients; the parameters only for sampling, export, a source to cut a shard from and
  // ZeRO-2; none for ZeRO-3, whose optimizer binds the parameters and is the model's
  // residency before its values are filled (nn::fill_whole_parameters). Built on the host,
  // where a file or an initializer fills it (move_to takes it to its device), or on the
  // meta device for a dry run, which fills nothing.
  explicit Transformer(const TransformerConfig& config, ModelShard shard = {},
                       Blocks blocks = Blocks::ParametersAndGradients, Device device = Device::cpu());
  // The parameters' names, shapes, units and splits only, nothing allocated: what another
  // rank's shard holds (checkpoints gather and scatter by it).
  static Transformer layout_only(const TransformerConfig& config, ModelShard shard = {});

  const TransformerConfig& config() const { return config_; }
  ParameterStore& params() { return params_; }
  const ParameterStore& params() const { return params_; }
  int64_t num_parameters() const { return params_.numel(); }

  const ModelShard& shard() const { return shard_; }
  size_t num_chunks() const { return shard_.chunks.size(); }
  // The pairs (region of the whole parameter, region of this shard's parameter) that
  // correspond for parameter `param` (by its index in this shard): copying each pair
  // one way cuts the shard from the whole, the other way puts it back. `whole` has the
  // whole model's shape of that parameter, `local` this shard's.
  std::vector<std::pair<Tensor, Tensor>> shard_regions(size_t param, const Tensor& whole, const Tensor& local) const;
  TpSplit tp_split(size_t param) const { return splits_[param]; }
  // Whether parameter `param` is an expert's (split over the expert-parallel group; the
  // router is not).
  bool is_expert(size_t param) const { return param < expert_.size() && expert_[param]; }
  // The experts of a sparse layer this shard holds: [first_expert, first_expert + count).
  int64_t first_expert() const;
  int64_t local_experts() const;
  // The last pipeline chunk's copy of a tied wte (its gradient is summed with the first's).
  bool is_tied_head_copy(size_t param) const { return param == wte_ && tied_head_copy_; }
  int64_t vocab_start() const { return shard_.tp_rank * (config_.padded_vocab_size / shard_.tp); }

  // Tensor parallel collectives (null without tensor parallelism). Not owned.
  void set_tensor_parallel(TensorParallelOps* ops) { tp_ops_ = ops; }
  TensorParallelOps* tensor_parallel() const { return tp_ops_; }
  // Context parallel collectives (null without context parallelism). Not owned. With
  // them, forward takes this rank's local sequences (nn/context_parallel.h) and attends
  // over the whole ones; KV-cache decoding runs on whole sequences and leaves them out.
  void set_context_parallel(ContextParallelOps* ops) { cp_ops_ = ops; }
  ContextParallelOps* context_parallel() const { return cp_ops_; }
  // Expert parallel exchanges (null without expert parallelism). Not owned. The shard
  // must have been built for the group's size and rank.
  void set_expert_parallel(ExpertParallelOps* ops);
  ExpertParallelOps* expert_parallel() const { return ep_ops_; }
  // Mixed precision: with BF16 every projection (qkv, attention output, MLP, head) runs
  // its GEMMs in bf16 over a bf16 copy of the parameters that the store keeps current
  // (ParameterStore::enable_compute_copy, 2 bytes per parameter), and attention's tile
  // products take bf16 q, k, v (ops::causal_attention_bf16); the head's logits, the
  // attention output and the MLP's hidden layer (and their gradients) are bf16; norms,
  // attention's softmax, the loss, the residual stream, the parameters' gradients and the
  // optimizer stay fp32. F32 (the default): off. Needs the parameter block resident (not
  // with ZeRO-3).
  void set_matmul_dtype(DType dtype);
  DType matmul_dtype() const { return matmul_dtype_; }
  // The head and the loss fused in chunks of `rows` rows (ops::linear_cross_entropy): the
  // (B*T, Vp) logits are never all live. 0 (the default): the head's logits, then the loss.
  // Not with tensor parallelism (its loss is vocabulary-parallel already).
  void set_loss_chunk_rows(int64_t rows);
  int64_t loss_chunk_rows() const { return loss_chunk_rows_; }
  // The chunk `--chunked-loss` uses: 32 MiB of fp32 logits, 16 MiB under bf16 (166 rows of
  // GPT-2's 50,304 columns), and never fewer than 128 rows, below which the head's GEMMs
  // slow down (oneDNN at C = 256, 2 threads: 65 rows 156-187 GFLOP/s, 130 rows 181-203; at
  // C = 768 the weight gradient 140 against 195). LLaMA-3's 128,256 columns take 128 rows,
  // 64 MiB: llama3-d4 at T = 8192 steps in 15.0-15.7 s against 17.1-17.2 with 65 rows.
  static int64_t default_loss_chunk_rows(int64_t padded_vocab);
  void set_recompute(Recompute r) { recompute_ = r; }
  Recompute recompute() const { return recompute_; }

  // Runs chunk `chunk` of this rank's shard on one microbatch. The model's first chunk
  // takes the tokens (B, T); any other chunk the previous chunk's output (B, T', C) (T'
  // is T / tp under sequence parallelism). The model's last chunk returns the loss of
  // `targets` (B, T); any other returns its output in `hidden`.
  ForwardResult forward_chunk(size_t chunk, const Tensor& input, const Tensor& targets) const;

  // tokens (B, T) int32; targets (B, T) int32 or undefined. Records the graph when
  // grad mode is on. With a cache (inference only), the tokens continue the cached
  // sequence: they sit at positions cache->length.. and attend to everything cached.
  ForwardResult forward(const Tensor& tokens, const Tensor& targets, bool return_logits = false,
                        KvCache* cache = nullptr) const;
  // An empty cache for `batch` sequences of up to `capacity` tokens (<= max_seq_len).
  KvCache make_kv_cache(int64_t batch, int64_t capacity) const;
  // The rotary inverse frequencies (D/2), a model constant (LLaMA; undefined for GPT-2).
  const Tensor& inv_freq() const { return inv_freq_; }
  // Moves the parameters (and the model's constants) to `device`: the model is built and
  // loaded on the host, then moved, before the optimizer is made.
  void move_to(Device device);
  Device device() const { return params_.device(); }

  // Where the parameters live while the model runs (ZeRO-3 sets one; null: always
  // resident). Not owned.
  void set_residency(ParameterResidency* residency) { residency_ = residency; }
  ParameterResidency* residency() const { return residency_; }
  // Units (parameters.h) of the parts this shard holds; layer takes the global index.
  size_t embed_unit() const { return embed_unit_; }
  // A layer's units: its own, and a sparse layer's experts after it (the experts differ
  // between expert-parallel ranks, so ZeRO shards them over other ranks than the rest).
  std::vector<size_t> layer_units(int64_t layer) const { return layers_[static_cast<size_t>(layer)].units(); }
  size_t final_unit() const { return final_unit_; }

  // FLOPs of one training token (forward + backward) of the whole model, whatever shard
  // this is: 6N + 6*L*C*T (attention), the formula llm.c and the PaLM paper use for MFU.
  double flops_per_token(int64_t seq_len) const;

 private:
  // Unit bookkeeping around a region of the forward (no-ops without a residency).
  void enter(const std::vector<size_t>& units) const;
  void leave(const std::vector<size_t>& units) const;
  void prefetch(const std::vector<size_t>& units) const;
  Tensor released_in_backward(const Tensor& x, const std::vector<size_t>& units) const;
  Tensor acquired_in_backward(const Tensor& x, const std::vector<size_t>& units) const;
  Tensor border(const Tensor& x, const std::vector<size_t>& units, bool acquire) const;
  // The parameter, or an undefined tensor for a slot this family does not have.
  Tensor param(size_t index) const { return index == kAbsent ? Tensor() : params_[index]; }
  Tensor norm(const Tensor& x, size_t weight, size_t bias) const;
  size_t declare(const std::string& name, Shape shape, bool decay, TpSplit split);
  size_t declare_expert(const std::string& name, Shape shape, TpSplit split);
  // `split`: the tokens are this rank's context-parallel local sequences.
  Tensor embed(const Tensor& tokens, int64_t start, bool split) const;
  Tensor layer(int64_t l, const Tensor& x, int64_t start, KvCache* cache) const;
  Tensor layer_body(int64_t l, const Tensor& x, int64_t start, KvCache* cache) const;
  void head(const Tensor& x, const Tensor& targets, bool return_logits, ForwardResult& result) const;
  // A row-parallel projection: the partial products summed over the tensor-parallel
  // group, then the (replicated) bias.
  Tensor row_linear(const Tensor& x, size_t weight, size_t bias) const;
  // x W^T + b for parameters `weight` and `bias` (kAbsent: none), in the matmul dtype;
  // under bf16 the output is `out` (fp32, or bf16 rounded once).
  Tensor linear(const Tensor& x, size_t weight, size_t bias, DType out = DType::F32) const;
  // The head's logits x W^T: fp32, or under bf16 bf16 (see transformer.cc).
  Tensor head_logits(const Tensor& x, size_t weight) const;
  // Causal attention over q, k, v, its tile products in the matmul dtype; `recompute`:
  // its output is made again in backward (selective recomputation).
  Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool recompute) const;
  // Context parallel: rotary over the local sequence's runs of positions, and attention of
  // the local queries over the gathered whole-sequence keys and values.
  Tensor split_rotary(const Tensor& x) const;
  Tensor split_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool recompute) const;

  struct LayoutOnly {};
  Transformer(const TransformerConfig& config, ModelShard shard, LayoutOnly);
  void declare_parameters();

  TransformerConfig config_;
  ModelShard shard_;
  ParameterStore params_;
  std::vector<TpSplit> splits_;  // per parameter
  std::vector<bool> expert_;     // per parameter: an expert's
  TensorParallelOps* tp_ops_ = nullptr;  // non-owning
  ContextParallelOps* cp_ops_ = nullptr;  // non-owning
  ExpertParallelOps* ep_ops_ = nullptr;   // non-owning
  Recompute recompute_ = Recompute::None;
  DType matmul_dtype_ = DType::F32;
  int64_t loss_chunk_rows_ = 0;
  bool tied_head_copy_ = false;
  size_t embed_unit_ = 0, final_unit_ = 0;
  ParameterResidency* residency_ = nullptr;  // non-owning
  Tensor inv_freq_;  // rotary frequencies (LLaMA's architecture), in the parameters' dtype
  // Parameter indices (kAbsent where the family has none). Each layer's parameters are
  // one unit of the block (parameters.h); every weight is its own leaf.
  static constexpr size_t kAbsent = static_cast<size_t>(-1);
  size_t wte_ = 0, wpe_ = kAbsent, lnfw_ = 0, lnfb_ = kAbsent, lm_head_ = kAbsent;
  struct Layer {
    size_t ln1w = kAbsent, ln1b = kAbsent, qkvw = kAbsent, qkvb = kAbsent, qnormw = kAbsent, knormw = kAbsent,
           attprojw = kAbsent, attprojb = kAbsent, ln2w = kAbsent, ln2b = kAbsent, fcw = kAbsent, fcb = kAbsent, fc2w = kAbsent, fcprojw = kAbsent,
           fcprojb = kAbsent;
    // A sparse layer's MLP: the router (E, C) and each expert's up, gate and down (this
    // shard's experts, first_expert() on).
    size_t routerw = kAbsent;
    std::vector<size_t> expert_up, expert_gate, expert_down;
    size_t unit = kAbsent;         // kAbsent: a layer of another rank's chunk
    size_t expert_unit = kAbsent;  // a sparse layer's experts: a unit of their own
    std::vector<size_t> units() const {
      return expert_unit == kAbsent ? std::vector<size_t>{unit} : std::vector<size_t>{unit, expert_unit};
    }
  };
  std::vector<Layer> layers_;  // indexed by the global layer
  // Sparse layer l's MLP on h (B, T, C): routed to its top-k experts, their outputs summed
  // with the routing weights (nn/experts.cc).
  Tensor experts(const Tensor& h, int64_t l) const;
  // The shard's experts over rows grouped by local expert (count[j] rows for expert j).
  Tensor local_mlps(const Tensor& rows, const std::vector<int64_t>& count, int64_t l) const;
  // The experts of every rank of the expert-parallel group over rows grouped by global
  // expert (count[e] rows for expert e): dispatched, run and combined.
  Tensor expert_parallel_mlps(const Tensor& rows, const std::vector<int64_t>& count, int64_t l) const;
  // What the load-balancing loss needs of each sparse layer the forward ran: the sum of its
  // probabilities over the tokens (E, with their graph), its choices per expert and its
  // token count. Taken (and cleared) by the head.
  struct RouterRecord {
    Tensor probability_sum;
    std::vector<int64_t> count;
    int64_t tokens = 0;
  };
  mutable std::vector<RouterRecord> router_records_;
  // The load-balancing loss of the records (undefined when there are none); clears them.
  Tensor take_router_loss() const;
  // The choices each expert took since the last take_expert_load(), in forwards that
  // train (with gradients; a recomputed layer counts once, in its recomputation).
  mutable std::vector<int64_t> expert_load_;
  mutable int64_t dropped_pairs_ = 0;
  void count_expert_load(const std::vector<int64_t>& count, int64_t dropped, int64_t l) const;
  double capacity_factor_ = 0;

 public:
  // (sparse layers x E) counts, layer-major over all of the model's sparse layers (zero
  // for those of other ranks' chunks); clears them.
  std::vector<int64_t> take_expert_load() const;
  // The (token, expert) pairs dropped past their expert's capacity since the last call.
  int64_t take_dropped_pairs() const;
  // Expert capacity (Switch Transformer's, GShard's): each expert of a sparse layer takes at
  // most ceil(factor x tokens x k / E) of a microbatch's pairs on each rank, in token order;
  // the rest are dropped (their slot adds nothing; the residual carries the token), and
  // every expert's rows are padded to that capacity, so every shape, and so the memory of
  // every step, is the same whatever the routing. 0 (the default): dropless, as
  // HuggingFace's Qwen3-MoE. A factor of E / k never drops.
  void set_expert_capacity_factor(double factor);
  // Rows each expert takes of a microbatch of `tokens` tokens (0: dropless).
  int64_t expert_capacity(int64_t tokens) const;
  // Sparse layer l's MLP alone on h (B, T, C), as its layer runs it after the norm:
  // routing, the experts and the weighted combine (bench/experts.cc times it).
  Tensor sparse_mlp(const Tensor& h, int64_t l) const { return experts(h, l); }

  // Router losses each sparse layer adds to the objective on the tokens it routes, times
  // their coefficients (0: off), training options beside the model's own (HuggingFace's)
  // load-balancing loss. Each joins the objective where its layer runs (its gradient is
  // seeded in the layer's backward), so they work in pipeline stages and recomputed
  // layers too. Per layer of N tokens, probabilities p (N, E) and router logits z:
  //   balance = E / (N^2 k) * sum_e C_e S_e   (Switch's, Megatron-Core's aux_loss: C_e the
  //             choices of e, S_e the sum of its probabilities; 1 when perfectly even)
  //   z       = 1/N * sum_n (log sum_e exp z_ne)^2   (ST-MoE's router z-loss)
  struct RouterLosses {
    double balance = 0, z = 0;
  };
  void set_router_losses(RouterLosses coefficients) { router_losses_ = coefficients; }
  // The sums over the sparse layers of each loss's value (before its coefficient) in the
  // forwards that trained since the last call (a recomputed layer counts once); clears them.
  RouterLosses take_router_loss_values() const;

 private:
  RouterLosses router_losses_;
  mutable RouterLosses router_loss_values_;
  // The layer's output `out`, with balance and z-loss (N routed tokens of logits and
  // probabilities, `load` choices per expert) seeded in its backward.
  Tensor with_router_losses(const Tensor& out, const Tensor& logits, const Tensor& probs,
                            const std::vector<int64_t>& load) const;
};

}  // namespace tally::nn
