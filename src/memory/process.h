// The process's memory as the operating system counts it, beside the ledger's own count:
// what the benchmarks and the trainer's step log print next to the ledger's peak (the
// difference is what no tally owner holds: libraries, thread stacks, oneDNN's buffers).
#pragma once
#include <cstdint>

namespace tally::memory {

// The process's resident-set high-water mark (VmHWM), or 0 where /proc does not say.
int64_t peak_rss_bytes();

// Resets that high-water mark to the current resident set (Linux 4.0 on), so the next
// peak_rss_bytes() is the peak of what runs in between.
void reset_peak_rss();

}  // namespace tally::memory
