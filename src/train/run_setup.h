// A run's set-up, before its first allocation: the files it reads and writes, its
// --out-dir, the ranks' agreement on what they run, and where the model's first weights
// come from.
//
// Every check that can fail is made here, before the model is built, so a bad path or a
// rank started with other flags fails at once, not after the first step.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dist/step_engine.h"
#include "dist/world.h"
#include "io/checkpoint.h"
#include "train/config.h"

namespace tally::train {

using Settings = std::vector<std::pair<std::string, std::string>>;

// The step engine's configuration for a run of `config` on a model of shape `model`.
dist::EngineConfig engine_config(const TrainConfig& config, const nn::TransformerConfig& model);

// Every rank must run the same job. A setting that differs between ranks (a wrapper
// script, another copy of the data on one machine) would make collectives of different
// sizes or counts, which MPI turns into corrupt memory or a hang, or would silently train
// the ranks on different data. Each setting's CRC-32 is gathered from every rank; one that
// differs from rank 0's stops every rank with the same error, which names it (and each
// rank says what it has). What is compared is what the settings say, not every byte.
void check_ranks_agree(const dist::World& world, const Settings& settings);

class RunSetup {
 public:
  // Checks the configuration, the paths and the --out-dir, takes its lock (a run that
  // saves holds it until it ends), and reads the model's shape.
  RunSetup(const TrainConfig& config, const dist::World& world);

  const nn::TransformerConfig& model() const { return model_; }
  // The checkpoint --resume names ("" for a fresh run), and whether it is one of the
  // --out-dir's (the run continues where it saves).
  const std::string& resume_dir() const { return resume_dir_; }
  bool continues() const { return continues_; }
  // Where the weights come from, and who holds the model's file: "the checkpoint",
  // "--model-file", "--init-from" or "--model <preset> drawn from --seed".
  std::string weights_source() const;

  // The ranks compare every setting that decides a collective's size or the data, `recipe`
  // (what a checkpoint saves) included.
  void check_ranks_agree_on(const Settings& recipe) const;
  // Fills the engine's freshly built shard: the checkpoint's weights on a resume, else
  // the file's, else drawn from --seed. Remembers what it read for check_weights_agree.
  dist::StepEngine::FillWeights fill_weights();
  // After the fill: every rank read the same bytes (a node holding another copy of the
  // model file, or a stale copy of the checkpoint, would train from other weights unseen).
  void check_weights_agree() const;
  // --overwrite: the earlier run's checkpoints go, now that every check has passed.
  void remove_earlier_checkpoints(bool quiet) const;

 private:
  void check_paths() const;
  void check_outputs() const;
  void take_out_dir();
  void find_earlier_checkpoints();
  void fill(nn::Transformer& model);

  const TrainConfig& c_;
  const dist::World& world_;
  ModelConfig source_;  // --model..., or the checkpoint's model.bin on a resume that names none
  nn::TransformerConfig model_;
  std::string resume_dir_;
  bool continues_ = false;
  io::OutDirLock lock_;
  std::vector<std::string> earlier_;  // rank 0: an earlier run's checkpoints that --overwrite removes
  uint32_t weights_crc_ = 0;
  std::vector<int64_t> hf_crcs_;  // --init-from: each parameter's CRC-32 (-1: not this rank's)
};

}  // namespace tally::train
