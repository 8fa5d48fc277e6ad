// The collectives a tensor-parallel model runs inside its forward, as seen from the model
// (nn/): an interface the model calls and dist/tensor_parallel.h implements over the
// tensor-parallel group, so the model layer never depends on the communicators.
//
// Megatron-LM's scheme: a column-parallel linear (qkv, MLP up and gate) holds a block of
// the output features, a row-parallel one (attention and MLP output projections) the
// matching block of the input features, so the pair needs one reduction on the way out
// and one on the gradient's way back in:
//                      forward                      backward
//   into a column      identity     (f)            all-reduce
//   out of a row       all-reduce   (g)            identity
// With sequence parallelism the regions between (norms, residual adds) hold a slice of
// the sequence instead of all of it, and the pair becomes
//   into a column      all-gather along T          reduce-scatter along T
//   out of a row       reduce-scatter along T      all-gather along T
// which moves the same bytes as the all-reduce (an all-reduce is a reduce-scatter and an
// all-gather) while the norms and residual stream hold 1/tp of the activations.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace tally::nn {

class TensorParallelOps {
 public:
  virtual ~TensorParallelOps() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  virtual bool sequence_parallel() const = 0;
  // x (B, T', C): the region's input on every rank, (B, T, C) out.
  virtual Tensor into_column_parallel(const Tensor& x) = 0;
  // x (B, T, C): this rank's partial sum, (B, T', C) out (T' = T / size under sequence
  // parallelism, else T).
  virtual Tensor out_of_row_parallel(const Tensor& x) = 0;
  // This rank's partial token embedding: rows of `weight_shard` (vocabulary ids
  // vocab_start .. vocab_start + rows) for the tokens in that range, zeros elsewhere;
  // out_of_row_parallel sums the ranks' partials.
  virtual Tensor vocab_parallel_embedding(const Tensor& weight_shard, const Tensor& tokens, int64_t vocab_start) = 0;
  // Mean cross-entropy of logits split by vocabulary (N, V/size per rank, this rank's
  // columns starting at vocab_start) against targets (N), over the first `vocab_size`
  // columns of the whole vocabulary; the full (N, V) logits are never gathered. The same
  // scalar on every rank.
  virtual Tensor vocab_parallel_cross_entropy(const Tensor& logits_shard, const Tensor& targets, int64_t vocab_start,
                                              int64_t vocab_size) = 0;
};

}  // namespace tally::nn
