// One sparse layer's MLP alone, at a model's routed shapes (default qwen3-moe-d6's: width
// 384, 8 experts of 384, 2 a token, 4096 tokens): forward and backward through
// nn::Transformer::sparse_mlp, the router, the top-k, the grouping of the (token, slot)
// pairs by expert, one GEMM per expert and projection, and the weighted combine, as the
// layer runs them. Prints the experts' GEMM FLOPs (3 projections of 2 R C Fe forward and
// twice that backward, over the R rows the experts run: N k dropless, E x capacity at a
// capacity, padding included), the router's (2 N C E forward, twice that backward), the
// layer's rate against the GEMM peak measured in the same run, and the time inside the
// GEMMs alone (runtime/profiler.h): what the routing, gathers and scatters, and SwiGLU cost
// beyond the arithmetic. Then one JSON line with the shape, for the peer
// (bench/experts_torch.py, HuggingFace's loop over the experts). bench/run_experts.sh runs
// both, alternating.
// --profile prints the last round's time per kernel to stderr.
//   bench_experts [rounds=5] [--model PRESET] [--tokens N] [--capacity-factor F] [--profile]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "core/random.h"
#include "nn/init.h"
#include "nn/transformer.h"
#include "ops/install.h"
#include "runtime/backend.h"
#include "runtime/profiler.h"

using namespace tally;

namespace {
double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

Tensor random_normal(const Shape& shape, uint64_t seed, double scale) {
  Rng rng(seed);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> values(static_cast<size_t>(n));
  for (float& x : values) x = static_cast<float>(scale * rng.normal());
  return Tensor::from_vector(values, shape);
}

struct Stats {
  double min, median;
};
Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2]};
}

// Milliseconds the report's GEMMs took in `phase`.
double gemm_ms(const runtime::profiler::Report& report, const std::string& phase) {
  double ms = 0;
  for (const auto& k : report.kernels)
    if (k.flops > 0 && phase == k.phase) ms += k.ms;
  return ms;
}

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr, "bench_experts: %s\n", what.c_str());
  std::exit(2);
}
}  // namespace

int main(int argc, char** argv) {
  tally::ops::install();
  int rounds = 5;
  int64_t N = 4096;
  double capacity_factor = 0;
  bool profile = false;
  std::string preset = "qwen3-moe-d6";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--model") preset = value();
    else if (a == "--tokens") N = std::atoll(value().c_str());
    else if (a == "--capacity-factor") capacity_factor = std::atof(value().c_str());
    else if (a == "--profile") profile = true;
    else if (a.rfind("--", 0) == 0) usage_error("unknown flag " + a);
    else rounds = std::atoi(a.c_str());
  }
  if (rounds < 1 || N < 1 || capacity_factor < 0) usage_error("rounds and --tokens must be positive, --capacity-factor not negative");
  nn::TransformerConfig config = nn::TransformerConfig::preset(preset);
  if (config.n_experts == 0) usage_error("--model " + preset + " has no experts");
  // One layer, sparse, and a token vocabulary the layer never reads.
  config.n_layer = 1;
  config.decoder_sparse_step = 1;
  config.mlp_only_layers.clear();
  config.vocab_size = config.padded_vocab_size = 128;
  nn::Transformer model(config);
  nn::init_weights(model, 1);
  model.set_expert_capacity_factor(capacity_factor);
  const int64_t C = config.n_embd, E = config.n_experts, k = config.experts_per_token, Fe = config.moe_ffn_hidden;
  const int64_t capacity = model.expert_capacity(N);
  const int64_t rows = capacity ? E * capacity : N * k;

  Tensor h = random_normal({1, N, C}, 100, 1.0);
  h.set_requires_grad(true);
  const Tensor dout = random_normal({1, N, C}, 200, 1e-2);
  runtime::backend(Device::cpu()).measured_gemm_peak_flops(DType::F32);
  namespace profiler = runtime::profiler;
  std::vector<double> forward_ms, backward_ms, forward_gemm_ms, backward_gemm_ms;
  std::vector<int64_t> load;
  for (int r = 0; r < rounds + 1; ++r) {  // the first round warms caches and primitives
    profiler::enable(true);
    const double t0 = now_s();
    Tensor out;
    {
      profiler::PhaseScope phase("forward");
      out = model.sparse_mlp(h, 0);
    }
    const double t1 = now_s();
    {
      profiler::PhaseScope phase("backward");
      autograd::backward({out}, {dout});
    }
    const double t2 = now_s();
    const profiler::Report report = profiler::take();
    profiler::enable(false);
    out = Tensor();
    h.discard_grad();
    model.params().discard_grads();
    load = model.take_expert_load();
    if (r == 0) continue;
    if (profile && r == rounds) std::fprintf(stderr, "last round by kernel (ms):\n%s", profiler::format(report, 10).c_str());
    forward_ms.push_back((t1 - t0) * 1e3);
    backward_ms.push_back((t2 - t1) * 1e3);
    forward_gemm_ms.push_back(gemm_ms(report, "forward"));
    backward_gemm_ms.push_back(gemm_ms(report, "backward"));
  }
  // Probed again now, the larger of the two, as bench_w1 does: a neighbour's burst can slow
  // a whole probe.
  const double peak = runtime::backend(Device::cpu()).measured_gemm_peak_flops(DType::F32, /*probe_again=*/true);
  const int64_t busiest = *std::max_element(load.begin(), load.end());
  const double expert_flops = 3 * 2.0 * static_cast<double>(rows) * static_cast<double>(C) * static_cast<double>(Fe);
  const double router_flops = 2.0 * static_cast<double>(N) * static_cast<double>(C) * static_cast<double>(E);
  std::printf("%s sparse MLP, %lld tokens, %lld experts of %lld, %lld a token, width %lld, %s; %lld rows, busiest "
              "expert %lld (mean %.0f); %d rounds; GEMM peak %.0f GFLOP/s (fp32)\n",
              preset.c_str(), static_cast<long long>(N), static_cast<long long>(E), static_cast<long long>(Fe),
              static_cast<long long>(k), static_cast<long long>(C),
              capacity ? ("capacity " + std::to_string(capacity)).c_str() : "dropless", static_cast<long long>(rows),
              static_cast<long long>(busiest), static_cast<double>(N * k) / static_cast<double>(E), rounds, peak / 1e9);
  struct Row {
    const char* pass;
    Stats total, gemm;
    double flops;
  };
  const Stats f = stats(forward_ms), b = stats(backward_ms);
  for (const Row& row : {Row{"forward", f, stats(forward_gemm_ms), expert_flops + router_flops},
                         Row{"backward", b, stats(backward_gemm_ms), 2 * (expert_flops + router_flops)}}) {
    const double rate = row.flops / (row.total.min * 1e-3);
    std::printf("  %-8s min %8.1f ms  median %8.1f ms | %6.2f GFLOP at %5.0f GFLOP/s on min: %3.0f%% of the peak; "
                "in GEMMs %.1f ms (%3.0f%% of the peak there), the rest %.1f ms\n",
                row.pass, row.total.min, row.total.median, row.flops / 1e9, rate / 1e9, 100 * rate / peak, row.gemm.min,
                100 * row.flops / (row.gemm.min * 1e-3) / peak, row.total.min - row.gemm.min);
  }
  std::vector<double> step_ms(forward_ms.size());
  for (size_t i = 0; i < step_ms.size(); ++i) step_ms[i] = forward_ms[i] + backward_ms[i];
  const Stats s = stats(step_ms), fg = stats(forward_gemm_ms), bg = stats(backward_gemm_ms);
  std::printf(
      "{\"system\": \"tally\", \"forward_min_ms\": %.2f, \"forward_median_ms\": %.2f, \"backward_min_ms\": %.2f, "
      "\"backward_median_ms\": %.2f, \"step_min_ms\": %.2f, \"step_median_ms\": %.2f, \"forward_gemm_min_ms\": %.2f, "
      "\"backward_gemm_min_ms\": %.2f, \"step_gflop\": %.4f, \"gemm_peak_gflops\": %.0f, \"busiest_expert_rows\": %lld, "
      "\"model\": \"%s\", \"tokens\": %lld, \"width\": %lld, \"experts\": %lld, \"top_k\": %lld, \"expert_width\": %lld, "
      "\"norm_topk_prob\": %s, \"capacity\": %lld, \"rows\": %lld}\n",
      f.min, f.median, b.min, b.median, s.min, s.median, fg.min, bg.min, 3 * (expert_flops + router_flops) / 1e9,
      peak / 1e9, static_cast<long long>(busiest), preset.c_str(), static_cast<long long>(N), static_cast<long long>(C),
      static_cast<long long>(E), static_cast<long long>(k), static_cast<long long>(Fe),
      config.norm_topk_prob ? "true" : "false", static_cast<long long>(capacity), static_cast<long long>(rows));
  return 0;
}
