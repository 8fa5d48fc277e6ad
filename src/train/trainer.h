// The trainer: a short loop over parts with one job each. Set-up checks the run and its
// files (run_setup.h); the step engine runs every layout's step (dist/step_engine.h); the
// data (run_data.h), the checkpoints (checkpointer.h), validation and samples
// (evaluation.h), the step lines and logs (metrics.h), the memory against its plan
// (peak_report.h) and the memory trace (memory_trace.h) each have their own file.
//
// A step runs N microbatches per rank (forward, backward with the loss scaled by
// 1/(N x data-parallel ranks)), completes the gradients over the layout, clips their norm,
// takes an AdamW step and logs on rank 0. The sanitizer scopes every step and microbatch
// on every rank, so --sanitize strict turns any growth of live memory or surviving graph
// into an error.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dist/world.h"
#include "sanitizer/sanitizer.h"
#include "train/config.h"
#include "train/metrics.h"

namespace tally::train {

struct TrainResult {
  int64_t steps_run = 0;
  double final_loss = 0;
  double final_val_loss = -1;
  // Set-up's peak (the largest over ranks: measured, and the plan's; 0 when the plan has
  // none, without tensor/pipeline parallelism).
  int64_t setup_peak_bytes = 0, predicted_setup_bytes = 0;
  int64_t resume_peak_bytes = 0;  // --resume: the peak of set-up up to the checkpoint read (largest over ranks)
  double best_val_loss = -1;  // the lowest validation loss of the whole run (a resumed one's included), -1 if none
  int64_t best_val_step = 0;
  std::vector<StepMetrics> history;
  std::string last_checkpoint;
  std::vector<sanitizer::Boundary> boundaries;  // the sanitizer's step/microbatch records (this rank; memory.keep_boundaries)
  Tensor parameters;  // the final parameter block (gathered), when config.return_parameters
};

using OnStep = std::function<void(const StepMetrics&)>;

// Runs the configured training on `world` (every rank calls it). `on_step` (optional)
// sees each step's metrics.
TrainResult run_training(const TrainConfig& config, const dist::World& world, const OnStep& on_step = {});
// The same on a world made from the config's layout (MPI when launched by mpirun).
TrainResult run_training(const TrainConfig& config, const OnStep& on_step = {});

}  // namespace tally::train
