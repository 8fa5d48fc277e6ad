#include "train/checkpointer.h"

#include <charconv>
#include <cstdio>

#include "core/crash_point.h"
#include "io/checkpoint.h"
#include "memory/report.h"
#include "runtime/backend.h"

namespace tally::train {

namespace {

std::string exact(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// A recipe's number as one would type it: kept as %.17g (compared exactly), 3e-4 reads
// 0.00029999999999999997. Whole numbers and words are shown as they are.
std::string readable(const std::string& value) {
  if (value.find_first_of(".e") == std::string::npos) return value;
  double x = 0;
  const char* end = value.data() + value.size();
  const auto [stop, error] = std::from_chars(value.data(), end, x);
  if (error != std::errc() || stop != end) return value;
  char text[32];
  return std::string(text, std::to_chars(text, text + sizeof(text), x).ptr);
}

void log(const TrainConfig& c, const dist::World& world, const std::string& line) {
  if (c.metrics.quiet || !world.is_root()) return;
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

}  // namespace

// The data's path is not part of the recipe: it may differ between machines of one job,
// or after the shards were moved.
Settings run_recipe(const TrainConfig& c, const dist::World& world) {
  const OptimizerConfig& o = c.optimizer;
  return {{"--batch-size", std::to_string(c.batch.batch_size)},
          {"--seq-len", std::to_string(c.batch.seq_len)},
          {"microbatches per step (--grad-accum x --dp)", std::to_string(c.batch.grad_accum * world.dp())},
          {"--steps", std::to_string(c.batch.steps)},
          {"--lr", exact(o.lr)},
          {"--warmup-steps", std::to_string(o.warmup_steps)},
          {"--lr-schedule", lr_schedule_name(o.schedule)},
          {"--min-lr-frac", exact(o.min_lr_frac)},
          {"--weight-decay", exact(o.weight_decay)},
          {"--beta1", exact(o.beta1)},
          {"--beta2", exact(o.beta2)},
          {"--eps", exact(o.eps)},
          {"--grad-clip", exact(o.grad_clip)},
          {"--seed", std::to_string(c.seed)},
          {"--shuffle", c.data.shuffle ? "on" : "off"},
          {"--dtype", c.compute.dtype == DType::BF16 ? "bf16" : "fp32"},
          {"--moe-capacity-factor", exact(c.compute.moe_capacity_factor)},
          {"--moe-balance-loss-coef", exact(c.compute.moe_balance_loss_coef)},
          {"--moe-z-loss-coef", exact(c.compute.moe_z_loss_coef)}};
}

// Checkpoints older than saved recipes have none and compare equal. A setting added to
// the recipe later is missing from the recipes saved before it, which ran with its old
// behaviour: it compares as that value (--shuffle: off).
std::string recipe_changes(const Settings& saved, const Settings& now) {
  static const Settings added_later = {{"--shuffle", "off"},
                                       {"--moe-capacity-factor", "0"},
                                       {"--moe-balance-loss-coef", "0"},
                                       {"--moe-z-loss-coef", "0"}};
  std::string out;
  for (const auto& [name, value] : now) {
    const std::string* was = nullptr;
    for (const auto& [saved_name, saved_value] : saved)
      if (saved_name == name) was = &saved_value;
    if (!was && !saved.empty())
      for (const auto& [added, old_behaviour] : added_later)
        if (added == name) was = &old_behaviour;
    if (was && *was != value)
      out += (out.empty() ? "" : ", ") + name + " was " + readable(*was) + ", now " + readable(value);
  }
  return out;
}

Checkpointer::Checkpointer(const TrainConfig& c, const dist::World& world, dist::StepEngine& engine, Settings recipe)
    : c_(c), world_(world), engine_(engine), recipe_(std::move(recipe)) {}

void Checkpointer::resume(const std::string& dir, Rng& sample_rng) {
  const std::string& flag = c_.checkpoint.resume;
  io::TrainingState st = io::load_checkpoint_state(dir, engine_.model(), engine_.optimizer());
  resume_peak_ = runtime::ledger(c_.compute.device).stats().peak_allocated;
  check_ranks_agree(world_, {{"--resume's state.bin (CRC-32 of its contents)", std::to_string(st.content_crc)}});
  TALLY_CHECK(st.step <= c_.batch.steps, "--resume '", flag, "': the checkpoint is at step ", st.step, ", beyond --steps ",
              c_.batch.steps, "; to train further, raise --steps with --allow-recipe-change (--steps is part of the run's "
              "recipe: its learning-rate schedule ends there)");
  const std::string changes = recipe_changes(st.recipe, recipe_);
  TALLY_CHECK(changes.empty() || c_.checkpoint.allow_recipe_change, "--resume '", flag,
              "': this run would not continue the checkpoint's run exactly: ", changes,
              ". Use the checkpoint's settings, or pass --allow-recipe-change to continue anyway");
  if (!changes.empty()) log(c_, world_, "resuming with a changed recipe (--allow-recipe-change): " + changes);
  start_step_ = st.step;
  resumed_history_ = std::move(st.history);
  sample_rng.set_state(st.rng_state);
  log(c_, world_, "resumed from " + dir + " at step " + std::to_string(start_step_));
}

bool Checkpointer::saves_at(int64_t step, bool last) const {
  const int64_t every = c_.checkpoint.save_every;
  return every > 0 && (step % every == 0 || last);
}

void Checkpointer::save(int64_t step, const RunCurve& curve, const Rng& sample_rng) {
  io::TrainingState st;
  st.step = step;
  st.rng_state = sample_rng.state();
  st.recipe = recipe_;
  st.history = curve_to_json(curve);
  // What writing holds beside the run's live memory (the next step resets the peak).
  memory::Ledger& ledger = runtime::ledger(c_.compute.device);
  ledger.reset_peaks();
  const int64_t live_before = ledger.stats().allocated;
  last_ = io::save_checkpoint(c_.checkpoint.out_dir, engine_.model(), engine_.optimizer(), st, world_,
                              [this](int pp_rank, int tp_rank, int ep_rank) {
                                return engine_.shard_of(pp_rank, tp_rank, ep_rank);
                              });
  const double held = world_.world().all_reduce_scalar(static_cast<double>(ledger.stats().peak_allocated - live_before),
                                                       dist::ReduceOp::Max);
  log(c_, world_, "saved " + last_ + " (writing held " + memory::format_bytes(static_cast<int64_t>(held)) +
                      " beside the live memory" + (world_.size() > 1 ? ", largest over ranks" : "") + ")");
  keep_last(step);
  crash_point("checkpoint", step);
}

void Checkpointer::keep_last(int64_t step) {
  const int64_t keep = c_.checkpoint.keep_last;
  if (keep == 0 || !world_.is_root()) return;
  saved_steps_.push_back(step);
  const std::vector<std::string> removed =
      io::remove_older_checkpoints(c_.checkpoint.out_dir, last_, keep, start_step_, saved_steps_);
  if (removed.empty()) return;
  log(c_, world_, "removed " + std::to_string(removed.size()) + " older checkpoint" + (removed.size() == 1 ? "" : "s") +
                      " (--keep-last " + std::to_string(keep) + "): " + removed.front() +
                      (removed.size() > 1 ? " ... " + removed.back() : ""));
}

}  // namespace tally::train
