#include "train/metrics.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "core/crash_point.h"
#include "io/checkpoint.h"
#include "io/files.h"
#include "memory/process.h"
#include "memory/report.h"
#include "runtime/backend.h"

namespace tally::train {

namespace fs = std::filesystem;
namespace profiler = runtime::profiler;
using memory::format_bytes;

namespace {

std::string fmt(const char* format, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, format, args...);
  return buf;
}

// How much of the training data a number of tokens reads: "0.052% of one pass", "87.5% of
// one pass", "2.31 passes" (never an exponent: %g would print 99.7% as "1e+02%").
std::string passes_str(double passes) {
  const double percent = 100.0 * passes;
  if (passes >= 1.0) return fmt("%.2f pass%s", passes, passes == 1.0 ? "" : "es");
  if (percent >= 10) return fmt("%.1f%% of one pass", percent);
  if (percent >= 0.001) return fmt("%.2g%% of one pass", percent);
  return "under 0.001% of one pass";
}

int64_t max_over_ranks(const dist::World& world, int64_t value) {
  return static_cast<int64_t>(world.world().all_reduce_scalar(static_cast<double>(value), dist::ReduceOp::Max));
}

}  // namespace

std::string duration_str(double seconds) {
  const auto s = static_cast<long long>(std::llround(std::max(0.0, seconds)));
  if (s >= 3600) return fmt("%lldh%02lldm", s / 3600, s / 60 % 60);
  if (s >= 60) return fmt("%lldm%02llds", s / 60, s % 60);
  return fmt("%llds", s);
}

double probe_gemm_peak(const TrainConfig& c, bool say_notes) {
  runtime::Backend& backend = runtime::backend(c.compute.device);
  const double peak = backend.measured_gemm_peak_flops(c.compute.dtype);
  const std::string note = backend.gemm_note(c.compute.dtype);
  if (!note.empty() && say_notes) std::fprintf(stderr, "tally: note: %s\n", note.c_str());
  return peak;
}

Metrics::Metrics(const TrainConfig& c, const dist::World& world, const dist::StepEngine& engine, const RunData& data,
                 const nn::TransformerConfig& model, double gemm_peak, std::vector<int64_t> rank_planned_peaks,
                 int64_t start_step, const std::string& resume_dir, const std::string& resumed_history, bool continues)
    : c_(c), world_(world), engine_(engine), data_(data), model_(model), gemm_peak_(gemm_peak),
      rank_planned_peaks_(std::move(rank_planned_peaks)), best_val_(std::numeric_limits<double>::infinity()),
      start_step_(start_step) {
  const BatchConfig& b = c.batch;
  tokens_per_step_ = b.grad_accum * world.dp() * b.batch_size * b.seq_len;
  // Each rank does its share of its batches' work: 1/(tp x pp) of it under model
  // parallelism, 1/cp of each sequence under context parallelism.
  rank_step_flops_ = engine.model().flops_per_token(b.seq_len) * static_cast<double>(b.grad_accum * b.batch_size * b.seq_len) /
                     static_cast<double>(world.tp() * world.pp() * world.cp());
  log_is_stream_ = !c.metrics.log_json.empty() && io::is_stream(c.metrics.log_json);
  print_start();
  open_logs(start_step);
  take_record(start_step, resume_dir, resumed_history);
  // A run that does not save, in an --out-dir holding another run's checkpoints, would
  // replace that run's plot with its own: it draws none, and says so.
  const CheckpointConfig& k = c.checkpoint;
  plot_path_ = (fs::path(k.out_dir) / "loss.svg").string();
  plot_is_anothers_ = world.is_root() && k.save_every == 0 && !continues && !k.overwrite &&
                      !io::checkpoints_in(k.out_dir).empty();
  if (plot_is_anothers_)
    log("loss plot: not drawn: --out-dir '" + k.out_dir + "' holds another run's checkpoints and its loss.svg (give this "
        "run an --out-dir of its own to draw one)");
  run_start_ = std::chrono::steady_clock::now();
}

void Metrics::log(const std::string& line) const {
  if (c_.metrics.quiet || !world_.is_root()) return;
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// Rank 0 writes the job's rows; with --log-json-all-ranks every rank also writes its own.
// A fresh run's log starts empty: per-rank logs an earlier run wrote beside it that this
// run will not rewrite (a rank it does not have, or all of them without
// --log-json-all-ranks) would contradict it, and are removed. (A resumed run's earlier
// rows are the run's own: left.)
void Metrics::open_logs(int64_t start_step) {
  const std::string& path = c_.metrics.log_json;
  if (path.empty()) return;
  if (world_.is_root()) json_log_ = std::make_unique<StepLog>(path, start_step);
  if (world_.is_root() && start_step == 0 && !log_is_stream_) {
    const fs::path log_path(path);
    const std::string prefix = log_path.filename().string() + ".rank";
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(log_path.parent_path().empty() ? fs::path(".") : log_path.parent_path(), ec)) {
      const std::string name = entry.path().filename().string();
      if (name.size() <= prefix.size() || name.rfind(prefix, 0) != 0 ||
          name.find_first_not_of("0123456789", prefix.size()) != std::string::npos)
        continue;
      const int64_t r = std::atoll(name.c_str() + prefix.size());
      if ((!c_.metrics.log_json_all_ranks || r >= world_.size()) && fs::remove(entry.path(), ec))
        log("log: removed " + entry.path().string() + ", an earlier run's log of rank " + std::to_string(r));
    }
  }
  if (c_.metrics.log_json_all_ranks)
    rank_json_log_ = std::make_unique<StepLog>(path + ".rank" + std::to_string(world_.rank()), start_step);
}

// The run's record, drawn into <out-dir>/loss.svg and saved with every checkpoint: a
// resumed run's earlier steps come from its checkpoint (or, from a checkpoint older than
// that record, from its log), and so does its best validation loss so far. The tokens
// seen go on from that record (step x tokens a step is wrong after a resume that changed
// the batch).
void Metrics::take_record(int64_t start_step, const std::string& resume_dir, const std::string& resumed_history) {
  tokens_seen_ = start_step * tokens_per_step_;
  if (start_step == 0) return;
  RunCurve earlier;
  const std::string& path = c_.metrics.log_json;
  std::error_code ec;
  if (!resumed_history.empty()) earlier = curve_from_json(resumed_history, resume_dir + "/history.json");
  else if (world_.is_root() && !path.empty() && !log_is_stream_ && fs::file_size(path, ec) > 0 && !ec)
    earlier = read_run_log(path, "");
  else if (world_.is_root())
    log("loss plot: the checkpoint '" + resume_dir + "' holds no record of steps 1-" + std::to_string(start_step) +
        " (its state predates history.json) and no log of them was given: the plot starts at step " +
        std::to_string(start_step + 1));
  for (size_t i = 0; i < earlier.steps.size() && earlier.steps[i] <= start_step; ++i)
    curve_.add_step(earlier.steps[i], earlier.loss[i], earlier.lr[i], earlier.tokens[i]);
  for (auto& [step, v] : earlier.val)
    if (step <= start_step) {
      curve_.add_val(step, v);
      if (v < best_val_) best_val_ = v, best_val_step_ = step;
    }
  if (!curve_.steps.empty() && curve_.steps.back() == start_step && curve_.tokens.back() > 0)
    tokens_seen_ = curve_.tokens.back();
}

void Metrics::print_start() const {
  const BatchConfig& b = c_.batch;
  const OptimizerConfig& o = c_.optimizer;
  const data::TokenLoader& train = data_.train();
  const bool root = world_.is_root();
  log(fmt("model: %s, %lld parameters", model_.describe().c_str(),
          static_cast<long long>(nn::Transformer::layout_only(model_).num_parameters())));
  log(fmt("data: %lld train tokens in %zu shard(s)%s; step = %lld rank(s) x %lld microbatch(es) x %lld x %lld = %lld tokens",
          static_cast<long long>(train.total_tokens()), train.files().size(),
          data_.val() ? (", " + std::to_string(data_.val()->total_tokens()) + " val tokens").c_str() : "",
          static_cast<long long>(world_.dp()), static_cast<long long>(b.grad_accum), static_cast<long long>(b.batch_size),
          static_cast<long long>(b.seq_len), static_cast<long long>(tokens_per_step_)));
  if (b.steps > 0 && o.warmup_steps > b.steps && root)
    std::fprintf(stderr, "tally: warning: --warmup-steps %lld is longer than --steps %lld: the learning rate never "
                 "reaches --lr (at most %.3g)\n", static_cast<long long>(o.warmup_steps), static_cast<long long>(b.steps),
                 learning_rate(o, b.steps, b.steps - 1));
  // How many times the run reads its data. In file order every pass is the same sequence
  // of batches: say so when there is more than one.
  const double passes = static_cast<double>(b.steps * tokens_per_step_) / static_cast<double>(train.tokens_per_pass());
  if (c_.data.shuffle)
    log(fmt("data order: shuffled (--shuffle, seed %llu): %lld sequences of %lld tokens, in a new order on every pass; "
            "--steps %lld read %s",
            static_cast<unsigned long long>(c_.seed), static_cast<long long>(train.tokens_per_pass() / b.seq_len),
            static_cast<long long>(b.seq_len), static_cast<long long>(b.steps), passes_str(passes).c_str()));
  else if (passes > 1.0)
    log(fmt("data order: file order; --steps %lld read %s, every pass the same text in the same order "
            "(--shuffle reads each pass in a new order)", static_cast<long long>(b.steps), passes_str(passes).c_str()));
  const std::vector<std::string> layout = engine_.describe();
  for (size_t i = 0; i + 1 < layout.size(); ++i) log(layout[i]);
  // ZeRO shards over the data-parallel ranks: with one, it changes nothing (said, not left
  // for the start-up line to suggest otherwise). --bucket-mb sizes plain data parallel's
  // and ZeRO-1's all-reduce; a run without one says so.
  const int zero = c_.parallel.zero;
  if (zero > 0 && world_.replicas() == 1 && root)
    std::fprintf(stderr, "tally: warning: --zero %d shards the optimizer state over data-parallel ranks; this run has "
                 "one, so it saves nothing (launch more ranks with mpirun, or leave --zero out)\n", zero);
  if (c_.parallel.bucket_mb_given && !engine_.all_reduce_stats() && root)
    std::fprintf(stderr, "tally: warning: --bucket-mb %g sizes the buckets of data parallel's gradient all-reduce; this "
                 "run has %s, so it does nothing\n", c_.parallel.bucket_mb,
                 world_.replicas() == 1 ? "one data-parallel rank and no all-reduce"
                                  : "ZeRO stage 2 or 3, which reduce-scatters gradients instead");
  log(layout.back());
  const bool bf16 = c_.compute.dtype == DType::BF16;
  log(fmt("threads: %d per rank, measured %s GEMM peak %.0f GFLOP/s%s", omp_get_max_threads(), bf16 ? "bf16" : "fp32",
          gemm_peak_ / 1e9, bf16 ? " (mixed precision: bf16 GEMM operands, fp32 master weights and optimizer)" : ""));
}

void Metrics::begin_step() {
  step_start_ = std::chrono::steady_clock::now();
  runtime::ledger(c_.compute.device).reset_peaks();
}

const StepMetrics& Metrics::end_step(int64_t step, double loss, double grad_norm, double lr) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start_).count();
  StepMetrics m;
  m.step = step + 1;
  m.loss = loss;
  m.lr = lr;
  m.grad_norm = grad_norm;
  m.ms = seconds * 1e3;
  m.tokens_per_s = static_cast<double>(tokens_per_step_) / seconds;
  m.gemm_peak_frac = rank_step_flops_ / seconds / gemm_peak_;
  if (m.gemm_peak_frac > 1.0 && !gemm_peak_probed_again_) {
    // A step faster than the probe's GEMMs: a neighbour slowed the probe. Probe once more
    // (after the step's time was taken) and keep the larger.
    gemm_peak_ = runtime::backend(c_.compute.device).measured_gemm_peak_flops(c_.compute.dtype, /*probe_again=*/true);
    gemm_peak_probed_again_ = true;
    m.gemm_peak_frac = rank_step_flops_ / seconds / gemm_peak_;
  }
  measure_memory(m);
  m.tp_payload_bytes = engine_.tp_payload_bytes();
  m.cp_payload_bytes = engine_.cp_traffic().payload_bytes;
  m.cp_comm_s = engine_.cp_traffic().busy_seconds;
  m.ep_payload_bytes = engine_.ep_traffic().payload_bytes;
  m.ep_comm_s = engine_.ep_traffic().busy_seconds;
  m.aux_loss = engine_.aux_loss();
  m.expert_load_min = engine_.expert_load().min;
  m.expert_load_max = engine_.expert_load().max;
  m.expert_dropped = engine_.expert_load().dropped;
  const ComputeConfig& k = c_.compute;
  if (k.moe_balance_loss_coef > 0) m.balance_loss = engine_.router_losses().balance;
  if (k.moe_z_loss_coef > 0) m.z_loss = engine_.router_losses().z;
  m.ce_loss = m.loss - std::max(0.0, engine_.model().config().router_aux_loss_coef * m.aux_loss) -
              k.moe_balance_loss_coef * std::max(0.0, m.balance_loss) - k.moe_z_loss_coef * std::max(0.0, m.z_loss);
  if (c_.compute.profile_ops) m.ops = profiler::take();
  measure_pipeline(m);
  tokens_seen_ += tokens_per_step_;
  curve_.add_step(m.step, m.loss, m.lr, tokens_seen_);
  last_ = std::move(m);
  start_row(last_);
  return last_;
}

// Memory: the maximum over ranks, and every rank's peak.
void Metrics::measure_memory(StepMetrics& m) {
  rank_stats_ = runtime::ledger(c_.compute.device).stats();
  const memory::Stats& s = rank_stats_;
  m.live_bytes = max_over_ranks(world_, s.allocated);
  m.peak_bytes = max_over_ranks(world_, s.peak_allocated);
  m.reserved_bytes = max_over_ranks(world_, s.reserved);
  for (double p : world_.world().all_gather_scalar(static_cast<double>(s.peak_allocated)))
    m.rank_peak_bytes.push_back(static_cast<int64_t>(p));
  m.live_after_forward_bytes = engine_.live_after_first_forward();
  m.rank_predicted_peak_bytes = rank_planned_peaks_;
  for (int64_t p : rank_planned_peaks_) m.predicted_peak_bytes = std::max(m.predicted_peak_bytes, p);
  m.peak_rss_bytes = max_over_ranks(world_, memory::peak_rss_bytes());
  run_peak_ = std::max(run_peak_, m.peak_bytes);
}

void Metrics::measure_pipeline(StepMetrics& m) {
  const dist::PipelineStepStats* ps = engine_.pipeline_stats();
  if (!ps) return;
  m.pp_sent_bytes = ps->bytes_sent;
  m.rank_idle_frac = world_.world().all_gather_scalar(ps->seconds > 0 ? ps->idle_seconds / ps->seconds : 0.0);
  for (double f : m.rank_idle_frac) m.bubble_frac += f / static_cast<double>(world_.size());
  m.max_in_flight = max_over_ranks(world_, ps->max_in_flight);
}

// Progress: the share of steps done, and the time left at the pace of the steps so far
// (validation, samples and checkpoints included).
void Metrics::print_step() const {
  const StepMetrics& m = last_;
  const int64_t steps = c_.batch.steps;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start_).count();
  const int64_t done = m.step - start_step_, left = steps - m.step;
  const std::string eta = left == 0 ? "done" : "ETA " + duration_str(elapsed / static_cast<double>(done) * static_cast<double>(left));
  log(fmt("step %5lld/%lld %3.0f%% | loss %.4f | norm %.3f | lr %.2e | %.0f ms | %.1f%% of GEMM peak | %.0f tok/s | mem %s "
          "live, %s peak | %s",
          static_cast<long long>(m.step), static_cast<long long>(steps),
          100.0 * static_cast<double>(m.step) / static_cast<double>(steps), m.loss, m.grad_norm, m.lr, m.ms,
          100.0 * m.gemm_peak_frac, m.tokens_per_s, format_bytes(m.live_bytes).c_str(), format_bytes(m.peak_bytes).c_str(),
          eta.c_str()));
  if (!c_.compute.profile_ops) return;
  // Where this step's time went, per phase: the largest kernels, and what no kernel
  // accounts for (allocation, graph building, dispatch: the framework's own cost).
  std::string table = profiler::format(m.ops);
  for (size_t at = 0; (at = table.find('\n', at)) != std::string::npos && at + 1 < table.size(); at += 3)
    table.insert(at + 1, "  ");
  // Rank 0's own: under a pipeline its stage's kernels, and "untimed" holds its waits for
  // the other stages' activations and gradients too.
  if (world_.size() > 1)
    log(std::string("  (rank 0's kernels") +
        (world_.pp() > 1 ? ": pipeline stage 0; its untimed time includes waiting for the other stages" : "") + ")");
  if (!c_.metrics.quiet && world_.is_root()) std::printf("  %s", table.c_str()), std::fflush(stdout);
}

void Metrics::start_row(const StepMetrics& m) {
  nlohmann::json j = {{"step", m.step},       {"loss", m.loss},           {"lr", m.lr},
                      {"grad_norm", m.grad_norm}, {"ms", m.ms},           {"tokens_per_s", m.tokens_per_s},
                      {"gemm_peak_frac", m.gemm_peak_frac}, {"live_bytes", m.live_bytes}, {"peak_bytes", m.peak_bytes},
                      {"reserved_bytes", m.reserved_bytes}, {"live_after_forward_bytes", m.live_after_forward_bytes},
                      {"predicted_peak_bytes", m.predicted_peak_bytes},
                      {"rank_peak_bytes", m.rank_peak_bytes}, {"rank_predicted_peak_bytes", m.rank_predicted_peak_bytes},
                      {"peak_rss_bytes", m.peak_rss_bytes},
                      {"tokens", tokens_seen_}};
  if (engine_.pipeline_stats()) {
    j["bubble_frac"] = m.bubble_frac;
    j["rank_idle_frac"] = m.rank_idle_frac;
    j["max_in_flight"] = m.max_in_flight;
    j["pp_sent_bytes"] = m.pp_sent_bytes;
  }
  if (world_.tp() > 1) j["tp_payload_bytes"] = m.tp_payload_bytes;
  if (world_.cp() > 1) j["cp_payload_bytes"] = m.cp_payload_bytes, j["cp_comm_s"] = m.cp_comm_s;
  if (world_.ep() > 1) j["ep_payload_bytes"] = m.ep_payload_bytes, j["ep_comm_s"] = m.ep_comm_s;
  if (m.expert_load_max >= 0)  // over the sparse layers' experts, every rank's tokens
    j["expert_load"] = {{"min", m.expert_load_min}, {"max", m.expert_load_max}, {"dropped", m.expert_dropped}};
  // `loss` is the objective: the cross-entropy plus each router loss times its coefficient.
  if (m.aux_loss >= 0 || m.balance_loss >= 0 || m.z_loss >= 0) j["ce_loss"] = m.ce_loss;
  if (m.aux_loss >= 0) j["aux_loss"] = m.aux_loss;
  if (m.balance_loss >= 0) j["balance_loss"] = m.balance_loss;
  if (m.z_loss >= 0) j["z_loss"] = m.z_loss;
  if (c_.compute.profile_ops) {
    // {"forward": {"ms": 452.1, "kernels": {"gemm": {"ms": 301.2, "calls": 49, "gflop": 42.5}, ...}}, ...}
    nlohmann::json phases = nlohmann::json::object();
    for (const profiler::PhaseRow& p : m.ops.phases)
      phases[p.phase] = {{"ms", p.ms}, {"kernel_ms", p.kernel_ms}, {"kernels", nlohmann::json::object()}};
    for (const profiler::KernelRow& k : m.ops.kernels) {
      nlohmann::json row = {{"ms", k.ms}, {"calls", k.calls}};
      if (k.flops > 0) row["gflop"] = k.flops / 1e9;
      phases[k.phase]["kernels"][k.kernel] = row;
    }
    j["ops"] = phases;
  }
  row_ = std::move(j);
}

void Metrics::begin_validation() { runtime::ledger(c_.compute.device).reset_peaks(); }

void Metrics::record_val(double loss) {
  row_["val_loss"] = loss;
  last_.val_peak_bytes = runtime::ledger(c_.compute.device).stats().peak_allocated;
  row_["val_peak_bytes"] = last_.val_peak_bytes;
  log(fmt("val loss %.4f", loss));
  curve_.add_val(last_.step, loss);
  if (loss < best_val_) best_val_ = loss, best_val_step_ = last_.step;
  write_plot();
}

void Metrics::write_row() {
  if (json_log_) json_log_->append(row_.dump());
  crash_point("row", last_.step);
  if (!rank_json_log_) return;
  row_["rank"] = world_.rank();
  row_["rank_live_bytes"] = rank_stats_.allocated;
  row_["rank_peak_allocated_bytes"] = rank_stats_.peak_allocated;
  rank_json_log_->append(row_.dump());
}

void Metrics::sync_logs() {
  if (json_log_) json_log_->sync();
  if (rank_json_log_) rank_json_log_->sync();
}

void Metrics::commit_logs() {
  if (json_log_) json_log_->commit();
  if (rank_json_log_) rank_json_log_->commit();
}

bool Metrics::has_best_val() const { return std::isfinite(best_val_); }

void Metrics::write_plot() const {
  if (!world_.is_root() || plot_is_anothers_) return;
  fs::create_directories(c_.checkpoint.out_dir);
  write_loss_svg(plot_path_, {curve_}, "tally: " + model_.describe());
}

void Metrics::finish(int64_t steps_run, const std::string& last_checkpoint) {
  if (steps_run == 0) return;
  commit_logs();
  write_plot();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start_).count();
  const int64_t tokens = steps_run * tokens_per_step_;
  std::string summary = "done: " + std::to_string(steps_run) + " steps in " + duration_str(seconds) + ", " +
                        std::to_string(tokens) + " tokens (" +
                        std::to_string(static_cast<int64_t>(static_cast<double>(tokens) / std::max(seconds, 1e-9))) +
                        " tok/s, " +
                        passes_str(static_cast<double>(tokens) / static_cast<double>(data_.train().tokens_per_pass())) +
                        " over the training data)";
  if (has_best_val()) summary += "; best val loss " + fmt("%.4f", best_val_) + " at step " + std::to_string(best_val_step_);
  if (!last_checkpoint.empty()) summary += "; checkpoint " + last_checkpoint;
  if (!c_.metrics.log_json.empty()) summary += "; log " + c_.metrics.log_json;
  if (!plot_is_anothers_) summary += "; plot " + plot_path_;
  log(summary);
  const int64_t planned = *std::max_element(rank_planned_peaks_.begin(), rank_planned_peaks_.end());
  log(fmt("memory: the run's peak %s (its largest step peak%s), planned before it started %s: %+.2f%%",
          format_bytes(run_peak_).c_str(), world_.size() > 1 ? ", largest over ranks" : "", format_bytes(planned).c_str(),
          100.0 * static_cast<double>(run_peak_ - planned) / static_cast<double>(std::max<int64_t>(planned, 1))));
}

}  // namespace tally::train
