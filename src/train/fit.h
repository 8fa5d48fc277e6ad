// `tally plan --fit MEMORY --world N`: the layouts of N ranks whose every rank's peak fits
// MEMORY, for a run's model, sequence length and global batch, best first by an estimate
// of the step's time.
//
// The search. Every layout of the world: tensor parallel T in 1, 2, 4, 8 (with and
// without --sp), pipeline P a power of two up to the layers (1F1B, and interleaved with
// two chunks a rank), data parallel D = N / (T x P), ZeRO 0-3 (0-1 beside T or P, as
// tally train takes them), recompute none, selective and full, and microbatch sizes B of
// powers of two with the global batch G fixed (grad-accum = G / (D x B)). GPipe is left
// out: it holds all of a step's microbatches where 1F1B holds P, for the same bubble.
// What the run's command line fixes otherwise (dtype, chunked loss, --cp, --ep, the
// optimizer) is kept.
//
// The order. Each layout's step time is estimated by a stated model (StepEstimate below),
// the layouts are sorted by it, and each in turn is planned by the dry run
// (train/dry_run.h), every pipeline stage's, until `top` fit: the memory figures are the
// dry run's, exact; the times are the model's. A layout whose model states alone
// (16 bytes a parameter of its shard, less what ZeRO shards) exceed MEMORY is not run. The
// dry run of a layout runs at most 2 microbatches a step without a pipeline and 4 x P x V
// with one (train::with_planned_microbatches): from there on a step's peak repeats
// (Fit.FewerMicrobatchesPlanTheSamePeak).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "nn/transformer.h"
#include "train/config.h"

namespace tally::train {

// "80GiB", "512 MiB", "1.5TB", "4096" (bytes): throws naming --fit when it is not one.
int64_t parse_memory_size(const std::string& text);

struct FitOptions {
  int64_t memory_bytes = 0;     // --fit: each rank's memory
  int64_t world = 1;            // --world
  int64_t global_batch = 0;     // --global-batch: sequences a step (0: the command line's B x grad-accum x D)
  double flops_per_s = 0;       // --fit-tflops: each rank's rate (0: the GEMM peak measured in this process)
  double link_bytes_per_s = 25e9;  // --fit-link-gbps: each rank's link (25 GB/s: a 200 Gb/s network)
  int top = 10;                 // --fit-top: the layouts to list
  int max_dry_runs = 400;       // dry runs before the search stops (it says so)
  bool validates = false;       // the run validates: its loader's buffers are counted
};

// The step's time under the model: compute at the rate, the bubble, and every byte the
// rank's collectives move at the link's rate, none of it overlapped.
//   compute   F / (N x rate), F = G T x (6 x parameters a token runs + 6 L q_dim T), plus the
//             forward again under full recomputation (F / 3) or the attention's core
//             under selective (2 L q_dim T a token)
//   bubble    compute x (P - 1) / (V x M), M the step's microbatches, V the chunks a rank
//   tensor    M x (L / P) x 4 collectives a layer (6 under full recomputation) of
//             B x T x C fp32 values, each moving 2 (T - 1) / T of them a rank
//   data      the gradients' all-reduce (or ZeRO's reduce-scatter and all-gather):
//             2 (D - 1) / D x 4 bytes x the shard's parameters; ZeRO-3 also gathers the
//             parameters in each microbatch's forward and backward, 2 M times more
//   pipeline  2 x M x V activations of B x T x C fp32 values sent and received
// Left out: kernel efficiency (the rate is a peak), overlap of communication with
// compute, latency, the loss's vocabulary-parallel collectives, experts' all-to-alls,
// context parallel's exchanges, the optimizer step.
struct StepEstimate {
  double compute_s = 0, bubble_s = 0, tensor_s = 0, data_s = 0, pipeline_s = 0;
  double total_s() const { return compute_s + bubble_s + tensor_s + data_s + pipeline_s; }
};

struct FitCandidate {
  TrainConfig config;       // the run's with this layout (parallel, batch, recompute)
  StepEstimate estimate;
  int64_t peak_bytes = 0;   // the largest of its stages' dry-run peaks
  int peak_stage = 0;       // the stage that has it
  std::string flags() const;  // "--dp 8 --tp 2 --sp --pp 2 --zero 1 --recompute full --batch-size 1 --grad-accum 8"
};

struct FitResult {
  std::vector<FitCandidate> fits;  // best first, at most `top`
  int64_t layouts = 0;             // layouts of the world searched
  int64_t refused = 0;             // of them, ones tally train would refuse (or the dry run could not run)
  int64_t over_by_states = 0;      // not run: model states alone over the memory
  int64_t dry_runs = 0;            // layouts planned by the dry run
  bool stopped = false;            // max_dry_runs reached before `top` fit
  double flops_per_s = 0;          // the rate the estimates used
  int64_t global_batch = 0;
};

StepEstimate estimate_step(const TrainConfig& c, const nn::TransformerConfig& model, int64_t world,
                           double flops_per_s, double link_bytes_per_s);
FitResult fit_layouts(const TrainConfig& base, const nn::TransformerConfig& model, const FitOptions& options);
std::string fit_text(const FitResult& result, const FitOptions& options, const std::string& model_name);
std::string fit_json(const FitResult& result, const FitOptions& options);

}  // namespace tally::train
