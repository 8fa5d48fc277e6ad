// Tensor (and sequence) parallelism over a process group: the collectives of
// nn/tensor_parallel.h as autograd functions, Megatron-LM's mappings
// (tensor_parallel/mappings.py) and its vocabulary-parallel embedding and cross-entropy.
//
// Sequence-parallel tensors are (B, T/tp, C) slices of (B, T, C): rank r holds positions
// r*T/tp .. (r+1)*T/tp. The all-gather and reduce-scatter run on rank-major blocks, so
// each is one collective plus a transposing copy between (tp, B, T/tp, C) and (B, T, C).
#pragma once
#include "dist/communicator.h"
#include "dist/world.h"
#include "nn/transformer.h"
#include "nn/tensor_parallel.h"

namespace tally::dist {

class TensorParallel final : public nn::TensorParallelOps {
 public:
  // `group`: the tensor-parallel group (not owned; outlives this).
  TensorParallel(Communicator& group, bool sequence_parallel) : group_(group), sequence_parallel_(sequence_parallel) {}

  int size() const override { return group_.size(); }
  int rank() const override { return group_.rank(); }
  bool sequence_parallel() const override { return sequence_parallel_; }
  Tensor into_column_parallel(const Tensor& x) override;
  Tensor out_of_row_parallel(const Tensor& x) override;
  Tensor vocab_parallel_embedding(const Tensor& weight_shard, const Tensor& tokens, int64_t vocab_start) override;
  Tensor vocab_parallel_cross_entropy(const Tensor& logits_shard, const Tensor& targets, int64_t vocab_start,
                                      int64_t vocab_size) override;

  // Without a graph: (B, T/tp, C) -> (B, T, C) and (B, T, C) partial sums -> (B, T/tp, C).
  Tensor gather_sequence(const Tensor& x);
  Tensor reduce_scatter_sequence(const Tensor& x);
  // Without a graph: a summed copy of x over the group.
  Tensor all_reduced(const Tensor& x);
  Communicator& group() { return group_; }

 private:
  Communicator& group_;
  bool sequence_parallel_;
};

// Sums over the tensor-parallel group (one all-reduce, packed) the gradients that are partial
// on each rank: a weight shared by every head (Qwen3's q/k norms) saw only this rank's heads,
// and under sequence parallel every replicated parameter (norms, row-parallel biases, the
// position table) saw only this rank's slice of the sequence.
void sum_replicated_gradients(nn::Transformer& model, Communicator& tp_group, bool sequence_parallel);

// The gradient norm of the whole model from its shards: each rank's squares, replicated
// parameters counted on tensor-parallel rank 0 only and a tied head's copy not at all,
// experts' summed over the expert-parallel group, all summed over the tensor- and
// pipeline-parallel groups (data-parallel replicas hold the same reduced gradients and are
// not summed).
double model_parallel_gradient_norm(const nn::Transformer& model, const World& world);

}  // namespace tally::dist
