#include "nn/context_parallel.h"

#include <algorithm>

#include "core/error.h"

namespace tally::nn {

std::vector<PositionRun> context_parallel_runs(int size, int rank, int64_t local_length, int64_t begin, int64_t length) {
  TALLY_CHECK(size >= 1 && rank >= 0 && rank < size && local_length % 2 == 0 && begin >= 0 &&
                  begin + length <= local_length,
              "internal: context-parallel positions ", begin, "..", begin + length, " of rank ", rank, " of ", size,
              " holding ", local_length);
  const int64_t chunk = local_length / 2;
  const int64_t starts[2] = {rank * chunk, (2 * int64_t{size} - 1 - rank) * chunk};  // chunks r and 2C-1-r
  std::vector<PositionRun> runs;
  for (int half = 0; half < 2; ++half) {
    const int64_t lo = std::max(begin, half * chunk), hi = std::min(begin + length, (half + 1) * chunk);
    if (lo < hi) runs.push_back({lo, starts[half] + lo - half * chunk, hi - lo});
  }
  return runs;
}

}  // namespace tally::nn
