// Context parallelism as seen from the model (nn/): each of the C ranks of a
// context-parallel group holds T / C tokens of every sequence, and attention gathers the
// keys and values of the whole sequence from the group. An interface the model calls and
// dist/context_parallel.h implements over the group, as nn/tensor_parallel.h is for tensor
// parallelism.
//
// The split balances causal attention's work: the sequence is cut into 2C chunks of
// T / 2C tokens and rank r holds chunks r and 2C-1-r, so every rank's queries see the
// same number of keys in all (a query at position p sees p + 1 of them). Its local
// sequence is those two chunks, in that order. Positions (rotary angles, GPT-2's position
// table), the causal mask and the loss's targets follow the split.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace tally::nn {

// A run of a rank's local positions that are consecutive in the whole sequence: local
// positions local .. local+length-1 are global positions global .. global+length-1.
struct PositionRun {
  int64_t local = 0, global = 0, length = 0;
};

// The runs of local positions begin .. begin+length-1 of rank `rank` of `size`, whose local
// sequence holds `local_length` tokens (two chunks of local_length / 2).
std::vector<PositionRun> context_parallel_runs(int size, int rank, int64_t local_length, int64_t begin, int64_t length);

class ContextParallelOps {
 public:
  virtual ~ContextParallelOps() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // x (B, T/C, ...): this rank's tokens of every sequence; returns (B, T, ...), the whole
  // sequences in order. Its gradient is summed over the group and each rank keeps its own
  // tokens' part (a reduce-scatter).
  virtual Tensor gather_sequence(const Tensor& x) = 0;
};

}  // namespace tally::nn
