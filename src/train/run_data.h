// A run's data: the training loader, and the validation loader when there is --val-data,
// each opened and checked before the first step (every token against the vocabulary, the
// ranks against each other).
#pragma once
#include <cstdint>
#include <memory>

#include "data/loader.h"
#include "dist/world.h"
#include "nn/transformer.h"
#include "train/config.h"

namespace tally::train {

class RunData {
 public:
  RunData(const TrainConfig& config, const dist::World& world, const nn::TransformerConfig& model);

  data::TokenLoader& train() { return train_; }
  const data::TokenLoader& train() const { return train_; }
  data::TokenLoader* val() { return val_.get(); }
  const data::TokenLoader* val() const { return val_.get(); }
  // The batches a validation reads: --val-batches, or fewer when the data holds fewer.
  int64_t val_batches() const { return val_batches_; }

 private:
  void check_ranks_read_the_same_tokens(const dist::World& world) const;
  void warn_of_mismatches(const nn::TransformerConfig& model) const;
  void fit_val_batches(const TrainConfig& config);

  bool root_;
  data::TokenLoader train_;
  std::unique_ptr<data::TokenLoader> val_;
  int64_t val_batches_ = 0;
};

}  // namespace tally::train
