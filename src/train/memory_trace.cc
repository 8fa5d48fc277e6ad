#include "train/memory_trace.h"

#include <cstdio>
#include <exception>
#include <filesystem>

#include "io/files.h"
#include "memory/report.h"
#include "runtime/backend.h"

namespace tally::train {

namespace fs = std::filesystem;

std::string trace_path_of(const std::string& path, int rank) {
  if (rank == 0) return path;
  const fs::path p(path);
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(rank) + p.extension().string())).string();
}

MemoryTrace::MemoryTrace(const std::string& path, Device device, const dist::World& world)
    : path_(path.empty() ? "" : trace_path_of(path, world.rank())), device_(device), world_(world),
      html_(fs::path(path).extension() == ".html"), exceptions_(std::uncaught_exceptions()) {
  if (!path_.empty()) runtime::ledger(device_).enable_history(true, false);
}

MemoryTrace::~MemoryTrace() {
  if (path_.empty() || written_ || std::uncaught_exceptions() <= exceptions_) return;
  try {
    write();
    std::fprintf(stderr, "tally: the memory %s of the run up to its failure is in %s\n", html_ ? "report" : "trace",
                 path_.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tally: the failed run's memory trace could not be written: %s\n", e.what());
  }
}

void MemoryTrace::write() {
  written_ = true;
  io::create_directories_for("--mem-trace", path_, fs::path(path_).parent_path().string());
  const std::vector<memory::MemoryEvent> events = runtime::ledger(device_).take_history();
  if (html_) memory::write_html_report(path_, events, plan_);
  else memory::write_chrome_trace(path_, events, 1 << 20, plan_);
}

void MemoryTrace::write_at_end(bool quiet) {
  if (path_.empty()) return;
  write();
  if (quiet || !world_.is_root()) return;
  std::printf("memory %s written to %s%s\n", html_ ? "report" : "trace (open in ui.perfetto.dev or chrome://tracing)",
              path_.c_str(),
              world_.size() > 1 ? (", and each other rank's beside it, .rank<R> before the extension (" +
                                   trace_path_of(path_, 1) + ")").c_str()
                                : "");
  std::fflush(stdout);
}

}  // namespace tally::train
