// The machine's memory bandwidth, measured beside the GEMM peak in every benchmark run: a
// STREAM triad, a[i] = b[i] + s c[i], over three arrays far larger than any cache, on the
// run's OpenMP threads. Half of a training step is memory-bound (AdamW streams 28 bytes a
// parameter, every elementwise pass reads and writes its activations), so a table whose
// GEMM peak is steady but whose memory is slow or erratic says less than it seems: on a
// shared VM whose host was short of memory the same 256 MiB pass took 0.03 to 10 GB/s
// from one repetition to the next, and a W1 step took 35 s instead of 0.8.
//
// Bytes counted as STREAM counts them: two reads and one write a value (the write's
// read-for-ownership is not counted). Prints one JSON line: the best, median and worst
// repetition, so a run can tell a slow machine (all low) from an erratic one (the median
// far below the best).
//   bench_memory [repetitions=20] [--mib N (per array, default 256)]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  int reps = 20;
  long long mib = 256;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mib") {
      if (i + 1 >= argc) std::fprintf(stderr, "bench_memory: --mib needs a value\n"), std::exit(2);
      mib = std::atoll(argv[++i]);
    } else if (a.rfind("--", 0) == 0) {
      std::fprintf(stderr, "bench_memory: unknown flag %s (expected --mib N)\n", a.c_str()), std::exit(2);
    } else {
      reps = std::atoi(a.c_str());
    }
  }
  if (reps < 1 || mib < 1 || mib > (1 << 16))
    std::fprintf(stderr, "bench_memory: repetitions must be positive and --mib in 1..65536\n"), std::exit(2);
  const long long n = mib * (1LL << 20) / static_cast<long long>(sizeof(float));
  // Uninitialized storage, first touched below by the threads that stream it (each thread's
  // pages then sit where it runs, as the kernels' first touch places theirs).
  std::unique_ptr<float[]> a(new float[n]), b(new float[n]), c(new float[n]);
  float* pa = a.get();
  float* pb = b.get();
  float* pc = c.get();
#pragma omp parallel for simd schedule(static)
  for (long long i = 0; i < n; ++i) pa[i] = 0.f, pb[i] = 1.f, pc[i] = 2.f;
  const float s = 3.f;
  std::vector<double> gbps;
  for (int r = 0; r < reps + 1; ++r) {  // one warm-up repetition
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for simd schedule(static)
    for (long long i = 0; i < n; ++i) pa[i] = pb[i] + s * pc[i];
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) gbps.push_back(3.0 * sizeof(float) * static_cast<double>(n) / seconds / 1e9);
  }
  double check = 0;  // every value is 1 + 3 * 2 = 7: a wrong kernel would show here
  for (long long i = 0; i < n; i += 4096) check += pa[i] == 7.f ? 0 : 1;
  if (check != 0) std::fprintf(stderr, "bench_memory: the triad computed wrong values\n"), std::exit(1);
  std::sort(gbps.begin(), gbps.end());
  std::printf("{\"system\": \"memory\", \"kernel\": \"triad\", \"mib_per_array\": %lld, \"threads\": %d, "
              "\"repetitions\": %d, \"best_gbps\": %.2f, \"median_gbps\": %.2f, \"worst_gbps\": %.2f}\n",
              mib, omp_get_max_threads(), reps, gbps.back(), gbps[gbps.size() / 2], gbps.front());
  return 0;
}
