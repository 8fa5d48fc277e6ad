// tally's memory sanitizer: the observation half of the memory contract.
//
//   S1  step and microbatch boundaries: live non-persistent bytes must not grow; growth
//       is reported with every surviving allocation's owner, size and birth.
//   S2  live-graph census: after backward, no node or saved tensor born in the step may
//       be alive; survivors are listed with op, module path, microbatch and holders.
//   S3  cycle check in the engine (autograd::find_cycles), enabled while a sanitizer is on.
//   S4  storage holders: who still refers to a storage.
//
// Modes: Off (no checks), Warn (print and record), Strict (throw tally::Error).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/device.h"
#include "memory/ledger.h"

namespace tally {
class Storage;
}

namespace tally::memory {

enum class SanitizeMode { Off, Warn, Strict };
SanitizeMode parse_sanitize_mode(const std::string& text);  // "off" | "warn" | "strict"

enum class IssueKind { Growth, LiveGraph, Cycle };
const char* issue_kind_name(IssueKind k);

struct Issue {
  IssueKind kind;
  std::string message;
};

// Routes an issue to the active sanitizer (no-op when none is active).
void report_issue(IssueKind kind, const std::string& message);

struct Boundary {
  int64_t step = -1;
  int64_t microbatch = -1;  // -1 for a step boundary
  int64_t live_non_persistent = 0;
  int64_t allocated = 0;
  int64_t peak_allocated = 0;  // peak since the step began (step boundaries)
  size_t live_nodes = 0;       // nodes born in this step still alive
  size_t live_saved = 0;       // saved tensors born in this step still alive
};

class Sanitizer {
 public:
  explicit Sanitizer(SanitizeMode mode, std::vector<Device> devices = {Device::cpu()});
  ~Sanitizer();
  Sanitizer(const Sanitizer&) = delete;
  Sanitizer& operator=(const Sanitizer&) = delete;

  SanitizeMode mode() const { return mode_; }

  // Boundaries. begin_step resets peak statistics so each step's peak is its own.
  void begin_step(int64_t step);
  void end_step();
  void begin_microbatch(int64_t microbatch);
  void end_microbatch();

  const std::vector<Issue>& issues() const { return issues_; }
  const std::vector<Boundary>& boundaries() const { return boundaries_; }
  // Replaces the default printer (stderr) used in Warn mode.
  void set_printer(std::function<void(const Issue&)> printer) { printer_ = std::move(printer); }

  void report(IssueKind kind, const std::string& message);

 private:
  void check_boundary(bool step_boundary);
  int64_t live_non_persistent() const;

  SanitizeMode mode_;
  std::vector<Device> devices_;
  int64_t step_ = -1;
  int64_t microbatch_ = -1;
  int64_t previous_live_ = 0;
  uint64_t previous_max_id_ = 0;
  uint64_t step_first_node_ = 0;        // census marks: nodes born since these
  uint64_t microbatch_first_node_ = 0;
  std::vector<Issue> issues_;
  std::vector<Boundary> boundaries_;
  std::function<void(const Issue&)> printer_;
  Sanitizer* previous_active_ = nullptr;
};

// S4: one line per tensor that still views `storage`: its name, shape, autograd role.
std::vector<std::string> storage_holders(const Storage& storage);

// A table of live allocations (largest first) for reports: owner, category, size, birth.
std::string describe_allocations(const std::vector<LiveAllocation>& allocations, size_t max_rows = 20);

}  // namespace tally::memory
