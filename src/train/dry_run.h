// A dry run of a training run: the trainer's own step engine, model and optimizer run the
// run's steps on the meta device (core/device.h), on shapes alone, and the meta device's
// ledger records every allocation they make, in the order the real run makes them, with
// the same owners. Its peaks are the real run's, by construction rather than by formula:
// a feature the step gains is planned as soon as it runs.
//
// What runs: set-up (the model shard, its optimizer, the loader's buffers), then steps 0
// and 1 (the first optimizer step and a steady one), each as the trainer runs it:
// forward and backward of every microbatch, the gradients' reduction, their norm, the
// update; then, when the run validates, one validation batch as the trainer's validation
// runs each (every batch has the same shape). It stands in for one process, or one rank
// of a layout of data, tensor, context, pipeline and expert parallel ranks, whose
// collectives it makes on communicators that move nothing (dist::World::stand_in): the
// buffers the rank's step makes for them are made all the same; ZeRO's shards, staging
// and gathers too. On the CPU (meta(cpu)) or a GPU (meta(cuda): the CUDA kernels' scratch
// and cuBLASLt's workspace; the loader's buffers on the host, as a GPU run keeps them).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "memory/ledger.h"
#include "nn/transformer.h"
#include "train/config.h"

namespace tally::train {

struct DryRunStep {
  int64_t peak_bytes = 0;                  // the ledger's peak over the step
  std::vector<memory::OwnerBytes> at_peak;  // who held the bytes at that moment, largest first
  memory::PeakMoment moment;               // and the moment: phase, microbatch, allocation
};

struct DryRun {
  int rank = 0, stage = 0;  // the rank it stood in for, and its pipeline stage
  // Set-up's peak where the engine measures one (dist::StepEngine::setup_peak_bytes:
  // tensor or pipeline parallel, ZeRO-2/3), else 0.
  int64_t setup_peak_bytes = 0;
  std::vector<DryRunStep> steps;  // steps 0 and 1
  // A validation batch after them, when the run validates (peak_bytes 0 otherwise): its
  // forward without a graph, beside the model states, the optimizer's and the loaders'.
  DryRunStep validation;
  // What stands in for the data where the step depends on it: "" or, for experts, the
  // routing it planned at (nn/experts.cc).
  std::string bound;
  // The run's peak: the largest step's (the later on a tie: the steady one), or
  // validation's when it is larger; nullptr when nothing ran.
  const DryRunStep* peak() const;
  int64_t peak_bytes() const { return peak() ? peak()->peak_bytes : 0; }
};

// Runs `config`'s first two steps of `model` on the meta device (`validates`: the run has
// a validation loader, whose buffers live through it). Throws naming what it does not
// stand in for (dry_run_refusal).
// `world_size` > 1: it stands in for rank `rank` of the layout `config` gives that world.
DryRun dry_run(const TrainConfig& config, const nn::TransformerConfig& model, bool validates, int64_t world_size = 1,
               int rank = 0);
// The config whose dry run finds `c`'s peak in fewer microbatches: two steps of at most 2
// microbatches without a pipeline, 4 x P x V with one (1F1B and interleaved 1F1B; GPipe,
// which holds them all, keeps its own). From there on a step's peak repeats: memory is
// flat over microbatches, and a 1F1B schedule is periodic once warm, each steady round
// the one before.
TrainConfig with_planned_microbatches(const TrainConfig& c);
// The ranks whose steps differ in shape, one dry run each: the first rank of every pipeline
// stage (the data-, context- and tensor-parallel ranks of a stage make the same
// allocations: each tensor-parallel rank holds an equal slice).
std::vector<int> dry_run_roles(const TrainConfig& config, int64_t world_size);

// Why the dry run does not stand in for a run of `config`, or "" when it does (any real
// device).
std::string dry_run_refusal(const TrainConfig& config);

// A peak's moment as the plan says it: "step 2, backward of microbatch 4, allocating
// h.1.mlp:swiglu_dgate (activation)" (steps and microbatches counted from 1).
std::string moment_text(const memory::PeakMoment& moment);

// The dry run as `tally plan` prints it: each step's peak, and at the run's peak its
// moment, the bytes of each kind of memory and the largest owners.
// `name_rank`: say which rank it stood in for.
std::string dry_run_text(const DryRun& run, bool name_rank = false);

}  // namespace tally::train
