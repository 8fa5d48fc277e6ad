// Work W1 (bench/RESULTS.md): GPT-2 124M, batch 4, sequence 64, fp32, AdamW,
// one training step, timed over several steps after warm-up. Prints one JSON line.
// Another preset gives the same measurement on that model (L1: llama3-d6); --batch and
// --seq give other shapes (W3: --batch 1 --seq 1024). --profile prints where the mean
// step's time went, per phase and kernel (runtime/profiler.h), to stderr.
// --dtype bf16 runs the GEMMs in bf16 (mixed precision, as `tally train --dtype bf16`).
// After AdamW the gradients are discarded, as `tally train` does (the next backward
// overwrites them); --zero-grads zeroes them in AdamW's pass instead, for comparison.
// The gradient norm is summed during backward, as `tally train` does on one process
// (optim/grad_norm.h); --norm-after-backward sums it in a pass of its own, for comparison.
//   bench_w1 [steps=10] [threads=2] [model=gpt2] [--batch B] [--seq T] [--dtype fp32|bf16] [--profile]
//            [--zero-grads] [--norm-after-backward]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "core/random.h"
#include "memory/process.h"
#include "memory/report.h"
#include "nn/init.h"
#include "nn/transformer.h"
#include "ops/install.h"
#include "optim/adamw.h"
#include "optim/grad_norm.h"
#include "runtime/backend.h"
#include "runtime/profiler.h"

using namespace tally;


int main(int argc, char** argv) {
  tally::ops::install();
  std::vector<std::string> positional;
  int64_t B = 4, T = 64;
  bool profile = false, zero_grads = false, norm_after_backward = false;
  std::string dtype = "fp32";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] {
      if (i + 1 >= argc) std::fprintf(stderr, "bench_w1: %s needs a value\n", a.c_str()), std::exit(2);
      return std::atoll(argv[++i]);
    };
    if (a == "--batch") B = value();
    else if (a == "--seq") T = value();
    else if (a == "--profile") profile = true;
    else if (a == "--zero-grads") zero_grads = true;
    else if (a == "--norm-after-backward") norm_after_backward = true;
    else if (a == "--dtype") {
      if (i + 1 >= argc) std::fprintf(stderr, "bench_w1: --dtype needs fp32 or bf16\n"), std::exit(2);
      dtype = argv[++i];
      if (dtype != "fp32" && dtype != "bf16") std::fprintf(stderr, "bench_w1: --dtype %s: expected fp32 or bf16\n", dtype.c_str()), std::exit(2);
    }
    else if (a.rfind("--", 0) == 0) std::fprintf(stderr, "bench_w1: unknown flag %s\n", a.c_str()), std::exit(2);
    else positional.push_back(a);
  }
  const int steps = positional.size() > 0 ? std::stoi(positional[0]) : 10;
  const int threads = positional.size() > 1 ? std::stoi(positional[1]) : 2;
  omp_set_num_threads(threads);
  const std::string preset = positional.size() > 2 ? positional[2] : "gpt2";
  if (B < 1 || T < 1) std::fprintf(stderr, "bench_w1: --batch and --seq must be positive\n"), std::exit(2);
  if (steps < 1 || threads < 1) std::fprintf(stderr, "bench_w1: steps and threads must be at least 1\n"), std::exit(2);
  nn::Transformer model(nn::TransformerConfig::preset(preset));
  nn::init_weights(model, 1);
  if (dtype == "bf16") model.set_matmul_dtype(DType::BF16);
  optim::AdamW opt(model.params(), optim::AdamWConfig{0.9, 0.999, 1e-8, 0.0, false});
  optim::BackwardGradientNorm backward_norm(model.params());
  Rng rng(2);
  std::vector<int32_t> toks(B * T + 1);
  for (auto& t : toks) t = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(model.config().vocab_size));
  Tensor x = Tensor::from_vector(std::vector<int32_t>(toks.begin(), toks.end() - 1), {B, T});
  Tensor y = Tensor::from_vector(std::vector<int32_t>(toks.begin() + 1, toks.end()), {B, T});
  // The peak of the GEMMs this run does (fp32, or bf16 operands with fp32 accumulation),
  // probed before the steps and again after them.
  const DType gemm_dtype = dtype == "bf16" ? DType::BF16 : DType::F32;
  runtime::backend(Device::cpu()).measured_gemm_peak_flops(gemm_dtype);

  auto& ledger = runtime::ledger();
  int64_t live_after_forward = 0;  // model states + saved activations, measured at the end of the first forward
  std::vector<double> ms;
  double loss_value = 0;
  using clock = std::chrono::steady_clock;
  auto since = [](clock::time_point t) { return std::chrono::duration<double, std::milli>(clock::now() - t).count(); };
  double phase_ms[4] = {0, 0, 0, 0};  // forward, backward, norm + AdamW, zero_grad (summed over timed steps)
  namespace profiler = runtime::profiler;
  std::vector<profiler::Report> reports;
  for (int s = 0; s < steps + 2; ++s) {
    profiler::enable(profile && s >= 2);
    auto t0 = clock::now();
    std::optional<profiler::PhaseScope> phase(std::in_place, "forward");
    Tensor loss = model.forward(x, y).loss;
    double t_fwd = since(t0);
    if (s == 0) live_after_forward = ledger.stats().allocated;
    phase.emplace("backward");
    if (!norm_after_backward) backward_norm.arm();
    loss.backward();
    loss_value = loss.item();
    double t_bwd = since(t0);
    phase.emplace("optimizer");
    const double norm = norm_after_backward ? optim::gradient_norm(model.params()) : backward_norm.finish();
    opt.step(1e-4, optim::clip_scale(norm, 1.0), zero_grads);
    if (!zero_grads) model.params().discard_grads();
    phase.reset();
    double t_opt = since(t0);
    double dt = since(t0);
    if (profile && s >= 2) reports.push_back(profiler::take());
    if (s >= 2) {  // two warm-up steps (JIT, first-touch, cache fill)
      ms.push_back(dt);
      phase_ms[0] += t_fwd, phase_ms[1] += t_bwd - t_fwd, phase_ms[2] += t_opt - t_bwd, phase_ms[3] += dt - t_opt /* loss.item() etc. */;
    }
  }
  for (double& p : phase_ms) p /= steps;
  if (profile) {
    // The median step's table (by total time), so one slow outlier does not speak for all.
    std::vector<std::pair<double, size_t>> totals;
    for (size_t i = 0; i < reports.size(); ++i) {
      double t = 0;
      for (const auto& p : reports[i].phases) t += p.ms;
      totals.push_back({t, i});
    }
    std::sort(totals.begin(), totals.end());
    std::fprintf(stderr, "median step by kernel (ms):\n%s", profiler::format(reports[totals[totals.size() / 2].second], 8).c_str());
  }
  std::fprintf(stderr, "phases (mean ms): forward %.0f, backward %.0f, grad norm + AdamW%s %.0f, other %.0f\n",
               phase_ms[0], phase_ms[1], zero_grads ? " (zeroing grads)" : "", phase_ms[2], phase_ms[3]);
  // Probed again now, the larger of the two: a neighbour's burst can slow a whole probe.
  const double gemm_peak = runtime::backend(Device::cpu()).measured_gemm_peak_flops(gemm_dtype, /*probe_again=*/true);
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  const double flops = model.flops_per_token(T) * B * T;
  std::printf(
      "{\"system\": \"tally\", \"model\": \"%s\", \"ms_per_step\": %.1f, \"min_ms\": %.1f, \"tokens_per_s\": %.0f, \"gemm_peak_gflops\": %.0f, "
      "\"pct_gemm_peak\": %.1f, \"peak_rss_bytes\": %lld, \"peak_allocated_bytes\": %lld, \"reserved_bytes\": %lld, "
      "\"live_after_forward_bytes\": %lld, \"params\": %lld, \"loss\": %.4f, \"threads\": %d, \"batch\": %lld, \"seq\": %lld, \"dtype\": \"%s\", \"grads\": \"%s\", \"steps\": %d, "
      "\"flops_per_step\": %.6e}\n",
      preset.c_str(), median, ms.front(), B * T / (median / 1e3), gemm_peak / 1e9, 100.0 * flops / (median / 1e3) / gemm_peak,
      static_cast<long long>(memory::peak_rss_bytes()), static_cast<long long>(ledger.stats().peak_allocated),
      static_cast<long long>(ledger.stats().reserved), static_cast<long long>(live_after_forward),
      static_cast<long long>(model.num_parameters()), loss_value, threads, static_cast<long long>(B),
      static_cast<long long>(T), dtype.c_str(), zero_grads ? "zeroed" : "discarded", steps, flops);
  return 0;
}
