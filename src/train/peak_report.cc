#include "train/peak_report.h"

#include <cmath>
#include <cstdio>

#include "memory/report.h"
#include "runtime/backend.h"
#include "train/dry_run.h"

namespace tally::train {

using memory::format_bytes;

namespace {
std::string fmt(const char* format, auto... args) {
  char buf[1024];
  std::snprintf(buf, sizeof buf, format, args...);
  return buf;
}
}  // namespace

PeakReport::PeakReport(const TrainConfig& c, const dist::World& world, const dist::StepEngine& engine,
                       const nn::TransformerConfig& model, bool validates)
    : c_(c), world_(world), engine_(engine) {
  // The dry run stands in for this rank (train/dry_run.h): its steady step's peak, and at
  // it the kinds of memory alive; set-up's peak, the largest over ranks.
  const DryRun dry = dry_run(c, model, validates, world.size(), world.rank());
  planned_peak_ = dry.steps.empty() ? 0 : dry.steps.back().peak_bytes;
  for (double p : world.world().all_gather_scalar(static_cast<double>(planned_peak_)))
    rank_planned_peaks_.push_back(static_cast<int64_t>(p));
  predicted_setup_ = static_cast<int64_t>(
      world.world().all_reduce_scalar(static_cast<double>(dry.setup_peak_bytes), dist::ReduceOp::Max));
  if (!dry.steps.empty()) parts_ = peak_parts(dry.steps.back());
  // Dropless experts are planned at a declared routing bound only (`tally plan` says
  // which): the plan says so rather than warn.
  if (!dry.bound.empty())
    unplanned_ = "dropless experts are planned at the balanced routing bound; the real routing moves the peak "
                 "(exact at a --moe-capacity-factor)";
  // Who holds the peak, for the check against the plan after the second step.
  runtime::ledger(c.compute.device).track_peak_owners(true);
}

void PeakReport::log(const std::string& line) const {
  if (c_.metrics.quiet || !world_.is_root()) return;
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// From the second step on the peak is the steady one (the first also builds caches).
bool PeakReport::due(int64_t step, int64_t start_step) const {
  return step == start_step + 1 || (step == start_step && c_.batch.steps == start_step + 1);
}

void PeakReport::report(const StepMetrics& m, const memory::Stats& s, int64_t resume_peak) {
  const int64_t states = engine_.model_state_bytes();
  if (engine_.pipeline_stats()) {
    log(fmt("memory: measured peak %s (largest over ranks; this rank's %s with params+grads+adam %s); a stage held at "
            "most %lld microbatches at once (%s)",
            format_bytes(m.peak_bytes).c_str(), format_bytes(s.peak_allocated).c_str(), format_bytes(states).c_str(),
            static_cast<long long>(m.max_in_flight), dist::pipeline_schedule_name(c_.parallel.pp_schedule)));
  } else {
    const int64_t after_forward = engine_.live_after_first_forward();
    log(fmt("memory: measured peak %s = live after forward %s (params+grads+adam %s, activations and data of one "
            "microbatch %s) + transients %s",
            format_bytes(s.peak_allocated).c_str(), format_bytes(after_forward).c_str(), format_bytes(states).c_str(),
            format_bytes(after_forward - states).c_str(), format_bytes(s.peak_allocated - after_forward).c_str()));
  }
  compare_with_plan(m, s);
  runtime::ledger(c_.compute.device).track_peak_owners(false);
  report_setup(m, resume_peak);
  report_data_parallel(s);
}

// The largest plan beside the largest peak (rank 0 prints); every rank checks its own.
void PeakReport::compare_with_plan(const StepMetrics& m, const memory::Stats& s) const {
  const double off_max = static_cast<double>(m.peak_bytes - m.predicted_peak_bytes) /
                         static_cast<double>(std::max<int64_t>(m.predicted_peak_bytes, 1));
  log(fmt("memory: planned peak %s (%s%s), measured %s: %+.2f%%", format_bytes(m.predicted_peak_bytes).c_str(),
          "tally plan's dry run", world_.size() > 1 ? "; the largest over ranks, each rank's own checked" : "",
          format_bytes(m.peak_bytes).c_str(), 100.0 * off_max));
  if (!unplanned_.empty()) {
    log("memory: " + unplanned_);
    return;
  }
  const double off = static_cast<double>(s.peak_allocated - planned_peak_) / static_cast<double>(planned_peak_);
  if (std::abs(off) <= 0.05) return;
  const memory::Ledger& ledger = runtime::ledger(c_.compute.device);
  std::fprintf(stderr, "tally: warning: rank %lld's measured peak %s is %+.1f%% off the plan %s: %s; it came at %s; "
               "--mem-trace F.html shows who holds what\n", static_cast<long long>(world_.rank()),
               format_bytes(s.peak_allocated).c_str(), 100.0 * off, format_bytes(planned_peak_).c_str(),
               explain_peak(parts_, ledger.peak_owners()).c_str(), moment_text(ledger.peak_moment()).c_str());
}

void PeakReport::report_setup(const StepMetrics& m, int64_t resume_peak) {
  dist::Communicator& everyone = world_.world();
  setup_peak_ = static_cast<int64_t>(everyone.all_reduce_scalar(static_cast<double>(engine_.setup_peak_bytes()),
                                                                dist::ReduceOp::Max));
  resume_peak_ = static_cast<int64_t>(everyone.all_reduce_scalar(static_cast<double>(resume_peak), dist::ReduceOp::Max));
  if (resume_peak_ > m.peak_bytes)
    log(fmt("memory: reading the checkpoint peaked at %s (largest over ranks), above the steps' peak %s: its optimizer "
            "state is staged one unit at a time beside the model states, which the plan leaves out; a rank needs it "
            "free at start-up",
            format_bytes(resume_peak_).c_str(), format_bytes(m.peak_bytes).c_str()));
  if (predicted_setup_ <= 0) return;
  const char* what = world_.tp() * world_.pp() * world_.ep() > 1 ? "this rank's shard built, one whole parameter read beside it"
                     : c_.parallel.zero == 3        ? "this rank's ZeRO-3 shards, one whole parameter read beside them"
                                                    : "the parameter block and this rank's ZeRO-2 shards: its model states";
  log(fmt("memory: set-up peak %s (largest over ranks: %s), planned %s%s%s", format_bytes(setup_peak_).c_str(), what,
          format_bytes(predicted_setup_).c_str(),
          c_.model.init_from.empty() ? "" : " for the model; reading HuggingFace files adds one file tensor at a time, "
                                            "in the file's dtype and layout, which the plan does not know",
          setup_peak_ > m.peak_bytes ? "; above the steps' peak: each rank needs it free at start-up" : ""));
}

void PeakReport::report_data_parallel(const memory::Stats& s) const {
  const int64_t D = world_.replicas();  // ZeRO shards over data x context parallel
  if (D == 1) return;
  const auto& st = s.allocated_by_category;
  const int64_t held = st[static_cast<int>(Category::Parameter)] + st[static_cast<int>(Category::Gradient)] +
                       st[static_cast<int>(Category::OptimizerState)];
  log(fmt("memory per rank: model states %s by the formula %s (D=%lld), %s in the ledger",
          format_bytes(engine_.model_state_bytes()).c_str(), engine_.model_state_formula().c_str(),
          static_cast<long long>(D), format_bytes(held).c_str()));
  const dist::ReductionStats* r = engine_.all_reduce_stats();
  if (!r) return;
  const double ring = 2.0 * static_cast<double>(D - 1) / static_cast<double>(D) * static_cast<double>(r->payload_bytes);
  log(fmt("all-reduce per step: %s of gradients (4P = %s) in %d buckets; a ring sends 2(D-1)/D of it per rank: %s; "
          "%.0f%% of the %.0f ms all-reduce time was hidden behind backward",
          format_bytes(r->payload_bytes).c_str(), format_bytes(4 * engine_.model().num_parameters()).c_str(), r->buckets,
          format_bytes(static_cast<int64_t>(ring)).c_str(),
          r->comm_seconds > 0 ? 100.0 * r->hidden_seconds / r->comm_seconds : 0.0, r->comm_seconds * 1e3));
}

}  // namespace tally::train
