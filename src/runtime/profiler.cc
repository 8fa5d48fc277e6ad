#include "runtime/profiler.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace tally::runtime::profiler {

detail::ThreadState& detail::thread_state() {
  thread_local ThreadState state;
  return state;
}

namespace {
// A step has a few dozen (phase, kernel) pairs: a linear search over pointers (names are
// literals) is cheaper than hashing strings.
thread_local std::vector<KernelRow> kernel_rows;
thread_local std::vector<PhaseRow> phase_rows;

PhaseRow& phase_row(const char* phase) {
  for (PhaseRow& r : phase_rows)
    if (r.phase == phase || std::strcmp(r.phase, phase) == 0) return r;
  phase_rows.push_back(PhaseRow{phase, 0, 0});
  return phase_rows.back();
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

void detail::add_kernel(const char* kernel, std::chrono::steady_clock::time_point start, double flops) {
  const double ms = ms_since(start);
  const char* phase = thread_state().phase;
  KernelRow* row = nullptr;
  for (KernelRow& r : kernel_rows)
    if (r.kernel == kernel && r.phase == phase) row = &r;
  if (!row) row = &kernel_rows.emplace_back(KernelRow{phase, kernel, 0, 0, 0});
  row->ms += ms;
  row->calls += 1;
  row->flops += flops;
  phase_row(phase).kernel_ms += ms;
}

void detail::add_phase(const char* phase, std::chrono::steady_clock::time_point start, const char* outer) {
  const double ms = ms_since(start);
  phase_row(phase).ms += ms;
  // Phases report exclusive time: a nested phase's time is taken out of the enclosing one
  // (which adds its whole span when it ends).
  if (std::strcmp(outer, "other") != 0) phase_row(outer).ms -= ms;
}

void enable(bool turn_on) {
  detail::ThreadState& st = detail::thread_state();
  st.on = turn_on;
  st.depth = 0;
  kernel_rows.clear();
  phase_rows.clear();
}

bool enabled() { return detail::thread_state().on; }

Report take() {
  Report report;
  // add_kernel made a row for every phase a kernel ran in, and summed its kernel time.
  report.phases = std::move(phase_rows);
  phase_rows.clear();
  for (PhaseRow& p : report.phases) p.ms = std::max(p.ms, p.kernel_ms);  // kernels outside a timed span of the phase
  auto phase_index = [&](const char* name) {
    for (size_t i = 0; i < report.phases.size(); ++i)
      if (std::strcmp(report.phases[i].phase, name) == 0) return i;
    return report.phases.size();
  };
  report.kernels = std::move(kernel_rows);
  kernel_rows.clear();
  std::stable_sort(report.kernels.begin(), report.kernels.end(), [&](const KernelRow& a, const KernelRow& b) {
    const size_t pa = phase_index(a.phase), pb = phase_index(b.phase);
    return pa != pb ? pa < pb : a.ms > b.ms;
  });
  return report;
}

std::string format(const Report& report, int top) {
  std::string out;
  char buf[160];
  for (const PhaseRow& p : report.phases) {
    // Kernels outside every named phase (a fill between steps) only when they add up.
    if (p.ms < 0.05 && std::strcmp(p.phase, "other") == 0) continue;
    std::snprintf(buf, sizeof buf, "%s %.1f ms:", p.phase, p.ms);
    out += buf;
    int shown = 0;
    double rest = 0;
    for (const KernelRow& k : report.kernels) {
      if (std::strcmp(k.phase, p.phase) != 0) continue;
      if (shown++ >= top) {
        rest += k.ms;
        continue;
      }
      if (k.flops > 0 && k.ms > 0)
        std::snprintf(buf, sizeof buf, " %s %.1f (%.0f GFLOP/s),", k.kernel, k.ms, k.flops / (k.ms * 1e-3) / 1e9);
      else
        std::snprintf(buf, sizeof buf, " %s %.1f,", k.kernel, k.ms);
      out += buf;
    }
    if (rest > 0) std::snprintf(buf, sizeof buf, " other kernels %.1f,", rest), out += buf;
    std::snprintf(buf, sizeof buf, " untimed %.1f\n", std::max(0.0, p.ms - p.kernel_ms));
    out += buf;
  }
  return out;
}

}  // namespace tally::runtime::profiler
