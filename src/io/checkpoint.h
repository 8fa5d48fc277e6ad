// Training checkpoints: a directory holding
//   model.bin   the weights as an llm.c GPT-2 file (fp32), usable by `tally sample` and llm.c
//   state.bin   tally's training state: completed steps, AdamW step count and moments,
//               the sampler's RNG state (256 x int32 header, then fp32 m and v), and the
//               CRC-32 of the two files below, so neither can go missing or change unseen
//   recipe.json the settings a resume must keep (TrainingState::recipe)
//   history.json the run's record so far: every step's loss, learning rate and tokens,
//               and the validation losses (what the loss plot and "best val loss" need)
// Each file is written atomically, then the directory is renamed into place, and
// <out_dir>/latest is replaced atomically to name it. A crash leaves the previous
// checkpoint intact.
//
// With data parallel or ZeRO, saving is collective: every rank takes part in gathering
// the model (ZeRO-3: to rank 0, parameter by parameter) and the moments (unit by unit, so
// no rank holds more than one unit extra),
// and rank 0 writes; the others wait for it, so all agree on what `latest` names. The
// moments are stored in the parameter block's order whatever the layout, so any --dp and
// --zero can resume from any other (each rank keeps its own shard of what it reads).
// Loading reads the files on every rank: the directory must be visible to all of them
// (one machine, or a shared filesystem, as the data shards are).
#pragma once
#include <array>
#include <functional>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dist/world.h"
#include "nn/transformer.h"
#include "optim/optimizer.h"

namespace tally::io {

struct TrainingState {
  int64_t step = 0;  // steps completed
  std::array<uint64_t, 4> rng_state{};
  // The settings that decide the run's trajectory (batch shape, schedule, optimizer, data),
  // as name -> exact text, saved as <step dir>/recipe.json. Resuming compares them, so a
  // run whose data order, schedule or optimizer would differ is refused unless the user
  // allows it. The parallel layout is not part of it: a checkpoint resumes on another
  // dp x grad-accum split of the same global batch, another ZeRO stage or tp/pp layout, the
  // same math to fp32 rounding (reductions in another order), not bit for bit.
  std::vector<std::pair<std::string, std::string>> recipe;
  // The trainer's record of the run up to `step` (JSON text; train/plot.h reads and writes
  // it), saved as <step dir>/history.json. Empty in checkpoints older than it.
  std::string history;
  // Loading: the CRC-32 of state.bin's bytes (its header, then the moments), which ranks
  // resuming one run compare.
  uint32_t content_crc = 0;
};

// What the rank at (pipeline stage, tensor-parallel rank, expert-parallel rank) holds, for
// tensor-, pipeline- and expert-parallel runs.
using ShardLayout = std::function<nn::ModelShard(int pp_rank, int tp_rank, int ep_rank)>;

// Writes <out_dir>/step_<step>/ and points <out_dir>/latest at it. Returns the directory.
// Collective over `world`; under ZeRO-3 every rank sends rank 0 its pieces of each
// parameter in turn, so rank 0 holds one whole parameter at a time, the others nothing more.
// A tensor-, pipeline- or expert-parallel model (a shard) is written as the whole model:
// data-parallel rank 0 of every (stage, tp rank) sends its parameters and moments to rank 0
// (under --ep, data-parallel rank e < E its experts too),
// which puts them together and writes the same files one process would (so any layout,
// one process included, resumes from them). They are streamed: rank 0 holds one whole
// parameter, or one unit's moments, at a time beside its own shard (see checkpoint.cc).
std::string save_checkpoint(const std::string& out_dir, const nn::Transformer& model, optim::Optimizer& opt,
                            const TrainingState& state, const dist::World& world, const ShardLayout& layout = {});

// `path` is a checkpoint directory or an out_dir with a `latest` file.
std::string resolve_checkpoint(const std::string& path);
// The step directory <out_dir>/latest names (LF or CRLF), or "" when there is no `latest`;
// its ".old" when a save killed between moving the old directory aside and renaming the new
// one in left only that. A `latest` that holds no plain directory name is an error naming
// `flag` and `out_dir`.
std::string latest_step_dir(const std::string& out_dir, const char* flag);
// An exclusive lock on an --out-dir, for the run that saves into it: flock(2) on
// "<out_dir>/.tally.lock", whose bytes are the holder's pid. It is released when the object
// is destroyed or reset, or when the process ends, however it ends (a killed run leaves no
// stale lock). Another run may then neither save there nor repair the directory
// (recover_out_dir removes the temporaries of unfinished saves, which a live run's are).
class OutDirLock {
 public:
  OutDirLock() = default;
  // Takes the lock if no other process (or open of the file) holds it; otherwise returns
  // an unheld lock naming the holder's pid. A lock file it cannot open is an error naming
  // the directory.
  static OutDirLock try_take(const std::string& out_dir);
  OutDirLock(OutDirLock&& other) noexcept;
  OutDirLock& operator=(OutDirLock&& other) noexcept;
  OutDirLock(const OutDirLock&) = delete;
  OutDirLock& operator=(const OutDirLock&) = delete;
  ~OutDirLock();
  bool held() const { return fd_ >= 0; }
  // Who holds it when held() is false: the pid in the lock file (0 if unreadable).
  long holder() const { return holder_; }

 private:
  int fd_ = -1;
  long holder_ = 0;
};

// Repairs what a killed save can leave in `out_dir` (run by the writer before training):
// a step directory moved aside as "<step>.old" while its replacement was not yet in place
// is moved back, and the temporaries of unfinished writes are removed (a file's only when
// the process that wrote it is gone).
void recover_out_dir(const std::string& out_dir);
// The checkpoints an earlier run left in `out_dir`: when it has a `latest`, its step
// directories (step_<digits> holding a state.bin; by name, in step order) and "latest";
// empty otherwise (a step directory without `latest` is a first save a kill interrupted).
std::vector<std::string> checkpoints_in(const std::string& out_dir);
// Removes them (a fresh run's --overwrite).
void remove_checkpoints(const std::string& out_dir);
// After saving `newest` (a step directory of `out_dir`, which `latest` names): removes
// this run's checkpoints of earlier steps but the `keep` - 1 newest (--keep-last). This
// run's: those at or before `resumed_step` (its past) and the steps it saved
// (`saved_steps`). A run resumed from an earlier checkpoint leaves the abandoned run's later
// ones alone and does not count them (it kept one of those and removed its own). Returns
// the removed directories' names, oldest first.
std::vector<std::string> remove_older_checkpoints(const std::string& out_dir, const std::string& newest, int64_t keep,
                                                  int64_t resumed_step, const std::vector<int64_t>& saved_steps);
// Loads the weights (configs must match; errors name the file). Returns the CRC-32 of the
// weight bytes read (the whole file's, also for a shard).
uint32_t load_checkpoint_model(const std::string& dir, nn::Transformer& model);
// The recipe saved with a checkpoint (empty for checkpoints older than recipes). Only a
// checkpoint's state.bin knows whether one must be there: load_checkpoint_state checks.
std::vector<std::pair<std::string, std::string>> load_checkpoint_recipe(const std::string& dir);
// Loads the optimizer moments and step count and returns the training state. A shard
// (tensor or pipeline parallel) takes its slices of the whole model's moments.
TrainingState load_checkpoint_state(const std::string& dir, const nn::Transformer& model, optim::Optimizer& opt);

}  // namespace tally::io
