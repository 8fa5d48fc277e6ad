// Causal attention alone, at a model's shapes (default W3's: GPT-2 124M, batch 1, 1024
// tokens, 12 heads of 64): forward and backward through ops::causal_attention(_bf16) on q,
// k, v sliced from one fused (B, T, 3C) projection, as the model calls it, for all of the
// model's layers. Prints the tile products' FLOPs (what the blocked kernel multiplies,
// masked diagonal parts included, backward's recomputed scores included), the causal
// FLOPs (only j <= t), and their rate against the GEMM peak measured in the same run:
// what attention costs beyond its arithmetic; then one JSON line with the same times and
// the memory attention takes above its inputs in the warm-up round: the ledger's peak
// (exact bytes) and the growth of the process's peak RSS, measured as the peer
// (bench/attention_torch.py) measures its own. bench/run_attention_scan.sh runs both over T.
//   bench_attention [rounds=5] [--batch B] [--seq T] [--heads H] [--head-dim D] [--layers L] [--dtype fp32|bf16]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "core/random.h"
#include "memory/ledger.h"
#include "memory/process.h"
#include "ops/install.h"
#include "ops/ops.h"
#include "runtime/backend.h"
#include "runtime/cpu/kernels.h"

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

// The blocked kernel multiplies, per query tile of `rows` starting at t0, all t0 + rows
// keys it sees.
double tile_products_per_head(int64_t T, int64_t D, int products) {
  constexpr int64_t kTile = runtime::cpu::kAttentionQueryTile;
  double macs = 0;
  for (int64_t t0 = 0; t0 < T; t0 += kTile) {
    const int64_t rows = std::min(kTile, T - t0);
    macs += static_cast<double>(rows) * static_cast<double>(t0 + rows) * static_cast<double>(D);
  }
  return 2.0 * products * macs;
}

struct Stats {
  double min_ms, median_ms;
};
Stats stats(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  return {ms.front(), ms[ms.size() / 2]};
}
}  // namespace

int main(int argc, char** argv) {
  tally::ops::install();
  int rounds = 5;
  int64_t B = 1, T = 1024, H = 12, D = 64, L = 12;
  std::string dtype = "fp32";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) std::fprintf(stderr, "bench_attention: %s needs a value\n", a.c_str()), std::exit(2);
      return argv[++i];
    };
    if (a == "--batch") B = std::atoll(value().c_str());
    else if (a == "--seq") T = std::atoll(value().c_str());
    else if (a == "--heads") H = std::atoll(value().c_str());
    else if (a == "--head-dim") D = std::atoll(value().c_str());
    else if (a == "--layers") L = std::atoll(value().c_str());
    else if (a == "--dtype") {
      dtype = value();
      if (dtype != "fp32" && dtype != "bf16")
        std::fprintf(stderr, "bench_attention: --dtype %s: expected fp32 or bf16\n", dtype.c_str()), std::exit(2);
    } else if (a.rfind("--", 0) == 0) std::fprintf(stderr, "bench_attention: unknown flag %s\n", a.c_str()), std::exit(2);
    else rounds = std::atoi(a.c_str());
  }
  if (rounds < 1 || B < 1 || T < 1 || H < 1 || D < 1 || L < 1)
    std::fprintf(stderr, "bench_attention: rounds and every size must be positive\n"), std::exit(2);
  const bool bf16 = dtype == "bf16";
  const int64_t C = H * D;

  // One fused projection per layer, its gradient, and the output's gradient.
  std::vector<Tensor> qkv, dout;
  for (int64_t l = 0; l < L; ++l) {
    qkv.push_back(random_normal({B, T, 3 * C}, 100 + l, 1.0));
    qkv.back().set_requires_grad(true);
    Tensor d = random_normal({B, T, H, D}, 200 + l, 1e-2);
    dout.push_back(bf16 ? d.to(DType::BF16) : d);
  }
  auto run_layer = [&](int64_t l) {
    std::vector<Tensor> parts = ops::split(qkv[l], {C, C, C}, 2);
    Tensor q = parts[0].view({B, T, H, D}), k = parts[1].view({B, T, H, D}), v = parts[2].view({B, T, H, D});
    return bf16 ? ops::causal_attention_bf16(q, k, v) : ops::causal_attention(q, k, v);
  };

  const DType gemm_dtype = bf16 ? DType::BF16 : DType::F32;
  runtime::backend(Device::cpu()).measured_gemm_peak_flops(gemm_dtype);
  std::vector<double> forward_ms, backward_ms, step_ms;  // step: one round's forward + backward
  memory::Ledger& ledger = runtime::ledger();
  int64_t ledger_growth = 0, rss_growth = 0;
  for (int r = 0; r < rounds + 1; ++r) {  // the first round warms caches and primitives
    int64_t allocated_before = 0, rss_before = 0;
    if (r == 0) {  // and its peak above the inputs is the memory figure
      allocated_before = ledger.stats().allocated;
      ledger.reset_peaks();
      memory::reset_peak_rss();
      rss_before = memory::peak_rss_bytes();  // the RSS the peak was reset to
      if (rss_before == 0) std::fprintf(stderr, "bench_attention: no VmHWM in /proc/self/status\n"), std::exit(1);
    }
    std::vector<Tensor> outs;
    const double t0 = now_s();
    for (int64_t l = 0; l < L; ++l) outs.push_back(run_layer(l));
    const double t1 = now_s();
    for (int64_t l = L - 1; l >= 0; --l) autograd::backward({outs[l]}, {dout[l]});
    const double t2 = now_s();
    outs.clear();
    for (Tensor& x : qkv) x.discard_grad();
    if (r == 0) {
      ledger_growth = ledger.stats().peak_allocated - allocated_before;
      rss_growth = memory::peak_rss_bytes() - rss_before;
      continue;
    }
    forward_ms.push_back((t1 - t0) * 1e3);
    backward_ms.push_back((t2 - t1) * 1e3);
    step_ms.push_back((t2 - t0) * 1e3);
  }

  // Probed again now, the larger of the two, as bench_w1 does: a neighbour's burst can slow
  // a whole probe.
  const double peak = runtime::backend(Device::cpu()).measured_gemm_peak_flops(gemm_dtype, /*probe_again=*/true);
  const double heads = static_cast<double>(B * H * L);
  const double causal_macs = static_cast<double>(T) * static_cast<double>(T + 1) / 2 * static_cast<double>(D);
  struct Row {
    const char* pass;
    Stats s;
    int products;
  };
  std::printf("attention %s, B %lld T %lld heads %lld x %lld, %lld layers, %d rounds; GEMM peak %.0f GFLOP/s (%s)\n",
              dtype.c_str(), static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(H),
              static_cast<long long>(D), static_cast<long long>(L), rounds, peak / 1e9, bf16 ? "bf16" : "fp32");
  for (const Row& row : {Row{"forward", stats(forward_ms), 2}, Row{"backward", stats(backward_ms), 5}}) {
    const double tiles = heads * tile_products_per_head(T, D, row.products);
    const double causal = heads * 2.0 * row.products * causal_macs;
    const double floor_ms = tiles / peak * 1e3;
    std::printf(
        "  %-8s min %8.1f ms  median %8.1f ms | tile products %6.2f GFLOP (causal %6.2f) at %5.0f GFLOP/s on min: "
        "%3.0f%% of the peak; at the peak they take %.1f ms\n",
        row.pass, row.s.min_ms, row.s.median_ms, tiles / 1e9, causal / 1e9, tiles / (row.s.min_ms * 1e-3) / 1e9,
        100.0 * floor_ms / row.s.min_ms, floor_ms);
  }
  const Stats f = stats(forward_ms), b = stats(backward_ms), s = stats(step_ms);
  std::printf(
      "{\"system\": \"tally\", \"forward_min_ms\": %.2f, \"forward_median_ms\": %.2f, \"backward_min_ms\": %.2f, "
      "\"backward_median_ms\": %.2f, \"step_min_ms\": %.2f, \"step_median_ms\": %.2f, \"ledger_peak_growth_bytes\": %lld, \"peak_growth_bytes\": %lld, "
      "\"gemm_peak_gflops\": %.0f, \"batch\": %lld, \"seq\": %lld, \"heads\": %lld, \"head_dim\": %lld, "
      "\"layers\": %lld, \"dtype\": \"%s\"}\n",
      f.min_ms, f.median_ms, b.min_ms, b.median_ms, s.min_ms, s.median_ms, static_cast<long long>(ledger_growth),
      static_cast<long long>(rss_growth), peak / 1e9, static_cast<long long>(B), static_cast<long long>(T),
      static_cast<long long>(H), static_cast<long long>(D), static_cast<long long>(L), dtype.c_str());
  return 0;
}
