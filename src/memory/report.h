// Human-readable views of the ledger: byte counts, symbolized stacks, and the memory
// history as a Perfetto/Chrome trace or a self-contained HTML report.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "memory/ledger.h"

namespace tally::memory {

std::string format_bytes(int64_t bytes);

// Human-readable symbol for a return address (function name when available).
std::string symbolize(void* address);

// Writes `events` as a Chrome/Perfetto trace: one counter track per category
// ("ph":"C") plus an instant event per allocation larger than `instant_min_bytes`.
void write_chrome_trace(const std::string& path, const std::vector<MemoryEvent>& events,
                        int64_t instant_min_bytes = 1 << 20);

// Writes `events` as a self-contained HTML page: a plot of live bytes per category over
// time (inline SVG, no scripts or network), the peak, and the largest allocations.
void write_html_report(const std::string& path, const std::vector<MemoryEvent>& events);

}  // namespace tally::memory
