// The memory plan: every rank's peak, before anything real is allocated, from the dry run
// (train/dry_run.h): the run's own steps on the meta device, once for each rank whose steps
// differ in shape (the first rank of each pipeline stage). `tally plan` prints it; the
// trainer prints its rank's beside the measured peak and warns when they differ by more
// than 5%. A rank's parts are the kinds of memory alive at its peak (parameters,
// gradients, optimizer state, activations, data, communication, other), by the ledger's
// categories. docs/memory-plan.md explains those peaks by formulas over the model's shape
// and the batch, and tests/test_plan.cc checks the dry run against them.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "memory/ledger.h"
#include "memory/report.h"
#include "nn/transformer.h"
#include "train/config.h"
#include "train/dry_run.h"

namespace tally::train {

struct RankPlan {
  int rank = 0;
  int stage = 0;  // its pipeline stage (0 without --pp)
  memory::PlanParts parts;  // kind -> bytes at the peak, largest first
  int64_t predicted_peak_bytes = 0;
  // Set-up's peak where a layout plans one (dist::StepEngine::setup_peak_bytes: tensor or
  // pipeline parallel, ZeRO-2/3), else 0.
  int64_t setup_bytes = 0;
};

struct MemoryPlan {
  std::vector<RankPlan> ranks;  // every rank of the world
  std::vector<DryRun> dry_runs;  // one per pipeline stage: its first rank's
  // The activations alive at a stage's peak (the stage whose peak holds the most), by op
  // summed over its layers ("mlp:gelu", "attn:attention_lse", "head:linear", ...),
  // largest first.
  memory::PlanParts activations_by_op;
  int activations_stage = 0;
  // What the plan simplified (a step of many microbatches run as a few); a bound that stood
  // in for the data is each dry run's own (DryRun::bound).
  std::vector<std::string> notes;
};

// The plan of `config` run on `world` ranks (`validates`: it has --val-data). Checks the
// layout as tally train does.
MemoryPlan plan_memory(const TrainConfig& config, const nn::TransformerConfig& model, int64_t world, bool validates);
// Parameters of a config (padded vocabulary rows included), by unit in the block's order.
int64_t parameter_count(const nn::TransformerConfig& c);
std::vector<int64_t> unit_numels(const nn::TransformerConfig& c);
// The kinds of memory alive at a dry run's peak (DryRun::peak), largest first.
memory::PlanParts peak_parts(const DryRunStep& peak);
std::string plan_text(const MemoryPlan& plan, const TrainConfig& config, const nn::TransformerConfig& model,
                      int64_t world);
// {"ranks": [{"rank": 0, "stage": 0, "predicted_peak_bytes": N, "setup_bytes": N, "parts": {...}}, ...],
// "activations": {...}, "notes": [...], "dry_run": rank 0's and, with several stages,
// "dry_runs": one per stage, each {"step_peak_bytes": [...], "peak_bytes": N,
// "validation_peak_bytes": N (when it validates), "at_peak": {owner: bytes} and "moment":
// {"step", "phase", "microbatch" (from 0; -1: none), "allocation", "category"} of the run's
// peak (the largest step's, or validation's when larger), "bound": what stood in for the
// data (experts' routing), when any}.
std::string plan_json(const MemoryPlan& plan);

// The kind of memory a plan part or a ledger category is: parameters, gradients,
// optimizer state, activations (activations, saved tensors, workspaces, the loss),
// data, communication, other.
std::string memory_kind(const std::string& plan_part);
std::string memory_kind(Category category);

// Why a measured peak differs from the plan: the kind of memory furthest from its planned
// bytes, and its largest owner at the peak, e.g. "activations are 152.0 KiB over the plan
// (480.0 KiB against 328.0 KiB); the largest at the peak: h.1.mlp:swiglu_dgate, 64.0 KiB".
// `at_peak` is the ledger's snapshot (Ledger::peak_owners).
std::string explain_peak(const memory::PlanParts& plan_parts,
                         const std::vector<memory::OwnerBytes>& at_peak);

}  // namespace tally::train
