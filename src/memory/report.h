// Human-readable views of the ledger: byte counts, symbolized stacks, and the memory
// history as a Perfetto/Chrome trace or a self-contained HTML report.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "memory/ledger.h"

namespace tally::memory {

std::string format_bytes(int64_t bytes);

// Human-readable symbol for a return address (function name when available).
std::string symbolize(void* address);

// The memory plan's parts (train/plan.h), carried into traces and reports as name -> bytes.
using PlanParts = std::vector<std::pair<std::string, int64_t>>;

// Writes `events` as a Chrome/Perfetto trace: one counter track per category
// ("ph":"C") plus an instant event per allocation larger than `instant_min_bytes`, and a
// "tally_memory" section holding every event and the plan, which `read_memory_trace`
// reads back (for `tally memory report` and `tally memory diff`).
void write_chrome_trace(const std::string& path, const std::vector<MemoryEvent>& events,
                        int64_t instant_min_bytes = 1 << 20, const PlanParts& plan = {});

struct MemoryTrace {
  std::vector<MemoryEvent> events;
  PlanParts plan;
};
MemoryTrace read_memory_trace(const std::string& path);

// Writes `events` as a self-contained HTML page (inline SVG, no scripts, no network):
// stacked areas of live bytes by category and by owner (the 8 largest at the peak, the
// rest as "other") over time with step bands, the peak by category beside the plan's
// parts, and who holds the peak (owner, category, birth step and microbatch).
void write_html_report(const std::string& path, const std::vector<MemoryEvent>& events, const PlanParts& plan = {});

// Which owners held different bytes in trace B than in A: most held in each, the change,
// and the first step in which they differ; largest change first.
std::string diff_memory_traces(const MemoryTrace& a, const MemoryTrace& b);

}  // namespace tally::memory
