// What a run shows of its model as it trains: the validation loss on --val-data and
// samples of text (--sample-every), both on every rank (a pipeline validates through its
// stages, ZeRO-3 gathers each unit in every forward).
#pragma once
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "core/random.h"
#include "data/tokenizer.h"
#include "dist/step_engine.h"
#include "train/config.h"
#include "train/run_data.h"

namespace tally::train {

class Evaluator {
 public:
  // Loads --tokenizer (checked against the model's vocabulary now, not at the first sample).
  Evaluator(const TrainConfig& config, const dist::World& world, const nn::TransformerConfig& model);

  // The samples' random state (a resume continues the checkpoint's).
  Rng& sample_rng() { return sample_rng_; }

  bool validates_at(int64_t step, bool last, const RunData& data) const;
  // The mean loss of the validation batches, without a graph.
  double validate(dist::StepEngine& engine, RunData& data) const;

  bool samples_at(int64_t step, bool last) const;
  // Draws and prints a sample (every rank draws the same). A failure is handed back, not
  // thrown, so that showing text never costs the checkpoint of the step it shows.
  std::exception_ptr sample(dist::StepEngine& engine, bool last);

 private:
  std::string text(const std::vector<int32_t>& ids) const;

  const TrainConfig& c_;
  const dist::World& world_;
  nn::TransformerConfig model_;
  std::unique_ptr<data::Tokenizer> tokenizer_;  // null: samples print token ids
  Rng sample_rng_;
};

}  // namespace tally::train
