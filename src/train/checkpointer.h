// The trainer's checkpoints: what a run saves (io/checkpoint.h writes the files), how a
// resume continues it, and how many it keeps (--keep-last).
//
// The recipe is what decides a run's trajectory after its checkpoint: the global batch's
// shape (the data position of every microbatch), the learning-rate schedule (cosine
// depends on --steps), the optimizer and the data. Saved with every checkpoint and
// compared on resume, exactly (numbers as %.17g): a resume that would not continue the
// run exactly is refused unless --allow-recipe-change.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/random.h"
#include "dist/step_engine.h"
#include "train/config.h"
#include "train/plot.h"
#include "train/run_setup.h"

namespace tally::train {

// The recipe of this run (without the data's token count, which the data adds).
Settings run_recipe(const TrainConfig& config, const dist::World& world);
// What a resume would change in the run a checkpoint saved ("--lr was 0.001, now 0.002,
// ..."), or "" when nothing: `saved` is the checkpoint's recipe, `now` this run's.
std::string recipe_changes(const Settings& saved, const Settings& now);

class Checkpointer {
 public:
  Checkpointer(const TrainConfig& config, const dist::World& world, dist::StepEngine& engine, Settings recipe);

  // --resume: the optimizer's state and the run's record from `dir` (the engine's model
  // holds its weights already), the recipe compared. Sets start_step(); `sample_rng`
  // continues from the checkpoint's state.
  void resume(const std::string& dir, Rng& sample_rng);
  int64_t start_step() const { return start_step_; }
  // The checkpoint's record of the steps before start_step() (JSON; empty when older).
  const std::string& resumed_history() const { return resumed_history_; }
  // The peak of set-up up to the checkpoint read (0 without --resume): reading stages the
  // moments one unit at a time beside the model states.
  int64_t resume_peak_bytes() const { return resume_peak_; }

  bool saves_at(int64_t step, bool last) const;
  // Saves step `step` (collective), then removes what --keep-last no longer keeps.
  void save(int64_t step, const RunCurve& curve, const Rng& sample_rng);
  // The last checkpoint this run wrote ("" for none).
  const std::string& last() const { return last_; }

 private:
  void keep_last(int64_t step);

  const TrainConfig& c_;
  const dist::World& world_;
  dist::StepEngine& engine_;
  Settings recipe_;
  int64_t start_step_ = 0;
  std::string resumed_history_;
  int64_t resume_peak_ = 0;
  std::vector<int64_t> saved_steps_;  // the checkpoints this run wrote (--keep-last counts them)
  std::string last_;
};

}  // namespace tally::train
