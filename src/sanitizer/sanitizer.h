// tally's memory sanitizer: the observation half of the memory contract
// (docs/memory-contract.md). It sits above everything it observes: it reads each
// device's ledger and the graph census, and watches the backward engine through the
// observer interface the engine exposes.
//
//   S1  Boundaries. A microbatch ends when its backward has run: nothing graph-carrying
//       born in it may still be alive (activations, saved tensors, the gradient of any
//       leaf that is not a registered parameter); plain detached values (a loss kept for
//       logging, R4) may live to the end of the step. A step ends with no non-persistent
//       allocation born in it (or between it and the previous step) still alive.
//   S2  Live-graph census: no autograd node of a microbatch survives its end, none of a
//       step survives the step, none made between steps survives to the next. Each
//       survivor is named with the reference cycle that keeps it alive, or the tensors
//       that hold it.
//   S3  Cycle check when a backward begins (autograd::find_cycles).
//   S4  Storage holders: who still refers to a storage.
//
// Microbatches carry explicit ids: begin_microbatch(id) starts or resumes one (and sets
// the clock, so what is allocated and recorded is tagged with it); end_microbatch(id)
// declares that its backward has run. Any number may be in flight at once: a pipeline's
// F0 F1 B0 B1, or N forwards whose summed loss has one backward, end each id after its
// backward and pass; a graph kept after its own backward still fails.
//
// Modes: Off (no checks, the clock is still set), Warn (print and record), Strict (throw
// tally::Error).
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "autograd/node.h"
#include "autograd/observer.h"
#include "core/device.h"
#include "memory/ledger.h"

namespace tally {
class Storage;
}

namespace tally::sanitizer {

enum class SanitizeMode { Off, Warn, Strict };
SanitizeMode parse_sanitize_mode(const std::string& text);  // "off" | "warn" | "strict"

enum class IssueKind { Growth, LiveGraph, Cycle };
const char* issue_kind_name(IssueKind k);

struct Issue {
  IssueKind kind;
  std::string message;
};

struct Boundary {
  int64_t step = -1;
  int64_t microbatch = -1;  // -1 for a step boundary
  int64_t live_non_persistent = 0;
  int64_t allocated = 0;
  int64_t peak_allocated = 0;  // peak since the step began
  size_t live_nodes = 0;       // nodes of this step (microbatch) still alive
  size_t live_saved = 0;       // their saved tensors
};

class Sanitizer : private autograd::EngineObserver {
 public:
  explicit Sanitizer(SanitizeMode mode, std::vector<Device> devices = {Device::cpu()});
  ~Sanitizer() override;
  Sanitizer(const Sanitizer&) = delete;
  Sanitizer& operator=(const Sanitizer&) = delete;

  SanitizeMode mode() const { return mode_; }

  // Warm-up is explicit: allocations that survive the first `steps` steps (caches filled
  // lazily) become the baseline instead of growth. Default 0.
  void set_warmup_steps(int64_t steps) { warmup_steps_ = steps; }

  // Step boundaries. begin_step resets peak statistics so each step's peak is its own.
  void begin_step(int64_t step);
  void end_step();
  // The run is over: a graph recorded after the last step (an evaluation with gradients on)
  // must be gone too, as it must be by the next step's start.
  void end_run();
  // Starts or resumes microbatch `id` of the current step; it stays in flight until
  // end_microbatch(id).
  void begin_microbatch(int64_t id);
  // Microbatch `id`'s backward has run: checks what it left behind.
  void end_microbatch(int64_t id);
  void end_microbatch();  // the current one

  const std::vector<Issue>& issues() const { return issues_; }
  // Every boundary's record, in order, while keep_boundaries is on (the default): one per
  // microbatch and step, so a long run with many microbatches a step turns it off.
  const std::vector<Boundary>& boundaries() const { return boundaries_; }
  void keep_boundaries(bool keep) { keep_boundaries_ = keep; }
  const std::set<int64_t>& in_flight() const { return in_flight_; }
  // Replaces the default printer (stderr) used in Warn mode.
  void set_printer(std::function<void(const Issue&)> printer) { printer_ = std::move(printer); }

  void report(IssueKind kind, const std::string& message);

 private:
  void check_hooks(const std::string& where, bool warming_up);
  void backward_begins(const std::vector<Tensor>& roots) override;  // S3

  bool active() const { return mode_ != SanitizeMode::Off; }
  bool born_here(const memory::LiveAllocation& a, const Device& d) const;
  // Whether `a` was born in the current step, or between the previous step and it.
  bool born_this_step(const memory::LiveAllocation& a) const;
  Boundary measure(int64_t microbatch) const;
  std::vector<autograd::NodeInfo> surviving_nodes(int64_t step, std::optional<int64_t> microbatch) const;
  void report_nodes(const std::vector<autograd::NodeInfo>& nodes, const std::string& where, const char* why);
  void report_allocations(const std::vector<memory::LiveAllocation>& grown, const std::string& where,
                          const std::string& why);

  SanitizeMode mode_;
  std::vector<Device> devices_;
  std::vector<uint64_t> first_id_;  // per device: allocations with an id above it were born after we started
  uint64_t first_node_ = 0;         // nodes with a sequence number at or above it likewise
  int64_t step_ = -1;
  int64_t previous_step_ = -1;
  int64_t current_microbatch_ = -1;
  int64_t steps_ended_ = 0;
  int64_t warmup_steps_ = 0;
  std::set<int64_t> in_flight_;
  int64_t baseline_live_ = 0;
  int64_t baseline_persistent_ = -1;  // live persistent bytes at the last step's end (-1: none ended)
  int64_t baseline_hooks_ = -1;  // gradient hooks alive at the previous step's end (-1: none ended yet)
  std::vector<Issue> issues_;
  std::vector<Boundary> boundaries_;
  bool keep_boundaries_ = true;
  std::function<void(const Issue&)> printer_;
  std::optional<autograd::ObserverRegistration> registration_;
  Clock::Reading previous_clock_;
};

// S4: one line per tensor that still views `storage`: its name, shape, autograd role.
std::vector<std::string> storage_holders(const Storage& storage);

// A table of live allocations (largest first) for reports: owner, category, size, birth,
// holders, and the reference cycle keeping a holder alive when there is one.
std::string describe_allocations(const std::vector<memory::LiveAllocation>& allocations, size_t max_rows = 20);

}  // namespace tally::sanitizer
