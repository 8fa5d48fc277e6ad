#include "nn/llmc_layout.h"

#include <unordered_map>
#include <unordered_set>

#include "autograd/grad_mode.h"
#include "core/error.h"

namespace tally::nn {

std::vector<std::pair<std::string, Shape>> llmc_tensor_layout(const TransformerConfig& c) {
  const int64_t L = c.n_layer, C = c.n_embd, Vp = c.padded_vocab_size, T = c.max_seq_len, F = c.ffn_dim();
  if (c.llama_architecture()) {
    // llm.c's train_llama3.py order; c_fc is the up projection (Meta's w3), c_fc2 the
    // gate (w1). Embedding and head hold vocab_size rows (unpadded). Qwen2's q/k/v biases
    // follow the q/k/v weights, Qwen3's q/k norms follow those.
    // Qwen3-MoE's sparse layers hold the router and the experts instead of the MLP: each
    // kind is stacked over the layers that have it (dense, then sparse), the experts' over
    // layers and experts.
    const int64_t V = c.vocab_size, D = c.head_dim();
    const int64_t sparse = c.sparse_layer_count();
    const int64_t dense = L - sparse, E = c.n_experts, Fe = c.moe_ffn_hidden;
    std::vector<std::pair<std::string, Shape>> layout = {{"wte", {V, C}}, {"ln1w", {L, C}}, {"qkvw", {L, c.qkv_dim(), C}}};
    if (c.has_qkv_bias()) layout.push_back({"qkvb", {L, c.qkv_dim()}});
    if (c.has_qk_norm()) layout.insert(layout.end(), {{"qnormw", {L, D}}, {"knormw", {L, D}}});
    layout.insert(layout.end(), {{"attprojw", {L, C, c.q_dim()}}, {"ln2w", {L, C}}});
    if (dense > 0) layout.insert(layout.end(), {{"fcw", {dense, F, C}}, {"fcw2", {dense, F, C}}, {"fcprojw", {dense, C, F}}});
    if (sparse > 0)
      layout.insert(layout.end(), {{"routerw", {sparse, E, C}}, {"expfcw", {sparse, E, Fe, C}},
                                   {"expfcw2", {sparse, E, Fe, C}}, {"expfcprojw", {sparse, E, C, Fe}}});
    layout.insert(layout.end(), {{"lnfw", {C}}, {"lm_head", {V, C}}});
    return layout;
  }
  return {{"wte", {Vp, C}},         {"wpe", {T, C}},        {"ln1w", {L, C}},         {"ln1b", {L, C}},
          {"qkvw", {L, 3 * C, C}}, {"qkvb", {L, 3 * C}},  {"attprojw", {L, C, C}},  {"attprojb", {L, C}},
          {"ln2w", {L, C}},         {"ln2b", {L, C}},        {"fcw", {L, 4 * C, C}},   {"fcb", {L, 4 * C}},
          {"fcprojw", {L, C, 4 * C}}, {"fcprojb", {L, C}}, {"lnfw", {C}},            {"lnfb", {C}}};
}

std::vector<LlmcTensor> llmc_tensors(const Transformer& model) {
  TALLY_CHECK(model.shard().whole(), "internal: the llm.c layout is the whole model's; this rank holds a shard");
  const TransformerConfig& c = model.config();
  const ParameterStore& params = model.params();
  // The kinds stacked over layers, by the suffix of their layers' parameter names.
  static const std::unordered_map<std::string, std::string> per_layer = {
      {"ln1w", "ln_1.weight"},         {"ln1b", "ln_1.bias"},         {"qkvw", "attn.c_attn.weight"},
      {"qkvb", "attn.c_attn.bias"},    {"attprojw", "attn.c_proj.weight"}, {"attprojb", "attn.c_proj.bias"},
      {"ln2w", "ln_2.weight"},         {"ln2b", "ln_2.bias"},         {"fcw", "mlp.c_fc.weight"},
      {"fcb", "mlp.c_fc.bias"},        {"fcw2", "mlp.c_fc2.weight"},  {"fcprojw", "mlp.c_proj.weight"},
      {"fcprojb", "mlp.c_proj.bias"},  {"qnormw", "attn.q_norm.weight"}, {"knormw", "attn.k_norm.weight"},
      {"routerw", "mlp.router.weight"}};
  // The experts' kinds, by the suffix of each expert's parameter names.
  static const std::unordered_map<std::string, std::string> per_expert = {
      {"expfcw", "c_fc.weight"}, {"expfcw2", "c_fc2.weight"}, {"expfcprojw", "c_proj.weight"}};
  static const std::unordered_map<std::string, std::string> whole = {
      {"wte", "wte"}, {"wpe", "wpe"}, {"lnfw", "ln_f.weight"}, {"lnfb", "ln_f.bias"}};
  std::vector<LlmcTensor> out;
  for (auto& [name, shape] : llmc_tensor_layout(c)) {
    LlmcTensor t{name, shape, {}, false};
    if (name == "lm_head") {
      t.params = {params.index_of(c.tie_embeddings ? "wte" : "lm_head")};
      t.vocab_rows = true;
    } else if (auto it = whole.find(name); it != whole.end()) {
      t.params = {params.index_of(it->second)};
      t.vocab_rows = name == "wte" && c.llama_architecture();
    } else if (auto ex = per_expert.find(name); ex != per_expert.end()) {
      for (int64_t l = 0; l < c.n_layer; ++l)
        for (int64_t e = 0; c.sparse_layer(l) && e < c.n_experts; ++e)
          t.params.push_back(params.index_of("h." + std::to_string(l) + ".mlp.experts." + std::to_string(e) + "." + ex->second));
    } else {
      // The MLP's kinds are the dense layers', the router the sparse layers'.
      const std::string& suffix = per_layer.at(name);
      const bool mlp = suffix.rfind("mlp.", 0) == 0;
      for (int64_t l = 0; l < c.n_layer; ++l)
        if (!mlp || c.sparse_layer(l) == (name == "routerw"))
          t.params.push_back(params.index_of("h." + std::to_string(l) + "." + suffix));
    }
    out.push_back(std::move(t));
  }
  return out;
}

namespace {
// Whether this shard's parameter `local` has the whole parameter's shape (replicated, or
// a split over one tensor-parallel rank): then it is filled in place.
bool holds_whole(const ParameterSpec& local, const ParameterSpec& whole) { return local.shape == whole.shape; }

// On the host, where the model is built (a dry run's model: on the meta device, which
// stands in for the host).
Tensor whole_scratch(const ParameterSpec& spec, Device model_device) {
  const Device host = model_device.is_meta() ? Device::meta(DeviceType::CPU) : Device::cpu();
  return Tensor::empty(spec.shape, DType::F32, host, make_owner(Category::Other, "model.whole_parameter"));
}
}  // namespace

void fill_whole_parameters(Transformer& model, const WholeParameterFill& fill) {
  autograd::NoGradGuard no_grad;
  ParameterStore& params = model.params();
  std::unordered_set<size_t> visited;  // a tied head's wte comes twice: the second time, passed over
  // The whole model's layout (a whole model's own, index for index) and the parameters this
  // model holds of it, by name: a whole model holds each whole, so it fills them in place.
  const Transformer whole = Transformer::layout_only(model.config());
  std::unordered_map<std::string, size_t> local;  // name -> this model's parameter
  for (size_t i = 0; i < params.size(); ++i) local.emplace(params.spec(i).name, i);
  // ZeRO-3: no parameter holds its values; each goes through the scratch to the residency.
  ParameterResidency* keeper = model.residency() && model.residency()->holds_values() ? model.residency() : nullptr;
  for (const LlmcTensor& t : llmc_tensors(whole)) {
    for (size_t w : t.params) {
      const ParameterSpec& spec = whole.params().spec(w);
      auto it = local.find(spec.name);
      if (it == local.end() || !visited.insert(w).second) {
        fill(t, w, spec, Tensor());  // another rank's, or visited already
        continue;
      }
      const size_t i = it->second;
      if (keeper) {
        const Tensor scratch = whole_scratch(spec, model.device());
        fill(t, w, spec, scratch);
        keeper->store(i, scratch);
        continue;
      }
      const Tensor param = params[i].detach();
      if (holds_whole(params.spec(i), spec)) {
        fill(t, w, spec, param);
      } else {
        const Tensor scratch = whole_scratch(spec, model.device());
        fill(t, w, spec, scratch);
        for (auto& [from, to] : model.shard_regions(i, scratch, param)) to.copy_(from);
      }
      params[i].storage().bump_version();
    }
  }
}

int64_t whole_parameter_scratch_bytes(const Transformer& model) {
  const Transformer whole = Transformer::layout_only(model.config());
  const ParameterStore& params = model.params();
  int64_t largest = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParameterSpec& spec = whole.params().spec(whole.params().index_of(params.spec(i).name));
    if (!holds_whole(params.spec(i), spec)) largest = std::max(largest, shape_numel(spec.shape) * 4);
  }
  return largest;
}

void load_shard_from(Transformer& model, const Transformer& full) {
  TALLY_CHECK(full.shard().whole(), "internal: load_shard_from needs the whole model");
  fill_whole_parameters(model, [&](const LlmcTensor&, size_t index, const ParameterSpec&, const Tensor& target) {
    if (target.defined()) target.copy_(full.params()[index].detach());
  });
}

}  // namespace tally::nn
