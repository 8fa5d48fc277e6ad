#include "train/plan.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "dist/pipeline.h"
#include "memory/report.h"

namespace tally::train {

// Parameters per unit in the block's order: the embeddings, each layer, the final norm
// (and an untied head) (nn/parameters.h).
//   GPT-2 layer: two norms (2C each), qkv (3C^2 + 3C), the attention projection (C^2 + C),
//     the MLP (4C^2 + 4C and 4C^2 + C): 12C^2 + 13C.
//   LLaMA layer: two RMSNorms (C each), qkv ((H D + 2 KV D) C), the attention projection
//     (C H D), gate, up and down (3 C F): no biases. Qwen2 adds the q/k/v biases
//     (H D + 2 KV D), Qwen3 the q and k norms (D each).
std::vector<int64_t> unit_numels(const nn::TransformerConfig& c) {
  const int64_t C = c.n_embd, Vp = c.padded_vocab_size;
  std::vector<int64_t> units;
  const int64_t token_table = checked_mul(Vp, C, "plan: wte");
  int64_t layer, sparse_layer = 0;
  if (c.llama_architecture()) {
    units.push_back(token_table);
    const int64_t extras = 2 * C + (c.has_qkv_bias() ? c.qkv_dim() : 0) + (c.has_qk_norm() ? 2 * c.head_dim() : 0);
    const int64_t attention = checked_add(checked_mul(c.qkv_dim() + c.q_dim(), C, "plan: attention"), extras, "plan: layer");
    layer = checked_add(attention, checked_product({3, C, c.ffn_dim()}, "plan: MLP"), "plan: layer");
    // Qwen3-MoE's sparse layers: the router (E C) and E experts (3 C Fe each) for the MLP.
    if (c.n_experts > 0)
      sparse_layer = checked_add(attention,
                                 checked_add(checked_mul(c.n_experts, C, "plan: router"),
                                             checked_product({c.n_experts, 3, C, c.moe_ffn_hidden}, "plan: experts"),
                                             "plan: layer"),
                                 "plan: layer");
  } else {
    units.push_back(checked_add(token_table, checked_mul(c.max_seq_len, C, "plan: wpe"), "plan: embeddings"));
    layer = checked_add(checked_product({12, C, C}, "plan: layer"), 13 * C, "plan: layer");
  }
  for (int64_t l = 0; l < c.n_layer; ++l) units.push_back(c.sparse_layer(l) ? sparse_layer : layer);
  units.push_back((c.llama_architecture() ? C : 2 * C) + (c.tie_embeddings ? 0 : token_table));
  return units;
}

int64_t parameter_count(const nn::TransformerConfig& c) {
  int64_t total = 0;
  for (int64_t n : unit_numels(c)) total = checked_add(total, n, "plan: parameters");
  return total;
}

namespace {

// "h.3.mlp:gelu" -> "mlp:gelu": one op's activations summed over the layers.
std::string op_of(const std::string& owner) {
  if (owner.rfind("h.", 0) != 0) return owner;
  const size_t dot = owner.find('.', 2);
  return dot == std::string::npos ? owner : owner.substr(dot + 1);
}

bool is_activation(Category c) {
  return c == Category::Activation || c == Category::SavedForBackward || c == Category::Workspace;
}

// Adds `bytes` under `name`, keeping the first-seen order; then largest first.
void add_part(memory::PlanParts& parts, const std::string& name, int64_t bytes) {
  auto it = std::find_if(parts.begin(), parts.end(), [&](const auto& p) { return p.first == name; });
  if (it == parts.end()) parts.emplace_back(name, bytes);
  else it->second += bytes;
}
void largest_first(memory::PlanParts& parts) {
  std::stable_sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
}

memory::PlanParts activations_by_op(const DryRun& run) {
  memory::PlanParts ops;
  if (const DryRunStep* peak = run.peak())
    for (const memory::OwnerBytes& o : peak->at_peak)
      if (is_activation(o.category)) add_part(ops, op_of(name_of(o.name)), o.bytes);
  largest_first(ops);
  return ops;
}

}  // namespace

memory::PlanParts peak_parts(const DryRunStep& peak) {
  memory::PlanParts kinds;
  for (const memory::OwnerBytes& o : peak.at_peak) add_part(kinds, memory_kind(o.category), o.bytes);
  largest_first(kinds);
  return kinds;
}

MemoryPlan plan_memory(const TrainConfig& c, const nn::TransformerConfig& model, int64_t world, bool validates) {
  const ParallelismConfig& p = c.parallel;
  TALLY_CHECK(world >= 1, "plan: --world must be at least 1, got ", world);
  const int64_t model_parallel = checked_product({p.tp, p.pp, p.cp}, "plan: --tp x --pp x --cp");
  TALLY_CHECK(world % model_parallel == 0, "--world ", world, " is not a multiple of --tp ", p.tp, " x --cp ", p.cp,
              " x --pp ", p.pp);
  check_layout(c, world);
  MemoryPlan plan;
  const TrainConfig planned = with_planned_microbatches(c);
  if (planned.batch.grad_accum < c.batch.grad_accum)
    plan.notes.push_back("each step planned with " + std::to_string(planned.batch.grad_accum) + " of its " +
                         std::to_string(c.batch.grad_accum) + " microbatches: from there on its peak repeats");
  for (int rank : dry_run_roles(c, world)) plan.dry_runs.push_back(dry_run(planned, model, validates, world, rank));
  const int64_t per_stage = world / p.pp;
  for (int64_t r = 0; r < world; ++r) {
    const DryRun& d = plan.dry_runs[static_cast<size_t>(r / per_stage)];
    plan.ranks.push_back({static_cast<int>(r), d.stage, d.peak() ? peak_parts(*d.peak()) : memory::PlanParts{},
                          d.peak_bytes(), d.setup_peak_bytes});
  }
  // The stage whose peak holds the most activations shows them.
  int64_t most = -1;
  for (const DryRun& d : plan.dry_runs) {
    memory::PlanParts ops = activations_by_op(d);
    int64_t total = 0;
    for (const auto& [op, bytes] : ops) total += bytes;
    if (total > most) most = total, plan.activations_by_op = std::move(ops), plan.activations_stage = d.stage;
  }
  return plan;
}

std::string plan_text(const MemoryPlan& plan, const TrainConfig& c, const nn::TransformerConfig& model, int64_t world) {
  const ParallelismConfig& p = c.parallel;
  std::string out = "plan: " + model.describe() + ", batch " + std::to_string(c.batch.batch_size) + " x " +
                    std::to_string(c.batch.seq_len) + ", grad-accum " + std::to_string(c.batch.grad_accum) + ", " +
                    std::to_string(world) + " rank(s)" +
                    (p.tp > 1 ? " (tp " + std::to_string(p.tp) + (p.sequence_parallel ? " with sp" : "") + ")" : "") +
                    (p.cp > 1 ? " (cp " + std::to_string(p.cp) + ")" : "") +
                    (p.ep > 1 ? " (ep " + std::to_string(p.ep) + ")" : "") +
                    (p.pp > 1 ? " (pp " + std::to_string(p.pp) + " " + dist::pipeline_schedule_name(p.pp_schedule) +
                                    (p.virtual_stages > 1 ? " x" + std::to_string(p.virtual_stages) : "") +
                                    (p.pp_last_stage_layers > 0
                                         ? ", " + std::to_string(p.pp_last_stage_layers) + " layer(s) on the last stage"
                                         : "") +
                                    ")"
                              : "") +
                    ", zero " + std::to_string(p.zero) + ", " + c.compute.device.str() +
                    (c.compute.dtype == DType::BF16 ? ", bf16 mixed precision" : "") +
                    (c.compute.chunked_loss ? ", chunked loss" : "") +
                    (c.compute.recompute == nn::Recompute::Selective ? ", selective recomputation"
                     : c.compute.recompute == nn::Recompute::Full    ? ", full recomputation"
                                                                     : "") +
                    "\n";
  // Each stage's plan once, with its ranks: "ranks 0-3 (pipeline stage 0)".
  const int64_t per_stage = world / p.pp;
  for (const DryRun& d : plan.dry_runs) {
    const int64_t first = static_cast<int64_t>(d.stage) * per_stage, last = first + per_stage - 1;
    out += per_stage > 1 ? "ranks " + std::to_string(first) + "-" + std::to_string(last) : "rank " + std::to_string(first);
    if (p.pp > 1) out += " (pipeline stage " + std::to_string(d.stage) + ")";
    out += ": predicted peak " + memory::format_bytes(d.peak_bytes()) + "\n";
    if (d.setup_peak_bytes > 0) out += "  set-up " + memory::format_bytes(d.setup_peak_bytes) + "\n";
    out += dry_run_text(d, world > 1);
  }
  for (const std::string& note : plan.notes) out += "note: " + note + "\n";
  out += p.pp > 1 ? "activations at pipeline stage " + std::to_string(plan.activations_stage) + "'s peak, by op over its layers:\n"
                  : "activations at the peak, by op over the layers:\n";
  for (const auto& [op, bytes] : plan.activations_by_op) out += "  " + memory::format_bytes(bytes) + "  " + op + "\n";
  return out;
}

std::string memory_kind(const std::string& part) {
  auto starts = [&](const char* prefix) { return part.rfind(prefix, 0) == 0; };
  if (starts("parameters")) return "parameters";
  if (starts("gradient")) return "gradients";  // the gradients and ZeRO's staging of them
  if (starts("optimizer")) return "optimizer state";
  if (starts("activations") || starts("transient") || starts("loss")) return "activations";
  if (starts("loader") || starts("data")) return "data";
  if (starts("gathered") || starts("all-gather") || starts("pipeline") || starts("communication"))
    return "communication";
  return "other";
}

std::string memory_kind(Category category) {
  switch (category) {
    case Category::Parameter: return "parameters";
    case Category::Gradient: return "gradients";
    case Category::OptimizerState: return "optimizer state";
    case Category::Activation:
    case Category::SavedForBackward:
    case Category::Workspace: return "activations";
    case Category::Data: return "data";
    case Category::Communication: return "communication";
    case Category::Other: return "other";
  }
  return "other";
}

std::string explain_peak(const memory::PlanParts& plan_parts,
                         const std::vector<memory::OwnerBytes>& at_peak) {
  std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> kinds;  // kind -> (planned, measured)
  auto slot = [&](const std::string& kind) -> std::pair<int64_t, int64_t>& {
    for (auto& [k, v] : kinds)
      if (k == kind) return v;
    kinds.push_back({kind, {0, 0}});
    return kinds.back().second;
  };
  for (const auto& [name, bytes] : plan_parts) slot(memory_kind(name)).first += bytes;
  for (const memory::OwnerBytes& o : at_peak) slot(memory_kind(o.category)).second += o.bytes;
  if (kinds.empty()) return "";
  auto off = [](const std::pair<int64_t, int64_t>& v) { return v.second - v.first; };
  const auto worst = std::max_element(kinds.begin(), kinds.end(), [&](const auto& a, const auto& b) {
    return std::llabs(off(a.second)) < std::llabs(off(b.second));
  });
  const int64_t delta = off(worst->second);
  const std::string& kind = worst->first;
  const bool plural = kind == "parameters" || kind == "gradients" || kind == "activations";
  std::string out = (kind == "other" ? std::string("other memory") : kind) + (plural ? " are " : " is ") +
                    memory::format_bytes(std::llabs(delta)) + (delta >= 0 ? " over" : " under") +
                    " the plan (" + memory::format_bytes(worst->second.second) + " against " +
                    memory::format_bytes(worst->second.first) + ")";
  for (const memory::OwnerBytes& o : at_peak)  // largest first
    if (memory_kind(o.category) == worst->first) {
      out += "; the largest at the peak: " + (o.name ? name_of(o.name) : std::string("(unnamed)")) + ", " +
             memory::format_bytes(o.bytes);
      break;
    }
  return out;
}

namespace {
nlohmann::json dry_run_json(const DryRun& dry_run) {
  nlohmann::json steps = nlohmann::json::array(), at_peak = nlohmann::json::object();
  for (const DryRunStep& s : dry_run.steps) steps.push_back(s.peak_bytes);
  const DryRunStep* peak = dry_run.peak();
  if (peak)
    for (const memory::OwnerBytes& o : peak->at_peak) at_peak[name_of(o.name)] = at_peak.value(name_of(o.name), int64_t{0}) + o.bytes;
  nlohmann::json out{{"rank", dry_run.rank},     {"stage", dry_run.stage},        {"step_peak_bytes", steps},
                     {"peak_bytes", dry_run.peak_bytes()}, {"at_peak", at_peak}};
  if (!dry_run.bound.empty()) out["bound"] = dry_run.bound;
  if (dry_run.validation.peak_bytes > 0) out["validation_peak_bytes"] = dry_run.validation.peak_bytes;
  if (peak) {
    const OwnerTag& o = peak->moment.owner;
    out["moment"] = {{"step", o.step}, {"phase", peak->moment.phase}, {"microbatch", o.microbatch},
                     {"allocation", o.name_str()}, {"category", category_name(o.category)}};
  }
  return out;
}
}  // namespace

std::string plan_json(const MemoryPlan& plan) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankPlan& r : plan.ranks) {
    nlohmann::json parts = nlohmann::json::object();
    for (const auto& [name, bytes] : r.parts) parts[name] = bytes;
    ranks.push_back(
        {{"rank", r.rank}, {"stage", r.stage}, {"predicted_peak_bytes", r.predicted_peak_bytes},
         {"setup_bytes", r.setup_bytes}, {"parts", parts}});
  }
  nlohmann::json activations = nlohmann::json::object();
  for (const auto& [op, bytes] : plan.activations_by_op) activations[op] = bytes;
  nlohmann::json out{{"ranks", ranks}, {"activations", activations}, {"notes", plan.notes}};
  // "dry_run": rank 0's; "dry_runs": one per pipeline stage (its first rank).
  out["dry_run"] = dry_run_json(plan.dry_runs.front());
  if (plan.dry_runs.size() > 1) {
    nlohmann::json all = nlohmann::json::array();
    for (const DryRun& d : plan.dry_runs) all.push_back(dry_run_json(d));
    out["dry_runs"] = all;
  }
  return out.dump(2);
}

}  // namespace tally::train
