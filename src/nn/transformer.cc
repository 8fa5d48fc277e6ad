#include "nn/transformer.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "autograd/checkpoint.h"
#include "autograd/function.h"
#include "autograd/grad_mode.h"
#include "core/checked.h"
#include "core/owner.h"
#include "ops/ops.h"

namespace tally::nn {

const char* TransformerConfig::family_name() const {
  switch (family) {
    case Family::Gpt2: return "gpt2";
    case Family::Llama3: return "llama3";
    case Family::Qwen2: return "qwen2";
    case Family::Qwen3: return "qwen3";
    case Family::Qwen3Moe: return "qwen3_moe";
  }
  return "?";
}

bool TransformerConfig::sparse_layer(int64_t l) const {
  return n_experts > 0 && (l + 1) % decoder_sparse_step == 0 &&
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), l) == mlp_only_layers.end();
}

int64_t TransformerConfig::sparse_layers_before(int64_t l) const {
  int64_t sparse = 0;
  for (int64_t i = 0; i < l; ++i) sparse += sparse_layer(i);
  return sparse;
}

std::string TransformerConfig::describe() const {
  std::ostringstream os;
  os << family_name() << " L=" << n_layer << " H=" << n_head;
  if (n_kv_head != n_head) os << " KV=" << n_kv_head;
  if (head_width > 0) os << " D=" << head_width;
  os << " C=" << n_embd;
  if (llama_architecture()) os << " F=" << ffn_hidden;
  os << " V=" << vocab_size << " (padded " << padded_vocab_size << ") maxT=" << max_seq_len;
  if (llama_architecture() && !tie_embeddings) os << " untied";
  if (n_experts > 0) os << " experts=" << n_experts << " top" << experts_per_token << " Fe=" << moe_ffn_hidden;
  return os.str();
}

void TransformerConfig::validate() const {
  TALLY_CHECK(n_layer >= 1 && n_head >= 1 && n_embd >= 1 && vocab_size >= 1 && max_seq_len >= 1,
              "model: implausible shape ", describe());
  TALLY_CHECK(head_width >= 0 && (head_width == 0 || has_qk_norm()), "model: a head width of its own (", head_width,
              ") is Qwen3's; ", family_name(), "'s heads are n_embd / n_head wide");
  TALLY_CHECK(head_width > 0 || n_embd % n_head == 0, "model: n_embd ", n_embd, " is not divisible by n_head ", n_head);
  TALLY_CHECK(n_kv_head >= 1 && n_head % n_kv_head == 0, "model: n_head ", n_head, " is not a multiple of n_kv_head ",
              n_kv_head);
  TALLY_CHECK(padded_vocab_size >= vocab_size, "model: padded vocab ", padded_vocab_size, " < vocab ", vocab_size);
  TALLY_CHECK(std::isfinite(norm_eps) && norm_eps > 0, "model: the norm's epsilon must be positive, got ", norm_eps);
  if (llama_architecture()) {
    TALLY_CHECK(head_dim() % 2 == 0, "model: rotary embeddings need an even head dimension, got ", head_dim());
    TALLY_CHECK(ffn_hidden >= 1, "model: the SwiGLU width (ffn_hidden) must be set, got ", ffn_hidden);
    TALLY_CHECK(rope_theta > 0, "model: rope_theta must be positive, got ", rope_theta);
    TALLY_CHECK(rope_factor == 0 || (rope_factor > 0 && rope_high_freq_factor > rope_low_freq_factor &&
                                     rope_low_freq_factor > 0 && rope_original_max_position > 0),
                "model: rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and an original "
                "context length, got factor ",
                rope_factor, ", low ", rope_low_freq_factor, ", high ", rope_high_freq_factor, ", original ",
                rope_original_max_position);
  } else {
    TALLY_CHECK(n_kv_head == n_head, "model: GPT-2 has no grouped-query attention (n_kv_head ", n_kv_head,
                " != n_head ", n_head, ")");
    TALLY_CHECK(tie_embeddings, "model: GPT-2's LM head is always tied to the token embedding");
  }
  TALLY_CHECK((family == Family::Qwen3Moe) == (n_experts > 0), "model: ",
              n_experts > 0 ? "experts are Qwen3-MoE's; " : "Qwen3-MoE needs experts; ", family_name(), " with ", n_experts,
              " experts");
  if (n_experts > 0) {
    TALLY_CHECK(experts_per_token >= 1 && experts_per_token <= n_experts, "model: ", experts_per_token,
                " experts per token (num_experts_per_tok) out of ", n_experts, ", expected 1..", n_experts);
    TALLY_CHECK(moe_ffn_hidden >= 1, "model: the experts' width (moe_intermediate_size) must be set, got ", moe_ffn_hidden);
    TALLY_CHECK(decoder_sparse_step >= 1, "model: decoder_sparse_step must be >= 1, got ", decoder_sparse_step);
    TALLY_CHECK(std::isfinite(router_aux_loss_coef) && router_aux_loss_coef >= 0,
                "model: router_aux_loss_coef must be a finite number >= 0, got ", router_aux_loss_coef);
    for (int64_t l : mlp_only_layers)
      TALLY_CHECK(l >= 0 && l < n_layer, "model: mlp_only_layers names layer ", l, " of a ", n_layer, "-layer model");
  }
}

int64_t llama_ffn_hidden(int64_t n_embd, int64_t multiple_of, double ffn_dim_multiplier) {
  TALLY_CHECK(multiple_of >= 1, "model: multiple_of must be >= 1, got ", multiple_of);
  int64_t hidden = checked_mul(n_embd, 8, "model: 2 x (4 x n_embd)") / 3;  // int(2 * hidden_dim / 3)
  if (ffn_dim_multiplier > 0) {
    const double scaled = ffn_dim_multiplier * static_cast<double>(hidden);
    TALLY_CHECK(scaled < 0x1p62, "model: ffn_dim_multiplier ", ffn_dim_multiplier, " x ", hidden,
                " overflows a 64-bit size");
    hidden = static_cast<int64_t>(scaled);
  }
  const int64_t rounded_up = checked_add(hidden, multiple_of - 1, "model: the SwiGLU width rounded up to multiple_of");
  return checked_mul(multiple_of, rounded_up / multiple_of, "model: the SwiGLU width rounded up to multiple_of");
}

void settle_llama_ffn_rounding(TransformerConfig& c) {
  if (c.multiple_of >= 1 && llama_ffn_hidden(c.n_embd, c.multiple_of, c.ffn_dim_multiplier) == c.ffn_hidden) return;
  for (double multiplier : {0.0, 1.0, 1.3, 1.5, 2.0})
    for (int64_t multiple : {1024, 512, 256, 128, 64, 32, 16, 8})
      if (llama_ffn_hidden(c.n_embd, multiple, multiplier) == c.ffn_hidden) {
        c.multiple_of = multiple;
        c.ffn_dim_multiplier = multiplier;
        return;
      }
  c.multiple_of = c.ffn_hidden;
  c.ffn_dim_multiplier = 0;
}

std::vector<double> rope_inv_freq(const TransformerConfig& c) {
  const int64_t D = c.head_dim();
  std::vector<double> freqs;
  for (int64_t i = 0; i < D / 2; ++i) {
    double f = 1.0 / std::pow(c.rope_theta, static_cast<double>(2 * i) / static_cast<double>(D));
    if (c.rope_factor > 0) {
      const double original = static_cast<double>(c.rope_original_max_position);
      const double low_wavelen = original / c.rope_low_freq_factor, high_wavelen = original / c.rope_high_freq_factor;
      const double wavelen = 2 * M_PI / f;
      if (wavelen > low_wavelen) {
        f /= c.rope_factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth =
            (original / wavelen - c.rope_low_freq_factor) / (c.rope_high_freq_factor - c.rope_low_freq_factor);
        f = (1 - smooth) * f / c.rope_factor + smooth * f;
      }
    }
    freqs.push_back(f);
  }
  return freqs;
}

namespace {
// depth heads sharing half as many key/value heads (grouped-query attention, as LLaMA-3's
// and Qwen's own sizes do); for an odd depth the largest divisor up to half of it.
int64_t grouped_kv_heads(int64_t depth) {
  int64_t kv_heads = std::max<int64_t>(1, depth / 2);
  while (depth % kv_heads != 0) --kv_heads;
  return kv_heads;
}
}  // namespace

TransformerConfig TransformerConfig::preset(const std::string& name) {
  TransformerConfig c;
  auto set = [&](int64_t L, int64_t H, int64_t C) {
    c.n_layer = L;
    c.n_head = H;
    c.n_kv_head = H;
    c.n_embd = C;
  };
  // LLaMA-3's shared shape: the 128,256-token vocabulary (a multiple of 128 already),
  // theta 500,000, eps 1e-5, LLaMA-3.1's scaling with Meta's factors.
  auto llama = [&](int64_t L, int64_t H, int64_t KV, int64_t C, int64_t multiple_of, double multiplier,
                   double rope_factor, bool tied, int64_t max_seq_len) {
    c.family = Family::Llama3;
    set(L, H, C);
    c.n_kv_head = KV;
    c.vocab_size = c.padded_vocab_size = 128256;
    c.multiple_of = multiple_of;
    c.ffn_dim_multiplier = multiplier;
    c.ffn_hidden = llama_ffn_hidden(C, multiple_of, multiplier);
    c.rope_theta = 500000.0;
    c.rope_factor = rope_factor;
    c.rope_low_freq_factor = 1;
    c.rope_high_freq_factor = 4;
    c.rope_original_max_position = 8192;
    c.tie_embeddings = tied;
    c.max_seq_len = max_seq_len;
  };
  // Qwen's shared shape: the 151,936-token vocabulary (152,064 for Qwen2.5-7B), theta
  // 1e6, eps 1e-6, no rotary scaling, the MLP width as config.json gives it.
  auto qwen = [&](Family family, int64_t L, int64_t H, int64_t KV, int64_t C, int64_t F, int64_t head_width,
                  int64_t vocab, bool tied, int64_t max_seq_len) {
    c.family = family;
    set(L, H, C);
    c.n_kv_head = KV;
    c.head_width = head_width;
    c.vocab_size = c.padded_vocab_size = vocab;
    c.ffn_hidden = F;
    settle_llama_ffn_rounding(c);
    c.norm_eps = 1e-6;
    c.rope_theta = 1e6;
    c.rope_factor = 0;
    c.tie_embeddings = tied;
    c.max_seq_len = max_seq_len;
  };
  auto depth_of = [&](const std::string& digits) {
    // At most three digits: std::stoll would throw a bare "stoll" on a 20-digit depth.
    const int64_t depth = !digits.empty() && digits.size() <= 3 && digits.find_first_not_of("0123456789") == std::string::npos
                              ? std::stoll(digits)
                              : 0;
    TALLY_CHECK(depth >= 1 && depth <= 64, "--model ", name, ": depth must be 1..64");
    return depth;
  };
  if (name == "gpt2") set(12, 12, 768);
  else if (name == "gpt2-medium") set(24, 16, 1024);
  else if (name == "gpt2-large") set(36, 20, 1280);
  else if (name == "gpt2-xl") set(48, 25, 1600);
  else if (name == "llama3.2-1b") llama(16, 32, 8, 2048, 256, 1.5, 32, true, 131072);
  else if (name == "llama3.2-3b") llama(28, 24, 8, 3072, 256, 1.0, 32, true, 131072);
  else if (name == "llama3.1-8b") llama(32, 32, 8, 4096, 1024, 1.3, 8, false, 131072);
  else if (name == "qwen2.5-0.5b") qwen(Family::Qwen2, 24, 14, 2, 896, 4864, 0, 151936, true, 32768);
  else if (name == "qwen2.5-1.5b") qwen(Family::Qwen2, 28, 12, 2, 1536, 8960, 0, 151936, true, 32768);
  else if (name == "qwen2.5-7b") qwen(Family::Qwen2, 28, 28, 4, 3584, 18944, 0, 152064, false, 32768);
  else if (name == "qwen3-0.6b") qwen(Family::Qwen3, 28, 16, 8, 1024, 3072, 128, 151936, true, 40960);
  else if (name == "qwen3-8b") qwen(Family::Qwen3, 36, 32, 8, 4096, 12288, 128, 151936, false, 40960);
  else if (name == "qwen3-30b-a3b") {
    qwen(Family::Qwen3Moe, 48, 32, 4, 2048, 6144, 128, 151936, false, 40960);
    c.n_experts = 128, c.experts_per_token = 8, c.moe_ffn_hidden = 768;
  } else if (name.rfind("qwen3-moe-d", 0) == 0) {
    // qwen3-dN's attention, and 8 experts a layer of the width, 2 of them per token.
    const int64_t depth = depth_of(name.substr(11));
    qwen(Family::Qwen3Moe, depth, depth, grouped_kv_heads(depth), 64 * depth, 3 * 64 * depth, 128, 151936, true, 8192);
    c.n_experts = 8, c.experts_per_token = 2, c.moe_ffn_hidden = 64 * depth;
  }
  else if (name.rfind("llama3-d", 0) == 0) {
    const int64_t depth = depth_of(name.substr(8));
    llama(depth, depth, grouped_kv_heads(depth), 64 * depth, 256, 0, 8, true, 8192);
  } else if (name.rfind("qwen2.5-d", 0) == 0 || name.rfind("qwen3-d", 0) == 0) {
    const bool qwen3 = name[4] == '3';
    const int64_t depth = depth_of(name.substr(qwen3 ? 7 : 9));
    qwen(qwen3 ? Family::Qwen3 : Family::Qwen2, depth, depth, grouped_kv_heads(depth), 64 * depth, 3 * 64 * depth,
         qwen3 ? 128 : 0, 151936, true, qwen3 ? 40960 : 32768);  // the families' context lengths
  } else if (name.size() >= 2 && name[0] == 'd' && name.find_first_not_of("0123456789", 1) == std::string::npos) {
    const int64_t depth = depth_of(name.substr(1));
    set(depth, depth, 64 * depth);
  } else {
    std::string all;
    for (const auto& n : preset_names()) all += (all.empty() ? "" : ", ") + n;
    TALLY_FAIL("--model: unknown preset '", name, "'; expected one of ", all,
               " (or dN, llama3-dN, qwen2.5-dN, qwen3-dN, qwen3-moe-dN for any depth N)");
  }
  return c;
}

std::vector<std::string> TransformerConfig::preset_names() {
  return {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "d2", "d4", "d6", "d12", "d24",
          "llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3-d2", "llama3-d4", "llama3-d6",
          "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b", "qwen2.5-d2", "qwen3-d2",
          "qwen3-30b-a3b", "qwen3-moe-d2"};
}

Recompute parse_recompute(const std::string& text) {
  if (text == "none") return Recompute::None;
  if (text == "selective") return Recompute::Selective;
  if (text == "full") return Recompute::Full;
  TALLY_FAIL("--recompute: expected none, selective or full, got '", text, "'");
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::None: return "none";
    case Recompute::Selective: return "selective";
    case Recompute::Full: return "full";
  }
  return "?";
}

int64_t Transformer::local_experts() const { return config_.n_experts / shard_.ep; }
int64_t Transformer::first_expert() const { return shard_.ep_rank * local_experts(); }

void Transformer::set_expert_parallel(ExpertParallelOps* ops) {
  TALLY_CHECK(!ops || (ops->size() == shard_.ep && ops->rank() == shard_.ep_rank), "model: an expert-parallel group's rank ",
              ops ? ops->rank() : 0, " of ", ops ? ops->size() : 0, " for a shard built as rank ", shard_.ep_rank, " of ",
              shard_.ep);
  ep_ops_ = ops;
}

size_t Transformer::declare_expert(const std::string& name, Shape shape, TpSplit split) {
  const size_t i = declare(name, std::move(shape), true, split);
  expert_.resize(i + 1, false);
  expert_[i] = true;
  return i;
}

size_t Transformer::declare(const std::string& name, Shape shape, bool decay, TpSplit split) {
  const size_t i = params_.declare(name, std::move(shape), decay);
  splits_.resize(i + 1, TpSplit::Replicated);
  splits_[i] = split;
  return i;
}

Transformer::Transformer(const TransformerConfig& config, ModelShard shard, Blocks blocks, Device device)
    : Transformer(config, std::move(shard), LayoutOnly{}) {
  params_.allocate(DType::F32, device, blocks);
  if (config_.llama_architecture()) {
    // A model constant beside the parameters: persistent, owned by the model.
    OwnerTag tag;
    tag.category = Category::Other;
    tag.persistent = true;
    tag.name = intern_name("rope.inv_freq");
    std::vector<double> freqs = rope_inv_freq(config_);
    inv_freq_ = Tensor::empty({static_cast<int64_t>(freqs.size())}, DType::F32, device, tag);
    if (device.is_meta()) return;
    float* d = inv_freq_.data<float>();
    for (size_t i = 0; i < freqs.size(); ++i) d[i] = static_cast<float>(freqs[i]);
  }
}

void Transformer::move_to(Device device) {
  params_.move_to(device);
  if (inv_freq_.defined() && inv_freq_.device() != device) {
    Tensor moved = Tensor::empty(inv_freq_.shape(), inv_freq_.dtype(), device, inv_freq_.storage().owner());
    moved.copy_(inv_freq_);
    inv_freq_ = moved;
  }
}

Transformer Transformer::layout_only(const TransformerConfig& config, ModelShard shard) {
  return Transformer(config, std::move(shard), LayoutOnly{});
}

Transformer::Transformer(const TransformerConfig& config, ModelShard shard, LayoutOnly)
    : config_(config), shard_(std::move(shard)) {
  declare_parameters();
}

void Transformer::declare_parameters() {
  const auto& c = config_;
  c.validate();
  const bool llama = c.llama_architecture();
  const int64_t L = c.n_layer, C = c.n_embd, F = c.ffn_dim(), D = c.head_dim();
  if (shard_.chunks.empty()) shard_.chunks.push_back({0, L, true, true});
  // The shard's shape: every split must divide, every chunk be a range of layers.
  const int tp = shard_.tp;
  TALLY_CHECK(tp >= 1 && shard_.tp_rank >= 0 && shard_.tp_rank < tp, "model shard: tensor-parallel rank ",
              shard_.tp_rank, " of ", tp);
  TALLY_CHECK(c.n_head % tp == 0 && c.n_kv_head % tp == 0, "--tp ", tp, ": the model's ", c.n_head, " query heads and ",
              c.n_kv_head, " key/value heads must both divide into ", tp, " ranks");
  TALLY_CHECK(F % tp == 0, "--tp ", tp, ": the MLP width ", F, " must divide into ", tp, " ranks");
  TALLY_CHECK(c.n_experts == 0 || c.moe_ffn_hidden % tp == 0, "--tp ", tp, ": the experts' width ", c.moe_ffn_hidden,
              " must divide into ", tp, " ranks");
  TALLY_CHECK(shard_.ep >= 1 && shard_.ep_rank >= 0 && shard_.ep_rank < shard_.ep, "model shard: expert-parallel rank ",
              shard_.ep_rank, " of ", shard_.ep);
  TALLY_CHECK(shard_.ep == 1 || (c.n_experts > 0 && c.n_experts % shard_.ep == 0), "--ep ", shard_.ep,
              c.n_experts > 0 ? ": the model's " + std::to_string(c.n_experts) + " experts a layer must divide into " +
                                    std::to_string(shard_.ep) + " ranks"
                              : ": expert parallel splits a mixture of experts' experts, and " + c.describe() +
                                    " has none");
  TALLY_CHECK(c.padded_vocab_size % tp == 0, "--tp ", tp, ": the padded vocabulary ", c.padded_vocab_size,
              " must divide into ", tp, " ranks");
  for (const auto& ch : shard_.chunks)
    TALLY_CHECK(ch.first_layer >= 0 && ch.first_layer < ch.end_layer && ch.end_layer <= L,
                "model shard: chunk of layers [", ch.first_layer, ", ", ch.end_layer, ") of a ", L, "-layer model");
  const int64_t Hl = c.n_head / tp, KVl = c.n_kv_head / tp, Fl = F / tp, Vl = c.padded_vocab_size / tp;
  const int64_t qkv_local = (Hl + 2 * KVl) * D;
  layers_.resize(static_cast<size_t>(L));
  // LLaMA's architecture has no biases (Qwen2 but those of q, k and v): their slots stay kAbsent.
  auto bias = [&](const std::string& name, int64_t n, TpSplit split) {
    return llama ? kAbsent : declare(name, {n}, false, split);
  };
  auto qk_norm = [&](const std::string& name) {
    return c.has_qk_norm() ? declare(name, {D}, false, TpSplit::SharedBySlices) : kAbsent;
  };
  // Units in forward order: the embeddings, each layer, the final norm (and an untied
  // head) (parameters.h).
  for (const auto& ch : shard_.chunks) {
    if (ch.embed) {
      embed_unit_ = params_.begin_unit("embed");
      wte_ = declare("wte", {Vl, C}, true, TpSplit::Rows);
      if (!llama) wpe_ = declare("wpe", {c.max_seq_len, C}, true, TpSplit::Replicated);
    }
    for (int64_t l = ch.first_layer; l < ch.end_layer; ++l) {
      const std::string h = "h." + std::to_string(l) + ".";
      Layer& p = layers_[static_cast<size_t>(l)];
      p.unit = params_.begin_unit("h." + std::to_string(l));
      p.ln1w = declare(h + "ln_1.weight", {C}, false, TpSplit::Replicated);
      p.ln1b = bias(h + "ln_1.bias", C, TpSplit::Replicated);
      p.qkvw = declare(h + "attn.c_attn.weight", {qkv_local, C}, true, TpSplit::QkvRows);
      p.qkvb = c.has_qkv_bias() ? declare(h + "attn.c_attn.bias", {qkv_local}, false, TpSplit::QkvRows) : kAbsent;
      p.qnormw = qk_norm(h + "attn.q_norm.weight");
      p.knormw = qk_norm(h + "attn.k_norm.weight");
      p.attprojw = declare(h + "attn.c_proj.weight", {C, Hl * D}, true, TpSplit::Columns);
      p.attprojb = bias(h + "attn.c_proj.bias", C, TpSplit::Replicated);
      p.ln2w = declare(h + "ln_2.weight", {C}, false, TpSplit::Replicated);
      p.ln2b = bias(h + "ln_2.bias", C, TpSplit::Replicated);
      if (c.sparse_layer(l)) {
        // The router, then each expert's up, gate and down (a dense MLP's names under
        // mlp.experts.E).
        p.routerw = declare(h + "mlp.router.weight", {c.n_experts, C}, true, TpSplit::SharedBySlices);
        p.expert_unit = params_.begin_unit("h." + std::to_string(l) + ".experts");
        const int64_t Fe = c.moe_ffn_hidden / tp;  // each expert split as a dense MLP is
        for (int64_t e = first_expert(); e < first_expert() + local_experts(); ++e) {
          const std::string x = h + "mlp.experts." + std::to_string(e) + ".";
          p.expert_up.push_back(declare_expert(x + "c_fc.weight", {Fe, C}, TpSplit::Rows));
          p.expert_gate.push_back(declare_expert(x + "c_fc2.weight", {Fe, C}, TpSplit::Rows));
          p.expert_down.push_back(declare_expert(x + "c_proj.weight", {C, Fe}, TpSplit::Columns));
        }
        continue;
      }
      p.fcw = declare(h + "mlp.c_fc.weight", {Fl, C}, true, TpSplit::Rows);
      p.fcb = bias(h + "mlp.c_fc.bias", Fl, TpSplit::Rows);
      p.fc2w = llama ? declare(h + "mlp.c_fc2.weight", {Fl, C}, true, TpSplit::Rows) : kAbsent;
      p.fcprojw = declare(h + "mlp.c_proj.weight", {C, Fl}, true, TpSplit::Columns);
      p.fcprojb = bias(h + "mlp.c_proj.bias", C, TpSplit::Replicated);
    }
    if (ch.head) {
      final_unit_ = params_.begin_unit(c.tie_embeddings ? "ln_f" : "head");
      lnfw_ = declare("ln_f.weight", {C}, false, TpSplit::Replicated);
      lnfb_ = bias("ln_f.bias", C, TpSplit::Replicated);
      if (!c.tie_embeddings) {
        lm_head_ = declare("lm_head", {Vl, C}, true, TpSplit::Rows);
      } else if (!ch.embed) {
        // A pipeline's last chunk: its own copy of the tied embedding (Megatron's
        // embedding group sums the two copies' gradients).
        bool first_chunk_here = false;
        for (const auto& other : shard_.chunks) first_chunk_here |= other.embed;
        TALLY_CHECK(!first_chunk_here, "model shard: the embedding and the tied head are in different chunks of one rank");
        wte_ = declare("wte", {Vl, C}, true, TpSplit::Rows);
        tied_head_copy_ = true;
      }
    }
  }
}

std::vector<std::pair<Tensor, Tensor>> Transformer::shard_regions(size_t i, const Tensor& whole, const Tensor& local) const {
  const auto& c = config_;
  const int r = shard_.tp_rank;
  const int64_t D = c.head_dim(), Hl = c.n_head / shard_.tp, KVl = c.n_kv_head / shard_.tp;
  auto rows = [](const Tensor& t, int64_t begin, int64_t n) { return t.slice(0, begin, begin + n); };
  switch (splits_[i]) {
    case TpSplit::Replicated:
    case TpSplit::SharedBySlices: return {{whole, local}};
    case TpSplit::Rows: {
      const int64_t n = local.shape()[0];
      return {{rows(whole, r * n, n), local}};
    }
    case TpSplit::Columns: {
      const int64_t n = local.shape()[1];
      return {{whole.slice(1, r * n, (r + 1) * n), local}};
    }
    case TpSplit::QkvRows: {
      // [q of my heads | k of my kv heads | v of my kv heads] within [q | k | v].
      const int64_t q = Hl * D, kv = KVl * D;
      return {{rows(whole, r * q, q), rows(local, 0, q)},
              {rows(whole, c.q_dim() + r * kv, kv), rows(local, q, kv)},
              {rows(whole, c.q_dim() + c.kv_dim() + r * kv, kv), rows(local, q + kv, kv)}};
    }
  }
  return {};
}

namespace {
// An identity on an activation whose backward tells the residency to acquire or release
// parameter units: placed at a unit's output it runs before the unit's backward, at its
// input after it.
struct UnitBorder {
  static constexpr const char* kName = "unit_border";
  struct Context : autograd::Context {
    ParameterResidency* residency = nullptr;  // non-owning: outlives the graph (the trainer holds it)
    std::vector<size_t> units;
    bool acquire = false;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    for (size_t u : ctx.units) ctx.acquire ? ctx.residency->acquire(u, true) : ctx.residency->release(u, true);
    return {grads[0]};
  }
};
}  // namespace

void Transformer::enter(const std::vector<size_t>& units) const {
  if (!residency_) return;
  for (size_t u : units) residency_->acquire(u, false);
}

void Transformer::prefetch(const std::vector<size_t>& units) const {
  if (!residency_) return;
  for (size_t u : units) residency_->prefetch(u);
}

void Transformer::leave(const std::vector<size_t>& units) const {
  if (!residency_) return;
  for (size_t u : units) residency_->release(u, false);
}

Tensor Transformer::released_in_backward(const Tensor& x, const std::vector<size_t>& units) const {
  return border(x, units, false);
}

Tensor Transformer::acquired_in_backward(const Tensor& x, const std::vector<size_t>& units) const {
  return border(x, units, true);
}

Tensor Transformer::border(const Tensor& x, const std::vector<size_t>& units, bool acquire) const {
  if (!residency_ || !autograd::needs_graph({x})) return x;
  Tensor out = x.detach();  // the same values, a fresh tensor for the marker's output
  auto ctx = std::make_unique<UnitBorder::Context>();
  ctx->residency = residency_;
  ctx->units = units;
  ctx->acquire = acquire;
  autograd::record<UnitBorder>(std::move(ctx), {x}, {out});
  return out;
}

Tensor Transformer::norm(const Tensor& x, size_t weight, size_t bias) const {
  return config_.llama_architecture() ? ops::rmsnorm(x, params_[weight], config_.norm_eps)
                            : ops::layernorm(x, params_[weight], params_[bias], config_.norm_eps);
}

KvCache Transformer::make_kv_cache(int64_t batch, int64_t capacity) const {
  TALLY_CHECK(batch >= 1 && capacity >= 1 && capacity <= config_.max_seq_len, "KV cache: ", batch, " sequences of ",
              capacity, " tokens; the model's maximum is ", config_.max_seq_len);
  // Persistent: it lives across the decoding steps by design.
  const OwnerTag tag = make_owner(Category::Workspace, "kv_cache", /*persistent=*/true);
  KvCache cache;
  const Shape shape = {batch, capacity, config_.n_kv_head, config_.head_dim()};
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    cache.k.push_back(Tensor::zeros(shape, params_.dtype(), params_.device(), tag));
    cache.v.push_back(Tensor::zeros(shape, params_.dtype(), params_.device(), tag));
  }
  return cache;
}

ForwardResult Transformer::forward(const Tensor& tokens, const Tensor& targets, bool return_logits,
                                   KvCache* cache) const {
  const auto& c = config_;
  TALLY_CHECK(shard_.chunks.size() == 1 && shard_.chunks[0].embed && shard_.chunks[0].head,
              "model: forward runs the whole model; this rank holds pipeline chunks (run them with forward_chunk)");
  TALLY_CHECK(tokens.dim() == 2, "model: tokens must be (B, T), got ", tokens.str());
  const int64_t B = tokens.shape()[0], T = tokens.shape()[1];
  const int64_t start = cache ? cache->length : 0;  // the first token's position
  TALLY_CHECK(start + T <= c.max_seq_len, "model: sequence length ", start + T, " exceeds the model's maximum ",
              c.max_seq_len);
  if (cache) {
    TALLY_CHECK(!autograd::grad_enabled(), "model: a KV cache is for inference; run it without gradients");
    TALLY_CHECK(!tp_ops_, "model: KV-cache decoding runs on a model that is not tensor-parallel");
    TALLY_CHECK(static_cast<int64_t>(cache->k.size()) == c.n_layer && cache->k[0].shape()[0] == B &&
                    start + T <= cache->capacity(),
                "model: the KV cache holds ", cache->k.size(), " layers of ",
                cache->k.empty() ? 0 : cache->k[0].shape()[0], " x ", cache->capacity(), " tokens; this call needs ",
                c.n_layer, " layers of ", B, " x ", start + T);
  }
  if (targets.defined())
    TALLY_CHECK(targets.shape() == tokens.shape(), "model: targets ", targets.str(), " do not match tokens ", tokens.str());
  Tensor x = embed(tokens, start, cp_ops_ && !cache);
  for (int64_t l = 0; l < c.n_layer; ++l) x = layer(l, x, start, cache);
  if (cache) cache->length = start + T;
  ForwardResult result;
  head(x, targets, return_logits, result);
  return result;
}

ForwardResult Transformer::forward_chunk(size_t chunk, const Tensor& input, const Tensor& targets) const {
  TALLY_CHECK(chunk < shard_.chunks.size(), "model: chunk ", chunk, " of a shard of ", shard_.chunks.size());
  const ModelShard::Chunk& ch = shard_.chunks[chunk];
  Tensor x;
  if (ch.embed) {
    TALLY_CHECK(input.dim() == 2, "model: the first chunk takes tokens (B, T), got ", input.str());
    TALLY_CHECK(input.shape()[1] <= config_.max_seq_len, "model: sequence length ", input.shape()[1],
                " exceeds the model's maximum ", config_.max_seq_len);
    x = embed(input, 0, cp_ops_ != nullptr);
  } else {
    TALLY_CHECK(input.dim() == 3 && input.shape()[2] == config_.n_embd, "model: chunk ", chunk,
                " takes the previous chunk's output (B, T, ", config_.n_embd, "), got ", input.str());
    x = input;
  }
  for (int64_t l = ch.first_layer; l < ch.end_layer; ++l) x = layer(l, x, 0, nullptr);
  ForwardResult result;
  if (ch.head) head(x, targets, false, result);
  else result.hidden = x;
  return result;
}

Tensor Transformer::embed(const Tensor& tokens, int64_t start, bool split) const {
  const auto& c = config_;
  const std::vector<size_t> units{embed_unit()};
  OwnerScope scope("embed");
  enter(units);
  prefetch(layer_units(0));
  // Named steps, not nested calls: C++ leaves argument evaluation order unspecified,
  // and the order ops are recorded in is the order backward runs them in reverse.
  Tensor x;
  if (!tp_ops_) {
    x = ops::embedding(params_[wte_], tokens);
  } else {
    // Each rank looks up the tokens of its vocabulary block; the sum over ranks (or its
    // slice of the sequence, under sequence parallelism) is the embedding.
    Tensor partial = tp_ops_->vocab_parallel_embedding(params_[wte_], tokens, vocab_start());
    x = tp_ops_->out_of_row_parallel(partial);
  }
  if (!c.llama_architecture()) {
    // This rank's positions: all T, or its slice of the sequence; under context
    // parallelism the rows of its runs of positions.
    const int64_t T = x.shape()[1];
    const int64_t first = tp_ops_ && tp_ops_->sequence_parallel() ? tp_ops_->rank() * T : 0;
    Tensor position_embedding;
    if (split) {
      const int64_t local_length = T * (tp_ops_ && tp_ops_->sequence_parallel() ? tp_ops_->size() : 1);
      std::vector<Tensor> rows;
      for (const PositionRun& r : context_parallel_runs(cp_ops_->size(), cp_ops_->rank(), local_length, first, T))
        rows.push_back(params_[wpe_].slice(0, r.global, r.global + r.length));
      position_embedding = rows.size() == 1 ? rows[0] : ops::cat(rows, 0);
    } else {
      position_embedding = params_[wpe_].slice(0, start + first, start + first + T);
    }
    x = ops::add(x, position_embedding);
  }
  x = acquired_in_backward(x, units);
  leave(units);
  return x;
}

void Transformer::set_loss_chunk_rows(int64_t rows) {
  TALLY_CHECK(rows >= 0, "model: loss chunk rows must be >= 0, got ", rows);
  TALLY_CHECK(rows == 0 || !tp_ops_, "model: the chunked loss does not combine with tensor parallelism, whose loss is "
              "vocabulary-parallel already");
  loss_chunk_rows_ = rows;
}

int64_t Transformer::default_loss_chunk_rows(int64_t padded_vocab) {
  return std::max<int64_t>(128, (int64_t{32} << 20) / (4 * std::max<int64_t>(padded_vocab, 1)));
}

void Transformer::set_matmul_dtype(DType dtype) {
  TALLY_CHECK(dtype == DType::F32 || dtype == DType::BF16, "model: matmul dtype ", dtype_name(dtype),
              " is not supported (float32, bfloat16)");
  if (dtype == DType::BF16 && !params_.has_compute_copy()) params_.enable_compute_copy(DType::BF16);
  matmul_dtype_ = dtype;
}

Tensor Transformer::linear(const Tensor& x, size_t weight, size_t bias, DType out) const {
  if (matmul_dtype_ == DType::BF16)
    return ops::linear_bf16(x, params_[weight], params_.compute_copy(weight), param(bias), out);
  return ops::linear(x, params_[weight], param(bias));
}

// Under bf16 the head writes bf16 logits, as autocast's linear does: the (B*T, Vp)
// logits are the step's largest activation, and the loss reads them as fp32 anyway. Their
// gradient is then bf16 too, the GEMMs' operand as it is, with no rounding pass between.
Tensor Transformer::head_logits(const Tensor& x, size_t weight) const {
  if (matmul_dtype_ == DType::BF16)
    return ops::linear_bf16(x, params_[weight], params_.compute_copy(weight), Tensor(), DType::BF16);
  return ops::linear(x, params_[weight]);
}

Tensor Transformer::attention(const Tensor& q, const Tensor& k, const Tensor& v, bool recompute) const {
  if (matmul_dtype_ == DType::BF16) return ops::causal_attention_bf16(q, k, v, recompute);
  return ops::causal_attention(q, k, v, recompute);
}

Tensor Transformer::split_rotary(const Tensor& x) const {
  std::vector<Tensor> parts;
  for (const PositionRun& r : context_parallel_runs(cp_ops_->size(), cp_ops_->rank(), x.shape()[1], 0, x.shape()[1]))
    parts.push_back(ops::rotary(x.slice(1, r.local, r.local + r.length), inv_freq_, r.global));
  return ops::cat(parts, 1);
}

// Each run of local queries ends at global position g + n - 1 and sees the keys up to it:
// the prefix 0 .. g + n - 1 of the whole sequence, with the causal mask aligned to its end.
Tensor Transformer::split_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool recompute) const {
  std::vector<Tensor> parts;
  for (const PositionRun& r : context_parallel_runs(cp_ops_->size(), cp_ops_->rank(), q.shape()[1], 0, q.shape()[1])) {
    const int64_t seen = r.global + r.length;
    parts.push_back(attention(q.slice(1, r.local, r.local + r.length), k.slice(1, 0, seen), v.slice(1, 0, seen), recompute));
  }
  return ops::cat(parts, 1);
}

Tensor Transformer::row_linear(const Tensor& x, size_t weight, size_t bias) const {
  if (!tp_ops_) return linear(x, weight, bias);
  Tensor partial = linear(x, weight, kAbsent);
  Tensor out = tp_ops_->out_of_row_parallel(partial);
  return bias == kAbsent ? out : ops::add(out, params_[bias]);
}

Tensor Transformer::layer(int64_t l, const Tensor& input, int64_t start, KvCache* cache) const {
  const Layer& p = layers_[static_cast<size_t>(l)];
  TALLY_CHECK(p.unit != kAbsent, "internal: layer ", l, " is not part of this rank's shard");
  OwnerScope layer_scope("h." + std::to_string(l));
  const std::vector<size_t> unit = p.units();
  enter(unit);
  prefetch(l + 1 < config_.n_layer ? layer_units(l + 1) : std::vector<size_t>{final_unit()});
  Tensor x = released_in_backward(input, unit);
  if (recompute_ == Recompute::Full && autograd::grad_enabled() && !cache) {
    // Only the layer's input is kept; backward runs the layer again (R5: what the
    // recomputation makes dies with the checkpoint node's backward).
    x = autograd::checkpoint([this, l, start](const std::vector<Tensor>& in) { return layer_body(l, in[0], start, nullptr); },
                             {x});
  } else {
    x = layer_body(l, x, start, cache);
  }
  x = acquired_in_backward(x, unit);
  leave(unit);
  return x;
}

Tensor Transformer::layer_body(int64_t l, const Tensor& input, int64_t start, KvCache* cache) const {
  const auto& c = config_;
  const Layer& p = layers_[static_cast<size_t>(l)];
  const int tp = shard_.tp;
  const int64_t D = c.head_dim(), H = c.n_head / tp, KV = c.n_kv_head / tp;
  Tensor x = input;
  {
    OwnerScope scope("attn");
    Tensor h = norm(x, p.ln1w, p.ln1b);
    if (tp_ops_) h = tp_ops_->into_column_parallel(h);  // (B, T, C) on every rank
    const int64_t B = h.shape()[0], T = h.shape()[1];
    Tensor qkv = linear(h, p.qkvw, p.qkvb);                      // (B,T,(H+2KV)*D)
    std::vector<Tensor> parts = ops::split(qkv, {H * D, KV * D, KV * D}, 2);           // strided views
    Tensor q = parts[0].view({B, T, H, D}), k = parts[1].view({B, T, KV, D}), v = parts[2].view({B, T, KV, D});
    if (c.has_qk_norm()) {
      // Each head's q and k normalized over its D channels (one weight for all heads),
      // before rotary: new tensors, so qkv itself is not kept for their backward.
      q = ops::rmsnorm(q, params_[p.qnormw], c.norm_eps);
      k = ops::rmsnorm(k, params_[p.knormw], c.norm_eps);
    }
    const bool split = cp_ops_ && !cache;
    if (c.llama_architecture()) {
      q = split ? split_rotary(q) : ops::rotary(q, inv_freq_, start);
      k = split ? split_rotary(k) : ops::rotary(k, inv_freq_, start);
      // v's own copy: saving the view would keep all of qkv alive until backward. (Mixed
      // precision's attention saves a bf16 copy of its own; a cache copies v in anyway,
      // and so does context parallelism's gather.)
      if (matmul_dtype_ != DType::BF16 && !cache && !split) v = ops::contiguous(v);
    }
    if (cache) {
      // Append this call's keys and values, then attend over everything cached.
      cache->k[l].slice(1, start, start + T).copy_(k);
      cache->v[l].slice(1, start, start + T).copy_(v);
      k = cache->k[l].slice(1, 0, start + T);
      v = cache->v[l].slice(1, 0, start + T);
    }
    // Selective recomputation: the attention core keeps only q, k, v (fp32 views of the
    // projection, or under bf16 its own bf16 copies) and runs its forward again in backward
    // for the output and log-sum-exp.
    const bool selective = recompute_ == Recompute::Selective;
    Tensor a;
    if (split) {
      // The whole sequences' keys and values, gathered from the context-parallel group.
      k = cp_ops_->gather_sequence(k);
      v = cp_ops_->gather_sequence(v);
      a = split_attention(q, k, v, selective).view({B, T, H * D});
    } else {
      a = attention(q, k, v, selective).view({B, T, H * D});
    }
    x = ops::add(x, row_linear(a, p.attprojw, p.attprojb));
  }
  {
    OwnerScope scope("mlp");
    Tensor h = norm(x, p.ln2w, p.ln2b);
    if (p.routerw != kAbsent) return ops::add(x, experts(h, l));
    if (tp_ops_) h = tp_ops_->into_column_parallel(h);
    Tensor f;
    // Under bf16 the hidden layer stays bf16 end to end, as autocast runs it: the
    // projections write it rounded, SwiGLU or GELU reads and writes bf16, the output
    // projection takes it as its operand, and their gradients are bf16 too. (The widest
    // activations: half the bytes saved, and no fp32 copy or rounding pass either way.)
    if (c.llama_architecture()) {
      Tensor gate = linear(h, p.fc2w, kAbsent, matmul_dtype_);
      Tensor up = linear(h, p.fcw, kAbsent, matmul_dtype_);
      f = ops::swiglu(gate, up);
    } else {
      f = ops::gelu(linear(h, p.fcw, p.fcb, matmul_dtype_));
    }
    x = ops::add(x, row_linear(f, p.fcprojw, p.fcprojb));
  }
  return x;
}

void Transformer::head(const Tensor& input, const Tensor& targets, bool return_logits, ForwardResult& result) const {
  const auto& c = config_;
  std::vector<size_t> units{final_unit()};
  if (c.tie_embeddings && !tied_head_copy_) units.push_back(embed_unit());
  OwnerScope scope("head");
  enter(units);
  Tensor x = released_in_backward(input, units);
  x = norm(x, lnfw_, lnfb_);
  const size_t head_weight = c.tie_embeddings ? wte_ : lm_head_;
  auto check_targets = [&](int64_t B, int64_t T) {
    TALLY_CHECK(targets.dim() == 2 && targets.shape()[0] == B && targets.shape()[1] == T, "model: targets ",
                targets.str(), " do not match the batch (", B, ", ", T, ")");
  };
  if (tp_ops_) {
    // Logits of this rank's vocabulary block only: (B, T, Vp / tp).
    TALLY_CHECK(!return_logits, "model: a tensor-parallel model does not return whole logits");
    x = tp_ops_->into_column_parallel(x);
    const int64_t B = x.shape()[0], T = x.shape()[1];
    if (targets.defined()) check_targets(B, T);
    Tensor logits = head_logits(x, head_weight);
    if (targets.defined())
      result.loss = tp_ops_->vocab_parallel_cross_entropy(logits.view({B * T, logits.shape()[2]}), targets.view({B * T}),
                                                          vocab_start(), c.vocab_size);
  } else {
    const int64_t B = x.shape()[0], T = x.shape()[1];
    if (targets.defined()) check_targets(B, T);
    if (loss_chunk_rows_ > 0 && targets.defined() && !return_logits) {
      const Tensor copy = matmul_dtype_ == DType::BF16 ? params_.compute_copy(head_weight) : Tensor();
      result.loss = ops::linear_cross_entropy(x.reshape({B * T, c.n_embd}), params_[head_weight], targets.reshape({B * T}),
                                              c.vocab_size, loss_chunk_rows_, copy);
    } else {
      Tensor logits = head_logits(x, head_weight);  // (B,T,Vp)
      if (targets.defined())
        result.loss = ops::cross_entropy(logits.view({B * T, c.padded_vocab_size}), targets.view({B * T}), c.vocab_size);
      // Returned logits are fp32 whatever the head wrote (under bf16: its values, widened).
      if (return_logits) result.logits = logits.dtype() == DType::F32 ? logits : logits.to(DType::F32);
    }
  }
  // The router's load-balancing loss joins the objective; without targets there is none.
  if (Tensor aux = take_router_loss(); aux.defined() && result.loss.defined()) {
    result.aux_loss = aux;
    result.loss = ops::add(result.loss, ops::scale(aux, config_.router_aux_loss_coef));
  }
  if (result.loss.defined()) result.loss = acquired_in_backward(result.loss, units);
  leave(units);
}

double Transformer::flops_per_token(int64_t seq_len) const {
  const auto& c = config_;
  int64_t whole = shard_.whole() ? num_parameters() : layout_only(c).num_parameters();
  // A token runs k of a sparse layer's E experts: the others' weights do no work for it.
  for (int64_t l = 0; l < c.n_layer; ++l)
    if (c.sparse_layer(l)) whole -= (c.n_experts - c.experts_per_token) * 3 * c.n_embd * c.moe_ffn_hidden;
  return 6.0 * static_cast<double>(whole) + 6.0 * static_cast<double>(c.n_layer * c.q_dim() * seq_len);
}

}  // namespace tally::nn
