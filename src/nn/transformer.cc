#include "nn/transformer.h"

#include <cmath>
#include <sstream>

#include "autograd/function.h"
#include "autograd/grad_mode.h"
#include "core/owner.h"
#include "ops/ops.h"

namespace tally::nn {

std::string TransformerConfig::describe() const {
  std::ostringstream os;
  os << (family == Family::Gpt2 ? "gpt2" : "llama3") << " L=" << n_layer << " H=" << n_head << " C=" << n_embd
     << " V=" << vocab_size << " (padded " << padded_vocab_size << ") maxT=" << max_seq_len;
  return os.str();
}

TransformerConfig TransformerConfig::preset(const std::string& name) {
  TransformerConfig c;
  auto set = [&](int64_t L, int64_t H, int64_t C) {
    c.n_layer = L;
    c.n_head = H;
    c.n_kv_head = H;
    c.n_embd = C;
  };
  if (name == "gpt2") set(12, 12, 768);
  else if (name == "gpt2-medium") set(24, 16, 1024);
  else if (name == "gpt2-large") set(36, 20, 1280);
  else if (name == "gpt2-xl") set(48, 25, 1600);
  else if (name.size() >= 2 && name[0] == 'd' && name.find_first_not_of("0123456789", 1) == std::string::npos) {
    // At most three digits: std::stoll would throw a bare "stoll" on a 20-digit depth.
    const int64_t depth = name.size() <= 4 ? std::stoll(name.substr(1)) : 0;
    TALLY_CHECK(depth >= 1 && depth <= 64, "--model ", name, ": depth must be 1..64");
    set(depth, depth, 64 * depth);
  } else {
    std::string all;
    for (const auto& n : preset_names()) all += (all.empty() ? "" : ", ") + n;
    TALLY_FAIL("--model: unknown preset '", name, "'; expected one of ", all, " (or dN for any depth N)");
  }
  return c;
}

std::vector<std::string> TransformerConfig::preset_names() {
  return {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "d2", "d4", "d6", "d12", "d24"};
}

std::vector<std::pair<std::string, Shape>> llmc_tensor_layout(const TransformerConfig& c) {
  const int64_t L = c.n_layer, C = c.n_embd, Vp = c.padded_vocab_size, T = c.max_seq_len;
  return {{"wte", {Vp, C}},         {"wpe", {T, C}},        {"ln1w", {L, C}},         {"ln1b", {L, C}},
          {"qkvw", {L, 3 * C, C}}, {"qkvb", {L, 3 * C}},  {"attprojw", {L, C, C}},  {"attprojb", {L, C}},
          {"ln2w", {L, C}},         {"ln2b", {L, C}},        {"fcw", {L, 4 * C, C}},   {"fcb", {L, 4 * C}},
          {"fcprojw", {L, C, 4 * C}}, {"fcprojb", {L, C}}, {"lnfw", {C}},            {"lnfb", {C}}};
}

Transformer::Transformer(const TransformerConfig& config) : config_(config) {
  const auto& c = config_;
  TALLY_CHECK(c.family == TransformerConfig::Family::Gpt2,
              "model family llama3 is not implemented yet (RMSNorm, RoPE and SwiGLU kernels are missing)");
  TALLY_CHECK(c.n_embd % c.n_head == 0, "model: n_embd ", c.n_embd, " is not divisible by n_head ", c.n_head);
  TALLY_CHECK(c.padded_vocab_size >= c.vocab_size, "model: padded vocab ", c.padded_vocab_size, " < vocab ", c.vocab_size);
  const int64_t L = c.n_layer, C = c.n_embd;
  layers_.resize(static_cast<size_t>(L));
  // Units in forward order: the embeddings, each layer, the final norm (parameters.h).
  params_.begin_unit("embed");
  wte_ = params_.declare("wte", {c.padded_vocab_size, C}, true);
  wpe_ = params_.declare("wpe", {c.max_seq_len, C}, true);
  for (int64_t l = 0; l < L; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    Layer& p = layers_[l];
    params_.begin_unit("h." + std::to_string(l));
    p.ln1w = params_.declare(h + "ln_1.weight", {C}, false);
    p.ln1b = params_.declare(h + "ln_1.bias", {C}, false);
    p.qkvw = params_.declare(h + "attn.c_attn.weight", {3 * C, C}, true);
    p.qkvb = params_.declare(h + "attn.c_attn.bias", {3 * C}, false);
    p.attprojw = params_.declare(h + "attn.c_proj.weight", {C, C}, true);
    p.attprojb = params_.declare(h + "attn.c_proj.bias", {C}, false);
    p.ln2w = params_.declare(h + "ln_2.weight", {C}, false);
    p.ln2b = params_.declare(h + "ln_2.bias", {C}, false);
    p.fcw = params_.declare(h + "mlp.c_fc.weight", {4 * C, C}, true);
    p.fcb = params_.declare(h + "mlp.c_fc.bias", {4 * C}, false);
    p.fcprojw = params_.declare(h + "mlp.c_proj.weight", {C, 4 * C}, true);
    p.fcprojb = params_.declare(h + "mlp.c_proj.bias", {C}, false);
  }
  params_.begin_unit("ln_f");
  lnfw_ = params_.declare("ln_f.weight", {C}, false);
  lnfb_ = params_.declare("ln_f.bias", {C}, false);
  params_.allocate();
}

std::vector<LlmcTensor> Transformer::llmc_tensors() const {
  std::vector<LlmcTensor> out;
  for (auto& [name, shape] : llmc_tensor_layout(config_)) {
    LlmcTensor t{name, shape, {}};
    if (name == "wte") t.params = {wte_};
    else if (name == "wpe") t.params = {wpe_};
    else if (name == "lnfw") t.params = {lnfw_};
    else if (name == "lnfb") t.params = {lnfb_};
    else {
      static const std::pair<const char*, size_t Layer::*> kinds[] = {
          {"ln1w", &Layer::ln1w}, {"ln1b", &Layer::ln1b},         {"qkvw", &Layer::qkvw},     {"qkvb", &Layer::qkvb},
          {"attprojw", &Layer::attprojw}, {"attprojb", &Layer::attprojb}, {"ln2w", &Layer::ln2w}, {"ln2b", &Layer::ln2b},
          {"fcw", &Layer::fcw},   {"fcb", &Layer::fcb},           {"fcprojw", &Layer::fcprojw}, {"fcprojb", &Layer::fcprojb}};
      for (auto& [kind, field] : kinds)
        if (name == kind)
          for (const Layer& layer : layers_) t.params.push_back(layer.*field);
    }
    TALLY_CHECK(!t.params.empty(), "internal: llm.c tensor '", name, "' maps to no parameter");
    out.push_back(std::move(t));
  }
  return out;
}

void Transformer::init_weights(uint64_t seed) {
  Rng rng(seed);
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
  // Draws in llm.c's tensor order (each kind over all layers), so a seed gives the same
  // weights whatever order the parameter block keeps them in.
  for (const LlmcTensor& t : llmc_tensors()) {
    for (size_t i : t.params) {
      const std::string& name = params_.spec(i).name;
      const Tensor& p = params_[i];
      float* d = p.data<float>();
      const int64_t n = p.numel();
      bool is_norm_weight = name.find("ln_") != std::string::npos && name.find(".weight") != std::string::npos;
      bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
      if (is_norm_weight) {
        for (int64_t j = 0; j < n; ++j) d[j] = 1.f;
      } else if (is_bias) {
        for (int64_t j = 0; j < n; ++j) d[j] = 0.f;
      } else {
        bool residual = name.find("c_proj.weight") != std::string::npos;
        double std = residual ? residual_std : 0.02;
        for (int64_t j = 0; j < n; ++j) d[j] = static_cast<float>(rng.normal() * std);
      }
      p.storage().bump_version();
    }
  }
  // Padding rows of the embedding are never looked up or predicted: keep them zero.
  Tensor wte = params_[wte_];
  wte.slice(0, config_.vocab_size, config_.padded_vocab_size).detach().zero_();
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

ForwardResult Transformer::forward(const Tensor& tokens, const Tensor& targets, bool return_logits) const {
  const auto& c = config_;
  TALLY_CHECK(tokens.dim() == 2, "model: tokens must be (B, T), got ", tokens.str());
  const int64_t B = tokens.shape()[0], T = tokens.shape()[1], C = c.n_embd, H = c.n_head, D = c.head_dim();
  TALLY_CHECK(T <= c.max_seq_len, "model: sequence length ", T, " exceeds the model's maximum ", c.max_seq_len);
  // Each unit's parameters are acquired around its ops (see residency.h); without a
  // residency every call below on units is a no-op.
  const std::vector<size_t> embed{embed_unit()}, head{final_unit(), embed_unit()};

  // Embeddings: x = wte[tokens] + wpe[0:T]
  Tensor x;
  {
    OwnerScope scope("embed");
    enter(embed);
    if (residency_) residency_->prefetch(layer_unit(0));
    // Named steps, not nested calls: C++ leaves argument evaluation order unspecified,
    // and the order ops are recorded in is the order backward runs them in reverse.
    Tensor token_embedding = ops::embedding(params_[wte_], tokens);
    Tensor position_embedding = params_[wpe_].slice(0, 0, T);
    x = acquired_in_backward(ops::add(token_embedding, position_embedding), embed);
    leave(embed);
  }
  for (int64_t l = 0; l < c.n_layer; ++l) {
    OwnerScope layer_scope("h." + std::to_string(l));
    const Layer& p = layers_[l];
    const std::vector<size_t> unit{layer_unit(l)};
    enter(unit);
    if (residency_) residency_->prefetch(l + 1 < c.n_layer ? layer_unit(l + 1) : final_unit());
    x = released_in_backward(x, unit);
    {
      OwnerScope scope("attn");
      Tensor h = ops::layernorm(x, params_[p.ln1w], params_[p.ln1b], c.norm_eps);
      Tensor qkv = ops::linear(h, params_[p.qkvw], params_[p.qkvb]);                  // (B,T,3C)
      std::vector<Tensor> parts = ops::split(qkv, {C, C, C}, 2);                        // strided views
      Tensor q = parts[0].view({B, T, H, D}), k = parts[1].view({B, T, H, D}), v = parts[2].view({B, T, H, D});
      Tensor a = ops::causal_attention(q, k, v).view({B, T, C});
      x = ops::add(x, ops::linear(a, params_[p.attprojw], params_[p.attprojb]));
    }
    {
      OwnerScope scope("mlp");
      Tensor h = ops::layernorm(x, params_[p.ln2w], params_[p.ln2b], c.norm_eps);
      Tensor f = ops::gelu(ops::linear(h, params_[p.fcw], params_[p.fcb]));
      x = ops::add(x, ops::linear(f, params_[p.fcprojw], params_[p.fcprojb]));
    }
    x = acquired_in_backward(x, unit);
    leave(unit);
  }
  ForwardResult result;
  OwnerScope scope("head");
  enter(head);
  x = released_in_backward(x, head);
  x = ops::layernorm(x, params_[lnfw_], params_[lnfb_], c.norm_eps);
  Tensor logits = ops::linear(x, params_[wte_]);  // (B,T,Vp), tied to the embedding
  if (targets.defined()) {
    TALLY_CHECK(targets.shape() == tokens.shape(), "model: targets ", targets.str(), " do not match tokens ", tokens.str());
    result.loss = ops::cross_entropy(logits.view({B * T, c.padded_vocab_size}), targets.view({B * T}), c.vocab_size);
    result.loss = acquired_in_backward(result.loss, head);
  }
  if (return_logits) result.logits = logits;
  leave(head);
  return result;
}

double Transformer::flops_per_token(int64_t seq_len) const {
  const auto& c = config_;
  return 6.0 * static_cast<double>(num_parameters()) +
         6.0 * static_cast<double>(c.n_layer * c.n_embd * seq_len);
}

}  // namespace tally::nn
