#include "train/fit.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "dist/pipeline.h"
#include "memory/report.h"
#include "runtime/backend.h"
#include "train/dry_run.h"
#include "train/plan.h"

namespace tally::train {

int64_t parse_memory_size(const std::string& text) {
  size_t end = 0;
  double value = -1;
  try {
    value = std::stod(text, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  std::string unit = text.substr(end);
  unit.erase(std::remove_if(unit.begin(), unit.end(), [](unsigned char ch) { return std::isspace(ch); }), unit.end());
  for (char& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  const std::vector<std::pair<std::string, double>> units{
      {"", 1},      {"b", 1},         {"kib", 1024.0},  {"mib", 1048576.0}, {"gib", 1073741824.0},
      {"tib", 1099511627776.0},       {"kb", 1e3},      {"mb", 1e6},        {"gb", 1e9},
      {"tb", 1e12}};
  auto it = std::find_if(units.begin(), units.end(), [&](const auto& u) { return u.first == unit; });
  TALLY_CHECK(end > 0 && value > 0 && std::isfinite(value) && it != units.end() && value * it->second < 9e18,
              "--fit ", text, ": expected a memory size, a positive number with a unit (B, KiB, MiB, GiB, TiB, KB, MB, "
              "GB, TB), e.g. 80GiB");
  return static_cast<int64_t>(value * it->second);
}

namespace {

double token_flops(const nn::TransformerConfig& model, int64_t seq_len) {
  return nn::Transformer::layout_only(model).flops_per_token(seq_len);
}

StepEstimate estimate(const TrainConfig& c, const nn::TransformerConfig& m, int64_t world, double per_token,
                      double rate, double link) {
  const ParallelismConfig& p = c.parallel;
  const double T = p.tp, P = p.pp, V = p.virtual_stages, M = static_cast<double>(c.batch.grad_accum);
  const double replicas = static_cast<double>(world) / (T * P);  // data and context parallel ranks
  const double D = replicas / p.cp;
  const double seq = static_cast<double>(c.batch.seq_len), local_seq = seq / p.cp;
  const double B = static_cast<double>(c.batch.batch_size), C = static_cast<double>(m.n_embd);
  const double L = static_cast<double>(m.n_layer), attention = 2.0 * L * static_cast<double>(m.q_dim()) * seq;
  StepEstimate e;
  double flops = B * M * D * seq * per_token;
  if (c.compute.recompute == nn::Recompute::Full) flops *= 4.0 / 3.0;
  if (c.compute.recompute == nn::Recompute::Selective) flops += B * M * D * seq * attention;
  e.compute_s = flops / (static_cast<double>(world) * rate);
  e.bubble_s = e.compute_s * (P - 1) / (V * M);
  const double activation = B * local_seq * C * 4;
  const double per_layer = c.compute.recompute == nn::Recompute::Full ? 6 : 4;
  e.tensor_s = M * (L / P) * per_layer * 2 * (T - 1) / T * activation / link;
  const double shard = static_cast<double>(parameter_count(m)) / (T * P) * 4;
  e.data_s = 2 * (replicas - 1) / replicas * shard * (1 + (p.zero == 3 ? M : 0)) / link;
  e.pipeline_s = P > 1 ? 2 * M * V * activation / link : 0;
  return e;
}

// Bytes a rank's model states take at least: parameters, gradients and AdamW's two
// moments of its shard (the average shard: some rank holds at least that), less what
// ZeRO shards over the data-parallel ranks.
double model_state_floor(const TrainConfig& c, const nn::TransformerConfig& m, int64_t world) {
  const ParallelismConfig& p = c.parallel;
  const double shard = static_cast<double>(parameter_count(m)) / (p.tp * p.pp);
  const double replicas = static_cast<double>(world) / (p.tp * p.pp);
  return shard * ((p.zero >= 3 ? 4 / replicas : 4) + (p.zero >= 2 ? 4 / replicas : 4) + (p.zero >= 1 ? 8 / replicas : 8));
}

std::vector<TrainConfig> layouts(const TrainConfig& base, const nn::TransformerConfig& m, int64_t world,
                                 int64_t global_batch) {
  std::vector<TrainConfig> out;
  const int cp = std::max(base.parallel.cp, 1);
  for (int tp : {1, 2, 4, 8})
    for (bool sp : {false, true})
      for (int pp = 1; pp <= m.n_layer; pp *= 2)
        for (auto [schedule, virtual_stages] :
             {std::pair{dist::PipelineSchedule::OneFOneB, 1}, std::pair{dist::PipelineSchedule::Interleaved, 2}})
          for (int zero = 0; zero <= 3; ++zero)
            for (nn::Recompute recompute : {nn::Recompute::None, nn::Recompute::Selective, nn::Recompute::Full}) {
              const int64_t model_parallel = static_cast<int64_t>(tp) * pp * cp;
              if ((sp && tp == 1) || world % model_parallel != 0) continue;
              if (pp == 1 && schedule != dist::PipelineSchedule::OneFOneB) continue;
              const int64_t dp = world / model_parallel;
              if (zero > 0 && dp * cp == 1) continue;  // nothing to shard over
              if (global_batch % dp != 0) continue;
              for (int64_t b = 1; b <= global_batch / dp; b *= 2) {
                if ((global_batch / dp) % b != 0) continue;
                TrainConfig c = base;
                ParallelismConfig& p = c.parallel;
                p.dp = static_cast<int>(dp), p.tp = tp, p.pp = pp, p.sequence_parallel = sp;
                p.pp_schedule = schedule, p.virtual_stages = virtual_stages, p.zero = zero;
                p.pp_last_stage_layers = 0;
                c.compute.recompute = recompute;
                c.batch.batch_size = b;
                c.batch.grad_accum = global_batch / dp / b;
                out.push_back(c);
              }
            }
  return out;
}

// Whether tally train takes the layout (the checks it runs before any rank starts).
bool accepted(const TrainConfig& c, const nn::TransformerConfig& m, int64_t world) {
  try {
    c.validate_settings();
    check_layout(c, world);
    const ParallelismConfig& p = c.parallel;
    if (p.pp > 1) dist::check_pipeline(p.pp_schedule, p.pp, p.virtual_stages, c.batch.grad_accum, m.n_layer);
    if (m.n_head % p.tp != 0 || m.n_kv_head % p.tp != 0) return false;
    return dry_run_refusal(c).empty();
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

StepEstimate estimate_step(const TrainConfig& c, const nn::TransformerConfig& model, int64_t world,
                           double flops_per_s, double link_bytes_per_s) {
  return estimate(c, model, world, token_flops(model, c.batch.seq_len), flops_per_s, link_bytes_per_s);
}

FitResult fit_layouts(const TrainConfig& base, const nn::TransformerConfig& model, const FitOptions& o) {
  TALLY_CHECK(o.memory_bytes > 0 && o.world >= 1 && o.top >= 1, "--fit needs a memory, --world >= 1 and --fit-top >= 1");
  FitResult r;
  const ParallelismConfig& bp = base.parallel;
  const int64_t base_dp = bp.dp > 0 ? bp.dp : std::max<int64_t>(1, o.world / (static_cast<int64_t>(bp.tp) * bp.pp * bp.cp));
  r.global_batch = o.global_batch > 0 ? o.global_batch : base.batch.batch_size * base.batch.grad_accum * base_dp;
  r.flops_per_s = o.flops_per_s > 0 ? o.flops_per_s
                                    : runtime::backend(Device::cpu()).measured_gemm_peak_flops(base.compute.dtype);
  const double per_token = token_flops(model, base.batch.seq_len);
  struct Ranked {
    TrainConfig config;
    StepEstimate estimate;
    double floor;
  };
  std::vector<Ranked> ranked;
  for (const TrainConfig& c : layouts(base, model, o.world, r.global_batch)) {
    ++r.layouts;
    if (!accepted(c, model, o.world)) {
      ++r.refused;
      continue;
    }
    ranked.push_back({c, estimate(c, model, o.world, per_token, r.flops_per_s, o.link_bytes_per_s),
                      model_state_floor(c, model, o.world)});
  }
  // Fastest first; at equal estimates, the layout that shards more (it fits sooner).
  std::stable_sort(ranked.begin(), ranked.end(), [](const Ranked& a, const Ranked& b) {
    return a.estimate.total_s() != b.estimate.total_s() ? a.estimate.total_s() < b.estimate.total_s() : a.floor < b.floor;
  });
  const bool experts_sharded = model.n_experts > 0 && bp.ep > 1;  // the floor counts every expert on every rank
  for (const Ranked& k : ranked) {
    if (static_cast<int64_t>(r.fits.size()) >= o.top) break;
    if (!experts_sharded && k.floor > static_cast<double>(o.memory_bytes)) {
      ++r.over_by_states;
      continue;
    }
    if (r.dry_runs >= o.max_dry_runs) {
      r.stopped = true;
      break;
    }
    ++r.dry_runs;
    FitCandidate f{k.config, k.estimate, 0, 0};
    try {
      const TrainConfig planned = with_planned_microbatches(k.config);
      for (int rank : dry_run_roles(planned, o.world)) {
        const DryRun d = dry_run(planned, model, o.validates, o.world, rank);
        if (d.peak_bytes() > f.peak_bytes) f.peak_bytes = d.peak_bytes(), f.peak_stage = d.stage;
      }
    } catch (const std::exception&) {
      ++r.refused;
      continue;
    }
    if (f.peak_bytes <= o.memory_bytes) r.fits.push_back(f);
  }
  return r;
}

std::string FitCandidate::flags() const {
  const ParallelismConfig& p = config.parallel;
  std::string out = "--dp " + std::to_string(p.dp);
  if (p.tp > 1) out += " --tp " + std::to_string(p.tp) + (p.sequence_parallel ? " --sp" : "");
  if (p.pp > 1) {
    out += " --pp " + std::to_string(p.pp);
    if (p.pp_schedule != dist::PipelineSchedule::OneFOneB)
      out += std::string(" --pp-schedule ") + dist::pipeline_schedule_name(p.pp_schedule) + " --virtual-stages " +
             std::to_string(p.virtual_stages);
  }
  if (p.cp > 1) out += " --cp " + std::to_string(p.cp);
  if (p.ep > 1) out += " --ep " + std::to_string(p.ep);
  if (p.zero > 0) out += " --zero " + std::to_string(p.zero);
  if (config.compute.recompute != nn::Recompute::None)
    out += std::string(" --recompute ") + nn::recompute_name(config.compute.recompute);
  return out + " --batch-size " + std::to_string(config.batch.batch_size) + " --grad-accum " +
         std::to_string(config.batch.grad_accum);
}

namespace {
std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, s >= 100 ? "%.0f" : s >= 1 ? "%.2f" : "%.3f", s);
  return buf;
}
}  // namespace

std::string fit_text(const FitResult& r, const FitOptions& o, const std::string& model_name) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "fit %s a rank on %lld ranks: %s, %lld sequences a step\n"
                "  %lld layouts searched: %lld refused by tally train's checks, %lld over by their model states "
                "alone, %lld planned by the dry run, %zu fit%s\n",
                memory::format_bytes(o.memory_bytes).c_str(), static_cast<long long>(o.world), model_name.c_str(),
                static_cast<long long>(r.global_batch), static_cast<long long>(r.layouts),
                static_cast<long long>(r.refused), static_cast<long long>(r.over_by_states),
                static_cast<long long>(r.dry_runs), r.fits.size(),
                r.stopped ? " (the search stopped at its limit of dry runs)" : "");
  std::string out = buf;
  if (r.fits.empty()) out += "  none fits: more ranks, a smaller microbatch or a larger memory\n";
  for (size_t i = 0; i < r.fits.size(); ++i) {
    const FitCandidate& f = r.fits[i];
    const StepEstimate& e = f.estimate;
    std::snprintf(buf, sizeof buf, "  %2zu. %s\n      peak %s (stage %d), step ~%s s = compute %s + bubble %s + tp %s + dp %s + pp %s\n",
                  i + 1, f.flags().c_str(), memory::format_bytes(f.peak_bytes).c_str(), f.peak_stage,
                  seconds(e.total_s()).c_str(), seconds(e.compute_s).c_str(), seconds(e.bubble_s).c_str(),
                  seconds(e.tensor_s).c_str(), seconds(e.data_s).c_str(), seconds(e.pipeline_s).c_str());
    out += buf;
  }
  std::snprintf(buf, sizeof buf,
                "  peaks: the dry run's (every stage, exact). Step times: a model, %.1f TFLOP/s a rank%s and %.1f GB/s "
                "links, no overlap; it leaves out kernel efficiency, latency, the loss's and experts' collectives "
                "and the optimizer step (train/fit.h)\n",
                r.flops_per_s / 1e12, o.flops_per_s > 0 ? "" : " (the GEMM peak measured here; --fit-tflops)",
                o.link_bytes_per_s / 1e9);
  return out + buf;
}

std::string fit_json(const FitResult& r, const FitOptions& o) {
  nlohmann::json fits = nlohmann::json::array();
  for (const FitCandidate& f : r.fits) {
    const ParallelismConfig& p = f.config.parallel;
    const StepEstimate& e = f.estimate;
    fits.push_back({{"flags", f.flags()}, {"dp", p.dp}, {"tp", p.tp}, {"sp", p.sequence_parallel}, {"pp", p.pp},
                    {"pp_schedule", dist::pipeline_schedule_name(p.pp_schedule)}, {"virtual_stages", p.virtual_stages},
                    {"zero", p.zero}, {"recompute", nn::recompute_name(f.config.compute.recompute)},
                    {"batch_size", f.config.batch.batch_size}, {"grad_accum", f.config.batch.grad_accum},
                    {"peak_bytes", f.peak_bytes}, {"peak_stage", f.peak_stage},
                    {"step_seconds", e.total_s()},
                    {"estimate", {{"compute", e.compute_s}, {"bubble", e.bubble_s}, {"tensor", e.tensor_s},
                                  {"data", e.data_s}, {"pipeline", e.pipeline_s}}}});
  }
  nlohmann::json out{{"fit",
                      {{"memory_bytes", o.memory_bytes}, {"world", o.world}, {"global_batch", r.global_batch},
                       {"flops_per_s", r.flops_per_s}, {"link_bytes_per_s", o.link_bytes_per_s},
                       {"layouts", r.layouts}, {"refused", r.refused}, {"over_by_states", r.over_by_states},
                       {"dry_runs", r.dry_runs}, {"stopped", r.stopped}, {"fits", fits}}}};
  return out.dump(2);
}

}  // namespace tally::train
