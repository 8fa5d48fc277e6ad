// Work W1 (bench/RESULTS.md): GPT-2 124M, batch 4, sequence 64, fp32, AdamW,
// one training step, timed over several steps after warm-up. Prints one JSON line.
// Another preset gives the same measurement on that model (L1: llama3-d6).
//   bench_w1 [steps=10] [threads=2] [model=gpt2]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "core/random.h"
#include "memory/report.h"
#include "runtime/backend.h"
#include "nn/transformer.h"
#include "runtime/backend.h"
#include "ops/ops.h"
#include "optim/adamw.h"

using namespace tally;

namespace {
int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}
}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 10;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  omp_set_num_threads(threads);
  const std::string preset = argc > 3 ? argv[3] : "gpt2";
  const int64_t B = 4, T = 64;
  nn::Transformer model(nn::TransformerConfig::preset(preset));
  model.init_weights(1);
  optim::AdamW opt(model.params(), optim::AdamWConfig{0.9, 0.999, 1e-8, 0.0, false});
  Rng rng(2);
  std::vector<int32_t> toks(B * T + 1);
  for (auto& t : toks) t = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(model.config().vocab_size));
  Tensor x = Tensor::from_vector(std::vector<int32_t>(toks.begin(), toks.end() - 1), {B, T});
  Tensor y = Tensor::from_vector(std::vector<int32_t>(toks.begin() + 1, toks.end()), {B, T});
  const double gemm_peak = runtime::backend(Device::cpu()).measured_gemm_peak_flops();

  auto& ledger = runtime::ledger();
  int64_t live_after_forward = 0;  // model states + saved activations, measured at the end of the first forward
  std::vector<double> ms;
  double loss_value = 0;
  using clock = std::chrono::steady_clock;
  auto since = [](clock::time_point t) { return std::chrono::duration<double, std::milli>(clock::now() - t).count(); };
  double phase[4] = {0, 0, 0, 0};  // forward, backward, norm + AdamW, zero_grad (summed over timed steps)
  for (int s = 0; s < steps + 2; ++s) {
    auto t0 = clock::now();
    Tensor loss = model.forward(x, y).loss;
    double t_fwd = since(t0);
    if (s == 0) live_after_forward = ledger.stats().allocated;
    loss.backward();
    loss_value = loss.item();
    double t_bwd = since(t0);
    double norm = ops::global_norm({model.params().flat_grads()});
    opt.step(1e-4, optim::clip_scale(norm, 1.0), /*zero_grad=*/true);
    double t_opt = since(t0);
    double dt = since(t0);
    if (s >= 2) {  // two warm-up steps (JIT, first-touch, cache fill)
      ms.push_back(dt);
      phase[0] += t_fwd, phase[1] += t_bwd - t_fwd, phase[2] += t_opt - t_bwd, phase[3] += dt - t_opt /* loss.item() etc. */;
    }
  }
  for (double& p : phase) p /= steps;
  std::fprintf(stderr, "phases (mean ms): forward %.0f, backward %.0f, grad norm + AdamW (zeroing grads) %.0f, other %.0f\n", phase[0],
               phase[1], phase[2], phase[3]);
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  const double flops = model.flops_per_token(T) * B * T;
  std::printf(
      "{\"system\": \"tally\", \"model\": \"%s\", \"ms_per_step\": %.1f, \"min_ms\": %.1f, \"tokens_per_s\": %.0f, \"gemm_peak_gflops\": %.0f, "
      "\"pct_gemm_peak\": %.1f, \"peak_rss_bytes\": %lld, \"peak_allocated_bytes\": %lld, \"reserved_bytes\": %lld, "
      "\"live_after_forward_bytes\": %lld, \"params\": %lld, \"loss\": %.4f, \"threads\": %d}\n",
      preset.c_str(), median, ms.front(), B * T / (median / 1e3), gemm_peak / 1e9, 100.0 * flops / (median / 1e3) / gemm_peak,
      static_cast<long long>(peak_rss_bytes()), static_cast<long long>(ledger.stats().peak_allocated),
      static_cast<long long>(ledger.stats().reserved), static_cast<long long>(live_after_forward),
      static_cast<long long>(model.num_parameters()), loss_value, threads);
  return 0;
}
