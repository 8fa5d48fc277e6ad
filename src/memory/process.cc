#include "memory/process.h"

#include <cstdlib>
#include <fstream>
#include <string>

namespace tally::memory {

int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  return 0;
}

void reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";  // 5: reset the peak resident set size
}

}  // namespace tally::memory
