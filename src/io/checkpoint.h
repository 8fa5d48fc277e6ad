// Training checkpoints: a directory holding
//   model.bin   the weights as an llm.c GPT-2 file (fp32), usable by `tally sample` and llm.c
//   state.bin   tally's training state: completed steps, AdamW step count and moments,
//               the sampler's RNG state (256 x int32 header, then fp32 m and v)
// Each file is written atomically, then the directory is renamed into place, and
// <out_dir>/latest is replaced atomically to name it. A crash leaves the previous
// checkpoint intact.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "nn/transformer.h"
#include "optim/adamw.h"

namespace tally::io {

struct TrainingState {
  int64_t step = 0;  // steps completed
  std::array<uint64_t, 4> rng_state{};
};

// Writes <out_dir>/step_<step>/ and points <out_dir>/latest at it. Returns the directory.
std::string save_checkpoint(const std::string& out_dir, const nn::Transformer& model, const optim::AdamW& opt,
                            const TrainingState& state);

// `path` is a checkpoint directory or an out_dir with a `latest` file.
std::string resolve_checkpoint(const std::string& path);
// Loads weights, optimizer moments and state (configs must match; errors name the file).
TrainingState load_checkpoint(const std::string& dir, nn::Transformer& model, optim::AdamW& opt);

}  // namespace tally::io
