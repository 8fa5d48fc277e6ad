// What a run says about itself as it trains: the start-up lines, one line and one JSONL
// row a step (--log-json), the loss plot (<out-dir>/loss.svg) and the summary at the end.
// Rank 0 prints and writes the job's rows; with --log-json-all-ranks every rank also
// writes its own. Metrics take values, never tensors (memory contract R4).
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dist/step_engine.h"
#include "memory/ledger.h"
#include "runtime/profiler.h"
#include "train/config.h"
#include "train/plot.h"
#include "train/run_data.h"
#include "train/step_log.h"

namespace tally::train {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double ms = 0;
  double tokens_per_s = 0;
  double gemm_peak_frac = 0;
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t live_after_forward_bytes = 0;  // measured: model states + loader + one microbatch's saved activations
  int64_t predicted_peak_bytes = 0;      // the memory plan's (plan.h), the maximum over ranks like peak_bytes
  std::vector<int64_t> rank_peak_bytes;  // one per rank (live_bytes and peak_bytes are the maxima)
  std::vector<int64_t> rank_predicted_peak_bytes;  // the plan's, one per rank
  int64_t peak_rss_bytes = 0;            // the process's resident-set high-water mark (maximum over ranks)
  double bubble_frac = 0;                // pipeline: the share of the step stages wait for a neighbour (mean over ranks)
  std::vector<double> rank_idle_frac;    // pipeline: that share on each rank
  int64_t max_in_flight = 0;             // pipeline: most microbatches one stage held at once (maximum over ranks)
  int64_t tp_payload_bytes = 0;          // tensor parallel: bytes handed to the tp group's collectives this step (rank 0)
  int64_t cp_payload_bytes = 0;          // context parallel: bytes handed to the cp group's collectives this step (rank 0)
  double cp_comm_s = 0;                  // context parallel: seconds those collectives ran (rank 0)
  int64_t ep_payload_bytes = 0;          // expert parallel: bytes rank 0 sent by all-to-all this step
  double ep_comm_s = 0;                  // expert parallel: seconds those all-to-alls ran (rank 0)
  double aux_loss = -1;                  // the router's load-balancing loss (negative: the model adds none)
  double balance_loss = -1;              // --moe-balance-loss-coef's loss over the sparse layers (negative: off)
  double z_loss = -1;                    // --moe-z-loss-coef's loss over the sparse layers (negative: off)
  double ce_loss = 0;                    // with any of them: the cross-entropy part of `loss`
  int64_t expert_load_min = -1, expert_load_max = -1;  // choices one expert of one layer took (-1: no experts)
  int64_t expert_dropped = 0;  // (token, expert) pairs dropped past the experts' capacity (--moe-capacity-factor)
  int64_t pp_sent_bytes = 0;             // pipeline: activation and gradient bytes rank 0 sent this step
  int64_t val_peak_bytes = 0;            // this rank's peak while it validated after the step (0: it did not)
  runtime::profiler::Report ops;         // --profile-ops: this rank's time per phase and kernel
};

// The GEMM peak every step line compares with, probed (and kept) before anything of the
// run is allocated: its operands are no part of the run's memory.
double probe_gemm_peak(const TrainConfig& config, bool say_notes);

class Metrics {
 public:
  // Prints the lines that say what the run will do (the model, the data and its order,
  // the layout, the threads), opens the logs (a fresh run's start empty; a resumed run's
  // keep their rows up to `start_step`), and takes the run's record so far from
  // `resumed_history` (a checkpoint's history.json) or, from a checkpoint older than
  // that, from the log.
  Metrics(const TrainConfig& config, const dist::World& world, const dist::StepEngine& engine, const RunData& data,
          const nn::TransformerConfig& model, double gemm_peak, std::vector<int64_t> rank_planned_peaks,
          int64_t start_step, const std::string& resume_dir, const std::string& resumed_history, bool continues);

  void begin_step();
  // Measures the step just taken (collective: maxima over ranks) and starts its JSONL row.
  const StepMetrics& end_step(int64_t step, double loss, double grad_norm, double lr);
  // The step's line (and, with --profile-ops, where its time went).
  void print_step() const;
  // This rank's memory statistics as the step ended.
  const memory::Stats& rank_stats() const { return rank_stats_; }
  // Validation after a step: its peak is measured from here to record_val.
  void begin_validation();
  void record_val(double loss);
  // The step's JSONL row, written before the step's checkpoint: a checkpointed step always
  // has its row.
  void write_row();
  void sync_logs();    // before a checkpoint: the rows so far survive a crash
  void commit_logs();  // after a checkpoint, and at the end: this run's history is the log's

  const RunCurve& curve() const { return curve_; }
  // The run's lowest validation loss so far (a resumed one's included), and its step.
  bool has_best_val() const;
  double best_val() const { return best_val_; }
  int64_t best_val_step() const { return best_val_step_; }
  // The summary lines (steps, time, tokens, best validation, where the files are; the
  // run's peak memory against the plan), and the plot once more.
  void finish(int64_t steps_run, const std::string& last_checkpoint);

 private:
  void log(const std::string& line) const;
  void print_start() const;
  void open_logs(int64_t start_step);
  void take_record(int64_t start_step, const std::string& resume_dir, const std::string& resumed_history);
  void measure_memory(StepMetrics& m);
  void measure_pipeline(StepMetrics& m);
  void start_row(const StepMetrics& m);
  void write_plot() const;

  const TrainConfig& c_;
  const dist::World& world_;
  const dist::StepEngine& engine_;
  const RunData& data_;
  nn::TransformerConfig model_;
  double gemm_peak_;
  bool gemm_peak_probed_again_ = false;
  std::vector<int64_t> rank_planned_peaks_;
  double rank_step_flops_ = 0;  // this rank's share of the model's work in a step
  int64_t tokens_per_step_ = 0;  // over all data-parallel ranks
  std::unique_ptr<StepLog> json_log_, rank_json_log_;
  bool log_is_stream_ = false;
  RunCurve curve_;
  std::string plot_path_;
  bool plot_is_anothers_ = false;
  double best_val_;
  int64_t best_val_step_ = 0;
  int64_t tokens_seen_ = 0;
  std::chrono::steady_clock::time_point run_start_, step_start_;
  int64_t start_step_ = 0;
  int64_t run_peak_ = 0;  // the largest step peak of the run (largest over ranks)
  memory::Stats rank_stats_;
  StepMetrics last_;
  nlohmann::json row_;
};

// "1h02m", "3m05s", "12s".
std::string duration_str(double seconds);

}  // namespace tally::train
