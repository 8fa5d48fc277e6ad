// Per-kernel timers: where a training step's time goes (`tally train --profile-ops`,
// `bench_w1 --profile`).
//
// Every backend kernel entry opens a KernelScope; while the profiler is on for the
// calling thread, the scope adds its wall time (and, for GEMMs, its FLOPs) to the row of
// (phase, kernel). A PhaseScope names what the caller is doing (forward, backward,
// optimizer) and times the phase as a whole, so the report can say how much of it no
// kernel accounts for: allocation, graph building, dispatch: the framework's own cost.
//
// Off, a scope costs a call (for the thread's state) and a branch. Only the outermost scope on a
// thread counts, so a kernel that calls another is not counted twice. Timers are per
// thread: kernels that a communicator's worker thread runs are not in the table of the
// thread that turned the profiler on.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "core/owner.h"

namespace tally::runtime::profiler {

// Turns timing on or off for the calling thread (and clears its table when turning on).
void enable(bool on);
bool enabled();

struct KernelRow {
  const char* phase = "";   // the enclosing PhaseScope's name ("other" outside one)
  const char* kernel = "";  // the backend entry ("gemm", "layernorm_backward", ...)
  double ms = 0;
  int64_t calls = 0;
  double flops = 0;  // GEMMs: 2mnk summed over calls; 0 for the others
};
struct PhaseRow {
  const char* phase = "";
  double ms = 0;         // wall time inside the phase's scopes
  double kernel_ms = 0;  // of which in kernels
};
struct Report {
  std::vector<PhaseRow> phases;    // in the order first seen
  std::vector<KernelRow> kernels;  // by phase (in that order), then by time, largest first
};
// The calling thread's table since the last take() (or enable), which it then clears.
Report take();

// One line per phase: "forward 452.1 ms: gemm 301.2 (142 GFLOP/s), attention_forward 40.3,
// ... + untimed 12.0". `top` kernels per phase are named; the rest are summed as "other".
std::string format(const Report& report, int top = 6);

namespace detail {
// The calling thread's profiler state. Reached through a function, not an extern
// thread_local variable: UBSan (GCC 12) reports the TLS wrapper of an extern thread_local
// as a null load, and the call costs nanoseconds beside a kernel.
struct ThreadState {
  bool on = false;
  int depth = 0;                // open kernel scopes (only the outermost counts)
  const char* phase = "other";  // the innermost PhaseScope's name
};
ThreadState& thread_state();
void add_kernel(const char* kernel, std::chrono::steady_clock::time_point start, double flops);
void add_phase(const char* phase, std::chrono::steady_clock::time_point start, const char* outer);
}  // namespace detail

class KernelScope {
 public:
  explicit KernelScope(const char* kernel, double flops = 0) {
    detail::ThreadState& st = detail::thread_state();
    if (!st.on) return;
    state_ = &st;
    if (st.depth++ > 0) return;
    kernel_ = kernel;
    flops_ = flops;
    start_ = std::chrono::steady_clock::now();
  }
  ~KernelScope() {
    if (!state_) return;
    --state_->depth;
    if (kernel_ && state_->on) detail::add_kernel(kernel_, start_, flops_);
  }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;

 private:
  detail::ThreadState* state_ = nullptr;  // set when the profiler was on at the start
  const char* kernel_ = nullptr;          // set when this is the outermost scope
  double flops_ = 0;
  std::chrono::steady_clock::time_point start_;
};

// Names the phase kernels run in until the scope ends (then the enclosing one again),
// for the profiler and the ledger (a PhaseMark). `phase` must outlive the report: a
// string literal.
class PhaseScope {
 public:
  explicit PhaseScope(const char* phase) : mark_(phase), state_(detail::thread_state()), outer_(state_.phase) {
    state_.phase = phase;
    if (state_.on) start_ = std::chrono::steady_clock::now(), timed_ = true;
  }
  ~PhaseScope() {
    if (timed_ && state_.on) detail::add_phase(state_.phase, start_, outer_);
    state_.phase = outer_;
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  PhaseMark mark_;  // the ledger's name for the phase (core/owner.h)
  detail::ThreadState& state_;
  const char* outer_;
  bool timed_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace tally::runtime::profiler
