#include "train/plan.h"

#include <algorithm>
#include <initializer_list>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "dist/pipeline.h"
#include "memory/report.h"
#include "nn/llmc_layout.h"
#include "runtime/backend.h"
#include "train/dry_run.h"

namespace tally::train {

namespace {

constexpr int64_t kFloat = 4;
constexpr const char* kBf16CopyPart = "parameters' bf16 copy (mixed precision)";

}  // namespace

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

// A shard's units (parameters.h) as the model's own layout declares them (nothing allocated).
std::vector<int64_t> shard_unit_numels(const nn::TransformerConfig& c, const nn::ModelShard& shard) {
  const nn::Transformer layout = nn::Transformer::layout_only(c, shard);
  std::vector<int64_t> units;
  for (size_t u = 0; u < layout.params().num_units(); ++u) units.push_back(layout.params().unit(u).numel());
  return units;
}

// Parameters of a set of units, and as ZeRO shards them over D ranks: each unit padded to D
// equal pieces; this rank's pieces together, and the largest piece of a unit that D does
// not divide (ZeRO-1/2 gather such a unit through a send piece and a receive buffer; the
// others in place).
struct UnitSizes {
  int64_t params = 0, pieces = 0, largest_padded_piece = 0;
};
UnitSizes unit_sizes(const std::vector<int64_t>& units, int64_t D) {
  UnitSizes s;
  for (int64_t n : units) {
    s.params = checked_add(s.params, n, "plan: parameters");
    s.pieces += (n + D - 1) / D;
    if (n % D != 0) s.largest_padded_piece = std::max(s.largest_padded_piece, (n + D - 1) / D);
  }
  return s;
}

}  // namespace

namespace {
MemoryPlan plan_steps(const PlanInput& in);
}  // namespace

// The steps' plan, and set-up's under tensor and pipeline parallelism: each rank builds
// its shard's parameters and gradients (8 P_rank bytes), then reads or draws the whole
// model's parameters one at a time, holding a whole-shaped scratch tensor for each one it
// keeps only a slice of (nn::fill_whole_parameters): 8 P_rank + the largest such
// parameter, whatever the source (the seed, an llm.c file, HuggingFace files: those read
// one tensor at a time, each a piece of a parameter, into the scratch or the parameter).
MemoryPlan plan_memory(const PlanInput& in) {
  MemoryPlan plan = plan_steps(in);
  if (in.cp > 1)
    plan.notes.push_back("context parallel: the formulas plan each of the --cp " + std::to_string(in.cp) +
                         " ranks' activations as if it held whole sequences of " + std::to_string(in.seq_len) +
                         " tokens; it holds " + std::to_string(in.seq_len / in.cp) +
                         " of each and the whole sequences' keys and values");
  const int64_t rotary = in.model.llama_architecture() ? in.model.head_dim() / 2 * 4 : 0;  // LLaMA's constant, alive throughout
  if (in.zero >= 2) {
    // ZeRO-2/3 (data parallel only). ZeRO-2 builds the model's parameter block without a
    // gradient block (4P) and reads the weights into it, then allocates the rank's moment
    // and gradient shards: 4P + 12 bytes a padded piece. ZeRO-3 allocates its shards of
    // all four (16 bytes a padded piece) and nothing whole, then reads or draws the weights
    // one whole parameter at a time into a scratch and keeps its pieces of it: 16 bytes a
    // padded piece + the largest parameter.
    const UnitSizes sizes = unit_sizes(unit_numels(in.model), in.world);
    int64_t largest_parameter = 0;
    if (in.zero == 3) {
      const nn::Transformer layout = nn::Transformer::layout_only(in.model);
      for (size_t i = 0; i < layout.params().size(); ++i)
        largest_parameter = std::max(largest_parameter, shape_numel(layout.params().spec(i).shape) * 4);
    }
    const int64_t model = in.zero == 3 ? largest_parameter : checked_mul(sizes.params, 4, "plan: set-up");
    const int64_t setup =
        checked_add(model, checked_mul(sizes.pieces, in.zero == 3 ? 16 : 12, "plan: set-up") + rotary, "plan: set-up");
    for (RankPlan& r : plan.ranks) r.setup_bytes = setup;
    if (setup > plan.ranks[0].predicted_peak_bytes)
      plan.notes.push_back("set-up: " +
                           (in.zero == 3 ? "ZeRO-3 reads the weights into its shards one whole parameter at a time (the "
                                           "largest: " + memory::format_bytes(largest_parameter) + ")"
                                         : "ZeRO-2 builds the parameter block (" + memory::format_bytes(4 * sizes.params) +
                                               ") and its shards beside it") +
                           ": " + memory::format_bytes(setup) + " at once, above the step peak of " +
                           memory::format_bytes(plan.ranks[0].predicted_peak_bytes) +
                           "; each rank needs that much free at start-up");
    return plan;
  }
  if (in.tp * in.pp == 1) return plan;
  int64_t worst = 0, worst_step = 0;
  for (RankPlan& r : plan.ranks) {
    int64_t shard = 0;  // this rank's parameters and gradients
    for (const auto& [name, bytes] : r.parts)  // fp32 blocks (the bf16 copy comes after set-up)
      if ((name.rfind("parameters", 0) == 0 && name != kBf16CopyPart) || name.rfind("gradients", 0) == 0) shard += bytes;
    const nn::ModelShard layout = dist::pipeline_shard(in.model.n_layer, in.pp, r.stage, in.virtual_stages, in.tp, 0,
                                                       in.pp_last_stage_layers);
    const int64_t scratch = nn::whole_parameter_scratch_bytes(nn::Transformer::layout_only(in.model, layout));
    r.setup_bytes = checked_add(shard, scratch + rotary, "plan: set-up");
    if (r.setup_bytes - r.predicted_peak_bytes > worst - worst_step) worst = r.setup_bytes, worst_step = r.predicted_peak_bytes;
  }
  if (worst > worst_step)
    plan.notes.push_back("set-up: building a rank's shard holds its parameters and gradients and one whole parameter "
                         "it keeps a slice of: " + memory::format_bytes(worst) +
                         " on the rank that needs most, above its step peak of " + memory::format_bytes(worst_step) +
                         "; each rank needs that much free at start-up");
  return plan;
}

PlanInput plan_input(const TrainConfig& c, const nn::TransformerConfig& model, int64_t world, bool validates) {
  PlanInput in;
  in.model = model;
  in.batch_size = c.batch.batch_size;
  in.seq_len = c.batch.seq_len;
  in.grad_accum = c.batch.grad_accum;
  in.world = static_cast<int>(world);
  in.tp = c.parallel.tp;
  in.sequence_parallel = c.parallel.sequence_parallel;
  in.pp = c.parallel.pp;
  in.pp_schedule = c.parallel.pp_schedule;
  in.virtual_stages = c.parallel.virtual_stages;
  in.pp_last_stage_layers = c.parallel.pp_last_stage_layers;
  in.zero = c.parallel.zero;
  in.val_loader = validates;
  in.bf16 = c.compute.dtype == DType::BF16;
  in.device = c.compute.device;  // (the plan counts what the device changes: the GEMM library's workspace, the loader)
  in.loss_chunk_rows = c.compute.chunked_loss ? nn::Transformer::default_loss_chunk_rows(model.padded_vocab_size) : 0;
  in.recompute = c.compute.recompute;
  in.cp = c.parallel.cp;
  return in;
}

namespace {
// The microbatches of a step the plan walks the schedule's actions for. 1F1B and
// interleaved 1F1B are periodic once warm: every stage holds at most P*V microbatch chunks,
// each steady round repeats the one before, and a chunk's accumulators and gradients are
// in their lasting state after its first backward. So a step of N is planned as one of
// min(N, 4*P*V) (a multiple of P, as interleaving needs): warm-up, several steady rounds
// and the cool-down, the moments every longer step has. GPipe holds all N at once, so it
// walks all of them, up to a bound past which the walk itself would be the memory hog.
int64_t walked_microbatches(dist::PipelineSchedule schedule, int64_t stages, int virtual_stages,
                            int64_t microbatches) {
  constexpr int64_t kMostGpipeMicrobatches = int64_t{1} << 20;
  if (schedule == dist::PipelineSchedule::GPipe) {
    TALLY_CHECK(microbatches <= kMostGpipeMicrobatches, "plan: --pp-schedule gpipe holds all ", microbatches,
                " microbatches of a step in flight (--grad-accum); the plan walks each, up to ", kMostGpipeMicrobatches,
                " (1f1b and interleaved hold at most --pp x --virtual-stages and plan any number)");
    return microbatches;
  }
  return std::min(microbatches, 4 * stages * virtual_stages);
}

MemoryPlan plan_steps(const PlanInput& in) {
  const auto& c = in.model;
  c.validate();
  TALLY_CHECK(in.world >= 1, "plan: --world must be at least 1, got ", in.world);
  TALLY_CHECK(in.tp >= 1 && in.pp >= 1 && in.world % checked_mul(in.tp, in.pp, "plan: --tp x --pp") == 0, "plan: --world ", in.world,
              " is not a multiple of --tp ", in.tp, " x --pp ", in.pp);
  check_layout_flags({in.world, in.tp, in.pp, in.sequence_parallel, in.seq_len, in.zero, in.bf16, in.loss_chunk_rows > 0,
                      in.device, in.cp});
  const int64_t TP = in.tp;
  // D: the data-parallel ranks, over which ZeRO shards and the loss is averaged.
  const int64_t PP = in.pp;
  const dist::PipelineSchedule schedule = in.pp_schedule;
  // As tally train checks them (a flag that needs --pp > 1 without it, too).
  dist::check_pipeline(schedule, static_cast<int>(PP), in.virtual_stages, in.grad_accum, c.n_layer,
                       in.pp_last_stage_layers);
  const int64_t D = in.world / (TP * PP), B = in.batch_size, T = in.seq_len, C = c.n_embd, H = c.n_head, L = c.n_layer;
  const int64_t Vp = c.padded_vocab_size;
  const int64_t BT = checked_mul(B, T, "plan: --batch-size x --seq-len");
  // Rows of what sequence parallelism shards (norms, residuals): B*T/tp with --sp.
  const int64_t sp_rows = in.sequence_parallel ? BT / TP : BT;

  // A tensor-parallel rank's units are its shard's (every rank's alike: each split divides).
  nn::ModelShard tp_shard;
  tp_shard.tp = static_cast<int>(TP);
  const std::vector<int64_t> units = TP == 1 ? unit_numels(c) : shard_unit_numels(c, tp_shard);
  const UnitSizes sizes = unit_sizes(units, D);
  const int64_t P = sizes.params, piece_total = sizes.pieces;
  // A whole unit as ZeRO stages and gathers it: D pieces, padding included.
  auto padded = [&](size_t u) { return D * ((units[u] + D - 1) / D) * kFloat; };
  const size_t embed = 0, last_layer = units.size() - 2, final_norm = units.size() - 1;

  MemoryPlan plan;
  const bool bf16 = in.bf16;
  const bool selective = in.recompute == nn::Recompute::Selective, full = in.recompute == nn::Recompute::Full;
  // What one layer saves for backward, by kind: elements per token and bytes per element
  // (4, or 2 for what mixed precision keeps in bf16). A projection's saved input, and
  // attention's q, k, v: fp32, or bf16 copies under mixed precision (the MLP's hidden
  // layer and the attention output are bf16 themselves there, saved as they are).
  // Under tensor parallelism a column-parallel projection's outputs (q, k, v, the MLP's
  // hidden) and what follows from them (the attention output, its log-sum-exp) are this
  // rank's heads' or columns' share, 1/tp; its input (a norm's output) is whole, and under
  // sequence parallelism it is the all-gathered copy the projection saves, while the norms
  // and the residual stream hold B*T/tp rows.
  struct Kind {
    std::string name;
    int64_t rows, columns, bytes;  // columns per row, bytes per element
  };
  std::vector<Kind> layer;
  const int64_t proj_bytes = bf16 ? 2 : kFloat;
  // Bytes per value of the MLP's hidden activations (GPT-2's pre- and post-GELU, LLaMA's
  // gate, up and SwiGLU output) and their gradients: bf16 under bf16 (the projections
  // write them rounded).
  const int64_t hidden_bytes = bf16 ? 2 : kFloat;
  const char* proj = bf16 ? " (bf16 copies the projections keep)" : "";
  const std::string gathered = in.sequence_parallel ? " (all-gathered over the sequence)" : "";
  layer.push_back({"residual stream (x, x + attention)", sp_rows, 2 * C, kFloat});
  // The attention's output (bf16 under mixed precision), which the attention and the
  // output projection both save (so selective recomputation keeps it too), and its
  // log-sum-exp, which selective recomputation makes again in backward.
  auto attention_outputs = [&] {
    layer.push_back({bf16 ? "attention output (bf16)" : "attention output", BT, c.q_dim() / TP, proj_bytes});
    if (!selective) layer.push_back({"attention log-sum-exp", BT, H / TP, kFloat});
  };
  if (c.llama_architecture()) {
    // q and k leave rotary as new tensors and v is copied out of the fused projection (in
    // fp32, or by the bf16 attention's rounding), so the (B,T,C+2KV*D) projection itself
    // is freed within the layer.
    const int64_t KVD = c.kv_dim(), F = c.ffn_dim();
    // bf16: the second output feeds gate and up, and each keeps its own copy.
    layer.push_back({std::string("RMSNorm outputs") + proj + gathered, BT, (bf16 ? 3 : 2) * C, proj_bytes});
    layer.push_back({"RMSNorm rstd", sp_rows, 2, kFloat});
    layer.push_back({std::string("q and k after rotary, v") + (bf16 ? " (attention's bf16 copies)" : ""), BT,
                     (c.q_dim() + 2 * KVD) / TP, proj_bytes});
    if (c.has_qk_norm()) {
      layer.push_back({"q and k before their norms", BT, (c.q_dim() + KVD) / TP, kFloat});
      layer.push_back({"q and k norms' rstd", BT, (c.n_head + c.n_kv_head) / TP, kFloat});
    }
    attention_outputs();
    layer.push_back({std::string("MLP gate and up") + (bf16 ? " (bf16)" : ""), BT, 2 * F / TP, hidden_bytes});
    layer.push_back({std::string("MLP SwiGLU output") + (bf16 ? " (bf16)" : ""), BT, F / TP, hidden_bytes});
  } else {
    layer.push_back({std::string("layernorm outputs") + proj + gathered, BT, 2 * C, proj_bytes});
    layer.push_back({"layernorm mean and rstd", sp_rows, 4, kFloat});
    layer.push_back({std::string("q, k, v") + (bf16 ? " (attention's bf16 copies)" : ""), BT, 3 * C / TP, proj_bytes});
    attention_outputs();
    // Under bf16 the hidden layer is bf16 end to end (the projection writes it rounded),
    // so GELU saves a bf16 input and the output projection its bf16 input as it is.
    layer.push_back({std::string("MLP pre-GELU") + (bf16 ? " (bf16)" : ""), BT, 4 * C / TP, hidden_bytes});
    layer.push_back({std::string("MLP post-GELU") + (bf16 ? " (bf16)" : ""), BT, 4 * C / TP, hidden_bytes});
  }
  // Their sizes grow with the flags: an overflow names the flags (--batch-size, --seq-len),
  // not only the product that overflows.
  const std::string activations_context = "plan: the activations of --batch-size " + std::to_string(B) + " x --seq-len " +
                                   std::to_string(T) + " tokens a microbatch";
  int64_t layer_bytes = 0;  // one layer's saved activations of one microbatch
  for (const Kind& k : layer)
    layer_bytes = checked_add(layer_bytes, checked_product({k.rows, k.columns, k.bytes}, activations_context), activations_context);

  // Activations of one microbatch, by kind over all layers.
  auto act = [&](const std::string& kind, int64_t rows, int64_t columns, int64_t bytes = kFloat) {
    plan.activations_by_kind.emplace_back(kind, checked_product({rows, columns, bytes}, activations_context));
  };
  if (full) {
    act("layer inputs (kept by --recompute full)", sp_rows, C * L);
  } else {
    for (const Kind& k : layer) act(k.name, k.rows, checked_mul(k.columns, L, activations_context), k.bytes);
  }
  act("head: last residual", sp_rows, C);
  act(std::string("head: final norm output") + proj + gathered, BT, C, proj_bytes);
  act(c.llama_architecture() ? "head: final RMSNorm rstd" : "head: final norm mean and rstd", sp_rows, c.llama_architecture() ? 1 : 2);
  const int64_t chunk = std::min(in.loss_chunk_rows, BT);
  // Under bf16 the head writes bf16 logits (as autocast's linear does), and their gradient
  // is bf16 too: the GEMMs' operand, with no rounded copy.
  const int64_t logit = bf16 ? 2 : kFloat;
  if (chunk == 0) act(TP > 1 ? "head: logits (this rank's vocabulary block)" : "head: logits", BT, Vp / TP, logit);
  // The vocabulary-parallel loss keeps its log-sum-exp in fp64 (two floats a row).
  act("head: cross-entropy log-sum-exp", BT, TP > 1 ? 2 : 1);
  int64_t activations = 0, head_activations = 0;
  for (const auto& [kind, bytes] : plan.activations_by_kind) {
    activations = checked_add(activations, bytes, "plan");
    if (kind.rfind("head:", 0) == 0) head_activations += bytes;
  }
  // Other candidate moments (the plan takes the largest; each is checked to the byte in
  // tests/test_plan.cc and tests/test_parallel.cc where the test models make it the peak):
  //
  // The last layer's MLP backward, after the head's activations are freed: the residual's
  // gradient (C, B*T/tp rows under --sp) is live, and then either
  //  - the activation's backward: the MLP output's input (post-GELU or SwiGLU output, W
  //    wide: 4C or F, 1/tp under tensor parallelism) is freed, its gradient (W values)
  //    allocated, and the gradients of the activation's inputs: GPT-2's d(pre-GELU) (W),
  //    LLaMA's dgate and dup (2W); under bf16 the hidden layer and its gradients are bf16
  //    (2 bytes, not 4);
  //  - or the moment before, the output projection's backward: its input still saved
  //    beside its new gradient (W values), with under --sp the residual's gradient
  //    all-gathered (B*T x C floats), and then either (bf16) the residual's gradient
  //    rounded for the GEMMs (B*T x C bf16) or, after them, in one process GPT-2's bias
  //    gradient (C floats, not per token) summed before it is added into its buffer:
  //    only when that buffer already holds a gradient (an earlier backward of the step
  //    wrote it). A step's first backward sums it straight into the discarded gradient,
  //    as every backward does under ZeRO-2 and -3, whose staging starts each microbatch
  //    discarded.
  // It wins when the vocabulary is small and the MLP wide. Under full recomputation the
  // last layer's activations are live again (recomputed), and so is the region's
  // recomputed output (C), which its inner backward starts from; its input is one of the
  // layers' inputs already counted, so the layer adds exactly its own saved set.
  // Sums of terms, each already an overflow-checked product.
  auto sum = [](std::initializer_list<int64_t> terms) {
    int64_t total = 0;
    for (int64_t t : terms) total = checked_add(total, t, "plan");
    return total;
  };
  auto bytes_of = [](int64_t rows, int64_t columns, int64_t per_element) {
    return checked_product({rows, columns, per_element}, "plan");
  };
  const int64_t mlp_width = c.llama_architecture() ? c.ffn_dim() / TP : 4 * C / TP;
  // GPT-2's output-projection bias gradient (C floats): in one process the projection sums
  // it itself, beside its input's gradient. Tensor parallel, the bias is added after the
  // all-reduce and its gradient summed by the add's backward, then handed to the bias's
  // accumulator, which the engine runs in sequence order: a fresh one (made by this
  // microbatch's forward) right away, one an earlier microbatch's graph still holds (a
  // pipeline stage with microbatches in flight) only after the rest of the chunk, so
  // there the sum stays live (C floats more; not under full recomputation, whose
  // recomputed graph makes its own).
  const int64_t tp_bias_gradient = TP > 1 && !c.llama_architecture() && !full ? C * kFloat : 0;
  const int64_t activation_backward = sum({bytes_of(BT, mlp_width, hidden_bytes - proj_bytes),
                                           bytes_of(BT, (c.llama_architecture() ? 2 : 1) * mlp_width, hidden_bytes)});
  // `gradients_written`: the backward's parameter gradients already hold a sum (see above).
  auto mlp_backward = [&](bool gradients_written) {
    const int64_t bias_gradient_sum = TP == 1 && !c.llama_architecture() && gradients_written && in.zero < 2 ? C * kFloat : 0;
    const int64_t projection_backward = sum({in.sequence_parallel ? bytes_of(BT, C, kFloat) : 0,
                                             bytes_of(BT, mlp_width, hidden_bytes),
                                             std::max(bf16 ? bytes_of(BT, C, 2) : 0, bias_gradient_sum)});
    return sum({bytes_of(sp_rows, C, kFloat), std::max(activation_backward, projection_backward)});
  };
  const int64_t recomputed_layer = full ? layer_bytes : 0;
  // The last layer's MLP output projection in forward, before the head runs: its output
  // and the sum that makes it. One process: the projection's output and the residual sum
  // (2C). Tensor parallel: the partial product and its all-reduce (2C), and GPT-2's bias
  // added to it (C more); under --sp the partial product, the reduce-scatter's buffer (2C)
  // and its output (C, B*T/tp rows). Under bf16 also the fp32 norm output (C, all-gathered
  // under --sp), which the projections keep only as bf16 copies (the MLP's hidden layer is
  // bf16 and saved as it is).
  const int64_t row_parallel = in.sequence_parallel      ? sum({bytes_of(BT, 2 * C, kFloat), bytes_of(sp_rows, C, kFloat)})
                               : TP > 1 && !c.llama_architecture() ? bytes_of(BT, 3 * C, kFloat)
                                                         : bytes_of(BT, 2 * C, kFloat);
  const int64_t mlp_forward = sum({row_parallel, bf16 ? bytes_of(BT, C, kFloat) : 0});
  // Tensor parallel, after the loss's backward: its saved logits and log-sum-exp are freed
  // and the head's projection writes its input's gradient (B*T x C floats) beside the
  // logits' gradient (bf16 under bf16, as the logits); then its saved input is
  // freed and the input's gradient is summed over the tensor-parallel ranks (all-reduced
  // into a new tensor, or under --sp reduce-scattered through a buffer).
  const int64_t logits_bytes = chunk == 0 ? bytes_of(BT, Vp / TP, logit) : 0;
  const int64_t loss_lse_bytes = bytes_of(BT, TP > 1 ? 2 : 1, kFloat);
  const int64_t head_input_grad = bytes_of(BT, C, kFloat);
  const int64_t head_backward = sum({logits_bytes, head_input_grad});
  const int64_t head_input_sum = sum({head_input_grad, head_input_grad, in.sequence_parallel ? bytes_of(sp_rows, C, kFloat) : 0});
  const int64_t final_norm_output = bytes_of(BT, C, proj_bytes);

  // What the device changes: the GEMM library's workspace, and whether the validation
  // loader's host buffers are in the planned ledger.
  const bool on_cpu = in.device.is_cpu();
  const int64_t library_workspace = runtime::library_workspace_bytes(on_cpu ? DeviceType::CPU : DeviceType::CUDA);
  const int64_t loader = (in.val_loader && on_cpu ? 2 : 1) * 2 * BT * kFloat;
  // A GPU's step copies each microbatch's tokens to the device; the loss's backward frees
  // the targets' copy, so backward's moments hold the inputs alone.
  const int64_t targets_freed = on_cpu ? 0 : BT * kFloat;
  // At the peak (the start of backward): dL/d(final norm output) is allocated while the
  // cross-entropy's log-sum-exp has been freed (the logits' gradient took the logits'
  // place). The chunked loss holds one chunk of logits, then of their gradient, in place.
  // Tensor parallel: the vocabulary-parallel loss's backward writes the logits' gradient
  // beside the saved logits (not in their place), holding the loss's incoming gradient and
  // its value read as a double: that moment, before the head's projection runs backward,
  // is the peak.
  // The loss's forward (one process, or a pipeline's head stage): beside every activation
  // of the microbatch, the per-row losses (B*T floats), under bf16 the final norm's fp32
  // output (the head still holds it; its projection keeps a bf16 copy), and then either
  // the mean (the loss, one float) beside the logits, or the chunked loss's last chunk of
  // logits. Under bf16, whose logits take half of fp32's bytes, it is the peak
  // (docs/memory-plan.md).
  const int64_t loss_forward = sum({bf16 ? bytes_of(BT, C, kFloat) : 0, chunk > 0 ? bytes_of(chunk, Vp, logit) : 0,
                                    bytes_of(BT, 1, kFloat), chunk > 0 ? 0 : kFloat});
  // The vocabulary-parallel loss's forward: beside every activation (its log-sum-exp among
  // them), its row statistics (the maximum and two sums a row, fp64), under bf16 the final
  // norm's fp32 output (all-gathered under --sp), which the head holds while its
  // projection keeps a bf16 copy, and then the loss. Its backward, the logits' gradient
  // beside the logits, is larger unless the vocabulary block is narrow (bf16: Vp/tp < 2C +
  // 12, as in the test models).
  const int64_t vocab_loss_forward = sum({bf16 ? bytes_of(BT, C, kFloat) : 0, bytes_of(BT, 3, 8), kFloat});
  const int64_t transient = TP > 1      ? sum({bytes_of(BT, Vp / TP, logit), kFloat, 8})
                            : chunk > 0 ? sum({bytes_of(BT, C, kFloat), bytes_of(chunk, Vp, logit), kFloat})
                                        : bytes_of(BT, C, kFloat) - BT * kFloat;

  // The pipeline: every stage walks its schedule's actions (dist::pipeline_actions) and
  // the plan follows what is live at each: the model states of its shard; every
  // microbatch in flight on it (forward run, backward not yet): its chunk's saved
  // activations, on the embedding's chunk its tokens (B*T int32, its own copy), on other
  // chunks but the head's the output kept for the gradient that comes back (B*T'*C), on the
  // head's the loss and the targets its loss saved; the receive posted for the next action
  // (B*T'*C, an activation or a gradient); in a backward the gradient received for it; the
  // last gradient sent back (once a stage has sent one it holds one: each send replaces the
  // previous); and the action's own transient: in a forward the tokens and targets the
  // loader copied for it and the last layer's MLP output projection (on the head's chunk
  // also the loss's forward), in a backward the
  // moments above (the head's, the MLP's). The peak is the largest over the actions, and
  // over the step's end: the tied embedding's gradient exchanged between the first and last
  // stage in 1M-element pieces, and ZeRO-1's all-gather. The D x tp ranks of a stage
  // share its plan.
  if (PP > 1) {
    const int64_t boundary = bytes_of(sp_rows, C, kFloat);  // an activation or gradient between stages
    const int64_t tokens = bytes_of(BT, 1, 4);                 // a microbatch's int32 token copy
    auto stage_plan = [&](int stage) {
      const nn::ModelShard shard = dist::pipeline_shard(c.n_layer, static_cast<int>(PP), stage, in.virtual_stages,
                                                        static_cast<int>(TP), 0, in.pp_last_stage_layers);
      const UnitSizes stage_sizes = unit_sizes(shard_unit_numels(c, shard), D);
      const int64_t Ps = stage_sizes.params;
      std::vector<std::pair<std::string, int64_t>> states = {
          {"parameters (this stage's)", bytes_of(Ps, 1, kFloat)},
          {"gradients", bytes_of(Ps, 1, kFloat)},
          {in.zero == 1 ? "optimizer state (AdamW m, v: this rank's pieces)" : "optimizer state (AdamW m, v)",
           bytes_of(in.zero == 1 ? stage_sizes.pieces : Ps, 2, kFloat)},
          {"loader buffers", loader}};
      if (bf16) states.emplace_back(kBf16CopyPart, bytes_of(Ps, 1, 2));
      if (c.llama_architecture()) states.emplace_back("model constants (rotary frequencies)", c.head_dim() / 2 * kFloat);
      int64_t fixed = 0;
      for (const auto& [name, b] : states) fixed = checked_add(fixed, b, "plan");

      // One microbatch's saved bytes on chunk k.
      auto chunk_bytes = [&](const nn::ModelShard::Chunk& ch) {
        const int64_t n = ch.end_layer - ch.first_layer;
        return sum({full ? bytes_of(sp_rows, n * C, kFloat) : checked_mul(n, layer_bytes, "plan"),
                    ch.embed ? tokens : 0, ch.head ? sum({head_activations, kFloat, tokens}) : boundary});
      };
      auto receives = [&](const dist::PipelineAction& a) {
        const nn::ModelShard::Chunk& ch = shard.chunks[static_cast<size_t>(a.chunk)];
        return a.forward ? !ch.embed : !ch.head;
      };
      const std::vector<dist::PipelineAction> actions = dist::pipeline_actions(
          schedule, static_cast<int>(PP), stage, walked_microbatches(schedule, PP, in.virtual_stages, in.grad_accum),
          in.virtual_stages);
      // (microbatch, chunk) -> its saved bytes, and whether another microbatch of the same
      // chunk was in flight when its forward ran (then its parameters' accumulators are
      // older than its graph).
      struct InFlight {
        int64_t saved = 0;
        bool older_graph = false;
      };
      std::map<std::pair<int64_t, int>, InFlight> in_flight;
      std::set<int> chunks_backward;  // the chunks whose backward ran: their gradients hold a sum
      int64_t held = 0, gradient_send = 0, best = 0;
      std::vector<std::pair<std::string, int64_t>> best_parts;
      // A moment: what is in flight less what this action has freed by then, the receive
      // posted for the next action (an activation, or a gradient), the gradients received
      // and sent, and the action's transient.
      struct Buffers {
        int64_t activation = 0, gradients = 0;
      };
      auto consider = [&](Buffers buffers, int64_t freed, int64_t transient_bytes, const std::string& moment,
                          bool communication = false) {
        const int64_t at = sum({fixed, held - freed, buffers.activation, buffers.gradients, transient_bytes});
        if (at <= best) return;
        best = at;
        best_parts.clear();
        if (held - freed > 0)
          best_parts.emplace_back("activations (" + std::to_string(in_flight.size()) + " microbatch chunk(s) in flight)",
                                  held - freed);
        if (buffers.activation > 0) best_parts.emplace_back("activations (the receive posted for the next forward)", buffers.activation);
        if (buffers.gradients > 0)
          best_parts.emplace_back("pipeline gradient buffers (received, posted, sent back)", buffers.gradients);
        best_parts.emplace_back((communication ? "communication at the peak (" : "transient at the peak (") + moment + ")",
                                transient_bytes);
      };
      for (size_t i = 0; i < actions.size(); ++i) {
        const dist::PipelineAction& a = actions[i];
        const nn::ModelShard::Chunk& ch = shard.chunks[static_cast<size_t>(a.chunk)];
        const int64_t n = ch.end_layer - ch.first_layer;
        Buffers buffers{0, gradient_send};
        if (i + 1 < actions.size() && receives(actions[i + 1]))
          (actions[i + 1].forward ? buffers.activation : buffers.gradients) += boundary;
        if (a.forward) {
          // The last layer's MLP output projection, the chunk's layers saved so far, and the
          // loader's two copies (the embedding's chunk saves its tokens, counted here).
          if (!full)
            consider(buffers, 0, sum({checked_mul(n, layer_bytes, "plan"), 2 * tokens, mlp_forward}),
                     "a forward: the last layer's MLP output projection");
          // The head's chunk: the loss's forward (above), beside the chunk's layers.
          if (ch.head)
            consider(buffers, 0,
                     sum({full ? bytes_of(sp_rows, n * C, kFloat) : checked_mul(n, layer_bytes, "plan"), head_activations,
                          2 * tokens, TP > 1 ? vocab_loss_forward : loss_forward}),
                     "a forward: the loss");
          const int64_t saved = chunk_bytes(ch);
          bool older = false;
          for (const auto& [key, f] : in_flight) older = older || key.second == a.chunk;
          in_flight[{a.microbatch, a.chunk}] = {saved, older};
          held = checked_add(held, saved, "plan");
          continue;
        }
        const auto it = in_flight.find({a.microbatch, a.chunk});
        TALLY_CHECK(it != in_flight.end(), "internal: plan: a backward before its forward");
        if (!ch.head) buffers.gradients += boundary;  // the gradient received for this backward
        // The head's saved tensors, its loss and the targets its loss saved (the
        // microbatch's own copy; one process reads the loader's).
        const int64_t this_head = ch.head ? sum({head_activations, kFloat, tokens}) : 0;
        if (ch.head) {
          // The plain loss's backward has freed its targets with its log-sum-exp; the
          // vocabulary-parallel and the chunked loss free them after it.
          consider(buffers, TP > 1 || chunk > 0 ? 0 : tokens, transient, "the head's backward");
          if (TP > 1) {
            consider(buffers, logits_bytes + loss_lse_bytes + tokens, head_backward, "the head's projection backward");
            consider(buffers, logits_bytes + loss_lse_bytes + tokens + final_norm_output, head_input_sum,
                     "the head input's gradient summed over the tensor-parallel ranks");
          }
        }
        // The last layer's MLP backward. The residual's gradient is the received one on
        // chunks without the head; the head's saved tensors are freed by then, but for its
        // loss scalar.
        const int64_t x = bytes_of(sp_rows, C, kFloat);
        const int64_t residual = ch.head ? 0 : x;
        const int64_t head_freed = ch.head ? this_head - kFloat : 0;
        const int64_t waiting = it->second.older_graph ? tp_bias_gradient : 0;
        consider(buffers, head_freed, sum({mlp_backward(chunks_backward.contains(a.chunk)), full ? layer_bytes : 0, waiting}) - residual,
                 "a backward: the last layer's MLP");
        // Full recomputation: the last layer's saved set made again (its input is among
        // the inputs held), the output projection's sum, the residual's gradient.
        if (full)
          consider(buffers, head_freed, sum({layer_bytes, mlp_forward}) - x + (ch.head ? x : 0),
                   "a backward: the recomputed last layer's MLP output projection");
        held -= it->second.saved;
        in_flight.erase(it);
        chunks_backward.insert(a.chunk);
        if (!ch.embed) gradient_send = boundary;
      }
      // The step's end (the pipeline's buffers are gone): the tied embedding's gradient
      // exchange, ZeRO-1's all-gather.
      if (c.tie_embeddings && (shard.chunks.front().embed || shard.chunks.back().head)) {
        const int64_t wte = checked_mul(Vp / TP, C, "plan");
        consider({}, 0, std::min<int64_t>(wte, int64_t{1} << 20) * kFloat, "the tied embedding's gradient exchange",
                 true);
      }
      if (in.zero == 1 && stage_sizes.largest_padded_piece > 0)
        consider({}, 0, bytes_of(1 + D, stage_sizes.largest_padded_piece, kFloat),
                 "the optimizer step's all-gather of the largest unit D does not divide",
                 true);
      RankPlan rp;
      rp.stage = stage;
      rp.parts = states;
      rp.parts.insert(rp.parts.begin() + 3, best_parts.begin(), best_parts.end());
      rp.predicted_peak_bytes = best;
      return rp;
    };
    std::vector<RankPlan> stages;
    for (int stage = 0; stage < PP; ++stage) stages.push_back(stage_plan(stage));
    for (int r = 0; r < in.world; ++r) {
      plan.ranks.push_back(stages[static_cast<size_t>(r / (D * TP))]);
      plan.ranks.back().rank = r;
    }
    return plan;
  }
  const int64_t shard = piece_total * kFloat;  // one fp32 value per element of this rank's pieces
  // Without a pipeline every rank's plan is the same: made once (as rank 0's), then copied.
  {
    RankPlan rp;
    rp.parts = {{in.zero == 3 ? "parameters (this rank's pieces)" : "parameters", in.zero == 3 ? shard : P * kFloat},
                {in.zero >= 2 ? "gradients (this rank's pieces)" : "gradients", in.zero >= 2 ? shard : P * kFloat},
                {in.zero >= 1 ? "optimizer state (AdamW m, v: this rank's pieces)" : "optimizer state (AdamW m, v)",
                 in.zero >= 1 ? 2 * shard : 2 * P * kFloat},
                {"activations (one microbatch)", activations},
                {on_cpu ? "loader buffers" : "loader buffers (the microbatch's inputs on the device)",
                 loader - targets_freed},
                {"transient at the peak", transient},
                // The loss (and, when scaled by 1/(N*D), its scaled copy): scalars.
                {"loss", in.grad_accum * D > 1 ? 2 * kFloat : kFloat}};
    if (bf16) rp.parts.emplace_back(kBf16CopyPart, 2 * P);
    if (library_workspace > 0) rp.parts.emplace_back("GEMM library workspace (cuBLASLt)", library_workspace);
    // LLaMA's rotary frequencies, a model constant (D/2 floats).
    if (c.llama_architecture()) rp.parts.emplace_back("model constants (rotary frequencies)", c.head_dim() / 2 * kFloat);
    // ZeRO-2/3 at the start of backward: the head's units (the final norm, and the tied
    // embedding, whose gradient is final only at the end of backward) have their gradient
    // staging buffers, whole units, reduce-scattered when complete.
    const int64_t head_units = padded(final_norm) + (c.tie_embeddings ? padded(embed) : 0);
    const std::string head_names = c.tie_embeddings ? "embeddings and final norm" : "final norm and head";
    const size_t zero_parts_begin = rp.parts.size();  // ZeRO-2/3's parts at the start of backward: the last ones
    if (in.zero >= 2) rp.parts.emplace_back("gradient staging (" + head_names + ", whole units)", head_units);
    // ZeRO-3 has gathered the same units again for backward, and prefetched the last layer.
    if (in.zero == 3)
      rp.parts.emplace_back("gathered units (" + head_names + ", last layer prefetched)", head_units + padded(last_layer));
    for (const auto& [name, bytes] : rp.parts) rp.predicted_peak_bytes = checked_add(rp.predicted_peak_bytes, bytes, "plan");
    // The other moments (above), where nothing else changes between them (zero <= 1); with
    // ZeRO-2/3 the layers' MLP backward with what ZeRO holds there (below).
    struct Moment {
      std::string activations_name;
      int64_t activations;
      std::string transient_name;
      int64_t transient;
      bool in_forward = false;  // the loss does not exist yet
    };
    std::vector<Moment> moments;
    moments.push_back({full ? "activations (one microbatch: the layers' inputs; the head's are freed)"
                            : "activations (one microbatch, the layers'; the head's are freed)",
                       activations - head_activations + recomputed_layer,
                       std::string("transient at the peak (the last layer's MLP backward") +
                           (full ? ", the layer recomputed" : "") + ": the residual's gradient and the MLP's)",
                       mlp_backward(in.grad_accum > 1)});
    if (!full)
      moments.push_back({"activations (one microbatch, the layers'; the head has not run)",
                         activations - head_activations,
                         "transient at the peak (the last layer's MLP output projection in forward)", mlp_forward,
                         true});
    // Full recomputation: the same projection's moment as the last layer is recomputed in
    // backward, with the residual's gradient live and the layer's saved set made again
    // (its input is among the layers' inputs already).
    if (full)
      moments.push_back({"activations (one microbatch: the layers' inputs, the last layer's recomputed so far)",
                         activations - head_activations + layer_bytes - checked_product({sp_rows, C, kFloat}, "plan"),
                         "transient at the peak (the recomputed last layer's MLP output projection, the residual's "
                         "gradient)",
                         mlp_forward + checked_product({sp_rows, C, kFloat}, "plan")});
    if (TP > 1) {
      moments.push_back({"activations (one microbatch; the logits and the loss's log-sum-exp are freed)",
                         activations - logits_bytes - loss_lse_bytes,
                         "transient at the peak (the head's backward: the logits' gradient, its input's gradient)",
                         head_backward});
      moments.push_back({"activations (one microbatch; the logits, the loss's log-sum-exp and the head's input are freed)",
                         activations - logits_bytes - loss_lse_bytes - final_norm_output,
                         "transient at the peak (the head input's gradient, summed over the tensor-parallel ranks)",
                         head_input_sum});
      moments.push_back({"activations (one microbatch, all of them)", activations,
                         "transient at the peak (the vocabulary-parallel loss's forward: its row statistics" +
                             std::string(bf16 ? ", the final norm's fp32 output" : "") + " and the loss)",
                         vocab_loss_forward, true});
    }
    if (TP == 1)
      moments.push_back({"activations (one microbatch, all of them)", activations,
                         "transient at the peak (the loss's forward: the per-row losses" +
                             std::string(chunk > 0 ? ", a chunk of logits" : " and their mean") +
                             (bf16 ? ", the final norm's fp32 output" : "") + ")",
                         loss_forward, true});
    const int64_t others = rp.predicted_peak_bytes - activations - transient;
    const int64_t loss_bytes = rp.parts[6].second;
    auto total = [&](const Moment& m) {
      return checked_add(checked_add(others, m.activations, "plan"), m.transient, "plan") -
             (m.in_forward ? loss_bytes - targets_freed : 0);
    };
    // ZeRO-2/3 change what lives between these moments. At a layer's MLP backward
    // (measured from traces, 1 and 2 ranks): the layer's gradient is being staged, the
    // unit after it (the next layer, or the final norm) is still staged with its
    // reduce-scatter piece in flight, and a tied embedding's staging waits for the end of
    // backward; ZeRO-3 holds the layer gathered and the unit before it prefetched. The last
    // layer holds the most activations; the one before it holds one layer's fewer (under
    // full recomputation one layer input fewer) but a whole layer unit's staging and piece
    // where the last holds the final norm's, so either can be the peak. Both are planned;
    // the others (the forward's, the recomputation's, tensor parallel's head) are not, and
    // are noted when larger.
    using Parts = std::vector<std::pair<std::string, int64_t>>;
    // `unit`: the layer's; `layer` names it, `after` the unit after it.
    auto zero_parts_at = [&](size_t unit, const std::string& layer, const std::string& after) {
      Parts parts;
      parts.emplace_back("gradient staging (the " + layer + "'s; the " + after + "'s" +
                             (c.tie_embeddings ? "; the embeddings'" : "") + ")",
                         sum({padded(unit), padded(unit + 1), c.tie_embeddings ? padded(embed) : 0}));
      // (The ledger tags the piece a reduce-scatter fills as communication.)
      parts.emplace_back("communication (the " + after + "'s reduce-scatter piece, in flight)", padded(unit + 1) / D);
      if (in.zero == 3)
        parts.emplace_back("gathered units (the " + layer + ", the unit before it prefetched)",
                           sum({padded(unit), padded(unit - 1)}));
      return parts;
    };
    std::vector<Parts> zero_parts;  // by moment, under ZeRO-2/3
    std::vector<Moment> unplanned;  // ZeRO-2/3's other moments
    if (in.zero >= 2) {
      unplanned.assign(moments.begin() + 1, moments.end());
      moments.resize(1);
      zero_parts.push_back(zero_parts_at(last_layer, "last layer", "final norm"));
      if (L >= 2) {
        const int64_t one_layer_fewer = full ? bytes_of(sp_rows, C, kFloat) : layer_bytes;
        moments.push_back({moments[0].activations_name + ", less the last layer's" + (full ? " input" : ""),
                           moments[0].activations - one_layer_fewer,
                           "transient at the peak (the second-to-last layer's MLP backward" +
                               std::string(full ? ", the layer recomputed" : "") +
                               ": the residual's gradient and the MLP's)",
                           moments[0].transient});
        zero_parts.push_back(zero_parts_at(last_layer - 1, "second-to-last layer", "last layer"));
      }
    }
    int64_t zero_at_start = 0;
    for (size_t i = zero_parts_begin; i < rp.parts.size(); ++i) zero_at_start += rp.parts[i].second;
    auto total_at = [&](size_t m) {
      int64_t bytes = total(moments[m]);
      if (m < zero_parts.size()) {
        bytes -= zero_at_start;
        for (const auto& [name, b] : zero_parts[m]) bytes = checked_add(bytes, b, "plan");
      }
      return bytes;
    };
    size_t peak = moments.size();
    int64_t at_peak = rp.predicted_peak_bytes;
    for (size_t m = 0; m < moments.size(); ++m)
      if (total_at(m) > at_peak) peak = m, at_peak = total_at(m);
    if (peak < moments.size()) {
      rp.parts[3] = {moments[peak].activations_name, moments[peak].activations};
      rp.parts[5] = {moments[peak].transient_name, moments[peak].transient};
      if (peak < zero_parts.size()) {  // (a backward moment: the loss stays, the parts keep their places)
        rp.parts.erase(rp.parts.begin() + static_cast<std::ptrdiff_t>(zero_parts_begin), rp.parts.end());
        rp.parts.insert(rp.parts.end(), zero_parts[peak].begin(), zero_parts[peak].end());
      } else if (moments[peak].in_forward) {
        rp.parts[4] = {"loader buffers", loader};
        rp.parts.erase(rp.parts.begin() + 6);
      }
      rp.predicted_peak_bytes = at_peak;
    }
    // An unplanned moment holds at least its activations and transient beside the model
    // states: noted when even that is over the plan.
    bool unplanned_larger = false;
    for (const Moment& m : unplanned) unplanned_larger |= total(m) - zero_at_start > rp.predicted_peak_bytes;
    if (unplanned_larger)
      plan.notes.push_back("ZeRO-" + std::to_string(in.zero) +
                           ": a moment of the forward, of the recomputation or of the head's backward holds more "
                           "activation memory than the plan's peak (a small vocabulary or a wide MLP); the peak may "
                           "come there, and be higher");
    // Moments when no activation is alive: the model states, the loader, the bf16 copy,
    // the library workspace and the model constants, plus what the moment itself holds.
    // Each becomes the plan's peak where it is larger.
    auto consider_without_activations = [&](const Parts& held) {
      Parts parts(rp.parts.begin(), rp.parts.begin() + 3);
      parts.emplace_back("loader buffers", loader);
      if (bf16) parts.emplace_back(kBf16CopyPart, 2 * P);
      if (library_workspace > 0) parts.emplace_back("GEMM library workspace (cuBLASLt)", library_workspace);
      if (c.llama_architecture()) parts.emplace_back("model constants (rotary frequencies)", c.head_dim() / 2 * kFloat);
      parts.insert(parts.end(), held.begin(), held.end());
      int64_t total = 0;
      for (const auto& [name, bytes] : parts) total = checked_add(total, bytes, "plan");
      if (total > rp.predicted_peak_bytes) {
        rp.parts = parts;
        rp.predicted_peak_bytes = total;
      }
    };
    // ZeRO-1/2's optimizer step all-gathers a unit that D does not divide through a send
    // piece (c) and a receive buffer (D*c). With few activations (a small microbatch) that
    // moment can be the peak. (Units of D equal pieces are gathered in place.)
    if ((in.zero == 1 || in.zero == 2) && sizes.largest_padded_piece > 0)
      consider_without_activations({{"all-gather of the largest unit D does not divide, in the optimizer step (send "
                                     "piece, receive buffer)",
                                     bytes_of(1 + D, sizes.largest_padded_piece, kFloat)}});
    // ZeRO-2/3's end of backward: the embeddings unit's gradient is final last (the token
    // embedding's scatter is backward's last op), and its staging (D c) and the piece it is
    // reduce-scattered into (c) live beside the loss and what every such moment holds. With
    // few activations, or on one rank (where c is the whole unit), that moment is the peak.
    // ZeRO-3 also holds a tied embedding gathered from the head's backward to the embedding's.
    if (in.zero >= 2) {
      Parts held = {{"loss", in.grad_accum * D > 1 ? 2 * kFloat : kFloat},
                    {"gradient staging (embeddings, whole unit), at the end of backward", padded(embed)},
                    {"communication (the embeddings' reduce-scatter piece, at the end of backward)", padded(embed) / D}};
      if (in.zero == 3 && c.tie_embeddings) held.emplace_back("gathered unit (embeddings)", padded(embed));
      consider_without_activations(held);
    }
    for (int r = 0; r < in.world; ++r) {
      plan.ranks.push_back(rp);
      plan.ranks.back().rank = r;
    }
  }
  if (in.zero == 3 && padded(embed) > activations)
    plan.notes.push_back("ZeRO-3: the embeddings unit (" + memory::format_bytes(padded(embed)) +
                         ") outweighs one microbatch's activations (" + memory::format_bytes(activations) +
                         "); the peak may come in forward, while the unit is gathered, and be higher");
  return plan;
}

}  // namespace

std::string plan_text(const MemoryPlan& plan, const PlanInput& in) {
  std::string out = "plan: " + in.model.describe() + ", batch " + std::to_string(in.batch_size) + " x " +
                    std::to_string(in.seq_len) + ", grad-accum " + std::to_string(in.grad_accum) + ", " +
                    std::to_string(in.world) + " rank(s)" +
                    (in.tp > 1 ? " (tp " + std::to_string(in.tp) + (in.sequence_parallel ? " with sp" : "") + ")" : "") +
                    (in.pp > 1 ? " (pp " + std::to_string(in.pp) + " " + dist::pipeline_schedule_name(in.pp_schedule) +
                                     (in.virtual_stages > 1 ? " x" + std::to_string(in.virtual_stages) : "") +
                                     (in.pp_last_stage_layers > 0
                                          ? ", " + std::to_string(in.pp_last_stage_layers) + " layer(s) on the last stage"
                                          : "") +
                                     ")"
                               : "") +
                    ", zero " + std::to_string(in.zero) +
                    (in.bf16 ? ", bf16 mixed precision" : "") +
                    (in.loss_chunk_rows > 0 ? ", chunked loss (" + std::to_string(in.loss_chunk_rows) + " rows)" : "") +
                    (in.recompute == nn::Recompute::Selective ? ", selective recomputation"
                     : in.recompute == nn::Recompute::Full    ? ", full recomputation"
                                                              : "") +
                    "\n";
  // Each distinct rank plan once, with the ranks (and pipeline stages) that share it, as
  // ranges: "ranks 0-3 (pipeline stage 0)".
  const int ranks_per_stage = std::max(1, in.world / std::max(1, in.pp));
  auto ranges = [](const std::vector<int>& ids) {
    std::string text;
    for (size_t i = 0; i < ids.size();) {
      size_t j = i;
      while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
      if (!text.empty()) text += ", ";
      text += std::to_string(ids[i]);
      if (j > i) {
        text += '-';
        text += std::to_string(ids[j]);
      }
      i = j + 1;
    }
    return text;
  };
  std::vector<bool> done(plan.ranks.size(), false);
  for (size_t i = 0; i < plan.ranks.size(); ++i) {
    if (done[i]) continue;
    std::vector<int> ranks, stages;
    for (size_t j = i; j < plan.ranks.size(); ++j)
      if (!done[j] && plan.ranks[j].parts == plan.ranks[i].parts) {
        done[j] = true;
        ranks.push_back(plan.ranks[j].rank);
        const int stage = plan.ranks[j].rank / ranks_per_stage;
        if (stages.empty() || stages.back() != stage) stages.push_back(stage);
      }
    const RankPlan& r = plan.ranks[i];
    out += ranks.size() > 1 ? "ranks " : "rank ";
    out += ranges(ranks);
    if (in.pp > 1) {
      out += stages.size() > 1 ? " (pipeline stages " : " (pipeline stage ";
      out += ranges(stages);
      out += ')';
    }
    out += ": predicted peak " + memory::format_bytes(r.predicted_peak_bytes) + "\n";
    for (const auto& [name, bytes] : r.parts) out += "  " + memory::format_bytes(bytes) + "  " + name + "\n";
  }
  for (const std::string& note : plan.notes) out += "note: " + note + "\n";
  out += in.pp > 1 ? "activations of one microbatch, by kind (the whole model; each stage holds its layers' share):\n"
                   : "activations of one microbatch, by kind:\n";
  for (const auto& [kind, bytes] : plan.activations_by_kind) out += "  " + memory::format_bytes(bytes) + "  " + kind + "\n";
  return out;
}

std::string memory_kind(const std::string& part) {
  auto starts = [&](const char* prefix) { return part.rfind(prefix, 0) == 0; };
  if (starts("parameters")) return "parameters";
  if (starts("gradient")) return "gradients";  // the gradients and ZeRO's staging of them
  if (starts("optimizer")) return "optimizer state";
  if (starts("activations") || starts("transient") || starts("loss")) return "activations";
  if (starts("loader")) return "data";
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

std::string explain_peak(const std::vector<std::pair<std::string, int64_t>>& plan_parts,
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
  const DryRunStep* peak = nullptr;
  for (const DryRunStep& s : dry_run.steps) {
    steps.push_back(s.peak_bytes);
    if (!peak || s.peak_bytes > peak->peak_bytes) peak = &s;
  }
  if (peak && dry_run.validation.peak_bytes > peak->peak_bytes) peak = &dry_run.validation;
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

std::string plan_json(const MemoryPlan& plan, const std::vector<DryRun>& dry_runs) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankPlan& r : plan.ranks) {
    nlohmann::json parts = nlohmann::json::object();
    for (const auto& [name, bytes] : r.parts) parts[name] = bytes;
    ranks.push_back(
        {{"rank", r.rank}, {"stage", r.stage}, {"predicted_peak_bytes", r.predicted_peak_bytes},
         {"setup_bytes", r.setup_bytes}, {"parts", parts}});
  }
  nlohmann::json activations = nlohmann::json::object();
  for (const auto& [kind, bytes] : plan.activations_by_kind) activations[kind] = bytes;
  nlohmann::json out{{"ranks", ranks}, {"activations", activations}, {"notes", plan.notes}};
  // "dry_run": rank 0's; "dry_runs": one per pipeline stage (its first rank).
  if (!dry_runs.empty()) out["dry_run"] = dry_run_json(dry_runs.front());
  if (dry_runs.size() > 1) {
    nlohmann::json all = nlohmann::json::array();
    for (const DryRun& d : dry_runs) all.push_back(dry_run_json(d));
    out["dry_runs"] = all;
  }
  return out.dump(2);
}

}  // namespace tally::train
