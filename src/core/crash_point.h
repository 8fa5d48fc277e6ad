// Crash points for testing durability: named places where a process can die (a kill, a
// power cut) in the middle of writing its outputs. With TALLY_CRASH_POINT=<name>:<step> in
// the environment, the process ends at once, with no cleanup, when it reaches that point of
// that step, as if SIGKILLed there (exit status 137). Tests use it to hit windows of a few
// microseconds that random kills almost never land in. Unset, a crash point costs one
// cached getenv.
#pragma once
#include <cstdint>

namespace tally {

void crash_point(const char* name, int64_t step);

}  // namespace tally
