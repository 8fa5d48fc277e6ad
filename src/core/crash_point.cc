#include "core/crash_point.h"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace tally {

void crash_point(const char* name, int64_t step) {
  static const char* const wanted = std::getenv("TALLY_CRASH_POINT");
  if (wanted == nullptr) return;
  if (std::string(wanted) != std::string(name) + ":" + std::to_string(step)) return;
  std::fflush(stdout);
  std::_Exit(137);
}

}  // namespace tally
