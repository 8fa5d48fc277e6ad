// The run's memory against its plan: every rank's peak predicted by the dry run
// (train/dry_run.h) before the first step, and after the second step (the first also
// builds caches) the measured peak beside it, with its parts, set-up's and a resume's
// peaks, and what the data-parallel reduction moved. A rank whose peak is more than 5%
// off its plan says so, naming the kind of memory and its largest owner.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dist/step_engine.h"
#include "memory/report.h"
#include "train/config.h"
#include "train/metrics.h"
#include "train/plan.h"

namespace tally::train {

class PeakReport {
 public:
  PeakReport(const TrainConfig& config, const dist::World& world, const dist::StepEngine& engine,
             const nn::TransformerConfig& model, bool validates);

  const std::vector<int64_t>& rank_planned_peaks() const { return rank_planned_peaks_; }
  const memory::PlanParts& parts() const { return parts_; }  // this rank's
  int64_t predicted_setup_bytes() const { return predicted_setup_; }
  // Set-up's measured peak and a resume's (the largest over ranks), once reported.
  int64_t setup_peak_bytes() const { return setup_peak_; }
  int64_t resume_peak_bytes() const { return resume_peak_; }

  // Whether step `step` (from 0) of a run from `start_step` is the one to report.
  bool due(int64_t step, int64_t start_step) const;
  // The report (collective). `rank_stats` is this rank's ledger at the step's end.
  void report(const StepMetrics& m, const memory::Stats& rank_stats, int64_t resume_peak);

 private:
  void log(const std::string& line) const;
  void compare_with_plan(const StepMetrics& m, const memory::Stats& rank_stats) const;
  void report_setup(const StepMetrics& m, int64_t resume_peak);
  void report_data_parallel(const memory::Stats& rank_stats) const;

  const TrainConfig& c_;
  const dist::World& world_;
  const dist::StepEngine& engine_;
  std::vector<int64_t> rank_planned_peaks_;
  int64_t planned_peak_ = 0;  // this rank's
  memory::PlanParts parts_;
  int64_t predicted_setup_ = 0;
  int64_t setup_peak_ = 0, resume_peak_ = 0;
  std::string unplanned_;  // why the plan is a bound here (dropless experts), or empty
};

}  // namespace tally::train
