// Context parallelism over a process group: the all-gather of keys and values that
// nn/context_parallel.h asks for, as an autograd function, and the split of a batch's
// tokens into each rank's local sequences.
//
// The choice, all-gather rather than ring attention: every rank gathers the whole
// sequences' keys and values (2 x T x kv_heads x D per layer) and attends its local
// queries over them; backward reduce-scatters their gradient. With grouped-query attention
// (LLaMA-3's 8 kv heads for 32 query heads, Qwen's 2-8) the gathered keys and values are a
// quarter or less of the activations a ring would pass round as many times, in one
// collective instead of C - 1 exchanges; the price is that each layer keeps the gathered
// keys and values for backward (T/C of the queries', T of the keys'). LLaMA-3's own
// training used this form (Dubey et al. 2024, section 3.3.2).
#pragma once
#include "dist/communicator.h"
#include "nn/context_parallel.h"

namespace tally::dist {

class ContextParallel final : public nn::ContextParallelOps {
 public:
  // `group`: the context-parallel group (not owned; outlives this).
  explicit ContextParallel(Communicator& group) : group_(group) {}

  int size() const override { return group_.size(); }
  int rank() const override { return group_.rank(); }
  Tensor gather_sequence(const Tensor& x) override;

  // Without a graph: (B, T/C, ...) local parts -> (B, T, ...) whole, and the conjugate:
  // the whole gradient summed over the group, this rank's tokens of it.
  Tensor gathered(const Tensor& x);
  Tensor reduce_scattered(const Tensor& x);

  // This rank's local sequences of tokens (B, T) -> (B, T/C): chunks r and 2C-1-r of 2C.
  // The error names --cp and --seq-len when T does not split so.
  Tensor local_tokens(const Tensor& tokens) const;

 private:
  Communicator& group_;
};

}  // namespace tally::dist
