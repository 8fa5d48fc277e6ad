#include "train/dry_run.h"

#include <algorithm>

#include "autograd/grad_mode.h"
#include "core/checked.h"
#include "data/loader.h"
#include "dist/step_engine.h"
#include "nn/llmc_layout.h"
#include "optim/adamw.h"
#include "runtime/backend.h"
#include "sanitizer/sanitizer.h"
#include "memory/report.h"
#include "train/plan.h"
#include "train/run_setup.h"

namespace tally::train {

namespace {

// One step as the trainer runs it (train/trainer.cc), its peak and who held it.
DryRunStep run_step(int64_t step, const TrainConfig& c, dist::StepEngine& engine, data::BatchSource& batches,
                    memory::Ledger& ledger) {
  sanitizer::Sanitizer off(sanitizer::SanitizeMode::Off, {engine.model().device()});
  ledger.reset_peaks();
  off.begin_step(step);
  engine.forward_backward(step, batches, off);
  engine.finalize_grads();
  const double norm = engine.grad_norm();
  engine.optimizer_step(learning_rate(c.optimizer, c.batch.steps, step), optim::clip_scale(norm, c.optimizer.grad_clip));
  off.end_step();
  engine.synchronize();
  return {ledger.stats().peak_allocated, ledger.peak_owners(), ledger.peak_moment()};
}

// One validation batch as train::Evaluator::validate runs each.
DryRunStep run_validation(dist::StepEngine& engine, data::BatchSource& batches, memory::Ledger& ledger) {
  ledger.reset_peaks();
  {
    autograd::InferenceModeGuard inference;
    OwnerScope scope("eval");
    const PhaseMark phase("validation");
    engine.evaluate(batches.batch_from(0));
  }
  engine.synchronize();
  return {ledger.stats().peak_allocated, ledger.peak_owners(), ledger.peak_moment()};
}

// A --mem-trace run's host history is the real run's: the few host scalars the dry run's
// collectives make stay out of it (their steps are the dry run's, not the run's).
class HostHistoryPaused {
 public:
  HostHistoryPaused()
      : host_(runtime::ledger(Device::cpu())), enabled_(host_.history_enabled()), stacks_(host_.history_stacks()) {
    host_.enable_history(false);
  }
  ~HostHistoryPaused() { host_.enable_history(enabled_, stacks_); }
  HostHistoryPaused(const HostHistoryPaused&) = delete;
  HostHistoryPaused& operator=(const HostHistoryPaused&) = delete;

 private:
  memory::Ledger& host_;
  bool enabled_, stacks_;
};

}  // namespace

std::string dry_run_refusal(const TrainConfig& c) {
  if (c.compute.device.is_meta()) return "the dry run stands in for a real device, not --device " + c.compute.device.str();
  return "";
}

const DryRunStep* DryRun::peak() const {
  const DryRunStep* peak = nullptr;
  for (const DryRunStep& s : steps)
    if (!peak || s.peak_bytes >= peak->peak_bytes) peak = &s;
  if (validation.peak_bytes > (peak ? peak->peak_bytes : 0)) peak = &validation;
  return peak;
}

TrainConfig with_planned_microbatches(const TrainConfig& c) {
  TrainConfig planned = c;
  const int64_t enough = c.parallel.pp > 1 ? 4 * c.parallel.pp * c.parallel.virtual_stages : 2;
  if (c.parallel.pp_schedule != dist::PipelineSchedule::GPipe)
    planned.batch.grad_accum = std::min(c.batch.grad_accum, enough);
  return planned;
}

std::vector<int> dry_run_roles(const TrainConfig& c, int64_t world) {
  const ParallelismConfig& p = c.parallel;
  const int64_t per_stage = world / std::max(p.pp, 1);
  std::vector<int> ranks;
  for (int stage = 0; stage < p.pp; ++stage) ranks.push_back(static_cast<int>(stage * per_stage));
  return ranks;
}

DryRun dry_run(const TrainConfig& config, const nn::TransformerConfig& model, bool validates, int64_t world_size,
               int rank) {
  const ParallelismConfig& p = config.parallel;
  const std::string refusal = dry_run_refusal(config);
  TALLY_CHECK(refusal.empty(), refusal);
  // The microbatch's logits, its largest activation: a batch too large to count names the
  // flags that make it.
  checked_product({config.batch.batch_size, config.batch.seq_len, model.padded_vocab_size, 4}, "the activations of --batch-size ",
                  config.batch.batch_size, " x --seq-len ", config.batch.seq_len, " tokens a microbatch");
  TrainConfig c = config;
  c.on_microbatch_loss = nullptr;  // the run's own hook sees the run's losses, not these
  c.compute.device = Device::meta(config.compute.device.type);
  memory::Ledger& ledger = runtime::ledger(c.compute.device);
  TALLY_CHECK(ledger.stats().allocated == 0, "a dry run is under way in this process already (",
              ledger.stats().allocated, " bytes live on ", c.compute.device.str(), ")");
  ledger.reset_peaks();
  ledger.track_peak_owners(true);
  // A world that stands in for the rank, on communicators that move nothing (a run under
  // mpirun plans one rank of its own), and the clock put back afterwards: the steps it
  // runs are not the real run's.
  std::unique_ptr<dist::World> world =
      dist::World::stand_in({p.dp, p.tp, p.pp, p.cp, p.ep}, static_cast<int>(world_size), rank);
  const Clock::Reading clock = Clock::now();
  const HostHistoryPaused host_history;
  DryRun run;
  run.rank = rank;
  run.stage = world->pp_rank();
  // At a capacity every expert takes its capacity's rows whatever the routing: exact.
  if (model.n_experts > 0 && c.compute.moe_capacity_factor == 0)
    run.bound = "experts' routing at the balanced bound: each of the " + std::to_string(model.n_experts) +
                " experts takes 1/" + std::to_string(model.n_experts) + " of the tokens' " +
                std::to_string(model.experts_per_token) + " choices (a skewed routing enlarges the busiest expert's "
                "GEMMs and their transients" + (p.ep > 1 ? ", and under --ep the rows a rank receives" : "") +
                "; --moe-capacity-factor fixes them)";
  {
    // Set-up fills the model one whole parameter at a time through a scratch (values:
    // none, on the meta device).
    dist::StepEngine engine(*world, engine_config(c, model), [](nn::Transformer& m) {
      nn::fill_whole_parameters(m, [](const nn::LlmcTensor&, size_t, const nn::ParameterSpec&, const Tensor&) {});
    });
    // The loader's buffers, as RunData opens them after the engine: training's, and
    // validation's when the run validates, on the host (a GPU's step copies each batch).
    const Device host = Device::meta(DeviceType::CPU);
    data::ShapeOnlyBatches train(c.batch.batch_size, c.batch.seq_len, host);
    std::unique_ptr<data::ShapeOnlyBatches> val;
    if (validates) val = std::make_unique<data::ShapeOnlyBatches>(c.batch.batch_size, c.batch.seq_len, host);
    run.setup_peak_bytes = engine.setup_peak_bytes();
    for (int64_t step = 0; step < std::min<int64_t>(2, c.batch.steps); ++step)
      run.steps.push_back(run_step(step, c, engine, train, ledger));
    if (val) run.validation = run_validation(engine, *val, ledger);
  }
  runtime::backend(c.compute.device).end_stand_in();
  ledger.track_peak_owners(false);
  Clock::set(clock.step, clock.microbatch);
  return run;
}

std::string moment_text(const memory::PeakMoment& m) {
  const OwnerTag& o = m.owner;
  std::string out = o.step >= 0 ? "step " + std::to_string(o.step + 1) : "set-up";
  const std::string phase = *m.phase ? m.phase : o.step >= 0 ? "between phases" : "";
  if (!phase.empty()) out += ", " + phase;
  if (o.microbatch >= 0) out += " of microbatch " + std::to_string(o.microbatch + 1);
  return out + ", allocating " + o.name_str() + " (" + category_name(o.category) + ")";
}

std::string dry_run_text(const DryRun& run, bool name_rank) {
  std::string out = "dry run (the real steps on the meta device)";
  if (name_rank) out += ", rank " + std::to_string(run.rank) + " (pipeline stage " + std::to_string(run.stage) + ")";
  out += ":";
  for (size_t s = 0; s < run.steps.size(); ++s)
    out += (s ? ", step " : " step ") + std::to_string(s + 1) + " " + memory::format_bytes(run.steps[s].peak_bytes);
  if (run.validation.peak_bytes > 0) out += ", validation " + memory::format_bytes(run.validation.peak_bytes);
  out += "\n";
  if (!run.bound.empty()) out += "  planned at a declared bound: " + run.bound + "\n";
  if (run.steps.empty()) return out;
  const DryRunStep& peak = *run.peak();
  const std::vector<memory::OwnerBytes>& owners = peak.at_peak;
  const memory::PlanParts kinds = peak_parts(peak);
  out += "  the peak: " + moment_text(peak.moment) + "\n";
  out += &peak == &run.validation ? std::string("  at validation's peak:")
                                  : "  at step " + std::to_string(&peak - run.steps.data() + 1) + "'s peak:";
  for (size_t k = 0; k < kinds.size(); ++k) out += (k ? ", " : " ") + kinds[k].first + " " + memory::format_bytes(kinds[k].second);
  out += "\n  largest owners:";
  for (size_t i = 0; i < std::min<size_t>(5, owners.size()); ++i)
    out += (i ? ", " : " ") + name_of(owners[i].name) + " " + memory::format_bytes(owners[i].bytes);
  return out + "\n";
}

}  // namespace tally::train
