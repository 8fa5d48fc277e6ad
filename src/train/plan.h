// The memory plan: every rank's peak, predicted from the configuration alone (no model
// memory is allocated), with its parts. `tally plan` prints it; the trainer prints it
// beside the measured peak and warns when they differ by more than 5%.
//
// Every term is a formula over the model's shape and the batch (as llm.c sizes its
// buffers up front), in bytes, fp32:
//   model states   parameters 4P, gradients 4P, AdamW moments 8P; ZeRO-1 keeps the moments
//                  of this rank's piece of each unit (units padded to a multiple of D)
//   activations    what one microbatch saves for backward, by layer and kind (below);
//                  microbatches run one after another, so one microbatch's worth is live
//   loader         the (B, T) int32 inputs and targets of the train (and val) loader
//   transient      at the peak: the first gradient of backward, dL/d(final norm output)
//                  (B*T*C), while the cross-entropy's saved log-sum-exp (B*T) is already
//                  freed and the logits' gradient is written in place of the logits (one
//                  process; tensor parallel: below). Other moments can be the peak with a
//                  small vocabulary or a wide MLP; plan.cc lists them, the plan takes the
//                  largest, and the parts then name the moment.
//   loss           the loss scalar, and its copy scaled by 1/(N*D) when N*D > 1
// (A pipeline stage holds several microbatches at once and its own parts: below.)
// Activations per token of a GPT-2 layer (floats): the residual input x and the middle
// residual (2C, saved by the two layernorms), each norm's output (2C, saved by the next
// linear) and its mean and rstd (4), q/k/v (3C) and the attention output (C), the
// attention's log-sum-exp (H per token), the MLP's pre-GELU and post-GELU (8C):
// 16C + 4 + H. The head saves the last residual and the final norm's output (2C), its
// mean and rstd (2), the logits (Vp; 2 bytes each under bf16) and the cross-entropy's
// log-sum-exp (1).
// A LLaMA layer: x and the middle residual (2C), the RMSNorm outputs (2C) and rstd (2),
// q and k after rotary and v (C + 2 KV D), the attention output (C) and log-sum-exp (H),
// the MLP's gate, up and SwiGLU output (3F): 6C + 2 KV D + 3F + H + 2. Its head saves
// the final RMSNorm's rstd (1) where GPT-2's saves mean and rstd; a model constant, the
// rotary frequencies (D/2), is counted beside the parameters.
//
// Mixed precision (--dtype bf16) adds the parameters' bf16 copy (2P) and changes what the
// projections save: each keeps its input rounded to bf16 (2 bytes) instead of the fp32
// tensor. Where nothing else saves that input (the norm outputs) the fp32 one is freed;
// the MLP's hidden layer is bf16 itself (the projections write it rounded, GELU or SwiGLU
// reads and writes bf16), so GPT-2's pre-GELU and post-GELU and LLaMA's gate, up and
// SwiGLU output count 2 bytes each; the attention writes a bf16 output, which it and the
// output projection both save (one tensor); LLaMA's second RMSNorm output feeds two
// projections (gate, up), which keep a bf16 copy each. Attention saves q, k and v rounded
// to bf16 (its tile products are bf16), and the fp32 ones are freed. The head writes bf16
// logits, and the loss turns them in place into their bf16 gradient, which the head's
// GEMMs take as it is. The loss's forward, holding every activation, the per-row losses
// and the final norm's fp32 output, is then the peak of one process.
//
// The chunked loss (--chunked-loss) saves no logits; at the start of backward it holds dx
// (B*T*C), one chunk of logits (R*Vp, R = min(rows per chunk, B*T); bf16 under bf16,
// turned in place into its gradient) and the loss's gradient (a scalar), while the
// log-sum-exp is still saved.
//
// Recomputation (--recompute). Selective: the attention keeps only q, k and v, so its
// log-sum-exp (H per token per layer) is not saved; its output (fp32, or bf16 under bf16)
// the output projection saves anyway. Full: each layer keeps only its input (C per
// token per layer, fp32), beside the head's activations. Backward then recomputes the last
// layer after the head's activations are freed: the candidate moments there hold the
// layers' inputs and the last layer's saved set again (its recomputed output standing in
// for its input, already counted), with its MLP backward's gradients, or in its recomputed
// forward the output projection's sum and the residual's gradient; they win when the
// vocabulary is small.
//
// Tensor parallelism (--tp, Megatron's layout): parameters are this rank's shard (split
// heads, MLP width and vocabulary; replicated norms, row-parallel biases and positions).
// Column-parallel outputs (q, k, v, the MLP's hidden, the attention output and its
// log-sum-exp, the logits) are 1/tp of their width; the projections' inputs (the norms'
// outputs) are whole. Sequence parallelism (--sp) makes the residual stream and the norms'
// statistics B*T/tp rows, and the projections save the all-gathered norm output. The
// vocabulary-parallel loss keeps its log-sum-exp in fp64, and its backward writes the
// logits' gradient beside the logits: that moment is the peak for real vocabularies (the
// transient: the logits' gradient, B*T*Vp/tp elements, the loss's incoming gradient and its
// value as a double). plan.cc lists the other moments, which a small vocabulary or a wide
// MLP makes the peak; the plan takes the largest.
// The pipeline (--pp): each stage walks its schedule's actions and follows what is live at
// each (the microbatches in flight, the posted receives and the gradient sent back, the
// action's transient); plan.cc and docs/memory-plan.md say what each holds.
//
// ZeRO-2 and -3 shard gradients (and, in stage 3, parameters) and add, at the start of
// backward, the gradient staging of the head's units (final norm and the tied embedding,
// whole units padded to D pieces); stage 3 also holds those two units gathered again and the
// last layer prefetched. ZeRO-1/2 have a second candidate, the optimizer step's all-gather
// of the largest unit D does not divide (send piece c, receive buffer D*c, over the model
// states and the loader; a unit of D equal pieces is gathered in place): the plan takes
// the larger. ZeRO-2/3's two layer units in flight later in backward (which exceed the start
// of backward when the logits are small: B*T < 282 for GPT-2 124M, < 1223 for 1.5B) are
// planned at the last and second-to-last layers' MLP backward, a reduce-scatter piece in
// flight as "communication", as the ledger tags it. Not modeled, and flagged in the notes:
// ZeRO-3's gather of the embeddings in forward when they outweigh the activations.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dist/pipeline.h"
#include "memory/ledger.h"
#include "nn/transformer.h"
#include "train/config.h"

namespace tally::train {

struct PlanInput {
  nn::TransformerConfig model;
  int64_t batch_size = 4, seq_len = 64, grad_accum = 1;
  int world = 1;  // ranks: data-parallel x tensor-parallel
  int tp = 1;     // tensor-parallel ranks (--tp); the data-parallel ones are world / tp
  bool sequence_parallel = false;  // --sp
  int zero = 0;   // over the data-parallel ranks
  bool val_loader = false;  // the run validates (--val-data): its loader's buffers, counted where they are (the host)
  bool bf16 = false;  // --dtype bf16: mixed precision (see below)
  int64_t loss_chunk_rows = 0;  // --chunked-loss: rows per chunk of the fused head and loss (0: off)
  // --device: on a GPU the plan counts cuBLASLt's workspace and leaves the validation
  // loader's host buffers out (a GPU's evaluation copies them one batch at a time).
  Device device = Device::cpu();
  nn::Recompute recompute = nn::Recompute::None;  // --recompute (see below)
  // The pipeline (--pp, --pp-schedule, --virtual-stages, --pp-last-stage-layers); world =
  // dp x tp x pp.
  int pp = 1;
  dist::PipelineSchedule pp_schedule = dist::PipelineSchedule::OneFOneB;
  int virtual_stages = 1;
  int64_t pp_last_stage_layers = 0;
  // --cp: context-parallel ranks, counted among the world's replicas (ZeRO shards over
  // them); the formulas plan each rank's activations as if it held whole sequences, and
  // the plan says so in a note.
  int cp = 1;
};

struct RankPlan {
  int rank = 0;
  int stage = 0;  // its pipeline stage (0 without --pp)
  std::vector<std::pair<std::string, int64_t>> parts;  // name -> bytes, in the order printed
  int64_t predicted_peak_bytes = 0;
  // Set-up's peak (plan_memory): under tensor/pipeline parallelism this rank's shard's
  // parameters and gradients and one whole parameter beside them; under ZeRO-2/3 the whole
  // parameter block and the rank's shards; 0 otherwise (set-up holds less than a step).
  int64_t setup_bytes = 0;
};

struct MemoryPlan {
  std::vector<RankPlan> ranks;
  std::vector<std::pair<std::string, int64_t>> activations_by_kind;  // one microbatch, all layers
  std::vector<std::string> notes;  // where the plan's assumptions may not hold
};

MemoryPlan plan_memory(const PlanInput& input);
// The plan's input for a run of `config` on `world` ranks (`validates`: it has --val-data).
PlanInput plan_input(const TrainConfig& config, const nn::TransformerConfig& model, int64_t world, bool validates);
// Parameters of a config (padded vocabulary rows included), from the same formulas.
int64_t parameter_count(const nn::TransformerConfig& c);
std::vector<int64_t> unit_numels(const nn::TransformerConfig& c);
std::string plan_text(const MemoryPlan& plan, const PlanInput& input);
// {"ranks": [{"rank": 0, "stage": 0, "predicted_peak_bytes": N, "parts": {...}}, ...], "activations": {...}},
// and with a dry run (train/dry_run.h) "dry_run": {"step_peak_bytes": [...], "peak_bytes": N,
// "validation_peak_bytes": N (when it validates), "at_peak": {owner: bytes} and "moment": {"step",
// "phase", "microbatch" (from 0; -1: none), "allocation", "category"} of the run's peak (the
// largest step's, or validation's when larger), "bound": what stood in for the data (experts'
// routing), when any}.
struct DryRun;
std::string plan_json(const MemoryPlan& plan, const std::vector<DryRun>& dry_runs = {});

// The kind of memory a plan part or a ledger category is: parameters, gradients,
// optimizer state, activations (activations, saved tensors, workspaces, the loss),
// data, communication, other.
std::string memory_kind(const std::string& plan_part);
std::string memory_kind(Category category);

// Why a measured peak differs from the plan: the kind of memory furthest from its planned
// bytes, and its largest owner at the peak, e.g. "activations are 152.0 KiB over the plan
// (480.0 KiB against 328.0 KiB); the largest at the peak: h.1.mlp:swiglu_dgate, 64.0 KiB".
// `at_peak` is the ledger's snapshot (Ledger::peak_owners).
std::string explain_peak(const std::vector<std::pair<std::string, int64_t>>& plan_parts,
                         const std::vector<memory::OwnerBytes>& at_peak);

}  // namespace tally::train
