#include "train/trainer.h"

#include <cmath>
#include <cstdio>
#include <exception>

#include "dist/step_engine.h"
#include "optim/adamw.h"
#include "runtime/backend.h"
#include "runtime/profiler.h"
#include "train/checkpointer.h"
#include "train/evaluation.h"
#include "train/memory_trace.h"
#include "train/peak_report.h"
#include "train/run_data.h"
#include "train/run_setup.h"

namespace tally::train {

namespace {

// A non-finite loss or gradient would silently turn every parameter into NaN.
void check_finite(int64_t step, double loss, double norm) {
  TALLY_CHECK(std::isfinite(loss) && std::isfinite(norm), "step ", step + 1, ": loss ", loss, ", gradient norm ", norm,
              " is not finite; stopping before the update (try a lower --lr or --grad-clip)");
}

// The full parameter block in its order, on every rank (ZeRO-3 gathers each unit).
Tensor gather_parameters(const nn::Transformer& model) {
  const nn::ParameterStore& params = model.params();
  Tensor out = Tensor::empty({params.numel()}, DType::F32, Device::cpu(), make_owner(Category::Other, "final_parameters"));
  nn::ParameterResidency* residency = model.residency();
  for (size_t u = 0; u < params.num_units(); ++u) {
    if (residency) residency->acquire(u, false);
    const nn::ParameterUnit& unit = params.unit(u);
    for (size_t i = unit.first; i < unit.last; ++i)
      make_view(out, {params[i].numel()}, {1}, params.offset(i)).copy_(params[i].reshape({-1}).detach());
    if (residency) residency->release(u, false);
  }
  return out;
}

void say(const TrainConfig& c, const dist::World& world, const std::string& line) {
  if (!c.metrics.quiet && world.is_root()) std::printf("%s\n", line.c_str()), std::fflush(stdout);
}

}  // namespace

TrainResult run_training(const TrainConfig& c, const OnStep& on_step) {
  std::unique_ptr<dist::World> world = dist::World::create({c.parallel.dp, c.parallel.tp, c.parallel.pp, c.parallel.cp, c.parallel.ep});
  return run_training(c, *world, on_step);
}

TrainResult run_training(const TrainConfig& c, const dist::World& world, const OnStep& on_step) {
  RunSetup setup(c, world);
  const double gemm_peak = probe_gemm_peak(c, world.is_root());
  MemoryTrace trace(c.memory.trace, c.compute.device, world);
  runtime::ledger(c.compute.device).reset_peaks();  // set-up's peak is this run's (a process may have trained before)
  Settings recipe = run_recipe(c, world);
  setup.check_ranks_agree_on(recipe);
  dist::StepEngine engine(world, engine_config(c, setup.model()), setup.fill_weights());
  setup.check_weights_agree();
  RunData data(c, world, setup.model());
  // A resume on other training data would not continue the run (the batches differ).
  recipe.emplace_back("--train-data's token count", std::to_string(data.train().total_tokens()));
  Evaluator evaluator(c, world, setup.model());
  Checkpointer checkpointer(c, world, engine, recipe);
  if (!setup.resume_dir().empty()) checkpointer.resume(setup.resume_dir(), evaluator.sample_rng());
  const int64_t start = checkpointer.start_step(), steps = c.batch.steps;
  PeakReport peaks(c, world, engine, setup.model(), data.val() != nullptr);
  trace.set_plan(peaks.parts());
  Metrics metrics(c, world, engine, data, setup.model(), gemm_peak, peaks.rank_planned_peaks(), start,
                  setup.resume_dir(), checkpointer.resumed_history(), setup.continues());
  sanitizer::Sanitizer sanitizer(c.memory.sanitize, sanitized_devices(c.compute.device));
  sanitizer.keep_boundaries(c.memory.keep_boundaries);
  runtime::profiler::enable(c.compute.profile_ops);
  setup.remove_earlier_checkpoints(c.metrics.quiet);
  if (start >= steps) say(c, world, "nothing to train: the run is at step " + std::to_string(start) + " of --steps " + std::to_string(steps));
  TrainResult result;
  for (int64_t step = start; step < steps; ++step) {
    metrics.begin_step();
    sanitizer.begin_step(step);
    const double loss = engine.forward_backward(step, data.train(), sanitizer);
    engine.finalize_grads();
    const double norm = engine.grad_norm();
    check_finite(step, loss, norm);
    const double lr = learning_rate(c.optimizer, steps, step);
    engine.optimizer_step(lr, optim::clip_scale(norm, c.optimizer.grad_clip));
    sanitizer.end_step();
    engine.synchronize();
    const StepMetrics& m = metrics.end_step(step, loss, norm, lr);
    if (peaks.due(step, start)) peaks.report(m, metrics.rank_stats(), checkpointer.resume_peak_bytes());
    metrics.print_step();
    const bool last = step + 1 == steps;
    if (evaluator.validates_at(m.step, last, data)) {
      metrics.begin_validation();
      metrics.record_val(result.final_val_loss = evaluator.validate(engine, data));
    }
    const std::exception_ptr sample_error = evaluator.samples_at(m.step, last) ? evaluator.sample(engine, last) : nullptr;
    metrics.write_row();
    if (checkpointer.saves_at(m.step, last)) {
      metrics.sync_logs();
      checkpointer.save(m.step, metrics.curve(), evaluator.sample_rng());
      metrics.commit_logs();
    }
    if (sample_error) std::rethrow_exception(sample_error);
    result.history.push_back(m);
    result.final_loss = m.loss;
    result.steps_run++;
    if (on_step) on_step(m);
  }
  sanitizer.end_run();
  result.boundaries = sanitizer.boundaries();
  if (metrics.has_best_val()) result.best_val_loss = metrics.best_val(), result.best_val_step = metrics.best_val_step();
  metrics.finish(result.steps_run, checkpointer.last());
  result.last_checkpoint = checkpointer.last();
  if (c.return_parameters && engine.holds_whole_model()) result.parameters = gather_parameters(engine.model());
  trace.write_at_end(c.metrics.quiet);
  result.setup_peak_bytes = peaks.setup_peak_bytes();
  result.predicted_setup_bytes = peaks.predicted_setup_bytes();
  result.resume_peak_bytes = peaks.resume_peak_bytes();
  return result;
}

}  // namespace tally::train
