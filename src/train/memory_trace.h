// --mem-trace: the run's memory history (every allocation and free, with its owner)
// written as a Perfetto/Chrome trace (.json) or an HTML report (.html), at the end of the
// run, or where it fails (out of memory, a loss gone non-finite, the sanitizer's strict
// mode), which is when it is wanted most. Rank 0 writes the path; rank R writes
// trace_path_of(path, R).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "dist/world.h"

namespace tally::train {

// Rank R's file beside rank 0's: ".rankR" before the extension, so that another rank's
// report still ends in .html (run.rank1.html opens as a page).
std::string trace_path_of(const std::string& path, int rank);

class MemoryTrace {
 public:
  // Starts recording the ledger of `device` when `path` is not empty.
  MemoryTrace(const std::string& path, Device device, const dist::World& world);
  // A run that leaves by an exception writes what it recorded up to then; a failure to
  // write it is said on stderr, and the run's own error is the one that propagates.
  ~MemoryTrace();
  MemoryTrace(const MemoryTrace&) = delete;
  MemoryTrace& operator=(const MemoryTrace&) = delete;

  // The plan's parts, drawn beside the measured curve.
  void set_plan(std::vector<std::pair<std::string, int64_t>> parts) { plan_ = std::move(parts); }
  // Writes the trace now (the end of a run) and says where, unless `quiet`.
  void write_at_end(bool quiet);

 private:
  void write();

  std::string path_;  // this rank's ("" when not tracing)
  Device device_;
  const dist::World& world_;
  bool html_ = false;
  bool written_ = false;
  std::vector<std::pair<std::string, int64_t>> plan_;
  int exceptions_;
};

}  // namespace tally::train
